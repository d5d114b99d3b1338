"""Triton kernel of the sampler (:func:`lightning_moe.kernels.sampling.sample_tokens_triton` checks, allocates and
launches it; :func:`lightning_moe.kernels.sampling.sample_tokens` is its torch reference).

One program per row, the row streamed in blocks of ``BLOCK`` tokens (no ``[B, V]`` workspace): a max pass (min-p,
top-p), a bisection for top-k's k-th value, a normalizer pass and a bisection for top-p's boundary, then the race.
The bisections run over the 32-bit **order keys** of the fp32 values (the bits as int32, the negative ones with their
low 31 bits flipped: a monotone map, so the k-th largest value and top-p's boundary are found exactly, in 32 passes
over the row each). Ties at a boundary: top-k keeps every token equal to the k-th value; top-p keeps the tied tokens
in id order while the mass ranked before them is below ``top_p`` (the reference's stable sort), counted with a running
prefix over the blocks.

The race hashes ``(row key, token id)`` exactly as :func:`lightning_moe.kernels.sampling.race_uniforms` does (murmur3's
fmix32 on int64 lanes masked to 32 bits), then ``E = -log1p(-w)`` by Goldberg's accurate ``log1p`` (``log(u) * x / (u -
1)``, ``u = 1 + x``: full relative precision near 0, where the race is decided) and scores ``x - log(E)``; the lowest
id wins ties. Like ``_triton_kernels``, it calls no ``@triton.jit`` helper of triton's own library (``tl.max``,
``tl.sum``, ``tl.argmax``, ``tl.cumsum``): its reductions and scan take combine functions of this module, so the
interpreter (TRITON_INTERPRET=1) runs it after triton was imported in compiled mode. Imported only on demand.
"""

import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))
_KEY_MIN = tl.constexpr(-2147483648)  # the order key below every value's


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_fn(a, b):
    return a + b


@triton.jit
def _argmax_fn(va, ia, vb, ib):
    """(value, id) of the larger value; the lower id on ties."""
    take_a = (va > vb) | ((va == vb) & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finalizer on int64 lanes holding values in [0, 2**32)."""
    m32 = tl.full((), 0xFFFFFFFF, tl.int64)
    h = h ^ (h >> 16)
    h = (h * tl.full((), 0x85EBCA6B, tl.int64)) & m32
    h = h ^ (h >> 13)
    h = (h * tl.full((), 0xC2B2AE35, tl.int64)) & m32
    return h ^ (h >> 16)


@triton.jit
def _order_key(x):
    """int32 keys ordered as the fp32 values x are (-0.0 just below +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _load_x(row_ptr, offs, V, temperature, xmax, log_min_p, kth, USE_MINP: tl.constexpr, USE_TOPK: tl.constexpr):
    """fp32 ``logits / temperature`` of one block, -inf past V and where min-p or top-k drop the token."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=_NEG_INF).to(tl.float32) / temperature
    if USE_MINP:
        x = tl.where(x >= xmax + log_min_p, x, _NEG_INF)
    if USE_TOPK:
        x = tl.where(_order_key(x) >= kth, x, _NEG_INF)
    return x


@triton.jit
def _row_max(row_ptr, V, temperature, BLOCK: tl.constexpr):
    m = tl.full((BLOCK,), _NEG_INF, tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=_NEG_INF).to(tl.float32) / temperature
        m = tl.maximum(m, x)
    return tl.reduce(m, 0, _max_fn)


@triton.jit
def _kth_key(row_ptr, V, temperature, xmax, log_min_p, top_k, USE_MINP: tl.constexpr, BLOCK: tl.constexpr):
    """The largest order key t with at least top_k kept tokens of key >= t (top-k's k-th value, exactly)."""
    lo = tl.full((), _KEY_MIN, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        cnt = tl.full((BLOCK,), 0, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_x(row_ptr, offs, V, temperature, xmax, log_min_p, 0, USE_MINP, False)
            cnt += ((_order_key(x).to(tl.int64) >= mid) & (x > _NEG_INF)).to(tl.int32)
        ok = tl.reduce(cnt, 0, _add_fn) >= top_k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _mass_above(row_ptr, V, temperature, xmax, log_min_p, kth, t, USE_MINP: tl.constexpr, USE_TOPK: tl.constexpr,
                BLOCK: tl.constexpr):
    """sum of exp(x - xmax) over the kept tokens of order key > t (t: int64; t < key min gives the normalizer)."""
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_x(row_ptr, offs, V, temperature, xmax, log_min_p, kth, USE_MINP, USE_TOPK)
        acc += tl.where(_order_key(x).to(tl.int64) > t, tl.exp(x - xmax), 0.0)
    return tl.reduce(acc, 0, _add_fn)


@triton.jit
def _top_p_boundary(row_ptr, V, temperature, xmax, log_min_p, kth, top_p, USE_MINP: tl.constexpr,
                    USE_TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """(t, before, q, target): the smallest order key t whose kept tokens above it hold less than top_p of the mass
    (``target``, unnormalized: exp(x - xmax) summed), that mass ``before`` and each token's ``q`` at t (the tied tokens
    at t stay in id order while the mass ranked before each, ``before + rank * q``, is below ``target``)."""
    target = top_p * _mass_above(row_ptr, V, temperature, xmax, log_min_p, kth, _KEY_MIN - 1, USE_MINP, USE_TOPK,
                                 BLOCK)
    lo = tl.full((), _KEY_MIN, tl.int64)
    hi = _order_key(xmax).to(tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        below = _mass_above(row_ptr, V, temperature, xmax, log_min_p, kth, mid, USE_MINP, USE_TOPK, BLOCK) < target
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    before = _mass_above(row_ptr, V, temperature, xmax, log_min_p, kth, lo, USE_MINP, USE_TOPK, BLOCK)
    k = lo.to(tl.int32)
    x_t = tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)  # the value whose key is lo
    return k, before, tl.exp(x_t - xmax), target


@triton.jit
def _race_scores(x, offs, ka, kb):
    """x - log(E) with E = -log1p(-w) of the (row key, token id) hash w; -inf where x is."""
    m32 = tl.full((), 0xFFFFFFFF, tl.int64)
    h = (offs.to(tl.int64) * tl.full((), 0x9E3779B1, tl.int64)) & m32
    h = _fmix32(((h + ka) & m32) ^ kb)
    w = tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 1.0 - 5.960464477539063e-08)
    u = 1.0 - w  # log1p(-w) = log(u) * (-w) / (u - 1) (exact where u == 1: -w)
    lp = tl.where(u == 1.0, -w, tl.log(u) * (-w) / (u - 1.0))
    return tl.where(x > _NEG_INF, x - tl.log(-lp), _NEG_INF)


@triton.jit
def race_sample_kernel(logits_ptr, keys_ptr, out_ptr, V, stride_b, temperature, log_min_p, top_k, top_p,
                       USE_MINP: tl.constexpr, USE_TOPK: tl.constexpr, USE_TOPP: tl.constexpr, BLOCK: tl.constexpr):
    """out[b] = the exponential race's token of row b under min-p, top-k and top-p (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + b * stride_b
    key = tl.load(keys_ptr + b)
    ka = _fmix32(key & tl.full((), 0xFFFFFFFF, tl.int64))
    kb = _fmix32((key >> 32) ^ tl.full((), 0x85EBCA77, tl.int64))
    xmax = 0.0
    if USE_MINP or USE_TOPP:
        xmax = _row_max(row_ptr, V, temperature, BLOCK)
    kth = 0
    if USE_TOPK:
        kth = _kth_key(row_ptr, V, temperature, xmax, log_min_p, top_k, USE_MINP, BLOCK)
    t_p = _KEY_MIN
    before = 0.0
    q = 0.0
    target = 0.0
    if USE_TOPP:
        t_p, before, q, target = _top_p_boundary(row_ptr, V, temperature, xmax, log_min_p, kth, top_p, USE_MINP, USE_TOPK,
                                      BLOCK)
    best_v = tl.full((), _NEG_INF, tl.float32)
    best_i = tl.full((), 0, tl.int32)
    tied_before = tl.full((), 0, tl.int32)  # tokens tied at top-p's boundary in the blocks before
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_x(row_ptr, offs, V, temperature, xmax, log_min_p, kth, USE_MINP, USE_TOPK)
        if USE_TOPP:
            k = _order_key(x)
            tied = (k == t_p) & (x > _NEG_INF)
            rank = tied_before + tl.associative_scan(tied.to(tl.int32), 0, _add_fn) - 1  # among the tied, by id
            x = tl.where((k > t_p) | (tied & (before + rank.to(tl.float32) * q < target)), x, _NEG_INF)
            tied_before += tl.reduce(tied.to(tl.int32), 0, _add_fn)
        s = _race_scores(x, offs, ka, kb)
        v, i = tl.reduce((s, offs), 0, _argmax_fn)
        take = v > best_v
        best_i = tl.where(take, i, best_i)
        best_v = tl.where(take, v, best_v)
    tl.store(out_ptr + b, best_i.to(tl.int64))
