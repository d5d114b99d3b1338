"""CGOPipe's expert FFN: how one layer visit's routed experts are computed from where they are on the device.

A layer visit's experts are a :class:`~lightning_moe.pipeline.pager.LayerExperts`: the policy's resident experts
plus the paged ones in a GPU page buffer (dense ``w1 / w3 / w2`` stacks, or one packed ``uint8`` page per expert for
quantized checkpoints). A strategy turns them into the FFN the family's ``post_attention`` calls,
``ffn(h [T, D], ew, topk_weights [T, k], topk_ids [T, k]) -> [T, D]``, once per visit (every micro-batch, or prefill
chunk, of the visit calls the same one):

* :class:`TorchExpertFFN` -- the reference expert loop, the serial executor's per-expert ops (tokens identical to
  it; one host sync per expert to gather its tokens). Packed pages are dequantized per expert on the device as the
  serial executor does.
* :class:`GroupedExpertFFN` (was ``TritonExpertFFN``) -- dense pages: a sync-free grouped call once over the paged
  stack and once over the resident one; each call marks the other group's (token, slot) pairs with the skip id, so
  the kernel aligns them into a bucket it never computes (no host sync, no pair computed twice).
* :class:`GroupedQuantExpertFFN` (was ``TritonQuantExpertFFN``) -- packed pages: the visit's first call dequantizes
  ALL the layer's experts, paged and resident, once into a dense scratch ``[E, ...]``
  (:func:`~lightning_moe.kernels.quant.dequantize_pages_triton`), and every call of the visit runs ONE dense grouped
  call over it (the planner counts the scratch and the dequantization time: hrm "dequantized expert scratch", T_deq).

Each grouped call runs one of three kernels, picked per call from its token count by :class:`KernelChoice`: the
Triton grouped kernel (:func:`~lightning_moe.kernels.fused_moe.fused_experts_triton`), torch's library grouped GEMM
(:func:`~lightning_moe.kernels.fused_moe.fused_experts_grouped_mm`), or one library GEMM per expert
(:func:`~lightning_moe.kernels.fused_moe.fused_experts_mm_loop`: one host sync per call, so prefill passes only);
``expert_ffn: triton`` / ``grouped_mm`` / ``mm_loop`` force one, ``auto`` follows the hardware profile's
measurements (``expert_ffn_rates``), Triton where it has none.

:func:`expert_ffn` picks one; :func:`expert_ffn_for` resolves a job's ``expert_ffn`` setting.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch

from ..kernels import quant as Q
from ..kernels.fused_moe import (TRITON_ACTIVATIONS, _interpret_mode, fused_experts_grouped_mm, fused_experts_mm_loop,
                                 fused_experts_triton, grouped_mm_unsupported)
from ..kernels.mxfp4 import MXFP4PageLayout, fused_experts_mxfp4_triton, unpack_mxfp4_page
from ..kernels.quant import ExpertPageLayout, unpack_expert_page
from .pager import ExpertPaging, LayerExperts
from ..policy.hardware import EXPERT_FFN_KERNELS, NO_SYNC_KERNELS
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
        """``get(e) -> (w1 [F, D], w3 [F, D], w2 [D, F])`` of expert ``e`` in the compute dtype; for experts with
        biases (the pages hold ``b1 / b3 / b2``: ``MoESpec.expert_bias``) ``(w1, w3, w2, b1 [F], b3 [F], b2 [D])``,
        what such a family's ``experts_ffn_from`` takes."""
        if self.page_layout is None:
            def get(e):
                t = lx.expert(e)
                if "b1" in t:
                    return t["w1"], t["w3"], t["w2"], t["b1"], t["b3"], t["b2"]
                return t["w1"], t["w3"], t["w2"]
        elif isinstance(self.page_layout, MXFP4PageLayout):  # (w1, w3, w2, b1, b3, b2), as MXFP4Experts.dequantize
            lay, dt = self.page_layout, self.dtype

            def get(e):
                return unpack_mxfp4_page(lx.expert(e)[PAGE], lay, dt)
        else:
            lay, dt = self.page_layout, self.dtype

            def get(e):  # the same pure-torch dequantization as QuantExperts.dequantize (serial executor)
                return unpack_expert_page(lx.expert(e)[PAGE], lay, dt)
        return get


class KernelChoice:
    """Which grouped kernel ("triton" | "grouped_mm" | "mm_loop") a call of T tokens runs, and how many calls each
    ran.

    ``forced`` (one of EXPERT_FFN_KERNELS, the job's ``expert_ffn``) runs that kernel for every call. Otherwise
    (``expert_ffn: auto``) the hardware profile decides by measured shape: the fastest kernel at the profile's bucket
    nearest T (:meth:`~lightning_moe.policy.hardware.HardwareProfile.expert_ffn_kernel`, for the layer's ``(D, F, E,
    k)`` and the compute dtype) among all of them inside a prefill pass (:meth:`prefill_pass`, which CGOPipe's
    prefill enters) and among the NO_SYNC_KERNELS elsewhere (a decode step must not wait for the host: mm_loop reads
    each call's per-expert row counts on the host); with no measurement of the shape (presets, older profiles), or
    operands grouped_mm cannot take (:func:`~lightning_moe.kernels.fused_moe.grouped_mm_unsupported`), the Triton
    kernel -- today's behaviour. Resolved on the host from T (a shape) and the pass, so no host sync of its own.

    Args:
        forced: None (by the profile), or one of EXPERT_FFN_KERNELS.
        hardware: the profile (None: no measurements).
        shape: ``(hidden, intermediate, experts, top_k)`` of the model's routed experts.
        dtype: the compute dtype.
    """

    def __init__(self, forced: Optional[str] = None, hardware=None, shape: Optional[tuple] = None,
                 dtype: torch.dtype = torch.bfloat16):
        if forced not in (None,) + EXPERT_FFN_KERNELS:
            raise ValueError(f"KernelChoice: forced must be None or one of {EXPERT_FFN_KERNELS}, got {forced!r}")
        if forced is None and hardware is not None and shape is None:
            raise ValueError("KernelChoice: a profile-driven choice needs the expert shape")
        self.forced, self.hardware, self.shape = forced, hardware, shape
        self.dtype_name = str(dtype).replace("torch.", "")
        self.calls = {k: 0 for k in EXPERT_FFN_KERNELS}  # grouped-kernel calls per kernel (the run report's stages)
        self.prefill = False  # inside a prefill pass: kernels with a host sync may run
        self._by_tokens: dict = {}

    @contextmanager
    def prefill_pass(self):
        """A prefill pass: its calls may run any kernel (the host issues a layer's chunks one after another, with no
        decode work to keep ahead of)."""
        self.prefill = True
        try:
            yield self
        finally:
            self.prefill = False

    def __call__(self, tokens: int, grouped_mm_ok: bool = True) -> str:
        """The kernel of a call of ``tokens`` tokens; ``grouped_mm_ok``: the operands suit grouped_mm."""
        if self.forced is not None:
            kind = self.forced
        else:
            kind = self._by_tokens.get((tokens, self.prefill))
            if kind is None:
                kind = "triton"
                if self.hardware is not None:
                    kind = self.hardware.expert_ffn_kernel(*self.shape, self.dtype_name, tokens, EXPERT_FFN_KERNELS
                                                           if self.prefill else NO_SYNC_KERNELS) or "triton"
                self._by_tokens[(tokens, self.prefill)] = kind
            if kind == "grouped_mm" and not grouped_mm_ok:
                kind = "triton"
        self.calls[kind] += 1
        return kind


def _grouped_call(kind: str, h, w1, w3, w2, w, ids, skip: bool = False):
    """One grouped expert call with the kernel ``kind`` (a forced grouped_mm over operands it cannot take raises
    ValueError naming why; the profile-driven choice never picks it for them)."""
    if kind == "grouped_mm":
        return fused_experts_grouped_mm(h, w1, w3, w2, w, ids, validate=False, skip=skip)
    if kind == "mm_loop":
        return fused_experts_mm_loop(h, w1, w3, w2, w, ids, validate=False, skip=skip)
    return fused_experts_triton(h, w1, w3, w2, w, ids, validate=False, skip=skip)


class GroupedExpertFFN:
    """Dense pages: one grouped call over the paged stack and one over the resident stack, each skipping the other's
    (token, slot) pairs; each call's kernel (Triton, or torch's grouped_mm) picked by :class:`KernelChoice` from its
    token count (Triton on CUDA, or Triton's interpreter; grouped_mm on CUDA or the CPU).

    Args:
        paging: where each expert of a layer lives (``ExpertPaging.index_tensors``).
        device: the compute device.
        choice: the kernel per call (default: Triton for every call).
    """

    def __init__(self, paging: ExpertPaging, device: torch.device, choice: Optional[KernelChoice] = None):
        self.paging, self.device = paging, device
        self.choice = choice or KernelChoice("triton")
        self._maps: dict = {}  # (layer, paged, resident) -> _local_ids

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts."""
        groups = [(g, m) for g, m in zip((lx.paged, lx.resident), self._local_ids(lx)) if g["w1"].shape[0] > 0]
        choice, gmm_ok = self.choice, {}

        def ffn(h, ew, w, ids):
            out = None
            for i, (g, local_of) in enumerate(groups):
                if i not in gmm_ok:  # once per visit and group: can grouped_mm take these operands?
                    gmm_ok[i] = grouped_mm_unsupported(h, g["w1"], g["w3"], g["w2"]) is None
                kind = choice(h.shape[0], gmm_ok[i])
                local = local_of[ids]  # [T, k] each slot's row in group g, or g's skip id
                y = _grouped_call(kind, h, g["w1"], g["w3"], g["w2"], w, local, skip=True)
                out = y if out is None else out + y
            return out

        return ffn

    def _local_ids(self, lx: LayerExperts) -> tuple[torch.Tensor, torch.Tensor]:
        """(paged, resident): int64 [E] on the device, expert -> its row in that group's stack, or the group's expert
        count (the skip id: the expert is in the other group, not computed by that group's call). Made once per layer
        (the paging map is fixed), so a call indexes one map per group instead of building it from the ids."""
        P, R = lx.paged["w1"].shape[0], lx.resident["w1"].shape[0]
        key = (lx.layer, P, R)
        if key not in self._maps:
            is_paged, row = self.paging.index_tensors(lx.layer, self.device)  # [E] bool, [E] row in its group
            self._maps[key] = (torch.where(is_paged, row, torch.full_like(row, P)),
                               torch.where(is_paged, torch.full_like(row, R), row))
        return self._maps[key]


class GroupedQuantExpertFFN:
    """Packed pages: the visit's first call dequantizes every expert of the layer (the P paged ones to rows
    ``[0, P)`` of the scratch, the R resident ones to rows ``[P, P + R)``), and every call runs one dense grouped
    call over them, its kernel (Triton or grouped_mm) picked by :class:`KernelChoice` from its token count.

    Args:
        paging: where each expert of a layer lives.
        page_layout: the packed pages' layout (quantized).
        num_experts: E, experts per layer (the scratch's rows).
        dtype: the compute dtype (the scratch's).
        device: the compute device; on CUDA the scratch is allocated here (the planner counts it for every
            phase), elsewhere on first use.
        choice: the kernel per call (default: Triton for every call).
    """

    def __init__(self, paging: ExpertPaging, page_layout: ExpertPageLayout, num_experts: int, dtype: torch.dtype,
                 device: torch.device, choice: Optional[KernelChoice] = None):
        self.paging, self.page_layout, self.num_experts, self.dtype, self.device = (paging, page_layout, num_experts,
                                                                                    dtype, device)
        self.choice = choice or KernelChoice("triton")
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
        resident ones to rows ``[P, P + R)``. Returns ``(w1, w3, w2)`` views ``[P + R, ...]``. On CUDA (or under
        Triton's interpreter) with the Triton dequantization kernel; on the CPU with its torch reference
        (``unpack_expert_page``, bit-identical to the kernel) copied into the scratch."""
        scratch, P, R = self._scratch(), lx.paged[PAGE].shape[0], lx.resident[PAGE].shape[0]
        triton_ok = self.device.type == "cuda" or _interpret_mode()
        for pages, first, count in ((lx.paged[PAGE], 0, P), (lx.resident[PAGE], P, R)):
            if not count:
                continue
            out = tuple(w[first:first + count] for w in scratch)
            if triton_ok:
                Q.dequantize_pages_triton(pages, self.page_layout, dtype, out=out)
            else:
                for o, v in zip(out, unpack_expert_page(pages, self.page_layout, dtype)):
                    o.copy_(v)
        return tuple(w[: P + R] for w in scratch)

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts; its first call dequantizes them."""
        is_paged, row = self.paging.index_tensors(lx.layer, self.device)  # [E] bool, [E] row in its group
        dense: list = []  # this visit's dequantized experts (w1, w3, w2), views of the scratch
        dense_row = torch.where(is_paged, row, row + lx.paged[PAGE].shape[0])  # [E] expert -> its row in the scratch
        choice, gmm_ok = self.choice, []

        def ffn(h, ew, w, ids):
            if not dense:  # first call of the visit: dequantize the layer's experts once
                dense.extend(self._dequantize_visit(lx, h.dtype))
                gmm_ok.append(grouped_mm_unsupported(h, *dense) is None)
            kind = choice(h.shape[0], gmm_ok[0])
            return _grouped_call(kind, h, *dense, w, dense_row[ids])

        return ffn


class GroupedMXFP4ExpertFFN:
    """MXFP4 pages (gpt-oss): one :func:`~lightning_moe.kernels.mxfp4.fused_experts_mxfp4_triton` call over the paged
    pages and one over the resident ones, each skipping the other's (token, slot) pairs (as
    :class:`GroupedExpertFFN`); the kernel dequantizes in registers, so there is no dense scratch. On CUDA, or under
    Triton's interpreter.

    Args:
        paging: where each expert of a layer lives.
        page_layout: the pages' :class:`~lightning_moe.kernels.mxfp4.MXFP4PageLayout`.
        device: the compute device.
        limit, alpha: the spec's ``swiglu_limit`` / ``swiglu_alpha``.
    """

    def __init__(self, paging: ExpertPaging, page_layout: MXFP4PageLayout, device: torch.device, limit: float,
                 alpha: float):
        self.paging, self.page_layout, self.device, self.limit, self.alpha = paging, page_layout, device, limit, alpha
        self.choice = KernelChoice("triton")  # counts the kernel's calls (the run report's expert_ffn_*_calls_triton)

    def for_visit(self, lx: LayerExperts) -> ExpertFFN:
        """The FFN over ``lx``'s experts."""
        is_paged, row = self.paging.index_tensors(lx.layer, self.device)  # [E] bool, [E] row in its group
        groups = [(g[PAGE], m) for g, m in ((lx.paged, is_paged), (lx.resident, ~is_paged)) if g[PAGE].shape[0] > 0]
        lay, limit, alpha = self.page_layout, self.limit, self.alpha

        def ffn(h, ew, w, ids):
            out = None
            for pages, member in groups:
                # the group's row, or its page count: the slot's expert is in the other group (skip: not computed)
                local = torch.where(member[ids], row[ids], torch.full_like(ids, pages.shape[0]))  # [T, k]
                y = fused_experts_mxfp4_triton(h, pages, lay, w, local, limit=limit, alpha=alpha, validate=False,
                                               skip=True)
                self.choice(h.shape[0])
                out = y if out is None else out + y
            return out

        return ffn


TritonExpertFFN = GroupedExpertFFN  # the names before the grouped_mm kernel (Triton is still the default kernel)
TritonQuantExpertFFN = GroupedQuantExpertFFN


LIBRARY_KERNELS = ("grouped_mm", "mm_loop")  # the expert kernels on torch's GEMMs (dense operands only)
MXFP4_GROUPED_MM_REFUSAL = ("torch's GEMMs (grouped_mm, mm_loop) have no MXFP4 kernel; MXFP4 expert pages run "
                            "expert_ffn: triton (kernels.mxfp4), auto or torch")


def expert_ffn(kind: str, experts_ffn_from: Callable, paging: ExpertPaging, page_layout: Optional[ExpertPageLayout],
               num_experts: int, dtype: torch.dtype, device: torch.device, hardware=None,
               shape: Optional[tuple] = None, swiglu: Optional[tuple] = None):
    """The strategy named ``kind``: "torch" (:class:`TorchExpertFFN`); "triton", "grouped_mm", "mm_loop" (that kernel
    for every call) or "auto" (per call by the profile ``hardware`` for the experts' ``shape`` = (D, F, E, k):
    :class:`KernelChoice`) as :class:`GroupedExpertFFN` over dense pages or :class:`GroupedQuantExpertFFN` over packed
    ones; MXFP4 pages (an :class:`~lightning_moe.kernels.mxfp4.MXFP4PageLayout`) with "triton" or "auto":
    :class:`GroupedMXFP4ExpertFFN` with ``swiglu`` = (limit, alpha). Raises ValueError on another kind, and on
    "grouped_mm" / "mm_loop" over MXFP4 pages (no such kernel)."""
    if kind == "torch":
        return TorchExpertFFN(experts_ffn_from, num_experts, page_layout, dtype)
    if kind not in ("auto",) + EXPERT_FFN_KERNELS:
        raise ValueError(f"expert FFN must be torch, auto, triton, grouped_mm or mm_loop, got {kind!r}")
    if isinstance(page_layout, MXFP4PageLayout):
        if kind in LIBRARY_KERNELS:
            raise ValueError(f"expert FFN {kind}: {MXFP4_GROUPED_MM_REFUSAL}")
        limit, alpha = swiglu if swiglu is not None else (7.0, 1.702)
        return GroupedMXFP4ExpertFFN(paging, page_layout, device, limit, alpha)
    choice = KernelChoice(None if kind == "auto" else kind, hardware, shape, dtype)
    if page_layout is None:
        return GroupedExpertFFN(paging, device, choice)
    return GroupedQuantExpertFFN(paging, page_layout, num_experts, dtype, device, choice)


def grouped_kernels_refusal(spec, kind: Optional[str] = None, page_scheme: Optional[str] = None) -> Optional[str]:
    """Why the grouped expert kernels (``expert_ffn``: triton, grouped_mm, mm_loop, auto's picks; ``kind``: the one asked for,
    None: any) cannot compute ``spec``'s experts, naming what they lack (a gate activation other than
    ``TRITON_ACTIVATIONS``' silu, expert biases); None when they can. Such a model runs CGOPipe with ``expert_ffn:
    torch`` (the reference loop). ``page_scheme`` "mxfp4" (gpt-oss's MXFP4 pages kept packed): the MXFP4 kernel
    computes the clamped SwiGLU with biases, so only ``kind`` grouped_mm / mm_loop is refused."""
    from ..model.families import family_of

    if page_scheme == "mxfp4":
        return MXFP4_GROUPED_MM_REFUSAL if kind in LIBRARY_KERNELS else None

    act = family_of(spec).expert_activation
    missing = ([f"{act!r} gate activation"] if act not in TRITON_ACTIVATIONS else []) + (
        ["expert biases"] if spec.expert_bias else [])
    if not missing:
        return None
    return (f"the grouped expert kernels compute {', '.join(TRITON_ACTIVATIONS)} experts without biases, not the "
            f"{spec.model_type} family's {' and '.join(missing)} (use expert_ffn: torch)")


def expert_ffn_for(job, spec=None, page_scheme: Optional[str] = None) -> str:
    """The job's ``expert_ffn`` for the executor: "torch", "triton", "grouped_mm" and "mm_loop" as given; "auto" is "torch" for a
    ``spec`` the grouped kernels cannot compute (:func:`grouped_kernels_refusal` with ``page_scheme``: gpt-oss's
    clamped SwiGLU with biases, unless its MXFP4 pages are kept packed), else "auto" on CUDA when triton imports (each
    call's kernel by the hardware profile's measurements, Triton where it has none; MXFP4 pages: the MXFP4 kernel),
    else "torch"."""
    if job.expert_ffn != "auto":
        return job.expert_ffn
    if spec is not None and grouped_kernels_refusal(spec, page_scheme=page_scheme) is not None:
        return "torch"
    if job.device.startswith("cuda"):
        from ..kernels.fused_moe import triton_available

        return "auto" if triton_available() else "torch"
    return "torch"
