"""Prefill micro-batches: row and padded-token caps (pipeline/prefill.py), and the planner's choice of rows."""

from __future__ import annotations

import random

import pytest

from lightning_moe.pipeline.attention_placement import MicroBatch
from lightning_moe.pipeline.prefill import prefill_chunks
from lightning_moe.policy.milp import prefill_chunk_tokens, prefill_micro_batch
from lightning_moe.policy.policy import Policy


def _chunks(lens, prefill_mu, prefill_tokens):
    pol = Policy(mu=len(lens), n=1, prefill_mu=prefill_mu, prefill_tokens=prefill_tokens)
    prompts = [[1] * n for n in lens]
    mb = MicroBatch(rows=list(range(len(lens))), kv=None, on_gpu=False)
    return prefill_chunks(prompts, mb.rows, pol)


@pytest.mark.parametrize("seed", range(20))
def test_chunks_respect_caps_and_cover_rows_in_order(seed):
    rng = random.Random(seed)
    lens = sorted(rng.randint(1, 300) for _ in range(rng.randint(1, 60)))
    pmu, ptok = rng.randint(1, 20), rng.choice([64, 256, 1024])
    chunks = _chunks(lens, pmu, ptok)
    assert [r for _, rows in chunks for r in rows] == list(range(len(lens)))
    for off, rows in chunks:
        assert rows[0] == off and len(rows) <= pmu
        padded = len(rows) * max(lens[r] for r in rows)
        assert padded <= ptok or len(rows) == 1  # a single longer prompt runs alone
        assert padded <= prefill_chunk_tokens(pmu, max(lens), ptok)
    # greedy: the next row would have broken a cap
    for (off, rows), (nxt, _) in zip(chunks, chunks[1:]):
        more = rows + [nxt]
        assert len(more) > pmu or len(more) * max(lens[r] for r in more) > ptok


def test_outlier_gets_its_own_chunk_and_short_rows_pack():
    chunks = _chunks([10] * 12 + [425], prefill_mu=64, prefill_tokens=400)
    assert [len(r) for _, r in chunks] == [12, 1]


def test_prefill_rows_sized_by_mean_prompt():
    assert prefill_micro_batch(512, 112.4) == 32  # 32 * 113 <= 4096 < 64 * 113, and 32 divides 512
    assert prefill_micro_batch(512, 425) == 8
    assert prefill_micro_batch(7, 5000) == 1
    assert prefill_chunk_tokens(32, 425) == 4096 and prefill_chunk_tokens(4, 425) == 1700 and prefill_chunk_tokens(4, 5000) == 5000


def test_prefill_rows_not_a_far_smaller_divisor():
    """mu = 334 = 2 x 167 with 97 rows allowed (8192 tokens, mean 83.1): the H200 int4 run's policy got 2-row chunks
    (167 per micro-batch and layer; prefill 0.10 of its HRM). A divisor is kept only when it is at least half the cap."""
    assert prefill_micro_batch(334, 83.1, 8192) == 97  # the largest divisor under 97 is 2: not kept
    assert prefill_micro_batch(2000, 83.1, 4096) == 40  # 40 divides 2000 and 2 x 40 >= 48: kept
    assert prefill_micro_batch(97, 10.0, 4096) == 97  # prime mu under the cap: all rows
    assert prefill_micro_batch(101, 50.0, 4096) == 81  # prime mu over the cap: the cap, not 1
    for mu in range(1, 400):
        p = prefill_micro_batch(mu, 83.1, 8192)
        cap = min(mu, 8192 // 84)
        assert 1 <= p <= cap and 2 * p >= cap


@pytest.mark.parametrize("mu,n,prefill_mu", [(334, 2, 97), (1000, 1, 40), (101, 3, 81), (7, 2, 7), (50, 4, 3)])
def test_hrm_counts_the_chunks_the_executor_cuts(mu, n, prefill_mu):
    """hrm.pass_prefill_chunks (the HRM's prefill micro-batches of a first fill) = the executor's prefill_chunks over
    each of the n decode micro-batches (equal-length prompts, under the token cap): the same chunk sizes, counted."""
    from collections import Counter

    from lightning_moe.policy import hrm

    pol = Policy(mu=mu, n=n, prefill_mu=prefill_mu, prefill_tokens=1 << 20)
    prompts = [[1] * 84 for _ in range(mu * n)]
    executor = Counter(len(rows) for k in range(n) for _, rows in prefill_chunks(prompts, range(k * mu, (k + 1) * mu), pol))
    planned = Counter()
    for count, size in hrm.pass_prefill_chunks(pol):
        planned[size] += count
    assert planned == executor


def _best_chunk_brute_force(lens, rows, padded_tokens):
    """Largest packed sum of any subset the chunker's caps allow (k rows, longest L: k <= rows and k L <= padded, or
    k = 1), by enumeration."""
    from itertools import combinations

    best = 0
    for k in range(1, min(rows, len(lens)) + 1):
        for sub in combinations(lens, k):
            if k == 1 or k * max(sub) <= padded_tokens:
                best = max(best, sum(sub))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_packed_chunk_tokens_is_the_largest_chunk_any_order_allows(seed):
    """hrm.packed_chunk_tokens (the memory model's packed tokens of the largest prefill chunk, from the job's
    prompt lengths) equals the enumerated maximum over every subset the caps allow, and no chunk the executor
    forms from any order of those rows holds more."""
    from lightning_moe.policy.hrm import packed_chunk_tokens

    rng = random.Random(seed)
    lens = [rng.choice([rng.randint(0, 40), rng.randint(1, 300)]) for _ in range(rng.randint(1, 11))]
    pmu, ptok = rng.randint(1, 6), rng.choice([30, 100, 400, 1200])
    bound = packed_chunk_tokens(tuple(lens), pmu, ptok)
    assert bound == _best_chunk_brute_force(lens, pmu, ptok)
    for order in (sorted(lens), sorted(lens, reverse=True), rng.sample(lens, len(lens))):
        for _, rows in _chunks(order, pmu, ptok):
            assert sum(order[r] for r in rows) <= bound


def test_packed_chunk_tokens_by_hand():
    """[300, 200, 200, 100, 100, 100] in chunks of <= 4 rows and <= 600 padded tokens: a chunk led by 300 takes 2
    rows (500), by 200 takes 3 (500), by 100 takes 4 (300 of the 100s): 500, where rows x longest would say 600."""
    from lightning_moe.policy.hrm import packed_chunk_tokens

    assert packed_chunk_tokens((100, 200, 300, 100, 200, 100), 4, 600) == 500
    assert packed_chunk_tokens((700, 10), 4, 600) == 700  # a row longer than the cap forms a chunk alone
