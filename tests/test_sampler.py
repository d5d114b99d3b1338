"""kernels.sampling (issue 43): the vectorized sampler against its float64 per-row reference and against exact target
distributions.

* Goodness of fit: N = 100 000 draws at fixed logits for temperature, top-p, top-k, min-p and all four together, the
  target distribution written out by hand; the empirical distribution's total-variation distance to it must stay
  under ``0.5 * sum_i sqrt(p_i (1 - p_i) / N) + sqrt(ln(1 / delta) / (2 N))`` with delta = 1e-9 (the first term
  bounds E[TV] by Jensen, the second McDiarmid's deviation: one draw moves TV by at most 1 / N), so a correct sampler
  fails with probability < 1e-9 whatever the seed; every token outside the kept set must never be drawn.
* Agreement with the reference on random inputs (awkward B, V; fp32, bf16, fp16): the float64 reference races the
  same hash values; the drawn token's float64 race score is within 1e-5 of the row's best (fp32 filtering against
  float64) and the tokens agree on >= 90% of rows. The hash itself against a pure-Python fmix32.
* Robustness: logits x (1 + 1e-4 noise) change at most 1 of 512 rows' tokens (the old one-uniform inverse CDF
  changed 6, and 35 with top-p 0.9).
* Batch invariance, resume invariance, greedy = argmax, edge cases and argument errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.kernels.sampling import (keys_from_seeds, race_uniforms, reference_probs, sample_tokens,
                                            sample_tokens_reference)

BLOCK = 1024  # a width for "several thousand tokens" shapes (the sampler has no blocks)

_MASK64 = (1 << 64) - 1


def splitmix(seed: int, position: int) -> int:
    """A 63-bit per-draw seed of (seed, position): the formula of pipeline's ``position_seed`` (copied: tests of a
    kernel need no pipeline import)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------------------------------
# goodness of fit
# --------------------------------------------------------------------------------------------------------------------

# probabilities at temperature 1, listed best first, and the token id of each (ids not in probability order)
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
IDS = [5, 2, 7, 0, 3, 6, 1]  # token 4 has probability 0 (logit -inf)
V_GOF = 8

# (temperature, top_p, top_k, min_p) -> the ranks (indices into PROBS) that stay, worked out by hand:
GOF_CASES = {
    "temperature 0.7": ((0.7, 1.0, 0, 0.0), [0, 1, 2, 3, 4, 5, 6]),
    "temperature 1.5": ((1.5, 1.0, 0, 0.0), [0, 1, 2, 3, 4, 5, 6]),
    # mass ranked before: 0, .4, .65, .8 -> the first three stay (.65 < .7), the fourth goes (.8 >= .7)
    "top_p 0.7": ((1.0, 0.7, 0, 0.0), [0, 1, 2]),
    "top_k 3": ((1.0, 1.0, 3, 0.0), [0, 1, 2]),
    # p >= 0.2 * 0.4 = 0.08 -> .4 .25 .15 .1
    "min_p 0.2": ((1.0, 1.0, 0, 0.2), [0, 1, 2, 3]),
    # temperature 0.5: q ~ p^2 = .16 .0625 .0225 .01 .0025 .0009 .0004; min_p .05 keeps q >= .008 (four);
    # top_k 3 keeps three; top_p .8 over .16 .0625 .0225 (/ .245 = .653 .255 .092): mass before 0, .653, .908 -> two
    "all four": ((0.5, 0.8, 3, 0.05), [0, 1]),
}


def gof_logits() -> torch.Tensor:
    x = torch.full((V_GOF,), -math.inf)
    for p, i in zip(PROBS, IDS):
        x[i] = math.log(p) + 1.7  # an offset: only differences matter
    return x


def target(temperature: float, kept_ranks: list[int]) -> torch.Tensor:
    """float64 [V]: p^(1 / T) over the kept tokens, normalized."""
    t = torch.zeros(V_GOF, dtype=torch.float64)
    for r in kept_ranks:
        t[IDS[r]] = PROBS[r] ** (1.0 / temperature)
    return t / t.sum()


def tv_bound(p: torch.Tensor, n: int, delta: float = 1e-9) -> float:
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


def draw_counts(logits_row: torch.Tensor, args: tuple, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    keys = keys_from_seeds([splitmix(seed, pos) for pos in range(n)])
    rows = logits_row.to(dtype).expand(4096, -1)
    tok = torch.cat([sample_tokens(rows[: len(c)], *args, keys=c) for c in keys.split(4096)])
    return torch.bincount(tok, minlength=logits_row.shape[0]).double()


@pytest.mark.parametrize("case", list(GOF_CASES))
@pytest.mark.parametrize("seed", [0, 20261204])
def test_goodness_of_fit(case, seed):
    args, kept = GOF_CASES[case]
    n = 100_000
    p = target(args[0], kept)
    counts = draw_counts(gof_logits(), args, n, seed)
    assert counts.sum() == n
    assert (counts[p == 0] == 0).all(), f"{case}: drew a token outside the kept set: {counts.tolist()}"
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < tv_bound(p, n), f"{case}: TV {tv:.4f} >= bound {tv_bound(p, n):.4f}; counts {counts.tolist()}"


def test_goodness_of_fit_many_blocks():
    """V of several thousand tokens, bf16 logits: the draws fit the float64 target."""
    g = torch.Generator().manual_seed(3)
    V, n = 3 * BLOCK + 17, 40_000
    row = torch.randn(V, generator=g) * 4
    row[torch.randperm(V, generator=g)[:40]] += 9  # ~40 tokens carry most of the mass, spread over the blocks
    row = row.to(torch.bfloat16)
    args = (0.9, 1.0, 0, 0.0005)
    p = reference_probs(row.view(1, V), *args)[0]
    counts = draw_counts(row.float(), args, n, seed=11, dtype=torch.bfloat16)
    assert (counts[p == 0] == 0).all()
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < tv_bound(p, n), f"TV {tv:.4f} >= bound {tv_bound(p, n):.4f}"


# --------------------------------------------------------------------------------------------------------------------
# agreement with the reference
# --------------------------------------------------------------------------------------------------------------------

PARAMS = [(1.0, 1.0, 0, 0.0), (0.6, 0.9, 0, 0.0), (1.3, 1.0, 40, 0.0), (1.0, 1.0, 0, 0.05), (0.8, 0.7, 25, 0.01),
          (2.0, 0.5, 1, 0.0), (1.0, 0.99, 5000, 0.0)]


def random_keys(B: int, g: torch.Generator) -> torch.Tensor:
    k = torch.randint(0, (1 << 63) - 1, (B,), dtype=torch.int64, generator=g)
    k[1], k[2] = 0, (1 << 63) - 1  # the extremes
    return k


@pytest.mark.parametrize("V", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 333])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(V, dtype):
    g = torch.Generator().manual_seed(V * 7 + 1)
    B = 13
    for args in PARAMS:
        logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
        logits[0, : V // 3] = -math.inf  # a row with a third of its tokens impossible
        keys = random_keys(B, g)
        tok = sample_tokens(logits, *args, keys=keys)
        ref = sample_tokens_reference(logits, *args, keys=keys)
        assert tok.dtype == torch.int64 and tok.shape == (B,)
        p = reference_probs(logits, *args)  # [B, V] float64
        e = -torch.log1p(-race_uniforms(keys, V).double())
        score = torch.where(p > 0, p.log() - e.log(), -math.inf)  # the float64 race scores
        got = score.gather(1, tok.view(B, 1)).view(B)
        assert (p.gather(1, tok.view(B, 1)) > 0).all(), f"{args}: drew a token of probability 0"
        assert (got >= score.amax(-1) - 1e-5).all(), (args, tok, ref)
        assert torch.equal(ref, score.argmax(-1))
        assert (tok == ref).float().mean() >= 0.9, (args, tok, ref)


def fmix32_py(h: int) -> int:
    """murmur3's fmix32 in Python integers (the hash's definition)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_race_uniforms_hash():
    """race_uniforms against the formula in Python integers, for keys with high bits set and awkward token ids."""
    keys = [0, 1, (1 << 63) - 1, 0x5EADBEEF92345678, 1 << 32, 0xFFFFFFFF]
    V = 70
    w = race_uniforms(torch.tensor(keys, dtype=torch.int64), V)
    for r, key in enumerate(keys):
        ka, kb = fmix32_py(key & 0xFFFFFFFF), fmix32_py((key >> 32) ^ 0x85EBCA77)
        for i in range(V):
            h = fmix32_py(((i * 0x9E3779B1 + ka) & 0xFFFFFFFF) ^ kb)
            want = min(float(torch.tensor(float(h), dtype=torch.float32) + 0.5) * 2.0 ** -32, 1 - 2.0 ** -24)
            assert abs((h + 0.5) / 2 ** 32 - want) <= 1.2e-7 * want  # fp32: two roundings of 2**-24 at most
            assert float(w[r, i]) == want, (key, i)  # the same fp32 roundings, exactly
    big = race_uniforms(torch.tensor([12345], dtype=torch.int64), 200_000)[0]  # roughly uniform on (0, 1)
    assert 0 < float(big.min()) and float(big.max()) < 1
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float((big < 0.1).double().mean()) - 0.1) < 0.005


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_robust_to_tiny_logit_changes(top_p):
    """At fixed keys, logits x (1 + 1e-4 noise) (a resumed prefill's fp32 differences are ~1e-6..1e-5) change at
    most 1 of 512 rows' tokens. The one-uniform inverse CDF changed 6 (top-p 0.9: 35) here, since any change of the
    mass before the drawn token moves its boundary; the race changes a token only when two scores nearly tie."""
    g = torch.Generator().manual_seed(0)
    B, V = 512, 32000
    logits = torch.randn(B, V, generator=g) * 0.5
    noisy = logits * (1 + 1e-4 * torch.randn(B, V, generator=g))
    keys = keys_from_seeds([splitmix(i * 7 + 3, 5) for i in range(B)])
    a, b = sample_tokens(logits, 0.8, top_p, keys=keys), sample_tokens(noisy, 0.8, top_p, keys=keys)
    assert int((a != b).sum()) <= 1, f"{int((a != b).sum())} of {B} tokens changed"
    assert len(set(a.tolist())) > B // 2  # the draws do vary


# --------------------------------------------------------------------------------------------------------------------
# invariance, greedy
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", PARAMS[:5])
def test_batch_invariance(args):
    """A row's token depends on its own logits and key only: alone, or at any place in batches of other rows."""
    g = torch.Generator().manual_seed(5)
    V = 2 * BLOCK + 100
    rows = torch.randn(6, V, generator=g) * 3
    u = keys_from_seeds([splitmix(99, i) for i in range(6)])
    alone = torch.cat([sample_tokens(rows[i:i + 1], *args, keys=u[i:i + 1]) for i in range(6)])
    for B in (7, 64, 129):
        others = torch.randn(B, V, generator=g) * 3
        uo = random_keys(B, g)
        at = torch.randperm(B, generator=g)[:6]
        others[at], uo[at] = rows, u
        assert torch.equal(sample_tokens(others, *args, keys=uo)[at], alone), B


def test_resume_invariance():
    """Decoding a request in shifting batches and resuming it at position 10 in another batch draws the same
    tokens: each draw's key is a function of (request seed, output position) only."""
    V, steps, args = 500, 20, (0.9, 0.95, 50, 0.01)

    def logits_at(request: int, pos: int) -> torch.Tensor:  # the model, stood in for by a fixed function
        return torch.randn(V, generator=torch.Generator().manual_seed(request * 1000 + pos)) * 2

    def run(requests: list[int], start: int) -> dict[int, list[int]]:
        out = {r: [] for r in requests}
        for pos in range(start, steps):
            batch = requests if pos % 2 else requests[::-1]  # the batch order changes from step to step
            logits = torch.stack([logits_at(r, pos) for r in batch])
            u = keys_from_seeds([splitmix(12345 + r, pos) for r in batch])
            for r, t in zip(batch, sample_tokens(logits, *args, keys=u).tolist()):
                out[r].append(t)
        return out

    full = run([0, 1, 2, 3], 0)[2]
    resumed = run([2, 7], 10)[2]
    assert resumed == full[10:]
    assert len(set(full)) > 1  # the draws do vary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 1500, generator=g) * 2).to(dtype)
    logits[3, [10, 20, 700]] = 50  # a tie: the lowest id wins
    tok = sample_tokens(logits, 0.0, top_p=0.5, top_k=3)
    assert torch.equal(tok, sample_tokens_reference(logits, 0.0))
    assert torch.equal(tok, logits.float().argmax(-1)) and tok[3] == 10


# --------------------------------------------------------------------------------------------------------------------
# edge cases, argument errors
# --------------------------------------------------------------------------------------------------------------------


def test_edge_cases():
    u3 = torch.tensor([0, 12345, (1 << 63) - 1], dtype=torch.int64)
    assert sample_tokens(torch.zeros(0, 9), 1.0, keys=torch.zeros(0, dtype=torch.int64)).shape == (0,)
    assert sample_tokens(torch.zeros(0, 9), 0.0).shape == (0,)
    assert sample_tokens(torch.zeros(3, 1), 1.0, 0.5, 5, 0.5, keys=u3).tolist() == [0, 0, 0]  # V = 1
    # top-p keeps exactly one token
    one = torch.tensor([[0.0, 10.0, 0.0, 0.0]]).expand(3, -1)
    assert sample_tokens(one, 1.0, top_p=0.5, keys=u3).tolist() == [1, 1, 1]
    # ties: top-k keeps every token tied at the k-th value; top-p ranks ties by lower id first
    ties, k64 = torch.zeros(64, 4), keys_from_seeds([splitmix(5, i) for i in range(64)])
    assert set(sample_tokens(ties, 1.0, top_k=1, keys=k64).tolist()) == {0, 1, 2, 3}
    # mass ranked before each: 0, .25, .5, .75; a token stays while that mass is < top_p
    assert set(sample_tokens(ties, 1.0, top_p=0.25, keys=k64).tolist()) == {0}
    assert set(sample_tokens(ties, 1.0, top_p=0.3, keys=k64).tolist()) == {0, 1}
    assert set(sample_tokens(ties, 1.0, top_p=0.5, keys=k64).tolist()) == {0, 1}
    # -inf logits are never drawn, not even at the keys' extremes; an all -inf row gives the greedy token
    inf = torch.tensor([[-math.inf, 1.0, -math.inf, 2.0, -math.inf]])
    assert set(sample_tokens(inf.expand(64, -1), 1.0, keys=k64).tolist()) == {1, 3}
    assert set(sample_tokens(inf.expand(3, -1), 1.0, keys=u3).tolist()) <= {1, 3}
    assert sample_tokens(torch.full((3, 5), -math.inf), 1.0, 0.9, 2, 0.1, keys=u3).tolist() == [0, 0, 0]
    # one finite token among many -inf ones is always drawn
    pad = torch.full((3, BLOCK + 5), -math.inf)
    pad[:, BLOCK + 1] = 0.0
    assert sample_tokens(pad, 1.0, keys=u3).tolist() == [BLOCK + 1] * 3


def test_keys_from_seeds():
    k = keys_from_seeds([0, (1 << 63) - 1, 1 << 62])
    assert k.dtype == torch.int64 and k.tolist() == [0, (1 << 63) - 1, 1 << 62]
    with pytest.raises(ValueError, match=r"seeds\[1\]"):
        keys_from_seeds([0, -1])
    with pytest.raises(ValueError, match=r"seeds\[0\]"):
        keys_from_seeds([1 << 63])


@pytest.mark.parametrize("kw, field", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                       ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"),
                                       ({"min_p": -0.1}, "min_p"), ({"keys": torch.zeros(2, dtype=torch.int64)}, "keys"),
                                       ({"keys": torch.tensor([5, -1, 3])}, "keys"),
                                       ({"keys": torch.zeros(3)}, "keys"), ({"keys": None}, "keys")])
def test_argument_errors(kw, field):
    args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "keys": torch.zeros(3, dtype=torch.int64)} | kw
    with pytest.raises(ValueError, match=f"^{field}"):
        sample_tokens(torch.zeros(3, 4), **args)
    with pytest.raises(ValueError, match="^logits"):
        sample_tokens(torch.zeros(3), 1.0, keys=torch.zeros(3, dtype=torch.int64))


def test_pipeline_sample_draws_in_chunks_the_memory_model_counts(monkeypatch):
    """pipeline.sampling.sample splits the rows into calls of policy.hrm.sampler_rows(V) rows (so the sampler's
    temporaries stay within what hrm.micro_batch_workspace counts), and the tokens equal one call over every row."""
    from lightning_moe.pipeline import sampling as ps
    from lightning_moe.policy import hrm

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 301, generator=g)
    params = ps.DecodeSampling(8, temperature=0.9, top_p=0.8, top_k=40)
    seeds, pos = list(range(100, 137)), [i % 5 for i in range(37)]
    whole = ps.sample(logits, params, seeds, pos)
    monkeypatch.setattr(hrm, "SAMPLER_CHUNK_ELEMS", 301 * 5)  # 5 rows a call
    seen = []
    real = ps.sample_tokens
    monkeypatch.setattr(ps, "sample_tokens", lambda lg, *a: seen.append(lg.shape[0]) or real(lg, *a))
    assert torch.equal(ps.sample(logits, params, seeds, pos), whole)
    assert max(seen) <= 5 and sum(seen) == 37 and len(seen) == 8
    assert ps.sample(logits[:0], params, [], []).shape == (0,)


def test_micro_batch_workspace_covers_the_sampler():
    """The decode workspace of a micro-batch holds the sampler's call: sampler_rows(V) rows x V x
    SAMPLER_BYTES_PER_ELEM bytes (a model whose layers are tiny next to its vocabulary, so the sampler binds)."""
    from types import SimpleNamespace

    from lightning_moe.policy import hrm

    spec = SimpleNamespace(attn_query_elems=8, kv_elems_per_token=8, attn_output_elems=8, hidden_size=8,
                           vocab_size=50000, intermediate_size=8, top_k=1, num_experts=2, num_shared_experts=0,
                           shared_intermediate_size=0, dense_intermediate_size=0)
    for mu in (1, 7, 64, 1000):
        rows = min(mu, hrm.sampler_rows(50000))
        assert hrm.micro_batch_workspace(spec, mu, mu, "bf16", 1, sampling=True) >= rows * 50000 * hrm.SAMPLER_BYTES_PER_ELEM
    # greedy decoding is an argmax: no sampler temporaries (one row: far below the sampler's term)
    assert hrm.micro_batch_workspace(spec, 1, 1, "bf16", 1) < 50000 * hrm.SAMPLER_BYTES_PER_ELEM
