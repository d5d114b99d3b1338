"""Triton kernel of packed variable-length causal prefill attention (issue 44): flash attention with GQA, a sliding
window, per-head attention sinks and independent q/k and v head widths.

Imported only on demand by :func:`lightning_moe.kernels.prefill_attention.attention_varlen_triton` (it checks,
allocates and launches; :func:`lightning_moe.kernels.prefill_attention.attention_varlen_reference` is the torch
reference). This module imports triton at the top, so it must never be imported by code that runs on a host without
triton.

One program per (block of ``BLOCK_M`` queries of one sequence, sequence, query head). Its queries stay in registers;
the keys and values of its sequence stream in blocks of ``BLOCK_N`` from the first key any of its queries sees (0, or
with a sliding window ``m0 - window + 1``) up to its last query (causal: later blocks are never read). Scores
``q k^T * scale`` in fp32 (``tl.dot``; fp32 operands with ``input_precision="ieee"``, no TF32), masked to ``j <= i``
and ``j > i - window``, online softmax (running max ``m``, sum ``l``, fp32 accumulator rescaled per block), the
probabilities rounded to the value dtype for the second ``tl.dot`` (as flash attention does). A sink logit (fp32,
one per query head) joins the normalizer at the end: ``l += exp(sink - m')`` with everything rescaled to
``m' = max(m, sink)``; it has no value. No ``[S, S]`` matrix exists anywhere: per program a ``[BLOCK_M, BLOCK_N]``
score tile.

Head widths: ``DQK`` and ``DV`` are runtime values padded to the powers of two ``DQK_PAD`` / ``DV_PAD`` (>= 16) with
masked loads (0 in the padding: it adds nothing to a dot) and a masked store. Padding queries of a sequence's last
block (``i >= len``) are computed over masked keys and never stored; a row whose keys are all masked so far keeps
``m = -inf`` and its exponentials are taken against 0 instead (no ``-inf - -inf`` NaN). Offsets are int64 (packed
rows times strides pass 2**31 at ~16M elements).

``UPCAST_DOT`` is set only under the Triton interpreter (TRITON_INTERPRET=1), whose ``tl.dot`` mishandles bf16
operands: the operands are converted to fp32 first (the same values). Like ``_triton_kernels``, the kernel calls no
``@triton.jit`` helper of triton's own library (``tl.zeros``, ``tl.max``, ``tl.sum``, ``tl.cdiv``): those are
compiled-mode objects if triton was imported before ``TRITON_INTERPRET`` was set, and the interpreter then refuses
them. The row max and row sum are ``tl.reduce`` with triton's own combine functions of ``tl.max`` / ``tl.sum``
(``_MAX_COMBINE``, ``_SUM_COMBINE``), which the interpreter recognizes and runs with numpy.
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# tl.sum's and tl.max's own combine functions (triton.language.standard), which the interpreter recognizes and runs
# with numpy; this module's ``_add`` / ``_max`` if a triton lacks them (the same result, element by element in Python
# under the interpreter, ~100x slower)
_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _max)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulator); ``UPCAST_DOT`` (the interpreter): the operands in fp32 first."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)


@triton.jit
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, sink_ptr,
    sm_scale, window, G, DQK, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Query block ``program_id(0)`` (counted from the end: the longest key ranges start first) of sequence
    ``program_id(1)`` (packed rows ``cu[b]:cu[b+1]``), query head ``program_id(2)`` (kv head ``h // G``).

    q ``[T, Hq, DQK]``, k ``[T, Hkv, DQK]``, v ``[T, Hkv, DV]``, o ``[T, Hq, DV]``: last stride 1, the others given.
    ``window`` (with ``WINDOW``): query i sees keys ``i - window < j <= i``; ``sink_ptr`` (with ``SINKS``): fp32
    ``[Hq]``. Blocks past the sequence's length exit without a store.
    """
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    L = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64) * BLOCK_M
    if m0 < L:
        kvh = h // G
        offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] query positions in the sequence
        mm = offs_m < L
        offs_dq = tl.arange(0, DQK_PAD)
        mdq = offs_dq < DQK
        offs_dv = tl.arange(0, DV_PAD)
        mdv = offs_dv < DV
        q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_dq[None, :],
                    mask=mm[:, None] & mdq[None, :], other=0.0)  # [BM, DQK_PAD]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, DV_PAD], 0.0, tl.float32)
        lo = m0 * 0
        if WINDOW:
            lo = m0 - window + 1
            lo = tl.where(lo > 0, lo, 0)
        hi = m0 + BLOCK_M
        hi = tl.where(hi < L, hi, L)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
            mn = offs_n < L
            rows_n = start + offs_n
            kt = tl.load(k_ptr + rows_n[None, :] * stride_kt + kvh * stride_kh + offs_dq[:, None],
                         mask=mn[None, :] & mdq[:, None], other=0.0)  # [DQK_PAD, BN]
            s = _dot(q, kt, tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), DOT_PRECISION, UPCAST_DOT) * sm_scale
            allowed = (offs_n[None, :] <= offs_m[:, None]) & mn[None, :]  # [BM, BN] causal, inside the sequence
            if WINDOW:
                allowed = allowed & (offs_n[None, :] > offs_m[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX_COMBINE))  # [BM]
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])  # [BM, BN] fp32, 0 where masked
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM_COMBINE)
            v = tl.load(v_ptr + rows_n[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                        mask=mn[:, None] & mdv[None, :], other=0.0)  # [BN, DV_PAD]
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
            m_i = m_new
        if SINKS:  # the sink joins the normalizer: rescale to max(m, sink), add exp(sink - m'), no value
            sink = tl.load(sink_ptr + h)
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_fin)
            l_i = l_i * alpha + tl.exp(sink - m_fin)
            acc = acc * alpha[:, None]
        l_i = tl.where(l_i > 0, l_i, 1.0)  # padding queries only (a real query sees at least itself)
        o = acc / l_i[:, None]
        tl.store(o_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=mm[:, None] & mdv[None, :])
