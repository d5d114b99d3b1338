"""The Qwen2-MoE family (Qwen1.5-MoE, Qwen team 2024): config reader, checkpoint key map, layer math.

Per decoder layer: RMSNorm -> q, k, v projections WITH bias (o_proj without) -> RoPE (rotate-half; default, linear
or yarn frequencies) -> GQA attention (causal, full) -> o_proj -> residual -> RMSNorm -> then, in an MoE layer:
softmax over all experts -> top-k, renormalized only with ``norm_topk_prob`` -> routed SwiGLU experts of width
``moe_intermediate_size``, plus ONE shared SwiGLU expert of width ``shared_expert_intermediate_size`` scaled by
``sigmoid(shared_expert_gate(h))`` -> residual; in a dense layer (``mlp_only_layers``, or ``(i + 1) %
decoder_sparse_step != 0``): one SwiGLU MLP of width ``intermediate_size`` -> residual. Final RMSNorm and lm_head
(tied to embed_tokens with ``tie_word_embeddings``). The shared expert, its gate and a dense layer's MLP are
non-expert weights: resident on the compute device with the layer's other weights, never paged. Refused by name:
q/k/v without bias (``qkv_bias`` false), sliding windows (``use_sliding_window``, ``layer_types`` other than full
attention), rope types other than default, linear and yarn, transformers-quantized checkpoints. The oracle is
transformers' ``modeling_qwen2_moe.py``; the shared pieces are in ``model/layers.py`` (dimension key there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F_

from .. import layers as L
from ..spec import MoESpec
from .base import (DECODER_KEYS, HARMLESS_COMMON_KEYS, HF_ATTENTION_TENSORS, HF_EXPERT_KEYS, HF_MODEL_KEYS,
                   QUANTIZED_REFUSED_KEYS, ConfigView, Family, KeyMap, check_act_and_refused, decoder_fields,
                   module_fields, refuse, tensors_to)

NAME = "qwen2_moe"


# ---------------------------------------------------------------------------------------------------
# Weights (host or device tensors; HF layout: [out_features, in_features])
# ---------------------------------------------------------------------------------------------------
@dataclass
class AttentionWeights:
    """The weights every decoder layer (MoE or dense) holds: its attention and its two norms."""

    attn_norm: torch.Tensor  # [D] input_layernorm
    wq: torch.Tensor  # [Hq*hd, D]
    bq: torch.Tensor  # [Hq*hd] q_proj bias
    wk: torch.Tensor  # [Hkv*hd, D]
    bk: torch.Tensor  # [Hkv*hd] k_proj bias
    wv: torch.Tensor  # [Hkv*hd, D]
    bv: torch.Tensor  # [Hkv*hd] v_proj bias
    wo: torch.Tensor  # [D, Hq*hd] (no bias)
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm

    to = tensors_to  # (device, dtype=None) -> a copy on device


@dataclass
class LayerWeights(AttentionWeights):
    """Non-expert weights of one MoE decoder layer (small: they stay on the compute device)."""

    router: torch.Tensor  # [E, D] mlp.gate
    shared_w1: torch.Tensor  # [Fs, D] mlp.shared_expert.gate_proj
    shared_w3: torch.Tensor  # [Fs, D] mlp.shared_expert.up_proj
    shared_w2: torch.Tensor  # [D, Fs] mlp.shared_expert.down_proj
    shared_gate: torch.Tensor  # [1, D] mlp.shared_expert_gate


@dataclass
class DenseLayerWeights(AttentionWeights):
    """Weights of one dense (MLP-only) decoder layer: attention as an MoE layer's, one SwiGLU MLP instead of experts."""

    w1: torch.Tensor  # [Fd, D] mlp.gate_proj
    w3: torch.Tensor  # [Fd, D] mlp.up_proj
    w2: torch.Tensor  # [D, Fd] mlp.down_proj


_ATTENTION_TENSORS = {**HF_ATTENTION_TENSORS, "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
                      "bv": "self_attn.v_proj.bias"}
KEYS = KeyMap(
    **HF_MODEL_KEYS,
    # Hub checkpoints, transformers' save_pretrained and its in-memory names all use mlp.
    moe_blocks=("mlp.",),
    moe_probe="gate.weight",
    layer_tensors={
        **_ATTENTION_TENSORS,
        "router": "{moe}gate.weight",
        "shared_w1": "{moe}shared_expert.gate_proj.weight",
        "shared_w3": "{moe}shared_expert.up_proj.weight",
        "shared_w2": "{moe}shared_expert.down_proj.weight",
        "shared_gate": "{moe}shared_expert_gate.weight",
    },
    **HF_EXPERT_KEYS,
    dense_layer_tensors={**_ATTENTION_TENSORS, "w1": "mlp.gate_proj.weight", "w3": "mlp.up_proj.weight",
                         "w2": "mlp.down_proj.weight"},
)


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0):
    """Deterministic weights of layer ``layer`` for benchmarks: norms are ones, biases zeros, every matrix
    ``rnd(*shape)`` in field order (a :class:`DenseLayerWeights` for a dense layer)."""
    D, Fs, Fd = spec.hidden_size, spec.shared_intermediate_size, spec.dense_intermediate_size
    ones, zeros = (lambda n: torch.ones(n, dtype=dtype)), (lambda n: torch.zeros(n, dtype=dtype))
    attn = dict(attn_norm=ones(D), wq=rnd(spec.q_size, D), bq=zeros(spec.q_size), wk=rnd(spec.kv_size, D),
                bk=zeros(spec.kv_size), wv=rnd(spec.kv_size, D), bv=zeros(spec.kv_size), wo=rnd(D, spec.q_size),
                ffn_norm=ones(D))
    if spec.is_dense_layer(layer):
        return DenseLayerWeights(**attn, w1=rnd(Fd, D), w3=rnd(Fd, D), w2=rnd(D, Fd))
    return LayerWeights(**attn, router=rnd(spec.num_experts, D), shared_w1=rnd(Fs, D), shared_w3=rnd(Fs, D),
                        shared_w2=rnd(D, Fs), shared_gate=rnd(1, D))


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec
# ---------------------------------------------------------------------------------------------------
# transformers' Qwen2MoeConfig fields (and the Hub config.json names) by how they are handled; the test walks
# Qwen2MoeConfig's fields and fails on one that is in none of these sets.
IMPLEMENTED_KEYS = DECODER_KEYS | {
    "num_experts",  # routed experts per MoE layer (>= 1)
    "moe_intermediate_size",  # the routed experts' width
    "shared_expert_intermediate_size",  # the shared expert's width (>= 1)
    "intermediate_size",  # width of the dense MLP of the dense layers
    "decoder_sparse_step", "mlp_only_layers",  # which layers are dense (transformers' Qwen2MoeDecoderLayer rule)
    "norm_topk_prob",  # renormalize the top-k router weights (both values implemented)
    "hidden_act",  # silu only
    "qkv_bias",  # true only (q/k/v projections with bias, the Qwen1.5 layout)
    "use_sliding_window",  # false only
    "layer_types",  # "full_attention" only
    "sliding_window",  # unused unless use_sliding_window (transformers sets it to 0 then)
    "quantization",  # this package's packed expert pages (model/quantized.py)
}
REFUSED_KEYS = QUANTIZED_REFUSED_KEYS
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {
    "router_aux_loss_coef",  # the auxiliary loss: training only
    "max_window_layers",  # which layers a sliding window would cover; use_sliding_window is refused
}
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none (transformers' Qwen2MoeConfig.default_theta)


def dense_layer_indices(get, num_layers: int, family: str) -> tuple[int, ...]:
    """The dense (MLP-only) layers of a Qwen2-MoE / Qwen3-MoE config, by transformers' rule
    (``Qwen2MoeDecoderLayer``, ``Qwen3MoeDecoderLayer``): layer i is MoE iff ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; every other layer is a dense MLP. Indices of ``mlp_only_layers`` past the
    last layer name no layer (transformers builds every layer from its own index). Raises ValueError naming the field
    for a step < 1 and for a config with no MoE layer left."""
    step = get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise refuse("decoder_sparse_step", step, family, "an int >= 1 (layer i is MoE iff (i + 1) % step == 0)")
    mlp_only = {int(i) for i in (get("mlp_only_layers") or [])}
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    if len(dense) == num_layers:
        key = "mlp_only_layers" if mlp_only & set(range(num_layers)) else "decoder_sparse_step"
        raise refuse(key, get(key), family, "at least one MoE layer (a model of dense layers only is not an MoE)")
    return dense


def qwen_moe_fields(c: ConfigView, family: str, experts_key: str, num_layers: int) -> dict:
    """MoESpec fields Qwen2-MoE and Qwen3-MoE read alike: ``experts_key`` routed experts (>= 1) of width
    ``moe_intermediate_size``, ``norm_topk_prob`` (default false), full attention, and the dense layers
    (:func:`dense_layer_indices`) with their MLP width ``intermediate_size``. Raises ValueError naming the field."""
    num_experts = int(c.need(experts_key))
    if num_experts < 1:  # transformers: every layer a dense MLP
        raise refuse(experts_key, num_experts, family, ">= 1 routed experts (a model of dense layers only is not an MoE)")
    dense = dense_layer_indices(c.get, num_layers, family)
    return dict(intermediate_size=int(c.need("moe_intermediate_size")), num_experts=num_experts, sliding_window=None,
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),  # the config classes' default
                dense_layers=dense, dense_intermediate_size=int(c.need("intermediate_size")) if dense else 0)


def _check_math_fields(get) -> None:
    """Refuse, by name, every config value that would change the math and is not implemented here."""
    check_act_and_refused(get, NAME, HIDDEN_ACTS, REFUSED_KEYS)
    if not get("qkv_bias", True):  # Qwen2MoeConfig's default: the checkpoints hold q/k/v biases
        raise refuse("qkv_bias", get("qkv_bias"), NAME, "True (q/k/v projections with bias, o_proj without)")
    if get("use_sliding_window", False):
        raise refuse("use_sliding_window", get("use_sliding_window"), NAME, "False (full causal attention)")
    types = get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise refuse("layer_types", types, NAME, "'full_attention' in every layer")


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a Qwen2-MoE config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError: a missing field, or a value that changes the math and is not implemented (``hidden_act`` other
            than silu, a rope type other than default, linear, yarn, ``qkv_bias`` false, ``use_sliding_window``, a sliding ``layer_types``
            entry, no experts or no shared expert, no MoE layer, a transformers ``quantization_config``): the
            message names the field.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get, need = c.get, c.need
    num_layers = int(need("num_hidden_layers"))
    _check_math_fields(get)
    moe = qwen_moe_fields(c, NAME, "num_experts", num_layers)
    shared = int(need("shared_expert_intermediate_size"))
    if shared < 1:
        raise refuse("shared_expert_intermediate_size", shared, NAME, ">= 1 (one shared expert in every MoE layer)")
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=32768, default_eps=1e-6),
        **moe, num_shared_experts=1, shared_intermediate_size=shared,
    )


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def pre_attention(lw, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                  rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections with their biases and RoPE for a packed batch of tokens, MoE or dense layer
    (arguments: ``Family.pre_attention``). x: [T, D]. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]."""
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q, k, v = L.qkv_heads(h, spec, lw.wq, lw.wk, lw.wv, lw.bq, lw.bk, lw.bv)  # [T, Hq, hd], [T, Hkv, hd] x2
    q, k = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    return q, k, v


def shared_expert(lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    """The shared expert of an MoE layer: ``sigmoid(h Wg^T) * SwiGLU_shared(h)``. h: [T, D] normed. Returns [T, D]."""
    gate = torch.sigmoid(F_.linear(h, lw.shared_gate))  # [T, 1]
    return gate * L.swiglu(h, lw.shared_w1, lw.shared_w3, lw.shared_w2)  # [T, D]


def post_attention(lw, ew, x: torch.Tensor, attn: torch.Tensor, spec: MoESpec, ffn=None) -> torch.Tensor:
    """o_proj + residual, RMSNorm, then routed experts + the gated shared expert (MoE layer) or the dense MLP (a
    :class:`DenseLayerWeights` layer: ``ew`` and ``ffn`` unused), residual. x: [T, D]; attn: [T, Hq*hd] -> [T, D]."""
    if isinstance(lw, DenseLayerWeights):
        return L.dense_post_attention(lw, x, attn, spec)
    return L.moe_post_attention(lw, ew, x, attn, spec, ffn, shared=shared_expert)


FAMILY = Family(**module_fields(globals()), model_types=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",))
