"""KV caches: a ragged per-layer CPU cache for N sequences, and the same layout on the GPU.

Each layer holds K and V as ``[B, Hkv, S_max, hd]`` with S_max = the longest prompt + max_new_tokens
of the batch (sized exactly, allocated once), plus the per-sequence number of valid positions.
Rows are sequences; a row's positions beyond its length are never read (decode attention masks them).
"""

from __future__ import annotations

import torch

from ..model.spec import MoESpec


class KVCache:
    """Per-layer K/V storage for ``batch`` sequences on one device.

    Args:
        spec: model architecture (layers, KV heads, head dim).
        batch: number of sequences B.
        max_len: positions per sequence S_max (prompt + generated tokens).
        dtype: storage dtype (the model dtype).
        device: "cpu" (default; host memory) or a CUDA device for GPU-attention micro-batches.
        pin: page-lock the CPU storage (faster D2H/H2D of small slices); ignored on GPU.
    Memory: ``2 * L * B * Hkv * S_max * hd * itemsize`` bytes, see :attr:`nbytes`.
    """

    def __init__(self, spec: MoESpec, batch: int, max_len: int, dtype: torch.dtype, device="cpu", pin: bool = False):
        shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
        pin = pin and torch.device(device).type == "cpu" and torch.cuda.is_available()
        self.k = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(spec.num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.int64)  # valid positions per row (host tensor)
        self.max_len = max_len
        self.sliding_window = spec.sliding_window

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V storage."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's keys/values for ``row``: k, v [S, Hkv, hd] at positions 0..S-1."""
        S = k.shape[0]
        if S > self.max_len:
            raise ValueError(f"prompt of {S} tokens exceeds the cache's {self.max_len} positions")
        self.k[layer][row, :, :S] = k.transpose(0, 1).to(self.k[layer].device)
        self.v[layer][row, :, :S] = v.transpose(0, 1).to(self.v[layer].device)

    def append(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decode token per row: k, v [B', Hkv, hd] at position lengths[rows] (no length update)."""
        pos = self.lengths[rows]
        if int(pos.max()) >= self.max_len:
            raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
        dev = self.k[layer].device
        r, p = rows.to(dev), pos.to(dev)
        self.k[layer][r, :, p] = k.to(dev)
        self.v[layer][r, :, p] = v.to(dev)

    def view(self, layer: int, rows: torch.Tensor | None, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B', Hkv, upto, hd] for ``rows`` (all rows when None; a gather copy otherwise)."""
        k, v = self.k[layer][:, :, :upto], self.v[layer][:, :, :upto]
        if rows is None:
            return k, v
        r = rows.to(k.device)
        return k.index_select(0, r), v.index_select(0, r)
