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
import torch.nn.functional as F_

from .. import layers as L
from ..spec import MoESpec
from .base import ConfigView, Family, KeyMap, decoder_fields, refuse
from .qwen2_moe import dense_layer_indices

NAME = "qwen3_moe"


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
    q_norm: torch.Tensor  # [hd] self_attn.q_norm (one RMSNorm shared by every query head)
    k_norm: torch.Tensor  # [hd] self_attn.k_norm
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] mlp.gate

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "LayerWeights":
        """Copy of every tensor on ``device`` (and ``dtype`` when given)."""
        return LayerWeights(**{k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.__dict__.items()})


@dataclass
class DenseLayerWeights:
    """Weights of one dense (MLP-only) decoder layer: attention as an MoE layer's, one SwiGLU MLP instead of experts."""

    attn_norm: torch.Tensor  # [D] input_layernorm
    wq: torch.Tensor  # [Hq*hd, D]
    wk: torch.Tensor  # [Hkv*hd, D]
    wv: torch.Tensor  # [Hkv*hd, D]
    q_norm: torch.Tensor  # [hd] self_attn.q_norm
    k_norm: torch.Tensor  # [hd] self_attn.k_norm
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    w1: torch.Tensor  # [Fd, D] mlp.gate_proj
    w3: torch.Tensor  # [Fd, D] mlp.up_proj
    w2: torch.Tensor  # [D, Fd] mlp.down_proj

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "DenseLayerWeights":
        """Copy of every tensor on ``device`` (and ``dtype`` when given)."""
        return DenseLayerWeights(**{k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.__dict__.items()})


_ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}
KEYS = KeyMap(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    layer="model.layers.{layer}.",
    # Hub checkpoints, transformers' save_pretrained and its in-memory names all use mlp.
    moe_blocks=("mlp.",),
    moe_probe="gate.weight",
    layer_tensors={**_ATTENTION_TENSORS, "router": "{moe}gate.weight"},
    expert_tensors={"w1": "{moe}experts.{expert}.gate_proj.weight", "w3": "{moe}experts.{expert}.up_proj.weight",
                    "w2": "{moe}experts.{expert}.down_proj.weight"},
    fused_gate_up="{moe}experts.gate_up_proj",  # [E, 2F, D]: gate rows first, then up (Qwen3MoeExperts.chunk(2))
    fused_down="{moe}experts.down_proj",
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
IMPLEMENTED_KEYS = frozenset({
    "model_type", "_name_or_path", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts_per_tok", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "num_local_experts", "num_experts",  # transformers 5's config.json name / the Hub's (attribute_map aliases)
    "moe_intermediate_size",  # the routed experts' width
    "intermediate_size",  # width of the dense MLP of the dense (MLP-only) layers
    "norm_topk_prob",  # renormalize the top-k router weights (both values implemented)
    "hidden_act",  # silu only
    "rope_parameters", "rope_scaling",  # rope_type default, linear, yarn (transformers 5 / older names; base.read_rope)
    "rope_theta",  # older configs: top level; transformers 5: in rope_parameters
    "partial_rotary_factor",  # not a config class field (transformers moves a top-level one into rope_parameters): 1 only
    "original_max_position_embeddings",  # older top-level name (wins over rope_parameters' for yarn, as in transformers)
    "attention_bias",  # false only
    "use_sliding_window",  # false only
    "sliding_window",  # unused unless use_sliding_window (transformers sets it to None then)
    "decoder_sparse_step", "mlp_only_layers",  # which layers are dense (transformers' Qwen3MoeDecoderLayer rule)
    "quantization",  # this package's packed expert pages (model/quantized.py)
})
REFUSED_KEYS = frozenset({"quantization_config"})  # a transformers-quantized checkpoint (GPTQ, AWQ, FP8, ...)
HARMLESS_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache", "pad_token_id",
    "attention_dropout",  # dropout: training only
    "output_router_logits", "router_aux_loss_coef",  # the auxiliary loss: training only
    "max_window_layers",  # Hub configs: which layers a sliding window would skip; use_sliding_window is refused
})
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none (transformers' Qwen3MoeConfig.default_theta)


def _check_math_fields(get) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    act = get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise refuse("hidden_act", act, NAME, ", ".join(repr(a) for a in HIDDEN_ACTS))
    if get("attention_bias", False):
        raise refuse("attention_bias", get("attention_bias"), NAME, "False (q/k/v/o projections without bias)")
    if get("use_sliding_window", False):
        raise refuse("use_sliding_window", get("use_sliding_window"), NAME, "False (full causal attention)")
    for key in REFUSED_KEYS:
        if get(key) is not None:
            raise refuse(key, get(key), NAME, "unquantized checkpoints and moe-batch quantize's packed pages")


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a Qwen3-MoE config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope scaling type other than linear and yarn, ``partial_rotary_factor`` != 1,
            ``attention_bias``, ``use_sliding_window``, no experts, no MoE layer left by ``decoder_sparse_step`` /
            ``mlp_only_layers``, a transformers ``quantization_config``): the message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get, need = c.get, c.need
    num_layers = int(need("num_hidden_layers"))
    _check_math_fields(get)
    experts_key = "num_local_experts" if get("num_local_experts") is not None else "num_experts"
    num_experts = int(need(experts_key))
    if num_experts < 1:  # transformers: every layer a dense MLP
        raise refuse(experts_key, num_experts, NAME, ">= 1 routed experts (a model of dense layers only is not an MoE)")
    dense = dense_layer_indices(get, num_layers, NAME)
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=32768, default_eps=1e-6),
        intermediate_size=int(need("moe_intermediate_size")),
        num_experts=num_experts,
        sliding_window=None,
        norm_topk_prob=bool(get("norm_topk_prob", False)),  # Qwen3MoeConfig's default
        dense_layers=dense,
        dense_intermediate_size=int(need("intermediate_size")) if dense else 0,
    )


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def pre_attention(
    lw, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections, per-head q/k RMSNorm and RoPE for a packed batch of tokens.

    x: [T, D]; positions: int64 [T] (each token's position in its own sequence); ``rope``: the tables
    ``rope_cos_sin(spec, positions, inv_freq, x.dtype)`` when the caller computed them once for all layers (else None).
    Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in x's dtype.
    """
    T = x.shape[0]
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q = F_.linear(h, lw.wq).view(T, spec.num_heads, spec.head_dim)  # [T, Hq, hd]
    k = F_.linear(h, lw.wk).view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    v = F_.linear(h, lw.wv).view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    q = L.rms_norm(q, lw.q_norm, spec.rms_norm_eps)  # [T, Hq, hd] each head over hd
    k = L.rms_norm(k, lw.k_norm, spec.rms_norm_eps)  # [T, Hkv, hd]
    cos, sin = rope if rope is not None else L.rope_cos_sin(spec, positions, inv_freq.to(x.device), x.dtype)  # [T, hd]
    return L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin), v


def post_attention(lw, ew, x: torch.Tensor, attn: torch.Tensor, spec: MoESpec, ffn=None) -> torch.Tensor:
    """o_proj + residual, RMSNorm, then router and routed experts (MoE layer) or the dense MLP (a
    :class:`DenseLayerWeights` layer: ``ew`` and ``ffn`` unused), residual. x: [T, D]; attn: [T, Hq*hd] -> [T, D]."""
    if isinstance(lw, DenseLayerWeights):
        return L.dense_post_attention(lw, x, attn, spec)
    return L.moe_post_attention(lw, ew, x, attn, spec, ffn)


FAMILY = Family(
    name=NAME,
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    read_spec=read_spec,
    implemented_keys=IMPLEMENTED_KEYS,
    refused_keys=REFUSED_KEYS,
    harmless_keys=HARMLESS_KEYS,
    keys=KEYS,
    layer_weights=LayerWeights,
    dummy_layer=dummy_layer,
    pre_attention=pre_attention,
    post_attention=post_attention,
    dense_layer_weights=DenseLayerWeights,
)
