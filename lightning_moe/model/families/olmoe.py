"""The OLMoE family (Muennighoff et al. 2024, arXiv 2409.02060): config reader, checkpoint key map, layer math.

Per decoder layer: RMSNorm -> q, k, v projections (no bias) -> RMSNorm of the WHOLE q projection (``q_norm`` of
width Hq*hd) and of the whole k projection (``k_norm``, Hkv*hd), before the reshape into heads -> with ``clip_qkv``,
q, k and v clamped to [-clip_qkv, clip_qkv] -> RoPE (rotate-half) -> GQA attention (causal,
full) -> o_proj -> residual -> RMSNorm -> softmax over all experts -> top-k, renormalized only with
``norm_topk_prob`` (OLMoE-1B-7B: false) -> routed SwiGLU experts of width ``intermediate_size`` -> residual. No
shared expert, no dense layers; head_dim is hidden_size / num_attention_heads (transformers sizes q_norm by
hidden_size). Final RMSNorm and lm_head (tied to embed_tokens with ``tie_word_embeddings``).
RoPE default, linear or yarn (``base.read_rope``). Refused by name: attention biases, other rope types, a ``head_dim``
other than hidden / heads, a sliding window, ``hidden_act`` other than silu, transformers-quantized checkpoints. The oracle is transformers'
``modeling_olmoe.py``; the shared pieces are in ``model/layers.py`` (dimension key there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F_

from .. import layers as L
from ..spec import MoESpec
from .base import (DECODER_KEYS, HARMLESS_COMMON_KEYS, HF_ATTENTION_TENSORS, HF_EXPERT_KEYS, HF_MODEL_KEYS,
                   QUANTIZED_REFUSED_KEYS, ConfigView, Family, KeyMap, check_act_and_refused, check_no_attention_bias,
                   decoder_fields, module_fields, refuse, QKVWeights)

NAME = "olmoe"


@dataclass
class LayerWeights(QKVWeights):
    """Non-expert weights of one OLMoE layer (resident on the compute device): QKVWeights' attn_norm,
    wq, wk, wv, then these."""

    q_norm: torch.Tensor  # [Hq*hd] self_attn.q_norm (over the whole q projection, not per head)
    k_norm: torch.Tensor  # [Hkv*hd] self_attn.k_norm
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] mlp.gate


KEYS = KeyMap(
    **HF_MODEL_KEYS,
    # Hub checkpoints, transformers' save_pretrained and its in-memory names all use mlp.
    moe_blocks=("mlp.",),
    moe_probe="gate.weight",
    layer_tensors={**HF_ATTENTION_TENSORS, "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
                   "router": "{moe}gate.weight"},
    # what the Hub and save_pretrained hold (transformers 5 splits its fused experts on save), or the fused layout
    **HF_EXPERT_KEYS,
)


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0) -> LayerWeights:
    """Deterministic layer weights for benchmarks: norms are ones, every matrix ``rnd(*shape)`` in field order (every
    OLMoE layer is MoE: ``layer`` changes nothing)."""
    D = spec.hidden_size
    return LayerWeights(
        torch.ones(D, dtype=dtype), rnd(spec.q_size, D), rnd(spec.kv_size, D), rnd(spec.kv_size, D),
        torch.ones(spec.q_size, dtype=dtype), torch.ones(spec.kv_size, dtype=dtype), rnd(D, spec.q_size),
        torch.ones(D, dtype=dtype), rnd(spec.num_experts, D),
    )


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec
# ---------------------------------------------------------------------------------------------------
# transformers' OlmoeConfig fields (and the Hub config.json names) by how they are handled; the test walks
# OlmoeConfig's fields and fails on one that is in none of these sets.
IMPLEMENTED_KEYS = DECODER_KEYS | {  # head_dim: not an OlmoeConfig field, read when present: hidden / heads only
    "num_experts", "num_local_experts",  # OlmoeConfig's name / its attribute_map alias
    "intermediate_size",  # the routed experts' width
    "norm_topk_prob",  # renormalize the top-k router weights (both values implemented)
    "clip_qkv",  # clamp of q, k, v (null or a positive number: both implemented)
    "hidden_act",  # silu only
    "attention_bias",  # false only
    "sliding_window",  # not an OlmoeConfig field; transformers' attention reads it when present: null only
    "quantization",  # this package's packed expert pages (model/quantized.py)
}
REFUSED_KEYS = QUANTIZED_REFUSED_KEYS
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {"router_aux_loss_coef"}  # the auxiliary loss: training only
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none (transformers' OlmoeConfig.default_theta)


def _check_math_fields(get, hidden: int, heads: int) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    check_act_and_refused(get, NAME, HIDDEN_ACTS, REFUSED_KEYS)
    check_no_attention_bias(get, NAME)
    if hidden % heads:  # q_norm has hidden_size weights and normalizes a projection of heads * (hidden // heads)
        raise refuse("num_attention_heads", heads, NAME, f"a divisor of hidden_size {hidden}")
    head_dim = get("head_dim")
    if head_dim is not None and int(head_dim) != hidden // heads:
        raise refuse("head_dim", head_dim, NAME, f"hidden_size / num_attention_heads = {hidden // heads}")
    if get("sliding_window") is not None:
        raise refuse("sliding_window", get("sliding_window"), NAME, "None (full causal attention)")
    clip = get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise refuse("clip_qkv", clip, NAME, "None or a positive number")


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of an OLMoE config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope type other than default, linear, yarn, ``attention_bias``, a ``head_dim`` other than hidden / heads, a
            ``sliding_window``, a ``clip_qkv`` that is not a positive number, no experts, a transformers
            ``quantization_config``): the message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get, need = c.get, c.need
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    _check_math_fields(get, hidden, heads)
    experts_key = "num_experts" if get("num_experts") is not None else "num_local_experts"
    num_experts = int(need(experts_key))
    if num_experts < 1:
        raise refuse(experts_key, num_experts, NAME, ">= 1 routed experts")
    clip = get("clip_qkv")
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=4096, default_eps=1e-5),
        intermediate_size=int(need("intermediate_size")),
        num_experts=num_experts,
        sliding_window=None,
        norm_topk_prob=bool(get("norm_topk_prob", False)),  # OlmoeConfig's default
        clip_qkv=None if clip is None else float(clip),
    )


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def pre_attention(lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                  rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections, q/k RMSNorm over the whole projection, ``clip_qkv`` and RoPE for a packed batch
    (arguments: ``Family.pre_attention``). x: [T, D]. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in x's
    dtype."""
    T = x.shape[0]
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q = L.rms_norm(F_.linear(h, lw.wq), lw.q_norm, spec.rms_norm_eps)  # [T, Hq*hd] one norm over all heads
    k = L.rms_norm(F_.linear(h, lw.wk), lw.k_norm, spec.rms_norm_eps)  # [T, Hkv*hd]
    v = F_.linear(h, lw.wv)  # [T, Hkv*hd]
    if spec.clip_qkv is not None:  # after the norms, as transformers' OlmoeAttention
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q = q.view(T, spec.num_heads, spec.head_dim)  # [T, Hq, hd]
    k, v = (t.view(T, spec.num_kv_heads, spec.head_dim) for t in (k, v))  # [T, Hkv, hd] each
    q, k = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    return q, k, v


post_attention = L.moe_post_attention  # o_proj + residual, RMSNorm, router, experts, residual


FAMILY = Family(**module_fields(globals()), model_types=("olmoe",), architectures=("OlmoeForCausalLM",))
