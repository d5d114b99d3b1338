"""kernels.score_head on CUDA: the compiled kernel against its torch reference at Qwen3's vocabulary (V 151,936) and
at awkward widths, ties and NaN / inf rows, and pipeline.token_scores on CUDA taking the kernel (equal to its torch
path) without ever allocating an fp32 [c, V] tensor.

Tolerances as in tests/test_score_head_kernel.py: logp within 1e-5 relative (+ 1e-5 absolute) of the reference from
the same logits cast to fp32 (the kernel's fp32 sum runs in another order, and CUDA's exp / log are approximations of
a few ulps); greedy exact. Written in a CPU-only session (the interpreter twins ran there); run on a CUDA host:
``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels import score_head as sh  # noqa: E402
from lightning_moe.model import layers as L  # noqa: E402
from lightning_moe.pipeline.token_scores import token_scores  # noqa: E402

NAN, INF = float("nan"), float("inf")
V_QWEN3 = 151_936


def assert_scores(got, want):
    (lp, g), (rlp, rg) = got, want
    assert lp.dtype == torch.float32 and g.dtype == torch.bool and lp.shape == g.shape == rlp.shape
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(g, rg)


def inputs(c, V, dtype, seed, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(c, V, generator=g, device="cuda") * scale).to(dtype)  # [c, V]
    t = torch.randint(0, V, (c,), generator=g, device="cuda")  # [c]
    t[::2] = x.float().argmax(-1)[::2]
    return x, t


@pytest.mark.parametrize("c,V,dtype", [
    (1024, V_QWEN3, torch.bfloat16),  # a full scoring chunk at Qwen3's vocabulary
    (37, V_QWEN3, torch.float16), (37, V_QWEN3, torch.float32), (1, V_QWEN3, torch.bfloat16),
    (513, 32_000, torch.bfloat16), (37, 4097, torch.bfloat16), (5, 1, torch.float32), (3, 1001, torch.float16),
])
def test_matches_reference_cuda(c, V, dtype):
    x, t = inputs(c, V, dtype, seed=c + V)
    got = sh.score_head_triton(x, t)
    assert_scores(got, sh.score_head_torch(x, t))
    if V > 1:
        assert bool(got[1][::2].all())
    assert torch.equal(got[0], sh.score_head_triton(x, t)[0])  # deterministic


def test_strided_rows_cuda():
    wide, t = inputs(64, V_QWEN3 + 64, torch.bfloat16, seed=2)
    x = wide[:, 32:32 + V_QWEN3]  # [64, V] at row stride V + 64
    t = t % V_QWEN3
    assert_scores(sh.score_head_triton(x, t), sh.score_head_torch(x, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_nan_inf_cuda(dtype):
    """Equal maxima across lanes and blocks (lowest index wins), an all-equal row, NaN rows (logp NaN, greedy False),
    a +inf row (logp NaN, greedy at the first +inf), -inf entries and a row of -inf."""
    V = V_QWEN3
    x, t = inputs(10, V, dtype, seed=7)
    x = x.clamp(-3, 3)
    for r, (a, b) in enumerate([(7, 7 + 4096), (100, 3000), (4000, 4096 + 3), (0, V - 1)]):
        x[r, a] = x[r, b] = 10.0
        t[r] = a
    x[4] = 0.5
    t[4] = 0
    x[5, 9] = NAN
    x[6, V - 1] = NAN
    x[7, 17] = x[7, 90_000] = INF
    t[7] = 17
    x[8, ::3] = -INF
    x[9] = -INF
    lp, g = sh.score_head_triton(x, t)
    assert g[:5].tolist() == [True] * 5 and g[5:7].tolist() == [False, False] and bool(g[7])
    assert bool(lp[5:8].isnan().all()) and bool(lp[9].isnan())
    assert_scores((lp, g), sh.score_head_torch(x, t))


def _head(T, D, V, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, D, generator=g, device="cuda") * 2).to(dtype)
    norm = (torch.rand(D, generator=g, device="cuda") + 0.5).to(dtype)
    lm_head = (torch.randn(V, D, generator=g, device="cuda") * 2 / D ** 0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    targets[::3] = L.final_logits(x, norm, lm_head, 1e-6).argmax(-1)[::3]
    targets[-1] = -1
    return x, norm, lm_head, targets


def test_token_scores_cuda_kernel_path(monkeypatch):
    """On CUDA token_scores takes the kernel (spied), equal to its torch path (use_triton forced off); the kernel
    path's peak allocation above its inputs stays below one fp32 [c, V] tensor (c V 4 bytes): the logits stay bf16."""
    T, D, V, c = 1000, 2048, V_QWEN3, 256
    x, norm, lm_head, targets = _head(T, D, V, torch.bfloat16, seed=1)
    calls, real = [], sh.score_head_triton
    monkeypatch.setattr(sh, "score_head_triton", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    got = token_scores(x, norm, lm_head, 1e-6, targets, c)  # also warms cuBLAS / Triton up
    assert calls == [torch.bfloat16] * -(-T // c)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    token_scores(x, norm, lm_head, 1e-6, targets, c)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < c * V * 4, (peak, c * V * 4)
    with monkeypatch.context() as m:
        m.setattr(sh, "use_triton", lambda t: False)
        want = token_scores(x, norm, lm_head, 1e-6, targets, c)
    assert_scores(got, want)
    assert 0 < int(got[1].sum()) < T
