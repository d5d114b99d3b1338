"""GPU tests of gpt-oss's expert FFN from MXFP4 pages (lightning_moe.kernels.mxfp4.fused_experts_mxfp4_triton), compiled
on CUDA, against its torch reference (experts_ffn_mxfp4_reference, dequantized bf16 weights bit for bit the kernel's).

Tolerance: ||a - b|| / ||b|| <= 1e-2 in bf16 / fp16 (rounding of the intermediates), <= 1e-5 in fp32 (IEEE dots).
Shapes: 1 token, an expert with no tokens, odd T, D / F odd multiples of 32, k = 1 and 4, gpt-oss-20b's D = F = 2880.
Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels.mxfp4 import experts_ffn_mxfp4_reference, fused_experts_mxfp4_triton, pack_mxfp4_pages

DEV = "cuda"


def _experts(E, D, F, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gub = torch.randint(0, 256, (E, 2 * F, D // 32, 16), dtype=torch.uint8, generator=g)
    gus = torch.randint(120, 124, (E, 2 * F, D // 32), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (E, D, F // 32, 16), dtype=torch.uint8, generator=g)
    ds = torch.randint(120, 124, (E, D, F // 32), dtype=torch.uint8, generator=g)
    gubias = (torch.randn(E, 2 * F, generator=g) * 0.5).to(dtype)
    dbias = (torch.randn(E, D, generator=g) * 0.5).to(dtype)
    return pack_mxfp4_pages(*(t.to(DEV) for t in (gub, gus, gubias, db, ds, dbias)))


def _routing(T, E, k, seed, avoid=None):
    g = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(T, E, generator=g)
    if avoid is not None:
        logits[:, avoid] = -float("inf")
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1).to(DEV), ids.to(DEV)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# (T, D, F, E, k, expert without tokens)
SHAPES = [(1, 64, 32, 4, 1, None), (7, 96, 160, 5, 4, 2), (33, 224, 96, 8, 2, 5), (300, 2880, 2880, 32, 4, 7),
          (1100, 2880, 2880, 16, 4, 3)]
IDS = ["T1-k1", "T7-k4-empty-D96-F160", "T33-k2-empty-D224", "T300-gpt-oss-20b", "T1100-gpt-oss-prefill-tiles"]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-2), (torch.float32, 1e-5)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("limit", [1.0, 7.0])
def test_mxfp4_kernel_matches_reference(shape, dtype, tol, limit):
    T, D, F, E, k, avoid = shape
    pages, lay = _experts(E, D, F, dtype, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3 + T)).to(DEV, dtype)
    w, ids = _routing(T, E, k, seed=T, avoid=avoid)
    got = fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=limit, alpha=1.702)
    want = experts_ffn_mxfp4_reference(x, pages, lay, w, ids, limit=limit, alpha=1.702)
    assert got.dtype == dtype and got.shape == (T, D) and got.is_cuda
    assert _rel(got, want) <= tol


def test_mxfp4_kernel_skip_id_adds_nothing():
    T, D, F, E, k = 17, 128, 64, 6, 3
    pages, lay = _experts(E, D, F, torch.bfloat16, seed=9)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(9)).to(DEV, torch.bfloat16)
    w, ids = _routing(T, E, k, seed=9)
    skipped = torch.where(ids >= 4, torch.full_like(ids, E), ids)
    got = fused_experts_mxfp4_triton(x, pages, lay, w, skipped, limit=7.0, alpha=1.702, skip=True)
    want = experts_ffn_mxfp4_reference(x, pages, lay, torch.where(ids >= 4, torch.zeros_like(w), w),
                                       torch.where(ids >= 4, 0, ids), limit=7.0, alpha=1.702)
    assert _rel(got, want) <= 1e-2


@pytest.mark.parametrize("mode", ["one-column", "paired", "scaled", "scaled-joint"])
@pytest.mark.parametrize("T", [5, 700], ids=["decode-tiles", "prefill-tiles"])
def test_mxfp4_paths_bf16_wide_scales_nan_workspaces(mode, T, monkeypatch):
    """Each dequantization path (mxfp4.PAIRED_NIBBLES / DOT_SCALED / JOINT_GATE_UP) on its default tiles (mxfp4_kernel_config: T 700
    at top-2 of 8 gives 175 pairs per expert, the 128 x 128 x 128 prefill tiles; D 352 = 2.75 K blocks of 128),
    scales over 2^-27..2^13 (E8M0 100..140) so a wrong exponent shows, every wrapper allocation NaN-filled first;
    bf16, 1e-2."""
    from lightning_moe.kernels import mxfp4
    from tests.support.nan_workspace import nan_empty

    monkeypatch.setattr(mxfp4, "PAIRED_NIBBLES", mode != "one-column")
    monkeypatch.setattr(mxfp4, "DOT_SCALED", mode.startswith("scaled"))
    monkeypatch.setattr(mxfp4, "JOINT_GATE_UP", mode == "scaled-joint")
    E, D, F, k = 8, 352, 224, 2
    g = torch.Generator().manual_seed(T)
    gub = torch.randint(0, 256, (E, 2 * F, D // 32, 16), dtype=torch.uint8, generator=g)
    gus = torch.randint(100, 141, (E, 2 * F, D // 32), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (E, D, F // 32, 16), dtype=torch.uint8, generator=g)
    ds = torch.randint(100, 141, (E, D, F // 32), dtype=torch.uint8, generator=g)
    bias = [(torch.randn(E, n, generator=g) * 0.5).to(torch.bfloat16) for n in (2 * F, D)]
    pages, lay = pack_mxfp4_pages(*(t.to(DEV) for t in (gub, gus, bias[0], db, ds, bias[1])))
    x = (torch.randn(T, D, generator=g) * 2.0**-10).to(DEV, torch.bfloat16)
    w, ids = _routing(T, E, k, seed=T)
    want = experts_ffn_mxfp4_reference(x, pages, lay, w, ids, limit=7.0, alpha=1.702)
    nan_empty(monkeypatch)
    got = fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=7.0, alpha=1.702)
    assert torch.isfinite(got).all() and _rel(got, want) <= 1e-2, _rel(got, want)
