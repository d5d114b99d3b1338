"""Ragged decode attention on the CPU over the CPU KV cache (MoE-Lightning Sec. 4.1: attention on CPU).

Reads only up to the longest valid length of the batch, rounded up to a small bucket, never the whole
``S_max``; rows are masked at their own lengths. Bytes moved per call: 2 * B * Hkv * S * hd * itemsize
(K and V), which is what bounds it (arithmetic intensity ~ G FLOP/byte).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

BUCKET = 16  # pad the attended length up to a multiple of this many positions


def bucket_len(max_len: int, limit: int) -> int:
    """``max_len`` rounded up to a multiple of BUCKET, capped at ``limit`` (the cache's S_max)."""
    return min(limit, -(-max_len // BUCKET) * BUCKET)


def _native_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native kernel (kernels.cpu_attention) can run these operands (built, dtype, layout)."""
    from ..kernels.cpu_attention import native_available

    hd = k.shape[-1]
    return (k.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.dtype == k.dtype == v.dtype
            and k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == hd
            and (q.shape[0] == 0 or q[0].is_contiguous()) and native_available())


def cpu_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, sliding_window: Optional[int] = None
) -> torch.Tensor:
    """GQA decode attention for B sequences, one new query each, in ONE call.

    Runs the native kernel (kernels.cpu_attention.decode_attention_append without an append: one pass over
    each valid K and V row) when it is built and the operands fit it (bf16/fp16/fp32, each head's positions
    contiguous); otherwise PyTorch's fused routine, as follows. The G query heads that share a KV head are laid out as G query positions of that head, so
    ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's fused CPU kernel) runs on
    q [B, Hkv, G, hd] against k/v [B, Hkv, S, hd] with a per-row key mask, without expanding K/V. At decode
    shapes the cost of a call is mostly fixed dispatch/threading overhead (an unfused routine of about ten small
    ops took 2.9 ms per call for 16 rows on the H200 host), so the routine is one call.
    Equals :func:`lightning_moe.model.layers.decode_attention` (the unfused reference) up to summation
    order: ~1e-7 in fp32, ~1e-2 relative in bf16.

    q: [B, Hq, hd] (any float dtype, on CPU); k, v: [B, Hkv, S, hd] CPU cache rows (the new token's k/v
    already written; positions past a row's length must hold finite values, as the zero-initialised caches
    do); lengths: int64 [B] valid positions per row, each in 1..S.
    Returns [B, Hq*hd] in q's dtype. Raises ValueError on mismatched shapes.
    """
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise ValueError(f"cpu_decode_attention: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} lengths={tuple(lengths.shape)}")
    B, Hq, hd = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"cpu_decode_attention: {Hq} query heads not a multiple of {Hkv} KV heads")
    if _native_ok(q, k, v):
        from ..kernels.cpu_attention import decode_attention_append

        out = torch.empty((B, Hq * hd), dtype=q.dtype)
        return decode_attention_append(q, None, None, torch.arange(B), k, v, lengths.to(torch.int64), out, sliding_window)
    S = bucket_len(int(lengths.max()), k.shape[2])
    pos = torch.arange(S)
    valid = pos[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:
        valid &= pos[None, :] >= (lengths[:, None] - sliding_window)
    out = F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, hd), k[:, :, :S], v[:, :, :S],
                                         attn_mask=valid[:, None, None, :])  # [B, Hkv, G, hd]
    return out.reshape(B, Hq * hd)


def _latent_native_ok(q_lat: torch.Tensor, lat: torch.Tensor) -> bool:
    """Whether the native MLA kernel (kernels.cpu_latent_attention) can run these operands: built and not disabled
    (``LIGHTNING_MOE_CPU_ATTENTION=sdpa`` selects the torch routine, as for GQA), a CPU latent cache of bf16 / fp16 /
    fp32 with q_lat's dtype, each position's elements contiguous and consecutive."""
    from ..kernels.cpu_attention import native_available

    return (lat.device.type == "cpu" and lat.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and q_lat.dtype == lat.dtype and q_lat.device.type == "cpu" and lat.dim() == 3
            and lat.stride(2) == 1 and lat.stride(1) == lat.shape[2]
            and (q_lat.shape[0] == 0 or q_lat[0].is_contiguous()) and native_available())


def cpu_latent_attention(q_lat: torch.Tensor, lat: torch.Tensor, lengths: torch.Tensor, kv_lora_rank: int,
                         scale: float, fallback: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
    """MLA decode attention over CPU latents (the new token's latent already written) in ONE call: the native kernel
    (kernels.cpu_latent_attention.latent_attention_append without an append: one pass over each valid latent row for
    all heads) when the operands fit it, else ``fallback(q_lat, lat, lengths)`` (the family's torch
    ``latent_attention`` with the spec bound). q_lat [B, Hq, Dl + rd]; lat [B, S, Dl + rd]; lengths int64 [B], each in
    1..S; ``scale`` the spec's softmax_scale. Returns the attention-weighted latents [B, Hq, kv_lora_rank]."""
    if _latent_native_ok(q_lat, lat):
        from ..kernels.cpu_latent_attention import latent_attention_append

        B, Hq = q_lat.shape[0], q_lat.shape[1]
        out = torch.empty((B, Hq, kv_lora_rank), dtype=q_lat.dtype)
        return latent_attention_append(q_lat, None, None, torch.arange(B), lat, lengths.to(torch.int64), out, scale)
    return fallback(q_lat, lat, lengths)
