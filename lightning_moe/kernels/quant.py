"""Expert weight quantization, fixed-size expert pages, and the expert FFN computed from packed pages.

Dimension key: ``T`` tokens, ``D`` hidden size, ``F`` per-expert FFN width, ``E`` experts, ``k`` top-k,
``G`` group size, ``R`` rows, ``C`` columns (the input / reduction dimension of an HF ``[out, in]``
weight), ``NG = cdiv(C, G)`` groups per row, ``RB = cdiv(C * bits, 8)`` packed bytes per row.

1. Group-wise asymmetric quantization along the reduction dimension (W4A16 as in CommitMoE; INT2 for
   up_proj as in FloE): per group of G consecutive input columns of one row,

       scale = (max - min) / (2^bits - 1),   zero = min,   code = clamp(round((w - zero) / scale), 0, 2^bits - 1)
       w ~= code * scale + zero,             |w - (code * scale + zero)| <= scale / 2     (per element)

   ``zero`` is a floating offset (the group minimum), not an integer zero-point as in GPTQ/AWQ, so the
   bound above holds without clamping. Scales and zeros are stored in ``scale_dtype`` (fp16 default)
   and rounded *outward* (zero rounded down, scale rounded up until ``zero + L*scale >= max``), so the
   bound holds with the stored scale: see :func:`quant_error_bound` and :func:`analytic_error_bound`.
   If C is not a multiple of G the last group of a row is shorter: its scale and zero come from its
   real columns only (implemented by padding with copies of the row's last column, which leaves min/max
   unchanged); no codes are stored for the padding.

2. Fixed-size expert pages (CommitMoE: "quantization padding so every expert page has one size"):
   :func:`expert_page_layout` gives byte offsets of w1/w3/w2 payloads and their scales/zeros inside one
   ``uint8`` page (an :class:`ExpertPageLayout`: a :class:`~lightning_moe.kernels.pages.PageLayout` whose
   entries are these segments, with the scheme's fields), every segment starting at a multiple of
   ``segment_align`` (16) bytes and the page padded to a multiple of ``align`` (4096) bytes, so all experts of a
   layer (and of a model) have the same page size. Schemes: ``bf16`` / ``fp16`` / ``fp32`` (unquantized), ``int4``
   (all projections 4-bit), ``int2`` (all 2-bit), ``int2-up`` = ``int4-up2`` (gate/down 4-bit, up 2-bit, after
   FloE's INT2 up_proj). With the defaults, and every segment a multiple of 16 bytes (true for Mixtral, and for any
   D, F that are multiples of 32 with G = 128), ``page_bytes`` equals ``MoESpec.expert_bytes(scheme)``:
   ``roundup(sum over projections of out*in*bits/8 + out*cdiv(in, 128)*4, 4096)``.

3. :func:`fused_experts_paged_triton` -- the routed-expert FFN read directly from a stacked page buffer
   ``[E, page_bytes]``: codes are dequantized in registers (``code * scale + zero`` in fp32, cast to
   the activation dtype), multiplied with ``tl.dot`` and accumulated in fp32; grouped by expert exactly
   as :func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`. Its reference is
   :func:`experts_ffn_quant_reference` (dequantize, then the torch reference FFN).

4. :func:`dequantize_triton` / :func:`dequantize_pages_triton` -- a memory-bound Triton kernel that decodes
   packed experts into dense ``[E, R, C]`` weights in the activation dtype, bit-identical to
   :func:`dequantize` / :func:`unpack_expert_page`. :func:`fused_experts_quant_triton` (and so
   :func:`fused_experts_paged_triton`) takes ``mode="dequant" | "fused"``: "dequant" (the default) decodes the
   experts of the call into a dense scratch and runs the bf16 grouped kernel
   :func:`~lightning_moe.kernels.fused_moe.fused_experts_triton` on it; "fused" dequantizes in registers inside the
   GEMM and reads only the packed bytes, but repeats the dequantization for every M-block; with the dequantization
   near HBM bandwidth, dequantize + dense is faster at every T on Mixtral-size experts (benchmarks/bench_quant_ffn.py;
   the measured times are in docs/CHANGELOG.md).

Triton is imported lazily (kernels in :mod:`lightning_moe.kernels._triton_kernels`); importing this
module needs only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from .fused_moe import (
    REFERENCE_ORDERS,
    MoEKernelConfig,
    _cdiv,
    _check_id_range,
    _check_routing,
    _check_triton_device,
    _dot_precision,
    _interpret_mode,
    _sum_slots,
    _triton_kernels,
    _TRITON_DTYPES,
    default_kernel_config,
    experts_ffn_reference_from,
    fused_experts_triton,
    kernel_alignment,
)
from .pages import PageLayout

__all__ = [
    "DEQUANT_MODES",
    "PAGE_SCHEMES",
    "dense_expert_scratch",
    "dequantize_pages_triton",
    "dequantize_triton",
    "ExpertPageLayout",
    "PageScheme",
    "QuantTensor",
    "analytic_error_bound",
    "dequantize",
    "expert_page_layout",
    "experts_ffn_quant_reference",
    "fused_experts_paged_triton",
    "fused_experts_quant_triton",
    "experts_ffn_qt_reference",
    "expert_tensor_specs",
    "quant_tensors_from_views",
    "pack_expert_page",
    "pack_expert_pages",
    "page_quant_tensors",
    "page_weight_views",
    "quant_error_bound",
    "quantize_groupwise",
    "unpack_expert_page",
]

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

DEQUANT_MODES = ("dequant", "fused")  # fused_experts_quant_triton's paths (see the module docstring, 4.)

# --------------------------------------------------------------------------------------------------
# group-wise quantization (pure torch)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantTensor:
    """A group-wise asymmetrically quantized weight ``[..., R, C]`` (quantized along C, the input dim).

    Dequantization: ``w[..., r, c] ~= code[..., r, c] * scales[..., r, c // G] + zeros[..., r, c // G]``.
    Code ``c`` of a row sits in byte ``c * bits // 8`` at bit ``(c % (8 // bits)) * bits`` (low bits
    first: at 4 bits the even column is the low nibble).
    """

    packed: torch.Tensor  # uint8 [..., R, RB = cdiv(C * bits, 8)]: codes, 8 // bits per byte, low bits first
    scales: torch.Tensor  # scale_dtype [..., R, NG]: step of each group (>= (max - min) / (2^bits - 1))
    zeros: torch.Tensor  # scale_dtype [..., R, NG]: offset of each group (<= group minimum), not an int zero-point
    shape: tuple  # original shape (..., R, C)
    bits: int  # 4 or 2
    group_size: int  # G, columns per group
    dtype: torch.dtype = torch.bfloat16  # default dtype of dequantize() (the original weight dtype)

    @property
    def cols(self) -> int:
        """C, the unpadded column count."""
        return int(self.shape[-1])

    @property
    def n_groups(self) -> int:
        """NG = cdiv(C, G)."""
        return _cdiv(self.cols, self.group_size)

    @property
    def row_bytes(self) -> int:
        """RB = cdiv(C * bits, 8), packed bytes per row (no codes for the last group's padding)."""
        return _cdiv(self.cols * self.bits, 8)

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes + scales + zeros."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))

    def select(self, index: int) -> "QuantTensor":
        """The sub-tensor ``[index]`` along the first (e.g. expert) dimension, as views."""
        if len(self.shape) < 3:
            raise ValueError(f"QuantTensor.select: need a stacked [N, R, C] tensor, shape is {self.shape}")
        return QuantTensor(self.packed[index], self.scales[index], self.zeros[index], tuple(self.shape[1:]),
                           self.bits, self.group_size, self.dtype)


def _check_bits_group(fn: str, bits: int, group_size: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"{fn}: bits must be 4 or 2, got {bits}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")


def quantize_groupwise(
    w: torch.Tensor,
    bits: int,
    group_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantTensor:
    """Quantize ``w [..., R, C]`` (e.g. ``[F, D]`` or stacked ``[E, F, D]``) group-wise along C.

    Args:
        w: floating weight, HF ``[out, in]`` layout (groups run along ``in``, the reduction dimension).
        bits: 4 or 2.
        group_size: G, columns per group (128 default; any positive int).
            If C is not a multiple of G, the last group is shorter (scale/zero from its real columns).
        scale_dtype: dtype of the stored scales and zeros (fp16 default; bf16 for weights beyond fp16
            range; fp32 to make the analytic bound exact).

    Returns:
        :class:`QuantTensor`. The min/max, outward rounding of scale/zero, and the codes are computed in
        float64, so each code is the exact round-to-nearest of ``(w - zero) / scale`` and
        ``|w - dequantize(q)| <= scale / 2`` holds with the stored scale (plus one fp32 rounding of the
        dequantized value, <= 2^-24 |w|).

    Raises:
        ValueError: ``w`` not floating or fewer than 2 dims, bad bits / group_size / scale_dtype,
        non-finite weights, or scales/zeros that overflow ``scale_dtype``.
    """
    fn = "quantize_groupwise"
    _check_bits_group(fn, bits, group_size)
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"{fn}: w must be a floating [..., R, C] tensor, got {w.dtype} {tuple(w.shape)}")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"{fn}: scale_dtype must be one of {_SCALE_DTYPES}, got {scale_dtype}")
    *lead, R, C = w.shape
    G = group_size
    NG = _cdiv(C, G)
    Cp = NG * G
    L = (1 << bits) - 1
    wd = w.detach().to(torch.float64, copy=True)  # [..., R, C]: our own copy, rewritten in place below
    if Cp > C:  # pad the last group by repeating the last column (min/max unchanged)
        wd = torch.cat([wd, wd[..., -1:].expand(*lead, R, Cp - C)], dim=-1)
    g = wd.reshape(*lead, R, NG, G)  # [..., R, NG, G]
    mn, mx = g.amin(dim=-1), g.amax(dim=-1)  # [..., R, NG] fp64
    if mn.numel() and not (bool(torch.isfinite(mn).all()) and bool(torch.isfinite(mx).all())):  # NaN propagates
        raise ValueError(f"{fn}: w contains inf or nan")  # through amin/amax, an inf is a group's min or max

    inf = torch.tensor(float("inf"), dtype=scale_dtype, device=w.device)
    zero = mn.to(scale_dtype)
    zero = torch.where(zero.to(torch.float64) > mn, torch.nextafter(zero, -inf), zero)  # round down
    zd = zero.to(torch.float64)
    scale = ((mx - zd) / L).to(scale_dtype)
    too_small = zd + scale.to(torch.float64) * L < mx
    scale = torch.where(too_small, torch.nextafter(scale, inf), scale)  # round up
    sd = scale.to(torch.float64)
    if not (bool(torch.isfinite(sd).all()) and bool(torch.isfinite(zd).all())):
        raise ValueError(f"{fn}: group scales/zeros overflow {scale_dtype}; use scale_dtype=torch.bfloat16 or float32")

    safe = torch.where(sd > 0, sd, torch.ones_like(sd))  # constant group: scale 0, every code 0
    t = g.sub_(zd[..., None])  # [..., R, NG, G] fp64, in place in the copy (no other temporary)
    codes = t.div_(safe[..., None]).round_().clamp_(0, L).to(torch.uint8)  # [..., R, NG, G]
    del wd, g, t
    packed = _pack_codes(codes.reshape(*lead, R, Cp)[..., :C], bits)  # [..., R, cdiv(C * bits, 8)]
    return QuantTensor(packed, scale, zero, tuple(w.shape), bits, G, w.dtype)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., C]`` (< 2^bits) -> packed uint8 ``[..., cdiv(C * bits, 8)]``, low bits first.

    A partial last byte is completed with zero codes.
    """
    per = 8 // bits
    if codes.shape[-1] % per:
        pad = per - codes.shape[-1] % per
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)  # uint8 [..., B, per]
    out = c[..., 0].clone()  # [..., B]: the codes are < 2^bits, so OR-ing the shifted ones is their sum
    for i in range(1, per):
        out |= c[..., i] << (i * bits)
    return out


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_codes`: packed uint8 ``[..., B]`` -> codes uint8 ``[..., B * 8 // bits]``."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def dequantize(qt: QuantTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Pure-torch dequantization: ``code * scale + zero`` in fp32, cast to ``dtype``; ``[..., R, C]``.

    ``dtype`` defaults to ``qt.dtype`` (the quantized weight's dtype). With fp16/bf16 scales the fp32
    product ``code * scale`` is exact, so this equals the Triton kernel's in-register dequantization
    bit for bit (fused multiply-add or not).
    """
    C = qt.cols
    codes = _unpack_codes(qt.packed, qt.bits)[..., :C].to(torch.float32)  # [..., R, C]
    s = qt.scales.to(torch.float32).repeat_interleave(qt.group_size, dim=-1)[..., :C]  # [..., R, C]
    z = qt.zeros.to(torch.float32).repeat_interleave(qt.group_size, dim=-1)[..., :C]
    return (codes * s + z).to(dtype or qt.dtype)


def quant_error_bound(qt: QuantTensor) -> torch.Tensor:
    """Per-element bound ``scale / 2`` (fp32, ``[..., R, C]``) with the stored scale of each group.

    ``|w - dequantize(qt, torch.float32)| <= quant_error_bound(qt) + 2^-24 |w|`` (the last term is the
    fp32 rounding of ``code * scale + zero``). A bf16/fp16 dequantized output adds half an ulp of that
    dtype.
    """
    s = qt.scales.to(torch.float32).repeat_interleave(qt.group_size, dim=-1)[..., : qt.cols]
    return s / 2


def analytic_error_bound(w: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Per-element bound ``(max - min) / (2^bits - 1) / 2`` of each group (fp32, shape of ``w``).

    This is the exact-arithmetic bound of round-to-nearest asymmetric quantization. The stored scale
    of :func:`quantize_groupwise` exceeds ``(max - min) / L`` by at most one ulp of ``scale_dtype`` plus
    ``ulp(min) / L`` (outward rounding), i.e. by a relative 2^-10 for fp16 scales when ``|min|`` is
    comparable to ``max - min``; with ``scale_dtype=torch.float32`` the two bounds agree to ~1e-7.
    """
    _check_bits_group("analytic_error_bound", bits, group_size)
    *lead, R, C = w.shape
    NG = _cdiv(C, group_size)
    wd = w.detach().to(torch.float64)
    if NG * group_size > C:
        wd = torch.cat([wd, wd[..., -1:].expand(*lead, R, NG * group_size - C)], dim=-1)
    g = wd.reshape(*lead, R, NG, group_size)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)
    return (step / 2).repeat_interleave(group_size, dim=-1)[..., :C].to(torch.float32)


# --------------------------------------------------------------------------------------------------
# fixed-size expert pages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageScheme:
    """Storage of the three projections of one expert."""

    name: str  # scheme key, e.g. "int2-up"
    bits_w1: int  # gate: 4 or 2; 16 / 32 = unquantized, stored in weight_dtype
    bits_w3: int  # up
    bits_w2: int  # down
    weight_dtype: Optional[torch.dtype] = None  # storage dtype of unquantized projections

    def bits(self, proj: str) -> int:
        return {"w1": self.bits_w1, "w3": self.bits_w3, "w2": self.bits_w2}[proj]


PAGE_SCHEMES = {
    "bf16": PageScheme("bf16", 16, 16, 16, torch.bfloat16),
    "fp16": PageScheme("fp16", 16, 16, 16, torch.float16),
    "fp32": PageScheme("fp32", 32, 32, 32, torch.float32),
    "int4": PageScheme("int4", 4, 4, 4),  # CommitMoE W4A16
    "int2": PageScheme("int2", 2, 2, 2),  # every projection INT2
    "int2-up": PageScheme("int2-up", 4, 2, 4),  # FloE: up_proj INT2 (gate/down kept at 4 bits here)
    "int4-up2": PageScheme("int4-up2", 4, 2, 4),  # alias of int2-up
}


@dataclass(frozen=True)
class ExpertPageLayout(PageLayout):
    """Byte layout of one expert page ``uint8 [page_bytes]`` (identical for every expert of a model): a
    :class:`~lightning_moe.kernels.pages.PageLayout` whose entries are the segments ``w1``, ``w1.scales``,
    ``w1.zeros``, ``w3``, ... (codes, scales and zeros; the weights themselves for unquantized schemes), with the
    scheme that made it."""

    scheme: str  # key of PAGE_SCHEMES
    hidden_size: int  # D
    intermediate_size: int  # F
    group_size: int  # G of quantized projections
    scale_dtype: torch.dtype  # dtype of scales and zeros
    align: int  # page_bytes is a multiple of this (bytes)
    segment_align: int  # every entry offset is a multiple of this (bytes)

    @property
    def spec(self) -> PageScheme:
        return PAGE_SCHEMES[self.scheme]

    @property
    def quantized(self) -> bool:
        """True if the projections are stored as codes + scales + zeros."""
        return self.spec.weight_dtype is None


_PROJ_SHAPES = ("w1", "w3", "w2")


def expert_page_layout(
    hidden_size: int,
    intermediate_size: int,
    scheme: str,
    group_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
    align: int = 4096,
    segment_align: int = 16,
) -> ExpertPageLayout:
    """Byte layout of one expert page (w1 gate ``[F, D]``, w3 up ``[F, D]``, w2 down ``[D, F]``).

    Segments, in order: ``w1, [w1.scales, w1.zeros], w3, [...], w2, [...]``; each starts at a multiple
    of ``segment_align`` bytes and the page is padded to a multiple of ``align`` bytes (CommitMoE's
    padding to one page size; 4096 = ``EXPERT_PAGE_ALIGN`` of ``model/spec.py``). A quantized projection
    ``[R, C]`` stores ``R * cdiv(C * bits, 8)`` code bytes plus two ``[R, cdiv(C, G)]`` arrays of
    ``scale_dtype``; an unquantized one ``R * C * itemsize`` bytes.

    Raises:
        ValueError: unknown scheme, non-positive sizes, bad group size / scale dtype, ``segment_align``
        not a positive multiple of 16, ``align`` not a positive multiple of ``segment_align``.
    """
    fn = "expert_page_layout"
    if scheme not in PAGE_SCHEMES:
        raise ValueError(f"{fn}: unknown scheme {scheme!r}; choose one of {sorted(PAGE_SCHEMES)}")
    if hidden_size < 1 or intermediate_size < 1:
        raise ValueError(f"{fn}: sizes must be positive, got D={hidden_size}, F={intermediate_size}")
    if segment_align < 16 or segment_align % 16:
        raise ValueError(f"{fn}: segment_align must be a positive multiple of 16 bytes, got {segment_align}")
    if align < segment_align or align % segment_align:
        raise ValueError(f"{fn}: align must be a positive multiple of segment_align={segment_align}, got {align}")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"{fn}: scale_dtype must be one of {_SCALE_DTYPES}, got {scale_dtype}")
    sch = PAGE_SCHEMES[scheme]
    D, Fd = hidden_size, intermediate_size
    shapes = {"w1": (Fd, D), "w3": (Fd, D), "w2": (D, Fd)}
    specs = []  # (name, dtype, shape) of every segment, in page order
    for proj in _PROJ_SHAPES:
        R, C = shapes[proj]
        bits = sch.bits(proj)
        if sch.weight_dtype is not None:
            specs.append((proj, sch.weight_dtype, (R, C)))
        else:
            _check_bits_group(fn, bits, group_size)
            NG = _cdiv(C, group_size)
            specs += [(proj, torch.uint8, (R, _cdiv(C * bits, 8))), (proj + ".scales", scale_dtype, (R, NG)),
                      (proj + ".zeros", scale_dtype, (R, NG))]
    entries, page_bytes = PageLayout.pack(specs, segment_align, align)
    return ExpertPageLayout(entries, page_bytes, scheme, D, Fd, group_size, scale_dtype, align, segment_align)


def _as_layout(fn: str, scheme_or_layout: Union[str, ExpertPageLayout], D: int, Fd: int, group_size: int,
               scale_dtype: torch.dtype) -> ExpertPageLayout:
    if isinstance(scheme_or_layout, ExpertPageLayout):
        lay = scheme_or_layout
        if (lay.hidden_size, lay.intermediate_size) != (D, Fd):
            raise ValueError(f"{fn}: layout is for D={lay.hidden_size}, F={lay.intermediate_size}, "
                             f"weights have D={D}, F={Fd}")
        return lay
    return expert_page_layout(D, Fd, scheme_or_layout, group_size, scale_dtype)


def _check_expert_weights(fn: str, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, stacked: bool) -> tuple:
    nd = 3 if stacked else 2
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.dim() != nd or not w.is_floating_point():
            want = "[E, out, in]" if stacked else "[out, in]"
            raise ValueError(f"{fn}: {name} must be a floating {want} tensor, got {w.dtype} {tuple(w.shape)}")
    Fd, D = w1.shape[-2:]
    lead = tuple(w1.shape[:-2])
    if tuple(w3.shape) != lead + (Fd, D):
        raise ValueError(f"{fn}: w3 shape {tuple(w3.shape)} != w1 shape {tuple(w1.shape)}")
    if tuple(w2.shape) != lead + (D, Fd):
        raise ValueError(f"{fn}: w2 must be {lead + (D, Fd)} (down, [D, F]), got {tuple(w2.shape)}")
    return D, Fd


def _check_page(fn: str, page: torch.Tensor, layout: ExpertPageLayout) -> None:
    if page.dtype != torch.uint8:
        raise ValueError(f"{fn}: page must be uint8, got {page.dtype}")
    if page.dim() not in (1, 2) or page.shape[-1] != layout.page_bytes:
        raise ValueError(f"{fn}: page must be [page_bytes={layout.page_bytes}] or [E, page_bytes], "
                         f"got shape {tuple(page.shape)}")
    if page.stride(-1) != 1:
        raise ValueError(f"{fn}: page bytes must be contiguous (stride(-1) == 1)")
    if page.dim() == 2 and page.stride(0) % layout.segment_align:
        raise ValueError(f"{fn}: page row stride {page.stride(0)} is not a multiple of "
                         f"segment_align={layout.segment_align}")


def pack_expert_page(
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    scheme: Union[str, ExpertPageLayout],
    group_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pack one expert (w1 ``[F, D]``, w3 ``[F, D]``, w2 ``[D, F]``) into a ``uint8 [page_bytes]`` page.

    ``scheme`` is a key of :data:`PAGE_SCHEMES` (layout built with ``group_size`` / ``scale_dtype``) or a
    :class:`ExpertPageLayout`. Unquantized schemes store the weights cast to the scheme's dtype; quantized ones
    store :func:`quantize_groupwise` codes/scales/zeros. Alignment padding is zero. ``out`` (e.g. a slot
    of a pinned host pool) receives the page if given (uint8, contiguous, ``[page_bytes]``).

    Raises:
        ValueError: shapes that do not match the layout, bad ``out``, quantization errors.
    """
    fn = "pack_expert_page"
    D, Fd = _check_expert_weights(fn, w1, w3, w2, stacked=False)
    lay = _as_layout(fn, scheme, D, Fd, group_size, scale_dtype)
    if out is None:
        out = torch.zeros(lay.page_bytes, dtype=torch.uint8, device=w1.device)
    else:
        if out.dtype != torch.uint8 or tuple(out.shape) != (lay.page_bytes,) or not out.is_contiguous():
            raise ValueError(f"{fn}: out must be a contiguous uint8 [{lay.page_bytes}] tensor, "
                             f"got {out.dtype} {tuple(out.shape)}")
        out.zero_()
    for proj, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        seg = lay.entry(proj)
        if not lay.quantized:
            seg.view(out).copy_(w.to(seg.dtype))
            continue
        qt = quantize_groupwise(w, lay.spec.bits(proj), lay.group_size, lay.scale_dtype)
        seg.view(out).copy_(qt.packed)
        lay.entry(proj + ".scales").view(out).copy_(qt.scales)
        lay.entry(proj + ".zeros").view(out).copy_(qt.zeros)
    return out


def pack_expert_pages(
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    scheme: Union[str, ExpertPageLayout],
    group_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
    device: Optional[Union[str, torch.device]] = None,
) -> tuple[torch.Tensor, ExpertPageLayout]:
    """Pack a layer's stacked experts (w1/w3 ``[E, F, D]``, w2 ``[E, D, F]``) into ``uint8 [E, page_bytes]``.

    Returns ``(pages, layout)``, the pages on w1's device. Row ``e`` is :func:`pack_expert_page` of expert ``e``.
    ``device``: where to compute (None: w1's): each expert's weights are copied there and its page back, one expert
    at a time (a layer's experts need not fit there). The pages are the same bytes on any device: the codes'
    float64 arithmetic (subtract, divide, round half to even) is exactly rounded everywhere, min / max are exact.
    """
    fn = "pack_expert_pages"
    D, Fd = _check_expert_weights(fn, w1, w3, w2, stacked=True)
    lay = _as_layout(fn, scheme, D, Fd, group_size, scale_dtype)
    pages = torch.zeros((w1.shape[0], lay.page_bytes), dtype=torch.uint8, device=w1.device)
    dev = torch.device(device) if device is not None else w1.device
    for e in range(w1.shape[0]):
        if dev == w1.device:
            pack_expert_page(w1[e], w3[e], w2[e], lay, out=pages[e])
        else:
            pages[e].copy_(pack_expert_page(w1[e].to(dev), w3[e].to(dev), w2[e].to(dev), lay))
    return pages, lay


def page_weight_views(page: torch.Tensor, layout: ExpertPageLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-copy ``(w1, w3, w2)`` views of an unquantized page ``[page_bytes]`` or pages ``[E, page_bytes]``.

    Shapes ``[(E,) F, D]``, ``[(E,) F, D]``, ``[(E,) D, F]`` in the scheme's dtype (strided along E).

    Raises:
        ValueError: quantized layout (use :func:`page_quant_tensors`) or a page of the wrong size.
    """
    fn = "page_weight_views"
    _check_page(fn, page, layout)
    if layout.quantized:
        raise ValueError(f"{fn}: scheme {layout.scheme} is quantized; use page_quant_tensors / unpack_expert_page")
    return tuple(layout.entry(p).view(page) for p in _PROJ_SHAPES)


def expert_tensor_specs(layout: ExpertPageLayout) -> list[tuple[str, torch.dtype, tuple]]:
    """Per-expert tensors of a page layout as ``(name, dtype, shape)`` (the segments, in page order).

    E.g. ``int4``: ``("w1", uint8, (F, cdiv(D*4, 8))), ("w1.scales", fp16, (F, cdiv(D, G))), ...``. A pager
    that stores several experts per page as ``[n, *shape]`` tensors can rebuild :class:`QuantTensor` views
    with :func:`quant_tensors_from_views`.
    """
    return [(sg.name, sg.dtype, tuple(sg.shape)) for sg in layout.entries]


def quant_tensors_from_views(views, layout: ExpertPageLayout,
                             dtype: torch.dtype = torch.bfloat16) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
    """``(w1, w3, w2)`` :class:`QuantTensor` s from tensors named as the layout's segments.

    ``views[name]`` is ``[..., *shape]`` (shape from :func:`expert_tensor_specs`; e.g. ``[E, F, RB]`` for
    ``"w1"``), codes/scales/zeros with unit last stride. ``dtype``: default dequantization dtype.
    Raises ValueError for an unquantized layout, a missing name or a wrong shape/dtype.
    """
    fn = "quant_tensors_from_views"
    if not layout.quantized:
        raise ValueError(f"{fn}: scheme {layout.scheme} is not quantized")
    D, Fd = layout.hidden_size, layout.intermediate_size
    out = []
    for p, shape in (("w1", (Fd, D)), ("w3", (Fd, D)), ("w2", (D, Fd))):
        ts = []
        for name in (p, p + ".scales", p + ".zeros"):
            if name not in views:
                raise ValueError(f"{fn}: no tensor {name!r} (have {sorted(views)})")
            t, sg = views[name], layout.entry(name)
            if tuple(t.shape[t.dim() - len(sg.shape):]) != tuple(sg.shape) or t.dtype != sg.dtype:
                raise ValueError(f"{fn}: {name} must be [..., {tuple(sg.shape)}] {sg.dtype}, "
                                 f"got {tuple(t.shape)} {t.dtype}")
            ts.append(t)
        lead = tuple(ts[0].shape[: ts[0].dim() - 2])
        out.append(QuantTensor(ts[0], ts[1], ts[2], lead + shape, layout.spec.bits(p), layout.group_size, dtype))
    return tuple(out)


def page_quant_tensors(page: torch.Tensor, layout: ExpertPageLayout,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
    """Zero-copy :class:`QuantTensor` views ``(w1, w3, w2)`` of a quantized page ``[page_bytes]`` (or ``[E, ...]``).

    ``dtype`` is recorded as the QuantTensors' default dequantization dtype.
    """
    fn = "page_quant_tensors"
    _check_page(fn, page, layout)
    if not layout.quantized:
        raise ValueError(f"{fn}: scheme {layout.scheme} is not quantized; use page_weight_views")
    return quant_tensors_from_views({sg.name: sg.view(page) for sg in layout.entries}, layout, dtype)


def unpack_expert_page(page: torch.Tensor, layout: ExpertPageLayout,
                       dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode a page (``[page_bytes]`` or ``[E, page_bytes]``) into dense ``(w1, w3, w2)`` (new tensors).

    Unquantized schemes: exact copies of the stored weights (``dtype`` defaults to the scheme's dtype).
    Quantized: :func:`dequantize` of each projection (``dtype`` defaults to bf16).
    """
    if not layout.quantized:
        views = page_weight_views(page, layout)
        return tuple(v.to(dtype or v.dtype, copy=True) for v in views)
    return tuple(dequantize(q, dtype or torch.bfloat16) for q in page_quant_tensors(page, layout))


# --------------------------------------------------------------------------------------------------
# expert FFN from pages: torch reference
# --------------------------------------------------------------------------------------------------


def _check_pages_call(fn: str, x: torch.Tensor, pages: torch.Tensor, layout: ExpertPageLayout,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int]:
    if not isinstance(layout, ExpertPageLayout):
        raise ValueError(f"{fn}: layout must be an ExpertPageLayout, got {type(layout).__name__}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: x must be a floating [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != layout.hidden_size:
        raise ValueError(f"{fn}: x hidden size {x.shape[1]} != layout D={layout.hidden_size}")
    if pages.dim() != 2:
        raise ValueError(f"{fn}: pages must be a stacked [E, page_bytes] buffer, got shape {tuple(pages.shape)}")
    _check_page(fn, pages, layout)
    for name, t in (("pages", pages), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    k = _check_routing(fn, x.shape[0], topk_weights, topk_ids)
    return int(pages.shape[0]), k


def experts_ffn_quant_reference(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: ExpertPageLayout,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    order: str = "hf",
) -> torch.Tensor:
    """Torch reference of the FFN from pages: dequantize (to ``x.dtype``) then :func:`experts_ffn_reference`.

    Args:
        x: ``[T, D]``; pages: ``uint8 [E, page_bytes]`` on x's device; layout: their :class:`ExpertPageLayout`;
        topk_weights / topk_ids: ``[T, k]``; order: see :func:`experts_ffn_reference` (``REFERENCE_ORDERS``).

    Each page that receives tokens is decoded once (unquantized pages: the stored weights cast to
    ``x.dtype``). Returns ``[T, D]`` in ``x.dtype``. Raises ValueError on shape/dtype/device mismatch.
    """
    fn = "experts_ffn_quant_reference"
    E, _ = _check_pages_call(fn, x, pages, layout, topk_weights, topk_ids)
    if order not in REFERENCE_ORDERS:
        raise ValueError(f"{fn}: order must be one of {REFERENCE_ORDERS}, got {order!r}")
    return experts_ffn_reference_from(
        x, lambda e: unpack_expert_page(pages[e], layout, x.dtype), E, topk_weights, topk_ids, order=order
    )


def experts_ffn_qt_reference(
    x: torch.Tensor,
    w1: QuantTensor,
    w3: QuantTensor,
    w2: QuantTensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    order: str = "hf",
) -> torch.Tensor:
    """Torch reference of :func:`fused_experts_quant_triton`: dequantize each used expert to ``x.dtype``, then
    :func:`~lightning_moe.kernels.fused_moe.experts_ffn_reference_from`. Stacked QuantTensors
    ``w1/w3 [E, F, D]``, ``w2 [E, D, F]``; other arguments and result as :func:`experts_ffn_quant_reference`."""
    fn = "experts_ffn_qt_reference"
    E = _check_qt_experts(fn, x, w1, w3, w2)
    return experts_ffn_reference_from(
        x, lambda e: tuple(dequantize(q.select(e), x.dtype) for q in (w1, w3, w2)), E, topk_weights, topk_ids,
        order=order,
    )


def _check_qt_experts(fn: str, x: torch.Tensor, w1: QuantTensor, w3: QuantTensor, w2: QuantTensor) -> int:
    """Check stacked QuantTensors against x [T, D]; return E."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: x must be a floating [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    for name, q in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(q, QuantTensor):
            raise ValueError(f"{fn}: {name} must be a QuantTensor, got {type(q).__name__}")
        if len(q.shape) != 3:
            raise ValueError(f"{fn}: {name} must be a stacked [E, out, in] QuantTensor, shape is {q.shape}")
        E, R, C = q.shape
        want = {"packed": (torch.uint8, (E, R, q.row_bytes)), "scales": (None, (E, R, q.n_groups)),
                "zeros": (None, (E, R, q.n_groups))}
        for attr, (dt, shp) in want.items():
            t = getattr(q, attr)
            if tuple(t.shape) != shp or (dt is not None and t.dtype != dt) or t.stride(-1) != 1:
                raise ValueError(f"{fn}: {name}.{attr} must be {shp} with unit last stride"
                                 f"{'' if dt is None else ' ' + str(dt)}, got {tuple(t.shape)} {t.dtype} "
                                 f"strides {t.stride()}")
            if t.device != x.device:
                raise ValueError(f"{fn}: {name}.{attr} on {t.device} but x on {x.device}")
        if q.scales.dtype not in _SCALE_DTYPES or q.zeros.dtype != q.scales.dtype:
            raise ValueError(f"{fn}: {name} scales/zeros must share a dtype in {_SCALE_DTYPES}")
    E, Fd, D = w1.shape
    if x.shape[1] != D:
        raise ValueError(f"{fn}: x hidden size {x.shape[1]} != w1 in-features {D}")
    if tuple(w3.shape) != (E, Fd, D) or tuple(w2.shape) != (E, D, Fd):
        raise ValueError(f"{fn}: need w1/w3 [E, F, D] = {(E, Fd, D)} and w2 [E, D, F]; "
                         f"got w3 {w3.shape}, w2 {w2.shape}")
    return E


# --------------------------------------------------------------------------------------------------
# dequantization: Triton
# --------------------------------------------------------------------------------------------------

_DEQUANT_TILE_ELEMS = 8192  # output elements per program (BLOCK_R x BLOCK_C): 16 KB of bf16; to be tuned on the GPU
_DEQUANT_MAX_COLS = 128  # widest column tile (one group of G = 128 per tile)
_DEQUANT_MIN_GROUP_COLS = 32  # narrowest column tile of the one-group-per-tile path
_DEQUANT_NUM_WARPS = 8  # 32 output elements per thread with 8192-element tiles; likewise to be tuned


def _dequant_tiles(bits: int, group_size: int) -> tuple[int, int, bool]:
    """``(BLOCK_R, BLOCK_C, TILE_IN_GROUP)`` of ``dequant_kernel`` for ``bits`` and group size G.

    ``BLOCK_C`` (output columns per tile row) is the largest power of two <= 128 dividing G; when that is
    >= 32 every tile lies inside one group (one scale and zero per row and tile: G = 128 gives 128 columns,
    G = 64 gives 64, at 4 and at 2 bits). Otherwise (e.g. G = 40, 48) ``BLOCK_C = 128`` with a per-element
    gather of scales/zeros. ``BLOCK_R = 8192 // BLOCK_C`` rows, so each program writes 8192 elements (16 KB
    in bf16). ``bits`` is accepted for the signature's sake: every ``BLOCK_C`` here is a multiple of
    ``8 // bits``.
    """
    del bits
    bc = min(_DEQUANT_MAX_COLS, group_size & -group_size)
    if bc >= _DEQUANT_MIN_GROUP_COLS:
        return _DEQUANT_TILE_ELEMS // bc, bc, True
    return _DEQUANT_TILE_ELEMS // _DEQUANT_MAX_COLS, _DEQUANT_MAX_COLS, False


def _is_pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and (v & (v - 1)) == 0


def dense_expert_scratch(num_experts: int, hidden_size: int, intermediate_size: int,
                         dtype: torch.dtype = torch.bfloat16,
                         device: Union[str, torch.device] = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialized dense expert buffers ``(w1 [E, F, D], w3 [E, F, D], w2 [E, D, F])`` of ``dtype``.

    For ``out=`` of :func:`dequantize_pages_triton` / ``scratch=`` of :func:`fused_experts_quant_triton`;
    ``3 * E * D * F * itemsize`` bytes (<= ``E * MoESpec.expert_bytes(dtype)``, which also rounds each expert up
    to 4096 bytes). Any call with at most ``E`` experts can use it (the first rows are written).
    """
    if num_experts < 0 or hidden_size < 1 or intermediate_size < 1:
        raise ValueError(f"dense_expert_scratch: bad sizes E={num_experts}, D={hidden_size}, F={intermediate_size}")
    E, D, Fd = num_experts, hidden_size, intermediate_size
    mk = lambda r, c: torch.empty((E, r, c), dtype=dtype, device=device)  # noqa: E731
    return mk(Fd, D), mk(Fd, D), mk(D, Fd)


def dequantize_triton(
    qt: QuantTensor,
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    *,
    block_rows: Optional[int] = None,
    block_cols: Optional[int] = None,
) -> torch.Tensor:
    """Triton dequantization of a (stacked) :class:`QuantTensor`: ``code * scale + zero`` in fp32, cast to ``dtype``.

    Bit-identical to :func:`dequantize` (the kernel is launched with ``enable_fp_fusion=False``, so even fp32
    scales round the product and the sum separately, as torch does; with fp16/bf16 scales the fp32 product is
    exact anyway). Memory-bound: each program writes one contiguous ``[BLOCK_R, BLOCK_C]`` output tile (vectorized
    stores along the row) from one coalesced load of its ``BLOCK_C // (8 // bits)`` packed bytes per row; see
    ``dequant_kernel`` and :func:`_dequant_tiles`.

    Args:
        qt: ``[E, R, C]`` (e.g. one projection of a layer's experts, strided views into a page buffer from
            :func:`page_quant_tensors`) or ``[R, C]``; ``packed`` uint8 ``[.., R, RB]``, ``scales`` / ``zeros``
            ``[.., R, NG]`` of one dtype in fp16 / bf16 / fp32, all with unit last stride, on one CUDA device
            (CPU under ``TRITON_INTERPRET=1``); bits 4 or 2; any group size G >= 1.
        dtype: output dtype, bf16 / fp16 / fp32 (default ``qt.dtype``).
        out: optional destination, ``[E', R, C]`` with ``E' >= E`` (rows ``[:E]`` are written; a reusable
            scratch) or ``[R, C]`` for a 2-D ``qt``; ``dtype``, same device, unit last stride.
        block_rows, block_cols: tile override, rows and output columns per program (powers of two,
            ``block_cols >= 8 // bits``; tests use them to force partial tiles and the per-element scale path,
            taken when G is not a multiple of ``block_cols``); default :func:`_dequant_tiles`.

    Returns:
        ``[E, R, C]`` (``out[:E]`` when given) or ``[R, C]`` in ``dtype``.

    Raises:
        ValueError: not a QuantTensor, bad bits / shapes / dtypes / strides, device mismatch, CPU tensors
        without ``TRITON_INTERPRET=1``, bad ``out`` or tile sizes. RuntimeError: triton not installed.
    """
    fn = "dequantize_triton"
    if not isinstance(qt, QuantTensor):
        raise ValueError(f"{fn}: qt must be a QuantTensor, got {type(qt).__name__}")
    _check_bits_group(fn, qt.bits, qt.group_size)
    dtype = dtype or qt.dtype
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: dtype must be one of {_TRITON_DTYPES}, got {dtype}")
    if len(qt.shape) not in (2, 3):
        raise ValueError(f"{fn}: qt must be [E, R, C] or [R, C], shape is {qt.shape}")
    stacked = len(qt.shape) == 3
    q = qt if stacked else QuantTensor(qt.packed[None], qt.scales[None], qt.zeros[None], (1,) + tuple(qt.shape),
                                       qt.bits, qt.group_size, qt.dtype)
    E, R, C = q.shape
    dev = q.packed.device
    want = {"packed": (E, R, q.row_bytes), "scales": (E, R, q.n_groups), "zeros": (E, R, q.n_groups)}
    for attr, shp in want.items():
        t = getattr(q, attr)
        if tuple(t.shape) != shp or t.stride(-1) != 1:
            raise ValueError(f"{fn}: qt.{attr} must be {shp[1:] if not stacked else shp} with unit last stride, "
                             f"got {tuple(t.shape)} strides {t.stride()}")
        if t.device != dev:
            raise ValueError(f"{fn}: qt.{attr} on {t.device} but qt.packed on {dev}")
    if q.packed.dtype != torch.uint8:
        raise ValueError(f"{fn}: qt.packed must be uint8, got {q.packed.dtype}")
    if q.scales.dtype not in _SCALE_DTYPES or q.zeros.dtype != q.scales.dtype:
        raise ValueError(f"{fn}: scales/zeros must share a dtype in {_SCALE_DTYPES}, "
                         f"got {q.scales.dtype} / {q.zeros.dtype}")
    if E > 65535:
        raise ValueError(f"{fn}: at most 65535 stacked tensors per call (grid z), got {E}")
    _check_triton_device(fn, q.packed)
    if out is None:
        o = torch.empty((E, R, C), dtype=dtype, device=dev)
    else:
        ok = (isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == dev
              and out.dim() == (3 if stacked else 2) and tuple(out.shape[-2:]) == (R, C)
              and (not stacked or out.shape[0] >= E) and (out.numel() == 0 or out.stride(-1) == 1))
        if not ok:
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{fn}: out must be {'[>= ' + str(E) + ', ' if stacked else '['}{R}, {C}] {dtype} on {dev} "
                             f"with unit last stride, got {got}")
        o = out[:E] if stacked else out[None]
    br, bc, in_group = _dequant_tiles(q.bits, q.group_size)
    if block_rows is not None or block_cols is not None:
        br, bc = block_rows or br, block_cols or bc
        if not (_is_pow2(br) and _is_pow2(bc) and bc >= 8 // q.bits):
            raise ValueError(f"{fn}: block_rows / block_cols must be powers of two (block_cols >= "
                             f"{8 // q.bits} codes per byte), got {br}, {bc}")
        in_group = q.group_size % bc == 0
    if o.numel():
        kern = _triton_kernels()
        grid = (_cdiv(R, br), _cdiv(C, bc), E)
        kern.dequant_kernel[grid](
            q.packed, q.scales, q.zeros, o,
            R, C, q.row_bytes,
            q.packed.stride(0), q.packed.stride(1), q.scales.stride(0), q.scales.stride(1),
            q.zeros.stride(0), q.zeros.stride(1), o.stride(0), o.stride(1),
            BITS=q.bits, GROUP=q.group_size, TILE_IN_GROUP=in_group, BLOCK_R=br, BLOCK_C=bc,
            num_warps=_DEQUANT_NUM_WARPS, enable_fp_fusion=False,
        )
    return o if stacked else o[0]


def dequantize_pages_triton(
    pages: torch.Tensor,
    layout: ExpertPageLayout,
    dtype: torch.dtype = torch.bfloat16,
    out: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode quantized expert pages into dense ``(w1, w3, w2)`` with :func:`dequantize_triton` (3 launches).

    Bit-identical to :func:`unpack_expert_page` ``(pages, layout, dtype)``.

    Args:
        pages: ``uint8 [E, page_bytes]`` (row stride a multiple of ``layout.segment_align``, e.g. a slot
            pool) or one page ``[page_bytes]``; on a CUDA device (CPU under ``TRITON_INTERPRET=1``).
        layout: a quantized :class:`ExpertPageLayout` (int4 / int2 / int2-up / int4-up2).
        dtype: output dtype (bf16 default; fp16 / fp32).
        out: optional ``(w1, w3, w2)`` destinations ``[E' >= E, F, D]``, ``[E', F, D]``, ``[E', D, F]`` (e.g.
            :func:`dense_expert_scratch`), written in rows ``[:E]``; ``[F, D], [F, D], [D, F]`` for one page.

    Returns:
        ``(w1 [E, F, D], w3 [E, F, D], w2 [E, D, F])`` in ``dtype`` (views of ``out`` when given).

    Raises:
        ValueError: unquantized layout (use :func:`page_weight_views`), bad pages / out (see
        :func:`dequantize_triton`). RuntimeError: triton not installed.
    """
    fn = "dequantize_pages_triton"
    if not isinstance(layout, ExpertPageLayout):
        raise ValueError(f"{fn}: layout must be an ExpertPageLayout, got {type(layout).__name__}")
    _check_page(fn, pages, layout)
    if not layout.quantized:
        raise ValueError(f"{fn}: scheme {layout.scheme} is not quantized; use page_weight_views")
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise ValueError(f"{fn}: out must be a (w1, w3, w2) tuple of tensors, got {type(out).__name__}")
    outs = tuple(out) if out is not None else (None, None, None)
    return tuple(dequantize_triton(q, dtype, o) for q, o in zip(page_quant_tensors(pages, layout, dtype), outs))


def _check_mode(fn: str, mode: str) -> None:
    if mode not in DEQUANT_MODES:
        raise ValueError(f"{fn}: mode must be one of {DEQUANT_MODES}, got {mode!r}")


# --------------------------------------------------------------------------------------------------
# expert FFN from pages: Triton
# --------------------------------------------------------------------------------------------------

def _quant_tiles(cfg: MoEKernelConfig, groups: tuple) -> tuple[MoEKernelConfig, bool]:
    """Adapt tile sizes to the group sizes: returns (config, tile_in_group).

    ``block_k`` is halved (down to 16) until it divides every group size; then each K tile lies inside
    one group and the kernels load one scale/zero per row and tile (``TILE_IN_GROUP``). Group sizes
    that are not multiples of 16 take the per-element path (a ``[BK, BN]`` gather of scales and zeros);
    its tiles are capped at ``block_n <= 64``, ``block_k <= 32`` as a precaution: when the compiler
    pipelines those gathers through shared memory (seen on sm_90 for G = 48 with BK = 64) a
    ``BK=64, BN=128``, 3-stage tile needs ~300 KiB, more than the 227 KiB of a block.
    """
    bk = cfg.block_k
    while bk > 16 and any(g % bk for g in groups):
        bk //= 2
    if not any(g % bk for g in groups):
        return replace(cfg, block_k=bk), True
    return replace(cfg, block_n=min(cfg.block_n, 64), block_k=min(cfg.block_k, 32)), False


def _check_quant_call(fn: str, x: torch.Tensor, w1: QuantTensor, w3: QuantTensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> None:
    """ValueError naming ``fn`` when the routing is on another device than ``x``, ``x``'s dtype is not one the Triton
    kernels take, w1 and w3 differ in group size, or ``x`` is not on a device Triton runs on."""
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    if x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: x dtype must be one of {_TRITON_DTYPES}, got {x.dtype}")
    if w1.group_size != w3.group_size:
        raise ValueError(f"{fn}: w1 and w3 must share a group size, got {w1.group_size} and {w3.group_size}")
    _check_triton_device(fn, x)


def fused_experts_quant_triton(
    x: torch.Tensor,
    w1: QuantTensor,
    w3: QuantTensor,
    w2: QuantTensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: Optional[MoEKernelConfig] = None,
    validate: bool = True,
    mode: str = "dequant",
    scratch: Optional[tuple] = None,
    skip: bool = False,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN from group-quantized experts (Triton, W4A16 / W2A16).

    Two paths, both grouped by expert as in :func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`
    (same ``h [P, F]`` in ``x.dtype``, weighted ``y [P, D]`` fp32, deterministic fp32 slot sum) and both using
    the same dequantized weights, bit for bit (``code * scale + zero`` in fp32, cast to ``x.dtype``, as
    :func:`dequantize`):

    * "dequant" (default): all E experts are decoded once by :func:`dequantize_triton` into ``scratch`` (or a
      new buffer of ``3 * E * D * F`` elements), then the dense kernel runs on them.
    * "fused": the codes of each weight tile are dequantized in registers inside the GEMM K-loop and
      multiplied with ``tl.dot`` (reads only packed bytes; but repeats the dequantization per M-block).

    Args:
        x: ``[T, D]`` CUDA tensor, bf16 / fp16 (fp32 also accepted).
        w1, w3: stacked :class:`QuantTensor` ``[E, F, D]``; w2: ``[E, D, F]``. Their ``packed``
            ``[E, R, RB]`` uint8, ``scales`` / ``zeros`` ``[E, R, NG]`` may be strided views (e.g. into a
            page buffer) with unit last stride; bits and group size may differ per projection.
        topk_weights: ``[T, k]`` floating (fp32); topk_ids: ``[T, k]`` int64/int32 in ``[0, E)``.
        config: tile sizes (default :func:`~lightning_moe.kernels.fused_moe.default_kernel_config`);
            ``block_k`` is then fitted to the group sizes (see :func:`_quant_tiles`).
        validate: range-check ids (one host sync).
        mode: "dequant" | "fused" (above).
        scratch: optional ``(w1 [E' >= E, F, D], w3 [E', F, D], w2 [E', D, F])`` in ``x.dtype`` on x's device
            (:func:`dense_expert_scratch`) that the "dequant" path writes instead of allocating.
        skip: ids equal to ``E`` mark pairs this call does not compute (they add 0), as in
            :func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`.

    Returns:
        ``[T, D]`` in ``x.dtype``; reference: :func:`experts_ffn_qt_reference`.

    Raises:
        ValueError: shape / dtype / device mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``),
        out-of-range ids, unknown mode, bad scratch. RuntimeError: triton not installed.
    """
    fn = "fused_experts_quant_triton"
    _check_mode(fn, mode)
    E = _check_qt_experts(fn, x, w1, w3, w2)
    T, D = x.shape
    Fd = w1.shape[1]
    k = _check_routing(fn, T, topk_weights, topk_ids)
    _check_quant_call(fn, x, w1, w3, topk_weights, topk_ids)
    if validate:
        _check_id_range(fn, topk_ids, E + 1 if skip else E)
    if scratch is not None and (not isinstance(scratch, (tuple, list)) or len(scratch) != 3):
        raise ValueError(f"{fn}: scratch must be a (w1, w3, w2) tuple of tensors, got {type(scratch).__name__}")
    if T == 0:
        return torch.empty((0, D), dtype=x.dtype, device=x.device)
    P = T * k
    if mode == "dequant":
        outs = tuple(scratch) if scratch is not None else (None, None, None)
        d1, d3, d2 = (dequantize_triton(q, x.dtype, o) for q, o in zip((w1, w3, w2), outs))
        return fused_experts_triton(x, d1, d3, d2, topk_weights, topk_ids, config=config, validate=False, skip=skip)
    cfg, tile_in_group = _quant_tiles(config or default_kernel_config(P, E, x.dtype), (w1.group_size, w2.group_size))
    kern = _triton_kernels()

    padded_pair_idx, block_expert = kernel_alignment(topk_ids, E, cfg.block_m, skip)
    rw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    h = torch.empty((P, Fd), dtype=x.dtype, device=x.device)  # [P, F]
    y = (torch.zeros if skip else torch.empty)((P, D), dtype=torch.float32, device=x.device)  # [P, D]; skipped rows 0

    def strides(q):
        return (q.packed.stride(0), q.packed.stride(1), q.scales.stride(0), q.scales.stride(1),
                q.zeros.stride(0), q.zeros.stride(1))

    max_blocks = block_expert.numel()
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  DOT_PRECISION=_dot_precision(x.dtype), UPCAST_DOT=_interpret_mode(),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kern.gate_up_q_kernel[(max_blocks, _cdiv(Fd, cfg.block_n))](
        x, w1.packed, w1.scales, w1.zeros, w3.packed, w3.scales, w3.zeros, h, padded_pair_idx, block_expert,
        P, D, Fd, k,
        x.stride(0), x.stride(1), h.stride(0), h.stride(1),
        *strides(w1), *strides(w3),
        BITS_1=w1.bits, BITS_3=w3.bits, GROUP=w1.group_size, TILE_IN_GROUP=tile_in_group, **common,
    )
    kern.down_q_kernel[(max_blocks, _cdiv(D, cfg.block_n))](
        h, w2.packed, w2.scales, w2.zeros, y, padded_pair_idx, block_expert, rw,
        P, D, Fd,
        h.stride(0), h.stride(1), y.stride(0), y.stride(1),
        *strides(w2),
        BITS_2=w2.bits, GROUP=w2.group_size, TILE_IN_GROUP=tile_in_group, **common,
    )
    return _sum_slots(y, T, k, D, x.dtype)


def fused_experts_paged_triton(
    x: torch.Tensor,
    pages: torch.Tensor,
    layout: ExpertPageLayout,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: Optional[MoEKernelConfig] = None,
    validate: bool = True,
    mode: str = "dequant",
    scratch: Optional[tuple] = None,
    skip: bool = False,
) -> torch.Tensor:
    """Routed-expert SwiGLU FFN computed directly from a stacked page buffer (Triton).

    Quantized schemes: zero-copy :class:`QuantTensor` views of the pages (:func:`page_quant_tensors`)
    go to :func:`fused_experts_quant_triton` with ``mode`` and ``scratch`` (all ``E`` pages dequantized into a
    dense scratch followed by the dense kernel, or dequantization in registers). Unquantized schemes:
    zero-copy strided weight views (:func:`page_weight_views`) go to
    :func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`.

    Args:
        x: ``[T, D]`` CUDA tensor, bf16 / fp16 (fp32 also accepted).
        pages: ``uint8 [E, page_bytes]`` on x's device, rows laid out by ``layout``; the row stride may
            exceed ``page_bytes`` (a slot pool) but must be a multiple of ``layout.segment_align``.
        layout: :class:`ExpertPageLayout` of the pages (from :func:`expert_page_layout`).
        topk_weights: ``[T, k]`` floating (fp32); topk_ids: ``[T, k]`` int64/int32 in ``[0, E)``.
        config: tile sizes (default :func:`~lightning_moe.kernels.fused_moe.default_kernel_config`).
        validate: range-check ids (one host sync).
        mode: "dequant" | "fused", see :func:`fused_experts_quant_triton` (ignored, but checked,
            for unquantized pages, which are already dense).
        scratch: dense ``(w1, w3, w2)`` buffers for the "dequant" path (:func:`dense_expert_scratch`).
        skip: ids equal to ``E`` (the pages' rows) mark pairs this call does not compute (they add 0).

    Returns:
        ``[T, D]`` in ``x.dtype``; reference: :func:`experts_ffn_quant_reference`.

    Raises:
        ValueError: shape / dtype / device mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``),
        out-of-range ids, an unquantized page dtype different from ``x.dtype``, unknown mode, bad scratch.
        RuntimeError: triton not installed.
    """
    fn = "fused_experts_paged_triton"
    _check_mode(fn, mode)
    _check_pages_call(fn, x, pages, layout, topk_weights, topk_ids)
    if x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: x dtype must be one of {_TRITON_DTYPES}, got {x.dtype}")
    _check_triton_device(fn, x)
    if not layout.quantized:
        if layout.spec.weight_dtype != x.dtype:
            raise ValueError(f"{fn}: pages store {layout.spec.weight_dtype} weights but x is {x.dtype}")
        w1, w3, w2 = page_weight_views(pages, layout)
        return fused_experts_triton(x, w1, w3, w2, topk_weights, topk_ids, config=config, validate=validate, skip=skip)
    w1, w3, w2 = page_quant_tensors(pages, layout, x.dtype)
    return fused_experts_quant_triton(x, w1, w3, w2, topk_weights, topk_ids, config=config, validate=validate,
                                      mode=mode, scratch=scratch, skip=skip)
