"""The grouped_mm FFN's Triton epilogue on CUDA (kernels.fused_moe.silu_mul_triton, moe_combine_triton; written in a
CPU-only session; run on the H200 host since). At Mixtral-8x7B width (T 8192, D 4096, F 14336, E 8, k 2, bf16):

* silu_mul vs silu_mul_reference (torch's F.silu + torch.mul on the device): bit for bit (libdevice expf = CUDA's
  expf, IEEE division; silu rounded to bf16, its fp32 product with up rounded once), into the strided column
  chunks fused_experts_grouped_mm writes and in place;
* moe_combine vs moe_combine_reference: within 1 bf16 ulp (the fp32 multiply-add may contract differently), NaN in
  the skipped pairs' rows never read;
* fused_experts_grouped_mm (auto: the Triton epilogue) vs its torch epilogue (``_epilogue="torch"``): bit for bit with
  only silu_mul swapped in, within 1 bf16 ulp with both kernels; vs experts_ffn_reference in fp32 within
  tests/gpu/test_grouped_mm_gpu.py's 1e-2 (that file's skip test checks the default, Triton-epilogue path for host syncs).

Run on a CUDA host: ``python -m pytest tests/gpu/test_moe_epilogue_gpu.py -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels import fused_moe as fm  # noqa: E402
from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm, moe_align,  # noqa: E402
                                             moe_combine_reference, moe_combine_triton, silu_mul_reference,
                                             silu_mul_triton)

T, D, F, E, K = 8192, 4096, 14336, 8, 2  # Mixtral-8x7B


def _ulps(a, b):
    """|a - b| in bf16 ulps (ordered integer image; +0 == -0)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    key = lambda i: torch.where(i < 0, -(i & 0x7FFF), i)  # noqa: E731
    return (key(ia) - key(ib)).abs()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def mixtral():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) / F**0.5).bfloat16()
    scores = torch.rand(T, E, device="cuda", generator=g)
    scores[:, 3] = -1.0  # expert 3 gets no tokens
    wts, ids = torch.topk(scores.softmax(-1), K, dim=-1)
    return x, w1, w3, w2, wts, ids


def _mismatch(got, want):
    d = _ulps(got, want)
    return f"{int((d > 0).sum())} of {d.numel()} elements differ, by up to {int(d.max())} ulp"


def test_silu_mul_bitwise_at_mixtral_width():
    """Gate / up of one quarter of F (fused_experts_grouped_mm's chunk at this width) for P = T k pairs, with the
    magnitudes of a real gate product: bit-identical to torch, into h[:, f0:f1] (row stride F) and in place."""
    g = torch.Generator(device="cuda").manual_seed(1)
    P, W = T * K, F // 4
    gate = (torch.randn(P, W, device="cuda", generator=g) * 3).bfloat16()
    up = torch.randn(P, W, device="cuda", generator=g).bfloat16()
    want = silu_mul_reference(gate.clone(), up, torch.empty_like(gate))
    h = torch.full((P, F), 7.0, dtype=torch.bfloat16, device="cuda")
    silu_mul_triton(gate, up, h[:, W:2 * W])
    assert torch.equal(h[:, W:2 * W], want), _mismatch(h[:, W:2 * W], want)
    assert bool((h[:, :W] == 7).all()) and bool((h[:, 2 * W:] == 7).all())
    inplace = gate.clone()
    silu_mul_triton(inplace, up)
    assert torch.equal(inplace, want), _mismatch(inplace, want)


def test_moe_combine_within_one_ulp_and_skips_nan_rows(mixtral):
    """yd [P, D] laid out as the grouped GEMM leaves it; a quarter of the pairs skipped, their rows NaN."""
    _, _, _, _, wts, ids = mixtral
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.where(torch.rand(T, K, device="cuda", generator=g) < 0.25, E, ids)
    al = moe_align(ids, E + 1)
    rank = torch.empty_like(al.sorted_pair_idx)
    rank[al.sorted_pair_idx] = torch.arange(T * K, device="cuda")
    rank = rank.view(T, K)
    yd = torch.randn(T * K, D, device="cuda", generator=g).bfloat16()
    yd[rank[ids == E]] = float("nan")
    got = moe_combine_triton(yd, rank, wts, ids, E, skip=True)
    want = moe_combine_reference(yd, rank, wts, ids, E, skip=True)
    assert bool(torch.isfinite(got).all())
    assert int(_ulps(got, want).max()) <= 1, _mismatch(got, want)


@pytest.mark.parametrize("chunks", [None, 1])
def test_grouped_mm_triton_epilogue_at_mixtral_width(mixtral, monkeypatch, chunks):
    """Default chunking (4 at this width: strided chunks of 3584 columns) and one full-width chunk (in place)."""
    x, w1, w3, w2, wts, ids = mixtral
    torch_epi = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks, _epilogue="torch")
    auto = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks)  # Triton epilogue on CUDA
    assert bool(torch.isfinite(auto).all())
    assert int(_ulps(auto, torch_epi).max()) <= 1, _mismatch(auto, torch_epi)
    with monkeypatch.context() as m:  # only silu_mul swapped in: bit for bit
        m.setattr(fm, "moe_combine_triton", moe_combine_reference)
        silu_only = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks, _epilogue="triton")
    assert torch.equal(silu_only, torch_epi), _mismatch(silu_only, torch_epi)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    assert _rel(auto, ref) < 1e-2


def test_epilogue_time_at_mixtral_width(mixtral):
    """Not a pass/fail speed bound: prints both epilogues' whole-call time (CUDA events, 5 runs after a warm-up) and
    requires the Triton one not to take more peak memory than the torch one."""
    x, w1, w3, w2, wts, ids = mixtral
    res = {}
    for epi in ("torch", "triton"):
        fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, validate=False, _epilogue=epi)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, validate=False, _epilogue=epi)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 5
        res[epi] = (ms, torch.cuda.max_memory_allocated() - base)
        flops = 2 * T * K * 3 * D * F
        print(f"epilogue {epi}: {ms:.2f} ms/call, {flops / ms / 1e9:.0f} TFLOP/s, peak +{res[epi][1] / 2**20:.0f} MiB")
    assert res["triton"][1] <= res["torch"][1]
