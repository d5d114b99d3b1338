"""CGOPipe's expert FFN: how one layer visit's routed experts are computed from where they are on the device.

A layer visit's experts are a :class:`~lightning_moe.pipeline.pager.LayerExperts`: the policy's resident experts
plus the paged ones in a GPU page buffer (dense ``w1 / w3 / w2`` stacks, or one packed ``uint8`` page per expert for
quantized checkpoints). A strategy turns them into the FFN the family's ``post_attention`` calls,
``ffn(h [T, D], ew, topk_weights [T, k], topk_ids [T, k]) -> [T, D]``, once per visit (every micro-batch, or prefill
chunk, of the visit calls the same one):

* :class:`TorchExpertFFN` -- the reference expert loop, the serial executor's per-expert ops (tokens identical to
  it; one host sync per expert to gather its tokens). Packed pages are dequantized per expert on the device as the
  serial executor does.
* :class:`TritonExpertFFN` -- dense pages: the sync-free grouped kernel
  (:func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`) once over the paged stack and once over the
  resident one; each call marks the other group's (token, slot) pairs with the skip id, so the kernel aligns them
  into a bucket it never computes (no host sync, no pair computed twice).
* :class:`TritonQuantExpertFFN` -- packed pages: the visit's first call dequantizes ALL the layer's experts, paged
  and resident, once into a dense scratch ``[E, ...]`` (:func:`~lightning_moe.kernels.quant.dequantize_pages_triton`),
  and every call of the visit runs ONE dense grouped kernel over it (the planner counts the scratch and the
  dequantization time: hrm "dequantized expert scratch", T_deq).

:func:`expert_ffn` picks one; :func:`expert_ffn_for` resolves a job's ``expert_ffn`` setting.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..kernels import quant as Q
from ..kernels.fused_moe import fused_experts_triton
from ..kernels.quant import ExpertPageLayout, unpack_expert_page
from .pager import ExpertPaging, LayerExperts
from .weight_stream import PAGE
ExpertFFN = Callable[..., torch.Tensor]  # ffn(h [T, D], ew, topk_weights [T, k], topk_ids [T, k]) -> [T, D]


class TorchExpertFFN:
    """The reference expert loop over a visit's experts (``family.experts_ffn_from``), one expert at a time.

    Args:
        experts_ffn_from: the family's ``experts_ffn_from(h, get, E, w, ids)``.
        num_experts: E, experts per layer.
        page_layout: the packed pages' layout (None: dense ``w1 / w3 / w2`` tensors).
        dtype: the compute dtype packed pages are dequantized to.
    """

    def __init__(self, experts_ffn_from: Callable, num_experts: int, page_layout: Optional[ExpertPageLayout],
                 dtype: torch.dtype):
        self.experts_ffn_from, self.num_experts, self.page_layout, self.dtype = (experts_ffn_from, num_experts,
                                                                                 page_layout, dtype)

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts."""
        get, E, ffn_from = self._expert_getter(lx), self.num_experts, self.experts_ffn_from
        return lambda h, ew, w, ids: ffn_from(h, get, E, w, ids)

    def _expert_getter(self, lx: LayerExperts):
        """``get(e) -> (w1 [F, D], w3 [F, D], w2 [D, F])`` of expert ``e`` in the compute dtype."""
        if self.page_layout is None:
            def get(e):
                t = lx.expert(e)
                return t["w1"], t["w3"], t["w2"]
        else:
            lay, dt = self.page_layout, self.dtype

            def get(e):  # the same pure-torch dequantization as QuantExperts.dequantize (serial executor)
                return unpack_expert_page(lx.expert(e)[PAGE], lay, dt)
        return get


class TritonExpertFFN:
    """Dense pages: one grouped Triton call over the paged stack and one over the resident stack, each skipping
    the other's (token, slot) pairs (CUDA, or Triton's interpreter).

    Args:
        paging: where each expert of a layer lives (``ExpertPaging.index_tensors``).
        device: the compute device.
    """

    def __init__(self, paging: ExpertPaging, device: torch.device):
        self.paging, self.device = paging, device

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts."""
        is_paged, row = self.paging.index_tensors(lx.layer, self.device)  # [E] bool, [E] row in its group
        groups = [(g, m) for g, m in ((lx.paged, is_paged), (lx.resident, ~is_paged)) if g["w1"].shape[0] > 0]

        def ffn(h, ew, w, ids):
            out = None
            for g, member in groups:
                sel = member[ids]  # [T, k] expert of this slot lives in group g
                # the group's row, or its expert count: the slot's expert is in the other group (skip: not computed)
                local = torch.where(sel, row[ids], torch.full_like(ids, g["w1"].shape[0]))  # [T, k]
                y = fused_experts_triton(h, g["w1"], g["w3"], g["w2"], w, local, validate=False, skip=True)
                out = y if out is None else out + y
            return out

        return ffn


class TritonQuantExpertFFN:
    """Packed pages: the visit's first call dequantizes every expert of the layer (the P paged ones to rows
    ``[0, P)`` of the scratch, the R resident ones to rows ``[P, P + R)``), and every call runs one dense grouped
    Triton kernel over them (CUDA, or Triton's interpreter).

    Args:
        paging: where each expert of a layer lives.
        page_layout: the packed pages' layout (quantized).
        num_experts: E, experts per layer (the scratch's rows).
        dtype: the compute dtype (the scratch's).
        device: the compute device; on CUDA the scratch is allocated here (the planner counts it for every
            phase), elsewhere on first use.
    """

    def __init__(self, paging: ExpertPaging, page_layout: ExpertPageLayout, num_experts: int, dtype: torch.dtype,
                 device: torch.device):
        self.paging, self.page_layout, self.num_experts, self.dtype, self.device = (paging, page_layout, num_experts,
                                                                                    dtype, device)
        self.scratch: Optional[tuple] = None  # dense (w1, w3, w2) [E, F, D], [E, F, D], [E, D, F], compute dtype
        if device.type == "cuda":
            self._scratch()

    def _scratch(self) -> tuple:
        """The dense scratch for one layer's experts (kernels.quant.dense_expert_scratch), allocated on first use."""
        if self.scratch is None:
            lay = self.page_layout
            self.scratch = Q.dense_expert_scratch(self.num_experts, lay.hidden_size, lay.intermediate_size,
                                                  self.dtype, self.device)
        return self.scratch

    def _dequantize_visit(self, lx: LayerExperts, dtype: torch.dtype) -> tuple:
        """Dequantize every packed expert of ``lx`` into the scratch: the P paged experts to rows ``[0, P)``, the R
        resident ones to rows ``[P, P + R)``. Returns ``(w1, w3, w2)`` views ``[P + R, ...]``."""
        scratch, P, R = self._scratch(), lx.paged[PAGE].shape[0], lx.resident[PAGE].shape[0]
        for pages, first, count in ((lx.paged[PAGE], 0, P), (lx.resident[PAGE], P, R)):
            if count:
                Q.dequantize_pages_triton(pages, self.page_layout, dtype, out=tuple(w[first:] for w in scratch))
        return tuple(w[: P + R] for w in scratch)

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts; its first call dequantizes them."""
        is_paged, row = self.paging.index_tensors(lx.layer, self.device)  # [E] bool, [E] row in its group
        dense: list = []  # this visit's dequantized experts (w1, w3, w2), views of the scratch
        dense_row = torch.where(is_paged, row, row + lx.paged[PAGE].shape[0])  # [E] expert -> its row in the scratch

        def ffn(h, ew, w, ids):
            if not dense:  # first call of the visit: dequantize the layer's experts once
                dense.extend(self._dequantize_visit(lx, h.dtype))
            return fused_experts_triton(h, *dense, w, dense_row[ids], validate=False)

        return ffn


def expert_ffn(kind: str, experts_ffn_from: Callable, paging: ExpertPaging, page_layout: Optional[ExpertPageLayout],
               num_experts: int, dtype: torch.dtype, device: torch.device):
    """The strategy named ``kind``: "torch" (:class:`TorchExpertFFN`) or "triton" (:class:`TritonExpertFFN` for
    dense pages, :class:`TritonQuantExpertFFN` for packed ones). Raises ValueError on another kind."""
    if kind == "torch":
        return TorchExpertFFN(experts_ffn_from, num_experts, page_layout, dtype)
    if kind != "triton":
        raise ValueError(f"expert FFN must be torch or triton, got {kind!r}")
    if page_layout is None:
        return TritonExpertFFN(paging, device)
    return TritonQuantExpertFFN(paging, page_layout, num_experts, dtype, device)


def expert_ffn_for(job) -> str:
    """The job's ``expert_ffn``: "auto" is "triton" on CUDA when triton imports, else "torch"."""
    if job.expert_ffn != "auto":
        return job.expert_ffn
    if job.device.startswith("cuda"):
        from ..kernels.fused_moe import triton_available

        return "triton" if triton_available() else "torch"
    return "torch"
