"""MXFP4 expert pages and gpt-oss's expert FFN from them (lightning_moe.kernels.mxfp4).

* the torch reference (experts_ffn_mxfp4_reference) equals mxfp4_dequantize + gpt_oss.experts_ffn exactly (fp32 and
  bf16: the same ops on the same dequantized weights);
* the Triton kernel (fused_experts_mxfp4_triton), run by Triton's CPU interpreter (TRITON_INTERPRET=1), equals the
  reference within ||a - b|| / ||b|| <= 1e-5 in fp32 and <= 1e-2 in fp16 (the interpreter mishandles bf16 tl.dot, as
  tests/test_kernels_ref.py says; tests/gpu/test_mxfp4_gpu.py checks bf16 on CUDA) on awkward shapes: 1 token, an
  expert with no tokens, odd T, D / F odd multiples of 32, k = 1 and 4, the skip id; bf16 through tl.dot_scaled
  (which the interpreter runs as Triton defines it) within 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels import mxfp4
from lightning_moe.kernels.fused_moe import MoEKernelConfig
from lightning_moe.kernels.mxfp4 import (experts_ffn_mxfp4_reference, fused_experts_mxfp4_triton, mxfp4_dequantize,
                                         mxfp4_expert_bytes, mxfp4_page_layout, pack_mxfp4_pages, unpack_mxfp4_page)

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")


def make_experts(E, D, F, seed=0, bias_dtype=torch.float32):
    """Random checkpoint tensors of one layer: gate_up blocks/scales [E, 2F, D/32, 16] / [E, 2F, D/32], down
    [E, D, F/32, 16] / [E, D, F/32], biases [E, 2F], [E, D]; scales 2^-5..2^-2 so values stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    gub = torch.randint(0, 256, (E, 2 * F, D // 32, 16), dtype=torch.uint8, generator=g)
    gus = torch.randint(122, 126, (E, 2 * F, D // 32), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (E, D, F // 32, 16), dtype=torch.uint8, generator=g)
    ds = torch.randint(122, 126, (E, D, F // 32), dtype=torch.uint8, generator=g)
    gubias = (torch.randn(E, 2 * F, generator=g) * 0.5).to(bias_dtype)
    dbias = (torch.randn(E, D, generator=g) * 0.5).to(bias_dtype)
    return gub, gus, gubias, db, ds, dbias


def make_routing(T, E, k, seed=0, avoid=None):
    """Top-k ids (distinct per token, never ``avoid``) and softmax weights fp32 [T, k]."""
    g = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(T, E, generator=g)
    if avoid is not None:
        logits[:, avoid] = -float("inf")
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def dense_like_loader(gub, gus, gubias, db, ds, dbias, dtype):
    """What gpt_oss.load_experts builds from the same tensors (its dequantize-on-load path)."""
    from lightning_moe.model.layers import ExpertWeights

    gu = mxfp4_dequantize(gub, gus, dtype)  # [E, D, 2F]
    down = mxfp4_dequantize(db, ds, dtype)  # [E, F, D]
    gubias, dbias = gubias.to(dtype), dbias.to(dtype)
    return ExpertWeights(gu[..., 0::2].transpose(1, 2).contiguous(), gu[..., 1::2].transpose(1, 2).contiguous(),
                         down.transpose(1, 2).contiguous(), gubias[:, 0::2].contiguous(),
                         gubias[:, 1::2].contiguous(), dbias.contiguous())


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("D,F", [(64, 32), (96, 160), (2880 // 45 * 3, 96)])
def test_layout_bytes_and_alignment(D, F):
    """Every segment 16-byte aligned, the page a multiple of 4096 bytes, and mxfp4_expert_bytes (the planner's
    formula) equal to the layout's page_bytes, for bf16 and fp32 biases."""
    for dt in (torch.bfloat16, torch.float32):
        lay = mxfp4_page_layout(D, F, dt)
        assert lay.page_bytes % 4096 == 0 and all(e.offset % 16 == 0 for e in lay.entries)
        assert lay.page_bytes == mxfp4_expert_bytes(D, F, dt.itemsize)
        assert lay.payload_bytes == 3 * D * F * 17 // 32 + (2 * F + D) * dt.itemsize  # 4.25 bits per weight + biases


def test_layout_refuses_sizes_that_are_not_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp4_page_layout(64, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_and_reference_equals_gpt_oss_experts_ffn_exactly(dtype):
    """unpack_mxfp4_page gives the dequantize-on-load tensors bit for bit, and experts_ffn_mxfp4_reference equals
    gpt_oss.experts_ffn over them exactly (1 token, an expert with none, k = 1 and 4)."""
    from lightning_moe.model.families import gpt_oss

    E, D, F = 6, 96, 64
    t = make_experts(E, D, F, seed=3)
    pages, lay = pack_mxfp4_pages(*t)
    ew = dense_like_loader(*t, dtype)
    for got, want in zip(unpack_mxfp4_page(pages, lay, dtype), (ew.w1, ew.w3, ew.w2, ew.b1, ew.b3, ew.b2)):
        assert got.dtype == dtype and torch.equal(got, want)
    assert all(torch.equal(a, b[2]) for a, b in zip(unpack_mxfp4_page(pages[2], lay, dtype),
                                                     unpack_mxfp4_page(pages, lay, dtype)))
    for T, k, avoid in ((1, 1, None), (7, 4, 2), (13, 2, 0)):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(dtype)
        w, ids = make_routing(T, E, k, seed=T, avoid=avoid)
        for limit, alpha in ((1.0, 1.702), (7.0, 1.702)):
            ref = experts_ffn_mxfp4_reference(x, pages, lay, w, ids, limit=limit, alpha=alpha)
            want = gpt_oss.experts_ffn(x, ew, w, ids, limit=limit, alpha=alpha)
            assert ref.dtype == dtype and torch.equal(ref, want)


# ---------------------------------------------------------------------------------------------------
# the Triton kernel under Triton's CPU interpreter
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first, in compiled mode: see tests/test_kernels_ref.py)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


# (T, D, F, E, k, expert without tokens)
CASES = [(1, 64, 32, 4, 1, None), (7, 96, 160, 5, 4, 2), (33, 64, 96, 8, 2, 5), (5, 160, 32, 3, 3, None)]
CASE_IDS = ["T1-k1", "T7-k4-empty-expert-D96-F160", "T33-k2-empty-expert", "T5-k3-D160"]


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", [None, MoEKernelConfig(16, 16, 32, 1, 1), MoEKernelConfig(16, 16, 16, 1, 1)],
                         ids=["default", "tiny-tiles", "k16"])  # block_k 16: one column at a time even when paired
@pytest.mark.parametrize("paired", [False, True], ids=["one-column", "paired-nibbles"])
def test_kernel_matches_reference_in_the_interpreter(interpret, case, dtype, tol, config, paired, monkeypatch):
    monkeypatch.setattr(mxfp4, "PAIRED_NIBBLES", paired)
    T, D, F, E, k, avoid = case
    t = make_experts(E, D, F, seed=T, bias_dtype=dtype)
    pages, lay = pack_mxfp4_pages(*t)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7 + T)).to(dtype)
    w, ids = make_routing(T, E, k, seed=T, avoid=avoid)
    for limit in (1.0, 7.0):  # 1.0: the clamps bite on many elements
        got = fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=limit, alpha=1.702, config=config)
        want = experts_ffn_mxfp4_reference(x, pages, lay, w, ids, limit=limit, alpha=1.702)
        assert got.dtype == dtype and got.shape == (T, D)
        assert rel_err(got, want) <= tol, (limit, rel_err(got, want))


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("config", [None, MoEKernelConfig(16, 16, 64, 1, 1), MoEKernelConfig(16, 32, 128, 1, 1)],
                         ids=["default", "k64", "k128-past-D"])
@pytest.mark.parametrize("joint", [False, True], ids=["gate-up-apart", "gate-up-joint"])
def test_dot_scaled_kernel_matches_reference_bf16(interpret, case, config, joint, monkeypatch):
    """bf16 x: the packed bytes and scales go to tl.dot_scaled (DOT_SCALED, block_k >= 64; JOINT_GATE_UP: one dot
    over the block's interleaved gate/up rows, split after), which the interpreter runs as Triton defines it; scales over 2^-27..2^13 (E8M0 100..140) so a wrong exponent shows; 1e-2 (bf16
    rounding of the reference's dequantized weights and its outputs)."""
    monkeypatch.setattr(mxfp4, "DOT_SCALED", True)
    monkeypatch.setattr(mxfp4, "JOINT_GATE_UP", joint)
    T, D, F, E, k, avoid = case
    gub, gus, gubias, db, ds, dbias = make_experts(E, D, F, seed=T, bias_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(T + 3)
    gus, ds = (torch.randint(100, 141, s.shape, dtype=torch.uint8, generator=g) for s in (gus, ds))
    pages, lay = pack_mxfp4_pages(gub, gus, gubias, db, ds, dbias)
    x = (torch.randn(T, D, generator=torch.Generator().manual_seed(7 + T)) * 2.0**-10).to(torch.bfloat16)
    w, ids = make_routing(T, E, k, seed=T, avoid=avoid)
    for limit in (1.0, 7.0):
        got = fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=limit, alpha=1.702, config=config)
        want = experts_ffn_mxfp4_reference(x, pages, lay, w, ids, limit=limit, alpha=1.702)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert rel_err(got, want) <= 1e-2, (limit, rel_err(got, want))


def test_kernel_configs_pad_within_the_memory_model():
    """Every tile config the MXFP4 and bf16 kernels pick has block_m <= hrm.MAX_BLOCK_M (the pair-index padding the
    memory model counts per expert)."""
    from lightning_moe.policy.hrm import MAX_BLOCK_M

    for pairs in (1, 16 * 8, 64 * 8, 65 * 8, 10**6):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            assert mxfp4.mxfp4_kernel_config(pairs, 8, dt).block_m <= MAX_BLOCK_M
            assert fm.default_kernel_config(pairs, 8, dt).block_m <= MAX_BLOCK_M


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernel_skip_id_and_int32_ids_and_strided_pages(interpret):
    """Pairs with the skip id (E) add nothing; int32 ids; pages with a row stride larger than page_bytes (a slot
    pool) give the same result (fp32, 1e-5)."""
    T, D, F, E, k = 9, 64, 64, 5, 3
    t = make_experts(E, D, F, seed=11)
    pages, lay = pack_mxfp4_pages(*t)
    wide = torch.zeros(E, lay.page_bytes + 4096, dtype=torch.uint8)
    wide[:, : lay.page_bytes] = pages
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    w, ids = make_routing(T, E, k, seed=5)
    skipped = torch.where(ids >= 3, torch.full_like(ids, E), ids)  # experts 3, 4 skipped
    got = fused_experts_mxfp4_triton(x, wide[:, : lay.page_bytes], lay, w, skipped.to(torch.int32), limit=1.0,
                                     alpha=1.702, skip=True)
    w_kept = torch.where(ids >= 3, torch.zeros_like(w), w)
    want = experts_ffn_mxfp4_reference(x, pages, lay, w_kept, torch.where(ids >= 3, 0, ids), limit=1.0, alpha=1.702)
    # the reference sends skipped slots to expert 0 with weight 0: they add exactly 0 (finite values)
    assert rel_err(got, want) <= 1e-5
    assert fused_experts_mxfp4_triton(x[:0], pages, lay, w[:0], ids[:0], limit=1.0, alpha=1.702).shape == (0, D)


def test_kernel_wrapper_refuses_cpu_and_bad_input(monkeypatch):
    """Checked before triton is needed (runs without triton)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = make_experts(4, 64, 32)
    pages, lay = pack_mxfp4_pages(*t)
    x = torch.randn(3, 64)
    w, ids = make_routing(3, 4, 2)
    with pytest.raises(ValueError, match="CUDA"):
        fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=7.0, alpha=1.702)
    with pytest.raises(ValueError, match=r"x must be a floating \[T, D=64\]"):
        fused_experts_mxfp4_triton(x[:, :32], pages, lay, w, ids, limit=7.0, alpha=1.702)
    with pytest.raises(ValueError, match="pages must be uint8"):
        fused_experts_mxfp4_triton(x, pages[:, :-16], lay, w, ids, limit=7.0, alpha=1.702)
    with pytest.raises(ValueError, match="limit must be > 0"):
        fused_experts_mxfp4_triton(x, pages, lay, w, ids, limit=0.0, alpha=1.702)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernel_nan_workspaces(interpret, monkeypatch):
    """Issue 41: every buffer the wrapper allocates NaN-filled (nan_empty): padded rows (tiny tiles) are masked and
    the skipped pairs' slot rows are zeroed, so the result is finite and equals the reference (fp32, 1e-5)."""
    from tests.support.nan_workspace import nan_empty

    nan_empty(monkeypatch)
    T, D, F, E, k = 11, 64, 64, 5, 3
    pages, lay = pack_mxfp4_pages(*make_experts(E, D, F, seed=13))
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    w, ids = make_routing(T, E, k, seed=6)
    w_kept = torch.where(ids >= 3, torch.zeros_like(w), w)
    want = experts_ffn_mxfp4_reference(x, pages, lay, w_kept, torch.where(ids >= 3, 0, ids), limit=7.0, alpha=1.702)
    for cfg in (None, MoEKernelConfig(16, 16, 32, 1, 1)):
        got = fused_experts_mxfp4_triton(x, pages, lay, w, torch.where(ids >= 3, torch.full_like(ids, E), ids),
                                         limit=7.0, alpha=1.702, skip=True, config=cfg)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-5, cfg
