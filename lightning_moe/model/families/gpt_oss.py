"""The gpt-oss family (OpenAI gpt-oss-20b / gpt-oss-120b, 2025): config reader, checkpoint key map, layer math.

Per decoder layer, as transformers' ``modeling_gpt_oss.py`` computes it:
    h = RMSNorm(x)                                   (norm weights kept in fp32: ``_keep_in_fp32_modules``)
    q, k, v = q_proj(h), k_proj(h), v_proj(h)        (with biases: ``attention_bias``)
    RoPE (rotate-half; yarn by default: factor 32 over 4096 positions, truncate false)
    attention: causal GQA; "sliding_attention" layers (``layer_types``) see only the last ``sliding_window``
        positions; every head's learned sink logit joins the softmax and is dropped:
        p = softmax([q k^T / sqrt(hd), sink_h])[:-1];  out = p v
    x = x + o_proj(out)                              (with bias)
    h = RMSNorm(x)
    router: logits = h W_r^T + b_r; top-k of the LOGITS, softmax over the chosen k
    experts (with biases; gate and up interleaved in the checkpoint's gate_up_proj):
        gate = h W1_e^T + b1_e, up = h W3_e^T + b3_e;  gate = min(gate, limit);  up = clamp(up, -limit, limit)
        y_e = ((up + 1) * gate * sigmoid(alpha * gate)) W2_e^T + b2_e       (limit: swiglu_limit, alpha: swiglu_alpha)
    x = x + sum_j w_j y_{e_j}
Final RMSNorm (fp32 weight) and lm_head. No shared experts, no dense layers.

Checkpoints: transformers' ``save_pretrained`` writes the experts fused as its parameters hold them,
``mlp.experts.gate_up_proj`` [E, D, 2F] (input dim first; gate = columns 0::2, up = 1::2), ``gate_up_proj_bias``
[E, 2F], ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D]; the Hub's MXFP4 checkpoints (``quantization_config``
``quant_method: mxfp4``) store ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales`` instead,
either kept packed (``load_checkpoint(packed_experts=True)``, what the serial and CGOPipe executors take: one MXFP4
page per expert, ``model.quantized.MXFP4Experts``, computed on CUDA by ``kernels.mxfp4.fused_experts_mxfp4_triton``)
or dequantized on load into the compute dtype (``kernels.mxfp4.mxfp4_dequantize``, bit for bit transformers'
dequantization; the expert-parallel executor, which cuts no packed pages). Dense experts are stored as
``layers.ExpertWeights`` [E, F, D] / [E, D, F] with their biases (``b1``, ``b3``, ``b2``).

Attention variant ``"gqa_sinks"``: the GQA K/V cache, and attention functions that take the layer's weights (its
sinks); both executors run them (CGOPipe's CPU decode attention in the native kernel with the layer's sinks and
window, its GPU-attention micro-batches in the Triton decode kernel with sinks). CGOPipe pages
the experts with their biases and computes them with :func:`experts_ffn_from` (``expert_ffn: torch``; its grouped
kernels compute silu without biases and are refused by name; MXFP4 pages on
CUDA run the MXFP4 kernel, ``expert_ffn: triton`` / ``auto``, grouped_mm refused by name). Refused by name: ``layer_types``
entries other than sliding_attention / full_attention (or a list of another length), sliding layers without a
``sliding_window``, ``swiglu_limit`` <= 0, a ``quantization_config`` other than mxfp4, this package's own
``quantization`` pages, rope types other than default, linear and yarn. The shared pieces are in ``model/layers.py``
(dimension key there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partialmethod
from typing import Mapping, Optional

import torch
import torch.nn.functional as F_

from ...kernels import prefill_attention as PA
from ...kernels.mxfp4 import mxfp4_dequantize, mxfp4_page_layout, pack_mxfp4_pages
from .. import layers as L
from ..checkpoint_io import CheckpointError
from ..spec import MoESpec
from .base import (DECODER_KEYS, HARMLESS_COMMON_KEYS, HF_MODEL_KEYS, ConfigView, Family, KeyMap, decoder_fields,
                   module_fields, refuse, tensors_to)

NAME = "gpt_oss"
_FP32_FIELDS = ("attn_norm", "ffn_norm")  # kept in fp32 (transformers' _keep_in_fp32_modules: the RMSNorms)


# ---------------------------------------------------------------------------------------------------
# Weights (host or device tensors; HF layout: [out_features, in_features])
# ---------------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    """Non-expert weights of one decoder layer (small: they stay on the compute device). The attention biases are
    None with ``attention_bias`` false."""

    attn_norm: torch.Tensor  # [D] input_layernorm (fp32)
    wq: torch.Tensor  # [Hq*hd, D]
    wk: torch.Tensor  # [Hkv*hd, D]
    wv: torch.Tensor  # [Hkv*hd, D]
    wo: torch.Tensor  # [D, Hq*hd]
    sinks: torch.Tensor  # [Hq] self_attn.sinks: one logit per query head
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm (fp32)
    router: torch.Tensor  # [E, D] mlp.router.weight
    router_bias: torch.Tensor  # [E] mlp.router.bias
    bq: Optional[torch.Tensor] = None  # [Hq*hd] q_proj bias
    bk: Optional[torch.Tensor] = None  # [Hkv*hd]
    bv: Optional[torch.Tensor] = None  # [Hkv*hd]
    bo: Optional[torch.Tensor] = None  # [D] o_proj bias

    to = partialmethod(tensors_to, keep_fp32=_FP32_FIELDS)  # (device, dtype=None) -> a copy on device (norms fp32)


KEYS = KeyMap(
    **HF_MODEL_KEYS,
    moe_blocks=("mlp.",),  # Hub checkpoints and transformers' save_pretrained
    moe_probe="router.weight",
    layer_tensors={
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight", "bq": "self_attn.q_proj.bias",
        "wk": "self_attn.k_proj.weight", "bk": "self_attn.k_proj.bias",
        "wv": "self_attn.v_proj.weight", "bv": "self_attn.v_proj.bias",
        "wo": "self_attn.o_proj.weight", "bo": "self_attn.o_proj.bias",
        "sinks": "self_attn.sinks",
        "ffn_norm": "post_attention_layernorm.weight",
        "router": "{moe}router.weight",
        "router_bias": "{moe}router.bias",
    },
    expert_tensors={},  # no per-expert tensors: the experts are read by load_experts (fused, or MXFP4 blocks)
    fused_gate_up="{moe}experts.gate_up_proj",  # [E, D, 2F], gate/up interleaved (load_experts)
    fused_down="{moe}experts.down_proj",  # [E, F, D]
    optional_tensors=frozenset({"bq", "bk", "bv", "bo"}),  # absent with attention_bias false
)


def packed_expert_layout(r, prefix: str, spec: MoESpec, dtype: torch.dtype):
    """The MXFP4 page layout (``kernels.mxfp4.mxfp4_page_layout``) of a layer whose experts the checkpoint stores as
    MXFP4 ``*_blocks`` / ``*_scales`` (``prefix``: the layer's ``mlp.``), else None. The biases are stored fp32 whatever
    ``dtype`` (they hold the load dtype's values exactly, and the page size is one per model: ``MoESpec.expert_bytes(
    "mxfp4")``, what the planner counts)."""
    if not r.has(prefix + "experts.gate_up_proj_blocks"):
        return None
    return mxfp4_page_layout(spec.hidden_size, spec.intermediate_size, torch.float32)


def _packed_pages(r, ex: str, lay, spec: MoESpec) -> torch.Tensor:
    """The MXFP4 pages ``uint8 [E, page_bytes]`` of the experts under ``ex``, packed a few experts at a time (the
    reader's ``MAP_LIMIT`` bytes of source per chunk), so that the layer's mapped source pages never sit beside its
    whole packed copy. Raises CheckpointError when the stored tensors do not fit the spec."""
    from .. import checkpoint_io

    E = spec.num_experts
    names = [ex + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                              "down_proj_scales", "down_proj_bias")]
    pages = torch.zeros((E, lay.page_bytes), dtype=torch.uint8)
    step = max(1, checkpoint_io.MAP_LIMIT // lay.page_bytes)
    try:
        if any(r.shape(n)[:1] != [E] for n in names):
            raise ValueError(f"the stored tensors' first dimensions are {[r.shape(n)[:1] for n in names]}")
        for a in range(0, E, step):
            pages[a:a + step] = pack_mxfp4_pages(*(r.get_rows(n, a, a + step) for n in names), layout=lay)[0]
    except ValueError as exc:
        raise CheckpointError(f"{r.path}: the MXFP4 experts under {ex!r} do not fit num_local_experts={E}, "
                              f"hidden_size={spec.hidden_size}, intermediate_size={spec.intermediate_size}: {exc}") from None
    return pages


def load_experts(r, prefix: str, spec: MoESpec, dtype: torch.dtype, packed: bool = False):
    """The routed experts of one layer from a checkpoint reader ``r`` (``prefix``: the layer's ``mlp.``): the fused
    tensors transformers saves, or the MXFP4 ``*_blocks`` / ``*_scales`` of the Hub checkpoints, dequantized into
    ``dtype``; gate and up de-interleaved (columns 0::2 and 1::2 of gate_up_proj), every projection transposed to
    [out, in]. Returns ExpertWeights w1, w3 [E, F, D], w2 [E, D, F], b1, b3 [E, F], b2 [E, D].
    ``packed`` (an executor that computes MXFP4 pages): MXFP4 tensors stay packed instead, as
    ``model.quantized.MXFP4Experts`` (the blocks and scales as stored, the biases read in ``dtype`` and kept fp32; layout
    :func:`packed_expert_layout`); fused (unquantized) tensors load as above.
    Raises CheckpointError naming a missing tensor or a tensor of another shape."""
    E, D, F = spec.num_experts, spec.hidden_size, spec.intermediate_size
    lay = packed_expert_layout(r, prefix, spec, dtype) if packed else None
    if lay is not None:
        from ..quantized import MXFP4Experts

        return MXFP4Experts(_packed_pages(r, prefix + "experts.", lay, spec), lay)

    def dense(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        full = prefix + "experts." + name
        if r.has(full + "_blocks"):  # MXFP4: [E, R, C/32, 16] blocks, [E, R, C/32] scales -> [E, C, R]
            t = mxfp4_dequantize(r.get(full + "_blocks"), r.get(full + "_scales"), dtype)
        else:
            t = r.get(full)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{r.path}: tensor {full!r} has shape {tuple(t.shape)}, expected {shape} "
                                  f"(num_local_experts, input, output)")
        return t

    gu = dense("gate_up_proj", (E, D, 2 * F))  # [E, D, 2F]
    down = dense("down_proj", (E, F, D))  # [E, F, D]
    gu_b = r.get(prefix + "experts.gate_up_proj_bias")  # [E, 2F]
    down_b = r.get(prefix + "experts.down_proj_bias")  # [E, D]
    return L.ExpertWeights(
        w1=gu[..., 0::2].transpose(1, 2).contiguous(), w3=gu[..., 1::2].transpose(1, 2).contiguous(),  # [E, F, D]
        w2=down.transpose(1, 2).contiguous(),  # [E, D, F]
        b1=gu_b[:, 0::2].contiguous(), b3=gu_b[:, 1::2].contiguous(), b2=down_b.contiguous(),
    )


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0) -> LayerWeights:
    """Deterministic layer weights for benchmarks: norms are ones, biases and sinks zeros, every matrix ``rnd(*shape)``
    in field order (every layer is MoE: ``layer`` changes nothing)."""
    D = spec.hidden_size

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    return LayerWeights(
        torch.ones(D, dtype=torch.float32), rnd(spec.q_size, D), rnd(spec.kv_size, D), rnd(spec.kv_size, D),
        rnd(D, spec.q_size), zeros(spec.num_heads), torch.ones(D, dtype=torch.float32), rnd(spec.num_experts, D),
        zeros(spec.num_experts), zeros(spec.q_size), zeros(spec.kv_size), zeros(spec.kv_size), zeros(D),
    )


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec
# ---------------------------------------------------------------------------------------------------
# transformers' GptOssConfig fields and the Hub config.json names, by how they are handled; the test walks GptOssConfig's
# fields and the Hub gpt-oss-20b config and fails on one that is in none of these sets.
IMPLEMENTED_KEYS = DECODER_KEYS | {
    "num_local_experts",  # routed experts per layer
    "intermediate_size",  # each expert's width
    "sliding_window",  # the window of the sliding_attention layers (an int >= 1 when there are any)
    "layer_types",  # sliding_attention / full_attention per layer (both implemented)
    "attention_bias",  # q/k/v/o biases (both values: the checkpoint holds them or not)
    "swiglu_limit", "swiglu_alpha",  # the experts' clamped SwiGLU (limit > 0)
    "quantization_config",  # quant_method mxfp4 only: the experts' MXFP4 blocks, kept packed or dequantized on load
}
REFUSED_KEYS = frozenset({"quantization"})  # moe-batch quantize's packed pages carry no expert biases
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {
    "router_aux_loss_coef",  # the auxiliary loss: training only
    "hidden_act",  # unused by transformers' GptOss classes (the experts' clamped SwiGLU is fixed)
    "experts_per_token", "initial_context_length",  # the Hub config's names from OpenAI's code: transformers reads
    #   num_experts_per_tok and rope_scaling's original_max_position_embeddings instead
}
DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
# GptOssConfig's defaults of the fields its __post_init__ fills (a raw config.json without them reads as transformers
# reads it)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
LAYER_TYPES = ("sliding_attention", "full_attention")


def _with_defaults(c: ConfigView) -> ConfigView:
    """A raw config.json dict with GptOssConfig's rope default when it names no rope mapping (a transformers config
    already holds it)."""
    cfg = c.cfg
    if isinstance(cfg, Mapping) and not cfg.get("rope_scaling") and not cfg.get("rope_parameters"):
        return ConfigView({**cfg, "rope_parameters": dict(DEFAULT_ROPE)})
    return c


def _layer_types(get, num_layers: int) -> list[str]:
    types = get("layer_types")
    if types is None:  # GptOssConfig.__post_init__: sliding on even layers, full on odd ones
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, (list, tuple)) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise refuse("layer_types", types, NAME, f"a list of num_hidden_layers={num_layers} entries, each "
                                                 f"'sliding_attention' or 'full_attention'")
    return list(types)


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a gpt-oss config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError naming the field: a missing one, ``layer_types`` not one of sliding_attention / full_attention per
            layer, sliding layers with no ``sliding_window``, ``swiglu_limit`` <= 0, a ``quantization_config`` other
            than mxfp4, a ``quantization`` section, a rope type other than default, linear, yarn.
    """
    c = _with_defaults(cfg if isinstance(cfg, ConfigView) else ConfigView(cfg))
    get, need = c.get, c.need
    for key in REFUSED_KEYS:
        if get(key) is not None:
            raise refuse(key, get(key), NAME, "unquantized or MXFP4 checkpoints (moe-batch quantize's pages carry "
                                              "no expert biases)")
    qc = get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
        if str(getattr(method, "value", method)) != "mxfp4":
            raise refuse("quantization_config", qc, NAME, "quant_method 'mxfp4' (dequantized on load)")
    num_layers = int(need("num_hidden_layers"))
    types = _layer_types(get, num_layers)
    window = get("sliding_window", 128)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise refuse("sliding_window", window, NAME, "an int >= 1 (layer_types has sliding_attention layers)")
    limit = get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0 or math.isinf(limit):
        raise refuse("swiglu_limit", limit, NAME, "a finite number > 0 (the experts' clamp)")
    alpha = get("swiglu_alpha", 1.702)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise refuse("swiglu_alpha", alpha, NAME, "a number (the clamped SwiGLU's sigmoid gain)")
    return MoESpec(
        **decoder_fields(c, name, NAME, default_theta=DEFAULT_THETA, default_max_pos=131072, default_eps=1e-5),
        intermediate_size=int(need("intermediate_size")),
        num_experts=int(need("num_local_experts")),
        sliding_window=int(window) if sliding else None,
        full_attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention") if sliding else (),
        norm_topk_prob=True,  # softmax over the chosen k: the weights sum to 1
        attention_sinks=True,
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
        expert_bias=True,
    )


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GptOssRMSNorm: ``(w * x / sqrt(mean(x^2) + eps))`` with the product in fp32, then x's dtype (the weight is kept
    in fp32; Mixtral's norm casts before the product). x: [..., D]; weight: [D]."""
    xf = x.float()  # [..., D]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def pre_attention(lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                  rope=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm (:func:`rms_norm`: fp32 product), q/k/v projections with their biases and RoPE for a packed batch of
    tokens (arguments: ``Family.pre_attention``). x: [T, D]. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]."""
    h = rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    q, k, v = L.qkv_heads(h, spec, lw.wq, lw.wk, lw.wv, lw.bq, lw.bk, lw.bv)  # [T, Hq, hd], [T, Hkv, hd] x2
    q, k = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    return q, k, v


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys and one sink logit per head, the sink's share dropped. scores: [..., H, Sq, Sk] (masked
    keys at -inf); sinks: [H]. Returns fp32 [..., H, Sq, Sk] (rows sum to < 1)."""
    s = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., H, Sq, 1]
    return torch.softmax(torch.cat([scores.float(), s], dim=-1), dim=-1)[..., :-1]  # [..., H, Sq, Sk]


def prefill_attention_packed(
    lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
    sliding_window: Optional[int] = None, layout: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Causal GQA attention with the layer's sinks over several sequences packed token-wise (prefill).

    q: [T, Hq, hd]; k, v: [T, Hkv, hd]; spans: (start, end) of each sequence; ``layout``: ``layers.prefill_packed_layout``
    of the spans (built here when None). Each query sees its own sequence's keys j <= i (and j > i - sliding_window);
    logits ``q k^T / sqrt(hd)``, softmax in fp32 together with the head's sink (``lw.sinks``), which is then dropped.
    On CUDA with triton (``kernels.prefill_attention.use_triton``: ``LIGHTNING_MOE_PREFILL_ATTENTION`` auto / varlen /
    triton), one launch of ``kernels.prefill_attention.attention_varlen_triton`` on the packed rows (fp32 online
    softmax with the sink, no [S, S] matrix). Otherwise (the CPU, ``efficient`` / ``sdpa``) the [B, Hq, S, S] scores
    are materialized: the torch path, which is also the reference. Returns [T, Hq*hd] in q's dtype.
    """
    T, Hq, hd = q.shape
    if L.spans_packed(spans, T) and PA.use_triton(q, k, v, sliding_window, None, PA.prefill_attention_mode(),
                                                  sinks=True):
        cu, longest = L.packed_cu_seqlens(spans, q.device)
        o = PA.attention_varlen_triton(q, k, v, cu, longest, sliding_window, sinks=lw.sinks.to(q.device))
        return o.reshape(T, Hq * hd)  # [T, Hq*hd]
    qp, kp, vp, allowed, keep = L.packed_attention_operands(q, k, v, spans, sliding_window, layout)
    B, _, S, _ = qp.shape
    scores = torch.matmul(qp, kp.transpose(2, 3)) * hd ** -0.5  # [B, Hq, S, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = _softmax_with_sinks(scores, lw.sinks.to(q.device)).to(q.dtype)  # [B, Hq, S, S]
    out = torch.matmul(probs, vp).permute(0, 2, 1, 3).reshape(B * S, Hq * hd)  # [B*S, Hq*hd]
    return out.index_select(0, keep)  # [T, Hq*hd] packed order


def decode_attention(lw: LayerWeights, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, sliding_window: Optional[int] = None) -> torch.Tensor:
    """Ragged GQA decode attention with the layer's sinks (:func:`layers.decode_attention` with ``sinks``): one new
    query per sequence over its cached keys/values. q: [B, Hq, hd]; k_cache, v_cache: [B, Hkv, S, hd] (the new token's
    k/v already written); lengths: int64 [B] valid positions per row (keys past a row's length, and outside the
    sliding window, are masked). Softmax in fp32 with the sinks. Returns [B, Hq*hd] in q's dtype, on q's device.
    """
    return L.decode_attention(q, k_cache, v_cache, lengths, sliding_window, sinks=lw.sinks.to(q.device))


def decode_attention_masked(lw: LayerWeights, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            masked: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` with its mask given: ``masked`` bool [B, 1, 1, S] on q's device
    (``kernels.cpu_attention.decode_mask`` of the lengths and the layer's window, made once per decode step by the
    caller). Returns [B, Hq*hd] in q's dtype, bit for bit :func:`decode_attention`."""
    return L.decode_attention_masked(q, k_cache, v_cache, masked, sinks=lw.sinks.to(q.device))


def route(lw: LayerWeights, h: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router (GptOssTopKRouter): logits ``h W_r^T + b_r`` (in fp32, as every router here), top-k of the
    logits, softmax over the chosen k. h: [T, D] -> (weights fp32 [T, k], expert ids int64 [T, k])."""
    logits = F_.linear(h.float(), lw.router.float(), lw.router_bias.float())  # [T, E] fp32
    top, ids = torch.topk(logits, spec.top_k, dim=-1)  # [T, k]
    return torch.softmax(top, dim=-1), ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GptOssExperts._apply_gate: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)``. gate, up: [T, F] -> [T, F]."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_ffn(x: torch.Tensor, ew: L.ExpertWeights, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """Routed experts with biases and the clamped SwiGLU, in transformers' order (GptOssExperts.forward): expert by
    expert in ascending id over the tokens routed to it, ``y = clamped_swiglu(x W1^T + b1, x W3^T + b3) W2^T + b2``,
    times the routing weight, accumulated into the output in x's dtype. x: [T, D]; ew on x's device (biases None:
    zero); topk_w fp32 [T, k]; topk_ids int64 [T, k]. Returns [T, D] in x's dtype. (:func:`experts_ffn_from` over
    the stacked tensors: the same ops.)"""
    def get(e: int):
        return (ew.w1[e], ew.w3[e], ew.w2[e], None if ew.b1 is None else ew.b1[e], None if ew.b3 is None else ew.b3[e],
                None if ew.b2 is None else ew.b2[e])

    return experts_ffn_from(x, get, ew.w1.shape[0], topk_w, topk_ids, limit=limit, alpha=alpha)


def experts_ffn_from(x: torch.Tensor, get_expert, num_experts: int, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                     limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """:func:`experts_ffn` with expert ``e``'s tensors from ``get_expert(e) -> (w1 [F, D], w3 [F, D], w2 [D, F], b1
    [F], b3 [F], b2 [D])`` (biases may be None: zero; a 3-tuple: no biases), called once per expert that receives
    tokens, in ascending id (CGOPipe's torch expert FFN over paged and resident experts, whose pages carry the
    biases). ``limit`` / ``alpha``: the spec's ``swiglu_limit`` / ``swiglu_alpha`` (the executor binds them).
    Returns [T, D] in x's dtype, bit-identical to :func:`experts_ffn` over the same tensors."""
    out = torch.zeros_like(x)  # [T, D]
    for e in torch.unique(topk_ids).tolist():  # ascending
        if not 0 <= e < num_experts:
            raise ValueError(f"experts_ffn_from: expert id {e} outside 0..{num_experts - 1}")
        w1, w3, w2, *b = get_expert(e)
        b1, b3, b2 = b if b else (None, None, None)
        tok, slot = torch.where(topk_ids == e)  # [n] each
        h = x[tok]  # [n, D]
        gate = F_.linear(h, w1, b1)  # [n, F]
        up = F_.linear(h, w3, b3)  # [n, F]
        y = F_.linear(clamped_swiglu(gate, up, limit, alpha), w2, b2)  # [n, D]
        out.index_add_(0, tok, (y * topk_w[tok, slot, None]).to(x.dtype))
    return out


def post_attention(lw: LayerWeights, ew: Optional[L.ExpertWeights], x: torch.Tensor, attn: torch.Tensor,
                   spec: MoESpec, ffn=None) -> torch.Tensor:
    """o_proj (with bias) + residual, RMSNorm, router, the experts (``ffn``: :func:`experts_ffn` with the spec's limit
    and alpha unless an executor passes its own, which must compute them), residual.
    x: [T, D]; attn: [T, Hq*hd] -> [T, D]."""
    if ffn is None or ffn is experts_ffn:
        ffn = functools.partial(experts_ffn, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
    x = x + F_.linear(attn.to(x.dtype), lw.wo, lw.bo)  # [T, D]
    h = rms_norm(x, lw.ffn_norm, spec.rms_norm_eps)  # [T, D]
    topk_w, topk_ids = route(lw, h, spec)  # [T, k] each
    return x + ffn(h, ew, topk_w, topk_ids)  # [T, D]


def head_logits(x: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm (:func:`rms_norm`, fp32 product) and lm_head in the model dtype. x: [T, D] -> [T, V] in the
    GEMM's dtype (:func:`final_logits` before its fp32 cast)."""
    return F_.linear(rms_norm(x, norm_w, eps), lm_head)


def final_logits(x: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm (:func:`rms_norm`, fp32 product) and lm_head. x: [T, D] -> fp32 logits [T, V]:
    ``head_logits(...).float()`` (named by its ``model_dtype_logits`` attribute: ``layers.model_dtype_head``)."""
    return head_logits(x, norm_w, lm_head, eps).float()


final_logits.model_dtype_logits = head_logits


FAMILY = Family(**module_fields(globals()), model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
                attention="gqa_sinks", expert_activation="clamped_swiglu")
