"""MXFP4 expert weights (OCP Microscaling FP4, as gpt-oss checkpoints store them): dequantization, packed expert
pages, and the gpt-oss expert FFN computed from the packed pages (a Triton kernel that dequantizes in registers, and
its torch reference).

Dimension key: ``T`` tokens, ``D`` hidden size, ``F`` per-expert FFN width, ``E`` experts, ``k`` top-k, ``P = T * k``
routed pairs, ``R`` rows (outputs) and ``C`` columns (inputs) of a projection, ``G = C / 32`` blocks per row.

A projection of R output rows and C input columns is stored as ``blocks`` uint8 [..., R, G, 16] (32 E2M1 values
per block, two per byte: the low nibble first) and ``scales`` uint8 [..., R, G] (one E8M0 exponent per block,
bias 127). Value = FP4_VALUES[nibble] * 2 ** (scale - 127): 4.25 bits per weight.

1. :func:`mxfp4_dequantize` -- the torch dequantization, bit for bit transformers' (the loader's dequantize-on-load
   path and every reference here).
2. Packed expert pages (:func:`mxfp4_page_layout` -> :class:`MXFP4PageLayout`, :func:`pack_mxfp4_pages`,
   :func:`unpack_mxfp4_page`): one expert's ``gate_up.blocks`` [2F, D/32, 16], ``gate_up.scales`` [2F, D/32],
   ``down.blocks`` [D, F/32, 16], ``down.scales`` [D, F/32] (the checkpoint's bytes, gate and up rows still
   interleaved: gate = even rows, up = odd rows) and the biases ``gate_up.bias`` [2F], ``down.bias`` [D] in one
   ``uint8 [page_bytes]`` page; segments 16-byte aligned, the page padded to 4096 bytes (as the int4 pages of
   :mod:`.quant`), so every expert of a model has one page size.
3. :func:`fused_experts_mxfp4_triton` -- gpt-oss's routed-expert FFN read from a stacked page buffer
   ``[E, page_bytes]``: grouped by expert as :func:`~.fused_moe.fused_experts_triton` (``moe_align`` blocks, skip
   id, ``h [P, F]`` in x's dtype, weighted ``y [P, D]`` fp32, deterministic fp32 slot sum), the weight tiles
   dequantized in registers (``_triton_kernels.mxfp4_tile``), cast to x's dtype and multiplied with ``tl.dot``::

       g = min(x W_gate^T + b_gate, limit);  u = clamp(x W_up^T + b_up, -limit, limit)
       y = w_slot * (((u + 1) * g * sigmoid(alpha * g)) W_down^T + b_down)

   Reference: :func:`experts_ffn_mxfp4_reference` (:func:`unpack_mxfp4_page`, i.e. :func:`mxfp4_dequantize`, then
   the torch math of ``gpt_oss.experts_ffn`` in transformers' order, :func:`clamped_swiglu_reference`).

Triton is imported lazily; importing this module needs only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F_

from .fused_moe import (MoEKernelConfig, _cdiv, _check_id_range, _check_routing, _check_triton_device, _dot_precision,
                        _interpret_mode, _sum_slots, _triton_kernels, _TRITON_DTYPES, default_kernel_config,
                        kernel_alignment)
from .pages import PageLayout

# E2M1 code -> value (code 8..15: the negatives; 8 is -0.0), transformers' integrations/mxfp4.py FP4_VALUES
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per scale
PAIRED_NIBBLES = True  # the kernels dequantize a byte's two columns at once (_triton_kernels.mxfp4_pair_tiles): 2.5-3x
#   the one-column path's rate on an H100 (benchmarks/bench_mxfp4_ffn.py, benchmarks/RESULTS.md session 33)
DOT_SCALED = True  # bf16 x: the kernels hand the packed bytes and scales to tl.dot_scaled (Triton's own E2M1 upcast)
JOINT_GATE_UP = False  # with DOT_SCALED: gate_up as one dot_scaled over the block's contiguous gate/up rows, split
#   after the loop (_triton_kernels.gate_up_mx_kernel JOINT); equal to the reference in the interpreter, not yet timed
#   on a GPU (benchmarks/bench_mxfp4_ffn.py compares it), so off until it is
SCALE_BIAS = 127  # E8M0 exponent bias


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize MXFP4 ``blocks`` uint8 [E, R, G, 16] with ``scales`` uint8 [E, R, G] into ``dtype``, returned as
    [E, G*32, R] (contiguous): the input dim first, as transformers' GptOssExperts parameters hold it (gate_up_proj
    [E, D, 2F], down_proj [E, F, D]).

    The same operations as transformers' ``convert_moe_packed_tensors`` (a lookup table in ``dtype``, the low nibble
    to even positions and the high one to odd ones, ``torch.ldexp`` by scale - 127 into the ``dtype`` buffer), in one
    pass instead of row chunks, so the result is bit for bit transformers'. Raises ValueError on mismatched shapes.
    """
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4_dequantize: blocks {tuple(blocks.shape)} must be [E, R, G, 16] and scales "
                         f"{tuple(scales.shape)} [E, R, G]")
    E, R, G, B = blocks.shape
    blocks = blocks.to(torch.uint8).reshape(E * R * G, B)  # [N, 16] with N = E*R*G blocks
    exp = (scales.to(torch.int32) - SCALE_BIAS).reshape(E * R * G, 1)  # [N, 1]
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # [16]
    out = torch.empty(E * R * G, 2 * B, dtype=dtype, device=blocks.device)  # [N, 32]
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]  # low nibble: even positions
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]  # high nibble: odd positions
    torch.ldexp(out, exp, out=out)  # * 2^(scale - 127), rounded once into dtype
    return out.view(E, R, G * 2 * B).transpose(1, 2).contiguous()  # [E, C, R]


# --------------------------------------------------------------------------------------------------
# packed expert pages
# --------------------------------------------------------------------------------------------------
MXFP4_SCHEME = "mxfp4"  # the scheme name of MXFP4 pages (ExpertsOnDisk / WeightStream layouts, the run report)
_BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MXFP4PageLayout(PageLayout):
    """Byte layout of one MXFP4 expert page ``uint8 [page_bytes]`` (identical for every expert of a model): entries
    ``gate_up.blocks``, ``gate_up.scales``, ``down.blocks``, ``down.scales``, ``gate_up.bias``, ``down.bias``
    (module docstring, 2.)."""

    hidden_size: int  # D (a multiple of 32)
    intermediate_size: int  # F (a multiple of 32)
    bias_dtype: torch.dtype  # dtype of the stored biases
    align: int  # page_bytes is a multiple of this (bytes)
    segment_align: int  # every entry offset is a multiple of this (bytes)

    @property
    def scheme(self) -> str:
        return MXFP4_SCHEME

    @property
    def quantized(self) -> bool:
        return True


def mxfp4_page_layout(hidden_size: int, intermediate_size: int, bias_dtype: torch.dtype = torch.bfloat16,
                      align: int = 4096, segment_align: int = 16) -> MXFP4PageLayout:
    """The page layout of one MXFP4 expert (module docstring, 2.).

    Raises ValueError: D or F not a positive multiple of 32 (MXFP4 blocks), a bias dtype other than bf16 / fp16 /
    fp32, ``segment_align`` not a positive multiple of 16, ``align`` not a multiple of ``segment_align``."""
    fn = "mxfp4_page_layout"
    D, Fd = hidden_size, intermediate_size
    if D < MXFP4_BLOCK or Fd < MXFP4_BLOCK or D % MXFP4_BLOCK or Fd % MXFP4_BLOCK:
        raise ValueError(f"{fn}: D={D} and F={Fd} must be positive multiples of {MXFP4_BLOCK} (MXFP4 blocks)")
    if bias_dtype not in _BIAS_DTYPES:
        raise ValueError(f"{fn}: bias_dtype must be one of {_BIAS_DTYPES}, got {bias_dtype}")
    if segment_align < 16 or segment_align % 16:
        raise ValueError(f"{fn}: segment_align must be a positive multiple of 16 bytes, got {segment_align}")
    if align < segment_align or align % segment_align:
        raise ValueError(f"{fn}: align must be a positive multiple of segment_align={segment_align}, got {align}")
    specs = [("gate_up.blocks", torch.uint8, (2 * Fd, D // MXFP4_BLOCK, 16)),
             ("gate_up.scales", torch.uint8, (2 * Fd, D // MXFP4_BLOCK)),
             ("down.blocks", torch.uint8, (D, Fd // MXFP4_BLOCK, 16)),
             ("down.scales", torch.uint8, (D, Fd // MXFP4_BLOCK)),
             ("gate_up.bias", bias_dtype, (2 * Fd,)),
             ("down.bias", bias_dtype, (D,))]
    entries, page_bytes = PageLayout.pack(specs, segment_align, align)
    return MXFP4PageLayout(entries, page_bytes, D, Fd, bias_dtype, align, segment_align)


def mxfp4_expert_bytes(hidden_size: int, intermediate_size: int, bias_bytes: int = 2, align: int = 4096) -> int:
    """Bytes of one MXFP4 expert page without building it: 3 D F weights at 4.25 bits (17 bytes per 32 values:
    16 of blocks, 1 scale) plus the 2F + D biases, each segment rounded up to 16 bytes, the page to ``align``.
    Equals ``mxfp4_page_layout(D, F, dtype).page_bytes`` (the planner's bytes per expert)."""
    D, Fd = hidden_size, intermediate_size
    segs = [2 * Fd * D // 2, 2 * Fd * D // 32, D * Fd // 2, D * Fd // 32, 2 * Fd * bias_bytes, D * bias_bytes]
    return _round_up(sum(_round_up(s, 16) for s in segs), align)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _check_mxfp4_pages(fn: str, pages: torch.Tensor, layout: MXFP4PageLayout) -> None:
    if not isinstance(layout, MXFP4PageLayout):
        raise ValueError(f"{fn}: layout must be an MXFP4PageLayout, got {type(layout).__name__}")
    if pages.dtype != torch.uint8 or pages.dim() not in (1, 2) or pages.shape[-1] != layout.page_bytes:
        raise ValueError(f"{fn}: pages must be uint8 [page_bytes={layout.page_bytes}] or [E, page_bytes], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    if pages.stride(-1) != 1 or (pages.dim() == 2 and pages.stride(0) % layout.segment_align):
        raise ValueError(f"{fn}: page bytes must be contiguous and the row stride a multiple of "
                         f"segment_align={layout.segment_align}, got strides {pages.stride()}")


def pack_mxfp4_pages(gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
                     down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
                     layout: Optional[MXFP4PageLayout] = None) -> tuple[torch.Tensor, MXFP4PageLayout]:
    """A layer's experts as MXFP4 pages ``uint8 [E, page_bytes]`` from the checkpoint's tensors: gate_up blocks
    [E, 2F, D/32, 16] and scales [E, 2F, D/32], down blocks [E, D, F/32, 16] and scales [E, D, F/32] (bytes copied
    as they are), biases [E, 2F] and [E, D] (cast to the layout's bias dtype; default the gate_up bias's).
    Returns ``(pages, layout)``; padding bytes are zero. Raises ValueError on shapes that do not fit."""
    fn = "pack_mxfp4_pages"
    if gate_up_blocks.dim() != 4 or down_blocks.dim() != 4:
        raise ValueError(f"{fn}: blocks must be [E, R, C/32, 16], got {tuple(gate_up_blocks.shape)} and "
                         f"{tuple(down_blocks.shape)}")
    E, R2, Gd, _ = gate_up_blocks.shape
    lay = layout or mxfp4_page_layout(Gd * MXFP4_BLOCK, R2 // 2, gate_up_bias.dtype)
    parts = {"gate_up.blocks": gate_up_blocks, "gate_up.scales": gate_up_scales, "down.blocks": down_blocks,
             "down.scales": down_scales, "gate_up.bias": gate_up_bias, "down.bias": down_bias}
    pages = torch.zeros((E, lay.page_bytes), dtype=torch.uint8, device=gate_up_blocks.device)
    for ent in lay.entries:
        t = parts[ent.name]
        if tuple(t.shape) != (E,) + ent.shape or (ent.dtype == torch.uint8) != (t.dtype == torch.uint8):
            raise ValueError(f"{fn}: {ent.name} must be [{E}, {', '.join(map(str, ent.shape))}] "
                             f"{'uint8' if ent.dtype == torch.uint8 else 'floating'}, got {t.dtype} {tuple(t.shape)}")
        ent.view(pages).copy_(t.to(ent.dtype))
    return pages, lay


def mxfp4_page_views(pages: torch.Tensor, layout: MXFP4PageLayout) -> dict[str, torch.Tensor]:
    """Zero-copy views ``{entry name: [(E,) *shape]}`` of a page ``[page_bytes]`` or pages ``[E, page_bytes]``."""
    _check_mxfp4_pages("mxfp4_page_views", pages, layout)
    return {e.name: e.view(pages) for e in layout.entries}


def unpack_mxfp4_page(pages: torch.Tensor, layout: MXFP4PageLayout, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Dense ``(w1 [(E,) F, D], w3 [(E,) F, D], w2 [(E,) D, F], b1 [(E,) F], b3 [(E,) F], b2 [(E,) D])`` in ``dtype``
    (new tensors) of a page or pages: :func:`mxfp4_dequantize`, gate = even rows of gate_up, up = odd rows; the same
    values, bit for bit, as gpt_oss's dequantize-on-load (``load_experts``)."""
    v = mxfp4_page_views(pages, layout)
    one = pages.dim() == 1

    def lead(t):  # [E, ...] (a single page gets E = 1)
        return t.unsqueeze(0) if one else t

    gu = mxfp4_dequantize(lead(v["gate_up.blocks"]), lead(v["gate_up.scales"]), dtype)  # [E, D, 2F]
    down = mxfp4_dequantize(lead(v["down.blocks"]), lead(v["down.scales"]), dtype)  # [E, F, D]
    gub, db = lead(v["gate_up.bias"]).to(dtype), lead(v["down.bias"]).to(dtype)  # [E, 2F], [E, D]
    out = (gu[..., 0::2].transpose(1, 2).contiguous(), gu[..., 1::2].transpose(1, 2).contiguous(),
           down.transpose(1, 2).contiguous(), gub[:, 0::2].contiguous(), gub[:, 1::2].contiguous(), db.contiguous())
    return tuple(t[0] for t in out) if one else out


# --------------------------------------------------------------------------------------------------
# the gpt-oss expert FFN from MXFP4 pages: torch reference
# --------------------------------------------------------------------------------------------------
def clamped_swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate): ``(clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g)`` with ``g = min(gate, limit)``. gate, up: [n, F] -> [n, F]."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _check_call(fn: str, x: torch.Tensor, pages: torch.Tensor, layout: MXFP4PageLayout, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> tuple[int, int]:
    _check_mxfp4_pages(fn, pages, layout)
    if pages.dim() != 2:
        raise ValueError(f"{fn}: pages must be a stacked [E, page_bytes] buffer, got shape {tuple(pages.shape)}")
    if x.dim() != 2 or not x.is_floating_point() or x.shape[1] != layout.hidden_size:
        raise ValueError(f"{fn}: x must be a floating [T, D={layout.hidden_size}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    for name, t in (("pages", pages), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {name} on {t.device} but x on {x.device}")
    return int(pages.shape[0]), _check_routing(fn, x.shape[0], topk_weights, topk_ids)


def experts_ffn_mxfp4_reference(x: torch.Tensor, pages: torch.Tensor, layout: MXFP4PageLayout,
                                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, limit: float,
                                alpha: float) -> torch.Tensor:
    """Torch reference of :func:`fused_experts_mxfp4_triton`: each expert that receives tokens, in ascending id, is
    dequantized into x's dtype (:func:`unpack_mxfp4_page`) and computed as gpt_oss's ``experts_ffn`` does
    (transformers' GptOssExperts order): ``y = clamped_swiglu(x W1^T + b1, x W3^T + b3) W2^T + b2``, times the routing
    weight, accumulated into the output in x's dtype. x: [T, D]; pages: uint8 [E, page_bytes]; topk_weights fp32
    [T, k]; topk_ids int [T, k] in [0, E). Returns [T, D] in x's dtype. Raises ValueError on shapes / ids."""
    fn = "experts_ffn_mxfp4_reference"
    E, _ = _check_call(fn, x, pages, layout, topk_weights, topk_ids)
    out = torch.zeros_like(x)  # [T, D]
    for e in torch.unique(topk_ids).tolist():  # ascending
        if not 0 <= e < E:
            raise ValueError(f"{fn}: expert id {e} outside 0..{E - 1}")
        w1, w3, w2, b1, b3, b2 = unpack_mxfp4_page(pages[e], layout, x.dtype)
        tok, slot = torch.where(topk_ids == e)  # [n] each
        h = x[tok]  # [n, D]
        y = F_.linear(clamped_swiglu_reference(F_.linear(h, w1, b1), F_.linear(h, w3, b3), limit, alpha), w2, b2)
        out.index_add_(0, tok, (y * topk_weights[tok, slot, None]).to(x.dtype))  # [n, D]
    return out


# --------------------------------------------------------------------------------------------------
# the gpt-oss expert FFN from MXFP4 pages: Triton
# --------------------------------------------------------------------------------------------------
def mxfp4_kernel_config(num_pairs: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> MoEKernelConfig:
    """Tile sizes of :func:`fused_experts_mxfp4_triton` from the mean rows per expert: with ``tl.dot_scaled`` (bf16 x)
    the fastest of benchmarks/bench_mxfp4_ffn.py's sweep on an H100 at gpt-oss's shape (D = F = 2880, E 128, top-4;
    benchmarks/RESULTS.md session 33): decode 16 x 64 x 64, mid 64 x 64 x 128, prefill 128 x 128 x 128 with 8
    warps; otherwise :func:`~.fused_moe.default_kernel_config`."""
    if not (DOT_SCALED and dtype == torch.bfloat16):
        return default_kernel_config(num_pairs, num_experts, dtype)
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return MoEKernelConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoEKernelConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return MoEKernelConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def fused_experts_mxfp4_triton(x: torch.Tensor, pages: torch.Tensor, layout: MXFP4PageLayout,
                               topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, limit: float, alpha: float,
                               config: Optional[MoEKernelConfig] = None, validate: bool = True,
                               skip: bool = False) -> torch.Tensor:
    """gpt-oss's routed-expert FFN from MXFP4 pages with Triton grouped GEMMs that dequantize in registers (module
    docstring, 3.).

    Args:
        x: ``[T, D]`` CUDA tensor (CPU under ``TRITON_INTERPRET=1``), bf16 / fp16 / fp32 (fp32: IEEE dot products).
        pages: ``uint8 [E, page_bytes]`` on x's device laid out by ``layout``; the row stride may exceed
            ``page_bytes`` (a slot pool) but must be a multiple of ``layout.segment_align``.
        topk_weights: ``[T, k]`` floating (fp32); topk_ids: ``[T, k]`` int64/int32 in ``[0, E)`` (``[0, E]`` with
            ``skip``).
        limit, alpha: the spec's ``swiglu_limit`` / ``swiglu_alpha``.
        config: tile sizes (default :func:`mxfp4_kernel_config`).
        validate: range-check ids (one host sync); pass False in a pipelined loop.
        skip: ids equal to ``E`` mark pairs this call does not compute (they add 0), as
            :func:`~.fused_moe.fused_experts_triton`'s.

    Returns ``[T, D]`` in ``x.dtype``; reference: :func:`experts_ffn_mxfp4_reference`. Raises ValueError: shape /
    dtype / device mismatch, CPU tensors (unless ``TRITON_INTERPRET=1``), out-of-range ids (when ``validate``), a
    ``limit`` <= 0. RuntimeError: triton not installed.
    """
    fn = "fused_experts_mxfp4_triton"
    E, k = _check_call(fn, x, pages, layout, topk_weights, topk_ids)
    if x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"{fn}: x dtype must be one of {_TRITON_DTYPES}, got {x.dtype}")
    if not limit > 0:
        raise ValueError(f"{fn}: limit must be > 0 (swiglu_limit), got {limit}")
    _check_triton_device(fn, x)
    if validate:
        _check_id_range(fn, topk_ids, E + 1 if skip else E)
    T, D = x.shape
    Fd = layout.intermediate_size
    if T == 0:
        return torch.empty((0, D), dtype=x.dtype, device=x.device)
    P = T * k
    cfg = config or mxfp4_kernel_config(P, E, x.dtype)
    kern = _triton_kernels()
    v = mxfp4_page_views(pages, layout)
    padded_pair_idx, block_expert = kernel_alignment(topk_ids, E, cfg.block_m, skip)
    rw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    h = torch.empty((P, Fd), dtype=x.dtype, device=x.device)  # [P, F]
    y = (torch.zeros if skip else torch.empty)((P, D), dtype=torch.float32, device=x.device)  # [P, D]; skipped rows 0
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  DOT_PRECISION=_dot_precision(x.dtype), UPCAST_DOT=_interpret_mode(),
                  PAIRED=PAIRED_NIBBLES and cfg.block_k >= 32,  # a dot needs >= 16 columns per half
                  SCALED=DOT_SCALED and x.dtype == torch.bfloat16 and cfg.block_k >= 64,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    max_blocks = block_expert.numel()

    def strides(p):  # blocks [E, R, G, 16] and scales [E, R, G] views; bias [E, R]
        b, s, bias = v[p + ".blocks"], v[p + ".scales"], v[p + ".bias"]
        return (b.stride(0), b.stride(1), s.stride(0), s.stride(1), bias.stride(0))

    kern.gate_up_mx_kernel[(max_blocks, _cdiv(Fd, cfg.block_n))](
        x, v["gate_up.blocks"], v["gate_up.scales"], v["gate_up.bias"], h, padded_pair_idx, block_expert,
        P, D, Fd, k, float(limit), float(alpha),
        x.stride(0), x.stride(1), h.stride(0), h.stride(1), *strides("gate_up"), JOINT=JOINT_GATE_UP, **common,
    )
    kern.down_mx_kernel[(max_blocks, _cdiv(D, cfg.block_n))](
        h, v["down.blocks"], v["down.scales"], v["down.bias"], y, padded_pair_idx, block_expert, rw,
        P, D, Fd,
        h.stride(0), h.stride(1), y.stride(0), y.stride(1), *strides("down"), **common,
    )
    return _sum_slots(y, T, k, D, x.dtype)
