"""Triton kernels of the grouped expert FFN (dense stacked weights and packed expert pages) and the
dequantization of packed experts into dense weights (``dequant_kernel``).

Imported only on demand by :mod:`lightning_moe.kernels.fused_moe` and :mod:`lightning_moe.kernels.quant`
(their wrappers check, allocate and launch; read those for shapes, dtypes and references). This module
imports triton at the top, so it must never be imported by code that runs on a host without triton.

Every FFN kernel works on blocks of ``BLOCK_M`` routed (token, slot) pairs that all belong to one expert
(``moe_align``'s padded layout; padding rows hold ``num_pairs`` and are masked, blocks with expert -1 exit).
Tiles: activations ``[BLOCK_M, BLOCK_K]``, weights ``[BLOCK_K, BLOCK_N]`` (loaded transposed from the HF
``[out, in]`` layout), fp32 accumulators ``[BLOCK_M, BLOCK_N]``. ``UPCAST_DOT`` is set only under the Triton
interpreter (TRITON_INTERPRET=1), whose ``tl.dot`` mishandles bf16 operands: the operands are converted to
fp32 first (same values, products exact). The six FFN kernels share their block set-up (``_block_tile``), the
activation tile load of the packed ones (``_load_rows``), that dot (``_dot``) and their stores (``_store_h``,
``_store_weighted``): inlined ``@triton.jit`` helpers. The kernels call no ``@triton.jit`` helpers of triton's own
standard library (``tl.cdiv``, ``tl.sigmoid``, ``tl.zeros``, ``tl.max``): those are compiled-mode objects
if triton was imported before ``TRITON_INTERPRET`` was set, and the interpreter then refuses to call them.

Row-count arguments that vary call to call (``num_pairs``, ``silu_mul_kernel``'s ``M``) are ``do_not_specialize``:
one compiled variant serves every count (Triton would otherwise compile again for a count divisible by 16 or equal
to 1, ~0.15 s, whenever a prefill first meets one).

The element-wise epilogue of the grouped_mm FFN (``silu_mul_kernel``, ``moe_combine_kernel``; wrappers
:func:`lightning_moe.kernels.fused_moe.silu_mul_triton` / ``moe_combine_triton``) reproduces torch's roundings:
``RNE_BY_HAND`` (interpreter, bf16) rounds fp32 -> bf16 to nearest even by hand, because the interpreter's cast
truncates; ``LIBDEVICE_EXP`` (compiled only: the interpreter has no libdevice) takes CUDA's ``expf``.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _block_tile(pair_ptr, num_pairs, N, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ``(pid_m, pid_n)`` of an FFN kernel: its ``BLOCK_M`` pairs (padding rows hold ``num_pairs``), which of
    them are real, its ``BLOCK_N`` output columns and which of them are ``< N``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + offs_m)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < num_pairs, offs_n, offs_n < N


@triton.jit
def _load_rows(ptr, rows64, offs_k, stride_r, stride_k, row_mask, k_mask):
    """Activation tile ``[BM, BK]`` of the packed kernels: rows ``rows64`` (int64), columns ``offs_k``; 0 where a
    mask is off."""
    return tl.load(ptr + rows64[:, None] * stride_r + offs_k[None, :] * stride_k,
                   mask=row_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulator). ``UPCAST_DOT`` (the Triton interpreter, whose tl.dot mishandles bf16):
    the operands converted to fp32 first, the same values, fp32 products."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)


@triton.jit
def _store_h(h, h_ptr, pair, row_mask, offs_n, n_mask, stride_hp, stride_hf):
    """Gate/up epilogue: ``h`` (fp32 ``[BM, BN]``) cast to h's dtype, stored at rows ``pair``, columns ``offs_n``."""
    h_ptrs = h_ptr + pair[:, None].to(tl.int64) * stride_hp + offs_n[None, :] * stride_hf
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _store_weighted(acc, y_ptr, rw_ptr, pair64, row_mask, offs_n, n_mask, stride_yp, stride_yd):
    """Down epilogue: ``y[p, n] = topk_weight[p] * acc[p, n]`` in fp32 for the block's pairs ``pair64``."""
    rw = tl.load(rw_ptr + pair64, mask=row_mask, other=0.0).to(tl.float32)  # [BM]
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + pair64[:, None] * stride_yp + offs_n[None, :] * stride_yd
    tl.store(y_ptrs, acc, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def gate_up_kernel(
    x_ptr, w1_ptr, w3_ptr, h_ptr, pair_ptr, block_expert_ptr,
    num_pairs, D, F, top_k,
    stride_xt, stride_xd,
    stride_w1e, stride_w1n, stride_w1k,
    stride_w3e, stride_w3n, stride_w3k,
    stride_hp, stride_hf,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """h[p, n] = silu(x[t] . w1[e, n]) * (x[t] . w3[e, n]) for the BLOCK_M pairs p of this block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # trailing block past the last expert's run
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, F, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    token = (pair // top_k).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xd  # [BM, BK]
    w1_ptrs = w1_ptr + e64 * stride_w1e + offs_n[None, :].to(tl.int64) * stride_w1n + offs_k[:, None] * stride_w1k
    w3_ptrs = w3_ptr + e64 * stride_w3e + offs_n[None, :].to(tl.int64) * stride_w3n + offs_k[:, None] * stride_w3k
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (D + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < D - kb * BLOCK_K
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b1 = tl.load(w1_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        b3 = tl.load(w3_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = _dot(a, b1, acc_g, DOT_PRECISION, UPCAST_DOT)
        acc_u = _dot(a, b3, acc_u, DOT_PRECISION, UPCAST_DOT)
        x_ptrs += BLOCK_K * stride_xd
        w1_ptrs += BLOCK_K * stride_w1k
        w3_ptrs += BLOCK_K * stride_w3k
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SwiGLU in fp32: silu(g) = g * sigmoid(g)
    _store_h(h, h_ptr, pair, row_mask, offs_n, n_mask, stride_hp, stride_hf)


@triton.jit(do_not_specialize=["num_pairs"])
def down_kernel(
    h_ptr, w2_ptr, y_ptr, pair_ptr, block_expert_ptr, rw_ptr,
    num_pairs, D, F,
    stride_hp, stride_hf,
    stride_w2e, stride_w2n, stride_w2k,
    stride_yp, stride_yd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """y[p, n] = topk_weight[p] * (h[p] . w2[e, n]) in fp32 for the BLOCK_M pairs p of this block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, D, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    pair64 = pair.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair64[:, None] * stride_hp + offs_k[None, :] * stride_hf  # [BM, BK]
    w2_ptrs = w2_ptr + e64 * stride_w2e + offs_n[None, :].to(tl.int64) * stride_w2n + offs_k[:, None] * stride_w2k
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (F + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < F - kb * BLOCK_K
        a = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w2_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST_DOT)
        h_ptrs += BLOCK_K * stride_hf
        w2_ptrs += BLOCK_K * stride_w2k
    _store_weighted(acc, y_ptr, rw_ptr, pair64, row_mask, offs_n, n_mask, stride_yp, stride_yd)


@triton.jit
def dequant_tile(q_ptr, s_ptr, z_ptr, e64, stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr,
                 k0, offs_k, offs_n, mask, n_mask,
                 BITS: tl.constexpr, GROUP: tl.constexpr, TILE_IN_GROUP: tl.constexpr):
    """Weight tile ``[BK, BN]`` fp32 of expert ``e64``: (k, n) = code[n, k] * scale[n, k // G] + zero[n, k // G].

    ``q_ptr``: uint8 codes ``[E, R, RB]`` (strides ``stride_qe``, ``stride_qr``, 1), code ``k`` of a row in
    byte ``k // (8 // BITS)`` at bit ``(k % (8 // BITS)) * BITS``; ``s_ptr`` / ``z_ptr``: ``[E, R, NG]``
    scales / zeros (last stride 1). ``offs_k``: input columns (the tile starts at column ``k0``),
    ``offs_n``: output rows; ``mask`` ``[BK, BN]`` / ``n_mask`` ``[BN]``: elements / rows that exist.
    ``TILE_IN_GROUP`` (``GROUP % BLOCK_K == 0``): the whole tile lies in group
    ``k0 // GROUP``, so one scale and zero per row are loaded (``[BN]``) instead of a ``[BK, BN]`` gather.
    """
    rows = offs_n[None, :].to(tl.int64)
    cols = offs_k[:, None]
    byte = tl.load(q_ptr + e64 * stride_qe + rows * stride_qr + cols // (8 // BITS), mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((cols % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)
    if TILE_IN_GROUP:
        r1 = offs_n.to(tl.int64)
        g = k0 // GROUP
        s = tl.load(s_ptr + e64 * stride_se + r1 * stride_sr + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + e64 * stride_ze + r1 * stride_zr + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        grp = cols // GROUP
        s = tl.load(s_ptr + e64 * stride_se + rows * stride_sr + grp, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + e64 * stride_ze + rows * stride_zr + grp, mask=mask, other=0.0).to(tl.float32)
    w = code.to(tl.float32) * s + z
    return tl.where(mask, w, 0.0)


@triton.jit(do_not_specialize=["num_pairs"])
def gate_up_q_kernel(
    x_ptr, q1_ptr, s1_ptr, z1_ptr, q3_ptr, s3_ptr, z3_ptr, h_ptr, pair_ptr, block_expert_ptr,
    num_pairs, D, F, top_k,
    stride_xt, stride_xd, stride_hp, stride_hf,
    stride_q1e, stride_q1r, stride_s1e, stride_s1r, stride_z1e, stride_z1r,
    stride_q3e, stride_q3r, stride_s3e, stride_s3r, stride_z3e, stride_z3r,
    BITS_1: tl.constexpr, BITS_3: tl.constexpr, GROUP: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """h[p, n] = silu(x[t] . deq(w1_e)[n]) * (x[t] . deq(w3_e)[n]) for the pairs p of this block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, F, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    token = (pair // top_k).to(tl.int64)
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (D + BLOCK_K - 1) // BLOCK_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < D
        a = _load_rows(x_ptr, token, offs_k, stride_xt, stride_xd, row_mask, k_mask)
        wmask = k_mask[:, None] & n_mask[None, :]
        b1 = dequant_tile(q1_ptr, s1_ptr, z1_ptr, e64, stride_q1e, stride_q1r, stride_s1e, stride_s1r,
                          stride_z1e, stride_z1r, kb * BLOCK_K, offs_k, offs_n, wmask, n_mask,
                          BITS_1, GROUP, TILE_IN_GROUP)
        b3 = dequant_tile(q3_ptr, s3_ptr, z3_ptr, e64, stride_q3e, stride_q3r, stride_s3e, stride_s3r,
                          stride_z3e, stride_z3r, kb * BLOCK_K, offs_k, offs_n, wmask, n_mask,
                          BITS_3, GROUP, TILE_IN_GROUP)
        b1 = b1.to(x_ptr.dtype.element_ty)  # the dequantized weight in the activation dtype, as the reference
        b3 = b3.to(x_ptr.dtype.element_ty)
        acc_g = _dot(a, b1, acc_g, DOT_PRECISION, UPCAST_DOT)
        acc_u = _dot(a, b3, acc_u, DOT_PRECISION, UPCAST_DOT)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SwiGLU in fp32
    _store_h(h, h_ptr, pair, row_mask, offs_n, n_mask, stride_hp, stride_hf)


@triton.jit(do_not_specialize=["num_pairs"])
def down_q_kernel(
    h_ptr, q2_ptr, s2_ptr, z2_ptr, y_ptr, pair_ptr, block_expert_ptr, rw_ptr,
    num_pairs, D, F,
    stride_hp, stride_hf, stride_yp, stride_yd,
    stride_q2e, stride_q2r, stride_s2e, stride_s2r, stride_z2e, stride_z2r,
    BITS_2: tl.constexpr, GROUP: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """y[p, n] = topk_weight[p] * (h[p] . deq(w2_e)[n]) in fp32 for the pairs p of this block."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, D, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    pair64 = pair.to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (F + BLOCK_K - 1) // BLOCK_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < F
        a = _load_rows(h_ptr, pair64, offs_k, stride_hp, stride_hf, row_mask, k_mask)
        b = dequant_tile(q2_ptr, s2_ptr, z2_ptr, e64, stride_q2e, stride_q2r, stride_s2e, stride_s2r,
                         stride_z2e, stride_z2r, kb * BLOCK_K, offs_k, offs_n, k_mask[:, None] & n_mask[None, :],
                         n_mask, BITS_2, GROUP, TILE_IN_GROUP)
        b = b.to(h_ptr.dtype.element_ty)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST_DOT)
    _store_weighted(acc, y_ptr, rw_ptr, pair64, row_mask, offs_n, n_mask, stride_yp, stride_yd)


@triton.jit
def _interleave_cols(a, b, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, 2 * COLS]`` with columns ``a[:, 0], b[:, 0], a[:, 1], b[:, 1], ...`` of two ``[ROWS, COLS]`` tensors.

    ``tl.join`` (new minor dimension of size 2) then a reshape that merges it into the columns: what
    ``tl.interleave`` does, written with the two builtins because ``tl.interleave`` is a ``@triton.jit``
    function of triton's standard library (see the module docstring on the interpreter).
    """
    return tl.reshape(tl.join(a, b), (ROWS, 2 * COLS))


@triton.jit
def dequant_kernel(
    q_ptr, s_ptr, z_ptr, out_ptr,
    R, C, RB,
    stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr, stride_oe, stride_or,
    BITS: tl.constexpr, GROUP: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Dense weights out[e, r, c] = code[e, r, c] * scale[e, r, c // G] + zero[e, r, c // G] (fp32, then cast).

    Program (pid_r, pid_c, e) writes the contiguous output tile of rows ``[pid_r * BLOCK_R, +BLOCK_R)`` and
    columns ``[pid_c * BLOCK_C, +BLOCK_C)`` of expert ``e`` (vectorized stores along the row). It loads the
    ``BLOCK_C // (8 // BITS)`` packed bytes of those columns per row in one coalesced ``[BLOCK_R, BLOCK_B]``
    uint8 load, splits them into the ``8 // BITS`` code planes (plane ``j``: bits ``[j * BITS, +BITS)`` of
    each byte, column ``byte * (8 // BITS) + j``) and interleaves the planes back into column order with
    ``tl.join`` + ``tl.reshape`` (2 bits: ``(c0, c2)`` and ``(c1, c3)`` first, then those two).
    ``q_ptr``: uint8 ``[E, R, RB]`` (strides ``stride_qe``, ``stride_qr``, 1); ``s_ptr`` / ``z_ptr``:
    ``[E, R, NG]`` (last stride 1); ``out_ptr``: ``[E, R, C]`` (last stride 1). ``BLOCK_C`` is a power of two
    and a multiple of ``8 // BITS``. Columns ``>= C`` (the zero codes completing a last byte, the tail of the
    last column tile) and rows ``>= R`` are not stored.
    ``TILE_IN_GROUP`` (``GROUP % BLOCK_C == 0``): the tile's columns lie in one group, so one scale and one zero
    per row are loaded (``[BLOCK_R]``); otherwise a per-element ``[BLOCK_R, BLOCK_C]`` gather (cache hits).
    The launch sets ``enable_fp_fusion=False`` so ``code * scale + zero`` rounds twice, as torch does.
    """
    PER: tl.constexpr = 8 // BITS
    BLOCK_B: tl.constexpr = BLOCK_C // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    e64 = tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < R
    rows64 = rows.to(tl.int64)
    byte_idx = pid_c * BLOCK_B + tl.arange(0, BLOCK_B)
    packed = tl.load(q_ptr + e64 * stride_qe + rows64[:, None] * stride_qr + byte_idx[None, :],
                     mask=r_mask[:, None] & (byte_idx < RB)[None, :], other=0)  # [BLOCK_R, BLOCK_B] uint8
    if BITS == 4:
        code = _interleave_cols(packed & MASK, packed >> 4, BLOCK_R, BLOCK_B)
    else:  # BITS == 2: c0 c2 -> [c0 c2 ..], c1 c3 -> [c1 c3 ..], then -> [c0 c1 c2 c3 ..]
        c02 = _interleave_cols(packed & MASK, (packed >> 4) & MASK, BLOCK_R, BLOCK_B)
        c13 = _interleave_cols((packed >> 2) & MASK, packed >> 6, BLOCK_R, BLOCK_B)
        code = _interleave_cols(c02, c13, BLOCK_R, 2 * BLOCK_B)
    code = code.to(tl.float32)  # [BLOCK_R, BLOCK_C], column c of the tile = code of column pid_c * BLOCK_C + c
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m = r_mask[:, None] & (cols < C)[None, :]
    s_row = s_ptr + e64 * stride_se + rows64 * stride_sr  # [BLOCK_R] pointers to each row's groups
    z_row = z_ptr + e64 * stride_ze + rows64 * stride_zr
    if TILE_IN_GROUP:
        g = (pid_c * BLOCK_C) // GROUP
        s = tl.load(s_row + g, mask=r_mask, other=0.0).to(tl.float32)[:, None]  # [BLOCK_R, 1]
        z = tl.load(z_row + g, mask=r_mask, other=0.0).to(tl.float32)[:, None]
    else:
        grp = (cols // GROUP)[None, :]
        s = tl.load(s_row[:, None] + grp, mask=m, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_C]
        z = tl.load(z_row[:, None] + grp, mask=m, other=0.0).to(tl.float32)
    w = code * s + z
    o_ptrs = out_ptr + e64 * stride_oe + rows64[:, None] * stride_or + cols[None, :]
    tl.store(o_ptrs, w.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def host_read_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i < n, with ``src`` in pinned host memory read by the SMs over PCIe (zero-copy), so the
    transfer does not queue behind the DMA copies on the host-to-device copy engine. Flat index in int64."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["P"])
def moe_align_kernel(
    ids_ptr, sorted_pair_ptr, sorted_token_ptr, offsets_ptr, counts_ptr, P, E, top_k,
    E_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Stable counting sort of the P routed pairs by expert, in one program (grid (1,)).

    Pass 1 counts each expert's pairs over blocks of ``BLOCK`` ids (a ``[BLOCK, E_PAD]`` hit matrix summed over
    rows); their exclusive prefix sum is each expert's first row. Pass 2 walks the blocks again in order: pair p of
    expert e goes to row ``first[e] + (pairs of e before p)``, the count before p within the block from a prefix
    sum down the hit matrix, plus the pairs of e in earlier blocks. So pairs keep increasing p within an expert
    (``torch.sort(stable=True)``'s order). Writes ``sorted_pair[row] = p``, ``sorted_token[row] = p // top_k``,
    ``counts[e]`` and ``offsets[e]`` (e < E), ``offsets[E] = `` the pairs with an id in ``[0, E)``, all int64;
    a pair whose id is outside ``[0, E)`` is not written.
    """
    experts = tl.arange(0, E_PAD)
    counts = tl.full([E_PAD], 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
        counts += tl.reduce(hit, 0, _sum_combine)
    counts = tl.where(experts < E, counts, 0)
    first = tl.associative_scan(counts, 0, _sum_combine) - counts  # [E_PAD] exclusive prefix sum
    tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
    tl.store(offsets_ptr + experts, first.to(tl.int64), mask=experts < E)
    tl.store(offsets_ptr + E, tl.reduce(counts, 0, _sum_combine).to(tl.int64))
    run = first  # [E_PAD] next free row of each expert
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
        before = tl.associative_scan(hit, 0, _sum_combine) - hit  # [BLOCK, E_PAD] same-expert pairs earlier in the block
        row = tl.reduce(hit * (before + run[None, :]), 1, _sum_combine)  # [BLOCK]
        ok = (p < P) & (ids >= 0) & (ids < E)
        tl.store(sorted_pair_ptr + row, p.to(tl.int64), mask=ok)
        tl.store(sorted_token_ptr + row, (p // top_k).to(tl.int64), mask=ok)
        run += tl.reduce(hit, 0, _sum_combine)


@triton.jit
def decode_append_attention_kernel(
    q_ptr, knew_ptr, vnew_ptr, kc_ptr, vc_ptr, out_ptr, base_ptr, cap_ptr, pos_ptr, sinks_ptr,
    G, HD, window, sm_scale,
    stride_qb, stride_qh, stride_nb, stride_nh, stride_ob,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    """One decode step of one (row r, KV head h) over a ragged flat KV cache: append, then GQA attention.

    The cache is a flat array of hd-vectors; row r's head h holds ``cap[r]`` positions starting at vector
    ``base[r] + h * cap[r]``. The new k / v (``knew`` / ``vnew`` [B, Hkv, hd]) are written at position ``pos[r]``,
    and the G query heads ``h*G .. h*G+G-1`` of row r attend over positions ``[start, pos[r]]`` (start = 0, or
    pos[r] + 1 - window with a sliding window): cached positions streamed in blocks of BLOCK_N, the new one from
    registers (no read-after-write of the same program's store). Online softmax and accumulation in fp32
    (Flash-Decoding's single-split case); output [B, Hq*hd] in ``out``'s dtype. Offsets in int64. With SINKS each
    query head's sink logit (fp32 ``sinks`` [Hq], gpt-oss) joins its softmax's denominator and adds no value.
    """
    r = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    cap = tl.load(cap_ptr + r).to(tl.int64)
    L = tl.load(pos_ptr + r).to(tl.int64)  # cached positions before this token; the new one goes to L
    row = tl.load(base_ptr + r).to(tl.int64) + h * cap  # first hd-vector of (r, h)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mg = offs_g < G
    md = offs_d < HD
    r64 = r.to(tl.int64)
    q = tl.load(q_ptr + r64 * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=mg[:, None] & md[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    kn = tl.load(knew_ptr + r64 * stride_nb + h * stride_nh + offs_d, mask=md, other=0.0)  # [D_PAD]
    vn = tl.load(vnew_ptr + r64 * stride_nb + h * stride_nh + offs_d, mask=md, other=0.0)
    tl.store(kc_ptr + (row + L) * HD + offs_d, kn, mask=md)
    tl.store(vc_ptr + (row + L) * HD + offs_d, vn, mask=md)
    # the new token first: m = its score, l = 1, acc = its value
    m_i = tl.reduce(q * kn.to(tl.float32)[None, :], 1, _sum_combine) * sm_scale  # [G_PAD]
    l_i = tl.full([G_PAD], 1.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32) + vn.to(tl.float32)[None, :]  # [G_PAD, D_PAD]
    start = L * 0
    if WINDOW:
        start = L + 1 - window
        start = tl.where(start > 0, start, 0)
    for n0 in range(start, L, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] cached positions
        mn = offs_n < L
        ptr = (row + offs_n)[:, None] * HD + offs_d[None, :]
        mk = mn[:, None] & md[None, :]
        k = tl.load(kc_ptr + ptr, mask=mk, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        s = tl.reduce(q[:, None, :] * k[None, :, :], 2, _sum_combine) * sm_scale  # [G_PAD, BLOCK_N]
        s = tl.where(mn[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [G_PAD]
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [G_PAD, BLOCK_N]
        v = tl.load(vc_ptr + ptr, mask=mk, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.reduce(p[:, :, None] * v[None, :, :], 1, _sum_combine)
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        m_i = m_new
    if SINKS:  # one more logit per query head, with no value: rescale to the joint max, add exp(sink) to l
        sk = tl.load(sinks_ptr + h * G + offs_g, mask=mg, other=float("-inf")).to(tl.float32)  # [G_PAD]
        m_new = tl.maximum(m_i, sk)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sk - m_new)
    o = acc / l_i[:, None]
    o_ptrs = out_ptr + r64 * stride_ob + (h * G + offs_g)[:, None] * HD + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mg[:, None] & md[None, :])


@triton.jit
def mxfp4_tile(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, rows, offs_k, mask):
    """MXFP4 weight tile ``[BK, BN]`` fp32 of expert ``e64``: (k, n) = E2M1(code of row ``rows[n]``, column k) *
    2^(scale - 127), dequantized in registers.

    ``blk_ptr``: uint8 blocks ``[E, R, C / 32, 16]`` (strides ``stride_be``, ``stride_br``, 16, 1: column k of a row
    in byte ``k // 2``, the low nibble for even k); ``sc_ptr``: uint8 E8M0 scales ``[E, R, C / 32]`` (last stride 1).
    ``rows``: ``[BN]`` output rows; ``offs_k``: ``[BK]`` input columns; ``mask`` ``[BK, BN]``: elements that exist.
    E2M1 (code: sign bit, 2 exponent bits, 1 mantissa bit): exponent 0 -> mantissa * 0.5, else
    (1 + mantissa / 2) * 2^(exponent - 1); the power of two is built as fp32 bits (``scale << 23``; scale 0 is the
    subnormal 2^-127), so value * 2^(scale - 127) is exact, as transformers' ``ldexp``.
    """
    r = rows[None, :].to(tl.int64)
    k = offs_k[:, None]
    byte = tl.load(blk_ptr + e64 * stride_be + r * stride_br + k // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((k % 2) * 4)) & 15  # [BK, BN]
    ex = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(ex == 0, man * 0.5, (1.0 + man * 0.5) * (1 << ex).to(tl.float32) * 0.5)
    val = tl.where(code >= 8, -mag, mag)
    s = tl.load(sc_ptr + e64 * stride_se + r * stride_sr + k // 32, mask=mask, other=127).to(tl.int32)
    pow2 = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) as fp32 bits
    return tl.where(mask, val * pow2, 0.0)


@triton.jit
def _e2m1_values(code):
    """E2M1 codes (int32 0..15: sign, 2 exponent bits, 1 mantissa bit) as fp32, built as fp32 bits: exponent 0 ->
    mantissa * 0.5 (0 or 2^-1), else (1 + mantissa / 2) * 2^(exponent - 1)."""
    ex = (code >> 1) & 3
    man = code & 1
    bits = tl.where(ex == 0, man * (126 << 23), ((ex + 126) << 23) | (man << 22))
    return (bits | ((code >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_pair_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, rows, offs_p, mask):
    """The even and odd input columns of an MXFP4 weight tile of expert ``e64``: ``([BKH, BN], [BKH, BN])`` fp32,
    columns ``2 * offs_p`` and ``2 * offs_p + 1`` of output rows ``rows`` (:func:`mxfp4_tile`'s values): one byte
    load and one scale load per pair of columns (byte ``p`` of a row holds columns 2p, low nibble, and 2p + 1).
    ``mask`` ``[BKH, BN]``: pairs that exist (masked pairs read byte 0, the value 0)."""
    r = rows[None, :].to(tl.int64)
    p = offs_p[:, None]
    byte = tl.load(blk_ptr + e64 * stride_be + r * stride_br + p, mask=mask, other=0).to(tl.int32)
    s = tl.load(sc_ptr + e64 * stride_se + r * stride_sr + p // 16, mask=mask, other=127).to(tl.int32)
    pow2 = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) as fp32 bits
    return _e2m1_values(byte & 15) * pow2, _e2m1_values(byte >> 4) * pow2


@triton.jit
def mxfp4_packed_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, rows, kb, K,
                       BLOCK_K: tl.constexpr, n_mask):
    """Block ``kb`` of ``BLOCK_K`` input columns of expert ``e64``'s MXFP4 weight, as ``tl.dot_scaled`` takes it:
    the packed E2M1 bytes ``uint8 [BLOCK_K / 2, BN]`` (byte p of row ``rows[n]``: columns 2p, low nibble, and 2p + 1)
    and the E8M0 scales ``uint8 [BN, BLOCK_K / 32]``; bytes past ``K`` read 0 (the value 0), their scales 127."""
    r = rows.to(tl.int64)
    offs_p = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    offs_s = kb * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    byte = tl.load(blk_ptr + e64 * stride_be + r[None, :] * stride_br + offs_p[:, None],
                   mask=(offs_p < K // 2)[:, None] & n_mask[None, :], other=0)
    scale = tl.load(sc_ptr + e64 * stride_se + r[:, None] * stride_sr + offs_s[None, :],
                    mask=n_mask[:, None] & (offs_s < K // 32)[None, :], other=127)
    return byte, scale


@triton.jit(do_not_specialize=["num_pairs"])
def gate_up_mx_kernel(
    x_ptr, blk_ptr, sc_ptr, bias_ptr, h_ptr, pair_ptr, block_expert_ptr,
    num_pairs, D, F, top_k, limit, alpha,
    stride_xt, stride_xd, stride_hp, stride_hf,
    stride_be, stride_br, stride_se, stride_sr, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PAIRED: tl.constexpr = False, SCALED: tl.constexpr = False,
    JOINT: tl.constexpr = False,
):
    """h[p, n] = (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(x[t] . W[e, 2n] + b[e, 2n], limit),
    u = x[t] . W[e, 2n + 1] + b[e, 2n + 1] (gpt-oss: gate and up interleaved in the 2F rows of gate_up), for the
    BLOCK_M pairs p of this block; W dequantized from MXFP4 in registers (:func:`mxfp4_tile`; ``PAIRED``:
    :func:`mxfp4_pair_tiles`, the even and odd input columns as two dot products; ``SCALED``: the packed bytes and
    scales (:func:`mxfp4_packed_tiles`) to ``tl.dot_scaled``, which upcasts them to bf16: x bf16 only; ``SCALED`` and
    ``JOINT``: one dot_scaled over the 2 BLOCK_N contiguous gate_up rows 2n, 2n + 1 of the block, its accumulator's even
    and odd columns split into gate and up after the loop)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, F, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    token = (pair // top_k).to(tl.int64)
    g_rows = 2 * offs_n  # gate: even rows of gate_up
    u_rows = 2 * offs_n + 1  # up: odd rows
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    gu_rows = 2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # JOINT: gate_up rows 2n and 2n + 1
    acc_gu = tl.full((BLOCK_M, 2 * BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (D + BLOCK_K - 1) // BLOCK_K):
        if SCALED and JOINT:
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = _load_rows(x_ptr, token, offs_k, stride_xt, stride_xd, row_mask, offs_k < D)
            b, sb = mxfp4_packed_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, gu_rows, kb,
                                       D, BLOCK_K, gu_rows < 2 * F)
            acc_gu = tl.dot_scaled(a, None, "bf16", b, sb, "e2m1", acc=acc_gu)
        elif SCALED:
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = _load_rows(x_ptr, token, offs_k, stride_xt, stride_xd, row_mask, offs_k < D)
            bg, sg = mxfp4_packed_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, g_rows, kb,
                                        D, BLOCK_K, n_mask)
            bu, su = mxfp4_packed_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, u_rows, kb,
                                        D, BLOCK_K, n_mask)
            acc_g = tl.dot_scaled(a, None, "bf16", bg, sg, "e2m1", acc=acc_g)
            acc_u = tl.dot_scaled(a, None, "bf16", bu, su, "e2m1", acc=acc_u)
        elif PAIRED:  # columns 2p (low nibbles) and 2p + 1 (high) of BLOCK_K // 2 byte columns p
            offs_p = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            p_mask = offs_p < D // 2
            a0 = _load_rows(x_ptr, token, 2 * offs_p, stride_xt, stride_xd, row_mask, p_mask)
            a1 = _load_rows(x_ptr, token, 2 * offs_p + 1, stride_xt, stride_xd, row_mask, p_mask)
            wmask = p_mask[:, None] & n_mask[None, :]
            g0, g1 = mxfp4_pair_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, g_rows,
                                      offs_p, wmask)
            u0, u1 = mxfp4_pair_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, u_rows,
                                      offs_p, wmask)
            dt = x_ptr.dtype.element_ty  # the dequantized weight in the activation dtype, as the reference
            acc_g = _dot(a1, g1.to(dt), _dot(a0, g0.to(dt), acc_g, DOT_PRECISION, UPCAST_DOT), DOT_PRECISION, UPCAST_DOT)
            acc_u = _dot(a1, u1.to(dt), _dot(a0, u0.to(dt), acc_u, DOT_PRECISION, UPCAST_DOT), DOT_PRECISION, UPCAST_DOT)
        else:
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < D
            a = _load_rows(x_ptr, token, offs_k, stride_xt, stride_xd, row_mask, k_mask)
            wmask = k_mask[:, None] & n_mask[None, :]
            bg = mxfp4_tile(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, g_rows, offs_k, wmask)
            bu = mxfp4_tile(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, u_rows, offs_k, wmask)
            bg = bg.to(x_ptr.dtype.element_ty)  # the dequantized weight in the activation dtype, as the reference
            bu = bu.to(x_ptr.dtype.element_ty)
            acc_g = _dot(a, bg, acc_g, DOT_PRECISION, UPCAST_DOT)
            acc_u = _dot(a, bu, acc_u, DOT_PRECISION, UPCAST_DOT)
    if SCALED and JOINT:  # column 2i: gate of output n = pid_n BLOCK_N + i, column 2i + 1: its up
        acc_g, acc_u = tl.split(tl.reshape(acc_gu, (BLOCK_M, BLOCK_N, 2)))
    b_row = bias_ptr + e64 * stride_bias_e
    g = acc_g + tl.load(b_row + g_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    u = acc_u + tl.load(b_row + u_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))  # clamped SwiGLU in fp32
    _store_h(h, h_ptr, pair, row_mask, offs_n, n_mask, stride_hp, stride_hf)


@triton.jit(do_not_specialize=["num_pairs"])
def down_mx_kernel(
    h_ptr, blk_ptr, sc_ptr, bias_ptr, y_ptr, pair_ptr, block_expert_ptr, rw_ptr,
    num_pairs, D, F,
    stride_hp, stride_hf, stride_yp, stride_yd,
    stride_be, stride_br, stride_se, stride_sr, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PAIRED: tl.constexpr = False, SCALED: tl.constexpr = False,
):
    """y[p, n] = topk_weight[p] * (h[p] . W2[e, n] + b2[e, n]) in fp32 for the pairs p of this block (W2 MXFP4;
    ``PAIRED``, ``SCALED`` as :func:`gate_up_mx_kernel`'s)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    pair, row_mask, offs_n, n_mask = _block_tile(pair_ptr, num_pairs, D, pid_m, tl.program_id(1), BLOCK_M, BLOCK_N)
    pair64 = pair.to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(0, (F + BLOCK_K - 1) // BLOCK_K):
        if SCALED:
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = _load_rows(h_ptr, pair64, offs_k, stride_hp, stride_hf, row_mask, offs_k < F)
            b, sb = mxfp4_packed_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, offs_n, kb,
                                       F, BLOCK_K, n_mask)
            acc = tl.dot_scaled(a, None, "bf16", b, sb, "e2m1", acc=acc)
        elif PAIRED:
            offs_p = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            p_mask = offs_p < F // 2
            a0 = _load_rows(h_ptr, pair64, 2 * offs_p, stride_hp, stride_hf, row_mask, p_mask)
            a1 = _load_rows(h_ptr, pair64, 2 * offs_p + 1, stride_hp, stride_hf, row_mask, p_mask)
            b0, b1 = mxfp4_pair_tiles(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, offs_n, offs_p,
                                      p_mask[:, None] & n_mask[None, :])
            dt = h_ptr.dtype.element_ty
            acc = _dot(a1, b1.to(dt), _dot(a0, b0.to(dt), acc, DOT_PRECISION, UPCAST_DOT), DOT_PRECISION, UPCAST_DOT)
        else:
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < F
            a = _load_rows(h_ptr, pair64, offs_k, stride_hp, stride_hf, row_mask, k_mask)
            b = mxfp4_tile(blk_ptr, sc_ptr, e64, stride_be, stride_br, stride_se, stride_sr, offs_n, offs_k,
                           k_mask[:, None] & n_mask[None, :])
            b = b.to(h_ptr.dtype.element_ty)
            acc = _dot(a, b, acc, DOT_PRECISION, UPCAST_DOT)
    acc = acc + tl.load(bias_ptr + e64 * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_weighted(acc, y_ptr, rw_ptr, pair64, row_mask, offs_n, n_mask, stride_yp, stride_yd)


# --------------------------------------------------------------------------------------------------
# element-wise epilogues of the grouped_mm FFN (kernels.fused_moe.silu_mul_triton, moe_combine_triton)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (round to nearest even) and returned in ``DTYPE``.

    ``RNE_BY_HAND`` (set for bf16 under the Triton interpreter, whose fp32 -> bf16 cast truncates): add half an
    ulp of bf16 plus the kept last bit to the fp32 bits and clear the 16 low bits, so the interpreter's truncating
    cast is exact; NaN passes through unchanged (the addition could carry a NaN's payload into the exponent).
    Compiled code casts with ``.to`` (``cvt.rn``: round to nearest even).
    """
    if RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        r = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r).to(DTYPE)
    return x.to(DTYPE)


@triton.jit(do_not_specialize=["M"])
def silu_mul_kernel(
    g_ptr, u_ptr, h_ptr, M, N,
    stride_gm, stride_um, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):
    """h[m, n] = round(round(silu(g[m, n])) * u[m, n]) for the ``[BLOCK_M, BLOCK_N]`` tile of program (pid_m, pid_n).

    ``g``, ``u``, ``h`` are ``[M, N]`` with row strides ``stride_*m`` and contiguous rows (``h`` may be a column
    slice of a wider buffer, or ``g`` itself). ``silu(g) = g / (1 + exp(-g))`` in fp32 from ``g``, rounded to the
    dtype of ``h`` (what ``F.silu`` does on a 16-bit tensor); its product with ``u`` in fp32, rounded once (what
    ``torch.mul`` does). The division is IEEE (``div_rn``, as CUDA C++'s ``/``); ``LIBDEVICE_EXP`` (compiled
    code): ``exp`` is libdevice's ``expf`` (CUDA's ``expf``, which torch's CUDA silu calls) rather than
    ``tl.exp``'s ``ex2.approx``; the interpreter has no libdevice and uses numpy's ``exp``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:  # interpreter: exp in fp64, rounded to fp32 (nearest to a correctly rounded expf; numpy's fp32 exp is not)
        e = tl.exp(-g.to(tl.float64)).to(tl.float32)
    s = _round_to(tl.math.div_rn(g, 1.0 + e), h_ptr.dtype.element_ty, RNE_BY_HAND).to(tl.float32)
    h = _round_to(s * u, h_ptr.dtype.element_ty, RNE_BY_HAND)
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], h, mask=mask)


@triton.jit
def moe_combine_kernel(
    yd_ptr, rank_ptr, w_ptr, ids_ptr, out_ptr, D, top_k, skip_id,
    stride_yp, stride_rt, stride_rk, stride_wt, stride_wk, stride_it, stride_ik, stride_ot,
    SKIP: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):
    """out[t, d] = round(sum_j w[t, j] * yd[rank[t, j], d]) for the ``BLOCK_D`` columns of program (t, pid_d).

    fp32 accumulator from 0, slots in increasing j (``w`` converted to fp32, ``yd`` upcast), one rounding to the
    dtype of ``out``. ``SKIP``: a slot whose id equals ``skip_id`` adds exactly 0 and its row of ``yd`` is not
    loaded (the grouped GEMM never wrote it: it may hold NaN). Rows of ``yd`` and ``out`` are contiguous.
    """
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.full((BLOCK_D,), 0.0, dtype=tl.float32)
    for j in range(0, top_k):
        row = tl.load(rank_ptr + t * stride_rt + j * stride_rk).to(tl.int64)
        w = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        m = d_mask
        if SKIP:  # one comparison: the interpreter's `&` of a vector and a scalar mask gives integers, not a mask
            keep = tl.load(ids_ptr + t * stride_it + j * stride_ik) != skip_id
            m = offs_d < keep.to(tl.int32) * D
            w = tl.where(keep, w, 0.0)
        y = tl.load(yd_ptr + row * stride_yp + offs_d, mask=m, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + t * stride_ot + offs_d, _round_to(acc, out_ptr.dtype.element_ty, RNE_BY_HAND), mask=d_mask)
