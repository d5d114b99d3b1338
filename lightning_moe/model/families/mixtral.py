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

from .. import layers as L
from ..spec import MoESpec
from .base import (DECODER_KEYS, HARMLESS_COMMON_KEYS, HF_ATTENTION_TENSORS, HF_MODEL_KEYS, QUANTIZED_REFUSED_KEYS,
                   ConfigView, Family, KeyMap, check_act_and_refused, decoder_fields, module_fields, QKVWeights)

NAME = "mixtral"


@dataclass
class LayerWeights(QKVWeights):
    """Non-expert weights of one Mixtral layer (resident on the compute device): QKVWeights' attn_norm,
    wq, wk, wv, then these."""

    wo: torch.Tensor  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] block_sparse_moe.gate


KEYS = KeyMap(
    **HF_MODEL_KEYS,
    # Hub checkpoints and transformers' save_pretrained: block_sparse_moe; transformers-5 in-memory names: mlp
    moe_blocks=("block_sparse_moe.", "mlp."),
    moe_probe="gate.weight",
    layer_tensors={**HF_ATTENTION_TENSORS, "router": "{moe}gate.weight"},
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
IMPLEMENTED_KEYS = DECODER_KEYS | {
    "intermediate_size", "num_local_experts", "sliding_window",
    "hidden_act",  # silu only
    "quantization",  # this package's packed expert pages (model/quantized.py)
}
REFUSED_KEYS = QUANTIZED_REFUSED_KEYS
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {
    "router_aux_loss_coef",  # the auxiliary loss: training only
    "router_jitter_noise",  # applied in training only (MixtralSparseMoeBlock: ``if self.training``)
}
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e6  # RoPE base when the config names none (transformers' MixtralConfig.default_theta)


def read_spec(cfg, name: Optional[str] = None, *, hidden_acts: tuple[str, ...] = HIDDEN_ACTS) -> MoESpec:
    """MoESpec of a Mixtral config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope scaling type other than linear and yarn, ``partial_rotary_factor`` != 1, a transformers
            ``quantization_config``): the message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get, need = c.get, c.need
    check_act_and_refused(get, NAME, hidden_acts, REFUSED_KEYS)
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
def pre_attention(lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                  rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections and RoPE for a packed batch of tokens (arguments: ``Family.pre_attention``).
    x: [T, D]. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in x's dtype."""
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q, k, v = L.qkv_heads(h, spec, lw.wq, lw.wk, lw.wv)  # [T, Hq, hd], [T, Hkv, hd] x2
    q, k = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    return q, k, v


post_attention = L.moe_post_attention  # o_proj + residual, RMSNorm, router, experts, residual


FAMILY = Family(**module_fields(globals()), model_types=("mixtral",), architectures=("MixtralForCausalLM",))
