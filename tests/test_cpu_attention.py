"""The fused CPU decode attention against the unfused reference (model.layers.decode_attention)."""

import pytest
import torch

from lightning_moe.model.layers import decode_attention
from lightning_moe.pipeline.cpu_attention import bucket_len, cpu_decode_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,Hq,Hkv,S,window", [(1, 4, 2, 1, None), (5, 8, 2, 37, None), (7, 32, 8, 100, 16), (3, 6, 6, 20, None)])
def test_fused_equals_reference(dtype, tol, B, Hq, Hkv, S, window):
    """Ragged rows (lengths 1..S, one row of length 1), GQA and MHA, an odd S, a sliding window."""
    g = torch.Generator().manual_seed(B * 100 + S)
    hd = 16
    q = torch.randn(B, Hq, hd, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S + 5, hd, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S + 5, hd, generator=g).to(dtype)
    k[:, :, S:] = 1e4  # beyond every row's length: large finite values (caches are zero-initialised) that
    v[:, :, S:] = 1e4  # would dominate the result if the mask let them through
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = 1
    out = cpu_decode_attention(q, k, v, lengths, window)
    Su = bucket_len(int(lengths.max()), S + 5)
    ref = decode_attention(q.float(), k[:, :, :Su].float(), v[:, :, :Su].float(), lengths, window)
    assert out.shape == (B, Hq * hd) and out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.2e} > {tol}"


def test_bad_shapes():
    with pytest.raises(ValueError, match="shapes"):
        cpu_decode_attention(torch.zeros(2, 4, 8), torch.zeros(3, 2, 5, 8), torch.zeros(3, 2, 5, 8), torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple"):
        cpu_decode_attention(torch.zeros(2, 5, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), torch.ones(2, dtype=torch.int64))


def test_profiler_matmul_routine_equals_fused_fp32():
    """The unfused routine `moe-batch profile` times beside the fused one computes the same attention."""
    from lightning_moe.pipeline.cpu_attention import cpu_decode_attention
    from lightning_moe.pipeline.profiler import _matmul_decode_attention

    g = torch.Generator().manual_seed(7)
    q = torch.randn(5, 8, 16, generator=g)  # [B, Hq, hd], GQA 8 / 2
    k = torch.randn(5, 2, 33, 16, generator=g)  # [B, Hkv, S, hd], S odd
    v = torch.randn(5, 2, 33, 16, generator=g)
    lengths = torch.tensor([1, 7, 33, 12, 20])
    torch.testing.assert_close(_matmul_decode_attention(q, k, v, lengths), cpu_decode_attention(q, k, v, lengths),
                               rtol=1e-5, atol=1e-6)
