"""GPU tests of quantization on CUDA and of the Triton FFN read from packed expert pages
(lightning_moe.kernels.quant.fused_experts_paged_triton).

Tolerance of the page kernel vs experts_ffn_quant_reference: ||a - b|| / ||b|| <= 1e-2 in bf16 / fp16
(both use the same dequantized bf16 weights, bit for bit; the difference is rounding of the
intermediates, expected ~5e-3). Quantization on CUDA must equal CPU quantization exactly (float64 math).
Every test draws fresh inputs from a fixed seed. Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels.fused_moe import MoEKernelConfig, experts_ffn_reference
from lightning_moe.kernels.quant import (
    dequantize,
    expert_page_layout,
    experts_ffn_qt_reference,
    experts_ffn_quant_reference,
    fused_experts_paged_triton,
    fused_experts_quant_triton,
    pack_expert_pages,
    quantize_groupwise,
)

from tests.support.moe_inputs import DEV, SHAPE_IDS, SHAPES, make_inputs, rel_err  # noqa: E402


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("scheme", ["int4", "int2-up", "int2", "bf16"])
@pytest.mark.parametrize("group_size", [128, 64])
def test_paged_kernel_matches_quant_reference_bf16(shape, scheme, group_size):
    """fused_experts_paged_triton vs experts_ffn_quant_reference, bf16: rel. L2 <= 1e-2."""
    x, w1, w3, w2, wts, ids = make_inputs(*shape, dtype=torch.bfloat16, seed=200)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=group_size)
    assert pages.is_cuda and pages.shape == (shape[3], lay.page_bytes)
    got = fused_experts_paged_triton(x, pages, lay, wts, ids)
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert bool(torch.isfinite(got).all())
    err = rel_err(got, want)
    assert err <= 1e-2, f"relative error {err:.2e} > 1e-2"


@pytest.mark.parametrize("scheme", ["int4", "int2-up"])
def test_paged_kernel_fp16_and_tile_configs(scheme):
    """fp16 activations and several tile configs: rel. L2 <= 1e-2 against the reference."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.float16, seed=201)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme)
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    for cfg in (None, MoEKernelConfig(16, 16, 16, 1, 2), MoEKernelConfig(64, 128, 64, 8, 3)):
        got = fused_experts_paged_triton(x, pages, lay, wts, ids, config=cfg)
        assert rel_err(got, want) <= 1e-2, cfg


@pytest.mark.parametrize("group_size", [40, 48, 128], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=["s-fp16", "s-bf16"])
def test_quant_tensor_kernel_group_sizes(group_size, scale_dtype):
    """fused_experts_quant_triton on contiguous QuantTensors, mixed bits (4/2/4), bf16 activations, vs
    experts_ffn_qt_reference: rel. L2 <= 1e-2. G=40 takes the per-element scale path (capped tiles),
    G=48 the one-group-per-tile path with block_k=16, G=128 the default path."""
    x, w1, w3, w2, wts, ids = make_inputs(300, 200, 344, 8, 2, 3, torch.bfloat16, seed=207)
    qs = [quantize_groupwise(w, b, group_size, scale_dtype) for w, b in zip((w1, w3, w2), (4, 2, 4))]
    got = fused_experts_quant_triton(x, *qs, wts, ids)
    err = rel_err(got, experts_ffn_qt_reference(x, *qs, wts, ids))
    assert err <= 1e-2, f"relative error {err:.2e} > 1e-2"


def test_paged_kernel_reads_pool_with_larger_row_stride():
    """Pages living in a slot pool whose rows are longer than page_bytes (stride multiple of 256)."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=202)
    pages, lay = pack_expert_pages(w1, w3, w2, "int2-up")
    pool = torch.zeros(8, lay.page_bytes + 512, dtype=torch.uint8, device=DEV)
    pool[:, : lay.page_bytes] = pages
    view = pool[:, : lay.page_bytes]
    got = fused_experts_paged_triton(x, view, lay, wts, ids)
    assert torch.equal(got, fused_experts_paged_triton(x, pages, lay, wts, ids))


def test_paged_kernel_deterministic():
    x, w1, w3, w2, wts, ids = make_inputs(257, 512, 704, 8, 2, None, torch.bfloat16, seed=203)
    pages, lay = pack_expert_pages(w1, w3, w2, "int4")
    assert torch.equal(fused_experts_paged_triton(x, pages, lay, wts, ids),
                       fused_experts_paged_triton(x, pages, lay, wts, ids))


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_on_gpu_equals_cpu(bits):
    """Codes, scales and zeros computed on CUDA are bit-identical to CPU (float64 arithmetic)."""
    w = (torch.randn(4, 96, 300, generator=torch.Generator().manual_seed(204)) * 0.05).to(torch.bfloat16)
    qg, qc = quantize_groupwise(w.to(DEV), bits, 128), quantize_groupwise(w, bits, 128)
    assert torch.equal(qg.packed.cpu(), qc.packed)
    assert torch.equal(qg.scales.cpu(), qc.scales) and torch.equal(qg.zeros.cpu(), qc.zeros)
    assert torch.equal(dequantize(qg).cpu(), dequantize(qc))


def test_pages_on_gpu_equal_cpu_pages():
    """pack_expert_pages on CUDA writes the same bytes as on CPU; the int4 FFN on GPU stays close to bf16."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=205)
    for scheme in ("bf16", "int4", "int2-up"):
        pg, lay = pack_expert_pages(w1, w3, w2, scheme)
        pc, _ = pack_expert_pages(w1.cpu(), w3.cpu(), w2.cpu(), scheme)
        assert torch.equal(pg.cpu(), pc), scheme
    pages, lay = pack_expert_pages(w1, w3, w2, "int4")
    dense = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    assert rel_err(fused_experts_paged_triton(x, pages, lay, wts, ids), dense) < 0.2  # int4 error, Gaussian weights


def test_quantize_checkpoint_on_cuda_writes_the_cpu_bytes(tiny_dir, tmp_path):
    """moe-batch quantize's codes computed on CUDA (expert by expert, pages copied back): the written checkpoint's
    tensors equal the CPU run's, byte for byte."""
    from safetensors.torch import load_file

    from lightning_moe.model.quantize import quantize_checkpoint

    a = quantize_checkpoint(tiny_dir, str(tmp_path / "cpu"), "int4", device="cpu")
    b = quantize_checkpoint(tiny_dir, str(tmp_path / "cuda"), "int4", device="cuda")
    assert a.page_bytes == b.page_bytes
    names = sorted(n for n in (tmp_path / "cpu").iterdir() if n.suffix == ".safetensors")
    assert names
    for n in names:
        ta, tb = load_file(str(n)), load_file(str(tmp_path / "cuda" / n.name))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), n.name


def test_paged_kernel_errors():
    x, w1, w3, w2, wts, ids = make_inputs(4, 128, 256, 8, 2, None, torch.bfloat16, seed=206)
    pages, lay = pack_expert_pages(w1, w3, w2, "fp16")
    with pytest.raises(ValueError, match="store torch.float16"):
        fused_experts_paged_triton(x, pages, lay, wts, ids)
    qpages, qlay = pack_expert_pages(w1, w3, w2, "int4")
    with pytest.raises(ValueError, match="on cpu"):
        fused_experts_paged_triton(x, qpages.cpu(), qlay, wts, ids)
    with pytest.raises(ValueError, match="layout D"):
        fused_experts_paged_triton(x, qpages, expert_page_layout(256, 256, "int4"), wts, ids)


# ---------------------------------------------------------------------------------------------------
# Triton dequantization (dequantize_triton / dequantize_pages_triton) and the large-M "dequant" path
# ---------------------------------------------------------------------------------------------------

from lightning_moe.kernels.quant import (  # noqa: E402
    dense_expert_scratch,
    dequantize_pages_triton,
    dequantize_triton,
    unpack_expert_page,
)

# (bits, group size, columns, scale dtype): short last groups, partial last bytes, both scale paths
DQ_CASES = [(4, 128, 256, torch.float16), (4, 64, 101, torch.bfloat16), (4, 48, 100, torch.float32),
            (2, 32, 101, torch.float16), (2, 128, 200, torch.float32), (2, 40, 100, torch.bfloat16),
            (4, 128, 4096, torch.float16), (2, 128, 14336, torch.float16)]


@pytest.mark.parametrize("case", DQ_CASES, ids=lambda c: f"b{c[0]}-G{c[1]}-C{c[2]}-{str(c[3])[6:]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tiles", [{}, {"block_rows": 16, "block_cols": 32}], ids=["default-tiles", "small-tiles"])
def test_dequantize_triton_bit_exact_gpu(case, dtype, tiles):
    """dequantize_triton on CUDA == dequantize (CUDA and CPU) BIT FOR BIT, 37 rows (partial row tiles), E = 3."""
    bits, G, C, sd = case
    w = torch.randn(3, 37, C, generator=torch.Generator().manual_seed(bits * 1000 + G + C)) * 0.05
    w[1, 5, 3] = 0.7
    qc = quantize_groupwise(w, bits, G, scale_dtype=sd)
    qg = quantize_groupwise(w.to(DEV), bits, G, scale_dtype=sd)
    got = dequantize_triton(qg, dtype, **tiles)
    assert got.is_cuda and got.dtype == dtype and got.shape == (3, 37, C)
    assert torch.equal(got, dequantize(qg, dtype))
    assert torch.equal(got.cpu(), dequantize(qc, dtype))


@pytest.mark.parametrize("scheme", ["int4", "int2", "int2-up"])
@pytest.mark.parametrize("group_size", [128, 64])
def test_dequantize_pages_bit_exact_gpu(scheme, group_size):
    """Pages in a pool with a longer row stride, into a larger reusable scratch: == unpack_expert_page bit for bit
    (bf16 and fp16); rows of the scratch past E stay untouched."""
    x, w1, w3, w2, wts, ids = make_inputs(4, 200, 344, 6, 2, None, torch.bfloat16, seed=210)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme, group_size=group_size)
    pool = torch.zeros(6, lay.page_bytes + 512, dtype=torch.uint8, device=DEV)
    pool[:, : lay.page_bytes] = pages
    for dt in (torch.bfloat16, torch.float16):
        scratch = dense_expert_scratch(8, 200, 344, dt, DEV)
        for t in scratch:
            t.fill_(3.0)
        got = dequantize_pages_triton(pool[:, : lay.page_bytes], lay, dt, out=scratch)
        want = unpack_expert_page(pages, lay, dt)
        for a, s, b in zip(got, scratch, want):
            assert a.data_ptr() == s.data_ptr() and torch.equal(a, b)
            assert bool((s[6:] == 3).all())


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("scheme", ["int4", "int2-up", "int2"])
@pytest.mark.parametrize("mode", ["fused", "dequant"])
def test_paged_kernel_modes_match_quant_reference_bf16(shape, scheme, mode):
    """Every mode of fused_experts_paged_triton vs experts_ffn_quant_reference, bf16: rel. L2 <= 1e-2 (the
    tolerance of the fused kernel above); with the same bf16 weights the two paths differ only in rounding."""
    x, w1, w3, w2, wts, ids = make_inputs(*shape, dtype=torch.bfloat16, seed=211)
    pages, lay = pack_expert_pages(w1, w3, w2, scheme)
    want = experts_ffn_quant_reference(x, pages, lay, wts, ids)
    got = fused_experts_paged_triton(x, pages, lay, wts, ids, mode=mode)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and bool(torch.isfinite(got).all())
    err = rel_err(got, want)
    assert err <= 1e-2, f"{mode}: relative error {err:.2e} > 1e-2"


def test_dequant_mode_scratch_reuse_and_determinism():
    """The dequant path writes a caller's scratch (no new weights), is deterministic, and a second layer's pages
    through the same scratch give that layer's result (no stale weights)."""
    x, w1, w3, w2, wts, ids = make_inputs(257, 512, 704, 8, 2, None, torch.bfloat16, seed=212)
    pa, lay = pack_expert_pages(w1, w3, w2, "int4")
    pb, _ = pack_expert_pages(w1.flip(0), w3.flip(0), w2.flip(0), lay)  # another layer: experts in reverse order
    scratch = dense_expert_scratch(8, 512, 704, torch.bfloat16, DEV)
    a1 = fused_experts_paged_triton(x, pa, lay, wts, ids, mode="dequant", scratch=scratch)
    b1 = fused_experts_paged_triton(x, pb, lay, wts, ids, mode="dequant", scratch=scratch)
    a2 = fused_experts_paged_triton(x, pa, lay, wts, ids, mode="dequant", scratch=scratch)
    assert torch.equal(a1, a2) and not torch.equal(a1, b1)
    assert torch.equal(b1, fused_experts_paged_triton(x, pb, lay, wts, ids, mode="dequant"))
    assert rel_err(b1, experts_ffn_quant_reference(x, pb, lay, wts, ids)) <= 1e-2
