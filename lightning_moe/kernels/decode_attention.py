"""GPU decode attention over a ragged (length-grouped) KV cache in one launch: append the new token, then attend.

Why: CGOPipe's GPU-attention micro-batches keep their KV in a :class:`~lightning_moe.pipeline.kv_cache.GroupedKVCache`
(8 length groups, each ``[B_g, Hkv, S_g, hd]``), and the torch path appends and attends group by group, ~20 small ops
per group and layer, all issued by the host thread, while the GPU waits: a GPU-attention micro-batch costs the host
more per layer than a CPU-attention one (profile h_g vs h_c).
Here the groups live in one flat array of hd-vectors per layer and every row carries its own (base, capacity), so one
kernel covers all groups: grid (rows, KV heads), Flash-Decoding's single-split case.

:func:`decode_append_attention_triton` is the wrapper (checks, allocates the output, launches);
:func:`decode_append_attention_reference` is the pure-torch reference beside it (same layout, same semantics, the
math of ``model.layers.decode_attention`` in fp32).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .fused_moe import _TRITON_DTYPES, _check_triton_device, _triton_kernels

BLOCK_N = 16  # cached positions per loop step of a program


def _check(fn: str, q, k_new, v_new, k_flat, v_flat, row_base, row_cap, pos) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes and devices of :func:`decode_append_attention_triton`'s arguments; returns (B, Hq, Hkv, G, hd)."""
    if q.dim() != 3 or k_new.dim() != 3 or v_new.shape != k_new.shape:
        raise ValueError(f"{fn}: q [B, Hq, hd] and k_new / v_new [B, Hkv, hd] expected, got {tuple(q.shape)} / "
                         f"{tuple(k_new.shape)} / {tuple(v_new.shape)}")
    B, Hq, hd = q.shape
    Hkv = k_new.shape[1]
    if k_new.shape[0] != B or k_new.shape[2] != hd or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{fn}: k_new {tuple(k_new.shape)} does not match q {tuple(q.shape)} (B, hd, Hq a multiple of Hkv)")
    if q.dtype not in _TRITON_DTYPES or k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise ValueError(f"{fn}: q / k_new / v_new must share one of {_TRITON_DTYPES}, got {q.dtype} / {k_new.dtype} / "
                         f"{v_new.dtype}")
    for name, t in (("k_flat", k_flat), ("v_flat", v_flat)):
        if t.dim() != 1 or not t.is_contiguous() or t.dtype != q.dtype or t.numel() % hd:
            raise ValueError(f"{fn}: {name} must be a contiguous 1-D {q.dtype} array of hd-vectors, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if k_flat.numel() != v_flat.numel():
        raise ValueError(f"{fn}: k_flat and v_flat differ in size ({k_flat.numel()} vs {v_flat.numel()})")
    for name, t in (("row_base", row_base), ("row_cap", row_cap), ("pos", pos)):
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{fn}: {name} must be int32/int64 [{B}], got {tuple(t.shape)} {t.dtype}")
    for name, t in (("k_new", k_new), ("v_new", v_new), ("k_flat", k_flat), ("v_flat", v_flat), ("row_base", row_base),
                    ("row_cap", row_cap), ("pos", pos)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} on {t.device} but q on {q.device}")
    return B, Hq, Hkv, Hq // Hkv, hd


def decode_append_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_flat: torch.Tensor,
                                      v_flat: torch.Tensor, row_base: torch.Tensor, row_cap: torch.Tensor,
                                      pos: torch.Tensor, sliding_window: Optional[int] = None,
                                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_append_attention_triton` (same arguments, same effect on the cache):
    a loop over rows, softmax in fp32 over scores computed in fp32 (with ``sinks``: each head's sink logit appended
    to its scores, its probability dropped). Returns [B, Hq*hd] in q's dtype."""
    B, Hq, Hkv, G, hd = _check("decode_append_attention_reference", q, k_new, v_new, k_flat, v_flat, row_base, row_cap, pos)
    K, V = k_flat.view(-1, hd), v_flat.view(-1, hd)  # [vectors, hd]
    out = torch.empty((B, Hq * hd), dtype=q.dtype, device=q.device)
    for r in range(B):
        base, cap, L = int(row_base[r]), int(row_cap[r]), int(pos[r])
        if L >= cap:
            raise ValueError(f"decode_append_attention_reference: row {r} is full ({L} of {cap} positions)")
        idx = base + torch.arange(Hkv, device=q.device) * cap + L  # [Hkv] vector of the new token per head
        K[idx], V[idx] = k_new[r], v_new[r]
        start = 0 if sliding_window is None else max(0, L + 1 - sliding_window)
        blocks = base + torch.arange(Hkv, device=q.device)[:, None] * cap + torch.arange(start, L + 1, device=q.device)
        Kr, Vr = K[blocks].float(), V[blocks].float()  # [Hkv, n, hd]
        qr = q[r].float().view(Hkv, G, hd)  # [Hkv, G, hd]
        s = qr @ Kr.transpose(1, 2) / math.sqrt(hd)  # [Hkv, G, n]
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(Hkv, G, 1)], dim=-1)  # [Hkv, G, n + 1]
        p = torch.softmax(s, dim=-1)[..., :Kr.shape[1]]  # [Hkv, G, n]
        out[r] = (p @ Vr).reshape(Hq * hd).to(q.dtype)
    return out


def decode_append_attention_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_flat: torch.Tensor,
                                   v_flat: torch.Tensor, row_base: torch.Tensor, row_cap: torch.Tensor, pos: torch.Tensor,
                                   sliding_window: Optional[int] = None,
                                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Append one decode token per row to a ragged flat KV cache and attend, in one kernel launch.

    Args:
        q: [B, Hq, hd] queries (bf16 / fp16 / fp32), rows in any order the metadata below uses.
        k_new, v_new: [B, Hkv, hd] the new token's key / value per row (q's dtype); Hq a multiple of Hkv (GQA).
        k_flat, v_flat: contiguous 1-D caches of hd-vectors (q's dtype): row r's KV head h holds ``row_cap[r]``
            positions from vector ``row_base[r] + h * row_cap[r]`` (GroupedKVCache's flat layout).
        row_base, row_cap: int32/int64 [B], in hd-vectors / positions.
        pos: int32/int64 [B] positions already cached per row; the new token is written at ``pos[r]`` and the row
            attends over ``pos[r] + 1`` positions (the last ``sliding_window`` of them with a window).
        sliding_window: None or the attention window in positions.
        sinks: None, or fp32 [Hq] on q's device: one sink logit per query head (gpt-oss), counted in each head's
            softmax and dropped from its output.
    Returns:
        [B, Hq*hd] in q's dtype (softmax and accumulation in fp32; bf16 differs from the bf16 torch path by its
        rounding, ~1e-2 relative).
    The kernel does not check ``pos[r] < row_cap[r]`` (that needs the values on the host): the caller must (the
    executor checks its host copy of the lengths). Runs on the current CUDA stream, no host sync.
    Raises:
        ValueError: a shape / dtype / device mismatch, CPU tensors (unless TRITON_INTERPRET=1), a window < 1.
        RuntimeError: triton is not installed.
    """
    fn = "decode_append_attention_triton"
    B, Hq, Hkv, G, hd = _check(fn, q, k_new, v_new, k_flat, v_flat, row_base, row_cap, pos)
    _check_triton_device(fn, q)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{fn}: sliding_window must be None or >= 1, got {sliding_window}")
    if sinks is not None and (sinks.shape != (Hq,) or sinks.dtype != torch.float32 or sinks.device != q.device
                              or not sinks.is_contiguous()):
        raise ValueError(f"{fn}: sinks must be a contiguous fp32 [Hq] = [{Hq}] tensor on {q.device}, got "
                         f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")
    out = torch.empty((B, Hq * hd), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if q.stride(2) != 1 or k_new.stride(2) != 1 or v_new.stride() != k_new.stride():
        q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    kern = _triton_kernels()
    kern.decode_append_attention_kernel[(B, Hkv)](
        q, k_new, v_new, k_flat, v_flat, out, row_base, row_cap, pos, sinks if sinks is not None else q,
        G, hd, sliding_window or 0, 1.0 / math.sqrt(hd),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), out.stride(0),
        G_PAD=max(2, 1 << (G - 1).bit_length()), D_PAD=max(16, 1 << (hd - 1).bit_length()), BLOCK_N=BLOCK_N,
        WINDOW=sliding_window is not None, SINKS=sinks is not None, num_warps=4,
    )
    return out

