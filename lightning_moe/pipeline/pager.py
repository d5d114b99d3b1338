"""Expert weight pages: one exact-size pinned host pool -> two GPU page buffers, with events.

MoE-Lightning's CGOPipe (arXiv 2411.11217, Sec. 4.1, "weights paging") keeps the expert weights that
do not fit on the GPU in pinned CPU memory and sends the next layer's experts to the GPU while the
current layer computes: layer l+1's experts are cut into n pages and one page is sent per micro-batch
slot, interleaved with the small activation transfers, into the second of two GPU buffers. Pages of
one size for every layer (padding the last page of a layer) follow CommitMoE's fixed-slot expert pool.

Pieces, in the order the executor uses them:

* :class:`ExpertPaging` -- which experts are resident on the GPU (the policy's set of ``(layer,
  expert)``), how the others are grouped into pages, and where every expert of a layer lives.
* :func:`pool_page_layout` -- a :class:`~lightning_moe.kernels.pages.PageLayout` of ``experts_per_page`` whole
  experts: the named tensors inside one page (name, dtype, shape, byte offset), the same for every page;
  :func:`~lightning_moe.kernels.pages.views` reinterprets a ``uint8`` page (host or GPU) as those tensors, no copy.
* :class:`HostPagePool` -- ONE exact-size host buffer holding every page of every layer, pinned with
  ``cudaHostRegister`` (see below), carved into pages of ``layout.page_bytes`` bytes.
* :class:`GpuPageBuffers` -- two GPU buffers, each holding one layer's pages, with a CUDA event per
  page slot (recorded on the h2d stream after that page's copy) and a "compute done" event per buffer
  (recorded on the compute stream after the last kernel that reads it). Inside a GPU buffer the pages
  are stored *by tensor*: every page's ``w1`` rows side by side, then every page's ``w3`` rows, ... so
  :meth:`GpuPageBuffers.expert_weights` gives contiguous stacked ``[E_nonres, F, D]`` tensors for
  the grouped expert FFN. A page copy is therefore ``len(layout.entries)`` contiguous copies.
* :class:`ResidentExperts` -- the policy's resident experts, stored on the GPU for the whole run.
* :class:`LayerExperts` -- one layer's full expert set assembled from resident + paged storage
  (expert id -> (paged?, row)).

Why ``cudaHostRegister`` and not ``pin_memory=True`` (DESIGN.md, host pool paragraph): PyTorch's
pinned (caching host) allocator rounds every request up to a power of two, so an 80 GiB pool would
take 128 GiB; registering one exact-size pageable tensor took 4.6 s for 80 GiB on the H200 host and
gave 55 GB/s host-to-device for 2.8 GB pages anywhere in it.

On ``device='cpu'`` the same API works with synchronous copies and no streams or events (the CPU
test of the pipelined executor runs on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from ..kernels.pages import ALIGN, PageLayout, TensorSpec, views

FFN_NAMES = ("w1", "w3", "w2")  # gate [F, D], up [F, D], down [D, F] (HF layout: out x in)


def _align(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def ffn_expert_specs(intermediate_size: int, hidden_size: int, dtype: torch.dtype,
                     bias: bool = False) -> list[TensorSpec]:
    """Per-expert tensors of a SwiGLU expert: ``w1 [F, D]`` (gate), ``w3 [F, D]`` (up), ``w2 [D, F]`` (down); with
    ``bias`` (experts that carry biases, ``MoESpec.expert_bias``: gpt-oss) also ``b1 [F]``, ``b3 [F]``, ``b2 [D]``."""
    F, D = int(intermediate_size), int(hidden_size)
    specs = [("w1", dtype, (F, D)), ("w3", dtype, (F, D)), ("w2", dtype, (D, F))]
    if bias:
        specs += [("b1", dtype, (F,)), ("b3", dtype, (F,)), ("b2", dtype, (D,))]
    return specs


def pool_page_layout(experts_per_page: int, expert_specs: Sequence[TensorSpec]) -> PageLayout:
    """Layout of a pool page holding ``experts_per_page`` whole experts (entries at 256-byte aligned offsets).

    Args:
        experts_per_page: experts per page (``ExpertPaging.experts_per_page``, >= 1).
        expert_specs: ``(name, dtype, per-expert shape)``, e.g. :func:`ffn_expert_specs`; packed (quantized)
            experts are one ``("page", uint8, (page_bytes,))`` tensor here (the executor's weight stream).

    Returns:
        A layout with entries ``name: dtype [experts_per_page, *per-expert shape]``.

    Raises:
        ValueError: ``experts_per_page < 1`` or an invalid spec.
    """
    if experts_per_page < 1:
        raise ValueError(f"experts_per_page must be >= 1, got {experts_per_page}")
    return PageLayout.build([(n, dt, (experts_per_page, *shape)) for n, dt, shape in expert_specs])


# --------------------------------------------------------------------------------------------------
# Which experts are paged, and where each expert lives
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertSlot:
    """Where one expert of a layer lives on the GPU."""

    paged: bool  # True: in the layer's GPU page buffer; False: in ResidentExperts
    index: int  # row in the stacked paged tensors ([E_nonres, ...]) or the resident ones ([E_res, ...])


@dataclass(frozen=True)
class ExpertPaging:
    """The split of every layer's experts into GPU-resident ones and pages of non-resident ones.

    A layer's non-resident experts (ascending id) are cut into pages of ``experts_per_page`` whole
    experts, ``experts_per_page = ceil(max_nonresident / n_pages)`` taken over all layers so every
    page of every layer has one size; a layer's last page may be partly padding. A layer has
    ``ceil(nonresident / experts_per_page)`` pages (at most ``n_pages``; fewer when a layer has fewer
    non-resident experts, or when there are fewer experts than requested pages). The non-resident
    expert of rank ``j`` in its layer sits in page ``j // experts_per_page``, row ``j %
    experts_per_page``, and at row ``j`` of the stacked GPU views.
    """

    num_layers: int  # decoder layers
    num_experts: int  # routed experts per MoE layer
    n_pages: int  # requested pages per layer (CGOPipe: one per micro-batch slot, so the policy's n)
    resident: frozenset = field(default_factory=frozenset)  # (layer, expert) pairs kept on the GPU
    dense_layers: frozenset = field(default_factory=frozenset)  # layers without routed experts (MoESpec.dense_layers):
    #   no resident experts, no pages, an empty index map

    def __post_init__(self) -> None:
        for k in ("num_layers", "num_experts", "n_pages"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ExpertPaging.{k} must be an int >= 1, got {v!r}")
        res = frozenset((int(l), int(e)) for l, e in self.resident)
        dense = frozenset(int(l) for l in self.dense_layers)
        if any(not 0 <= l < self.num_layers for l in dense):
            raise ValueError(f"dense layers {sorted(dense)} outside {self.num_layers} layers")
        for l, e in res:
            if not (0 <= l < self.num_layers and 0 <= e < self.num_experts) or l in dense:
                raise ValueError(f"resident expert (layer {l}, expert {e}) outside {self.num_layers} layers x {self.num_experts} experts"
                                 + (" (a dense layer has no experts)" if l in dense else ""))
        object.__setattr__(self, "resident", res)
        object.__setattr__(self, "dense_layers", dense)

    @cached_property
    def _split(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        out = []
        for l in range(self.num_layers):
            if l in self.dense_layers:  # no routed experts at all
                out.append(((), ()))
                continue
            res = tuple(e for e in range(self.num_experts) if (l, e) in self.resident)
            non = tuple(e for e in range(self.num_experts) if (l, e) not in self.resident)
            out.append((res, non))
        return tuple(out)

    def resident_experts(self, layer: int) -> tuple[int, ...]:
        """Expert ids of ``layer`` resident on the GPU, ascending."""
        return self._split[layer][0]

    def nonresident(self, layer: int) -> tuple[int, ...]:
        """Expert ids of ``layer`` kept in the host pool and paged in, ascending."""
        return self._split[layer][1]

    @property
    def max_nonresident(self) -> int:
        """Most non-resident experts in any layer (dense layers have none)."""
        return max(len(self.nonresident(l)) for l in range(self.num_layers))

    @property
    def experts_per_page(self) -> int:
        """Whole experts per page: ``ceil(max_nonresident / n_pages)`` (0 when every expert is resident)."""
        return -(-self.max_nonresident // self.n_pages)

    def layer_pages(self, layer: int) -> int:
        """Pages of ``layer``: ``ceil(nonresident(layer) / experts_per_page)`` (0 if all resident)."""
        epp = self.experts_per_page
        return -(-len(self.nonresident(layer)) // epp) if epp else 0

    @property
    def pages_per_layer(self) -> tuple[int, ...]:
        """``layer_pages(l)`` for every layer."""
        return tuple(self.layer_pages(l) for l in range(self.num_layers))

    def page_experts(self, layer: int, page: int) -> tuple[int, ...]:
        """Expert ids in ``page`` of ``layer`` (row order; fewer than ``experts_per_page`` for a padded page).

        Raises:
            IndexError: no such page.
        """
        if not 0 <= page < self.layer_pages(layer):
            raise IndexError(f"layer {layer} has {self.layer_pages(layer)} pages, no page {page}")
        epp = self.experts_per_page
        return self.nonresident(layer)[page * epp : (page + 1) * epp]

    @cached_property
    def _maps(self) -> tuple[tuple[ExpertSlot, ...], ...]:
        maps = []
        for l in range(self.num_layers):
            if l in self.dense_layers:
                maps.append(())
                continue
            slots: list[Optional[ExpertSlot]] = [None] * self.num_experts
            for i, e in enumerate(self.resident_experts(l)):
                slots[e] = ExpertSlot(False, i)
            for j, e in enumerate(self.nonresident(l)):
                slots[e] = ExpertSlot(True, j)
            maps.append(tuple(slots))
        return tuple(maps)

    def index_map(self, layer: int) -> tuple[ExpertSlot, ...]:
        """``index_map(layer)[e]``: where expert ``e`` of ``layer`` lives (length ``num_experts``; empty for a dense
        layer)."""
        return self._maps[layer]

    def locate(self, layer: int, expert: int) -> tuple[int, int]:
        """``(page, row)`` of a non-resident expert in the host pool.

        Raises:
            KeyError: the expert is resident.
        """
        s = self._maps[layer][expert]
        if not s.paged:
            raise KeyError(f"expert {expert} of layer {layer} is resident, it has no page")
        epp = self.experts_per_page
        return s.index // epp, s.index % epp

    def index_tensors(self, layer: int, device: Union[str, torch.device] = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The index map as tensors: ``(is_paged bool [E], row int64 [E])`` on ``device`` (cached)."""
        key = (layer, str(torch.device(device)))
        cache = self._tensor_cache
        if key not in cache:
            m = self._maps[layer]
            is_paged = torch.tensor([s.paged for s in m], dtype=torch.bool).to(device)
            row = torch.tensor([s.index for s in m], dtype=torch.int64).to(device)
            cache[key] = (is_paged, row)
        return cache[key]

    @cached_property
    def _tensor_cache(self) -> dict:
        return {}


def tiling_page_count(max_nonresident: int, slots: int) -> int:
    """Pages per layer that tile a layer's ``max_nonresident`` paged experts exactly: the smallest divisor of it that is
    >= min(slots, max_nonresident) (1 when nothing is paged). With that many pages the two GPU page buffers hold
    exactly ``max_nonresident`` experts each (``ceil(m / slots)`` experts per page would round a buffer up to
    ``pages * experts_per_page``, e.g. 9 experts for 8 paged ones over 3 slots); :func:`page_schedule` spreads the
    pages over the slots.

    Raises ValueError for ``max_nonresident < 0`` or ``slots < 1``."""
    if max_nonresident < 0 or slots < 1:
        raise ValueError(f"tiling_page_count needs max_nonresident >= 0 and slots >= 1, got {max_nonresident}, {slots}")
    if max_nonresident == 0:
        return 1
    want = min(slots, max_nonresident)
    return next(d for d in range(want, max_nonresident + 1) if max_nonresident % d == 0)


def page_schedule(num_pages: int, num_slots: int) -> list[range]:
    """Spread ``num_pages`` pages over ``num_slots`` micro-batch slots as evenly as possible.

    Slot ``k`` gets pages ``range(k*P//S, (k+1)*P//S)``; with fewer pages than slots some slots get an
    empty range. CGOPipe sends the pages of layer l+1 this way, one group per micro-batch of layer l.

    Raises:
        ValueError: ``num_pages < 0`` or ``num_slots < 1``.
    """
    if num_pages < 0 or num_slots < 1:
        raise ValueError(f"page_schedule needs num_pages >= 0 and num_slots >= 1, got {num_pages}, {num_slots}")
    return [range(k * num_pages // num_slots, (k + 1) * num_pages // num_slots) for k in range(num_slots)]


def _get(obj: Any, name: str) -> torch.Tensor:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def _rows_of(w: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``w[ids]``: a slice (no copy) when the ids are consecutive."""
    if list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return w[ids[0] : ids[0] + len(ids)]
    return w[torch.tensor(list(ids), dtype=torch.int64, device=w.device)]


# --------------------------------------------------------------------------------------------------
# Host pool
# --------------------------------------------------------------------------------------------------
class HostPagePool:
    """One exact-size host buffer holding every page of every layer, pinned with ``cudaHostRegister``.

    Layer ``l``'s pages are consecutive: page ``(l, i)`` is bytes ``[(start_l + i) * page_bytes, ... +
    page_bytes)`` of :attr:`buffer`, ``start_l = sum(pages_per_layer[:l])``.

    Args:
        layout: the layout of every page.
        pages_per_layer: pages of each layer (0 for a layer with no paged tensors).
        pin: register the buffer with CUDA (``cudaHostRegister``, flags 0) so host-to-device copies
            from it are asynchronous DMA. ``None``: pin when CUDA is available.
        paging: the expert paging the pages came from (enables :meth:`fill_experts`,
            :meth:`write_expert` and :meth:`GpuPageBuffers.layer_experts`); see :meth:`for_experts`.

    Attributes:
        buffer: ``uint8 [nbytes]`` on the CPU.
        nbytes: exact bytes of the pool, ``sum(pages_per_layer) * layout.page_bytes``.
        registered: whether the buffer is currently registered with CUDA.

    Raises:
        ValueError: a negative page count.
        RuntimeError: ``pin=True`` without CUDA, or ``cudaHostRegister`` failed (message has the
            CUDA error string and the byte count).

    Use ``with HostPagePool(...) as pool:`` or call :meth:`close` to unregister; ``__del__`` does it too.
    """

    def __init__(
        self,
        layout: PageLayout,
        pages_per_layer: Sequence[int],
        pin: Optional[bool] = None,
        paging: Optional[ExpertPaging] = None,
    ) -> None:
        self.layout = layout
        self.pages_per_layer = tuple(int(p) for p in pages_per_layer)
        if any(p < 0 for p in self.pages_per_layer):
            raise ValueError(f"negative page count in pages_per_layer={self.pages_per_layer}")
        self.paging = paging
        self._start = [0]
        for p in self.pages_per_layer:
            self._start.append(self._start[-1] + p)
        self.num_pages = self._start[-1]
        self.page_bytes = layout.page_bytes
        self.nbytes = self.num_pages * self.page_bytes
        self.registered = False
        self.register_rc: Optional[int] = None  # cudaHostRegister's return code (0 = success)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            self._register()

    @classmethod
    def for_experts(cls, paging: ExpertPaging, expert_specs: Sequence[TensorSpec], pin: Optional[bool] = None) -> "HostPagePool":
        """Pool for ``paging``'s non-resident experts with per-expert tensors ``expert_specs``.

        Example: ``HostPagePool.for_experts(paging, ffn_expert_specs(F, D, torch.bfloat16))``; fill it
        with :meth:`fill_experts` or, streaming from a checkpoint, :meth:`write_expert`.
        """
        layout = pool_page_layout(max(paging.experts_per_page, 1), expert_specs)
        return cls(layout, paging.pages_per_layer, pin=pin, paging=paging)

    # ---- pinning -------------------------------------------------------------------------------
    def pin(self) -> None:
        """Register the buffer with CUDA now (after filling it: registering faults in every page of the buffer,
        so a pool pinned before the host copies it takes are released holds both at once). Idempotent."""
        if not self.registered:
            self._register()

    def _register(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("HostPagePool(pin=True) needs CUDA, and torch.cuda.is_available() is False")
        if self.nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
        code = int(rc)
        self.register_rc = code
        if code != 0:
            try:
                msg = cudart.cudaGetErrorString(rc)
            except Exception:  # pragma: no cover - message lookup only
                msg = "CUDA error"
            raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte expert page pool failed: {msg} ({code})")
        self.registered = True

    def close(self) -> None:
        """Unregister the buffer from CUDA (after ``torch.cuda.synchronize()``, so no copy from it is
        in flight). Idempotent. The buffer stays valid as ordinary pageable memory.

        Raises:
            RuntimeError: ``cudaHostUnregister`` failed.
        """
        if not self.registered:
            return
        self.registered = False
        torch.cuda.synchronize()
        rc = torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostUnregister of the expert page pool failed ({int(rc)})")

    def __enter__(self) -> "HostPagePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass

    # ---- pages ---------------------------------------------------------------------------------
    def page_index(self, layer: int, idx: int) -> int:
        """Global page number of page ``idx`` of ``layer``. Raises IndexError if there is no such page."""
        if not 0 <= layer < len(self.pages_per_layer):
            raise IndexError(f"no layer {layer} in the page pool ({len(self.pages_per_layer)} layers)")
        if not 0 <= idx < self.pages_per_layer[layer]:
            raise IndexError(f"layer {layer} has {self.pages_per_layer[layer]} pages, no page {idx}")
        return self._start[layer] + idx

    def page(self, layer: int, idx: int) -> torch.Tensor:
        """Page ``idx`` of ``layer``: a ``uint8 [page_bytes]`` view of the pool (no copy)."""
        g = self.page_index(layer, idx)
        return self.buffer[g * self.page_bytes : (g + 1) * self.page_bytes]

    def page_views(self, layer: int, idx: int) -> dict[str, torch.Tensor]:
        """The named tensors of a page: :func:`views` of :meth:`page`."""
        return views(self.page(layer, idx), self.layout)

    @property
    def max_pages_per_layer(self) -> int:
        """Most pages of any layer (the page capacity a GPU buffer needs)."""
        return max(self.pages_per_layer, default=0)

    # ---- filling -------------------------------------------------------------------------------
    def write_rows(self, layer: int, idx: int, name: str, tensor: torch.Tensor, row: int = 0) -> None:
        """Copy ``tensor`` into entry ``name`` of a page, starting at leading-dimension row ``row``.

        Args:
            tensor: ``entry.dtype [r, *entry.shape[1:]]`` with ``row + r <= entry.rows``, any device.

        Raises:
            ValueError: wrong dtype or shape, or rows out of range.
        """
        e = self.layout.entry(name)
        if tensor.dtype != e.dtype:
            raise ValueError(f"page tensor {name!r}: dtype {tensor.dtype}, layout has {e.dtype}")
        if tensor.dim() != len(e.shape) or tuple(tensor.shape[1:]) != e.shape[1:] or not 0 <= row <= row + tensor.shape[0] <= e.rows:
            raise ValueError(
                f"page tensor {name!r}: shape {tuple(tensor.shape)} at row {row} does not fit {e.shape} "
                f"(need [r, {', '.join(map(str, e.shape[1:]))}] with row + r <= {e.rows})"
            )
        if tensor.numel() == 0:
            return
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        start = self.page_index(layer, idx) * self.page_bytes + e.offset + row * e.row_bytes
        self.buffer[start : start + src.numel()].copy_(src)

    def write_page(
        self, layer: int, idx: int, tensors: Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor]]
    ) -> None:
        """Copy the page's tensors' bytes into page ``idx`` of ``layer``; padding bytes become zero.

        Args:
            tensors: one tensor per layout entry, in layout order (or a mapping by name with exactly the
                layout's names); each ``entry.dtype [r, *entry.shape[1:]]`` with ``r <= entry.rows``
                (fewer rows: a layer's last, partly padded page; the missing rows are zeroed).

        Raises:
            ValueError: wrong number/names of tensors, dtype or shape.
            IndexError: no such page.
        """
        if isinstance(tensors, Mapping):
            if set(tensors) != set(self.layout.names):
                raise ValueError(f"write_page needs tensors {list(self.layout.names)}, got {list(tensors)}")
            items = [(e, tensors[e.name]) for e in self.layout.entries]
        else:
            tensors = list(tensors)
            if len(tensors) != len(self.layout.entries):
                raise ValueError(f"write_page needs {len(self.layout.entries)} tensors {list(self.layout.names)}, got {len(tensors)}")
            items = list(zip(self.layout.entries, tensors))
        base = self.page_index(layer, idx) * self.page_bytes
        page = self.buffer[base : base + self.page_bytes]
        for e, t in items:
            self.write_rows(layer, idx, e.name, t, 0)
        # zero the padding: missing rows, alignment gaps between entries and at the page end
        ends = [e.offset for e in self.layout.entries[1:]] + [self.page_bytes]
        for (e, t), end in zip(items, ends):
            page[e.offset + t.shape[0] * e.row_bytes : end].zero_()

    def _need_paging(self) -> ExpertPaging:
        if self.paging is None:
            raise RuntimeError("this HostPagePool was built without an ExpertPaging (use HostPagePool.for_experts)")
        return self.paging

    def fill_experts(self, experts: Sequence[Any]) -> None:
        """Write every page from per-layer expert weights.

        Args:
            experts: ``experts[l]`` has, for every layout entry name, a tensor ``[E, *per-expert shape]``
                as an attribute or a mapping key (e.g. ``ExpertWeights(w1 [E,F,D], w3 [E,F,D],
                w2 [E,D,F])``), of the layout's dtype, on any device.

        Raises:
            RuntimeError: the pool has no paging. ValueError: dtype/shape mismatch.
        """
        paging = self._need_paging()
        for l in range(paging.num_layers):
            for p in range(paging.layer_pages(l)):
                ids = paging.page_experts(l, p)
                self.write_page(l, p, {n: _rows_of(_get(experts[l], n), ids) for n in self.layout.names})

    def write_expert(
        self, layer: int, expert: int, tensors: Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor]]
    ) -> None:
        """Write one non-resident expert's tensors (``[*per-expert shape]`` each, no expert dim) into its
        page row; for streaming a checkpoint into the pool expert by expert. Padding rows of a layer's
        last page are left as they are (``torch.empty``: unspecified bytes, never read by routing).

        Raises:
            KeyError: the expert is resident. ValueError: dtype/shape mismatch, wrong names/count.
        """
        page, row = self._need_paging().locate(layer, expert)
        if isinstance(tensors, Mapping):
            if set(tensors) != set(self.layout.names):
                raise ValueError(f"write_expert needs tensors {list(self.layout.names)}, got {list(tensors)}")
            items = [(n, tensors[n]) for n in self.layout.names]
        else:
            tensors = list(tensors)
            if len(tensors) != len(self.layout.entries):
                raise ValueError(f"write_expert needs {len(self.layout.entries)} tensors {list(self.layout.names)}, got {len(tensors)}")
            items = list(zip(self.layout.names, tensors))
        for n, t in items:
            self.write_rows(layer, page, n, t.unsqueeze(0), row)


# --------------------------------------------------------------------------------------------------
# GPU double buffer
# --------------------------------------------------------------------------------------------------
class GpuPageBuffers:
    """Two (``n_buffers``) device buffers, each holding one layer's pages, with copy and compute events.

    Inside a buffer the pages are stored by tensor: region ``name`` (256-byte aligned start) holds
    ``capacity_pages * entry.rows`` rows of ``name`` back to back, page ``p``'s rows at rows ``[p*rows,
    (p+1)*rows)``. So :meth:`expert_weights` is a contiguous ``[E_nonres, *per-expert shape]`` view per
    tensor, with the non-resident expert of rank ``j`` at row ``j`` (``ExpertSlot.index``).

    Protocol per buffer ``b`` (the executor alternates ``b`` over the layers it visits, continuing
    across decode steps -- not ``layer % 2``, which breaks at a step boundary with an odd layer count):

    1. ``prefetch_layer(l, b, h2d_stream, page_range)`` one or more times: ``h2d`` first waits for
       ``b``'s compute-done event, then copies each page (non_blocking) and records that page's event.
       Pages of ``l`` already in ``b`` (and not overwritten since) are skipped, so with few layers and
       two buffers nothing is re-sent.
    2. ``wait_layer(l, b, compute_stream)``: the compute stream waits for the events of all of ``l``'s
       pages; returns the stacked views. Raises if some page of ``l`` was never prefetched into ``b``.
    3. launch every kernel that reads the views on ``compute_stream``, then
       ``compute_done(b, compute_stream)``: records ``b``'s compute-done event. A prefetch of another
       layer into ``b`` between 2 and 3 raises RuntimeError instead of racing.

    On ``device='cpu'`` copies are synchronous and streams/events are ignored (may be ``None``).

    Args:
        pool: the host pool to copy from.
        device: ``'cuda'``/``'cuda:i'`` or ``'cpu'``.
        n_buffers: buffers (2 = double buffering).

    Attributes:
        buffers: ``n_buffers`` tensors ``uint8 [buffer_bytes]`` on ``device``.
        buffer_bytes: bytes of one buffer, ``sum over entries of align256(capacity_pages * entry.nbytes)``
            (at most ``capacity_pages * page_bytes``).
        nbytes: exact device bytes of all buffers, ``n_buffers * buffer_bytes``.

    Raises:
        ValueError: ``device`` is neither CPU nor CUDA, or ``n_buffers < 1``.
    """

    def __init__(self, pool: HostPagePool, device: Union[str, torch.device] = "cuda", n_buffers: int = 2) -> None:
        self.pool = pool
        self.layout = pool.layout
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"GpuPageBuffers supports cpu and cuda devices, got {self.device}")
        if n_buffers < 1:
            raise ValueError(f"n_buffers must be >= 1, got {n_buffers}")
        self.n_buffers = n_buffers
        self.capacity_pages = pool.max_pages_per_layer
        self._cuda = self.device.type == "cuda"
        self._region: dict[str, int] = {}
        off = 0
        for e in self.layout.entries:
            self._region[e.name] = off
            off = _align(off + self.capacity_pages * e.nbytes)
        self.buffer_bytes = off
        self.nbytes = n_buffers * off
        self.buffers = [torch.empty(off, dtype=torch.uint8, device=self.device) for _ in range(n_buffers)]
        self._full_views = [self._stacked(buf) for buf in self.buffers]
        if self._cuda:
            self._page_events = [[torch.cuda.Event() for _ in range(self.capacity_pages)] for _ in range(n_buffers)]
            self._done_events = [torch.cuda.Event() for _ in range(n_buffers)]
        self._layer: list[Optional[int]] = [None] * n_buffers  # layer whose pages the buffer holds/receives
        self._held: list[set[int]] = [set() for _ in range(n_buffers)]  # pages of that layer issued into it
        self._reading: list[Optional[int]] = [None] * n_buffers  # layer being computed from it
        self._streams_seen: set[int] = set()

    def _stacked(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.layout.entries:
            start = self._region[e.name]
            rows = self.capacity_pages * e.rows
            out[e.name] = buf[start : start + self.capacity_pages * e.nbytes].view(e.dtype).view(rows, *e.shape[1:])
        return out

    def _check_buffer(self, b: int) -> None:
        if not 0 <= b < self.n_buffers:
            raise IndexError(f"buffer index {b} outside 0..{self.n_buffers - 1}")

    def prefetch_layer(
        self,
        layer: int,
        buffer_idx: int,
        stream: Optional["torch.cuda.Stream"] = None,
        page_range: Optional[Iterable[int]] = None,
        force: bool = False,
    ) -> int:
        """Copy pages of ``layer`` from the host pool into buffer ``buffer_idx``.

        On CUDA the copies are ``non_blocking`` on ``stream`` (default: the current stream), issued
        after ``stream.wait_event(compute-done event of the buffer)``; each page's event is recorded on
        ``stream`` after its copies. On CPU the copies are synchronous.

        Args:
            layer: layer whose pages to send.
            buffer_idx: destination buffer.
            stream: the h2d stream (CUDA only).
            page_range: pages of the layer to send (default: all), e.g. one slot of :func:`page_schedule`.
            force: copy even pages the buffer already holds for this layer.

        Returns:
            Bytes issued, ``pages copied * layout.payload_bytes`` (0 when every requested page was
            already there).

        Raises:
            IndexError: bad buffer index or page number.
            RuntimeError: the buffer is being read by another layer's compute (``wait_layer`` was called
                and ``compute_done`` not yet), or ``force`` while this layer's compute reads it.
        """
        self._check_buffer(buffer_idx)
        n = self.pool.pages_per_layer[layer]
        pages = range(n) if page_range is None else list(page_range)
        for p in pages:
            if not 0 <= p < n:
                raise IndexError(f"layer {layer} has {n} pages, no page {p}")
        reading = self._reading[buffer_idx]
        if reading is not None and (reading != layer or force):
            raise RuntimeError(
                f"buffer {buffer_idx} is still read by layer {reading}'s compute: call "
                f"compute_done({buffer_idx}, compute_stream) before prefetching layer {layer} into it"
            )
        if self._layer[buffer_idx] != layer:
            self._layer[buffer_idx] = layer
            self._held[buffer_idx] = set()
        held = self._held[buffer_idx]
        todo = [p for p in pages if force or p not in held]
        if not todo:
            return 0
        buf = self.buffers[buffer_idx]
        if self._cuda:
            if stream is None:
                stream = torch.cuda.current_stream(self.device)
            if stream.cuda_stream not in self._streams_seen:  # keep the allocator from reusing buf early
                self._streams_seen.add(stream.cuda_stream)
                for bb in self.buffers:
                    bb.record_stream(stream)
            stream.wait_event(self._done_events[buffer_idx])
            with torch.cuda.stream(stream):
                for p in todo:
                    self._copy_page(layer, p, buf, non_blocking=True)
                    self._page_events[buffer_idx][p].record(stream)
        else:
            for p in todo:
                self._copy_page(layer, p, buf, non_blocking=False)
        held.update(todo)
        return len(todo) * self.layout.payload_bytes

    def _copy_page(self, layer: int, p: int, buf: torch.Tensor, non_blocking: bool) -> None:
        src = self.pool.page(layer, p)
        for e in self.layout.entries:
            dst0 = self._region[e.name] + p * e.nbytes
            buf[dst0 : dst0 + e.nbytes].copy_(src[e.offset : e.offset + e.nbytes], non_blocking=non_blocking)

    def wait_layer(
        self, layer: int, buffer_idx: int, compute_stream: Optional["torch.cuda.Stream"] = None
    ) -> dict[str, torch.Tensor]:
        """Make ``compute_stream`` wait until every page of ``layer`` has landed in ``buffer_idx``.

        Marks the buffer as read by ``layer`` until :meth:`compute_done`.

        Returns:
            :meth:`expert_weights`\\ ``(buffer_idx)``.

        Raises:
            RuntimeError: some page of ``layer`` was never prefetched into this buffer.
        """
        self._check_buffer(buffer_idx)
        n = self.pool.pages_per_layer[layer]
        if n:
            missing = sorted(set(range(n)) - self._held[buffer_idx]) if self._layer[buffer_idx] == layer else list(range(n))
            if missing:
                raise RuntimeError(f"pages {missing} of layer {layer} were never prefetched into buffer {buffer_idx}")
            if self._cuda:
                if compute_stream is None:
                    compute_stream = torch.cuda.current_stream(self.device)
                for p in range(n):
                    compute_stream.wait_event(self._page_events[buffer_idx][p])
        self._reading[buffer_idx] = layer
        return self.expert_weights(buffer_idx, layer)

    def compute_done(self, buffer_idx: int, compute_stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Record that every kernel reading ``buffer_idx`` has been launched on ``compute_stream``.

        Call after the last kernel that reads the layer's views; a later prefetch into the buffer
        waits for this point on the GPU.
        """
        self._check_buffer(buffer_idx)
        if self._cuda:
            if compute_stream is None:
                compute_stream = torch.cuda.current_stream(self.device)
            self._done_events[buffer_idx].record(compute_stream)
        self._reading[buffer_idx] = None

    def expert_weights(self, buffer_idx: int, layer: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Stacked views of a buffer: ``{name: dtype [rows, *per-expert shape]}``, contiguous, no copy.

        ``rows`` = the layer's non-resident experts when the pool has an :class:`ExpertPaging` (row
        ``j`` = non-resident expert of rank ``j``), else its pages * rows per page; ``layer``
        defaults to the buffer's current layer (no layer yet: full capacity).
        E.g. ``w1 [E_nonres, F, D]``, ``w3 [E_nonres, F, D]``, ``w2 [E_nonres, D, F]``.
        """
        self._check_buffer(buffer_idx)
        full = self._full_views[buffer_idx]
        layer = self._layer[buffer_idx] if layer is None else layer
        if layer is None:
            return dict(full)
        if self.pool.paging is not None:
            rows = len(self.pool.paging.nonresident(layer))
            return {n: v[:rows] for n, v in full.items()}
        n = self.pool.pages_per_layer[layer]
        return {e.name: full[e.name][: n * e.rows] for e in self.layout.entries}

    def layer_experts(self, layer: int, buffer_idx: int, resident: Optional["ResidentExperts"] = None) -> "LayerExperts":
        """Layer ``layer``'s full expert set: paged views of ``buffer_idx`` + ``resident``'s tensors.

        Does not wait: call :meth:`wait_layer` (on the stream that will read) first.

        Raises:
            RuntimeError: the pool has no ExpertPaging, or ``layer`` has resident experts and
                ``resident`` is None.
        """
        paging = self.pool._need_paging()
        if resident is None:
            if paging.resident_experts(layer):
                raise RuntimeError(f"layer {layer} has resident experts: pass the ResidentExperts")
            res = {e.name: v[:0] for e, v in zip(self.layout.entries, self._full_views[buffer_idx].values())}
        else:
            res = resident.layer(layer)
        return LayerExperts(layer, res, self.expert_weights(buffer_idx, layer), paging)


# --------------------------------------------------------------------------------------------------
# Resident experts and the assembled per-layer expert set
# --------------------------------------------------------------------------------------------------
class ResidentExperts:
    """The policy's resident experts, copied to ``device`` once and kept there.

    Args:
        paging: which experts are resident.
        experts: ``experts[l]`` has tensors ``[E, *per-expert shape]`` named ``names`` (attributes or
            mapping keys), e.g. ``ExpertWeights(w1, w3, w2)``; None for a dense layer (``paging.dense_layers``).
            None: no layer yet; give them one at a time with :meth:`add_layer`.
        device: where to keep them.
        names: tensor names to keep (default ``("w1", "w3", "w2")``).
    """

    def __init__(
        self, paging: ExpertPaging, experts: Optional[Sequence[Any]], device: Union[str, torch.device] = "cuda",
        names: Sequence[str] = FFN_NAMES
    ) -> None:
        self.paging = paging
        self.device = torch.device(device)
        self.names = tuple(names)
        self._layers: list[dict[str, torch.Tensor]] = [{} for _ in range(paging.num_layers)]
        if experts is not None:
            for l in range(paging.num_layers):
                self.add_layer(l, experts[l])

    def add_layer(self, layer: int, experts: Any) -> None:
        """Copy ``layer``'s resident experts (rows of ``experts``, as in the constructor; None for a dense layer) to
        the device, replacing what the layer had."""
        ids = self.paging.resident_experts(layer)
        if experts is None:  # a dense layer: no routed experts
            self._layers[layer] = {}
            return
        d = {}
        for n in self.names:
            w = _get(experts, n)
            rows = _rows_of(w, ids) if ids else w[:0]
            d[n] = rows.to(self.device, copy=True).contiguous()
        self._layers[layer] = d

    @property
    def nbytes(self) -> int:
        """Exact bytes of all resident tensors on the device."""
        return sum(t.numel() * t.element_size() for d in self._layers for t in d.values())

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """``{name: [E_res(layer), *per-expert shape]}`` on the device, row ``i`` = i-th resident expert."""
        return self._layers[layer]


@dataclass
class LayerExperts:
    """One layer's experts on the device: resident tensors + paged views, and where each expert is."""

    layer: int  # decoder layer
    resident: dict[str, torch.Tensor]  # name -> [E_res, *per-expert shape]
    paged: dict[str, torch.Tensor]  # name -> [E_nonres, *per-expert shape] (views of a page buffer)
    paging: ExpertPaging  # the split (index_map(layer)[e] = ExpertSlot(paged, row))

    @property
    def index_map(self) -> tuple[ExpertSlot, ...]:
        """``index_map[e]``: (paged?, row) of expert ``e``."""
        return self.paging.index_map(self.layer)

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s tensors ``{name: [*per-expert shape]}`` (views)."""
        s = self.index_map[e]
        src = self.paged if s.paged else self.resident
        return {n: v[s.index] for n, v in src.items()}

    def stacked(self) -> dict[str, torch.Tensor]:
        """All experts stacked in id order ``{name: [E, *per-expert shape]}`` (a copy; reference/tests)."""
        per = [self.expert(e) for e in range(self.paging.num_experts)]
        return {n: torch.stack([p[n] for p in per]) for n in per[0]}
