"""CPU tests of the Triton dequantization of packed experts (kernels.quant.dequantize_triton /
dequantize_pages_triton) and of the large-M "dequant" path of fused_experts_quant_triton /
fused_experts_paged_triton, under Triton's CPU interpreter (the compiled run is tests/gpu/test_quant_gpu.py).

Tolerances: the dequantized weights must equal the torch reference (dequantize / unpack_expert_page) BIT FOR
BIT in fp32 and fp16. bf16 is exact on the GPU only: the interpreter converts fp32 -> bf16 by truncation
(measured here: up to one bf16 ulp off round-to-nearest), so interpreted bf16 is checked to be either the
round-to-nearest or the truncation of the exact fp32 value. The FFN paths use the tolerances of
tests/test_quant.py: ||a - b|| / ||b|| <= 1e-5 (fp32), 1e-2 (fp16). Every test draws inputs from a fixed seed.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels import quant as Q
from lightning_moe.kernels.fused_moe import MoEKernelConfig
from lightning_moe.kernels.quant import (
    dense_expert_scratch,
    dequantize,
    dequantize_pages_triton,
    dequantize_triton,
    expert_page_layout,
    experts_ffn_qt_reference,
    experts_ffn_quant_reference,
    fused_experts_paged_triton,
    fused_experts_quant_triton,
    pack_expert_pages,
    page_quant_tensors,
    quantize_groupwise,
    unpack_expert_page,
)

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecations inside the interpreter


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first, in compiled mode: see tests/test_quant.py)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def bf16_rne_or_trunc(got: torch.Tensor, exact_fp32: torch.Tensor) -> bool:
    """got (bf16) is, per element, the round-to-nearest-even or the truncation of exact_fp32."""
    rne = exact_fp32.to(torch.bfloat16)
    trunc = (exact_fp32.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return bool(((got == rne) | (got == trunc)).all())


# ---------------------------------------------------------------------------------------------------
# tiles (no triton needed)
# ---------------------------------------------------------------------------------------------------


def test_dequant_tiles():
    """8192 output elements per program. G = 128: one group per tile of 128 columns (4 and 2 bits); G = 64, 32:
    narrower one-group tiles; groups without a power-of-two divisor >= 32 take the gather path with 128 columns."""
    assert Q._dequant_tiles(4, 128) == (64, 128, True)
    assert Q._dequant_tiles(2, 128) == (64, 128, True)
    assert Q._dequant_tiles(4, 256) == (64, 128, True)
    assert Q._dequant_tiles(4, 64) == (128, 64, True)
    assert Q._dequant_tiles(2, 32) == (256, 32, True)
    assert Q._dequant_tiles(4, 48) == (64, 128, False)  # largest power-of-two divisor 16 -> gather
    assert Q._dequant_tiles(2, 40) == (64, 128, False)
    assert Q._dequant_tiles(2, 3) == (64, 128, False)
    assert Q._dequant_tiles(4, 1) == (64, 128, False)


# ---------------------------------------------------------------------------------------------------
# dequantize_triton: bit-exact against dequantize
# ---------------------------------------------------------------------------------------------------

# (bits, group size, columns C, scale dtype): C not a multiple of G (short last group), partial last bytes at
# 2 bits (C = 101), one-group-per-tile (G = 128, 64, 32) and gather (G = 48, 40) paths
DQ_CASES = [(4, 128, 256, torch.float16), (4, 64, 101, torch.bfloat16), (4, 48, 100, torch.float32),
            (2, 32, 101, torch.float16), (2, 128, 200, torch.float32), (2, 40, 100, torch.bfloat16)]


@needs_triton
@pytest.mark.parametrize("case", DQ_CASES, ids=lambda c: f"b{c[0]}-G{c[1]}-C{c[2]}-{str(c[3])[6:]}")
@pytest.mark.parametrize("tiles", [{}, {"block_rows": 16, "block_cols": 32}], ids=["default-tiles", "small-tiles"])
def test_dequantize_triton_bit_exact(interpret, case, tiles):
    """E = 3 stacked [37, C] weights (37 rows: partial row tiles): fp32 and fp16 outputs equal dequantize
    bit for bit; bf16 is the RNE or the truncation (interpreter) of the exact fp32 value."""
    bits, G, C, sd = case
    w = torch.randn(3, 37, C, generator=gen(bits * 1000 + G + C)) * 0.05
    w[1, 5, 3] = 0.7  # an outlier group
    q = quantize_groupwise(w, bits, G, scale_dtype=sd)
    for dt in (torch.float32, torch.float16):
        got = dequantize_triton(q, dt, **tiles)
        assert got.dtype == dt and got.shape == (3, 37, C)
        assert torch.equal(got, dequantize(q, dt)), dt
    assert bf16_rne_or_trunc(dequantize_triton(q, torch.bfloat16, **tiles), dequantize(q, torch.float32))


@needs_triton
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("G", [128, 40], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("tiles", [{}, {"block_rows": 16, "block_cols": 32}], ids=["default-tiles", "small-tiles"])
def test_dequantize_triton_random_codes_into_strided_out(interpret, bits, G, tiles):
    """Fresh random codes (every bit of every byte, including the unused codes of the last byte), scales and
    zeros; E = 3 stacked [70, 301] (R and C not multiples of any tile, C odd: the last byte is partial at 4 and
    2 bits; G = 128: one scale per tile row, G = 40: gather) into out = a [5, 70, 301] view with row stride 311
    of a buffer filled with a sentinel: out[:3] == dequantize bit for bit (fp32 and fp16 from fp16 scales,
    fp32 from fp32 scales), and nothing else of the buffer (columns >= C, experts >= E) is written."""
    E, R, C = 3, 70, 301
    g = gen(7000 + bits * 100 + G + len(tiles))
    RB, NG = -(-C * bits // 8), -(-C // G)
    packed = torch.randint(0, 256, (E, R, RB), generator=g, dtype=torch.uint8)
    for sd, dts in ((torch.float16, (torch.float32, torch.float16)), (torch.float32, (torch.float32,))):
        scales = (torch.rand(E, R, NG, generator=g) * 0.1 + 1e-3).to(sd)
        zeros = (torch.randn(E, R, NG, generator=g) * 0.2).to(sd)
        q = Q.QuantTensor(packed, scales, zeros, (E, R, C), bits, G, torch.float32)
        for dt in dts:
            buf = torch.full((E + 2, R, C + 10), -123.0, dtype=dt)
            out = buf[..., :C]
            got = dequantize_triton(q, dt, out, **tiles)
            assert got.data_ptr() == buf.data_ptr() and got.shape == (E, R, C)
            assert torch.equal(got, dequantize(q, dt)), (sd, dt)
            assert bool((buf[..., C:] == -123).all()) and bool((buf[E:] == -123).all()), (sd, dt)


@needs_triton
def test_dequantize_triton_2d_and_out_buffer(interpret):
    """A 2-D QuantTensor; out= with more rows than experts: rows [:E] written (a view of out is returned),
    the rest untouched; wrong out buffers are refused."""
    w = torch.randn(2, 40, 96, generator=gen(1))
    q = quantize_groupwise(w, 4, 32)
    assert torch.equal(dequantize_triton(q.select(1), torch.float32), dequantize(q.select(1), torch.float32))
    out = torch.full((5, 40, 96), 7.0)
    got = dequantize_triton(q, torch.float32, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (2, 40, 96)
    assert torch.equal(out[:2], dequantize(q, torch.float32)) and bool((out[2:] == 7).all())
    o2 = torch.empty(40, 96)
    assert dequantize_triton(q.select(0), torch.float32, o2).data_ptr() == o2.data_ptr()
    for bad in (torch.empty(1, 40, 96), torch.empty(2, 40, 96, dtype=torch.float16), torch.empty(2, 96, 40),
                torch.empty(2, 40, 192)[..., ::2]):
        with pytest.raises(ValueError, match="out must be"):
            dequantize_triton(q, torch.float32, bad)
    with pytest.raises(ValueError, match="powers of two"):
        dequantize_triton(q, torch.float32, block_rows=24)
    with pytest.raises(ValueError, match="powers of two"):
        dequantize_triton(q, torch.float32, block_cols=48)
    with pytest.raises(ValueError, match="codes per byte"):
        dequantize_triton(quantize_groupwise(w, 2, 32), torch.float32, block_cols=2)  # < 4 codes of a byte


@needs_triton
@pytest.mark.parametrize("scheme", ["int4", "int2", "int2-up", "int4-up2"])
def test_dequantize_pages_triton_equals_unpack(interpret, scheme):
    """Pages (D = 100, F = 72, G = 32; int2-up: gate/down 4 bits, up 2 bits) in a slot pool whose rows are longer
    than page_bytes: dequantize_pages_triton == unpack_expert_page bit for bit (fp32, fp16), into a reusable
    scratch with more rows; a single page gives 2-D weights."""
    E, D, Fd = 4, 100, 72
    g = gen(2)
    w1, w3, w2 = (torch.randn(E, *s, generator=g) * 0.1 for s in ((Fd, D), (Fd, D), (D, Fd)))
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=32)
    pool = torch.zeros(E, lay.page_bytes + 256, dtype=torch.uint8)
    pool[:, : lay.page_bytes] = pages
    view = pool[:, : lay.page_bytes]
    for dt in (torch.float32, torch.float16):
        want = unpack_expert_page(pages, lay, dt)
        got = dequantize_pages_triton(view, lay, dt)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), dt
        scratch = dense_expert_scratch(6, D, Fd, dt, "cpu")
        got = dequantize_pages_triton(view, lay, dt, out=scratch)
        assert all(a.data_ptr() == s.data_ptr() and torch.equal(a, b) for a, s, b in zip(got, scratch, want))
    one = dequantize_pages_triton(pages[2], lay, torch.float32)
    assert [t.shape for t in one] == [(Fd, D), (Fd, D), (D, Fd)]
    assert all(torch.equal(a, b) for a, b in zip(one, unpack_expert_page(pages[2], lay, torch.float32)))


def test_dequantize_rejects_bad_input(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.randn(2, 16, 64, generator=gen(3))
    q = quantize_groupwise(w, 4, 32)
    with pytest.raises(ValueError, match="CUDA"):
        dequantize_triton(q)
    with pytest.raises(ValueError, match="QuantTensor"):
        dequantize_triton(w)
    with pytest.raises(ValueError, match="dtype"):
        dequantize_triton(q, torch.int32)
    pages, lay = pack_expert_pages(torch.randn(2, 16, 48), torch.randn(2, 16, 48), torch.randn(2, 48, 16), "bf16")
    with pytest.raises(ValueError, match="not quantized"):
        dequantize_pages_triton(pages, lay)
    qpages, qlay = pack_expert_pages(torch.randn(2, 16, 48), torch.randn(2, 16, 48), torch.randn(2, 48, 16), "int4",
                                     group_size=16)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_pages_triton(qpages, qlay, out=torch.empty(1))
    with pytest.raises(ValueError, match="PageLayout"):
        dequantize_pages_triton(qpages, "int4")
    x, wts, ids = torch.randn(3, 48), torch.full((3, 2), 0.5), torch.tensor([[0, 1]] * 3)
    with pytest.raises(ValueError, match="mode"):
        fused_experts_paged_triton(x, qpages, qlay, wts, ids, mode="fast")
    with pytest.raises(ValueError, match="mode"):
        fused_experts_paged_triton(x, pages, lay, wts, ids, mode="fast")  # checked for dense pages too
    with pytest.raises(ValueError, match="mode"):
        fused_experts_quant_triton(x, *page_quant_tensors(qpages, qlay), wts, ids, mode="Dequant")


# ---------------------------------------------------------------------------------------------------
# FFN: "fused" and "dequant" against the reference
# ---------------------------------------------------------------------------------------------------

# (T, D, F, E, k, expert given no tokens, group size): 1 token, 33 tokens with an idle expert, D and F not
# multiples of the group, T k / E >= 16, k = 3
FFN_CASES = [(1, 64, 48, 8, 2, None, 32), (33, 100, 72, 8, 2, 3, 64), (9, 101, 37, 4, 2, None, 48),
             (40, 64, 48, 4, 2, 1, 32), (17, 40, 24, 6, 3, 5, 32)]


def _routing(T, E, k, skip, seed):
    g = gen(seed)
    allowed = torch.tensor([e for e in range(E) if e != skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    return torch.rand(T, k, generator=g).softmax(-1), ids.to(torch.int64)


@needs_triton
@pytest.mark.parametrize("case", FFN_CASES, ids=lambda c: f"T{c[0]}-D{c[1]}-F{c[2]}-E{c[3]}-k{c[4]}-G{c[6]}")
@pytest.mark.parametrize("scheme", ["int4", "int2-up"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
def test_paged_modes_match_reference(interpret, monkeypatch, case, scheme, dtype, tol):
    """fused_experts_paged_triton with mode fused / dequant (with and without a scratch) and the default mode
    (dequant) vs experts_ffn_quant_reference: ||a-b||/||b|| <= tol."""
    T, D, Fd, E, k, skip, G = case
    g = gen(60)
    w1, w3, w2 = (torch.randn(E, *s, generator=g) / s[1] ** 0.5 for s in ((Fd, D), (Fd, D), (D, Fd)))
    wts, ids = _routing(T, E, k, skip, seed=61)
    x = torch.randn(T, D, generator=gen(62)).to(dtype)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=G)
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    launches = []
    real = Q.dequantize_triton
    monkeypatch.setattr(Q, "dequantize_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    scratch = dense_expert_scratch(E + 1, D, Fd, dtype, "cpu")
    for mode, sc in (("fused", None), ("dequant", None), ("dequant", scratch)):
        launches.clear()
        got = fused_experts_paged_triton(x, pages, lay, wts, ids, mode=mode, scratch=sc)
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err(got, want) <= tol, (mode, rel_err(got, want))
        assert len(launches) == (3 if mode == "dequant" else 0), mode  # one launch per projection, all E experts
    launches.clear()
    assert rel_err(fused_experts_paged_triton(x, pages, lay, wts, ids, scratch=scratch), want) <= tol  # default mode
    assert len(launches) == 3


@needs_triton
@pytest.mark.parametrize("bits", [(4, 2, 4), (2, 4, 2)], ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("group_size", [40, 48])
def test_quant_tensor_dequant_mode(interpret, bits, group_size):
    """fused_experts_quant_triton(mode="dequant") on contiguous QuantTensors with mixed bits and fp32 scales (odd
    D = 101, F = 37) equals the fused mode's reference, fp32 ||a-b||/||b|| <= 1e-5 (as test_quant.py)."""
    E, D, Fd, T, k = 5, 101, 37, 13, 2
    g = gen(63)
    ws = [torch.randn(E, *s, generator=g) / s[1] ** 0.5 for s in ((Fd, D), (Fd, D), (D, Fd))]
    qs = [quantize_groupwise(w, b, group_size, scale_dtype=torch.float32) for w, b in zip(ws, bits)]
    wts, ids = _routing(T, E, k, 1, seed=64)
    x = torch.randn(T, D, generator=gen(65))
    want = experts_ffn_qt_reference(x, *qs, wts, ids)
    got = fused_experts_quant_triton(x, *qs, wts, ids, mode="dequant", config=MoEKernelConfig(16, 16, 32, 1, 1))
    assert rel_err(got, want) <= 1e-5
    empty = fused_experts_quant_triton(x[:0], *qs, wts[:0], ids[:0], mode="dequant")
    assert empty.shape == (0, D)


@needs_triton
def test_dense_pages_ignore_mode(interpret):
    """Unquantized pages are already dense: every mode runs the dense kernel on the page views (fp32, 1e-5)."""
    E, D, Fd = 4, 64, 48
    g = gen(66)
    w1, w3, w2 = (torch.randn(E, *s, generator=g) / s[1] ** 0.5 for s in ((Fd, D), (Fd, D), (D, Fd)))
    pages, lay = pack_expert_pages(w1, w3, w2, "fp32")
    wts, ids = _routing(40, E, 2, None, seed=67)
    x = torch.randn(40, D, generator=gen(68))
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    for mode in ("fused", "dequant"):
        assert rel_err(fused_experts_paged_triton(x, pages, lay, wts, ids, mode=mode), want) <= 1e-5
    assert expert_page_layout(D, Fd, "fp32").page_bytes == lay.page_bytes


@needs_triton
@pytest.mark.parametrize("mode", ["fused", "dequant"])
def test_paged_kernel_skip_pairs_interpreted(interpret, mode):
    """skip=True on packed int4 pages, both paths: pairs with id E add 0, the rest equals the quantized
    reference over only those pairs (fp32, 1e-5)."""
    E, D, Fd, k, T = 4, 64, 96, 2, 9
    g = torch.Generator().manual_seed(41)
    w1, w3 = torch.randn(E, Fd, D, generator=g) / D**0.5, torch.randn(E, Fd, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, Fd, generator=g) / Fd**0.5
    pages, lay = pack_expert_pages(w1, w3, w2, "int4", group_size=32)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g).softmax(-1)
    drop = torch.rand(T, k, generator=g) < 0.4
    got = fused_experts_paged_triton(x, pages, lay, wts, torch.where(drop, torch.full_like(ids, E), ids), mode=mode, skip=True)
    want = experts_ffn_quant_reference(x, pages, lay, torch.where(drop, torch.zeros_like(wts), wts), ids)
    assert (got - want).norm() / want.norm() <= 1e-5
