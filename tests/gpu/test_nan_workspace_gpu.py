"""Issue 41 on CUDA: every expert-FFN path with NaN-filled workspaces (tests/support/nan_workspace.py), so that a kernel
that reads a row nobody wrote (a padded GEMM row, a skipped pair's slot row, a scratch element) fails every time
instead of at random: mm_loop (its first call's tile warm-up included) and grouped_mm with the Triton epilogue,
the Triton kernel, the MXFP4 kernel and the quantized page kernel in both modes, each with and without the skip
id. Tolerance: bf16 1e-2 relative to the fp32 reference (the page kernels: to their own quantized reference).
Written in a CPU-only session (the CPU twins in tests/test_*: nan_workspaces ran there); run on a CUDA host:
``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.support.moe_inputs import DEV, make_inputs, rel_err  # noqa: E402
from tests.support.nan_workspace import finite_operand_mm, nan_empty, nan_tail_grouped_mm  # noqa: E402
from tests.gpu.test_mxfp4_gpu import _experts, _routing  # noqa: E402

from lightning_moe.kernels import fused_moe as fm  # noqa: E402
from lightning_moe.kernels.fused_moe import MoEKernelConfig, experts_ffn_reference, fused_experts_triton  # noqa: E402
from lightning_moe.kernels.mxfp4 import experts_ffn_mxfp4_reference, fused_experts_mxfp4_triton  # noqa: E402
from lightning_moe.kernels.quant import (dense_expert_scratch, experts_ffn_quant_reference,  # noqa: E402
                                         fused_experts_paged_triton, pack_expert_pages)


def _two_groups(fn, x, w1, w3, w2, wts, ids, **kw):
    """The layer as two calls with the skip id (experts [0, E/2) and the rest), summed in fp32."""
    E, out = w1.shape[0], 0
    for lo, hi in ((0, E // 2), (E // 2, E)):
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, hi - lo))
        out = out + fn(x, w1[lo:hi], w3[lo:hi], w2[lo:hi], wts, local, validate=False, skip=True, **kw).float()
    return out


@pytest.mark.parametrize("T", [1, 33, 600])
def test_library_gemm_paths_nan_workspaces(T, monkeypatch):
    """mm_loop (tile warm-up run afresh: it reads xs's spare rows) and grouped_mm (rows past the last group end NaN,
    as CUTLASS leaves them) with every allocation NaN-filled and GEMMs that fail on a non-finite operand row:
    finite, within 1e-2 of the reference, every chunking, and as two skip-id groups."""
    nan_empty(monkeypatch)
    finite_operand_mm(monkeypatch)
    ends = nan_tail_grouped_mm(monkeypatch, fm)
    monkeypatch.setattr(fm, "_MM_LOOP_WARMED", {})
    x, w1, w3, w2, wts, ids = make_inputs(T, 512, 344, 8, 2, 3, torch.bfloat16, seed=301)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    for fn in (fm.fused_experts_mm_loop, fm.fused_experts_grouped_mm):
        for chunks in (None, 4):
            got = fn(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks)
            assert bool(torch.isfinite(got).all()) and rel_err(got, ref) <= 1e-2, (fn.__name__, chunks)
        two = _two_groups(fn, x, w1, w3, w2, wts, ids)
        assert bool(torch.isfinite(two).all()) and rel_err(two, ref) <= 1e-2, fn.__name__
    assert any(end < ids.numel() for end in ends)  # the skip calls left NaN rows past the last group


def test_triton_kernel_nan_workspaces(monkeypatch):
    """fused_experts_triton with NaN-filled h / y (tiny tiles: many padded rows, masked) and as two skip-id groups
    (the skipped slot rows zeroed): finite, within 1e-2 of the reference."""
    nan_empty(monkeypatch)
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=302)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    for cfg in (None, MoEKernelConfig(16, 16, 16, 1, 1)):
        got = fused_experts_triton(x, w1, w3, w2, wts, ids, config=cfg)
        two = _two_groups(fused_experts_triton, x, w1, w3, w2, wts, ids, config=cfg)
        for y in (got, two):
            assert bool(torch.isfinite(y).all()) and rel_err(y, ref) <= 1e-2, cfg


def test_mxfp4_kernel_nan_workspaces(monkeypatch):
    """fused_experts_mxfp4_triton with NaN-filled h / y, with the skip id: finite, within 1e-2 of the reference."""
    nan_empty(monkeypatch)
    T, D, F, E, k = 17, 128, 64, 6, 3
    pages, lay = _experts(E, D, F, torch.bfloat16, seed=303)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(303)).to(DEV, torch.bfloat16)
    w, ids = _routing(T, E, k, seed=303)
    drop = ids >= 4
    want = experts_ffn_mxfp4_reference(x, pages, lay, torch.where(drop, torch.zeros_like(w), w),
                                       torch.where(drop, 0, ids), limit=7.0, alpha=1.702)
    for cfg in (None, MoEKernelConfig(16, 16, 32, 1, 1)):
        got = fused_experts_mxfp4_triton(x, pages, lay, w, torch.where(drop, torch.full_like(ids, E), ids),
                                         limit=7.0, alpha=1.702, skip=True, config=cfg)
        assert bool(torch.isfinite(got).all()) and rel_err(got, want) <= 1e-2, cfg


@pytest.mark.parametrize("mode", ["fused", "dequant"])
def test_paged_kernel_nan_workspaces(mode, monkeypatch):
    """fused_experts_paged_triton (int4 pages) with NaN-filled buffers and, in "dequant" mode, a NaN-filled dense
    scratch (dense_expert_scratch goes through torch.empty), with and without the skip id: finite, within 1e-2 of
    experts_ffn_quant_reference."""
    nan_empty(monkeypatch)
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=304)
    pages, lay = pack_expert_pages(w1, w3, w2, "int4")
    extra = {"scratch": dense_expert_scratch(8, 200, 344, torch.bfloat16, DEV)} if mode == "dequant" else {}
    assert mode == "fused" or bool(extra["scratch"][0].isnan().all())
    drop = ids >= 5
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    want_kept = experts_ffn_quant_reference(x, pages, lay, torch.where(drop, torch.zeros_like(wts), wts), ids)
    got = fused_experts_paged_triton(x, pages, lay, wts, ids, mode=mode, **extra)
    kept = fused_experts_paged_triton(x, pages, lay, wts, torch.where(drop, torch.full_like(ids, 8), ids), mode=mode,
                                      skip=True, **extra)
    assert bool(torch.isfinite(got).all()) and rel_err(got, want) <= 1e-2
    assert bool(torch.isfinite(kept).all()) and rel_err(kept, want_kept) <= 1e-2
