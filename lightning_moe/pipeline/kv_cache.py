"""KV caches: a ragged per-layer CPU cache for N sequences, and the same layout on the GPU.

:class:`KVCache`: each layer holds K and V as ``[B, Hkv, S_max, hd]`` with S_max = the longest prompt +
max_new_tokens of the batch (sized exactly, allocated once), plus the per-sequence number of valid positions.
Rows are sequences; a row's positions beyond its length are never read (decode attention masks them).

:class:`GroupedKVCache` (CGOPipe's micro-batches): the rows are split into at most ``max_groups`` groups of
similar final length (policy/batching.length_groups, which minimises the padded positions), each
group one dense ``[B_g, Hkv, S_g, hd]`` tensor per layer sized for its own longest row; decode attention
runs once per group over that group's rows only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..model.spec import MoESpec
from ..kernels.cpu_attention import decode_mask, native_available, scatter_rows, scatter_rows_torch
from . import huge_pages
from .cpu_attention import bucket_len
from ..policy.batching import KV_GROUPS, length_groups


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
        r, p = rows.to(dev, non_blocking=True), pos.to(dev, non_blocking=True)  # no stream sync (see append)
        self.k[layer][r, :, p] = k.to(dev)
        self.v[layer][r, :, p] = v.to(dev)

    def view(self, layer: int, rows: torch.Tensor | None, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B', Hkv, upto, hd] for ``rows`` (all rows when None; a gather copy otherwise)."""
        k, v = self.k[layer][:, :, :upto], self.v[layer][:, :, :upto]
        if rows is None:
            return k, v
        r = rows.to(k.device, non_blocking=True)
        return k.index_select(0, r), v.index_select(0, r)


class LatentKVCache:
    """Per-layer MLA latent storage for ``batch`` sequences on one device (multi-head latent attention, DeepSeek).

    Each layer holds ``[B, S_max, kv_lora_rank + qk_rope_head_dim]``: per token the normed latent c and the rotated
    rope key k_pe, shared by every head (decode attends over it with the projections absorbed,
    ``Family.latent_attention``). The interface is :class:`KVCache`'s, with c and k_pe in place of k and v.
    Memory: ``L * B * S_max * (kv_lora_rank + qk_rope_head_dim) * itemsize`` bytes = ``B * S_max *
    spec.kv_bytes_per_token(dtype)`` (the planner's count), see :attr:`nbytes`.
    """

    def __init__(self, spec: MoESpec, batch: int, max_len: int, dtype: torch.dtype, device="cpu", pin: bool = False):
        if not spec.is_mla:
            raise ValueError(f"LatentKVCache: {spec.name} has no kv_lora_rank (not multi-head latent attention)")
        pin = pin and torch.device(device).type == "cpu" and torch.cuda.is_available()
        shape = (batch, max_len, spec.kv_lora_rank + spec.qk_rope_head_dim)
        self.lat = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(spec.num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.int64)  # valid positions per row (host tensor)
        self.max_len = max_len
        self.sliding_window = None

    @property
    def nbytes(self) -> int:
        """Bytes of all latent storage."""
        return sum(t.numel() * t.element_size() for t in self.lat)

    def write_prefill(self, layer: int, row: int, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store a prompt's latents for ``row``: c [S, kv_lora], k_pe [S, rope] at positions 0..S-1."""
        S = c.shape[0]
        if S > self.max_len:
            raise ValueError(f"prompt of {S} tokens exceeds the cache's {self.max_len} positions")
        dev = self.lat[layer].device
        self.lat[layer][row, :S] = torch.cat([c, k_pe], dim=-1).to(dev)

    def append(self, layer: int, rows: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append one decode token per row: c [B', kv_lora], k_pe [B', rope] at position lengths[rows] (no length
        update)."""
        pos = self.lengths[rows]
        if int(pos.max()) >= self.max_len:
            raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
        dev = self.lat[layer].device
        r, p = rows.to(dev, non_blocking=True), pos.to(dev, non_blocking=True)
        self.lat[layer][r, p] = torch.cat([c, k_pe], dim=-1).to(dev)

    def view(self, layer: int, rows: torch.Tensor | None, upto: int) -> torch.Tensor:
        """The latents [B', upto, kv_lora + rope] of ``rows`` (all rows when None; a gather copy otherwise)."""
        t = self.lat[layer][:, :upto]
        return t if rows is None else t.index_select(0, rows.to(t.device, non_blocking=True))


def make_kv_cache(spec: MoESpec, batch: int, max_len: int, dtype: torch.dtype, device="cpu", pin: bool = False):
    """The cache of the spec's attention: :class:`LatentKVCache` for MLA (``spec.is_mla``), else :class:`KVCache`."""
    cls = LatentKVCache if spec.is_mla else KVCache
    return cls(spec, batch, max_len, dtype, device, pin)


SPEC_WINDOW = object()  # GroupedKVCache.append_attend's default window: the spec's sliding_window (every layer)
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PrefillIndex(NamedTuple):
    """Where the tokens of a packed prefill chunk go in a :class:`GroupedKVCache` (or :class:`GroupedLatentKVCache`):
    rows of the layer's flat array, built once per chunk by :meth:`GroupedKVCache.prefill_index`, used by every
    layer."""

    tok: Optional[torch.Tensor]  # int64 [n]: the chunk's k / v row of each stored token, or None: token i is row i
    dst: torch.Tensor  # int64 [n, H]: each token's row of the flat array per KV head (GQA: hd-vectors, H = Hkv;
    #   MLA: positions, H = 1), on the cache's device


def scatter_prefill(dst: torch.Tensor, src: torch.Tensor, index: PrefillIndex) -> None:
    """``dst[index.dst[i, h]] = src[index.tok[i], h]``: dst [N, w] (rows of a layer's flat array), src [T, H, w] (a
    chunk's k / v). A CPU cache takes the native row scatter (kernels.cpu_attention.scatter_rows: one memcpy per row,
    all of torch's threads; ~12 GB/s on 2 cores against ~5 for the index_put per group it replaced), a GPU cache
    (or no native kernel) one torch index_put. k / v on another device or dtype are gathered where they are (``tok``
    lives there) and copied to the cache's once."""
    tok, n = index.tok, index.dst.shape[0]
    if src.device != dst.device or src.dtype != dst.dtype:
        src, tok = (src[:n] if tok is None else src.index_select(0, tok)).to(dst.device, dst.dtype), None
    if dst.device.type == "cpu" and native_available():
        scatter_rows(dst, src if src.stride(-1) == 1 else src.contiguous(), index.dst, tok)
    else:
        scatter_rows_torch(dst, src, index.dst, tok)


class GroupedKVCache:
    """Per-layer K/V storage for ``B`` sequences in length groups, on one device.

    The rows (the caller's sequences, numbered 0..B-1 in the caller's order) are grouped by final length
    with :func:`~lightning_moe.policy.batching.length_groups` (at most ``max_groups`` groups, least
    padded positions); group g stores K and V of each layer as ``[B_g, Hkv, S_g, hd]`` with S_g its longest
    final length (a group's slots hold its rows in ascending caller order); the groups of a layer are views of one
    flat array of hd-vectors (:attr:`k_flat`, :attr:`v_flat`; row r's block starts at vector ``row_base[r]`` and holds
    ``row_cap[r]`` positions per KV head), so one kernel can address them all (:meth:`append_attend_triton`). The interface is :class:`KVCache`'s as the pipelined executor uses it (:attr:`lengths`,
    :meth:`write_prefill`, :meth:`append`, :attr:`nbytes`), plus :meth:`attend`, which runs decode attention
    per group and returns rows in the caller's order.

    Args:
        spec: model architecture (layers, KV heads, head dim, sliding window).
        final_lengths: per row, the positions it will need (prompt length + max_new_tokens), ints >= 1.
        dtype: storage dtype (the model dtype).
        device: "cpu" (default; host memory) or a CUDA device for GPU-attention micro-batches.
        pin: page-lock the CPU storage; ignored on GPU or without CUDA.
        max_groups: the most groups (default KV_GROUPS = 8); 1 gives :class:`KVCache`'s single tensor.
    Memory: ``2 * L * Hkv * hd * itemsize * sum_g B_g * S_g`` bytes, see :attr:`nbytes`.
    Raises:
        ValueError: no rows, a final length < 1, or ``max_groups`` not a positive int.
    """

    def __init__(self, spec: MoESpec, final_lengths: Sequence[int], dtype: torch.dtype, device="cpu",
                 pin: bool = False, max_groups: int = KV_GROUPS):
        dev, pin = self._group_rows(final_lengths, device, pin, max_groups)
        L, Hkv, hd = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.num_kv_heads = Hkv
        # one flat array of hd-vectors per layer for K (and V): group g's block [B_g, Hkv, S_g, hd] from vector
        # group_base[g]; k[layer][g], v[layer][g] are views of it (one kernel can address every group:
        # append_attend_triton)
        blocks = [len(r) * Hkv * S for r, S in zip(self.rows, self.sizes)]  # hd-vectors per group
        group_base = [sum(blocks[:g]) for g in range(len(blocks))]
        self.k_flat = [self._storage(sum(blocks) * hd, dtype, dev, pin) for _ in range(L)]
        self.v_flat = [self._storage(sum(blocks) * hd, dtype, dev, pin) for _ in range(L)]
        self.k = [self._group_views(f, group_base, hd) for f in self.k_flat]  # k[layer][g]: [B_g, Hkv, S_g, hd]
        self.v = [self._group_views(f, group_base, hd) for f in self.v_flat]
        # per caller row: first hd-vector of its block and its capacity S_g (int64 [B], host; device copies lazily)
        B = self.lengths.shape[0]
        self.row_base = torch.empty(B, dtype=torch.int64)
        self.row_cap = torch.empty(B, dtype=torch.int64)
        for gi, (r, S) in enumerate(zip(self.rows, self.sizes)):
            self.row_base[r] = group_base[gi] + torch.arange(len(r)) * Hkv * S
            self.row_cap[r] = S
        self._row_meta_dev: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._head_base_dev: Optional[torch.Tensor] = None  # append_all's [B, Hkv] block starts, on the device
        self.sliding_window = spec.sliding_window

    @staticmethod
    def _storage(numel: int, dtype: torch.dtype, dev: torch.device, pin: bool) -> torch.Tensor:
        """One layer's zeroed flat storage: in host memory (not pinned) on transparent huge pages
        (pipeline.huge_pages: its first touch and page tables at tens of GB), else ``torch.zeros`` on ``dev``."""
        if dev.type == "cpu" and not pin:
            return huge_pages.zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=dev, pin_memory=pin)

    def _group_rows(self, final_lengths: Sequence[int], device, pin: bool, max_groups: int) -> tuple[torch.device, bool]:
        """The length groups of the rows and their indexes (shared by :class:`GroupedLatentKVCache`); returns the
        cache's device and whether to pin its storage."""
        lens = [int(x) for x in final_lengths]
        if not lens or min(lens) < 1:
            raise ValueError(f"{type(self).__name__}: need >= 1 row, each with a final length >= 1 (got {len(lens)} "
                             f"rows, min {min(lens) if lens else None})")
        groups = length_groups(lens, max_groups)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # compare equal to tensors' devices (cuda:i)
            dev = torch.device("cuda", torch.cuda.current_device())
        pin = pin and dev.type == "cpu" and torch.cuda.is_available()
        B = len(lens)
        self.device = dev
        self.sizes = [max(lens[r] for r in g) for g in groups]  # S_g per group
        # caller rows of each group (host), ascending: with one group the cache is in the caller's order
        self.rows = [torch.tensor(sorted(g), dtype=torch.int64) for g in groups]
        self._rows_dev = [r.to(dev) for r in self.rows]
        self._slots_dev = [torch.arange(len(r), device=dev) for r in self.rows]
        self._all = torch.arange(len(lens))
        self.group_of = torch.empty(B, dtype=torch.int64)  # row -> group
        self.slot_of = torch.empty(B, dtype=torch.int64)  # row -> index inside its group
        for gi, r in enumerate(self.rows):
            self.group_of[r] = gi
            self.slot_of[r] = torch.arange(len(r))
        self._identity = len(groups) == 1 and torch.equal(self.rows[0], torch.arange(B))  # one group, caller order
        self.lengths = torch.zeros(B, dtype=torch.int64)  # valid positions per row, caller order (host tensor)
        self.max_len = max(self.sizes)  # longest final length of any row
        # per-step caches, keyed by the lengths' values (the same for every layer of a decode step)
        self._group_lengths: Optional[tuple[list[int], list[torch.Tensor]]] = None  # group_lengths()
        # _plan(): (new lengths, per group (len_g on the device, upto_g), window -> per-group decode masks)
        self._attend_plan: Optional[tuple[list[int], list[tuple[torch.Tensor, int]], dict]] = None
        self._views: dict[tuple[int, int], tuple] = {}  # _upto(): (layer, g) -> (upto, the group's cut views)
        self._order_dev: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # _order(): per device
        return dev, pin

    def group_lengths(self) -> list[torch.Tensor]:
        """Per group g, its rows' :attr:`lengths` (host int64 [B_g], slot order): the native kernels' ``lengths``.
        Made once per decode step, not per layer: reused while :attr:`lengths` holds the same values (read-only)."""
        now = self.lengths.tolist()
        if self._group_lengths is None or self._group_lengths[0] != now:
            self._group_lengths = (now, [self.lengths[r] for r in self.rows])
        return self._group_lengths[1]

    def _plan(self, new_lengths: list[int]) -> tuple[list[int], list[tuple[torch.Tensor, int]], dict]:
        """The step plan of :meth:`attend` for ``new_lengths`` (host values, caller order): (the values, per group g
        (its rows' new lengths int64 [B_g] on the cache's device, upto_g = bucket_len(max, S_g)), a dict sliding window
        -> the groups' decode masks (:meth:`_masks`)). Made once per decode step, not per layer: reused while the
        lengths hold the same values, so a layer's attention copies no lengths to the device and reads none on the
        host."""
        if self._attend_plan is None or self._attend_plan[0] != new_lengths:
            now = torch.tensor(new_lengths, dtype=torch.int64)  # [B] host
            plan = []
            for rows, S in zip(self.rows, self.sizes):
                len_g = now[rows]  # [B_g] host
                upto = bucket_len(int(len_g.max()), S)
                plan.append((len_g.to(self.device, non_blocking=True), upto))  # pageable H2D: staged, no sync
            self._attend_plan = (new_lengths, plan, {})
        return self._attend_plan

    def _plan_of(self, new_lengths: torch.Tensor) -> tuple:
        """:meth:`_plan` of ``new_lengths`` int64 [B] (host). Raises ValueError if it does not have B rows."""
        if new_lengths.shape != (self.lengths.shape[0],):
            raise ValueError(f"{type(self).__name__}.attend: new_lengths {tuple(new_lengths.shape)} do not have the "
                             f"cache's {self.lengths.shape[0]} rows")
        return self._plan(new_lengths.tolist())

    def _masks(self, plan: tuple, sliding_window: Optional[int]) -> list[torch.Tensor]:
        """Per group g of ``plan`` (:meth:`_plan`): ``decode_mask(len_g, upto_g, sliding_window)``, bool
        [B_g, 1, 1, upto_g] on the cache's device. Made once per step and window (gpt-oss alternates two)."""
        masks = plan[2].get(sliding_window)
        if masks is None:
            masks = plan[2][sliding_window] = [decode_mask(n, upto, sliding_window) for n, upto in plan[1]]
        return masks

    def _upto(self, layer: int, g: int, upto: int) -> tuple:
        """Group g's cache of ``layer`` cut at ``upto`` positions (:meth:`_cut`), made when ``upto`` changes (every
        BUCKET positions), not every layer and step: a dict lookup in place of two slice ops."""
        hit = self._views.get((layer, g))
        if hit is None or hit[0] != upto:
            hit = self._views[(layer, g)] = (upto, self._cut(layer, g, upto))
        return hit[1]

    def _cut(self, layer: int, g: int, upto: int) -> tuple:
        """(K, V) of group g and ``layer`` cut at ``upto`` positions: [B_g, Hkv, upto, hd] views."""
        return self.k[layer][g][:, :, :upto], self.v[layer][g][:, :, :upto]

    def _order(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the caller rows in group order, each caller row's index in that order): int64 [B] each on ``device``."""
        hit = self._order_dev.get(device)
        if hit is None:
            perm = torch.cat(self.rows)  # [B] group order -> caller row
            hit = self._order_dev[device] = (perm.to(device, non_blocking=True),  # pageable H2D: staged, no sync
                                             torch.argsort(perm).to(device, non_blocking=True))
        return hit

    def _group_views(self, flat: torch.Tensor, group_base: list[int], hd: int) -> list[torch.Tensor]:
        """Group g's ``[B_g, Hkv, S_g, hd]`` view of one layer's flat array (contiguous)."""
        Hkv = self.num_kv_heads
        return [flat[b * hd: (b + len(r) * Hkv * S) * hd].view(len(r), Hkv, S, hd)
                for b, r, S in zip(group_base, self.rows, self.sizes)]

    @property
    def num_groups(self) -> int:
        """Number of length groups."""
        return len(self.rows)

    @property
    def padded_positions(self) -> int:
        """sum_g B_g * S_g: positions allocated per layer for K (and as many for V)."""
        return sum(len(r) * S for r, S in zip(self.rows, self.sizes))

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V storage."""
        return sum(t.numel() * t.element_size() for layer in self.k + self.v for t in layer)

    def write_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's keys/values for caller row ``row``: k, v [S, Hkv, hd] at positions 0..S-1.

        Raises ValueError if S exceeds the row's group size S_g.
        """
        g, slot = int(self.group_of[row]), int(self.slot_of[row])
        S = k.shape[0]
        if S > self.sizes[g]:
            raise ValueError(f"prompt of {S} tokens exceeds row {row}'s cache of {self.sizes[g]} positions")
        self.k[layer][g][slot, :, :S] = k.transpose(0, 1).to(self.device)
        self.v[layer][g][slot, :, :S] = v.transpose(0, 1).to(self.device)

    def prefill_index(self, rows: Sequence[int], spans: Sequence[tuple[int, int]], device=None) -> PrefillIndex:
        """Scatter index of one packed prefill chunk, for :meth:`write_prefill_index` (built once, used by every layer).

        Args:
            rows: caller rows of the chunk, one per sequence, distinct; ``rows[j]``'s prompt tokens are ``spans[j]``.
            spans: (start, end) of each sequence in the chunk's packed token dim T (its positions 0..end-start-1).
            device: where the chunk's k / v will be (the token index goes there); default the cache's device.
        Returns:
            :class:`PrefillIndex`: per stored token (the spans' tokens in order) its row of the packed chunk (``tok``
            on ``device``; None when the spans are 0..n-1 in order) and its rows of a layer's flat array (``dst``
            [n, H] on the cache's device: :meth:`_flat_rows`), for every length group at once.
        Raises:
            ValueError: ``rows`` and ``spans`` differ in length, a row repeats, a span is empty, or a prompt is longer
            than its row's group (S_g).
        """
        if len(rows) != len(spans):
            raise ValueError(f"GroupedKVCache.prefill_index: {len(rows)} rows but {len(spans)} spans")
        if len(set(rows)) != len(rows):
            raise ValueError(f"GroupedKVCache.prefill_index: a row repeats in {list(rows)}")
        lens = torch.tensor([e - s for s, e in spans], dtype=torch.int64)  # [J]
        if len(spans) and int(lens.min()) < 1:
            raise ValueError(f"GroupedKVCache.prefill_index: empty span in {list(spans)}")
        r = torch.as_tensor(list(rows), dtype=torch.int64)  # [J]
        too_long = lens > self.row_cap[r]
        if bool(too_long.any()):
            j = int(too_long.nonzero()[0])
            raise ValueError(f"prompt of {int(lens[j])} tokens exceeds row {int(r[j])}'s cache of "
                             f"{int(self.row_cap[r[j]])} positions")
        seq = torch.repeat_interleave(torch.arange(len(spans)), lens)  # [n] sequence j of each packed token
        tok = torch.cat([torch.arange(s, e) for s, e in spans]) if len(spans) else torch.zeros(0, dtype=torch.int64)
        pos = tok - torch.tensor([s for s, _ in spans], dtype=torch.int64)[seq]  # [n] position in its own prompt
        dst = self._flat_rows(r[seq], pos)  # [n, H]
        tok_dev = torch.device(device) if device is not None else self.device
        same = torch.equal(tok, torch.arange(tok.shape[0]))  # the spans are the chunk's rows 0..n-1 in order
        # host index tensors to the device without a stream sync (pageable H2D: staged, no sync)
        return PrefillIndex(None if same else tok.to(tok_dev, non_blocking=True),
                            dst.to(self.device, non_blocking=True))

    def _head_base(self, r: torch.Tensor) -> torch.Tensor:
        """The first hd-vector of each (caller row in ``r``, KV head) block of a layer's :attr:`k_flat` /
        :attr:`v_flat`: int64 [n, Hkv] (row_base[r] + h * row_cap[r]; host)."""
        heads = torch.arange(self.num_kv_heads, dtype=torch.int64)  # [Hkv]
        return self.row_base[r][:, None] + heads[None, :] * self.row_cap[r][:, None]

    def _flat_rows(self, r: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The hd-vectors of caller rows ``r`` at positions ``pos`` (int64 [n] each, host) in a layer's
        :attr:`k_flat` / :attr:`v_flat`, per KV head: int64 [n, Hkv]."""
        return self._head_base(r) + pos[:, None]

    def write_prefill_index(self, layer: int, index: PrefillIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a packed prefill chunk's keys/values: k, v [T, Hkv, hd], scattered by :meth:`prefill_index` into
        every length group at once: one row scatter per K and V of whole hd-vectors into the layer's flat arrays
        (:func:`scatter_prefill`; native on a CPU cache). Equal to :meth:`write_prefill` per sequence. Raises ValueError on
        mismatched shapes."""
        hd = self.k[layer][0].shape[-1]
        scatter_prefill(self.k_flat[layer].view(-1, hd), k, index)
        scatter_prefill(self.v_flat[layer].view(-1, hd), v, index)

    def append(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decode token per row: k, v [B', Hkv, hd] for caller rows ``rows`` (int64 [B']), each at
        position lengths[row] (no length update). ``rows`` = all rows in order is the common (fast) case.
        Raises ValueError if a row's group is full."""
        for g, sel, slots, p in self._append_parts(rows, k.device):
            self.k[layer][g][slots, :, p] = k.index_select(0, sel).to(self.device)
            self.v[layer][g][slots, :, p] = v.index_select(0, sel).to(self.device)

    def append_all(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """:meth:`append` of every row in the caller's order, as one scatter per K and V into the layer's flat arrays
        (no per-group index, copy or host read of the positions): k, v [B, Hkv, hd] on the cache's device, ``pos``
        int64 [B] on that device, each row's position (equal to :attr:`lengths`: CGOPipe's ``MicroBatch.pos``).
        Raises ValueError if a row is full (checked on the host lengths)."""
        if bool((self.lengths >= self.row_cap).any()):
            raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
        if self._head_base_dev is None:  # [B, Hkv] first hd-vector of each (row, KV head) block
            self._head_base_dev = self._head_base(torch.arange(self.row_base.shape[0])).to(self.device)
        idx = self._head_base_dev + pos[:, None]  # [B, Hkv] hd-vector of each (row, head)'s new position
        hd = k.shape[-1]
        self.k_flat[layer].view(-1, hd)[idx] = k
        self.v_flat[layer].view(-1, hd)[idx] = v

    def _append_parts(self, rows: torch.Tensor, src: torch.device) -> list:
        """Per group g holding some of ``rows``: (g, the rows' indexes into the appended tensors (on ``src``), their
        slots and positions in group g (on the cache's device)). Raises ValueError if a row's group is full."""
        rows = rows.cpu()
        if rows.shape[0] == self.lengths.shape[0] and torch.equal(rows, self._all):  # every row, caller order
            on_dev = src == self.device
            parts = [(g, self._rows_dev[g] if on_dev else self.rows[g], self._slots_dev[g], self.lengths[self.rows[g]])
                     for g in range(self.num_groups)]
        else:
            groups = self.group_of[rows]
            parts = []
            for g in torch.unique(groups).tolist():
                sel = (groups == g).nonzero().flatten()
                parts.append((g, sel, self.slot_of[rows[sel]].to(self.device, non_blocking=True), self.lengths[rows[sel]]))
        out = []
        for g, sel, slots, pos in parts:
            if int(pos.max()) >= self.sizes[g]:
                raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
            # host index tensors to the device without a stream sync (a blocking copy of a pageable tensor waits for
            # the GPU; CUDA stages a pageable source before the call returns, so non_blocking is safe)
            out.append((g, sel.to(src, non_blocking=True), slots, pos.to(self.device, non_blocking=True)))
        return out

    def append_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: Optional[torch.Tensor] = None, sliding_window=SPEC_WINDOW,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """CPU decode step of one layer for every row: append k/v at position lengths[row], attend over lengths + 1
        positions (no length update), output rows in the caller's order.

        One native call over all groups (kernels.cpu_attention.decode_attention_append_groups: append and attention
        in one pass, output rows written straight into ``out``) when the kernel is available for these operands; else
        :meth:`append` + :meth:`attend` with ``pipeline.cpu_attention.cpu_decode_attention``.
        q [B, Hq, hd], k / v [B, Hkv, hd] in the cache dtype on the CPU; ``out`` [B, Hq*hd] (e.g. pinned) or None
        (allocated); ``sliding_window``: the layer's window (``MoESpec.layer_sliding_window``; None: full attention;
        default the spec's ``sliding_window``, :attr:`sliding_window`); ``sinks``: None, or the layer's fp32 [Hq]
        attention sinks (gpt-oss; without the native kernel: kernels.cpu_attention.decode_attention_torch per group).
        Returns ``out``. Raises ValueError on a full row or mismatched shapes.
        """
        from .cpu_attention import _native_ok, cpu_decode_attention

        sw = self.sliding_window if sliding_window is SPEC_WINDOW else sliding_window
        B = self.lengths.shape[0]
        if q.shape[0] != B or k.shape[0] != B or v.shape[0] != B:
            raise ValueError(f"GroupedKVCache.append_attend: q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} "
                             f"do not have the cache's {B} rows")
        if out is None:
            out = torch.empty((B, q.shape[1] * q.shape[2]), dtype=q.dtype)
        if self.device.type == "cpu" and _native_ok(q, self.k[layer][0], self.v[layer][0]) and k.dtype == q.dtype:
            from ..kernels.cpu_attention import decode_attention_append_groups

            # one native call for all groups (one parallel region, longest rows first)
            return decode_attention_append_groups(q, k, v, self.rows, self.k[layer], self.v[layer],
                                                  self.group_lengths(), out, sw, sinks=sinks)
        self.append(layer, torch.arange(B), k, v)
        if sinks is None:
            attend = lambda qg, K, V, n: cpu_decode_attention(qg, K, V, n, sw)  # noqa: E731
        else:
            from ..kernels.cpu_attention import decode_attention_torch

            attend = lambda qg, K, V, n: decode_attention_torch(qg, K, V, n, sw, sinks)  # noqa: E731
        out.copy_(self.attend(layer, q, self.lengths + 1, attend))
        return out

    def append_attend_triton(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             pos: torch.Tensor, sliding_window=SPEC_WINDOW,
                             sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """GPU decode step of one layer for every row in ONE kernel launch (kernels.decode_attention): append k/v at
        position lengths[row], attend over lengths + 1 positions (no length update), rows in the caller's order.

        Same result as :meth:`append` + :meth:`attend` with ``model.layers.decode_attention`` (fp32: to rounding;
        bf16: ~1e-2 relative, the kernel keeps scores in fp32), without a torch op per length group.
        q [B, Hq, hd], k / v [B, Hkv, hd] on the cache's device; ``pos`` int64 [B] on that device: the rows'
        positions, equal to :attr:`lengths` (CGOPipe's ``MicroBatch.pos``; no host-to-device copy per layer);
        ``sliding_window`` as in :meth:`append_attend`; ``sinks`` None or the layer's fp32 [Hq] sink logits on the
        device (gpt-oss). Returns [B, Hq*hd]. Raises ValueError if a row is full (checked on the host lengths) or on a
        shape mismatch.
        """
        from ..kernels.decode_attention import decode_append_attention_triton

        if bool((self.lengths >= self.row_cap).any()):
            raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
        if self._row_meta_dev is None:
            self._row_meta_dev = (self.row_base.to(self.device), self.row_cap.to(self.device))
        base, cap = self._row_meta_dev
        sw = self.sliding_window if sliding_window is SPEC_WINDOW else sliding_window
        return decode_append_attention_triton(q, k, v, self.k_flat[layer], self.v_flat[layer], base, cap, pos, sw,
                                              sinks=sinks)

    def attend(self, layer: int, q: torch.Tensor, new_lengths: torch.Tensor, fn: AttendFn) -> torch.Tensor:
        """Decode attention of every row, group by group, back in the caller's row order.

        For each group g: ``fn(q_g, K_g[:, :, :upto_g], V_g[:, :, :upto_g], len_g)`` with q_g = q's rows of
        the group [B_g, Hq, hd] (on q's device), K_g, V_g the group's cache [B_g, Hkv, upto_g, hd] (views),
        len_g int64 [B_g] on the cache's device (made once per decode step: :meth:`_plan`) and upto_g =
        bucket_len(max(len_g), S_g); ``fn`` returns [B_g, Hq*hd]
        (e.g. ``cpu_decode_attention`` or ``model.layers.decode_attention`` with the sliding window bound).

        Args:
            layer: decoder layer.
            q: [B, Hq, hd] queries in the caller's row order (any float dtype, on the cache's device).
            new_lengths: int64 [B] (host), valid positions per row including the new token (the
                new token's k/v already appended), each in 1..S_g of its row's group.
        Returns:
            [B, Hq*hd] in ``fn``'s output dtype, on ``fn``'s output device, rows in the caller's order.
        Raises:
            ValueError: q or new_lengths do not have B rows.
        """
        plan = self._plan_of(new_lengths)
        return self._attend_groups(q, plan[1], lambda g, qg, upto, n: fn(qg, *self._upto(layer, g, upto), n))

    def attend_masked(self, layer: int, q: torch.Tensor, fn: Callable, sliding_window=SPEC_WINDOW) -> torch.Tensor:
        """:meth:`attend` over :attr:`lengths` + 1 positions (the new token's k/v appended) with the per-group mask made
        once per decode step: ``fn(q_g, K_g, V_g, masked_g)`` with masked_g = ``decode_mask(len_g, upto_g, window)``
        bool [B_g, 1, 1, upto_g] on the cache's device (e.g. the family's ``decode_attention_masked``, bit for bit
        ``decode_attention`` over len_g). q [B, Hq, hd] in the caller's order on the cache's device;
        ``sliding_window`` the layer's window (default the spec's). Returns [B, Hq*hd] in the caller's order."""
        sw = self.sliding_window if sliding_window is SPEC_WINDOW else sliding_window
        plan = self._plan([n + 1 for n in self.lengths.tolist()])
        masks = self._masks(plan, sw)
        return self._attend_groups(q, plan[1], lambda g, qg, upto, n: fn(qg, *self._upto(layer, g, upto), masks[g]))

    def _attend_groups(self, q: torch.Tensor, plan: list[tuple[torch.Tensor, int]], fn_g: Callable) -> torch.Tensor:
        """:meth:`attend`'s loop over the groups of ``plan`` (:meth:`_plan`): ``fn_g(g, q_g, upto_g, len_g)`` per
        group (q_g gathered: a fresh tensor, as the attention always had), the outputs concatenated in group order
        and put back in the caller's order by one gather (one call over every row when one group holds them in
        order)."""
        B = self.lengths.shape[0]
        if q.shape[0] != B:
            raise ValueError(f"{type(self).__name__}.attend: q {tuple(q.shape)} does not have the cache's {B} rows")
        if self._identity:
            return fn_g(0, q, plan[0][1], plan[0][0])
        on_dev = q.device == self.device
        outs = [fn_g(g, q.index_select(0, self._rows_dev[g] if on_dev else rows.to(q.device)), upto, len_g)
                for g, (rows, (len_g, upto)) in enumerate(zip(self.rows, plan))]  # [B_g, ...] each
        out = torch.cat(outs)  # [B, ...] group order
        return out.index_select(0, self._order(out.device)[1])  # caller order


LatentAttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GroupedLatentKVCache(GroupedKVCache):
    """:class:`GroupedKVCache`'s length groups holding MLA latents (multi-head latent attention, DeepSeek; CGOPipe's
    micro-batches): group g stores ``[B_g, S_g, kv_lora_rank + qk_rope_head_dim]`` per layer, per token the normed
    latent c and the rotated rope key k_pe (:class:`LatentKVCache`'s layout), with c and k_pe in place of k and v;
    the groups of a layer are views of one flat array of positions (:attr:`lat_flat`; row r's block starts at
    position ``row_base[r]`` and holds ``row_cap[r]``), so one scatter appends to all of them (:meth:`append_all`).
    The rows, groups, :meth:`prefill_index` and :attr:`lengths` are GroupedKVCache's; attention takes the family's
    ``latent_attention`` (the absorbed query in, the attention-weighted latents out), or on the CPU the native kernel
    (:meth:`append_attend`); no Triton kernel.

    Memory: ``L * (kv_lora_rank + qk_rope_head_dim) * itemsize * sum_g B_g * S_g`` bytes = ``padded_positions *
    spec.kv_bytes_per_token(dtype)`` (the planner's count per position), see :attr:`nbytes`.
    Raises:
        ValueError: the spec is not MLA, no rows, a final length < 1, or ``max_groups`` not a positive int.
    """

    def __init__(self, spec: MoESpec, final_lengths: Sequence[int], dtype: torch.dtype, device="cpu",
                 pin: bool = False, max_groups: int = KV_GROUPS):
        if not spec.is_mla:
            raise ValueError(f"GroupedLatentKVCache: {spec.name} has no kv_lora_rank (not multi-head latent attention)")
        dev, pin = self._group_rows(final_lengths, device, pin, max_groups)
        W = self.width = spec.kv_lora_rank + spec.qk_rope_head_dim  # elements of one position
        self.kv_lora_rank, self.softmax_scale = spec.kv_lora_rank, spec.softmax_scale  # the native kernel's arguments
        # one flat array of W-vectors (positions) per layer: group g's block [B_g, S_g, W] from position group_base[g],
        # lat[layer][g] a view of it (one scatter appends to every group: append_all)
        blocks = [len(r) * S for r, S in zip(self.rows, self.sizes)]  # positions per group
        group_base = [sum(blocks[:g]) for g in range(len(blocks))]
        self.lat_flat = [self._storage(sum(blocks) * W, dtype, dev, pin) for _ in range(spec.num_layers)]
        self.lat = [[f[b * W: (b + n) * W].view(len(r), S, W) for b, n, r, S in zip(group_base, blocks, self.rows,
                                                                                   self.sizes)]
                    for f in self.lat_flat]  # lat[layer][g]: [B_g, S_g, W]
        # per caller row: first position of its block and its capacity S_g (int64 [B], host; the base's device copy
        # lazily)
        self.row_base = torch.empty(self.lengths.shape[0], dtype=torch.int64)
        self.row_cap = torch.empty(self.lengths.shape[0], dtype=torch.int64)
        for gi, (r, S) in enumerate(zip(self.rows, self.sizes)):
            self.row_base[r] = group_base[gi] + torch.arange(len(r)) * S
            self.row_cap[r] = S
        self._row_base_dev: Optional[torch.Tensor] = None
        self.sliding_window = None

    @property
    def nbytes(self) -> int:
        """Bytes of all latent storage (the flat arrays; the groups' views partition them)."""
        return sum(f.numel() * f.element_size() for f in self.lat_flat)

    def write_prefill(self, layer: int, row: int, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store a prompt's latents for caller row ``row``: c [S, kv_lora], k_pe [S, rope] at positions 0..S-1.
        Raises ValueError if S exceeds the row's group size S_g."""
        g, slot = int(self.group_of[row]), int(self.slot_of[row])
        S = c.shape[0]
        if S > self.sizes[g]:
            raise ValueError(f"prompt of {S} tokens exceeds row {row}'s cache of {self.sizes[g]} positions")
        self.lat[layer][g][slot, :S] = torch.cat([c, k_pe], dim=-1).to(self.device)

    def _flat_rows(self, r: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The positions of caller rows ``r`` at ``pos`` (int64 [n] each, host) in a layer's :attr:`lat_flat`:
        int64 [n, 1] (row_base[r] + pos)."""
        return (self.row_base[r] + pos)[:, None]

    def write_prefill_index(self, layer: int, index: PrefillIndex, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store a packed prefill chunk's latents: c [T, kv_lora], k_pe [T, rope], scattered by :meth:`prefill_index`
        into every length group at once: one row scatter each into the columns of the layer's flat array
        (:func:`scatter_prefill`; native on a CPU cache, no concatenation). Equal to :meth:`write_prefill` per sequence.
        Raises ValueError on mismatched shapes."""
        lat, Dl = self.lat_flat[layer].view(-1, self.width), self.kv_lora_rank  # [positions, kv_lora + rope]
        scatter_prefill(lat[:, :Dl], c[:, None], index)  # [T, 1, kv_lora] into columns :Dl
        scatter_prefill(lat[:, Dl:], k_pe[:, None], index)  # [T, 1, rope] into columns Dl:

    def append(self, layer: int, rows: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append one decode token per row: c [B', kv_lora], k_pe [B', rope] for caller rows ``rows`` (int64 [B']),
        each at position lengths[row] (no length update). Raises ValueError if a row's group is full."""
        lat = torch.cat([c, k_pe], dim=-1)  # [B', kv_lora + rope]
        for g, sel, slots, p in self._append_parts(rows, lat.device):
            self.lat[layer][g][slots, p] = lat.index_select(0, sel).to(self.device)

    def append_all(self, layer: int, c: torch.Tensor, k_pe: torch.Tensor, pos: torch.Tensor) -> None:
        """:meth:`append` of every row in the caller's order, as one scatter into the layer's flat array (no per-group
        index, copy or host read of the positions): c [B, kv_lora], k_pe [B, rope] on the cache's device, ``pos``
        int64 [B] on that device, each row's position (equal to :attr:`lengths`: CGOPipe's ``MicroBatch.pos``).
        Raises ValueError if a row is full (checked on the host lengths)."""
        if bool((self.lengths >= self.row_cap).any()):
            raise ValueError("KV cache full: a sequence is longer than the cache was sized for")
        if self._row_base_dev is None:
            self._row_base_dev = self.row_base.to(self.device)  # [B] first position of each row's block
        lat = torch.cat([c, k_pe], dim=-1)  # [B, W] (a mismatched width fails the index_put's shape check)
        self.lat_flat[layer].view(-1, self.width)[self._row_base_dev + pos] = lat  # row r at row_base[r] + pos[r]

    def attend(self, layer: int, q_lat: torch.Tensor, new_lengths: torch.Tensor, fn: LatentAttendFn) -> torch.Tensor:
        """Latent decode attention of every row, group by group, back in the caller's row order: per group
        ``fn(q_g, lat_g[:, :upto_g], len_g)`` (the family's ``latent_attention`` with the spec bound) with q_g the
        group's rows of q_lat [B_g, Hq, kv_lora + rope], lat_g its latents [B_g, upto_g, kv_lora + rope] (a view) and
        len_g int64 [B_g] on the cache's device. Returns [B, Hq, kv_lora] (``fn``'s output rows in the caller's order)."""
        plan = self._plan_of(new_lengths)
        return self._attend_groups(q_lat, plan[1], lambda g, qg, upto, n: fn(qg, *self._upto(layer, g, upto), n))

    def _cut(self, layer: int, g: int, upto: int) -> tuple:
        """(the latents of group g and ``layer`` cut at ``upto`` positions: a [B_g, upto, kv_lora + rope] view,)."""
        return (self.lat[layer][g][:, :upto],)

    def append_attend(self, layer: int, q_lat: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, fn: LatentAttendFn,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode step of one layer for every row: append c / k_pe at position lengths[row], attend over lengths + 1
        positions (no length update), into ``out`` [B, Hq, kv_lora] (e.g. pinned) or a new tensor.

        One native call over all groups (kernels.cpu_latent_attention.latent_attention_append_groups: append and
        attention in one pass, the spec's softmax_scale, output rows straight into ``out``) when the kernel is
        available for these operands (pipeline.cpu_attention._latent_native_ok); else :meth:`append` +
        :meth:`attend` with ``fn`` (the family's torch ``latent_attention``). q_lat [B, Hq, kv_lora + rope],
        c [B, kv_lora], k_pe [B, rope] on the cache's device. Returns ``out``. Raises ValueError on a full row or
        mismatched shapes."""
        from .cpu_attention import _latent_native_ok

        B = self.lengths.shape[0]
        if q_lat.shape[0] != B or c.shape[0] != B or k_pe.shape[0] != B:
            raise ValueError(f"GroupedLatentKVCache.append_attend: q_lat {tuple(q_lat.shape)} / c {tuple(c.shape)} / "
                             f"k_pe {tuple(k_pe.shape)} do not have the cache's {B} rows")
        if c.dtype == k_pe.dtype == q_lat.dtype and (out is None or out.dtype == q_lat.dtype) \
                and _latent_native_ok(q_lat, self.lat[layer][0]):
            from ..kernels.cpu_latent_attention import latent_attention_append_groups

            if out is None:
                out = torch.empty((B, q_lat.shape[1], self.kv_lora_rank), dtype=q_lat.dtype)
            return latent_attention_append_groups(q_lat, c, k_pe, self.rows, self.lat[layer],
                                                  self.group_lengths(), out, self.softmax_scale)
        self.append(layer, self._all, c, k_pe)
        o = self.attend(layer, q_lat, self.lengths + 1, fn)  # [B, Hq, kv_lora]
        if out is None:
            return o
        out.copy_(o)
        return out

    def append_attend_triton(self, *args, **kwargs):
        raise NotImplementedError("GroupedLatentKVCache: no Triton decode kernel for multi-head latent attention")
