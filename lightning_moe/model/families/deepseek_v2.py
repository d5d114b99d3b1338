"""The DeepSeek-V2 family (DeepSeek-V2, V2-Lite; DeepSeek-AI 2024, arXiv 2405.04434): config reader, key map, layer math.

Per decoder layer: RMSNorm -> multi-head latent attention (MLA) -> o_proj -> residual -> RMSNorm -> then, in an MoE
layer (``i >= first_k_dense_replace``): the router (softmax over all experts; ``topk_method`` greedy, or
group_limited_greedy: the ``topk_group`` best of ``n_group`` groups, each scored by its best expert; top-k, never
renormalized, times ``routed_scaling_factor``: ``layers.route_softmax_grouped``) -> routed SwiGLU experts of width
``moe_intermediate_size`` + the shared experts: ONE SwiGLU MLP of width ``n_shared_experts * moe_intermediate_size``,
ungated -> residual; in a dense layer (``i < first_k_dense_replace``): one SwiGLU MLP of width ``intermediate_size``.

MLA (``attention = "mla"``), as transformers' ``DeepseekV2Attention`` computes it:
    q = q_proj(h)  or, with ``q_lora_rank``, q_b_proj(RMSNorm_1e-6(q_a_proj(h)))       [T, Hq, nope + rd]
    c, k_pe = split(kv_a_proj_with_mqa(h), [kv_lora_rank, rd]);  c = RMSNorm_1e-6(c)   (the cached latent)
    RoPE on q's last rd dims and on k_pe (one rope key shared by all heads), over interleaved pairs
    k_nope, v = split(kv_b_proj(c), [nope, v_hd]) per head;  k = cat(k_nope, k_pe);  q = cat(q_nope, q_pe)
    softmax(q k^T * softmax_scale) v -> o_proj
(the two latent norms use RMSNorm's default eps 1e-6 whatever ``rms_norm_eps`` is, as transformers and DeepSeek's
code build them). Prefill expands the latent like this (:func:`prefill_attention_packed`). The KV cache holds per
token and layer only ``[c, k_pe]`` (kv_lora_rank + qk_rope_head_dim values), and decode attends over it with the
projections absorbed (:func:`mla_absorb`: q_nope W_UK^T per head; :func:`latent_attention`: one shared "KV head" of
width kv_lora_rank + rd, the values its first kv_lora_rank dims; :func:`mla_unabsorb`: W_UV per head), which equals
the expanded attention (tests/test_family_deepseek.py). ``softmax_scale`` is ``qk_head_dim ** -0.5``, times yarn's
``mscale(factor, mscale_all_dim) ** 2`` under rope scaling (``MoESpec.softmax_scale``).

DeepSeek-V3 (``families/deepseek_v3.py``) is this family with the sigmoid router and a correction bias.
Refused by name: ``norm_topk_prob`` true (transformers' V2 router ignores it, DeepSeek's code renormalizes: they
disagree), ``moe_layer_freq`` != 1 (transformers makes every layer past the dense ones MoE), ``attention_bias``,
``mlp_bias``, ``num_key_value_heads`` != heads, other ``topk_method`` / ``scoring_func`` values, rope types other
than default, linear and yarn, ``hidden_act`` other than silu, transformers-quantized checkpoints. The oracle is
transformers' ``modeling_deepseek_v2.py``; the shared pieces are in ``model/layers.py`` (dimension key there; here
also Dl: kv_lora_rank, rd: qk_rope_head_dim, nope: qk_nope_head_dim, vd: v_head_dim, S: cached positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partialmethod
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F_

from ...kernels.cpu_latent_attention import latent_attention_torch
from .. import layers as L
from ..spec import MoESpec
from .base import (HARMLESS_COMMON_KEYS, HF_EXPERT_KEYS, HF_MODEL_KEYS, QUANTIZED_REFUSED_KEYS, ROPE_CONFIG_KEYS,
                   ConfigView, Family, KeyMap, module_fields, read_rope, refuse, tensors_to)

NAME = "deepseek_v2"
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepseekV2RMSNorm's default eps (rms_norm_eps is not passed)
_FP32_FIELDS = ("router", "e_bias")  # kept in fp32 on the device (transformers' _keep_in_fp32_modules_strict)


# ---------------------------------------------------------------------------------------------------
# Weights (host or device tensors; HF layout: [out_features, in_features])
# ---------------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    """Non-expert weights of one MoE decoder layer (resident on the compute device). The q fields present are
    either ``wq`` (no q compression) or ``wq_a``, ``q_a_norm``, ``wq_b`` (``q_lora_rank``)."""

    attn_norm: torch.Tensor  # [D] input_layernorm
    wkv_a: torch.Tensor  # [Dl + rd, D] self_attn.kv_a_proj_with_mqa
    kv_a_norm: torch.Tensor  # [Dl] self_attn.kv_a_layernorm
    wkv_b: torch.Tensor  # [Hq*(nope + vd), Dl] self_attn.kv_b_proj
    wo: torch.Tensor  # [D, Hq*vd] self_attn.o_proj
    ffn_norm: torch.Tensor  # [D] post_attention_layernorm
    router: torch.Tensor  # [E, D] mlp.gate.weight (fp32)
    shared_w1: torch.Tensor  # [ns*F, D] mlp.shared_experts.gate_proj
    shared_w3: torch.Tensor  # [ns*F, D] mlp.shared_experts.up_proj
    shared_w2: torch.Tensor  # [D, ns*F] mlp.shared_experts.down_proj
    wq: Optional[torch.Tensor] = None  # [Hq*hd, D] self_attn.q_proj (q_lora_rank null)
    wq_a: Optional[torch.Tensor] = None  # [r, D] self_attn.q_a_proj (q_lora_rank r)
    q_a_norm: Optional[torch.Tensor] = None  # [r] self_attn.q_a_layernorm
    wq_b: Optional[torch.Tensor] = None  # [Hq*hd, r] self_attn.q_b_proj
    e_bias: Optional[torch.Tensor] = None  # [E] mlp.gate.e_score_correction_bias (DeepSeek-V3; fp32)

    to = partialmethod(tensors_to, keep_fp32=_FP32_FIELDS)  # (device, dtype=None) -> a copy on device (router fp32)


@dataclass
class DenseLayerWeights:
    """Weights of one dense (MLP-only) decoder layer (``i < first_k_dense_replace``): MLA as an MoE layer's, one
    SwiGLU MLP of width intermediate_size."""

    attn_norm: torch.Tensor  # [D]
    wkv_a: torch.Tensor  # [Dl + rd, D]
    kv_a_norm: torch.Tensor  # [Dl]
    wkv_b: torch.Tensor  # [Hq*(nope + vd), Dl]
    wo: torch.Tensor  # [D, Hq*vd]
    ffn_norm: torch.Tensor  # [D]
    w1: torch.Tensor  # [Fd, D] mlp.gate_proj
    w3: torch.Tensor  # [Fd, D] mlp.up_proj
    w2: torch.Tensor  # [D, Fd] mlp.down_proj
    wq: Optional[torch.Tensor] = None  # as LayerWeights
    wq_a: Optional[torch.Tensor] = None
    q_a_norm: Optional[torch.Tensor] = None
    wq_b: Optional[torch.Tensor] = None

    to = tensors_to  # (device, dtype=None) -> a copy on device


ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": "self_attn.kv_b_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wq_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight",
}
Q_FIELDS = frozenset({"wq", "wq_a", "q_a_norm", "wq_b"})  # present or absent by q_lora_rank
MOE_TENSORS = {
    "router": "{moe}gate.weight",
    "shared_w1": "{moe}shared_experts.gate_proj.weight",
    "shared_w3": "{moe}shared_experts.up_proj.weight",
    "shared_w2": "{moe}shared_experts.down_proj.weight",
}
KEYS = KeyMap(
    **HF_MODEL_KEYS,
    moe_blocks=("mlp.",),  # Hub checkpoints and transformers' save_pretrained
    moe_probe="gate.weight",
    layer_tensors={**ATTENTION_TENSORS, **MOE_TENSORS},
    **HF_EXPERT_KEYS,  # fused: gate rows first (DeepseekV2Experts.chunk(2))
    dense_layer_tensors={**ATTENTION_TENSORS, "w1": "mlp.gate_proj.weight", "w3": "mlp.up_proj.weight",
                         "w2": "mlp.down_proj.weight"},
    optional_tensors=Q_FIELDS,
)


def dummy_layer(spec: MoESpec, rnd, dtype: torch.dtype, layer: int = 0):
    """Deterministic weights of layer ``layer`` for benchmarks: norms are ones (the bias zeros), every matrix
    ``rnd(*shape)`` in field order (a :class:`DenseLayerWeights` for a dense layer)."""
    D, H, Dl, rd = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, vd, r = spec.qk_nope_head_dim, spec.value_head_dim, spec.q_lora_rank

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    attn = dict(attn_norm=ones(D), wkv_a=rnd(Dl + rd, D), kv_a_norm=ones(Dl), wkv_b=rnd(H * (nope + vd), Dl),
                wo=rnd(D, H * vd), ffn_norm=ones(D))
    q = dict(wq_a=rnd(r, D), q_a_norm=ones(r), wq_b=rnd(spec.q_size, r)) if r else dict(wq=rnd(spec.q_size, D))
    if spec.is_dense_layer(layer):
        Fd = spec.dense_intermediate_size
        return DenseLayerWeights(**attn, w1=rnd(Fd, D), w3=rnd(Fd, D), w2=rnd(D, Fd), **q)
    Fs = spec.num_shared_experts * spec.shared_intermediate_size
    bias = dict(e_bias=torch.zeros(spec.num_experts)) if spec.router_scoring == "sigmoid" else {}
    return LayerWeights(**attn, router=rnd(spec.num_experts, D), shared_w1=rnd(Fs, D), shared_w3=rnd(Fs, D),
                        shared_w2=rnd(D, Fs), **q, **bias)


# ---------------------------------------------------------------------------------------------------
# Config: config.json -> MoESpec (shared with deepseek_v3)
# ---------------------------------------------------------------------------------------------------
# transformers' DeepseekV2Config fields and the Hub config.json names, by how they are handled; the test walks
# DeepseekV2Config's fields and the Hub DeepSeek-V2-Lite config and fails on one in none of these sets.
COMMON_IMPLEMENTED = frozenset({
    "model_type", "_name_or_path", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads",  # == num_attention_heads only (MLA expands the latent to every head)
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "hidden_act",  # silu only
    "intermediate_size",  # the dense layers' MLP width
    "moe_intermediate_size",  # each routed (and shared) expert's width
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
    "moe_layer_freq",  # Hub name (not a transformers field): 1 only
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
    "attention_bias",  # false only
    "quantization",  # this package's packed expert pages (model/quantized.py)
}) | ROPE_CONFIG_KEYS  # default, linear, yarn (base.read_rope; yarn's mscale_all_dim scales softmax)
REFUSED_KEYS = QUANTIZED_REFUSED_KEYS
HARMLESS_KEYS = HARMLESS_COMMON_KEYS | {
    "aux_loss_alpha", "seq_aux",  # auxiliary losses: training only
    "pretraining_tp",  # unused by transformers 5's DeepSeek modeling
    "head_dim", "qk_head_dim",  # derived by the config class (qk_rope_head_dim, nope + rope), written to config.json
    "ep_size",  # the Hub code's expert-parallel world size: placement, not math
    "auto_map",  # the Hub's remote-code pointer (transformers' own class is the oracle)
}
IMPLEMENTED_KEYS = COMMON_IMPLEMENTED | {"mlp_bias"}  # DeepseekV2Config: false only
HIDDEN_ACTS = ("silu",)
DEFAULT_THETA = 1e4  # RoPE base when the config names none


def _int(get, key: str, minimum: int, family: str, what: str) -> int:
    v = get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise refuse(key, v, family, what)
    return v


def _rope_mapping(c: ConfigView) -> Mapping:
    """The rope mapping transformers reads (a config.json's rope_scaling wins over rope_parameters)."""
    for key in ("rope_scaling", "rope_parameters") if isinstance(c.cfg, Mapping) else ("rope_parameters",):
        rp = c.get(key)
        if isinstance(rp, Mapping) and rp:
            return rp
    return {}


def read_mla_spec(c: ConfigView, family: str, name: Optional[str], router: dict[str, Any]) -> MoESpec:
    """MoESpec of a DeepSeek config (V2 or V3): everything but the router and the RoPE layout, whose MoESpec fields
    (``router_*``, ``routed_scaling_factor``, ``norm_topk_prob``, ``rope_interleave``) come in ``router``.

    Raises ValueError naming the field for a missing one and for every value refused (module docstring).
    """
    get, need = c.get, c.need
    act = get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise refuse("hidden_act", act, family, ", ".join(repr(a) for a in HIDDEN_ACTS))
    for key in ("attention_bias", "mlp_bias"):
        if get(key, False):
            raise refuse(key, get(key), family, "False (projections without bias)")
    for key in REFUSED_KEYS:
        if get(key) is not None:
            raise refuse(key, get(key), family, "unquantized checkpoints and moe-batch quantize's packed pages")
    freq = get("moe_layer_freq", 1)
    if freq != 1:
        raise refuse("moe_layer_freq", freq, family, "1 (every layer from first_k_dense_replace on is MoE, as in "
                                                     "transformers)")
    num_layers = int(need("num_hidden_layers"))
    heads = int(need("num_attention_heads"))
    kv_heads = get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise refuse("num_key_value_heads", kv_heads, family, f"num_attention_heads={heads} (MLA expands the latent "
                                                                f"to every head)")
    first_dense = _int(get, "first_k_dense_replace", 0, family, "an int >= 0")
    if first_dense >= num_layers:
        raise refuse("first_k_dense_replace", first_dense, family,
                     f"< num_hidden_layers={num_layers} (at least one MoE layer)")
    experts = _int(get, "n_routed_experts", 1, family, ">= 1 routed experts")
    shared = _int(get, "n_shared_experts", 1, family, ">= 1 shared experts")
    kv_lora = _int(get, "kv_lora_rank", 1, family, "an int >= 1")
    q_lora = get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(get, "q_lora_rank", 1, family, "null (one q_proj) or an int >= 1")
    rd = _int(get, "qk_rope_head_dim", 2, family, "an even int >= 2")
    if rd % 2:
        raise refuse("qk_rope_head_dim", rd, family, "an even int >= 2")
    nope = _int(get, "qk_nope_head_dim", 1, family, "an int >= 1")
    vd = _int(get, "v_head_dim", 1, family, "an int >= 1")
    max_pos = int(get("max_position_embeddings", 2048))
    rope = read_rope(c, family, DEFAULT_THETA, max_pos)
    mscale_all_dim = float(_rope_mapping(c).get("mscale_all_dim") or 0.0) if rope["rope_type"] != "default" else 0.0
    eos = get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    model_type = get("model_type") or family
    F = int(need("moe_intermediate_size"))
    return MoESpec(
        name=name or str(get("_name_or_path") or model_type),
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=F,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rd,
        num_experts=experts,
        top_k=int(need("num_experts_per_tok")),
        **rope,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        sliding_window=None,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
        num_shared_experts=shared,
        shared_intermediate_size=F,  # transformers: one MLP of width n_shared_experts * moe_intermediate_size
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rd,
        v_head_dim=vd,
        dense_layers=tuple(range(first_dense)),
        dense_intermediate_size=int(need("intermediate_size")) if first_dense else 0,
        q_lora_rank=q_lora or 0,
        rope_mscale_all_dim=mscale_all_dim,
        **router,
    )


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a DeepSeek-V2 config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError naming the field: a missing one; ``topk_method`` other than greedy / group_limited_greedy (with
            its ``n_group`` / ``topk_group`` checked: ``layers.check_router_groups``), ``scoring_func`` other than
            softmax, ``norm_topk_prob`` true, and the values :func:`read_mla_spec` refuses.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get = c.get
    method = get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise refuse("topk_method", method, NAME, "'greedy', 'group_limited_greedy'")
    scoring = get("scoring_func", "softmax")
    if scoring != "softmax":
        raise refuse("scoring_func", scoring, NAME, "'softmax'")
    if get("norm_topk_prob", False):
        raise refuse("norm_topk_prob", get("norm_topk_prob"), NAME,
                     "False (transformers' DeepSeek-V2 router never renormalizes; DeepSeek's code does: they disagree)")
    n_group = topk_group = 0
    experts, top_k = c.need("n_routed_experts"), c.need("num_experts_per_tok")
    if method == "group_limited_greedy":
        n_group, topk_group = get("n_group"), get("topk_group")
        L.check_router_groups(experts, n_group, topk_group, top_k, NAME)
    router = dict(router_scoring="softmax", router_n_group=n_group, router_topk_group=topk_group,
                  routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), norm_topk_prob=False,
                  rope_interleave=True)  # the complex-number RoPE over adjacent pairs
    return read_mla_spec(c, NAME, name, router)


# ---------------------------------------------------------------------------------------------------
# Layer math
# ---------------------------------------------------------------------------------------------------
def _rotate(spec: MoESpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool) -> torch.Tensor:
    """RoPE of the rope part x [T, H, rd] (interleaved pairs or rotate-half, per spec.rope_interleave); ``fp32``:
    computed in fp32 and cast back (DeepSeek-V2's complex-number form), else in x's dtype (V3)."""
    dt = x.dtype
    if fp32:
        x, cos, sin = x.float(), cos.float(), sin.float()
    out = L.apply_rope_interleaved(x, cos, sin) if spec.rope_interleave else L.apply_rope(x, cos, sin)
    return out.to(dt)


def mla_pre_attention(lw, x: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
                      rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None, rope_fp32: bool = True,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, the query (compressed or not), the latent and the rope key, RoPE, for a packed batch of tokens.

    x: [T, D]; positions: int64 [T]; ``rope``: (cos, sin) [T, rd] of ``rope_cos_sin`` when the caller made them once.
    Returns q [T, Hq, nope + rd] (the rope part rotated), c [T, Dl] (normed latent), k_pe [T, rd] (rotated): c and
    k_pe are what the KV cache holds.
    """
    T, H, hd, rd, Dl = x.shape[0], spec.num_heads, spec.head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    nope = hd - rd
    h = L.rms_norm(x, lw.attn_norm, spec.rms_norm_eps)  # [T, D]
    if lw.wq_a is not None:
        q = F_.linear(L.rms_norm(F_.linear(h, lw.wq_a), lw.q_a_norm, LATENT_NORM_EPS), lw.wq_b)  # [T, Hq*hd]
    else:
        q = F_.linear(h, lw.wq)  # [T, Hq*hd]
    q = q.view(T, H, hd)
    c, k_pe = F_.linear(h, lw.wkv_a).split([Dl, rd], dim=-1)  # [T, Dl], [T, rd]
    c = L.rms_norm(c, lw.kv_a_norm, LATENT_NORM_EPS)  # [T, Dl]
    if rope is None:
        rope = L.rope_cos_sin(spec, positions, inv_freq.to(x.device), torch.float32 if rope_fp32 else x.dtype)
    cos, sin = rope  # [T, rd] each
    q_pe = _rotate(spec, q[..., nope:], cos, sin, rope_fp32)  # [T, Hq, rd]
    k_pe = _rotate(spec, k_pe[:, None, :], cos, sin, rope_fp32)[:, 0]  # [T, rd]
    return torch.cat([q[..., :nope], q_pe], dim=-1), c, k_pe


def pre_attention(lw, x, positions, spec, inv_freq, rope=None):
    """DeepSeek-V2's :func:`mla_pre_attention` (RoPE in fp32, as its complex-number form)."""
    return mla_pre_attention(lw, x, positions, spec, inv_freq, rope, rope_fp32=True)


def expand_latent(lw, c: torch.Tensor, k_pe: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from the latent (transformers' expand_kv). c: [T, Dl]; k_pe: [T, rd].
    Returns k [T, Hq, nope + rd], v [T, Hq, vd]."""
    T, H, nope = c.shape[0], spec.num_heads, spec.qk_nope_head_dim
    kv = F_.linear(c, lw.wkv_b).view(T, H, nope + spec.value_head_dim)  # [T, Hq, nope + vd]
    k_nope, v = kv.split([nope, spec.value_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, k_pe.shape[-1])], dim=-1)  # [T, Hq, hd]
    return k, v


def prefill_attention_packed(lw, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, spans: list[tuple[int, int]],
                             spec: MoESpec, layout=None) -> torch.Tensor:
    """Causal MLA over a packed chunk, the latent expanded per head (as transformers computes prefill).
    q: [T, Hq, hd]; c: [T, Dl]; k_pe: [T, rd]. Returns [T, Hq*vd]."""
    k, v = expand_latent(lw, c, k_pe, spec)
    return L.prefill_attention_packed(q, k, v, spans, None, layout, scale=spec.softmax_scale)


def _kv_b_heads(lw, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [Hq, nope, Dl] and W_UV [Hq, vd, Dl]: kv_b_proj's rows per head."""
    w = lw.wkv_b.view(spec.num_heads, spec.qk_nope_head_dim + spec.value_head_dim, spec.kv_lora_rank)
    return w[:, :spec.qk_nope_head_dim], w[:, spec.qk_nope_head_dim:]


def mla_absorb(lw, q: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The decode query over the latent cache: ``[q_nope W_UK, q_pe]`` per head. q: [B, Hq, hd] -> [B, Hq, Dl + rd]."""
    w_uk = _kv_b_heads(lw, spec)[0]  # [Hq, nope, Dl]
    nope = spec.qk_nope_head_dim
    q_lat = torch.einsum("bhn,hnd->bhd", q[..., :nope], w_uk)  # [B, Hq, Dl]
    return torch.cat([q_lat, q[..., nope:]], dim=-1)


def latent_attention(q_lat: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Decode attention over the latent cache (torch reference): every head attends to one shared key ``[c, k_pe]``
    per position with logits ``q_lat . [c, k_pe] * softmax_scale``; the value is c. Softmax in fp32; row b sees its
    first ``lengths[b]`` positions. q_lat: [B, Hq, Dl + rd]; cache: [B, S, Dl + rd]; lengths int64 [B].
    Returns the attention-weighted latents [B, Hq, Dl] in q_lat's dtype (kernels.cpu_latent_attention's torch
    routine; its native kernel is the CPU executors' fast path)."""
    return latent_attention_torch(q_lat, cache, lengths, spec.kv_lora_rank, spec.softmax_scale)


def mla_unabsorb(lw, o_lat: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Per-head values from the attention-weighted latents: ``o_lat W_UV^T``. o_lat: [B, Hq, Dl] -> [B, Hq*vd]."""
    w_uv = _kv_b_heads(lw, spec)[1]  # [Hq, vd, Dl]
    return torch.einsum("bhd,hvd->bhv", o_lat.to(w_uv.dtype), w_uv).reshape(o_lat.shape[0], -1)


def decode_attention(lw, q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """MLA decode over the latent cache, all on one device (the reference the executors compose):
    :func:`mla_unabsorb` (:func:`latent_attention` (:func:`mla_absorb` (q))). q: [B, Hq, hd]; cache [B, S, Dl + rd];
    lengths [B]. Returns [B, Hq*vd]."""
    return mla_unabsorb(lw, latent_attention(mla_absorb(lw, q, spec), cache, lengths, spec), spec)


def shared_experts(lw, h: torch.Tensor) -> torch.Tensor:
    """The shared experts of an MoE layer: one SwiGLU MLP of width n_shared * F, ungated. h: [T, D] -> [T, D]."""
    return L.swiglu(h, lw.shared_w1, lw.shared_w3, lw.shared_w2)


def route(lw, h: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's router by ``spec.router_scoring``: softmax (V2, greedy or group-limited) or sigmoid with the
    correction bias (V3). h: [T, D] -> (weights fp32 [T, k], ids int64 [T, k])."""
    if spec.router_scoring == "sigmoid":
        return L.route_sigmoid_biased(h, lw.router, lw.e_bias, spec.top_k, spec.router_n_group, spec.router_topk_group,
                                      spec.norm_topk_prob, spec.routed_scaling_factor)
    return L.route_softmax_grouped(h, lw.router, spec.top_k, spec.router_n_group, spec.router_topk_group,
                                   spec.routed_scaling_factor)


def post_attention(lw, ew, x: torch.Tensor, attn: torch.Tensor, spec: MoESpec, ffn=None) -> torch.Tensor:
    """o_proj + residual, RMSNorm, then routed experts + the shared experts (MoE layer) or the dense MLP (a
    :class:`DenseLayerWeights` layer), residual. x: [T, D]; attn: [T, Hq*vd] -> [T, D]."""
    if isinstance(lw, DenseLayerWeights):
        return L.dense_post_attention(lw, x, attn, spec)
    return L.moe_post_attention(lw, ew, x, attn, spec, ffn, shared=shared_experts, router=route)


FAMILY = Family(**module_fields(globals()), model_types=("deepseek_v2",), architectures=("DeepseekV2ForCausalLM",),
                attention="mla")
