"""The scoring head's per-row statistics in one Triton launch: log p(target) and the greedy flag from the logits in
the model dtype, with the torch reference beside it.

Why: scoring (``pipeline.token_scores``) needs two numbers per row of a chunk's ``[c, V]`` logits. torch's way makes
an fp32 copy of the logits (``.float()``), an fp32 log_softmax (itself a max pass, a sum pass and a write) and an
argmax pass, each a full pass over ``[c, V]`` in HBM: on an H100 at Qwen3-30B-A3B's V = 151,936 they took ~190 ms of a
perplexity job predicted at ~0.4 s, twice the lm_head GEMM (measured on the job, the head's passes were not what
bound its wall: benchmarks/RESULTS.md, Session 42). Here one program per row reads the model-dtype logits once (online
maximum and rescaled sum of exponentials, and a running argmax) and writes 5 bytes.

* :func:`score_head_triton` / :func:`score_head_torch` -- ``logp = x[t] - logsumexp(x)`` in fp32 and
  ``greedy = argmax(x) == t`` (lowest index among equal maxima) per row; :func:`score_head_triton_unsupported` says
  why a call cannot take the kernel (None: it can). ``pipeline.token_scores`` takes the kernel on CUDA with triton
  (:func:`use_triton`), a family head in the model dtype (``model.layers.model_dtype_head``) and operands it takes.

The ``@triton.jit`` kernel lives in :mod:`lightning_moe.kernels._triton_score_head`, imported lazily: importing this
module needs only torch.

Dimension key: c rows (a scoring chunk's tokens), V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fused_moe import _TRITON_DTYPES, _check_triton_device, _triton_kernels
from .norm_rope import use_triton

__all__ = [
    "score_head_torch",
    "score_head_triton",
    "score_head_triton_unsupported",
    "use_triton",
]

_KERNELS = "_triton_score_head"
_MAX_BLOCK_V = 4096  # logits per block of a row (one load per lane per block; 16 per thread at 8 warps)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def score_head_torch(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: fp32 copy, ``log_softmax``, gather of the target; greedy = argmax of the fp32 logits == target
    (torch's argmax: the lowest index among equal maxima), False on a row holding a NaN.

    logits: [c, V] any float dtype; targets: int64 [c] in [0, V). Returns (fp32 logp [c], bool greedy [c]).
    The log-probabilities are ``pipeline.token_scores``' torch path's; its greedy flag is the argmax of the
    log-probabilities, which equals this one but where fp32 rounding of ``x - logsumexp`` makes two near-maximal
    logits equal (it then names the lower index) and on NaN rows (where it compares the target with 0).
    """
    lf = logits.float()  # [c, V]
    logp = torch.log_softmax(lf, dim=-1).gather(1, targets[:, None])[:, 0]  # [c]
    greedy = (lf.argmax(dim=-1) == targets) & ~lf.isnan().any(dim=-1)  # [c]
    return logp, greedy


def score_head_triton_unsupported(logits: torch.Tensor, targets: torch.Tensor,
                                  out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Optional[str]:
    """Why :func:`score_head_triton` cannot take these operands (None: it can): logits ``[c, V]`` bf16 / fp16 / fp32
    with V >= 1 (< 2^31) and its last dimension contiguous (rows at any stride), targets int64 ``[c]`` (any stride) on
    its device, ``out`` (if given) fp32 and bool ``[c]`` contiguous tensors there, no autograd. The device (CUDA, or
    the interpreter) is :func:`use_triton`'s business."""
    if logits.dim() != 2 or logits.shape[1] < 1 or logits.shape[1] >= 2 ** 31:
        return f"logits {tuple(logits.shape)}: [c, V] with 1 <= V < 2^31 expected"
    if logits.dtype not in _TRITON_DTYPES:
        return f"logits dtype {logits.dtype}"
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        return f"logits strides {tuple(logits.stride())}: last dimension not contiguous"
    c = logits.shape[0]
    if targets.dim() != 1 or targets.shape[0] != c or targets.dtype != torch.int64:
        return f"targets {tuple(targets.shape)} {targets.dtype}: int64 [c] = [{c}] expected"
    if targets.device != logits.device:
        return f"targets on {targets.device}, logits on {logits.device}"
    for t, dtype in zip(out or (), (torch.float32, torch.bool)):
        if t.shape != (c,) or t.dtype != dtype or t.device != logits.device or not t.is_contiguous():
            return f"out {tuple(t.shape)} {t.dtype} on {t.device}: a contiguous {dtype} [{c}] on {logits.device} expected"
    if torch.is_grad_enabled() and logits.requires_grad:
        return "autograd (the kernel has no backward)"
    return None


def score_head_triton(logits: torch.Tensor, targets: torch.Tensor,
                      out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`score_head_torch` in one Triton launch, one read of the logits in their own dtype.

    Args:
        logits: [c, V] bf16 / fp16 / fp32 (the lm_head GEMM's output), last dimension contiguous, rows at any stride.
        targets: int64 [c], any stride. A target outside [0, V) gives logp NaN and greedy False (no read outside
            the row; ``pipeline.token_scores`` clamps its -1 targets to 0 first).
        out: optional (fp32 [c], bool [c]) contiguous tensors to write into (e.g. slices of a whole batch's outputs).
    Returns:
        (logp fp32 [c], greedy bool [c]): ``logp = (x[t] - M) - log(sum exp(x - M))`` (log_softmax's own order)
        with every logit converted to fp32 exactly (as ``.float()`` does) and all arithmetic in fp32, M the row
        maximum; ``greedy`` = (the lowest index holding M) == t, exactly torch's argmax of the logits. logp differs
        from the reference only in the order of the fp32 sum of exponentials (and, on CUDA, the exp / log
        approximations): within ~1e-6 of it. A row holding a NaN: logp NaN (as log_softmax gives), greedy False
        (no token is the argmax of such a row; torch's argmax of the log-probabilities would name index 0). A row
        holding +inf: logp NaN (as log_softmax), greedy (first +inf index) == t. One program per row, blocks of up
        to 4096 logits. Runs on the current CUDA stream, no host sync.
    Raises:
        ValueError: :func:`score_head_triton_unsupported`'s reasons, CPU tensors (unless TRITON_INTERPRET=1).
        RuntimeError: triton is not installed.
    """
    fn = "score_head_triton"
    why = score_head_triton_unsupported(logits, targets, out)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    _check_triton_device(fn, logits)
    c, V = logits.shape
    if out is None:
        out = (torch.empty(c, dtype=torch.float32, device=logits.device),  # [c]
               torch.empty(c, dtype=torch.bool, device=logits.device))  # [c]
    logp, greedy = out
    if c == 0:
        return logp, greedy
    BLOCK_V = min(_MAX_BLOCK_V, _next_pow2(V))
    num_warps = min(8, max(1, BLOCK_V // 512))  # ~16 logits per thread and block
    kern = _triton_kernels(_KERNELS)
    kern.score_head_kernel[(c,)](
        logits, targets, logp, greedy, V, logits.stride(0), targets.stride(0),
        BLOCK_V=BLOCK_V, num_warps=num_warps,
    )
    return logp, greedy
