"""Zero-copy reads of pinned host memory by a GPU kernel (the CPU-attention output's way back to the GPU).

Why: CGOPipe streams expert pages host-to-device on the copy engine, and copies of one direction run in issue order
there, so a micro-batch's CPU attention output (a few MB) issued as a DMA copy waits behind every page copy queued
before it (up to a slot of pages, ~10 ms at full size), while the GPU waits for it and the next micro-batch's q/k/v
wait for the GPU. A kernel that loads
the pinned buffer directly (CUDA unified addressing: pinned host memory is mapped into the device's address space)
moves those bytes over PCIe as SM reads, beside the copy engine's traffic instead of behind it.

:func:`copy_from_host_triton` is the kernel's wrapper (checks, allocates nothing, launches on the current stream);
:func:`copy_from_host_reference` is the plain ``dst.copy_(src)`` beside it. :func:`host_read_available` probes once
per device whether this CUDA / Triton build can read pinned memory from a kernel (callers fall back to DMA copies).
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

BLOCK = 2048  # elements per program
_probe: dict = {}  # device index -> bool
_lock = threading.Lock()


def copy_from_host_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Reference: ``dst.copy_(src)`` (a DMA copy on CUDA). Returns ``dst``."""
    return dst.copy_(src)


def copy_from_host_triton(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst[...] = src[...]`` by a Triton kernel on the current CUDA stream that reads ``src`` in place.

    Args:
        src: pinned host tensor (``src.is_pinned()``), contiguous, any shape; under TRITON_INTERPRET=1 any
            contiguous CPU tensor.
        dst: contiguous CUDA tensor (CPU under the interpreter) with ``src``'s shape and dtype.
    Returns ``dst``. The kernel reads ``src`` when it runs, not when it is launched: the caller must not rewrite
    ``src`` before the stream has passed the kernel (CGOPipe's ordering: the next write to a micro-batch's output
    buffer follows that micro-batch's next q/k/v copy, which is ordered after this kernel on the compute stream).
    Raises ValueError on a shape / dtype / device / layout mismatch; RuntimeError without triton.
    """
    from .fused_moe import _interpret_mode, _triton_kernels

    fn = "copy_from_host_triton"
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"{fn}: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} differ")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"{fn}: src and dst must be contiguous, got strides {src.stride()} / {dst.stride()}")
    if src.device.type != "cpu":
        raise ValueError(f"{fn}: src must be a (pinned) host tensor, got {src.device}")
    interp = _interpret_mode()
    if not interp:
        if not dst.is_cuda:
            raise ValueError(f"{fn}: dst must be a CUDA tensor, got {dst.device}")
        if not src.is_pinned():
            raise ValueError(f"{fn}: src must be in pinned host memory (torch.empty(..., pin_memory=True)): a kernel "
                             "cannot read pageable memory")
    n = src.numel()
    if n == 0:
        return dst
    kern = _triton_kernels()
    kern.host_read_kernel[(-(-n // BLOCK),)](src, dst, n, BLOCK=BLOCK)
    return dst


def host_read_available(device: torch.device | str | int = "cuda") -> bool:
    """Whether a kernel on ``device`` can read pinned host memory here: probed once per device (a 5000-element
    bf16 copy compared with its source); any failure (no triton, a driver without unified addressing, Triton
    refusing the host pointer) is logged once and gives False. False without CUDA."""
    if not torch.cuda.is_available():
        return False
    idx = torch.device(device).index if not isinstance(device, int) else device
    idx = torch.cuda.current_device() if idx is None else idx
    with _lock:
        if idx not in _probe:
            try:
                with torch.cuda.device(idx):
                    src = torch.randn(5000).to(torch.bfloat16).pin_memory()
                    dst = torch.empty(5000, dtype=torch.bfloat16, device=f"cuda:{idx}")
                    copy_from_host_triton(src, dst)
                    _probe[idx] = bool(torch.equal(dst.cpu(), src))
            except Exception as e:  # noqa: BLE001 - any failure means: use DMA copies
                log.warning("zero-copy host reads unavailable on cuda:%s (%s: %s); CPU attention outputs go by DMA",
                            idx, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                _probe[idx] = False
    return _probe[idx]
