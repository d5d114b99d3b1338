"""Ragged decode attention on the CPU over the CPU KV cache (MoE-Lightning Sec. 4.1: attention on CPU).

Reads only up to the longest valid length of the batch, rounded up to a small bucket, never the whole
``S_max``; rows are masked at their own lengths. Bytes moved per call: 2 * B * Hkv * S * hd * itemsize
(K and V), which is what bounds it (arithmetic intensity ~ G FLOP/byte).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..model.mixtral import decode_attention

BUCKET = 16  # pad the attended length up to a multiple of this many positions


def bucket_len(max_len: int, limit: int) -> int:
    """``max_len`` rounded up to a multiple of BUCKET, capped at ``limit`` (the cache's S_max)."""
    return min(limit, -(-max_len // BUCKET) * BUCKET)


def cpu_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, sliding_window: Optional[int] = None
) -> torch.Tensor:
    """GQA decode attention for B sequences, one new query each.

    q: [B, Hq, hd] (any float dtype, on CPU); k, v: [B, Hkv, S, hd] CPU cache rows (the new token's k/v
    already written); lengths: int64 [B] valid positions per row, each <= S.
    Returns [B, Hq*hd] in q's dtype. Raises ValueError on mismatched shapes.
    """
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise ValueError(f"cpu_decode_attention: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} lengths={tuple(lengths.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"cpu_decode_attention: {q.shape[1]} query heads not a multiple of {k.shape[1]} KV heads")
    S = bucket_len(int(lengths.max()), k.shape[2])
    return decode_attention(q, k[:, :, :S], v[:, :, :S], lengths, sliding_window)
