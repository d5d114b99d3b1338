"""kernels.score_head (log p(target) and the greedy flag in one pass over model-dtype logits) under Triton's CPU
interpreter: the kernel against its torch reference on awkward shapes, strided rows and three dtypes, ties, NaN /
inf rows, out-of-range targets, NaN-filled outputs, the operand checks, and pipeline.token_scores' kernel path
against its torch path (and the family heads it may and may not take).

Tolerances. logp: within 1e-5 relative of the reference computed from the same logits cast to fp32
(``torch.log_softmax(logits.float())``), plus 1e-5 absolute: the kernel sums the exponentials in another order, so
its logsumexp differs by a few fp32 ulps of |logsumexp| (~1e-6 at these logit scales), which is the whole error of a
logp near 0. greedy: exact (the argmax of the logits, lowest index on ties, is exact arithmetic). The CUDA runs are in
tests/gpu/test_score_head_gpu.py.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels import score_head as sh
from lightning_moe.model import layers as L
from lightning_moe.model.families import families
from lightning_moe.model.families import gpt_oss
from lightning_moe.pipeline.token_scores import token_scores
from tests.support.nan_workspace import nan_empty

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first in compiled mode, as tests/test_kernels_ref.py explains)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_scores(got, want):
    """logp within 1e-5 relative (+ 1e-5 absolute) of the reference, NaN where it is NaN; greedy equal."""
    (lp, g), (rlp, rg) = got, want
    assert lp.dtype == torch.float32 and g.dtype == torch.bool and lp.shape == g.shape == rlp.shape
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(g, rg), (g, rg)


def inputs(c, V, dtype, seed, scale=3.0):
    """Logits [c, V] (randn * scale, in dtype) and targets [c]: every other row's target is the row's argmax."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(c, V, generator=g) * scale).to(dtype)
    t = torch.randint(0, V, (c,), generator=g)
    t[::2] = x.float().argmax(-1)[::2]
    return x, t


# --------------------------------------------------------------------------------------------------
# The kernel against the reference
# --------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("shift", [1e3, 1e4])
def test_large_logits_keep_log_softmax_precision(interpret, shift):
    """Logits far from 0 (fp32, randn * 3 + shift): logp computed as (x[t] - M) - log(sum exp(x - M)), log_softmax's
    order, stays within 2e-6 of the float64 log-softmax; M + log(sum) first would round at ulp(M) (~6e-5 at 1e3)."""
    x, t = inputs(5, 32_000, torch.float32, seed=11)
    x = x + shift
    lp, _ = sh.score_head_triton(x, t)
    ref = torch.log_softmax(x.double(), -1).gather(1, t[:, None])[:, 0]
    assert (lp.double() - ref).abs().max().item() < 2e-6


@needs_triton
@pytest.mark.parametrize("c,V", [(1, 1), (37, 1), (1, 1001), (37, 1001), (37, 4096), (5, 4097), (3, 12_345),
                                 (2, 151_936)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_matches_reference(interpret, c, V, dtype):
    x, t = inputs(c, V, dtype, seed=c * 7 + V)
    got = sh.score_head_triton(x, t)
    assert_scores(got, sh.score_head_torch(x, t))
    if V > 1:
        assert bool(got[1][::2].all()) and not bool(got[1][1::2].all() if c > 1 else False)
    assert torch.equal(got[0], sh.score_head_triton(x, t)[0])  # deterministic


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_rows_and_targets(interpret, dtype):
    """Rows of a wider tensor (a row stride > V) and targets at stride 2: read in place."""
    wide, t = inputs(37, 5000, dtype, seed=11)
    x = wide[:, 13:4110]  # [37, 4097] at row stride 5000
    tt = torch.stack([t % 4097, torch.zeros_like(t)], 1).reshape(-1)[::2]  # [37] at stride 2
    assert x.stride() == (5000, 1) and tt.stride() == (2,)
    assert_scores(sh.score_head_triton(x, tt), sh.score_head_torch(x, tt.contiguous()))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ties_take_the_lowest_index(interpret, dtype):
    """All-equal rows: greedy only for target 0. Equal maxima in one lane of two blocks (j, j + 4096), in two lanes
    of one block, and a later block's low lane against an earlier block's high lane: the lowest index wins."""
    V = 3 * 4096 + 5
    pairs = [(7, 7 + 4096), (100, 3000), (4000, 4096 + 3), (0, V - 1), (V - 2, V - 1), (5, 4096 * 3 + 4)]
    x = torch.randn(len(pairs), V).clamp(-3, 3).to(dtype)
    for r, (a, b) in enumerate(pairs):
        x[r, a] = x[r, b] = 10.0
    for which, want in ((0, True), (1, False)):
        t = torch.tensor([p[which] for p in pairs])
        lp, g = sh.score_head_triton(x, t)
        assert g.tolist() == [want] * len(pairs), which
        assert_scores((lp, g), sh.score_head_torch(x, t))
    flat = torch.full((4, 1000), 0.25, dtype=dtype)  # all equal: logp = -log(V), argmax 0
    t = torch.tensor([0, 1, 999, 500])
    lp, g = sh.score_head_triton(flat, t)
    assert g.tolist() == [True, False, False, False]
    torch.testing.assert_close(lp, torch.full((4,), -torch.log(torch.tensor(1000.0)).item()), rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_rows(interpret, dtype):
    """A NaN anywhere in a row (first, last, a later block, beside the row's maximum): logp NaN and greedy False,
    whatever the target; the other rows untouched. +inf: logp NaN (as log_softmax), greedy at the first +inf;
    -inf entries (a masked vocabulary) are ordinary; a row of -inf: logp NaN (as log_softmax), argmax 0."""
    V = 5000
    x, t = inputs(8, V, dtype, seed=5)
    t[:] = x.float().argmax(-1)
    x[0, 0] = NAN
    x[1, V - 1] = NAN
    x[2, 4500] = NAN
    x[3, int(t[3])] = NAN  # the target itself
    x[4, 17] = INF
    x[4, 4000] = INF
    t[4] = 17
    x[5, ::3] = -INF
    x[6] = -INF
    t[6] = 0
    lp, g = sh.score_head_triton(x, t)
    rlp, rg = sh.score_head_torch(x, t)
    assert bool(lp[:5].isnan().all()) and bool(lp[6].isnan()) and not bool(lp[[5, 7]].isnan().any())
    assert g.tolist() == [False, False, False, False, True, True, True, True]
    assert_scores((lp, g), (rlp, rg))
    ref_ls = torch.log_softmax(x.float(), -1).gather(1, t[:, None])[:, 0]  # the current math, NaN rows and all
    torch.testing.assert_close(lp, ref_ls, rtol=1e-5, atol=1e-5, equal_nan=True)


@needs_triton
def test_targets_outside_the_row(interpret):
    """Targets < 0 or >= V: logp NaN and greedy False (no read outside the row); the other rows as the reference."""
    x, t = inputs(4, 300, torch.bfloat16, seed=9)
    bad = torch.tensor([-1, 300, 10**9, int(t[3])])
    lp, g = sh.score_head_triton(x, bad)
    assert bool(lp[:3].isnan().all()) and g[:3].tolist() == [False] * 3
    assert_scores((lp[3:], g[3:]), sh.score_head_torch(x[3:], bad[3:]))


@needs_triton
def test_outputs_allocated_nan_and_out_buffers(interpret, monkeypatch):
    """Every row's outputs are written: NaN-filled allocations (torch.empty) and ``out`` buffers prefilled with NaN
    and with the opposite of the greedy answer; no rows: empty outputs."""
    nan_empty(monkeypatch)
    x, t = inputs(37, 1001, torch.bfloat16, seed=1)
    want = sh.score_head_torch(x, t)
    assert_scores(sh.score_head_triton(x, t), want)
    out = (torch.full((37,), NAN), ~want[1])
    got = sh.score_head_triton(x, t, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_scores(got, want)
    lp, g = sh.score_head_triton(x[:0], t[:0])
    assert lp.shape == g.shape == (0,)


# --------------------------------------------------------------------------------------------------
# Operand checks and dispatch
# --------------------------------------------------------------------------------------------------


def test_unsupported_reasons():
    x, t = torch.randn(4, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64)
    assert sh.score_head_triton_unsupported(x, t) is None
    assert sh.score_head_triton_unsupported(x[:, :1], t) is None  # V = 1: any column stride
    assert "not contiguous" in sh.score_head_triton_unsupported(torch.randn(64, 4).to(torch.bfloat16).t(), t)
    assert "dtype" in sh.score_head_triton_unsupported(x.double(), t)
    assert "[c, V]" in sh.score_head_triton_unsupported(x[0], t[:1])
    assert "[c, V]" in sh.score_head_triton_unsupported(x[:, :0], t)
    assert "int64 [c]" in sh.score_head_triton_unsupported(x, t.int())
    assert "int64 [c]" in sh.score_head_triton_unsupported(x, t[:3])
    assert "out" in sh.score_head_triton_unsupported(x, t, (torch.empty(4), torch.empty(4)))  # greedy not bool
    assert "out" in sh.score_head_triton_unsupported(x, t, (torch.empty(8)[::2], torch.empty(4, dtype=torch.bool)))
    xg = torch.randn(4, 64, requires_grad=True)
    assert "autograd" in sh.score_head_triton_unsupported(xg, t)
    with torch.no_grad():
        assert sh.score_head_triton_unsupported(xg, t) is None


@needs_triton
def test_wrapper_refuses_what_it_cannot_take(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, t = torch.randn(4, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA"):
        sh.score_head_triton(x, t)
    with pytest.raises(ValueError, match="int64"):
        sh.score_head_triton(x, t.int())


def test_dispatch_predicate_on_cpu():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert not sh.use_triton(x)
    assert sh.use_triton(SimpleNamespace(is_cuda=True)) == fm.triton_available()


# --------------------------------------------------------------------------------------------------
# pipeline.token_scores: the kernel path against the torch path
# --------------------------------------------------------------------------------------------------


def head_inputs(T, D, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 2).to(dtype)  # [T, D]
    norm = (torch.rand(D, generator=g) + 0.5).to(dtype)  # [D]
    lm_head = (torch.randn(V, D, generator=g) * 2 / D ** 0.5).to(dtype)  # [V, D]
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::3] = L.final_logits(x, norm, lm_head, 1e-5).argmax(-1)[::3]  # some rows greedy
    targets[[4, T - 1]] = -1  # last tokens of sequences
    return x, norm, lm_head, targets


class _Fp32Logits(TorchDispatchMode):
    """Records the largest fp32 tensor (elements) any torch op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def kernel_calls(monkeypatch) -> list:
    """Make use_triton say yes (as for a CUDA tensor) and count score_head_triton's calls."""
    calls, real = [], sh.score_head_triton

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(sh, "use_triton", lambda x: True)
    monkeypatch.setattr(sh, "score_head_triton", spy)
    return calls


@needs_triton
@pytest.mark.parametrize("chunk", [1, 13, 37, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_scores_kernel_path_equals_torch_path(interpret, monkeypatch, chunk, dtype):
    T, D, V = 37, 48, 1001
    x, norm, lm_head, targets = head_inputs(T, D, V, dtype, seed=chunk)
    want = token_scores(x, norm, lm_head, 1e-5, targets, chunk)  # CPU: the torch path
    calls = kernel_calls(monkeypatch)
    with _Fp32Logits() as seen:
        got = token_scores(x, norm, lm_head, 1e-5, targets, chunk)
    assert len(calls) == -(-T // chunk) and all(s[1] == V for s in calls)
    assert_scores(got, want)
    assert 0 < int(got[1].sum()) < T
    if dtype == torch.bfloat16:  # no fp32 [c, V] logits (nor log_softmax output) on the kernel path
        assert seen.largest < min(chunk, T) * V, seen.largest


@needs_triton
def test_token_scores_kernel_path_gpt_oss_head(interpret, monkeypatch):
    """gpt-oss's head (its own RMSNorm: fp32 product, fp32 weight) goes through its own model-dtype head."""
    x, norm, lm_head, targets = head_inputs(37, 48, 777, torch.bfloat16, seed=3)
    norm = norm.float()
    want = token_scores(x, norm, lm_head, 1e-5, targets, 16, gpt_oss.final_logits)
    calls = kernel_calls(monkeypatch)
    got = token_scores(x, norm, lm_head, 1e-5, targets, 16, gpt_oss.final_logits)
    assert len(calls) == 3
    assert_scores(got, want)


@needs_triton
def test_token_scores_refuses_heads_without_a_model_dtype_head(interpret, monkeypatch):
    """A head with math after the fp32 cast (a soft-cap) names no model-dtype head: the torch path, its math; a head
    whose logits the kernel cannot take (fp64) falls back to the torch path on the head's logits cast to fp32."""
    x, norm, lm_head, targets = head_inputs(20, 32, 300, torch.bfloat16, seed=4)

    def capped(x, norm_w, lm_head, eps):
        return 30.0 * torch.tanh(L.final_logits(x, norm_w, lm_head, eps) / 30.0)

    calls = kernel_calls(monkeypatch)
    got = token_scores(x, norm, lm_head, 1e-5, targets, 8, capped)
    assert calls == [] and L.model_dtype_head(capped) is None
    lp = torch.log_softmax(capped(x, norm, lm_head, 1e-5), -1)
    t = targets.clamp(min=0)
    assert torch.equal(got[0], lp.gather(1, t[:, None])[:, 0]) and torch.equal(got[1], lp.argmax(-1) == t)
    xd, nd, hd = x.double(), norm.double(), lm_head.double()
    got = token_scores(xd, nd, hd, 1e-5, targets, 8)
    assert calls == []
    lp = torch.log_softmax(L.final_logits(xd, nd, hd, 1e-5), -1)
    assert torch.equal(got[0], lp.gather(1, t[:, None])[:, 0]) and torch.equal(got[1], lp.argmax(-1) == t)


@pytest.mark.parametrize("fam", families(), ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_family_head_is_its_model_dtype_head_cast(fam, dtype):
    """Every registered family's final_logits either names no model-dtype head or is exactly that head's output cast
    to fp32 (bitwise), in the model dtype: what lets the kernel path read the logits before the cast."""
    head = L.model_dtype_head(fam.final_logits)
    if head is None:
        pytest.skip(f"{fam.name}: no model-dtype head (torch path)")
    x, norm, lm_head, _ = head_inputs(9, 32, 200, dtype, seed=6)
    logits = head(x, norm, lm_head, 1e-6)  # [T, V]
    assert logits.dtype == dtype
    assert torch.equal(fam.final_logits(x, norm, lm_head, 1e-6), logits.float())
