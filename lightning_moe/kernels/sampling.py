"""Token sampling on the logits' device: temperature, min-p, top-k, top-p, one uniform per row (issue 43).

* :func:`sample_tokens` -- the vectorized sampler: ``[B, V]`` logits (any float dtype, any device) and ``[B]``
  uniforms in ``[0, 1)`` in, ``int64 [B]`` token ids on the logits' device out; no per-row Python loop, no host sync.
* :func:`uniforms_from_seeds` -- the ``[B]`` float64 uniforms of ``[B]`` 63-bit per-draw seeds (the top 53 bits).
* :func:`sample_tokens_reference` -- the per-row loop in float64 that tests compare against (never on a hot path).

Semantics (vLLM's v1 sampler, ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``), in this order:

1. ``temperature <= 0``: greedy, ``argmax`` of the raw logits (lowest id on ties); no uniforms needed.
2. ``x = fp32(logits) / temperature``.
3. min-p (``min_p > 0``): keep the tokens with ``p >= min_p * max p`` (``x >= max x + log(min_p)``).
4. top-k (``0 < top_k < V``; ``top_k <= 0`` is off, vLLM's -1 / 0): keep the tokens with ``x >=`` the k-th largest x,
   ties at the k-th value all kept (vLLM's ``apply_top_k_only``).
5. top-p (``top_p < 1``): the kept tokens renormalized and ranked by probability, ties by lower id first; keep a token
   when the mass ranked strictly before it is ``< top_p`` (the first always stays; vLLM's ``probs_sum <= 1 - p``
   drop rule read from the other end).
6. One draw from the kept tokens in proportion to ``exp(x)``.

How a draw is made, and why. Each row gets ONE uniform ``u`` (from its request seed and output position,
:func:`uniforms_from_seeds` of the host's splitmix64 ``position_seed``: B Python ints, B float64s sent to the
device). The token is the inverse CDF of the kept mass in token-id order: the smallest id whose cumulative mass
exceeds ``u * total``. So a row's token is a function of its own logits and its own ``u`` only: the same whatever
batch it lands in and wherever a run resumed (batch- and resume-invariant by construction, no generator state).
The CDF is two-level, so no rounding error grows along V and no ``[B, V]`` scan or float64 buffer is needed: per
block of :data:`BLOCK` tokens an fp32 sum (torch's pairwise reduction, relative error ~1e-7), a float64 cumsum of
those ``[B, V / BLOCK]`` sums picks the block, then a float64 cumsum of that one block (``[B, BLOCK]``) picks the
token. The distribution is the target's up to fp32 rounding of each ``exp(x - max x)`` and of the block sums
(relative ~1e-7 of the row's mass) and the 53-bit resolution of ``u``; a plain fp32 cumsum over V would drift by up to
~V * 6e-8 of the mass (1e-2 at V = 200 000) on a sequential CPU scan.

Cost. Without top-p the pass is elementwise + reductions: scale, (min-p compare), (``topk`` of k values per row),
``exp``, block sums, two small searches -- about four reads of ``[B, V]`` fp32 and no sort. top-p adds one stable
sort of ``[B, V]`` (as vLLM's native path does), a softmax and a cumsum in sorted order, and a scatter back.
The alternative, Gumbel-max / exponential race (vLLM's FlashInfer-free path: ``probs / Exp(1)`` then argmax), needs
``B * V`` random numbers per step; counter-based ones (a hash of (row seed, token id)) cost ~10 integer operations per
element -- measurable on the CPU (B = 80, V = 32000: 2.6 M hashes per step) and a full extra ``[B, V]`` pass on the
GPU -- for the same exactness. Inverse CDF needs B random numbers. Measured on this project's 2-core CPU host
(``benchmarks/bench_sampler.py``, V = 32000, temperature 1): see docs/DESIGN.md "Sampling"; GPU numbers (B = 2048,
V = 32000..200000) are not measured yet. Memory: one fp32 ``[B, V_pad]`` work buffer (plus the sort's keys and
indices with top-p), ``V_pad`` = V rounded up to a multiple of
:data:`BLOCK` (V itself when V <= BLOCK): 1.6 GB fp32 at B = 2048, V = 200 000, and the sort's int64 indices twice
that; a caller may split B into row chunks to bound it, the draws being batch-invariant.

Inputs with NaN or +inf logits are not supported (no check: it would need a host sync). A row whose logits are all
-inf has no mass; it returns the greedy token (id 0).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["BLOCK", "check_sampling_args", "reference_probs", "sample_tokens", "sample_tokens_reference",
           "uniforms_from_seeds"]

BLOCK = 1024  # tokens per block of the two-level CDF (float64 block sums, then a float64 cumsum of one block)
_SEED_BITS = 63  # position_seed's width; the top 53 bits make a float64 uniform in [0, 1)


def uniforms_from_seeds(seeds: Sequence[int]) -> torch.Tensor:
    """float64 ``[B]`` uniforms in ``[0, 1)`` on the CPU: ``(s >> 10) / 2**53`` of each 63-bit seed (exact in float64).
    Raises ValueError for a seed outside ``[0, 2**63)``."""
    out = []
    for i, s in enumerate(seeds):
        if not 0 <= int(s) < (1 << _SEED_BITS):
            raise ValueError(f"seeds[{i}]: {s} outside [0, 2**63)")
        out.append((int(s) >> (_SEED_BITS - 53)) * 2.0 ** -53)
    return torch.tensor(out, dtype=torch.float64)


def check_sampling_args(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float,
                        uniforms) -> None:
    """Raise ValueError naming the first bad argument of :func:`sample_tokens`. ``uniforms`` values are checked
    only on the CPU (a check on the device would sync)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits: a 2-D float tensor [B, V] expected, got {getattr(logits, 'shape', type(logits))}")
    if logits.shape[1] == 0:
        raise ValueError("logits: V = 0 (no token to sample)")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: {temperature} (finite and >= 0 expected)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: {top_p} (in (0, 1] expected)")
    if int(top_k) != top_k:
        raise ValueError(f"top_k: {top_k} (an integer expected; <= 0 is off)")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p: {min_p} (in [0, 1] expected)")
    if temperature == 0:
        return
    if not isinstance(uniforms, torch.Tensor) or uniforms.shape != (logits.shape[0],) \
            or not uniforms.dtype.is_floating_point:
        raise ValueError(f"uniforms: a float tensor [{logits.shape[0]}] expected with temperature > 0, got "
                         f"{getattr(uniforms, 'shape', type(uniforms))}")
    if uniforms.device.type == "cpu" and uniforms.numel() and not bool(((uniforms >= 0) & (uniforms < 1)).all()):
        raise ValueError("uniforms: values outside [0, 1)")


def _filtered_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                     min_p: float) -> torch.Tensor:
    """fp32 ``[B, V_pad]``: ``logits / temperature`` with the tokens min-p, top-k and top-p drop set to -inf, padded
    with -inf to a multiple of :data:`BLOCK` columns when V > BLOCK."""
    B, V = logits.shape
    v_pad = V if V <= BLOCK else -(-V // BLOCK) * BLOCK
    x = torch.empty((B, v_pad), dtype=torch.float32, device=logits.device)
    x[:, V:] = -math.inf
    if logits.dtype == torch.float32:
        torch.div(logits, temperature, out=x[:, :V])
    else:  # exact widening to fp32 first, so the division rounds in fp32
        x[:, :V] = logits
        x[:, :V].div_(temperature)
    if min_p > 0:
        xmax = x.amax(-1, keepdim=True)
        x.masked_fill_(x < xmax + math.log(min_p), -math.inf)
    if 0 < top_k < V:
        kth = x.topk(int(top_k), dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [B, 1]
        x.masked_fill_(x < kth, -math.inf)
    if top_p < 1.0:
        xv = x[:, :V]
        xs, order = xv.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        ps = torch.softmax(xs, dim=-1)
        before = ps.cumsum(-1) - ps  # mass ranked strictly before each token
        xs.masked_fill_(before >= top_p, -math.inf)
        xv.scatter_(-1, order, xs)
    return x


def _inverse_cdf(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: per row, the smallest id whose cumulative ``exp(x - max x)`` exceeds ``u * total`` (x: fp32
    ``[B, nb * bs]``, bs = min(BLOCK, V_pad), overwritten). Rows with no mass give -1."""
    B, v_pad = x.shape
    bs = min(BLOCK, v_pad)
    nb = v_pad // bs
    xmax = x.amax(-1, keepdim=True)
    x.sub_(xmax.nan_to_num(neginf=0.0)).exp_()  # [B, V_pad] fp32 weights; dropped tokens and padding 0
    cb = x.view(B, nb, bs).sum(-1).double().cumsum_(-1)  # [B, nb] cumulative block mass (fp32 sums, float64 scan)
    target = uniforms.to(x.device, torch.float64).view(B, 1) * cb[:, -1:]  # [B, 1], < total when total > 0
    blk = torch.searchsorted(cb, target, right=True).clamp_(max=nb - 1)  # [B, 1] first block whose end passes it
    rem = target - torch.where(blk > 0, cb.gather(-1, (blk - 1).clamp_(min=0)), 0.0)  # mass left inside the block
    w = x.view(B, nb, bs).gather(1, blk.view(B, 1, 1).expand(B, 1, bs)).view(B, bs)  # [B, bs]
    cw = w.to(torch.float64).cumsum_(-1)
    j = torch.searchsorted(cw, rem, right=True)  # [B, 1]; bs when rounding put rem at or past the block's end
    last = torch.where(w > 0, torch.arange(bs, device=x.device), -1).amax(-1, keepdim=True)  # last positive
    j = torch.where(j >= bs, last, j)
    tok = blk * bs + j
    return torch.where(cb[:, -1:] > 0, tok, -1).view(B)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                  uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (any float dtype, any device; computed in fp32): greedy argmax when
    ``temperature <= 0`` (``uniforms`` unused), else the draw of ``uniforms`` [B] (float, in ``[0, 1)``, any device)
    under temperature, min-p, top-k and top-p as the module docstring defines them. Returns int64 [B] on the logits'
    device; the caller copies it to the host when it needs the ids. Raises ValueError for bad arguments."""
    check_sampling_args(logits, temperature, top_p, top_k, min_p, uniforms)
    if temperature == 0:
        return logits.argmax(dim=-1)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    x = _filtered_logits(logits, float(temperature), float(top_p), int(top_k), float(min_p))
    return _inverse_cdf(x, uniforms).clamp_(min=0)  # a row with no mass (all -inf): its argmax, id 0


def _reference_probs(row: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """float64 ``[V]``: the target distribution of one row, step by step in float64 (the module docstring's rules)."""
    x = row.double() / temperature
    V = x.shape[0]
    p = torch.softmax(x, 0)
    if min_p > 0:
        p = torch.where(p >= min_p * p.max(), p, 0.0)
    if 0 < top_k < V:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        p = torch.where(x >= kth, p, 0.0)
    p = p / p.sum()
    if top_p < 1.0:
        pl = p.tolist()
        keep, mass = torch.zeros(V, dtype=torch.bool), 0.0
        for i in sorted(range(V), key=lambda i: (-pl[i], i)):
            if mass >= top_p:
                break
            keep[i], mass = True, mass + pl[i]
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def sample_tokens_reference(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                            min_p: float = 0.0, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample_tokens` row by row in float64 on the CPU (tests only): the target distribution of each row,
    then the smallest id whose cumulative probability exceeds ``u``. Returns int64 [B] on the CPU."""
    check_sampling_args(logits, temperature, top_p, top_k, min_p, uniforms)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for b in range(logits.shape[0]):
        row = logits[b].float().cpu()
        if temperature == 0 or not bool(torch.isfinite(row).any()):
            out[b] = int(row.argmax())
            continue
        cdf = _reference_probs(row, temperature, top_p, top_k, min_p).cumsum(0)
        i = int(torch.searchsorted(cdf, torch.tensor([float(uniforms[b]) * float(cdf[-1])], dtype=torch.float64),
                                   right=True))
        out[b] = min(i, int(torch.nonzero(cdf < cdf[-1]).numel()))  # u * total rounding up: the last positive id
    return out


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0) -> torch.Tensor:
    """float64 ``[B, V]`` on the CPU: each row's target distribution (temperature > 0), row by row (tests only)."""
    return torch.stack([_reference_probs(r.float().cpu(), temperature, top_p, top_k, min_p) for r in logits])
