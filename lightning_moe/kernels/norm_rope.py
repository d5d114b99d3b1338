"""RMSNorm and rotate-half RoPE in one Triton launch each, with their torch references (the model's math).

Why: prefill's element-wise work is memory-bound; torch's RMSNorm launches ~6-10 kernels (cast to fp32, square, mean,
add eps, rsqrt, multiply, cast back, multiply by the weight), each a full pass over the ``[T, D]`` activations in HBM
(~150 KB per token and layer at D = 4096 in bf16), and rotate-half RoPE as many (negate, cat, two products, a sum).
Here each is one kernel that reads its input once and writes its output once.

* :func:`rms_norm_triton` / :func:`rms_norm_torch` -- ``weight * round(x * rsqrt(mean(x^2) + eps))``, statistics in
  fp32, the normalized value rounded to x's dtype, then the product with the weight rounded once (torch's type
  promotion when ``weight.dtype == x.dtype``); :func:`rms_norm_triton_unsupported` says why a call cannot take the
  kernel (None: it can).
* :func:`apply_rope_triton` / :func:`apply_rope_torch` -- ``x * cos + cat(-x2, x1) * sin`` per token, each product
  and the sum rounded to x's dtype as torch rounds them: bitwise equal to the torch function in bf16, fp16 and fp32;
  :func:`apply_rope_triton_unsupported` likewise.

``model.layers.rms_norm`` / ``apply_rope`` take the kernels on CUDA when triton is installed and the operands are
supported, else the torch references. The ``@triton.jit`` kernels live in
:mod:`lightning_moe.kernels._triton_norm_rope`, imported lazily: importing this module needs only torch.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .fused_moe import _TRITON_DTYPES, _check_triton_device, _triton_kernels, triton_available

__all__ = [
    "apply_rope_torch",
    "apply_rope_triton",
    "apply_rope_triton_unsupported",
    "apply_rope_uses_triton",
    "rms_norm_torch",
    "rms_norm_triton",
    "rms_norm_triton_unsupported",
    "rms_norm_uses_triton",
    "use_triton",
]

_KERNELS = "_triton_norm_rope"
_ELEMENTS_PER_PROGRAM = 4096  # RMSNorm rows per program: as many rows of D as fill this many elements (>= 1 row)


def _round_mode(dtype: torch.dtype) -> int:
    """The kernels' ``ROUND`` constexpr for a tensor dtype (``_triton_norm_rope.ROUND_*``)."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``, statistics in fp32, the normalized value
    rounded to x's dtype before the product (transformers' MixtralRMSNorm). x: [..., D] any float dtype; weight: [D].
    Returns torch's promotion of weight and x's dtype (x's dtype when they match)."""
    dtype = x.dtype
    xf = x.float()  # [..., D] fp32
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_triton_unsupported(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why :func:`rms_norm_triton` cannot take these operands (None: it can): x and weight one of bf16 / fp16 / fp32,
    the same dtype and device, weight ``[D]`` with D = x's last size (> 0), x's last dimension contiguous, no autograd.
    The device (CUDA, or the interpreter) is :func:`use_triton`'s business."""
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype}"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} != x dtype {x.dtype}"
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] == 0:
        return f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: weight [D] with D = x.shape[-1] > 0 expected"
    if weight.device != x.device:
        return f"weight on {weight.device}, x on {x.device}"
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        return f"last dimension not contiguous (x strides {tuple(x.stride())}, weight {tuple(weight.stride())})"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "autograd (the kernel has no backward)"
    return None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_torch` in one Triton launch.

    Args:
        x: [..., D] bf16 / fp16 / fp32, last dimension contiguous (leading dimensions flattened to rows: any strides
            a view can flatten, e.g. rows of a ``split``; others are copied first).
        weight: [D] in x's dtype.
        eps: added to the fp32 mean of squares.
    Returns:
        A new contiguous tensor of x's shape and dtype. Equal to :func:`rms_norm_torch` but for the order in which the
        fp32 sum of squares is added up (and, on CUDA, the rsqrt / division roundings of the GPU), a few fp32 ulps of
        the statistic: fp32 within ~1e-6 relative; in bf16 / fp16 a rare element's normalized value rounds to the
        neighbouring value (1 ulp), and its product with the weight then differs by up to 2 ulps. One program per
        block of ``max(1, 4096 // next_pow2(D))`` rows. Runs on the current CUDA stream, no host sync.
    Raises:
        ValueError: :func:`rms_norm_triton_unsupported`'s reasons, CPU tensors (unless TRITON_INTERPRET=1).
        RuntimeError: triton is not installed.
    """
    fn = "rms_norm_triton"
    why = rms_norm_triton_unsupported(x, weight)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    _check_triton_device(fn, x)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)  # a view when the leading dimensions flatten (any row stride), else a copy
    if x2.stride(-1) != 1:  # pragma: no cover - reshape of a last-contiguous tensor keeps it so
        x2 = x2.contiguous()
    R = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    BLOCK_D = _next_pow2(D)
    BLOCK_R = max(1, _ELEMENTS_PER_PROGRAM // BLOCK_D)
    num_warps = min(16, max(1, BLOCK_R * BLOCK_D // 512))  # ~16 elements per thread
    kern = _triton_kernels(_KERNELS)
    kern.rms_norm_kernel[(-(-R // BLOCK_R),)](
        x2, weight, out, R, D, float(eps), x2.stride(0), D,
        BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, ROUND=_round_mode(x.dtype), num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


# --------------------------------------------------------------------------------------------------
# Rotate-half RoPE
# --------------------------------------------------------------------------------------------------


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, hd] by per-token cos/sin [T, hd] (rotate-half convention, as HF Mixtral):
    ``x * cos + cat(-x[..., hd/2:], x[..., :hd/2]) * sin``, cos / sin broadcast over the heads."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, hd]
    return x * cos[:, None, :] + rot * sin[:, None, :]


def apply_rope_triton_unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[str]:
    """Why :func:`apply_rope_triton` cannot take these operands (None: it can): x [T, H, hd] with hd even, cos / sin
    exactly [T, hd], all three one dtype of bf16 / fp16 / fp32 on one device, their last dimensions contiguous, no
    autograd. The device (CUDA, or the interpreter) is :func:`use_triton`'s business."""
    if x.dim() != 3 or x.shape[-1] % 2:
        return f"x {tuple(x.shape)}: [T, H, hd] with hd even expected"
    T, _, hd = x.shape
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype}"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, hd):
            return f"{name} {tuple(t.shape)}: [T, hd] = {(T, hd)} expected (no broadcasting)"
        if t.dtype != x.dtype:
            return f"{name} dtype {t.dtype} != x dtype {x.dtype}"
        if t.device != x.device:
            return f"{name} on {t.device}, x on {x.device}"
        if t.stride(-1) != 1 and hd > 1:
            return f"{name} strides {tuple(t.stride())}: last dimension not contiguous"
    if x.stride(-1) != 1 and hd > 1:
        return f"x strides {tuple(x.stride())}: last dimension not contiguous"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin)):
        return "autograd (the kernel has no backward)"
    return None


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope_torch` in one Triton launch, bitwise equal to it.

    Args:
        x: [T, H, hd] bf16 / fp16 / fp32, hd even; any strides with the last one 1 (a ``.view`` of a projection's
            output, a slice of a wider head).
        cos, sin: [T, hd] in x's dtype, last dimension contiguous (``model.layers.rope_cos_sin``'s tables or row
            slices of them).
    Returns:
        A new contiguous [T, H, hd] tensor in x's dtype: each product and the sum computed in fp32 and rounded to x's
        dtype, as torch's element-wise ops round them (bitwise equal to :func:`apply_rope_torch`). One program per
        token and block of heads. Runs on the current CUDA stream, no host sync.
    Raises:
        ValueError: :func:`apply_rope_triton_unsupported`'s reasons, CPU tensors (unless TRITON_INTERPRET=1).
        RuntimeError: triton is not installed.
    """
    fn = "apply_rope_triton"
    why = apply_rope_triton_unsupported(x, cos, sin)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    _check_triton_device(fn, x)
    T, H, hd = x.shape
    out = torch.empty((T, H, hd), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = hd // 2
    BLOCK_HALF = _next_pow2(half)
    BLOCK_H = min(_next_pow2(H), max(1, 2048 // BLOCK_HALF))  # <= 2 x 2048 elements of x per program
    num_warps = min(8, max(1, BLOCK_H * BLOCK_HALF // 256))
    kern = _triton_kernels(_KERNELS)
    kern.rope_kernel[(T, -(-H // BLOCK_H))](
        x, cos, sin, out, H, half,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, ROUND=_round_mode(x.dtype), num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    """triton is installed and imports (probed once per process)."""
    if not triton_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - a broken install: the torch path
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """True when a kernel of this module may run on ``x``'s device: x is a CUDA tensor and triton imports (the
    operand checks are the ``*_unsupported`` functions'). The interpreter is never chosen automatically."""
    return x.is_cuda and _triton_imports()


def rms_norm_uses_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``model.layers.rms_norm``'s choice: True -> :func:`rms_norm_triton`, False -> :func:`rms_norm_torch`."""
    return use_triton(x) and rms_norm_triton_unsupported(x, weight) is None


def apply_rope_uses_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """``model.layers.apply_rope``'s choice: True -> :func:`apply_rope_triton`, False -> :func:`apply_rope_torch`."""
    return use_triton(x) and apply_rope_triton_unsupported(x, cos, sin) is None
