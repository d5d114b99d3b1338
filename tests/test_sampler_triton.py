"""kernels.sampling.sample_tokens_triton (issue 43) under Triton's CPU interpreter (TRITON_INTERPRET=1), against the
torch path :func:`sample_tokens` and its float64 reference; skipped where triton is not installed. The compiled kernel
on CUDA runs the same checks at full size in ``tests/gpu/test_sampler_gpu.py``.

Tolerances, as for the torch path (tests/test_sampler.py): each drawn token has positive reference probability and a
float64 race score within 1e-5 of its row's best; against the torch path the tokens agree on >= 90 % of rows (they
differ only where top-p's boundary or the race is within fp32 rounding). Small blocks (16, 64 tokens) make every row
span several blocks, so the bisections, the running top-p tie count and the block-wise argmax cross block edges.
Goodness of fit runs 1,000 draws per case here (the interpreter runs one row at a time); the GPU file runs 100,000.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.kernels.fused_moe import triton_available
from lightning_moe.kernels.sampling import (keys_from_seeds, race_uniforms, reference_probs, sample_tokens,
                                            sample_tokens_reference, sample_tokens_triton)
from tests.test_sampler import GOF_CASES, PARAMS, gof_logits, random_keys, splitmix, target, tv_bound

pytestmark = [pytest.mark.skipif(not triton_available(), reason="triton not installed"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy's int64 wrap in the interpreter's hash


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    """triton imported in compiled mode first (as tests/test_kernels_ref.py does), then the interpreter set."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def check_against_reference(logits, args, keys, tok):
    """Every token drawable and a float64 race winner to 1e-5; >= 90 % equal to the torch path's."""
    B, V = logits.shape
    p = reference_probs(logits, *args)  # [B, V] float64
    e = -torch.log1p(-race_uniforms(keys, V).double())
    score = torch.where(p > 0, p.log() - e.log(), -math.inf)
    got = score.gather(1, tok.view(B, 1)).view(B)
    assert (p.gather(1, tok.view(B, 1)) > 0).all(), f"{args}: drew a token of probability 0: {tok.tolist()}"
    assert (got >= score.amax(-1) - 1e-5).all(), (args, tok, sample_tokens_reference(logits, *args, keys=keys))
    assert (tok == sample_tokens(logits, *args, keys=keys)).float().mean() >= 0.9, args


@pytest.mark.parametrize("V,block,dtype", [(1, 16, torch.float32), (16, 16, torch.bfloat16), (17, 16, torch.float32),
                                           (63, 16, torch.bfloat16), (333, 64, torch.float32)])
def test_matches_reference(V, block, dtype):
    g = torch.Generator().manual_seed(V * 13 + block)
    B = 5
    for args in PARAMS:
        logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
        logits[0, : V // 3] = -math.inf
        keys = random_keys(B, g)
        tok = sample_tokens_triton(logits, *args, keys=keys, block=block)
        assert tok.dtype == torch.int64 and tok.shape == (B,)
        check_against_reference(logits, args, keys, tok)


@pytest.mark.parametrize("case", list(GOF_CASES))
def test_goodness_of_fit(case):
    args, kept = GOF_CASES[case]
    n = 1000
    p = target(args[0], kept)
    keys = keys_from_seeds([splitmix(77, pos) for pos in range(n)])
    tok = sample_tokens_triton(gof_logits().expand(n, -1), *args, keys=keys, block=16)
    counts = torch.bincount(tok, minlength=p.shape[0]).double()
    assert (counts[p == 0] == 0).all(), f"{case}: drew a token outside the kept set: {counts.tolist()}"
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < tv_bound(p, n), f"{case}: TV {tv:.4f} >= bound {tv_bound(p, n):.4f}; counts {counts.tolist()}"


def test_batch_invariance():
    g = torch.Generator().manual_seed(5)
    V, args = 90, (0.8, 0.7, 25, 0.01)
    rows = torch.randn(3, V, generator=g) * 3
    u = keys_from_seeds([splitmix(99, i) for i in range(3)])
    alone = torch.cat([sample_tokens_triton(rows[i:i + 1], *args, keys=u[i:i + 1], block=32) for i in range(3)])
    others, uo = torch.randn(9, V, generator=g) * 3, random_keys(9, g)
    at = torch.tensor([8, 0, 4])
    others[at], uo[at] = rows, u
    assert torch.equal(sample_tokens_triton(others, *args, keys=uo, block=32)[at], alone)


def test_edge_cases():
    u3 = torch.tensor([0, 12345, (1 << 63) - 1], dtype=torch.int64)
    st = sample_tokens_triton
    assert st(torch.zeros(0, 9), 1.0, keys=torch.zeros(0, dtype=torch.int64)).shape == (0,)
    assert st(torch.zeros(3, 1), 1.0, 0.5, 5, 0.5, keys=u3).tolist() == [0, 0, 0]  # V = 1
    assert st(torch.tensor([[0.0, 10.0, 0.0, 0.0]]).expand(3, -1), 1.0, top_p=0.5, keys=u3).tolist() == [1, 1, 1]
    # ties: top-k keeps every token tied at the k-th value; top-p ranks ties by lower id first, across blocks
    ties, k64 = torch.zeros(48, 40), keys_from_seeds([splitmix(5, i) for i in range(48)])
    assert len(set(st(ties, 1.0, top_k=1, keys=k64, block=16).tolist())) > 20
    assert set(st(ties, 1.0, top_p=0.5 / 40, keys=k64, block=16).tolist()) == {0}
    assert set(st(ties, 1.0, top_p=20.5 / 40, keys=k64, block=16).tolist()) <= set(range(21))
    assert set(st(ties, 1.0, top_p=20.5 / 40, keys=k64, block=16).tolist()) & {17, 18, 19, 20}  # past block 1
    inf = torch.tensor([[-math.inf, 1.0, -math.inf, 2.0, -math.inf]])
    assert set(st(inf.expand(16, -1), 1.0, keys=k64[:16]).tolist()) == {1, 3}
    assert st(torch.full((3, 5), -math.inf), 1.0, 0.9, 2, 0.1, keys=u3).tolist() == [0, 0, 0]
    pad = torch.full((3, 70), -math.inf)
    pad[:, 66] = 0.0
    assert st(pad, 1.0, 0.9, 3, 0.1, keys=u3, block=16).tolist() == [66] * 3
    x = torch.randn(4, 30)
    assert torch.equal(st(x, 0.0), x.argmax(-1))  # greedy: the argmax, no keys needed
    with pytest.raises(ValueError, match="^block"):
        st(torch.zeros(3, 9), 1.0, keys=u3, block=24)


def test_interpreter_copy_after_compiled_import(monkeypatch):
    """The kernel module loaded in compiled mode first (as a CUDA caller in the same process would) does not stick:
    under TRITON_INTERPRET=1 the wrapper takes the interpreted copy (a plain import kept the compiled one and failed
    with "0 active drivers" on a CPU tensor)."""
    import sys

    from lightning_moe.kernels.fused_moe import _KERNEL_MODULES, _triton_kernels

    for key in [k for k in _KERNEL_MODULES if k[0] == "_sampling_triton"]:
        monkeypatch.delitem(_KERNEL_MODULES, key)
    monkeypatch.delitem(sys.modules, "lightning_moe.kernels._sampling_triton", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET")
    _triton_kernels("_sampling_triton")  # the compiled copy, first
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    assert sample_tokens_triton(logits, 1.0, top_k=1, keys=torch.tensor([7])).tolist() == [1]
