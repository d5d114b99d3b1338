"""The Qwen3-MoE family (Qwen team 2025, arXiv 2505.09388): config reader, checkpoint key map, layer math.

Per decoder layer: RMSNorm -> q, k, v projections (no bias) -> per-head RMSNorm of q and of k over head_dim
(``q_norm``, ``k_norm``, before RoPE) -> RoPE (rotate-half; default, linear or yarn frequencies) -> GQA attention
(causal, full) -> o_proj -> residual -> RMSNorm -> softmax over all experts -> top-k, renormalized only with
``norm_topk_prob`` -> routed SwiGLU experts of width ``moe_intermediate_size`` -> residual; a dense (MLP-only) layer
(``mlp_only_layers``, or ``(i + 1) % decoder_sparse_step != 0``) has one SwiGLU MLP of width ``intermediate_size``
instead, resident with its other weights (nothing paged). ``head_dim`` comes from the config (Qwen3: Hq * hd != D).
No shared expert. Final RMSNorm and lm_head (tied to embed_tokens with ``tie_word_embeddings``). Refused by name:
attention biases, sliding windows, rope scaling other than linear and yarn, partial rotary, transformers-quantized
checkpoints. The oracle is transformers' ``modeling_qwen3_moe.py``; the shared pieces are in ``model/layers.py``
(dimension key there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import layers as L
from ..spec import MoESpec
from .base import (DECODER_KEYS, HARMLESS_COMMON_KEYS, HF_ATTENTION_TENSORS, HF_EXPERT_KEYS, HF_MODEL_KEYS,
                   QUANTIZED_REFUSED_KEYS, ConfigView, Family, KeyMap, check_act_and_refused, check_no_attention_bias,
                   decoder_fields, module_fields, refuse, QKVWeights)
from .qwen2_moe import qwen_moe_fields

NAME = "qwen3_moe"


@dataclass
class AttentionWeights(QKVWeights):
    """What every Qwen3-MoE layer (MoE or dense) holds: attn_norm, wq, wk, wv, the per-head q/k norms, o_proj and the
    post-attention norm."""

    q_norm: torch.Tensor  # [hd] self_attn.q_norm (one RMSNorm shared by every query head)
    k_norm: torch.Tensor  # [hd] self_attn.k_norm
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm


@dataclass
class LayerWeights(AttentionWeights):
    """Non-expert weights of one MoE decoder layer (small: they stay on the compute device)."""

    router: torch.Tensor  # [E, D] mlp.gate


@dataclass
class DenseLayerWeights(AttentionWeights):
    """Weights of one dense (MLP-only) decoder layer: attention as an MoE layer's, one SwiGLU MLP instead of experts."""

    w1: torch.Tensor  # [Fd, D] mlp.gate_proj
    w3: torch.Tensor  # [Fd, D] mlp.up_proj
    w2: torch.Tensor  # [D, Fd] mlp.down_proj


_ATTENTION_TENSORS = {**HF_ATTENTION_TENSORS, "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
KEYS = KeyMap(
    **HF_MODEL_KEYS,
    # Hub checkpoints, transformers' save_pretrained and its in-memory names all use mlp.
    moe_blocks=("mlp.",),
    moe_probe="gate.weight",
    layer_tensors={**_ATTENTION_TENSORS, "router": "{moe}gate.weight"},
    **HF_EXPERT_KEYS,
    dense_layer_tensors={**_ATTENTION_TENSORS, "w1": "mlp.gate_proj.weight", "w3": "mlp.up_proj.weight",
                         "w2": "mlp.down_proj.weight"},
)


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0):
    """Deterministic weights of layer ``layer`` for benchmarks: norms are ones, every matrix ``rnd(*shape)`` in field
    order (a :class:`DenseLayerWeights` for a dense layer)."""
    D, hd, Fd = spec.hidden_size, spec.head_dim, spec.dense_intermediate_size
    attn = (torch.ones(D, dtype=dtype), rnd(spec.q_size, D), rnd(spec.kv_size, D), rnd(spec.kv_size, D),
            torch.ones(hd, dtype=dtype), torch.ones(hd, dtype=dtype), rnd(D, spec.q_size), torch.ones(D, dtype=dtype))
    if spec.is_dense_layer(layer):
        return DenseLayerWeights(*attn, rnd(Fd, D), rnd(Fd, D), rnd(D, Fd))
    return LayerWeights(*attn, rnd(spec.num_experts, D))


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec
# ---------------------------------------------------------------------------------------------------
# transformers' Qwen3MoeConfig fields (and the Hub config.json names) by how they are handled; the test walks
# Qwen3MoeConfig's fields and fails on one that is in none of these sets.
IMPLEMENTED_KEYS = DECODER_KEYS | {
    "num_local_experts", "num_experts",  # transformers 5's config.json name / the Hub's (attribute_map aliases)
    "moe_intermediate_size",  # the routed experts' width
    "intermediate_size",  # width of the dense MLP of the dense (MLP-only) layers
    "norm_topk_prob",  # renormalize the top-k router weights (both values implemented)
    "hidden_act",  # silu only
    "attention_bias",  # false only
    "use_sliding_window",  # false only
    "sliding_window",  # unused unless use_sliding_window (transformers sets it to None then)
    "decoder_sparse_step", "mlp_only_layers",  # which layers are dense (transformers' Qwen3MoeDecoderLayer rule)
    "quantization",  # this package's packed expert pages (model/quantized.py)
}
REFUSED_KEYS = QUANTIZED_REFUSED_KEYS
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {
    "router_aux_loss_coef",  # the auxiliary loss: training only
    "max_window_layers",  # Hub configs: which layers a sliding window would skip; use_sliding_window is refused
}
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none (transformers' Qwen3MoeConfig.default_theta)


def _check_math_fields(get) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    check_act_and_refused(get, NAME, HIDDEN_ACTS, REFUSED_KEYS)
    check_no_attention_bias(get, NAME)
    if get("use_sliding_window", False):
        raise refuse("use_sliding_window", get("use_sliding_window"), NAME, "False (full causal attention)")


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a Qwen3-MoE config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope scaling type other than linear and yarn, ``partial_rotary_factor`` != 1,
            ``attention_bias``, ``use_sliding_window``, no experts, no MoE layer left by ``decoder_sparse_step`` /
            ``mlp_only_layers``, a transformers ``quantization_config``): the message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get = c.get
    num_layers = int(c.need("num_hidden_layers"))
    _check_math_fields(get)
    experts_key = "num_local_experts" if get("num_local_experts") is not None else "num_experts"
    moe = qwen_moe_fields(c, NAME, experts_key, num_layers)
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=32768, default_eps=1e-6), **moe)


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def pre_attention(lw, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                  rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections, per-head q/k RMSNorm and RoPE for a packed batch of tokens, MoE or dense layer
    (arguments: ``Family.pre_attention``). x: [T, D]. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]."""
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q, k, v = L.qkv_heads(h, spec, lw.wq, lw.wk, lw.wv)  # [T, Hq, hd], [T, Hkv, hd] x2
    q = L.rms_norm(q, lw.q_norm, spec.rms_norm_eps)  # [T, Hq, hd] each head over hd
    k = L.rms_norm(k, lw.k_norm, spec.rms_norm_eps)  # [T, Hkv, hd]
    q, k = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    return q, k, v


def post_attention(lw, ew, x: torch.Tensor, attn: torch.Tensor, spec: MoESpec, ffn=None) -> torch.Tensor:
    """o_proj + residual, RMSNorm, then router and routed experts (MoE layer) or the dense MLP (a
    :class:`DenseLayerWeights` layer: ``ew`` and ``ffn`` unused), residual. x: [T, D]; attn: [T, Hq*hd] -> [T, D]."""
    if isinstance(lw, DenseLayerWeights):
        return L.dense_post_attention(lw, x, attn, spec)
    return L.moe_post_attention(lw, ew, x, attn, spec, ffn)


FAMILY = Family(**module_fields(globals()), model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",))
