"""Triton kernels of RMSNorm (``rms_norm_kernel``) and rotate-half RoPE (``rope_kernel``), each one launch that reads
its input once and writes its output once (torch's versions launch ~6-10 element-wise kernels each).

Imported only on demand by :mod:`lightning_moe.kernels.norm_rope` (its wrappers check, allocate and launch; read
them for shapes, dtypes and the torch references). This module imports triton at the top, so it must never be
imported by code that runs on a host without triton.

Both kernels reproduce torch's rounding: every value is loaded, converted to fp32, and each torch op's result is
rounded to the tensor dtype where torch rounds it (:func:`round_to`, staying in fp32), which is what torch's bf16 /
fp16 element-wise kernels do on CPU and CUDA (compute in fp32, round to nearest even once per op). bf16 is rounded
with integer bit operations, not ``.to(tl.bfloat16)``: the Triton interpreter's fp32 -> bf16 cast truncates. The
wrappers launch with ``enable_fp_fusion=False`` so that an fp32 ``a * b + c`` is not contracted into one FMA (torch
rounds the product first).

``rms_norm_kernel``'s row count ``R`` (a prefill chunk's tokens) is ``do_not_specialize``: one compiled variant
serves every count.

The kernels call no ``@triton.jit`` helpers of triton's own standard library (``tl.cdiv``, ``tl.sigmoid``,
``tl.zeros``, ``tl.max``, ``tl.sum``): those are compiled-mode objects if triton was imported before
``TRITON_INTERPRET`` was set, and the interpreter then refuses to call them. The row sum is ``tl.reduce`` with
``tl.standard._sum_combine``, the combine function of ``tl.sum`` itself (never called by the interpreter, which
recognizes it and sums with numpy; any other combine function it applies element by element in Python, ~100x
slower).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


# tl.sum's own combine function (triton.language.standard, 2.1 to 3.9 at least); this module's ``_add`` if a triton
# lacks it (the same sum, element by element under the interpreter)
_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)

ROUND_NONE, ROUND_BF16, ROUND_FP16 = 0, 1, 2  # the ``ROUND`` constexpr: fp32, bf16, fp16 tensors


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in bf16 (``ROUND == 1``) or fp16 (2), returned as fp32; as is for 0."""
    r = x
    if ROUND == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)  # round half to even at bit 16 (carries into the exponent: overflow -> inf)
        b = (b >> 16) << 16
        r = tl.where(x != x, x, b.to(tl.float32, bitcast=True))  # NaN stays NaN
    if ROUND == 2:
        r = x.to(tl.float16).to(tl.float32)
    return r


@triton.jit(do_not_specialize=["R"])
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    R, D, eps,
    stride_xr, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr,
):
    """out[r] = round(w * round(x[r] * rsqrt(mean(x[r]^2) + eps))) for the BLOCK_R rows r of this program.

    x: ``[R, D]`` rows at ``stride_xr`` (last stride 1); w: ``[D]``; out: ``[R, D]`` rows at ``stride_or``, x's dtype.
    Statistics in fp32 (masked columns load 0 and add nothing to the sum of squares; the mean divides by D).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    row_mask = rows < R
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BR, BD]
    ms = tl.reduce(x * x, 1, _SUM_COMBINE) / D  # [BR] fp32 mean of squares
    inv = tl.rsqrt(ms + eps)  # [BR]
    xn = round_to(x * inv[:, None], ROUND)  # normalized, rounded to x's dtype
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BD]
    y = round_to(w[None, :] * xn, ROUND)  # torch: weight * xn, one rounding to the common dtype
    tl.store(out_ptr + r64[:, None] * stride_or + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    H, HALF,
    stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND: tl.constexpr,
):
    """Rotate-half RoPE of token ``program_id(0)``'s heads ``[BLOCK_H * program_id(1), +BLOCK_H)``:

        out[:half] = round(round(x1 * cos[:half]) + round(-x2 * sin[:half]))
        out[half:] = round(round(x2 * cos[half:]) + round( x1 * sin[half:]))

    (x1 / x2 the first / second half of a head's hd = 2 * HALF values). x: ``[T, H, hd]`` at strides
    (``stride_xt``, ``stride_xh``, 1); cos / sin: ``[T, hd]`` rows at ``stride_ct`` / ``stride_st``; out: ``[T, H, hd]``
    at (``stride_ot``, ``stride_oh``, 1). All in one dtype; each product and the sum rounded to it, as torch does.
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    offs = tl.arange(0, BLOCK_HALF)  # [BHALF]
    half_mask = offs < HALF
    mask = (heads < H)[:, None] & half_mask[None, :]
    h64 = heads.to(tl.int64)
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=half_mask, other=0.0).to(tl.float32)[None, :]  # [1, BHALF]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    x_row = x_ptr + t * stride_xt + h64[:, None] * stride_xh + offs[None, :]  # [BH, BHALF]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    a1 = round_to(x1 * c1, ROUND)  # x * cos, first half
    b1 = round_to((-x2) * s1, ROUND)  # rot * sin, rot = cat(-x2, x1)
    a2 = round_to(x2 * c2, ROUND)
    b2 = round_to(x1 * s2, ROUND)
    dt = out_ptr.dtype.element_ty
    o_row = out_ptr + t * stride_ot + h64[:, None] * stride_oh + offs[None, :]
    tl.store(o_row, round_to(a1 + b1, ROUND).to(dt), mask=mask)  # exact: the value is already in dt
    tl.store(o_row + HALF, round_to(a2 + b2, ROUND).to(dt), mask=mask)
