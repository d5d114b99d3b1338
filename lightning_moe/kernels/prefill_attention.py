"""Causal attention over prompts packed token-wise (prefill): which fused kernel runs it on CUDA.

Two ways, both fused (no [S, S] score matrix in memory):

* :func:`attention_varlen` -- torch's variable-length flash attention (``torch.nn.attention.varlen``) straight on
  the packed rows: no padding, no per-sequence gather, one launch per call. Used where
  :func:`varlen_unsupported` has no objection (CUDA, fp16 / bf16, one head width for q, k and v, at most 256, a
  torch that has the module and, where asked for, its GQA, sliding-window and scale arguments).
* the padded call (the caller pads to the chunk's longest row with a boolean mask and calls
  ``scaled_dot_product_attention``) inside :func:`sdpa_backends`: on CUDA the memory-efficient kernel first. SDPA's
  own first pick on Hopper, cuDNN, builds an execution plan for every new (rows, longest row) shape, 50-110 ms
  each on the H200 (``benchmarks/bench_prefill_attention.py``), and a dataset of many lengths makes nearly every
  prefill chunk a new shape; the memory-efficient kernel has no per-shape cost.

``LIGHTNING_MOE_PREFILL_ATTENTION`` picks: ``auto`` (default: varlen where supported, else the padded call with
the memory-efficient kernel first), ``varlen`` (the same), ``efficient`` (always the padded call, memory-efficient
first), ``sdpa`` (the padded call with SDPA's own backend order). :func:`attention_varlen_reference` is the torch
reference of the varlen path (per sequence, fp32 softmax).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from typing import Optional

import torch

MODES = ("auto", "varlen", "efficient", "sdpa")
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
                               sliding_window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    """The torch reference of :func:`attention_varlen`: per sequence, scores in fp32, a masked softmax; any device
    and dtype. Returns ``[T, Hq, hd]`` in q's dtype."""
    G = q.shape[1] // k.shape[1]
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qh = q[s:e].transpose(0, 1).float()  # [Hq, S, hd]
        kh = k[s:e].transpose(0, 1).repeat_interleave(G, dim=0).float()  # [Hq, S, hd]
        vh = v[s:e].transpose(0, 1).repeat_interleave(G, dim=0).float()  # [Hq, S, hd]
        i = torch.arange(e - s, device=q.device)
        allowed = i[None, :] <= i[:, None]  # [S, S]
        if sliding_window is not None:
            allowed &= i[None, :] > i[:, None] - sliding_window
        scores = (qh @ kh.transpose(1, 2) * sc).masked_fill(~allowed, float("-inf"))  # [Hq, S, S]
        out[s:e] = (torch.softmax(scores, dim=-1) @ vh).transpose(0, 1).to(q.dtype)  # [S, Hq, hd]
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


__all__ = ["MODES", "prefill_attention_mode", "varlen_unsupported", "attention_varlen", "attention_varlen_reference",
           "sdpa_backends", "use_varlen"]
