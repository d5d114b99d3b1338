"""Triton kernel of the scoring head's per-row statistics (``score_head_kernel``): log p(target) and whether the
target is the row's argmax, in one pass over a row of logits in the model dtype (no fp32 copy, no log_softmax
output: torch's path makes both, each a full pass over ``[c, V]`` in HBM).

Imported only on demand by :mod:`lightning_moe.kernels.score_head` (its wrapper checks, allocates and launches; read
it for shapes, dtypes, the contract on NaN / inf rows and the torch reference). This module imports triton at the
top, so it must never be imported by code that runs on a host without triton.

The row is read in blocks of ``BLOCK_V`` logits; every lane of a block keeps its own running maximum ``m``, its
rescaled sum ``s = sum exp(x - m)`` (the online-softmax recurrence of Milakov & Gimelshein 2018: when the maximum
grows, the sum so far is multiplied by ``exp(m_old - m_new)``), the index of its first maximum and whether it saw a
NaN; the lanes are combined once at the end. NaN logits enter the arithmetic as -inf (so the compiled ``maximum``,
which drops NaN, and the interpreter's, which keeps it, agree) and set the row's NaN flag instead.

The lane reductions are ``tl.reduce`` with ``tl.standard``'s own combine functions (``_elementwise_max``,
``_elementwise_min``, ``_sum_combine``: the combine functions of ``tl.max`` / ``tl.min`` / ``tl.sum``), which the
interpreter recognizes and runs with numpy; the kernel calls no ``@triton.jit`` helper of triton's standard library
itself (``tl.max``, ``tl.sum``, ``tl.zeros``: compiled-mode objects if triton was imported before
``TRITON_INTERPRET`` was set, which the interpreter then refuses to call; see ``_triton_norm_rope``).
"""

import triton
import triton.language as tl

_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_SUM = tl.standard._sum_combine


@triton.jit
def _online_block(x, valid, cols, m, s, idx, nan, NONE):
    """One block of a row folded into the lanes' state (all [BV]): x fp32 logits (masked lanes -inf), valid (the
    lane holds a logit), cols (their indices). Returns the new (m, s, idx, nan)."""
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)  # NaN -> -inf in the arithmetic; the flag remembers it
    nan = tl.where(valid & is_nan, 1, nan)
    first = valid & ((x > m) | (idx == NONE))  # strictly greater: a lane keeps its earliest (lowest) index on ties
    idx = tl.where(first, cols, idx)
    m_new = tl.maximum(m, x)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, not exp(nan)
    s = s * tl.exp(m - shift) + tl.exp(x - shift)  # the rescale of the sum so far, then this block's term
    return m_new, s, idx, nan


@triton.jit
def score_head_kernel(
    logits_ptr, tgt_ptr, logp_ptr, greedy_ptr,
    V, stride_lr, stride_t,
    BLOCK_V: tl.constexpr,
):
    """Row ``program_id(0)`` of ``logits [c, V]`` (rows at ``stride_lr``, last stride 1; bf16 / fp16 / fp32):

        logp[r]   = (x[r, t] - M) - log(sum_j exp(x[r, j] - M)),  M = max_j x[r, j], all in fp32
        greedy[r] = (lowest j with x[r, j] = M) == t

    t = ``tgt[r * stride_t]`` (int64). A row with a NaN: logp NaN, greedy False. A target outside [0, V): logp NaN,
    greedy False (nothing outside the row is read). +inf in a row makes the sum NaN (logp NaN, as log_softmax).
    """
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_lr
    lanes = tl.arange(0, BLOCK_V)  # [BV]
    NONE = V  # an index no lane holds: "no element seen yet"
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # [BV] running maximum per lane
    s = tl.full([BLOCK_V], 0.0, tl.float32)  # [BV] sum of exp(x - m) per lane
    idx = tl.full([BLOCK_V], 0, tl.int32) + NONE  # [BV] index of the lane's first maximum
    nan = tl.full([BLOCK_V], 0, tl.int32)  # [BV] 1: the lane met a NaN
    for start in range(0, V, BLOCK_V):
        cols = start + lanes  # [BV]
        valid = cols < V
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)  # [BV]
        m, s, idx, nan = _online_block(x, valid, cols, m, s, idx, nan, NONE)
    M = tl.reduce(m, 0, _MAX)  # row maximum (fp32; -inf for a row of -inf)
    shift = tl.where(M == float("-inf"), 0.0, M)
    S = tl.reduce(s * tl.exp(m - shift), 0, _SUM)  # sum of exp(x - shift) over the row
    log_s = tl.log(S)  # logsumexp - shift (-inf for a row of -inf: logp = NaN, as log_softmax's)
    arg = tl.reduce(tl.where(m == M, idx, NONE), 0, _MIN)  # lowest index among the lanes holding M
    no_nan = tl.reduce(nan, 0, _MAX) == 0
    t = tl.load(tgt_ptr + row * stride_t)  # int64
    in_row = (t >= 0) & (t < V)
    x_t = tl.load(base + tl.where(in_row, t, 0), mask=in_row, other=float("nan")).to(tl.float32)
    logp = tl.where(no_nan, (x_t - shift) - log_s, float("nan"))  # as log_softmax: (x - max) - log(sum), no
    #   rounding of max + log(sum) (which would cost up to ulp(max) where the logits are large)
    tl.store(logp_ptr + row, logp)
    tl.store(greedy_ptr + row, (arg.to(tl.int64) == t) & in_row & no_nan)
