"""GPU tests of the Triton grouped expert FFN (lightning_moe.kernels.fused_moe.fused_experts_triton).

Compared with the torch reference run on the same GPU. Tolerances, as ||a - b|| / ||b|| (relative L2):
bf16 / fp16 <= 1e-2 (the reference rounds gate, up, h and y to 16 bits, the kernel only h and the
output: expected ~5e-3), fp32 <= 1e-4 (IEEE fp32 dot products, no TF32). Every test draws fresh
inputs from a fixed seed. Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels.fused_moe import (
    MoEKernelConfig,
    default_kernel_config,
    experts_ffn_reference,
    fused_experts_triton,
    moe_align,
)

from tests.support.moe_inputs import DEV, SHAPE_IDS, SHAPES, make_inputs, rel_err  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fused_experts_matches_reference(shape, dtype):
    """Triton vs experts_ffn_reference (order "hf") on the GPU: rel. L2 <= 1e-2 (16-bit) / 1e-4 (fp32)."""
    x, w1, w3, w2, wts, ids = make_inputs(*shape, dtype=dtype, seed=100)
    got = fused_experts_triton(x, w1, w3, w2, wts, ids)
    want = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    assert got.dtype == dtype and got.shape == x.shape and got.is_cuda
    assert bool(torch.isfinite(got).all())
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize(
    "config",
    [MoEKernelConfig(16, 16, 16, 1, 2), MoEKernelConfig(16, 32, 128, 4, 2), MoEKernelConfig(32, 64, 64, 4, 3),
     MoEKernelConfig(64, 128, 64, 8, 3), MoEKernelConfig(128, 128, 32, 8, 4)],
    ids=lambda c: f"m{c.block_m}-n{c.block_n}-k{c.block_k}-w{c.num_warps}-s{c.num_stages}",
)
def test_fused_experts_tile_configs(config):
    """Every tile config gives the same answer within 1e-2 (bf16) on an awkward shape."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=101)
    got = fused_experts_triton(x, w1, w3, w2, wts, ids, config=config)
    assert rel_err(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-2


def test_fused_experts_deterministic_and_int32_ids():
    """No atomics: two runs are bit-identical; int32 ids give the same bits as int64 ids."""
    x, w1, w3, w2, wts, ids = make_inputs(257, 512, 704, 8, 2, None, torch.bfloat16, seed=102)
    a = fused_experts_triton(x, w1, w3, w2, wts, ids)
    b = fused_experts_triton(x, w1, w3, w2, wts, ids.to(torch.int32), validate=False)
    assert torch.equal(a, b)


def test_fused_experts_strided_inputs():
    """Non-contiguous x and weights (transposed storage) match the reference within 1e-2 (bf16)."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.bfloat16, seed=103)
    xs = torch.stack([x, x], dim=-1)[..., 0]  # == x, strides (2D, 2)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # stride along D != 1
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    got = fused_experts_triton(xs, w1t, w3, w2t, wts, ids)
    assert rel_err(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-2


def test_fused_experts_skipped_expert_is_not_read():
    """NaN weights in an expert that gets no tokens never reach the output."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 4, torch.bfloat16, seed=104)
    for w in (w1, w3, w2):
        w[4] = float("nan")
    assert bool(torch.isfinite(fused_experts_triton(x, w1, w3, w2, wts, ids)).all())


def test_fused_experts_empty_batch_and_errors():
    x, w1, w3, w2, wts, ids = make_inputs(4, 128, 256, 8, 2, None, torch.bfloat16, seed=105)
    assert fused_experts_triton(x[:0], w1, w3, w2, wts[:0], ids[:0]).shape == (0, 128)
    with pytest.raises(ValueError, match="lie in"):
        fused_experts_triton(x, w1, w3, w2, wts, ids + 8)
    with pytest.raises(ValueError, match="on cpu"):
        fused_experts_triton(x, w1.cpu(), w3, w2, wts, ids)


def test_moe_align_on_gpu_matches_cpu():
    """moe_align on CUDA (sync-free ops) gives the same grouping as on CPU."""
    *_, ids = make_inputs(600, 8, 8, 8, 2, 6, torch.float32, seed=106)
    for block_m in (16, 64):
        a, b = moe_align(ids, 8, block_m), moe_align(ids.cpu(), 8, block_m)
        for fa, fb in zip(a, b):
            if isinstance(fa, torch.Tensor):
                assert torch.equal(fa.cpu(), fb)


@pytest.mark.parametrize("order", ["hf", "hf-eager", "hf4"])
def test_reference_on_gpu_matches_cpu_fp32(order):
    """The serial executor's reference on CUDA (fp32, TF32 off) agrees with CPU fp32 within 1e-5 relative."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 200, 344, 8, 2, 3, torch.float32, seed=107)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = experts_ffn_reference(x, w1, w3, w2, wts, ids, order=order)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    want = experts_ffn_reference(x.cpu(), w1.cpu(), w3.cpu(), w2.cpu(), wts.cpu(), ids.cpu(), order=order)
    assert rel_err(got.cpu(), want) <= 1e-5


def test_default_config_choice():
    assert default_kernel_config(16, 8).block_m == 16
    assert default_kernel_config(8 * 1000, 8).block_m == 64
    assert default_kernel_config(8 * 1000, 8, torch.float32).block_k == 32


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_experts_skip_pairs(shape, dtype):
    """skip=True: pairs with id E are not computed and add 0; the rest equals the reference over only those
    pairs (rel. L2 as above); a call where every pair is skipped returns zeros."""
    x, w1, w3, w2, wts, ids = make_inputs(*shape, dtype=dtype, seed=101)
    E = w1.shape[0]
    g = torch.Generator().manual_seed(102)
    drop = (torch.rand(ids.shape, generator=g) < 0.4).to(DEV)
    drop[0, 0] = True
    got = fused_experts_triton(x, w1, w3, w2, wts, torch.where(drop, torch.full_like(ids, E), ids), skip=True)
    want = experts_ffn_reference(x, w1, w3, w2, torch.where(drop, torch.zeros_like(wts), wts), ids)
    assert rel_err(got, want) <= TOL[dtype]
    none = fused_experts_triton(x, w1, w3, w2, wts, torch.full_like(ids, E), skip=True)
    assert torch.equal(none, torch.zeros_like(none))


def test_moe_align_triton_on_gpu_matches_moe_align():
    """moe_align_triton (compiled) equals moe_align on CUDA at prefill sizes up to its one-program limit: Mixtral's
    8 experts at 8,192 tokens x top-2 and 128 experts x top-8 at the limit, the skip bucket, int32 ids, an expert
    with no pairs."""
    from lightning_moe.kernels.fused_moe import MOE_ALIGN_TRITON_MAX, moe_align_triton, moe_align_triton_fits

    g = torch.Generator(device="cuda").manual_seed(107)
    cases = [(8192, 2, 8), (4096, 2, 9), (128, 8, 128), (3, 1, 1), (333, 6, 60)]
    for T, k, E in cases:
        assert moe_align_triton_fits(T * k, E), (T, k, E)
        ids = torch.randint(0, E, (T, k), device="cuda", generator=g)
        if E > 5:
            ids = torch.where(ids == 5, 4, ids)  # expert 5: no pairs
        for dt in (torch.int64, torch.int32):
            want, got = moe_align(ids.to(dt), E), moe_align_triton(ids.to(dt), E)
            for a, b, name in zip(got[:4], want[:4], ("sorted_token_idx", "expert_offsets", "sorted_pair_idx",
                                                      "counts")):
                assert torch.equal(a, b), (T, k, E, dt, name)
    assert not moe_align_triton_fits(MOE_ALIGN_TRITON_MAX // 8 + 1, 8)
