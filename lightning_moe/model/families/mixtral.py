"""The Mixtral family (Jiang et al. 2024, arXiv 2401.04088): config reader, checkpoint key map, layer math.

Per decoder layer: RMSNorm -> q, k, v projections (no bias) -> RoPE (rotate-half; default, linear or yarn
frequencies) -> GQA attention (causal, optional sliding window) -> o_proj -> residual -> RMSNorm -> softmax top-k
router over all experts, renormalized -> routed SwiGLU experts -> residual. No shared experts, no dense layers. Final
RMSNorm and lm_head. The oracle is transformers' ``modeling_mixtral.py``; the shared pieces are in ``model/layers.py``
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

NAME = "mixtral"


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
    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] block_sparse_moe.gate

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "LayerWeights":
        """Copy of every tensor on ``device`` (and ``dtype`` when given)."""
        return LayerWeights(**{k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.__dict__.items()})


KEYS = KeyMap(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    layer="model.layers.{layer}.",
    # Hub checkpoints and transformers' save_pretrained: block_sparse_moe; transformers-5 in-memory names: mlp
    moe_blocks=("block_sparse_moe.", "mlp."),
    moe_probe="gate.weight",
    layer_tensors={
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "router": "{moe}gate.weight",
    },
    expert_tensors={"w1": "{moe}experts.{expert}.w1.weight", "w3": "{moe}experts.{expert}.w3.weight",
                    "w2": "{moe}experts.{expert}.w2.weight"},
    fused_gate_up="{moe}experts.gate_up_proj",
    fused_down="{moe}experts.down_proj",
)


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0) -> LayerWeights:
    """Deterministic layer weights for benchmarks: norms are ones, every matrix ``rnd(*shape)`` in field order (every
    Mixtral layer is MoE: ``layer`` changes nothing)."""
    D = spec.hidden_size
    return LayerWeights(
        torch.ones(D, dtype=dtype), rnd(spec.q_size, D), rnd(spec.kv_size, D), rnd(spec.kv_size, D),
        rnd(D, spec.q_size), torch.ones(D, dtype=dtype), rnd(spec.num_experts, D),
    )


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec
# ---------------------------------------------------------------------------------------------------
# transformers' MixtralConfig fields (and the older config.json names) by how they are handled; the test walks
# MixtralConfig's fields and fails on one that is in none of these sets.
IMPLEMENTED_KEYS = frozenset({
    "model_type", "_name_or_path", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
    "rms_norm_eps", "max_position_embeddings", "sliding_window", "tie_word_embeddings", "bos_token_id",
    "eos_token_id",
    "hidden_act",  # silu only
    "rope_parameters", "rope_scaling",  # rope_type default, linear, yarn (transformers 5 / older names; base.read_rope)
    "rope_theta",  # older configs: top level; transformers 5: in rope_parameters
    "partial_rotary_factor",  # not a config class field (transformers moves a top-level one into rope_parameters): 1 only
    "original_max_position_embeddings",  # older top-level name (wins over rope_parameters' for yarn, as in transformers)
    "quantization",  # this package's packed expert pages (model/quantized.py)
})
REFUSED_KEYS = frozenset({"quantization_config"})  # a transformers-quantized checkpoint (GPTQ, AWQ, FP8, ...)
HARMLESS_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache", "pad_token_id",
    "attention_dropout",  # dropout: training only
    "output_router_logits", "router_aux_loss_coef",  # the auxiliary loss: training only
    "router_jitter_noise",  # applied in training only (MixtralSparseMoeBlock: ``if self.training``)
})
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e6  # RoPE base when the config names none (transformers' MixtralConfig.default_theta)


def _check_math_fields(get, hidden_acts: tuple[str, ...]) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    act = get("hidden_act", "silu")
    if act not in hidden_acts:
        raise refuse("hidden_act", act, NAME, ", ".join(repr(a) for a in hidden_acts))
    for key in REFUSED_KEYS:
        if get(key) is not None:
            raise refuse(key, get(key), NAME, "unquantized checkpoints and moe-batch quantize's packed pages")


def read_spec(cfg, name: Optional[str] = None, *, hidden_acts: tuple[str, ...] = HIDDEN_ACTS) -> MoESpec:
    """MoESpec of a Mixtral config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope scaling type other than linear and yarn, ``partial_rotary_factor`` != 1, a transformers
            ``quantization_config``): the message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get, need = c.get, c.need
    _check_math_fields(get, hidden_acts)
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=4096, default_eps=1e-5),
        intermediate_size=int(need("intermediate_size")),
        num_experts=int(need("num_local_experts")),
        sliding_window=get("sliding_window"),
        norm_topk_prob=True,
    )


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def pre_attention(
    lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections and RoPE for a packed batch of tokens.

    x: [T, D]; positions: int64 [T] (each token's position in its own sequence); ``rope``: the tables
    ``rope_cos_sin(spec, positions, inv_freq, x.dtype)`` when the caller computed them once for all layers (else None).
    Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in x's dtype.
    """
    T = x.shape[0]
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q = F_.linear(h, lw.wq).view(T, spec.num_heads, spec.head_dim)  # [T, Hq, hd]
    k = F_.linear(h, lw.wk).view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    v = F_.linear(h, lw.wv).view(T, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, hd]
    cos, sin = rope if rope is not None else L.rope_cos_sin(spec, positions, inv_freq.to(x.device), x.dtype)  # [T, hd]
    return L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin), v


post_attention = L.moe_post_attention  # o_proj + residual, RMSNorm, router, experts, residual


FAMILY = Family(
    name=NAME,
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
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
