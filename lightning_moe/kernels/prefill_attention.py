"""Causal attention over prompts packed token-wise (prefill): which fused kernel runs it on CUDA.

Three ways, all fused (no [S, S] score matrix in memory):

* :func:`attention_varlen` -- torch's variable-length flash attention (``torch.nn.attention.varlen``) straight on
  the packed rows: no padding, no per-sequence gather, one launch per call. Used where
  :func:`varlen_unsupported` has no objection (CUDA, fp16 / bf16, one head width for q, k and v, at most 256, a
  torch that has the module and, where asked for, its GQA, sliding-window and scale arguments).
* :func:`attention_varlen_triton` -- this package's Triton flash attention on the packed rows
  (``_prefill_attention_triton.py``, issue 44): what varlen refuses and the model needs, namely per-head attention
  sinks (gpt-oss), q/k and v of different head widths (MLA: 192 / 128), fp32, any width <= 256 (padded in the
  kernel); GQA, a sliding window and a scale too. Used where :func:`triton_unsupported` has no objection (CUDA,
  triton importable, fp32 / fp16 / bf16, widths <= 256).
* the padded call (the caller pads to the chunk's longest row with a boolean mask and calls
  ``scaled_dot_product_attention``) inside :func:`sdpa_backends`: on CUDA the memory-efficient kernel first. SDPA's
  own first pick on Hopper, cuDNN, builds an execution plan for every new (rows, longest row) shape, 50-110 ms
  each on the H200 (``benchmarks/bench_prefill_attention.py``), and a dataset of many lengths makes nearly every
  prefill chunk a new shape; the memory-efficient kernel has no per-shape cost.

``LIGHTNING_MOE_PREFILL_ATTENTION`` picks: ``auto`` (default: varlen where supported, else the Triton kernel where
supported, else the padded call with the memory-efficient kernel first), ``varlen`` (the same), ``triton`` (the
Triton kernel wherever it is supported, also where varlen is, else the padded call), ``efficient`` (always the padded
call, memory-efficient first), ``sdpa`` (the padded call with SDPA's own backend order). Attention with sinks
(gpt-oss, ``model.families.gpt_oss.prefill_attention_packed``) takes the Triton kernel under ``auto`` / ``varlen`` /
``triton`` where supported and its torch path (the [S, S] scores materialized) otherwise, ``efficient`` and ``sdpa``
included (:func:`use_triton`). :func:`attention_varlen_reference` is the torch reference of the fused paths (per
sequence, fp32 softmax, with sinks and different v width).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from typing import Optional

import torch

MODES = ("auto", "varlen", "triton", "efficient", "sdpa")
_VARLEN = None  # (varlen_attn, its parameter names), or () when this torch has none; filled on first use


def prefill_attention_mode() -> str:
    """``LIGHTNING_MOE_PREFILL_ATTENTION`` (unset or empty: ``auto``); raises ValueError naming the variable for a
    value not in :data:`MODES`."""
    mode = os.environ.get("LIGHTNING_MOE_PREFILL_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"environment variable LIGHTNING_MOE_PREFILL_ATTENTION={mode!r}: expected one of "
                         f"{', '.join(MODES)}")
    return mode


def _varlen():
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
            _VARLEN = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
        except ImportError:
            _VARLEN = ()
    return _VARLEN


def varlen_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: Optional[int],
                       scale: Optional[float]) -> Optional[str]:
    """Why :func:`attention_varlen` cannot take these operands (None: it can). q: [T, Hq, hd]; k: [T, Hkv, hd];
    v: [T, Hkv, v_hd]."""
    if not q.is_cuda:
        return "not on CUDA"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (flash attention: float16 / bfloat16)"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"head widths q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]} (flash: one width <= 256, a multiple of 8)"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} kv heads"
    fn = _varlen()
    if not fn:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    params = fn[1]
    if "window_size" not in params and "is_causal" not in params:
        return "this torch's varlen_attn takes neither window_size nor is_causal"
    if sliding_window is not None and "window_size" not in params:
        return "a sliding window (this torch's varlen_attn has no window_size)"
    if scale is not None and "scale" not in params:
        return "a softmax scale (this torch's varlen_attn has no scale)"
    return None


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     sliding_window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of the packed sequences ``cu_seqlens[i]:cu_seqlens[i+1]`` with torch's varlen flash attention:
    token i of a sequence attends to its own j <= i (and j > i - sliding_window when set); logits scaled by ``scale``
    (default 1/sqrt(hd)); GQA by the head ratio (kv head h serves query heads h*G..h*G+G-1).

    Args:
        q: ``[T, Hq, hd]``; k, v: ``[T, Hkv, hd]``; CUDA, fp16 / bf16 (:func:`varlen_unsupported`).
        cu_seqlens: int32 ``[B + 1]`` on q's device, 0 first, T last (not checked: that would sync).
        max_len: the longest sequence (a host int).

    Returns:
        ``[T, Hq, hd]`` in q's dtype.

    Raises:
        ValueError: what :func:`varlen_unsupported` names; ``cu_seqlens`` not int32 / not on q's device.
    """
    why = varlen_unsupported(q, k, v, sliding_window, scale)
    if why is not None:
        raise ValueError(f"attention_varlen: {why}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(f"attention_varlen: cu_seqlens must be int32 on {q.device}, got {cu_seqlens.dtype} on "
                         f"{cu_seqlens.device}")
    fn, params = _varlen()
    kw = {}
    G = q.shape[1] // k.shape[1]
    if G > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # this torch wants one kv head per query head: repeat the packed rows (no padding)
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if "window_size" in params:
        kw["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)  # (left, right): causal
    else:
        kw["is_causal"] = True
    if scale is not None:
        kw["scale"] = scale
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)


def attention_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               sliding_window: Optional[int] = None, scale: Optional[float] = None,
                               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference of :func:`attention_varlen` and :func:`attention_varlen_triton`: per sequence, scores in
    fp32, a masked softmax; any device and dtype. q: [T, Hq, hd]; k: [T, Hkv, hd]; v: [T, Hkv, v_hd] (v_hd may differ
    from hd); ``sinks``: [Hq] per-head logits that join each row's softmax (as one more key) and are dropped (their
    share goes to no value: gpt-oss). Returns ``[T, Hq, v_hd]`` in q's dtype."""
    G = q.shape[1] // k.shape[1]
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qh = q[s:e].transpose(0, 1).float()  # [Hq, S, hd]
        kh = k[s:e].transpose(0, 1).repeat_interleave(G, dim=0).float()  # [Hq, S, hd]
        vh = v[s:e].transpose(0, 1).repeat_interleave(G, dim=0).float()  # [Hq, S, v_hd]
        i = torch.arange(e - s, device=q.device)
        allowed = i[None, :] <= i[:, None]  # [S, S]
        if sliding_window is not None:
            allowed &= i[None, :] > i[:, None] - sliding_window
        scores = (qh @ kh.transpose(1, 2) * sc).masked_fill(~allowed, float("-inf"))  # [Hq, S, S]
        if sinks is not None:
            col = sinks.to(q.device, torch.float32).view(-1, 1, 1).expand(-1, e - s, 1)  # [Hq, S, 1]
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]  # [Hq, S, S]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[s:e] = (probs @ vh).transpose(0, 1).to(q.dtype)  # [S, Hq, v_hd]
    return out


TRITON_MAX_HEAD_DIM = 256  # widest q/k or v head the Triton kernel takes (its tiles hold a padded head in registers)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_IMPORTABLE = None  # whether triton is installed; filled on first use


def _triton_importable() -> bool:
    global _TRITON_IMPORTABLE
    if _TRITON_IMPORTABLE is None:
        from .fused_moe import triton_available
        _TRITON_IMPORTABLE = triton_available()
    return _TRITON_IMPORTABLE


def triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why :func:`attention_varlen_triton` does not run for these operands on this host (None: it does). q:
    [T, Hq, hd]; k: [T, Hkv, hd]; v: [T, Hkv, v_hd]. A window, a scale and sinks are always taken."""
    if not q.is_cuda:
        return "not on CUDA"
    if not _triton_importable():
        return "triton is not installed"
    return _triton_operands_wrong(q, k, v)


def _triton_operands_wrong(q, k, v) -> Optional[str]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be [T, H, hd], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _TRITON_DTYPES:
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype} (one of float32 / float16 / bfloat16)"
    if not (q.device == k.device == v.device):
        return f"devices q {q.device}, k {k.device}, v {v.device}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        return (f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (q [T, Hq, hd], k [T, Hkv, hd], "
                "v [T, Hkv, v_hd])")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} kv heads"
    if not (0 < q.shape[2] <= TRITON_MAX_HEAD_DIM and 0 < v.shape[2] <= TRITON_MAX_HEAD_DIM):
        return f"head widths q/k {q.shape[2]}, v {v.shape[2]} (each 1..{TRITON_MAX_HEAD_DIM})"
    return None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _triton_blocks(dqk_pad: int, dv_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) by padded head width: the q tile [BM, DQK_PAD], k tile [DQK_PAD, BN], v tile
    [BN, DV_PAD] and the fp32 accumulator [BM, DV_PAD] stay within a program's registers (not tuned on a GPU)."""
    wide = max(dqk_pad, dv_pad)
    if dtype == torch.float32:  # fp32 tiles take twice the registers
        return (32, 32, 4) if wide > 64 else (64, 32, 4)
    return (64, 32, 8) if wide > 128 else (64, 64, 4)


def attention_varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, sliding_window: Optional[int] = None, scale: Optional[float] = None,
                            sinks: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                            block_m: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Causal attention of the packed sequences ``cu_seqlens[i]:cu_seqlens[i+1]`` in one Triton launch
    (``_prefill_attention_triton.py``): token i of a sequence attends to its own j <= i (and j > i - sliding_window
    when set); logits scaled by ``scale`` (default 1/sqrt(hd)); GQA by the head ratio (kv head h serves query heads
    h*G..h*G+G-1); with ``sinks`` each query head's sink logit joins the softmax and is dropped. Online softmax and
    accumulation in fp32, no [S, S] matrix; :func:`attention_varlen_reference` is its reference.

    Args:
        q: ``[T, Hq, hd]``; k: ``[T, Hkv, hd]``; v: ``[T, Hkv, v_hd]`` (v_hd independent of hd: MLA's 192 / 128);
            one dtype of float32 / float16 / bfloat16; widths <= 256, any (padded in the kernel); any strides with
            the last one 1 (else a contiguous copy).
        cu_seqlens: int32 ``[B + 1]`` on q's device, 0 first, T last, non-decreasing (not checked: that would sync).
        max_len: the longest sequence (a host int; the grid's query blocks). An under-stated max_len leaves rows
            unwritten.
        sliding_window: None or >= 1 keys (the query's own included).
        sinks: None or ``[Hq]`` logits (any float dtype: used in fp32), on q's device.
        out: None or ``[T, Hq, v_hd]`` in q's dtype on q's device, last stride 1: written and returned.
        block_m, block_n: query / key block sizes (powers of two >= 16; None: by head width). Tests use small ones.

    Returns:
        ``[T, Hq, v_hd]`` in q's dtype. Runs on the current CUDA stream, no host sync; CPU tensors only under the
        Triton interpreter (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: bad shapes, dtypes, devices, cu_seqlens, window, sinks, out or blocks (before triton is needed).
        RuntimeError: triton is not installed.
    """
    from .fused_moe import _check_triton_device, _interpret_mode, _triton_kernels

    fn = "attention_varlen_triton"
    why = _triton_operands_wrong(q, k, v)
    if why is not None:
        raise ValueError(f"{fn}: {why}")
    _check_triton_device(fn, q)
    T, Hq, dqk = q.shape
    Hkv, dv = k.shape[1], v.shape[2]
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
            or cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens must be 1-D int32 [B + 1] on {q.device}, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"{fn}: max_len must be an int >= 0, got {max_len!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"{fn}: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if sinks is not None:
        if sinks.shape != (Hq,) or not sinks.is_floating_point() or sinks.device != q.device:
            raise ValueError(f"{fn}: sinks must be a float [{Hq}] on {q.device}, got {sinks.dtype} "
                             f"{tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.to(torch.float32).contiguous()
    if out is None:
        out = q.new_empty((T, Hq, dv))
    elif out.shape != (T, Hq, dv) or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"{fn}: out must be [{T}, {Hq}, {dv}] {q.dtype} on {q.device} with last stride 1, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    dqk_pad, dv_pad = _pow2(dqk), _pow2(dv)
    bm, bn, warps = _triton_blocks(dqk_pad, dv_pad, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    for name, blk in (("block_m", bm), ("block_n", bn)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{fn}: {name} must be a power of two >= 16, got {blk}")
    B = cu_seqlens.numel() - 1
    if B > 65535 or Hq > 65535:  # the grid's y / z extent
        raise ValueError(f"{fn}: at most 65535 sequences and query heads, got {B} and {Hq}")
    if T == 0 or B == 0 or max_len == 0:
        return out
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    kern = _triton_kernels("_prefill_attention_triton")
    grid = (-(-max_len // bm), B, Hq)
    kern.prefill_attention_kernel[grid](
        q, k, v, out, cu_seqlens, sinks if sinks is not None else cu_seqlens,
        float(scale) if scale is not None else 1.0 / math.sqrt(dqk), sliding_window or 0, Hq // Hkv, dqk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, DQK_PAD=dqk_pad, DV_PAD=dv_pad, WINDOW=sliding_window is not None,
        SINKS=sinks is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_interpret_mode(), num_warps=warps, num_stages=2,
    )
    return out


def sdpa_backends(device: torch.device, mode: str):
    """The context for the padded ``scaled_dot_product_attention`` call of packed prefill: on CUDA with ``mode``
    other than ``sdpa``, SDPA's backends in the order memory-efficient, flash, cuDNN, math (the first that takes
    the call runs it); otherwise no change."""
    if device.type != "cuda" or mode == "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def use_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: Optional[int],
               scale: Optional[float], mode: str) -> bool:
    """Whether packed prefill runs :func:`attention_varlen` under ``mode`` (``auto`` / ``varlen``: where supported)."""
    return mode in ("auto", "varlen") and varlen_unsupported(q, k, v, sliding_window, scale) is None


def use_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: Optional[int],
               scale: Optional[float], mode: str, sinks: bool = False) -> bool:
    """Whether packed prefill runs :func:`attention_varlen_triton` under ``mode``: ``auto`` / ``varlen`` where varlen
    cannot take the operands (always with ``sinks``, which varlen has not) and the Triton kernel can; ``triton``
    wherever the Triton kernel can; never under ``efficient`` / ``sdpa``."""
    if mode not in ("auto", "varlen", "triton") or triton_unsupported(q, k, v) is not None:
        return False
    return mode == "triton" or sinks or varlen_unsupported(q, k, v, sliding_window, scale) is not None


__all__ = ["MODES", "TRITON_MAX_HEAD_DIM", "prefill_attention_mode", "varlen_unsupported", "attention_varlen",
           "attention_varlen_reference", "triton_unsupported", "attention_varlen_triton", "sdpa_backends", "use_varlen",
           "use_triton"]
