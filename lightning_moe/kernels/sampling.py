"""Token sampling on the logits' device: temperature, min-p, top-k, top-p, then an exponential race (issue 43).

* :func:`sample_tokens` -- the vectorized sampler: ``[B, V]`` logits (any float dtype, any device) and ``[B]`` int64
  row keys in, ``int64 [B]`` token ids on the logits' device out; no per-row Python loop, no host sync.
* :func:`keys_from_seeds` -- the ``[B]`` int64 key tensor of ``[B]`` 63-bit per-draw seeds (checked on the host).
* :func:`race_uniforms` -- the ``[B, V]`` counter-based uniforms of (row key, token id) the race uses.
* :func:`sample_tokens_reference` -- the per-row loop in float64 that tests compare against (never on a hot path).

Semantics (vLLM's v1 sampler, ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``), in this order:

1. ``temperature <= 0``: greedy, ``argmax`` of the raw logits (lowest id on ties); no keys needed.
2. ``x = fp32(logits) / temperature``.
3. min-p (``min_p > 0``): keep the tokens with ``p >= min_p * max p`` (``x >= max x + log(min_p)``).
4. top-k (``0 < top_k < V``; ``top_k <= 0`` is off, vLLM's -1 / 0): keep the tokens with ``x >=`` the k-th largest x,
   ties at the k-th value all kept (vLLM's ``apply_top_k_only``).
5. top-p (``top_p < 1``): the kept tokens renormalized and ranked by probability, ties by lower id first; keep a token
   when the mass ranked strictly before it is ``< top_p`` (the first always stays; vLLM's ``probs_sum <= 1 - p``
   drop rule read from the other end).
6. One draw from the kept tokens in proportion to ``exp(x)``.

How a draw is made, and why. The draw is an exponential race (Gumbel-max): token = argmax over the kept i of
``x_i - log(E_i)``, ``E_i = -log(1 - w_i)`` ~ Exp(1), i.e. argmax ``p_i / E_i`` -- exactly what ``torch.multinomial``
does for one sample. ``w_i`` is a counter-based hash of (row key, token id i): the row's 63-bit key (the pipeline's
``position_seed(request seed, output position)``) is split into two 32-bit words on the device and hashed with the
token index by one round of murmur3's ``fmix32`` on int64 tensors (masked to 32 bits after each multiply), then
``w = (h + 0.5) / 2**32`` in fp32 (clamped below 1) and ``E = -log1p(-w)`` (full relative precision near 0, where the
race is decided). So a row's token is a function of its own logits and its own key only: batch- and
resume-invariant by construction, no generator state. And it is robust: a perturbation of the logits moves the
token only when two candidates' scores are within the perturbation. The one-uniform inverse CDF used before was
not: any change of the mass of the tokens before the drawn one moves the boundary, and a resumed sequence's logits
(a prefill of prompt + partial output instead of decode steps, fp32 differences ~1e-6..1e-5) drew other tokens
(B = 512, V = 32000, temperature 0.8, logits x (1 + 1e-4 noise): inverse CDF 6 of 512 rows changed, 27 with top-p
0.9; the race 0). The distribution is the target's up to fp32 rounding of ``x``, ``w`` and ``log`` (relative ~1e-7)
and E's truncation at ``-log(2**-24)`` (probability 6e-8 per token).

Cost. One ``[B, V]`` int64 hash pass (~13 integer ops per element), a ``log1p`` and a ``log`` per element, an argmax;
top-k adds a ``topk`` of k values per row, top-p one stable sort of ``[B, V]`` (as vLLM's native path does), a
softmax and a cumsum in sorted order, and a scatter back. Measured on this project's loaded 2-core CPU host
(``benchmarks/bench_sampler.py``, V = 32000, temperature 1, one thread; docs/DESIGN.md "Sampling"): B = 80, 38 ms
(the old per-row multinomial loop 63 ms); B = 512, 607 ms (the loop 516 ms). The race costs several times the
inverse CDF it replaced on the CPU (B random numbers per step became B * V hashes; that measured 7.9 / 140 ms).
Memory: one fp32 ``[B, V]`` work buffer and one int64 ``[B, V]`` hash buffer (plus the sort's keys and indices with
top-p): at B = 2048, V = 200 000, 1.6 GB + 3.3 GB; a caller may split B into row chunks to bound it, the draws being
batch-invariant.

On CUDA, :func:`sample_tokens_triton` (``_sampling_triton.py``) does the same in one launch, one program per row
streaming its logits in blocks: the max, min-p's and top-k's thresholds (top-k by bisection on the order-preserving
int32 keys of the fp32 values: 32 passes over the row), top-p's boundary (bisection on the kept mass, ties ranked by
id with a running count), then the race with the same hash; no ``[B, V]`` temporary, no sort. Measured on an H100
(``benchmarks/bench_sampler.py --device cuda``, V = 32000, best of 5, keys copied in and ids copied out): B = 1000,
temperature 1 0.6 ms (torch path 4.4 ms, the old host loop 1,084 ms), top-p 0.9 1.9 ms (8.6; 1,420), top-k 50 2.0
ms (5.3), all four 3.4 ms (9.0); B = 3072, temperature 1 2.0 ms, top-p 5.2 ms (torch path 12.6 / 24.4 ms).

Inputs with NaN or +inf logits are not supported (no check: it would need a host sync). A row whose logits are all
-inf has no mass; it returns the greedy token (id 0).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["check_sampling_args", "keys_from_seeds", "race_uniforms", "reference_probs", "sample_tokens",
           "sample_tokens_reference", "sample_tokens_triton"]

_KEY_BITS = 63  # position_seed's width: a row key is in [0, 2**63)
_M32 = 0xFFFFFFFF  # the low 32 bits of an int64
_W_MAX = 1.0 - 2.0 ** -24  # the largest w below 1 in fp32 (E = -log1p(-w) <= 16.6, finite)


def keys_from_seeds(seeds: Sequence[int]) -> torch.Tensor:
    """int64 ``[B]`` row keys on the CPU from ``[B]`` 63-bit per-draw seeds. Raises ValueError for a seed outside
    ``[0, 2**63)``."""
    for i, s in enumerate(seeds):
        if not 0 <= int(s) < (1 << _KEY_BITS):
            raise ValueError(f"seeds[{i}]: {s} outside [0, 2**63)")
    return torch.tensor([int(s) for s in seeds], dtype=torch.int64)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer, in place on an int64 tensor holding values in ``[0, 2**32)`` (the products wrap in
    int64, their low 32 bits stay exact; shifts of non-negative values are logical)."""
    h.bitwise_xor_(h >> 16).mul_(0x85EBCA6B).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 13).mul_(0xC2B2AE35).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def race_uniforms(keys: torch.Tensor, V: int, device=None) -> torch.Tensor:
    """fp32 ``[B, V]`` values ``w`` in ``(0, 1)`` on ``device`` (default: the keys'): ``(h + 0.5) / 2**32`` with
    ``h = fmix32(((i * 0x9E3779B1 + fmix32(a)) mod 2**32) ^ fmix32(b ^ 0x85EBCA77))`` of token id i and key words
    ``a = key & 0xFFFFFFFF``, ``b = key >> 32`` (a Weyl sequence through murmur3's finalizer, as SplitMix does; one
    ``[B, V]`` round: a second doubled the CPU cost); clamped to at most ``1 - 2**-24``."""
    k = keys.to(device if device is not None else keys.device, torch.int64).view(-1, 1)
    ka = _fmix32_(k & _M32)  # [B, 1]
    kb = _fmix32_((k >> 32).bitwise_xor_(0x85EBCA77))  # [B, 1]
    h = torch.arange(V, dtype=torch.int64, device=k.device).mul_(0x9E3779B1).bitwise_and_(_M32)  # [V]
    h = _fmix32_((h + ka).bitwise_and_(_M32).bitwise_xor_(kb))  # [B, V]
    return h.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=_W_MAX)


def check_sampling_args(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float,
                        keys) -> None:
    """Raise ValueError naming the first bad argument of :func:`sample_tokens`. ``keys`` values are checked only on
    the CPU (a check on the device would sync)."""
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
    if not isinstance(keys, torch.Tensor) or keys.shape != (logits.shape[0],) or keys.dtype != torch.int64:
        raise ValueError(f"keys: an int64 tensor [{logits.shape[0]}] expected with temperature > 0, got "
                         f"{getattr(keys, 'dtype', type(keys))} {getattr(keys, 'shape', '')}")
    if keys.device.type == "cpu" and keys.numel() and not bool((keys >= 0).all()):
        raise ValueError("keys: negative values (63-bit keys in [0, 2**63) expected)")


def _filtered_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                     min_p: float) -> torch.Tensor:
    """fp32 ``[B, V]``: ``logits / temperature`` with the tokens min-p, top-k and top-p drop set to -inf."""
    V = logits.shape[1]
    if logits.dtype == torch.float32:
        x = torch.div(logits, temperature)
    else:  # exact widening to fp32 first, so the division rounds in fp32
        x = logits.float().div_(temperature)
    if min_p > 0:
        xmax = x.amax(-1, keepdim=True)
        x.masked_fill_(x < xmax + math.log(min_p), -math.inf)
    if 0 < top_k < V:
        kth = x.topk(int(top_k), dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [B, 1]
        x.masked_fill_(x < kth, -math.inf)
    if top_p < 1.0:
        xs, order = x.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        ps = torch.softmax(xs, dim=-1)
        before = ps.cumsum(-1) - ps  # mass ranked strictly before each token
        xs.masked_fill_(before >= top_p, -math.inf)
        x.scatter_(-1, order, xs)
    return x


def _race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: per row, argmax over i of ``x_i - log(E_i)``, ``E_i = -log1p(-w_i)`` of :func:`race_uniforms`
    (x: fp32 ``[B, V]``, -inf where dropped; overwritten). A row with every x -inf gives 0."""
    e = race_uniforms(keys, x.shape[1], x.device).neg_().log1p_().neg_()  # [B, V] Exp(1), in (0, 16.6]
    return x.sub_(e.log_()).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                  keys: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (any float dtype, any device; computed in fp32): greedy argmax when
    ``temperature <= 0`` (``keys`` unused), else the exponential race of ``keys`` [B] (int64 63-bit row keys, any
    device) under temperature, min-p, top-k and top-p as the module docstring defines them. Returns int64 [B] on the
    logits' device; the caller copies it to the host when it needs the ids. Raises ValueError for bad arguments."""
    check_sampling_args(logits, temperature, top_p, top_k, min_p, keys)
    if temperature == 0:
        return logits.argmax(dim=-1)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    x = _filtered_logits(logits, float(temperature), float(top_p), int(top_k), float(min_p))
    return _race(x, keys)


def sample_tokens_triton(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                         min_p: float = 0.0, keys: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """:func:`sample_tokens` in one Triton launch (``kernels/_sampling_triton.py``): one program per row streams the
    row in blocks of ``block`` tokens, so no ``[B, V]`` temporary exists (the torch path allocates an fp32 and an int64
    ``[B, V]``, and sorts for top-p). Same rules and the same hash; the filtering's sums run in another order than
    the torch path's sort and cumsum, so a token at top-p's boundary within fp32 rounding of ``top_p`` may be kept by
    one and not the other. Needs triton (CUDA, or its CPU interpreter). Returns int64 [B] on the logits' device."""
    check_sampling_args(logits, temperature, top_p, top_k, min_p, keys)
    if temperature == 0:
        return logits.argmax(dim=-1)
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: {block} (a power of two >= 16 expected)")
    from .fused_moe import _triton_kernels

    kern = _triton_kernels("_sampling_triton")  # imports triton now; a copy per mode (compiled / TRITON_INTERPRET)

    if logits.stride(1) != 1:
        logits = logits.contiguous()
    keys = keys.to(logits.device, torch.int64).contiguous()
    block = min(block, max(16, 1 << (V - 1).bit_length()))
    kern.race_sample_kernel[(B,)](
        logits, keys, out, V, logits.stride(0), float(temperature), math.log(min_p) if min_p > 0 else 0.0,
        int(top_k), float(top_p), USE_MINP=min_p > 0, USE_TOPK=0 < top_k < V, USE_TOPP=top_p < 1.0, BLOCK=block,
        num_warps=8 if block >= 2048 else 4)
    return out


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
                            min_p: float = 0.0, keys: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample_tokens` row by row in float64 on the CPU (tests only): the target distribution of each row, then
    argmax over its tokens of positive probability of ``log p_i - log(-log1p(-w_i))`` with the same hash values
    ``w_i`` (:func:`race_uniforms` of the row's key alone, in float64). Returns int64 [B] on the CPU."""
    check_sampling_args(logits, temperature, top_p, top_k, min_p, keys)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for b in range(logits.shape[0]):
        row = logits[b].float().cpu()
        if temperature == 0 or not bool(torch.isfinite(row).any()):
            out[b] = int(row.argmax())
            continue
        p = _reference_probs(row, temperature, top_p, top_k, min_p)
        e = -torch.log1p(-race_uniforms(keys[b:b + 1].cpu(), row.shape[0])[0].double())
        out[b] = int(torch.where(p > 0, p.log() - e.log(), -math.inf).argmax())
    return out


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0) -> torch.Tensor:
    """float64 ``[B, V]`` on the CPU: each row's target distribution (temperature > 0), row by row (tests only)."""
    return torch.stack([_reference_probs(r.float().cpu(), temperature, top_p, top_k, min_p) for r in logits])
