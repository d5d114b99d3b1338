"""CPU tests of lightning_moe.kernels.quant: group-wise quantization and its error bound, fixed-size expert
pages, the quantized reference FFN and (when triton is installed) the page kernel under Triton's CPU
interpreter. Every test draws fresh inputs from a fixed seed and states its tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.fused_moe import MoEKernelConfig, experts_ffn_reference
from lightning_moe.kernels.quant import (
    PAGE_SCHEMES,
    analytic_error_bound,
    dequantize,
    expert_page_layout,
    expert_tensor_specs,
    experts_ffn_qt_reference,
    fused_experts_quant_triton,
    quant_tensors_from_views,
    experts_ffn_quant_reference,
    fused_experts_paged_triton,
    pack_expert_page,
    pack_expert_pages,
    page_quant_tensors,
    page_weight_views,
    quant_error_bound,
    quantize_groupwise,
    unpack_expert_page,
    _pack_codes,
    _unpack_codes,
)

QUANT_SCHEMES = ["int4", "int2-up"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_experts(E, D, Fd, dtype=torch.bfloat16, seed=0):
    g = gen(seed)
    w1 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w3 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, Fd, generator=g) / Fd**0.5).to(dtype)
    return w1, w3, w2


def make_routing(T, E, k, skip, seed):
    g = gen(seed)
    allowed = torch.tensor([e for e in range(E) if e != skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    return torch.rand(T, k, generator=g).softmax(-1), ids.to(torch.int64)


# ---------------------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("cols", [256, 200, 100], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_error_within_bound(bits, group_size, cols, wdtype):
    """|w - deq(q(w))| <= stored scale/2 + 2^-23|w| per element (fp16 scales), and the stored scale exceeds the
    analytic (max-min)/(2^bits-1) by at most a relative 2^-8 (outward fp16 rounding)."""
    w = (torch.randn(2, 24, cols, generator=gen(bits * 1000 + group_size + cols)) * 0.05).to(wdtype)
    w[0, 3, 5] = 0.4  # an outlier group
    qt = quantize_groupwise(w, bits, group_size)
    assert qt.shape == tuple(w.shape) and qt.bits == bits and qt.group_size == group_size
    assert qt.packed.dtype == torch.uint8 and qt.packed.shape[-1] == -(-cols * bits // 8) == qt.row_bytes
    deq = dequantize(qt, torch.float32)
    assert deq.shape == w.shape
    err = (deq - w.float()).abs()
    bound = quant_error_bound(qt)
    assert bool((err <= bound + 2**-23 * w.float().abs() + 1e-12).all()), float((err - bound).max())
    abound = analytic_error_bound(w, bits, group_size)
    assert bool((bound <= abound * (1 + 2**-8) + 1e-7).all())
    assert float(err.max()) > 0.25 * float(abound.max())  # the bound is not vacuous
    # default dequantize dtype is the weight's dtype
    assert dequantize(qt).dtype == wdtype


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_fp32_scales_meet_analytic_bound(bits):
    """With fp32 scales the analytic bound (max-min)/(2^bits-1)/2 holds up to 1e-6 relative."""
    w = torch.randn(16, 300, generator=gen(20 + bits))
    qt = quantize_groupwise(w, bits, 128, scale_dtype=torch.float32)
    err = (dequantize(qt, torch.float32) - w).abs()
    assert bool((err <= analytic_error_bound(w, bits, 128) * (1 + 1e-6) + 2**-23 * w.abs() + 1e-12).all())


def test_quantize_constant_and_tiny_groups_exact():
    """A constant group reconstructs exactly; a group with a tiny range stays within its bound."""
    w = torch.full((4, 128), 0.125)
    w[1] = -3.0
    w[2, :64] = 1e-6
    w[2, 64:] = 1e-6 + 1e-9
    qt = quantize_groupwise(w, 4, 64)
    deq = dequantize(qt, torch.float32)
    assert torch.equal(deq[[0, 1, 3]], w[[0, 1, 3]])
    assert bool(((deq - w).abs() <= quant_error_bound(qt) + 2**-23 * w.abs()).all())


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_short_last_group(bits):
    """C=101, G=64: the short second group takes its scale/zero from its 37 real columns only, and only
    cdiv(101 * bits, 8) code bytes are stored per row."""
    w = torch.randn(3, 101, generator=gen(21))
    qt = quantize_groupwise(w, bits, 64, scale_dtype=torch.float32)
    assert qt.n_groups == 2 and qt.scales.shape == (3, 2) and qt.packed.shape == (3, -(-101 * bits // 8))
    last = w[:, 64:]
    torch.testing.assert_close(qt.zeros[:, 1], last.amin(-1), rtol=0, atol=0)
    torch.testing.assert_close(qt.scales[:, 1], (last.amax(-1) - last.amin(-1)) / (2**bits - 1), rtol=1e-6, atol=0)
    assert dequantize(qt).shape == (3, 101)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_codes_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (5, 64), generator=gen(22), dtype=torch.int64).to(torch.uint8)
    packed = _pack_codes(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert torch.equal(_unpack_codes(packed, bits), codes)
    if bits == 4:  # documented bit order: even column in the low nibble
        assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)


def test_quantize_rejects_bad_input():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bits"):
        quantize_groupwise(w, 3)
    with pytest.raises(ValueError, match="group_size"):
        quantize_groupwise(w, 2, group_size=0)
    with pytest.raises(ValueError, match="floating"):
        quantize_groupwise(torch.ones(4, 64, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_groupwise(torch.full((4, 64), float("nan")), 4)
    with pytest.raises(ValueError, match="overflow"):
        quantize_groupwise(torch.tensor([[-1e6, 1e6] * 32]), 4, 64)  # range / 15 > fp16 max
    quantize_groupwise(torch.tensor([[-1e6, 1e6] * 32]), 4, 64, scale_dtype=torch.bfloat16)  # fine in bf16


# ---------------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", sorted(PAGE_SCHEMES))
@pytest.mark.parametrize("D,Fd,G", [(64, 48, 32), (100, 72, 128), (101, 37, 64), (4096, 14336, 128)])
def test_page_layout_sizes_and_alignment(scheme, D, Fd, G):
    """Segments are 16-byte aligned, disjoint, inside the page; page_bytes is a multiple of 4096; byte counts
    follow the documented formula."""
    lay = expert_page_layout(D, Fd, scheme, group_size=G)
    assert lay.page_bytes % 4096 == 0
    end = 0
    for s in lay.entries:
        assert s.offset % 16 == 0 and end <= s.offset < end + 16
        end = s.offset + s.nbytes
    assert end <= lay.page_bytes < end + 4096
    sch = PAGE_SCHEMES[scheme]
    if lay.quantized:
        ng = lambda c: -(-c // G)  # noqa: E731
        rb = lambda c, b: -(-c * b // 8)  # noqa: E731
        assert lay.entry("w1").nbytes == Fd * rb(D, sch.bits_w1)
        assert lay.entry("w3").nbytes == Fd * rb(D, sch.bits_w3)
        assert lay.entry("w2").nbytes == D * rb(Fd, sch.bits_w2)
        assert lay.entry("w1.zeros").nbytes == Fd * ng(D) * 2
        assert lay.entry("w2.scales").nbytes == D * ng(Fd) * 2
    else:
        isz = torch.empty((), dtype=sch.weight_dtype).element_size()
        assert lay.payload_bytes == 3 * D * Fd * isz
    if (D, Fd) == (4096, 14336):  # Mixtral 8x7B expert: int4 ~ 4.25 bits/weight, int4-up2 ~ 3.6
        bf16 = expert_page_layout(D, Fd, "bf16").page_bytes
        ratio = {"int4": 4.25 / 16, "int2": 2.25 / 16, "int2-up": (4.25 * 2 + 2.25) / 48,
                 "int4-up2": (4.25 * 2 + 2.25) / 48}.get(scheme)
        if ratio is not None:
            assert abs(lay.page_bytes / bf16 - ratio) < 1e-3


# (D, F) of Mixtral 8x7B / 8x22B and of small test models: every segment is a multiple of 16 bytes.
@pytest.mark.parametrize("D,Fd", [(4096, 14336), (6144, 16384), (32, 48), (64, 128), (128, 352)])
@pytest.mark.parametrize("scheme", ["bf16", "fp16", "fp32", "int4", "int2", "int2-up"])
def test_page_bytes_match_spec_formula(D, Fd, scheme):
    """page_bytes == roundup(sum_proj out*in*bits/8 (+ out*cdiv(in,128)*4 if quantized), 4096), the formula of
    MoESpec.expert_bytes in model/spec.py (restated here so kernels/ tests stay independent of model/)."""
    bits = {"bf16": (16,) * 3, "fp16": (16,) * 3, "fp32": (32,) * 3, "int4": (4,) * 3, "int2": (2,) * 3,
            "int2-up": (4, 2, 4)}[scheme]
    quant = scheme.startswith("int")
    raw = 0
    for (out, inp), b in zip(((Fd, D), (Fd, D), (D, Fd)), bits):
        raw += -(-out * inp * b // 8) + (out * -(-inp // 128) * 4 if quant else 0)
    assert expert_page_layout(D, Fd, scheme).page_bytes == -(-raw // 4096) * 4096


def test_page_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown scheme"):
        expert_page_layout(64, 48, "int3")
    with pytest.raises(ValueError, match="segment_align"):
        expert_page_layout(64, 48, "int4", segment_align=8)
    with pytest.raises(ValueError, match="align must be"):
        expert_page_layout(64, 48, "int4", align=1000)
    with pytest.raises(ValueError, match="group_size"):
        expert_page_layout(64, 48, "int4-up2", group_size=0)


@pytest.mark.parametrize("scheme", sorted(PAGE_SCHEMES))
@pytest.mark.parametrize("D,Fd,G", [(64, 48, 32), (100, 72, 128), (100, 200, 64), (101, 37, 48)])
def test_page_roundtrip(scheme, D, Fd, G):
    """Unquantized pages round-trip exactly; quantized pages decode to exactly dequantize(quantize(w));
    every page of the layer has the same byte size; pack_expert_pages row e == pack_expert_page(e)."""
    w1, w3, w2 = make_experts(3, D, Fd, seed=30)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=G)
    assert pages.dtype == torch.uint8 and pages.shape == (3, lay.page_bytes)
    for e in range(3):
        page = pack_expert_page(w1[e], w3[e], w2[e], scheme, group_size=G)
        assert page.shape == (lay.page_bytes,)
        assert torch.equal(page, pages[e])
        got = unpack_expert_page(page, lay)
        for proj, w, g in zip(("w1", "w3", "w2"), (w1[e], w3[e], w2[e]), got):
            assert g.shape == w.shape
            if lay.quantized:
                want = dequantize(quantize_groupwise(w, lay.spec.bits(proj), G), torch.bfloat16)
            else:
                want = w.to(lay.spec.weight_dtype)
            assert torch.equal(g, want), (scheme, proj)
    # stacked decode equals per-page decode
    for a, b in zip(unpack_expert_page(pages, lay), unpack_expert_page(pages[1], lay)):
        assert torch.equal(a[1], b)


def test_pack_into_pool_slot_and_views():
    """out= writes into a slot of a bigger pool; views are zero-copy."""
    w1, w3, w2 = make_experts(2, 64, 48, seed=31)
    lay = expert_page_layout(64, 48, "bf16")
    pool = torch.full((2, lay.page_bytes), 7, dtype=torch.uint8)
    pack_expert_page(w1[1], w3[1], w2[1], lay, out=pool[1])
    v1, v3, v2 = page_weight_views(pool, lay)
    assert v1.data_ptr() == pool[:, lay.entry("w1").offset:].data_ptr()
    assert torch.equal(v1[1], w1[1]) and torch.equal(v3[1], w3[1]) and torch.equal(v2[1], w2[1])
    assert bool((pool[0] == 7).all())
    qlay = expert_page_layout(64, 48, "int4", group_size=32)
    with pytest.raises(ValueError, match="out must be"):
        pack_expert_page(w1[0], w3[0], w2[0], qlay, out=pool[0])
    with pytest.raises(ValueError, match="quantized"):
        page_weight_views(torch.zeros(qlay.page_bytes, dtype=torch.uint8), qlay)
    with pytest.raises(ValueError, match="page must be"):
        page_quant_tensors(torch.zeros(qlay.page_bytes + 1, dtype=torch.uint8), qlay)
    with pytest.raises(ValueError, match="layout is for"):
        pack_expert_page(w1[0], w3[0], w2[0], expert_page_layout(32, 48, "int4", group_size=32))


# ---------------------------------------------------------------------------------------------------
# quantized reference FFN
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", sorted(PAGE_SCHEMES))
def test_quant_reference_equals_dense_reference_on_decoded_weights(scheme):
    """experts_ffn_quant_reference == experts_ffn_reference on the decoded weights (bit-exact)."""
    E, D, Fd, T, k = 6, 100, 72, 33, 2
    dtype = torch.float32 if scheme == "fp32" else (torch.float16 if scheme == "fp16" else torch.bfloat16)
    w1, w3, w2 = make_experts(E, D, Fd, dtype, seed=32)
    wts, ids = make_routing(T, E, k, skip=2, seed=33)
    x = torch.randn(T, D, generator=gen(34)).to(dtype)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=32)
    d1, d3, d2 = unpack_expert_page(pages, lay, dtype)
    got = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    assert torch.equal(got, experts_ffn_reference(x, d1, d3, d2, wts, ids))
    if not lay.quantized:
        assert torch.equal(got, experts_ffn_reference(x, w1, w3, w2, wts, ids))
    else:  # sanity: quantization error of Gaussian weights (measured 0.13 int4, 0.41 int2-up at G=32)
        limit = {"int4": 0.2, "int2-up": 0.6, "int4-up2": 0.6, "int2": 0.8}[scheme]
        assert rel_err(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) < limit


def test_quant_tensors_from_struct_of_arrays_views():
    """A pager that stores each segment as one stacked [E, *shape] tensor (struct of arrays) gets the same
    QuantTensors, dequantized weights and FFN as from the page buffer."""
    E, D, Fd = 4, 100, 72
    w1, w3, w2 = make_experts(E, D, Fd, torch.bfloat16, seed=35)
    pages, lay = pack_expert_pages(w1, w3, w2, "int2-up", group_size=32)
    specs = expert_tensor_specs(lay)
    assert [n for n, _, _ in specs] == [s.name for s in lay.entries]
    page_q = page_quant_tensors(pages, lay)
    soa = {}
    for (name, dt, shape), q in zip(specs, [t for q in page_q for t in (q.packed, q.scales, q.zeros)]):
        assert q.dtype == dt and tuple(q.shape[1:]) == shape
        soa[name] = q.contiguous()
    soa_q = quant_tensors_from_views(soa, lay)
    for a, b in zip(soa_q, page_q):
        assert a.shape == b.shape and a.bits == b.bits and torch.equal(dequantize(a), dequantize(b))
    wts, ids = make_routing(9, E, 2, None, seed=36)
    x = torch.randn(9, D, generator=gen(37)).to(torch.bfloat16)
    assert torch.equal(experts_ffn_qt_reference(x, *soa_q, wts, ids),
                       experts_ffn_quant_reference(x, pages, lay, wts, ids))
    with pytest.raises(ValueError, match="no tensor"):
        quant_tensors_from_views({k: v for k, v in soa.items() if k != "w3.zeros"}, lay)
    with pytest.raises(ValueError, match="must be"):
        quant_tensors_from_views(dict(soa, **{"w1": soa["w1"][..., :-1]}), lay)


# ---------------------------------------------------------------------------------------------------
# Triton page kernel under the CPU interpreter (the real GPU run is tests/gpu)
# ---------------------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels in Triton's CPU interpreter. triton is imported first, in compiled mode: importing it
    under TRITON_INTERPRET=1 would turn triton's own @jit helpers into interpreter objects for the rest of
    the session and could break compiled Triton code (e.g. tests/gpu) run later in the same process."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


# (T, D, F, E, k, skipped expert, group size)
PAGED_CASES = [(1, 64, 48, 8, 2, None, 32), (33, 100, 72, 8, 2, 3, 64), (17, 40, 24, 6, 3, 5, 32),
               (9, 101, 37, 4, 2, None, 48)]


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"T{c[0]}-D{c[1]}-F{c[2]}-k{c[4]}-G{c[6]}")
@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
def test_paged_triton_interpreter_matches_reference(interpret, case, scheme, dtype, tol):
    """fused_experts_paged_triton (interpreted) vs experts_ffn_quant_reference: ||a-b||/||b|| <= tol.
    (The interpreter truncates fp32 -> bf16, so bf16 is left to tests/gpu.)"""
    T, D, Fd, E, k, skip, G = case
    w1, w3, w2 = make_experts(E, D, Fd, torch.float32, seed=40)
    wts, ids = make_routing(T, E, k, skip, seed=41)
    x = torch.randn(T, D, generator=gen(42)).to(dtype)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=G)
    for cfg in (None, MoEKernelConfig(16, 16, 16, 1, 1)):
        got = fused_experts_paged_triton(x, pages, lay, wts, ids, config=cfg)
        want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err(got, want) <= tol


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_paged_triton_interpreter_unquantized_pages(interpret):
    """fp32 pages go through the dense kernel on strided page views (tolerance 1e-5)."""
    w1, w3, w2 = make_experts(8, 100, 72, torch.float32, seed=43)
    wts, ids = make_routing(33, 8, 2, 3, seed=44)
    x = torch.randn(33, 100, generator=gen(45))
    pages, lay = pack_expert_pages(w1, w3, w2, "fp32")
    got = fused_experts_paged_triton(x, pages, lay, wts, ids)
    assert rel_err(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("bits", [(4, 4, 4), (4, 2, 4), (2, 2, 2), (2, 4, 2)], ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("group_size", [40, 48])
def test_quant_triton_interpreter_on_quant_tensors(interpret, bits, group_size):
    """fused_experts_quant_triton on contiguous QuantTensors (fp32 scales, odd D) vs experts_ffn_qt_reference,
    fp32: ||a-b||/||b|| <= 1e-5. G=40 takes the per-element scale path, G=48 the one-group-per-tile path."""
    E, D, Fd, T, k = 5, 101, 37, 13, 2
    w1, w3, w2 = make_experts(E, D, Fd, torch.float32, seed=48)
    qs = [quantize_groupwise(w, b, group_size, scale_dtype=torch.float32) for w, b in zip((w1, w3, w2), bits)]
    wts, ids = make_routing(T, E, k, 1, seed=49)
    x = torch.randn(T, D, generator=gen(50))
    got = fused_experts_quant_triton(x, *qs, wts, ids, config=MoEKernelConfig(16, 16, 32, 1, 1))
    assert rel_err(got, experts_ffn_qt_reference(x, *qs, wts, ids)) <= 1e-5


def test_quant_tile_fitting():
    """block_k is fitted to the group size; groups that are not multiples of 16 get capped tiles."""
    from lightning_moe.kernels.quant import _quant_tiles

    big = MoEKernelConfig(64, 128, 64, 8, 3)
    assert _quant_tiles(big, (128, 128)) == (big, True)
    assert _quant_tiles(big, (128, 32))[0].block_k == 32 and _quant_tiles(big, (128, 32))[1]
    assert _quant_tiles(big, (48, 48))[0].block_k == 16 and _quant_tiles(big, (48, 48))[1]
    cfg, tile = _quant_tiles(big, (40, 128))
    assert not tile and cfg.block_n == 64 and cfg.block_k == 32


def test_paged_triton_rejects_bad_input(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w1, w3, w2 = make_experts(4, 64, 48, torch.float32, seed=46)
    wts, ids = make_routing(5, 4, 2, None, seed=47)
    x = torch.randn(5, 64)
    pages, lay = pack_expert_pages(w1, w3, w2, "int4", group_size=32)
    with pytest.raises(ValueError, match="CUDA"):
        fused_experts_paged_triton(x, pages, lay, wts, ids)
    with pytest.raises(ValueError, match="stacked"):
        fused_experts_paged_triton(x, pages[0], lay, wts, ids)
    with pytest.raises(ValueError, match="hidden size"):
        fused_experts_paged_triton(x[:, :32], pages, lay, wts, ids)
    with pytest.raises(ValueError, match="uint8"):
        fused_experts_paged_triton(x, pages.float(), lay, wts, ids)
    with pytest.raises(ValueError, match="PageLayout"):
        fused_experts_paged_triton(x, pages, "int4", wts, ids)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quant_triton_interpreter_nan_workspaces(interpret, monkeypatch):
    """Issue 41: every buffer the wrapper allocates NaN-filled (nan_empty), and NaN-filled dense scratch for the
    "dequant" mode: both modes, with and without the skip id, stay finite and equal experts_ffn_qt_reference (fp32,
    1e-5): padded rows are masked, skipped pairs' slot rows zeroed, the scratch fully overwritten."""
    from tests.support.nan_workspace import nan_empty

    nan_empty(monkeypatch)
    E, D, Fd, T, k = 5, 101, 37, 13, 2
    w1, w3, w2 = make_experts(E, D, Fd, torch.float32, seed=53)
    qs = [quantize_groupwise(w, 4, 48, scale_dtype=torch.float32) for w in (w1, w3, w2)]
    wts, ids = make_routing(T, E, k, 1, seed=54)
    x = torch.randn(T, D, generator=gen(55))
    drop = ids >= 3
    kept_w = torch.where(drop, torch.zeros_like(wts), wts)
    want, want_kept = (experts_ffn_qt_reference(x, *qs, w_, ids) for w_ in (wts, kept_w))
    scratch = tuple(torch.full(tuple(q.shape), float("nan")) for q in qs)
    cfg = MoEKernelConfig(16, 16, 32, 1, 1)
    for mode, extra in (("fused", {}), ("dequant", {"scratch": scratch})):
        got = fused_experts_quant_triton(x, *qs, wts, ids, config=cfg, mode=mode, **extra)
        kept = fused_experts_quant_triton(x, *qs, wts, torch.where(drop, torch.full_like(ids, E), ids), config=cfg,
                                          mode=mode, skip=True, **extra)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-5, mode
        assert torch.isfinite(kept).all() and rel_err(kept, want_kept) <= 1e-5, mode
