"""kernels.norm_rope on CUDA: the compiled RMSNorm and rotate-half RoPE kernels against their torch references at real
widths (D 4096, Hq 32 / Hkv 8 heads of 128, T 16384, bf16) and at awkward ones, and model.layers.rms_norm /
apply_rope on CUDA taking the kernels and equal to the references.

Tolerances as in tests/test_norm_rope_kernels.py: RoPE bitwise (fp32 too: the kernels launch without FMA
contraction); RMSNorm fp32 1e-6 relative, bf16 / fp16 1 ulp with weight 1 (the normalized value) and 2 ulps with a
random weight (the product rounded once more), at most 1% of the elements not bitwise equal; the fp32 statistic is
summed (and rsqrt-ed, divided by D) differently from torch's CUDA reduction."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels import norm_rope as nr  # noqa: E402
from lightning_moe.model import layers as L  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_rms_close(got, want, ulps):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    else:
        fi = torch.finfo(got.dtype)
        torch.testing.assert_close(got, want, rtol=ulps * fi.eps, atol=ulps * fi.eps * fi.tiny)
        n = int((got != want).sum())  # a flipped rounding is rare; skipping one would differ in ~10-40%
        assert n <= max(1, got.numel() // 100), f"{n} of {got.numel()} elements differ"


def _x(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * 3 + 0.5).to(dtype)


def _w(D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return (torch.randn(D, generator=g, device="cuda") * 0.5 + 1).to(dtype)


@pytest.mark.parametrize("shape,dtype", [
    ((16384, 4096), torch.bfloat16),  # the attention / FFN norm of a 16k-token prefill at D 4096
    ((16384, 32, 128), torch.bfloat16),  # Qwen3's per-head q norm
    ((16384, 8, 128), torch.bfloat16),  # ... and k norm
    ((2048, 4096), torch.float32), ((2048, 4096), torch.float16),
    ((33, 2880), torch.bfloat16), ((7, 7168), torch.bfloat16), ((1, 96), torch.float16), ((513, 64), torch.float32),
])
def test_rms_norm_matches_torch_cuda(shape, dtype):
    x, w = _x(shape, dtype, seed=shape[0]), _w(shape[-1], dtype, seed=shape[-1])
    got = nr.rms_norm_triton(x, w, 1e-5)
    assert_rms_close(got, nr.rms_norm_torch(x, w, 1e-5), ulps=2)
    assert torch.equal(got, nr.rms_norm_triton(x, w, 1e-5))  # deterministic
    ones = torch.ones(shape[-1], dtype=dtype, device="cuda")
    assert_rms_close(nr.rms_norm_triton(x, ones, 1e-5), nr.rms_norm_torch(x, ones, 1e-5), ulps=1)


def test_rms_norm_strided_rows_cuda():
    c, _ = _x((4096, 512 + 64), torch.bfloat16, seed=3).split([512, 64], dim=-1)  # DeepSeek's latent c
    w = _w(512, torch.bfloat16, seed=4)
    assert_rms_close(nr.rms_norm_triton(c, w, 1e-6), nr.rms_norm_torch(c, w, 1e-6), ulps=2)


@pytest.mark.parametrize("T,H,hd,dtype", [
    (16384, 32, 128, torch.bfloat16), (16384, 8, 128, torch.bfloat16),  # q and k of a 16k-token prefill
    (4096, 32, 128, torch.float32), (4096, 8, 128, torch.float16),
    (33, 3, 80, torch.bfloat16), (7, 1, 64, torch.float32), (1, 8, 64, torch.float16),
])
def test_rope_bitwise_cuda(T, H, hd, dtype):
    x = _x((T, H * hd), dtype, seed=T + H).view(T, H, hd)  # a projection's output viewed as heads
    cos, sin = _x((T, hd), dtype, seed=hd), _x((T, hd), dtype, seed=hd + 7)
    got = nr.apply_rope_triton(x, cos, sin)
    assert torch.equal(got, nr.apply_rope_torch(x, cos, sin))
    xs = _x((T, H, hd + 64), dtype, seed=5)[..., 64:]  # a slice (DeepSeek's q[..., nope:])
    assert torch.equal(nr.apply_rope_triton(xs, cos, sin), nr.apply_rope_torch(xs, cos, sin))


def test_layers_take_the_kernels_on_cuda():
    T, D, Hq, Hkv, hd = 16384, 4096, 32, 8, 128
    x, w = _x((T, D), torch.bfloat16, seed=1), _w(D, torch.bfloat16, seed=2)
    assert nr.rms_norm_uses_triton(x, w)
    assert_rms_close(L.rms_norm(x, w, 1e-5), nr.rms_norm_torch(x, w, 1e-5), ulps=2)
    assert not nr.rms_norm_uses_triton(x, w.float())  # gpt-oss's fp32 weight: torch path
    assert torch.equal(L.rms_norm(x, w.float(), 1e-5), nr.rms_norm_torch(x, w.float(), 1e-5))
    pos = torch.arange(T, device="cuda")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    for H in (Hq, Hkv):
        q = _x((T, H * hd), torch.bfloat16, seed=H).view(T, H, hd)
        assert nr.apply_rope_uses_triton(q, cos, sin)
        assert torch.equal(L.apply_rope(q, cos, sin), nr.apply_rope_torch(q, cos, sin))
