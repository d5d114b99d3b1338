"""CGOPipe's weight stream: the experts' way from host memory to the GPU, one layer visit at a time.

The pieces of :mod:`~lightning_moe.pipeline.pager`, put together for an executor:

* the resident experts (the policy's ``(layer, expert)`` set) copied to the device once
  (:class:`~lightning_moe.pipeline.pager.ResidentExperts`);
* every other expert in ONE exact-size host pool (pinned with ``cudaHostRegister`` on CUDA), cut into pages of
  whole experts so a layer's paged experts tile the pages exactly (:func:`~lightning_moe.pipeline.pager.
  tiling_page_count`); the host copies are released layer by layer as the pool takes them, so host memory holds
  each expert once;
* two GPU page buffers (:class:`~lightning_moe.pipeline.pager.GpuPageBuffers`) the layer visits alternate over.

A *visit* is one pass over one layer (prefill or a decode step): visit ``v`` is layer ``v % L`` in buffer ``v % 2``,
counted across steps. During visit ``v`` the executor issues visit ``v + 1``'s pages on the weight stream's own
CUDA stream, in slots (:meth:`WeightStream.prefetch_slot`: decode one slot per micro-batch, right after that
micro-batch's attention result is on its way; prefill all at once), while ``v`` computes. The compute stream waits
for a visit's pages only before its first expert FFN (:meth:`WeightStream.wait_pages`), and the next copy into a
buffer waits for the compute that read it (:meth:`WeightStream.end_visit`).

Quantized checkpoints (:class:`~lightning_moe.model.quantized.QuantExperts`) stay packed: the pool, the page
buffers and the resident experts hold one ``uint8 [page_bytes]`` page per expert (pool tensor ``"page"``), so pages
cross PCIe as packed bytes and are dequantized on the device (:mod:`~lightning_moe.pipeline.expert_ffn`). On the
CPU the same calls run with synchronous copies and no streams or events.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..kernels.quant import ExpertPageLayout
from ..model.quantized import QuantExperts
from ..model.weights import ExpertsOnDisk
from ..model.spec import MoESpec
from ..policy.policy import Policy
from .pager import (ExpertPaging, GpuPageBuffers, HostPagePool, LayerExperts, ResidentExperts, ffn_expert_specs,
                    page_schedule, tiling_page_count)
from .stage_stats import StageTimer

PAGE = "page"  # pool tensor of packed (quantized) experts: one uint8 [page_bytes] page per expert


def packed_layout(experts: Sequence) -> Optional[ExpertPageLayout]:
    """The page layout shared by every MoE layer's :class:`QuantExperts` (read, or :class:`ExpertsOnDisk` that will
    read as such), or None for dense (unpacked) experts.

    Raises:
        ValueError: some layers packed and others dense, or layers with different page layouts.
    """
    experts = [e for e in experts if e is not None]  # dense (MLP-only) layers have no experts
    of = [e.layout if isinstance(e, (QuantExperts, ExpertsOnDisk)) else None for e in experts]
    layouts = {lay for lay in of if lay is not None}
    if not layouts:
        return None
    if len(layouts) > 1 or None in of:
        raise ValueError("cgopipe: every layer's experts must be packed pages of one layout "
                         f"(got {len(layouts)} layouts, unpacked experts mixed in: {None in of})")
    return layouts.pop()


class WeightStream:
    """The experts of every layer: resident on the device, or paged from the host pool through two GPU buffers.

    Args:
        experts: per layer, :class:`ExpertWeights` or :class:`QuantExperts` (host), None for a dense layer of
            ``spec.dense_layers`` (no routed experts: no pages, its visits copy nothing); consumed: each entry is set
            to None once the pool holds that layer.
        spec: the model's numbers (layers, experts, sizes).
        policy: the resident experts (``resident_counts``, or explicit ``(layer, expert)`` pairs) and n, the slots
            a layer's pages are issued in.
        device: the compute device.
        dtype: the compute dtype (dense experts are cast to it).
        compute: the compute stream (None on the CPU).
        timer: stage times (``h2d_copy``, ``wait_h2d``).
        count_h2d: called with the bytes of every page copy issued (the executor's ``RunStats.h2d_bytes``).

    Attributes:
        paging, pool, resident, buffers: the pager's pieces; page_layout: packed pages' layout (None: dense);
        h2d: the weight stream's CUDA stream (None on the CPU); visit: the visit now running (or next).
    """

    def __init__(self, experts: list, spec: MoESpec, policy: Policy, device: torch.device, dtype: torch.dtype,
                 compute, timer: StageTimer, count_h2d: Callable[[int], None]):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.cuda = device.type == "cuda"
        self.compute, self.timer, self.count_h2d = compute, timer, count_h2d
        self.h2d = torch.cuda.Stream(device) if self.cuda else None  # expert pages
        counts = policy.resident_counts(spec)
        resident = frozenset((l, e) for l in range(spec.num_layers) for e in range(counts[l]))
        if isinstance(policy.resident_experts, tuple) and policy.resident_experts and isinstance(policy.resident_experts[0], tuple):
            resident = frozenset(policy.resident_experts)
        dense = frozenset(spec.dense_layers)  # layers without routed experts: nothing resident, nothing paged
        paged = ExpertPaging(spec.num_layers, spec.num_experts, 1, resident, dense).max_nonresident
        pages = tiling_page_count(paged, max(1, policy.n))  # buffers hold exactly the most paged experts of a layer
        self.paging = ExpertPaging(spec.num_layers, spec.num_experts, pages, resident, dense)
        self.page_layout = packed_layout(experts)  # kernels.quant layout of packed pages, or None (dense)
        if self.page_layout is None:
            specs = ffn_expert_specs(spec.intermediate_size, spec.hidden_size, dtype, bias=spec.expert_bias)
        else:  # one packed page per expert, moved as it is (dequantized on the device)
            specs = [(PAGE, torch.uint8, (self.page_layout.page_bytes,))]
        names = tuple(n for n, _, _ in specs)
        # pinned only once filled: registering faults in the whole pool, and until the loop below has released the
        # host copies layer by layer that would hold every expert twice (the host peak the planner budgets is one)
        self.pool = HostPagePool.for_experts(self.paging, specs, pin=False)
        self.resident = ResidentExperts(self.paging, None, device, names)
        for l in range(spec.num_layers):  # layer by layer: residents to the device, the rest into the pool, then release
            if experts[l] is None:  # a dense layer
                continue
            ew = self._expert_tensors(experts[l].read() if isinstance(experts[l], ExpertsOnDisk) else experts[l])
            self.resident.add_layer(l, ew)
            for p in range(self.paging.layer_pages(l)):
                ids = list(self.paging.page_experts(l, p))
                if ids and ids == list(range(ids[0], ids[0] + len(ids))):  # contiguous experts: a view, no gather copy
                    self.pool.write_page(l, p, {n: ew[n][ids[0] : ids[0] + len(ids)] for n in names})
                else:
                    self.pool.write_page(l, p, {n: ew[n][ids] for n in names})
            experts[l] = ew = None  # the pool and the device hold this layer's experts now: its host copy goes
        if self.cuda:
            self.pool.pin()
        self.buffers = GpuPageBuffers(self.pool, device, 2)
        self.visit = 0  # layer visits so far: buffer = visit % 2, continuing across steps
        self._issued = -1  # last visit whose pages were all issued

    def _expert_tensors(self, ew) -> Optional[dict[str, torch.Tensor]]:
        """A layer's experts as the pool's named tensors: ``{"page": uint8 [E, page_bytes]}`` for packed
        experts (no dequantization on the host), else ``{"w1", "w3", "w2"}`` in the compute dtype (and ``{"b1", "b3",
        "b2"}`` for experts with biases, ``spec.expert_bias``); None for a dense layer. Raises ValueError when the spec
        says biases and a layer holds none."""
        if ew is None:
            return None
        if isinstance(ew, QuantExperts):
            return {PAGE: ew.pages}
        if self.spec.expert_bias and (ew.b1 is None or ew.b3 is None or ew.b2 is None):
            raise ValueError(f"WeightStream: {self.spec.name}'s experts carry biases (expert_bias) but a layer's "
                             f"ExpertWeights has b1 / b3 / b2 None")
        if ew.w1.dtype != self.dtype:
            ew = ew.cast(self.dtype)
        out = {"w1": ew.w1, "w3": ew.w3, "w2": ew.w2}
        if self.spec.expert_bias:  # paged and resident with their expert's weights (the pool's b1 / b3 / b2)
            out.update(b1=ew.b1, b3=ew.b3, b2=ew.b2)
        return out

    def resident_count(self) -> int:
        """Resident experts over all layers."""
        return sum(len(self.paging.resident_experts(l)) for l in range(self.spec.num_layers))

    # ---- a layer visit ------------------------------------------------------------------------
    def begin_visit(self) -> int:
        """Start the next layer visit and return it; its pages are issued now unless the previous visit issued
        them (the first visit of a run).

        The compute stream does NOT wait for the pages here: pre-attention and attention need no expert
        weights, so they run while the pages are still crossing PCIe; :meth:`wait_pages` is enqueued just before
        the visit's first expert FFN.
        """
        visit = self.visit
        if self._issued < visit:
            self.prefetch_slot(visit, 0, 1)
            self._issued = visit
        return visit

    def prefetch_slot(self, visit: int, slot: int, slots: int) -> None:
        """Issue slot ``slot`` of ``slots`` of the pages of ``visit`` (:func:`~lightning_moe.pipeline.pager.
        page_schedule`) on the weight stream, after the visit's buffer is free."""
        layer = visit % self.spec.num_layers
        pages = page_schedule(self.pool.pages_per_layer[layer], slots)[slot]
        if len(pages) == 0:
            return
        b = visit % 2
        if self.cuda:  # wait for the buffer to be free first, so the timed span is the copies alone
            self.h2d.wait_event(self.buffers._done_events[b])
        self.count_h2d(self.timer.around("h2d_copy", self.h2d,
                                         lambda: self.buffers.prefetch_layer(layer, b, self.h2d, pages)))

    def wait_pages(self, visit: int) -> LayerExperts:
        """The compute stream waits (on the GPU) until the visit's pages landed; returns its experts."""
        layer, b = visit % self.spec.num_layers, visit % 2
        self.timer.around("wait_h2d", self.compute, lambda: self.buffers.wait_layer(layer, b, self.compute))
        return self.buffers.layer_experts(layer, b, self.resident)

    def end_visit(self, visit: int) -> None:
        """End ``visit`` after its last kernel was enqueued: a later copy into its buffer waits for that point. The
        next visit's pages were all issued during this one (every slot of decode's micro-batches, prefill's one)."""
        self.buffers.compute_done(visit % 2, self.compute)
        self._issued = visit + 1
        self.visit = visit + 1

    def close(self) -> None:
        """Unregister the pinned pool."""
        self.pool.close()
