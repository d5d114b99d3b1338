"""Decoder building blocks shared by the model families, as plain torch functions (gpt-fast style).

Each piece is a pure function over explicit tensors so that the executors (serial and CGOPipe) can place every
piece on the device they choose: the projections and the experts on the GPU, decode attention on the CPU over a
CPU KV cache. A family (``model/families/``) composes these into its layer (``pre_attention``, ``post_attention``)
and adds what is its own; the executors reach them only through the family (``families.family_of(spec)``).
The math follows Hugging Face transformers' modeling files (the oracle in our tests) with one deliberate
difference: router logits are computed in fp32 whatever the weight dtype (transformers computes them in the weight
dtype), so that two experts whose logits differ by less than bf16 resolution are ranked as fp32 ranks them.

Dimension key used in shape comments (here and in every family module):
    T: tokens in a packed (ragged) batch      B: sequences        S: key/value positions
    D: hidden size    Hq: query heads    Hkv: key/value heads    G: Hq // Hkv    hd: head dim
    E: experts        k: top-k           F: expert FFN width      V: vocabulary
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F_

from ..kernels import norm_rope as _nr
from ..kernels import prefill_attention as _pa
from ..kernels.cpu_attention import decode_attention_torch, decode_attention_torch_masked
from .spec import MoESpec


# ---------------------------------------------------------------------------------------------------
# The routed experts of one layer (host or device tensors; HF layout: [out_features, in_features]).
# A family's non-expert weights are its own dataclass (families/<family>.py: LayerWeights).
# ---------------------------------------------------------------------------------------------------
@dataclass
class ExpertWeights:
    """The routed experts of one layer, stacked: expert e is ``w1[e], w3[e], w2[e]`` (and, for a family whose experts
    carry biases, ``MoESpec.expert_bias``: ``b1[e], b3[e], b2[e]``; None otherwise)."""

    w1: torch.Tensor  # [E, F, D] gate_proj
    w3: torch.Tensor  # [E, F, D] up_proj
    w2: torch.Tensor  # [E, D, F] down_proj
    b1: Optional[torch.Tensor] = None  # [E, F] gate bias (gpt-oss)
    b3: Optional[torch.Tensor] = None  # [E, F] up bias
    b2: Optional[torch.Tensor] = None  # [E, D] down bias

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked tensors (the biases too, when present)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def cast(self, dtype: torch.dtype) -> "ExpertWeights":
        """The same experts in ``dtype`` (biases included)."""
        return ExpertWeights(*(None if t is None else t.to(dtype)
                               for t in (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2)))

    def to(self, device, non_blocking: bool = False) -> "ExpertWeights":
        """Copy to ``device`` (the serial executor's layer-by-layer host->device transfer)."""
        return ExpertWeights(*(None if t is None else t.to(device, non_blocking=non_blocking)
                               for t in (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2)))


# ---------------------------------------------------------------------------------------------------
# Norm and rotary embedding
# ---------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``, statistics in fp32.

    x: [..., D] any float dtype; weight: [D]. Returns x's dtype (as transformers' MixtralRMSNorm). On CUDA, with triton
    installed and x / weight one dtype of bf16 / fp16 / fp32, one fused Triton launch
    (``kernels.norm_rope.rms_norm_triton``: the same roundings, the fp32 mean summed in another order); else the torch
    reference ``kernels.norm_rope.rms_norm_torch``.
    """
    if _nr.rms_norm_uses_triton(x, weight):
        return _nr.rms_norm_triton(x, weight, eps)
    return _nr.rms_norm_torch(x, weight, eps)


def _rope_base_freqs(spec: MoESpec, device=None) -> torch.Tensor:
    """``theta^(2i/hd)`` for i < hd/2: the wavelengths / 2 pi of default RoPE (Su et al. 2021, RoFormer eq. 15). fp32 [hd/2]
    (hd: ``spec.rope_dim``, the rotated dims: MLA's qk_rope_head_dim)."""
    hd = spec.rope_dim
    return spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)


def yarn_correction_range(spec: MoESpec) -> tuple[float, float]:
    """YaRN's ramp ends (Peng et al. 2023, arXiv 2309.00071, eq. 17-18): the dims d where a wavelength fits
    ``beta_fast`` and ``beta_slow`` times into the original context L: ``d(b) = hd ln(L / (2 pi b)) / (2 ln theta)``;
    floored / ceiled with ``rope_truncate``, clamped to [0, hd - 1] (transformers' find_correction_range)."""
    hd, base, L = spec.rope_dim, spec.rope_theta, spec.rope_original_max_position_embeddings

    def dim(rotations: float) -> float:
        return hd * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim(spec.rope_beta_fast), dim(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, hd - 1)


def rope_inv_freq(spec: MoESpec, device=None) -> torch.Tensor:
    """RoPE inverse frequencies of ``spec.rope_type``, fp32 [hd/2] (transformers' modeling_rope_utils, bit for bit):

    - default: ``1 / theta^(2i/hd)``;
    - linear (position interpolation, Chen et al. 2023): the default ones divided by ``rope_factor``;
    - yarn (Peng et al. 2023, "NTK-by-parts"): per dim i a blend ``interp * (1 - e_i) + extrap * e_i`` of the
      interpolated (``/ rope_factor``) and default frequencies, ``e_i = 1 - clamp((i - low) / (high - low), 0, 1)``
      over :func:`yarn_correction_range` (high dims, long wavelengths, are interpolated). Its cos/sin scale
      ``rope_attention_factor`` is applied by :func:`rope_cos_sin`.
    """
    pos_freqs = _rope_base_freqs(spec, device)  # [hd/2]
    if spec.rope_type == "default":
        return 1.0 / pos_freqs
    if spec.rope_type == "linear":
        return 1.0 / pos_freqs / spec.rope_factor
    if spec.rope_type == "yarn":
        extrap = 1.0 / pos_freqs  # [hd/2]
        interp = 1.0 / (spec.rope_factor * pos_freqs)  # [hd/2]
        low, high = yarn_correction_range(spec)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(spec.rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [hd/2]
        extrap_factor = 1 - ramp.to(device)  # [hd/2] 1: extrapolate, 0: interpolate
        return interp * (1 - extrap_factor) + extrap * extrap_factor
    raise ValueError(f"{spec.name}: rope_type {spec.rope_type!r} is not implemented")


def rope_cos_sin(spec: MoESpec, positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer positions, each times ``spec.rope_attention_factor`` (YaRN's attention
    temperature folded into q and k, as transformers' rotary embeddings do; 1.0 but for yarn).

    positions: int64 [T]; inv_freq: fp32 [hd/2] (:func:`rope_inv_freq`). Returns (cos, sin), each [T, hd] in ``dtype``.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2] fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
    scale = spec.rope_attention_factor
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, hd] by per-token cos/sin [T, hd] (rotate-half convention, as HF Mixtral).

    On CUDA, with triton installed and x / cos / sin one dtype of bf16 / fp16 / fp32, one fused Triton launch
    (``kernels.norm_rope.apply_rope_triton``, bitwise equal); else the torch reference ``kernels.norm_rope.apply_rope_torch``.
    """
    if _nr.apply_rope_uses_triton(x, cos, sin):
        return _nr.apply_rope_triton(x, cos, sin)
    return _nr.apply_rope_torch(x, cos, sin)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, hd] whose rotary dims are interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek), pair i by
    frequency i, with cos/sin [T, hd] of :func:`rope_cos_sin` (its first half holds one value per frequency).

    Returns ``cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)`` [T, H, hd]: the rotated pairs
    de-interleaved (transformers' ``apply_rotary_pos_emb_interleave``, bit for bit). A query and a key rotated alike
    keep their dot product, so this also serves DeepSeek-V2's complex-number form (which keeps the pairs in place).
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, hd/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, hd/2] each
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # [T, H, hd]


def qkv_heads(h: torch.Tensor, spec: MoESpec, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
              bq: Optional[torch.Tensor] = None, bk: Optional[torch.Tensor] = None,
              bv: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v projections of a GQA layer, split into heads. h: [T, D] (normed); wq: [Hq*hd, D]; wk, wv:
    [Hkv*hd, D]; b*: their biases or None. Returns q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] in h's dtype."""
    T, hd = h.shape[0], spec.head_dim
    q = F_.linear(h, wq, bq).view(T, spec.num_heads, hd)  # [T, Hq, hd]
    k = F_.linear(h, wk, bk).view(T, spec.num_kv_heads, hd)  # [T, Hkv, hd]
    v = F_.linear(h, wv, bv).view(T, spec.num_kv_heads, hd)  # [T, Hkv, hd]
    return q, k, v


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, spec: MoESpec, inv_freq: torch.Tensor,
            rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, hd] and k [T, Hkv, hd] rotated by :func:`apply_rope` (rotate-half) with the tables ``rope`` (cos,
    sin [T, hd]: :func:`rope_cos_sin` of ``positions`` [T], made once for all layers by the caller), else with
    ``rope_cos_sin(spec, positions, inv_freq, q.dtype)`` made here. Returns (q, k), shapes and dtype kept."""
    cos, sin = rope if rope is not None else rope_cos_sin(spec, positions, inv_freq.to(q.device), q.dtype)  # [T, hd]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------
def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: Optional[int] = None
) -> torch.Tensor:
    """Causal GQA self-attention of ONE sequence over its own prompt (prefill).

    q: [S, Hq, hd]; k, v: [S, Hkv, hd]. Token i attends to j <= i (and j > i - sliding_window when set).
    Softmax in fp32. Returns [S, Hq*hd] in q's dtype.
    """
    S, Hq, hd = q.shape
    G = Hq // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, S, hd]
    kh = k.transpose(0, 1).repeat_interleave(G, dim=0)  # [Hq, S, hd]
    vh = v.transpose(0, 1).repeat_interleave(G, dim=0)  # [Hq, S, hd]
    i = torch.arange(S, device=q.device)
    allowed = i[None, :] <= i[:, None]  # [S, S] causal
    if sliding_window is not None:
        allowed &= i[None, :] > i[:, None] - sliding_window
    scores = torch.matmul(qh, kh.transpose(1, 2)) / math.sqrt(hd)  # [Hq, S, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [Hq, S, S]
    out = torch.matmul(probs, vh)  # [Hq, S, hd]
    return out.transpose(0, 1).reshape(S, Hq * hd)


# decode attention lives beside the native CPU kernel as its torch reference (kernels import nothing of the project)
decode_attention = decode_attention_torch
# the same with its mask given (kernels.cpu_attention.decode_mask(lengths, S, sliding_window), bool [B, 1, 1, S]): a
# caller that attends every layer of a decode step over the same lengths makes it once (GroupedKVCache.attend_masked)
decode_attention_masked = decode_attention_torch_masked


# ---------------------------------------------------------------------------------------------------
# Router and experts
# ---------------------------------------------------------------------------------------------------
def route(h: torch.Tensor, router_w: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax router (Mixtral: Jiang et al. 2024, arXiv 2401.04088, eq. 1-2).

    h: [T, D] normed hidden states (any dtype); router_w: [E, D]. Logits, softmax and top-k are all
    computed in fp32 whatever the weight dtype. With ``normalize`` the k probabilities are rescaled to
    sum to 1 (Mixtral always; Qwen2-MoE/OLMoE per ``norm_topk_prob``).
    Returns (weights fp32 [T, k], expert ids int64 [T, k]).
    """
    logits = F_.linear(h.float(), router_w.float())  # [T, E] fp32
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    w, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def check_router_groups(num_experts: int, n_group: int, topk_group: int, top_k: int, family: str,
                        min_group_size: int = 1) -> None:
    """Check a group-limited router's numbers (DeepSeek-V2 ``group_limited_greedy``, DeepSeek-V3): ``n_group`` must
    divide the experts, ``1 <= topk_group <= n_group``, each group must hold ``min_group_size`` experts (V3 scores a
    group by its top 2) and the kept groups must hold ``top_k`` experts (else transformers' choice among the masked
    ones depends on torch.topk's order of equal values). Raises ValueError naming the config fields."""
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"config field 'n_group': {n_group!r} must be an int >= 1 that divides the routed experts "
                         f"(n_routed_experts={num_experts}) for the {family} family's group-limited router")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"config field 'topk_group': {topk_group!r} must be an int in 1..n_group={n_group} for the "
                         f"{family} family's group-limited router")
    size = num_experts // n_group
    if size < min_group_size:
        raise ValueError(f"config fields 'n_group' and 'n_routed_experts': {n_group} groups of {num_experts} experts "
                         f"hold {size} each; the {family} family's router scores a group by its top {min_group_size}")
    if top_k > topk_group * size:
        raise ValueError(f"config fields 'num_experts_per_tok' and 'topk_group': top-{top_k} from {topk_group} kept "
                         f"groups of {size} experts is not implemented by the {family} family (at most "
                         f"topk_group * n_routed_experts / n_group = {topk_group * size})")


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """bool [T, E]: the experts of each token's ``topk_group`` best groups (group_scores fp32 [T, n_group]), with
    transformers' ops (topk unsorted, scatter, expand), so ties break as they do there."""
    n_group = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores)  # [T, n_group]
    group_mask.scatter_(1, group_idx, 1)
    return (group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group)
            .reshape(-1, num_experts).bool())  # [T, E]


def route_softmax_grouped(h: torch.Tensor, router_w: torch.Tensor, top_k: int, n_group: int = 0,
                          topk_group: int = 0, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router (transformers' ``DeepseekV2TopkRouter``): softmax over all experts in fp32; with
    ``n_group`` > 0 (``topk_method: group_limited_greedy``) each group of E / n_group experts is scored by its best
    expert, the ``topk_group`` best groups are kept and every other expert's score is set to 0; then top-k of the
    scores (never renormalized) times ``routed_scaling_factor``. n_group 0: ``greedy`` (plain top-k).

    h: [T, D] (any dtype); router_w: [E, D]. Returns (weights fp32 [T, k], expert ids int64 [T, k]) in
    torch.topk's unsorted order. The numbers are checked by :func:`check_router_groups` (the config reader does).
    """
    logits = F_.linear(h.float(), router_w.float())  # [T, E] fp32
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if n_group:
        E = scores.shape[-1]
        group_scores = scores.view(-1, n_group, E // n_group).max(dim=-1).values  # [T, n_group]
        scores = scores.masked_fill(~_group_mask(group_scores, topk_group, E), 0.0)  # [T, E]
    w, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)  # [T, k]
    return w * routed_scaling_factor, ids


def route_sigmoid_biased(h: torch.Tensor, router_w: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                         n_group: int, topk_group: int, normalize: bool,
                         routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``; GLM-4.5's is the same): sigmoid scores in fp32;
    the choice is made on ``scores + correction_bias`` (``e_score_correction_bias``, for selection only): each of
    the ``n_group`` groups is scored by the sum of its top 2, the ``topk_group`` best groups are kept (the others at
    -inf), top-k; the weights are the chosen experts' UNBIASED scores, divided by their sum (+ 1e-20) with
    ``normalize`` (``norm_topk_prob``), times ``routed_scaling_factor``.

    h: [T, D]; router_w: [E, D]; correction_bias: [E] (any dtype; used in fp32). Returns (weights fp32 [T, k],
    expert ids int64 [T, k]) in torch.topk's unsorted order.
    """
    logits = F_.linear(h.float(), router_w.float())  # [T, E] fp32
    scores = logits.sigmoid()  # [T, E]
    choice = scores + correction_bias.float()  # [T, E] selection only
    E = scores.shape[-1]
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
    choice = choice.masked_fill(~_group_mask(group_scores, topk_group, E), float("-inf"))  # [T, E]
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    w = scores.gather(1, ids)  # [T, k] unbiased
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids


ExpertsFn = Callable[[torch.Tensor, ExpertWeights, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_ffn(x: torch.Tensor, ew: ExpertWeights, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor] = F_.silu) -> torch.Tensor:
    """Routed gated experts: ``y_t = sum_j w_tj * (act(x_t W1_e^T) * (x_t W3_e^T)) W2_e^T`` with e = ids[t, j]
    (``act`` = silu: SwiGLU, Mixtral).

    Grouped by expert (tokens gathered per expert; experts that receive no token are skipped), with the
    accumulation order of ``kernels.fused_moe.experts_ffn_reference(order="hf")`` (transformers 5's
    default Mixtral experts path: routing weight applied after down_proj in fp32, the k slots summed in
    fp32, one cast to x's dtype). x: [T, D]; ew: [E, F, D] / [E, D, F] on x's device; topk_w fp32 [T, k];
    topk_ids int64 [T, k]. Returns [T, D] in x's dtype.
    """
    from ..kernels.fused_moe import experts_ffn_reference

    return experts_ffn_reference(x, ew.w1, ew.w3, ew.w2, topk_w, topk_ids, act=act)


def swiglu(h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One dense SwiGLU MLP ``(silu(h W1^T) * (h W3^T)) W2^T`` (a dense layer's MLP, a shared expert), in h's dtype.

    h: [T, D]; w1, w3: [F, D] (gate_proj, up_proj); w2: [D, F] (down_proj). Returns [T, D].
    """
    return F_.linear(F_.silu(F_.linear(h, w1)) * F_.linear(h, w3), w2)  # [T, D]


def head_logits(x: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm and lm_head in the model dtype: x: [T, D] -> [T, V] in the GEMM's dtype (:func:`final_logits`
    before its fp32 cast)."""
    return F_.linear(rms_norm(x, norm_w, eps), lm_head)


def final_logits(x: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm and lm_head. x: [T, D] -> fp32 logits [T, V]: ``head_logits(...).float()`` (named by its
    ``model_dtype_logits`` attribute: :func:`model_dtype_head`)."""
    return head_logits(x, norm_w, lm_head, eps).float()


final_logits.model_dtype_logits = head_logits


def model_dtype_head(final_logits: Callable) -> Optional[Callable]:
    """The model-dtype head of a family's ``final_logits``, or None. A ``final_logits`` that is exactly
    ``head(x, norm_w, lm_head, eps).float()`` (the cast its only math after the GEMM) names ``head`` in its
    ``model_dtype_logits`` attribute, so the scoring head (``pipeline.token_scores``) can read the logits before the
    cast without changing the math; one that does more after the GEMM (a soft-cap, a scale) must not set it, and
    scoring then takes ``final_logits`` itself (the torch path)."""
    return getattr(final_logits, "model_dtype_logits", None)


def packed_cu_seqlens(spans: list[tuple[int, int]], device) -> tuple[torch.Tensor, int]:
    """(int32 cumulative lengths [B + 1] on ``device``, the longest span) of spans consecutive from 0 (the packed
    chunk's rows): a host list copied without a stream sync, as :func:`prefill_packed_layout` copies."""
    cu = torch.tensor([0] + [e for _, e in spans], dtype=torch.int32).to(device, non_blocking=True)  # [B + 1]
    return cu, max(e - s for s, e in spans)


def spans_packed(spans: list[tuple[int, int]], T: int) -> bool:
    """Whether ``spans`` cover rows 0..T consecutively (what the packed fused kernels take)."""
    return bool(spans) and spans[-1][1] == T and all(a == b for (_, a), (b, _) in zip([(0, 0)] + spans, spans))


def prefill_packed_layout(spans: list[tuple[int, int]], T: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors of :func:`prefill_attention_packed` for one packed chunk (the same for every layer, so callers
    may build them once): ``src`` int64 [B, S] (packed token of each (sequence, position); pad slots point at token
    0), ``keep`` int64 [T] (rows of [B*S] that hold real tokens, in packed order), ``valid`` bool [B, S] (real
    tokens). Built on the host and copied to ``device`` without a stream sync: 17 bytes per padded token."""
    lens = torch.tensor([e - s for s, e in spans])
    S = int(lens.max())
    # index of each (sequence, position) in the packed dim; pad slots point at token 0 and are masked
    pos = torch.arange(S)
    starts = torch.tensor([s for s, _ in spans])
    src = (starts[:, None] + pos[None, :]).clamp(max=T - 1)  # [B, S]
    valid = pos[None, :] < lens[:, None]  # [B, S]
    keep = valid.flatten().nonzero().squeeze(1)  # [T] rows of [B*S] that hold real tokens (on the host: no GPU sync)
    # non_blocking: a blocking H2D copy of a pageable tensor synchronizes the stream (the host would wait for the
    # GPU once per chunk and layer); a pageable source is staged by CUDA before the call returns, so this is safe
    return tuple(t.to(device, non_blocking=True) for t in (src, keep, valid))


def packed_attention_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                              sliding_window: Optional[int], layout=None, mask: bool = True):
    """The padded operands of packed prefill attention: (qp, kp, vp [B, Hq, S, *] with k, v repeated to every query
    head, allowed [B, S(q), S(k)]: causal, within the sequence and the sliding window (None without ``mask``), keep
    [T]: the packed rows of the [B*S] output). q: [T, Hq, hd]; k, v: [T, Hkv, *]; ``layout``:
    :func:`prefill_packed_layout` of the spans."""
    G = q.shape[1] // k.shape[1]
    src, keep, valid = layout if layout is not None else prefill_packed_layout(spans, q.shape[0], q.device)
    S = src.shape[1]
    allowed = None
    if mask:
        i = torch.arange(S, device=q.device)
        allowed = (i[None, :] <= i[:, None])[None] & valid[:, None, :]  # [B, S(q), S(k)]
        if sliding_window is not None:
            allowed &= (i[None, :] > i[:, None] - sliding_window)[None]
    qp = q[src].permute(0, 2, 1, 3)  # [B, Hq, S, hd]
    kp = k[src].permute(0, 2, 1, 3).repeat_interleave(G, dim=1)  # [B, Hq, S, hd]
    vp = v[src].permute(0, 2, 1, 3).repeat_interleave(G, dim=1)  # [B, Hq, S, v_hd]
    return qp, kp, vp, allowed, keep


def prefill_attention_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], sliding_window: Optional[int] = None,
    layout: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None, scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal GQA attention of several sequences packed token-wise, in one fused call (prefill).

    q: [T, Hq, hd]; k, v: [T, Hkv, hd]; spans: (start, end) of each sequence in the packed dim; ``layout``:
    :func:`prefill_packed_layout` of these spans (built here when None).
    On CUDA, where torch's varlen flash attention takes the operands (:mod:`..kernels.prefill_attention`), one call
    on the packed rows. Otherwise sequences are padded at their ends to the longest (S) into [B, H, S, hd]; each query
    sees its own sequence's keys j <= i (``is_causal``; with a sliding window a mask, also j > i - sliding_window); one fused ``scaled_dot_product_attention`` call
    (fp32 softmax inside the kernel; on CUDA the memory-efficient kernel first: no plan per new chunk shape).
    Logits scaled by ``scale`` (default 1/sqrt(hd)); v may have its own head width v_hd (MLA). Returns
    [T, Hq*v_hd] in q's dtype. Equals :func:`prefill_attention` per sequence up to floating-point summation order.

    Where varlen refuses the operands (v narrower than q / k: MLA; fp32) and triton is importable, the CUDA path is
    this package's Triton flash attention on the packed rows instead (``kernels.prefill_attention.use_triton``;
    ``LIGHTNING_MOE_PREFILL_ATTENTION=triton`` takes it wherever it runs). The CPU path is never changed by it.
    """
    Hq = q.shape[1]
    mode = _pa.prefill_attention_mode()
    packed = spans_packed(spans, q.shape[0])  # 0..T, no gaps
    triton = packed and _pa.use_triton(q, k, v, sliding_window, scale, mode)  # what varlen refuses: MLA's widths, fp32
    if triton or (packed and _pa.use_varlen(q, k, v, sliding_window, scale, mode)):
        cu, longest = packed_cu_seqlens(spans, q.device)
        fn = _pa.attention_varlen_triton if triton else _pa.attention_varlen
        o = fn(q, k, v, cu, longest, sliding_window, scale)  # [T, Hq, v_hd]
        return o.reshape(q.shape[0], Hq * v.shape[-1])
    qp, kp, vp, allowed, keep = packed_attention_operands(q, k, v, spans, sliding_window, layout,
                                                          mask=sliding_window is not None)
    B, _, S, _ = qp.shape
    # fused SDPA (memory-efficient kernel on CUDA): never materializes the [B, Hq, S, S] scores,
    # whose fp32 copy is ~185 MB for 8 prompts of 425 tokens with 32 heads and is not in the planner's workspace.
    # Without a sliding window no mask: sequences are padded at their ends, so a kept query i < len sees only its
    # own keys j <= i under is_causal (a pad query's row is dropped by keep). SDPA turned a boolean [B, 1, S, S]
    # mask into a float one on every call: 45 ms per layer on 2 CPU cores at 16 x 425, more than the attention.
    with _pa.sdpa_backends(q.device, mode):
        o = F_.scaled_dot_product_attention(qp, kp, vp, attn_mask=None if allowed is None else allowed[:, None],
                                            is_causal=allowed is None, scale=scale)  # [B, Hq, S, v_hd]
    out = o.permute(0, 2, 1, 3).reshape(B * S, Hq * v.shape[-1])  # [B*S, Hq*v_hd]
    # packed order (spans are consecutive); an index computed on the host, not out[valid], whose boolean indexing
    # synchronized the host with the GPU once per prefill chunk and layer
    return out.index_select(0, keep)  # [T, Hq*hd]


def moe_post_attention(lw, ew: Optional[ExpertWeights], x: torch.Tensor, attn: torch.Tensor, spec: MoESpec,
                       ffn: Optional[ExpertsFn] = None,
                       shared: Optional[Callable[..., torch.Tensor]] = None,
                       router: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None) -> torch.Tensor:
    """o_proj + residual, RMSNorm, router (top-k renormalized per ``spec.norm_topk_prob``), experts (+ the shared
    expert), residual: the post-attention half of a decoder layer whose weights carry ``wo``, ``ffn_norm`` and
    ``router``.

    x: [T, D] the layer input (residual stream); attn: [T, Hq*hd] attention output; ``ffn(h, ew, topk_w,
    topk_ids)``: the expert FFN (default :func:`experts_ffn`; the executors pass theirs; ``ew`` may be None when
    ``ffn`` holds the experts); ``shared(lw, h) -> [T, D]``: the family's always-on shared expert(s) over the normed
    hidden states, added to the routed output (None: no shared expert); ``router(lw, h, spec) -> (topk_w, topk_ids)``:
    the family's router (None: :func:`route` over ``lw.router``). Returns the layer output [T, D].
    """
    ffn = experts_ffn if ffn is None else ffn
    x = x + F_.linear(attn.to(x.dtype), lw.wo)  # [T, D]
    h = rms_norm(x, lw.ffn_norm, spec.rms_norm_eps)  # [T, D]
    if router is None:
        topk_w, topk_ids = route(h, lw.router, spec.top_k, spec.norm_topk_prob)  # [T, k] each
    else:
        topk_w, topk_ids = router(lw, h, spec)  # [T, k] each
    y = ffn(h, ew, topk_w, topk_ids)  # [T, D] routed experts
    if shared is not None:
        y = y + shared(lw, h)  # [T, D]
    return x + y  # [T, D]


def dense_post_attention(lw, x: torch.Tensor, attn: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """o_proj + residual, RMSNorm, one dense SwiGLU MLP (:func:`swiglu` of ``lw.w1, lw.w3, lw.w2``), residual: the
    post-attention half of a dense (MLP-only) layer: no router, no routed or shared experts.

    x: [T, D] the layer input; attn: [T, Hq*hd]. Returns the layer output [T, D].
    """
    x = x + F_.linear(attn.to(x.dtype), lw.wo)  # [T, D]
    h = rms_norm(x, lw.ffn_norm, spec.rms_norm_eps)  # [T, D]
    return x + swiglu(h, lw.w1, lw.w3, lw.w2)  # [T, D]
