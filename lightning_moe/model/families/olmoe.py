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
from .base import ConfigView, Family, KeyMap, decoder_fields, refuse

NAME = "olmoe"


# ---------------------------------------------------------------------------------------------------
# Weights (host or device tensors; HF layout: [out_features, in_features])
# ---------------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    """Non-expert weights of one decoder layer (small: they stay on the compute device)."""

    attn_norm: torch.Tensor  # [D] input_layernorm
    wq: torch.Tensor  # [Hq*hd, D]
    wk: torch.Tensor  # [Hkv*hd, D]
    wv: torch.Tensor  # [Hkv*hd, D]
    q_norm: torch.Tensor  # [Hq*hd] self_attn.q_norm (over the whole q projection, not per head)
    k_norm: torch.Tensor  # [Hkv*hd] self_attn.k_norm
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] mlp.gate

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "LayerWeights":
        """Copy of every tensor on ``device`` (and ``dtype`` when given)."""
        return LayerWeights(**{k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.__dict__.items()})


KEYS = KeyMap(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    layer="model.layers.{layer}.",
    # Hub checkpoints, transformers' save_pretrained and its in-memory names all use mlp.
    moe_blocks=("mlp.",),
    moe_probe="gate.weight",
    layer_tensors={
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "wo": "self_attn.o_proj.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "router": "{moe}gate.weight",
    },
    # what the Hub and save_pretrained hold (transformers 5 splits its fused experts on save)
    expert_tensors={"w1": "{moe}experts.{expert}.gate_proj.weight", "w3": "{moe}experts.{expert}.up_proj.weight",
                    "w2": "{moe}experts.{expert}.down_proj.weight"},
    fused_gate_up="{moe}experts.gate_up_proj",  # [E, 2F, D]: gate rows first, then up (OlmoeExperts.chunk(2))
    fused_down="{moe}experts.down_proj",  # [E, D, F]
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
IMPLEMENTED_KEYS = frozenset({
    "model_type", "_name_or_path", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "num_experts", "num_local_experts",  # OlmoeConfig's name / its attribute_map alias
    "intermediate_size",  # the routed experts' width
    "norm_topk_prob",  # renormalize the top-k router weights (both values implemented)
    "clip_qkv",  # clamp of q, k, v (null or a positive number: both implemented)
    "hidden_act",  # silu only
    "rope_parameters", "rope_scaling",  # rope_type default, linear, yarn (transformers 5 / older names; base.read_rope)
    "rope_theta",  # older configs: top level; transformers 5: in rope_parameters
    "partial_rotary_factor",  # not a config class field (transformers moves a top-level one into rope_parameters): 1 only
    "original_max_position_embeddings",  # older top-level name (wins over rope_parameters' for yarn, as in transformers)
    "attention_bias",  # false only
    "head_dim",  # not an OlmoeConfig field, but transformers reads it when present: hidden / heads only
    "sliding_window",  # not an OlmoeConfig field; transformers' attention reads it when present: null only
    "quantization",  # this package's packed expert pages (model/quantized.py)
})
REFUSED_KEYS = frozenset({"quantization_config"})  # a transformers-quantized checkpoint (GPTQ, AWQ, FP8, ...)
HARMLESS_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache",
    "pad_token_id",  # the embedding's padding_idx: gradients and init only
    "attention_dropout",  # dropout: training only
    "output_router_logits", "router_aux_loss_coef",  # the auxiliary loss: training only
})
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none (transformers' OlmoeConfig.default_theta)


def _check_math_fields(get, hidden: int, heads: int) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    act = get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise refuse("hidden_act", act, NAME, ", ".join(repr(a) for a in HIDDEN_ACTS))
    if get("attention_bias", False):
        raise refuse("attention_bias", get("attention_bias"), NAME, "False (q/k/v/o projections without bias)")
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
    for key in REFUSED_KEYS:
        if get(key) is not None:
            raise refuse(key, get(key), NAME, "unquantized checkpoints and moe-batch quantize's packed pages")


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
def pre_attention(
    lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections, q/k RMSNorm over the whole projection, ``clip_qkv`` and RoPE for a packed batch.

    x: [T, D]; positions: int64 [T] (each token's position in its own sequence); ``rope``: the tables
    ``rope_cos_sin(spec, positions, inv_freq, x.dtype)`` when the caller computed them once for all layers (else None).
    Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in x's dtype.
    """
    T = x.shape[0]
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q = L.rms_norm(F_.linear(h, lw.wq), lw.q_norm, spec.rms_norm_eps)  # [T, Hq*hd] one norm over all heads
    k = L.rms_norm(F_.linear(h, lw.wk), lw.k_norm, spec.rms_norm_eps)  # [T, Hkv*hd]
    v = F_.linear(h, lw.wv)  # [T, Hkv*hd]
    if spec.clip_qkv is not None:  # after the norms, as transformers' OlmoeAttention
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q = q.view(T, spec.num_heads, spec.head_dim)  # [T, Hq, hd]
    k = k.view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    v = v.view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    cos, sin = rope if rope is not None else L.rope_cos_sin(spec, positions, inv_freq.to(x.device), x.dtype)  # [T, hd] each
    return L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin), v


post_attention = L.moe_post_attention  # o_proj + residual, RMSNorm, router, experts, residual


FAMILY = Family(
    name=NAME,
    model_types=("olmoe",),
    architectures=("OlmoeForCausalLM",),
    read_spec=read_spec,
    implemented_keys=IMPLEMENTED_KEYS,
    refused_keys=REFUSED_KEYS,
    harmless_keys=HARMLESS_KEYS,
    keys=KEYS,
    layer_weights=LayerWeights,
    dummy_layer=dummy_layer,
    pre_attention=pre_attention,
    post_attention=post_attention,
)
