"""CPU tests of lightning_moe.policy.batching (length-balanced micro-batches)."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from lightning_moe.policy.batching import KV_GROUPS, batches, length_groups, padded_positions, partition


def _optimum(lengths: list[int], mu: int, n: int) -> int:
    """Exact min over assignments (each micro-batch <= mu sequences) of the largest total length."""
    best = None
    for assign in itertools.product(range(n), repeat=len(lengths)):
        counts = [0] * n
        totals = [0] * n
        for i, j in enumerate(assign):
            counts[j] += 1
            totals[j] += lengths[i]
        if max(counts, default=0) <= mu:
            m = max(totals)
            best = m if best is None else min(best, m)
    assert best is not None
    return best


def _check_cover(groups: list[list[int]], count: int, mu: int, n: int) -> None:
    assert len(groups) == n
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(count))  # every index exactly once
    assert all(len(g) <= mu for g in groups)
    assert all(g == sorted(g) for g in groups)


@pytest.mark.parametrize("seed", range(40))
def test_cover_and_sizes_random(seed: int) -> None:
    rng = random.Random(seed)
    mu = rng.randint(1, 9)
    n = rng.randint(1, 9)
    count = rng.randint(0, mu * n)
    lengths = [rng.randint(0, 500) for _ in range(count)]
    groups = partition(lengths, mu, n)
    _check_cover(groups, count, mu, n)


@pytest.mark.parametrize("seed", range(150))
def test_balance_within_max_length_of_optimum(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 3)
    mu = rng.randint(1, 4)
    count = rng.randint(1, min(mu * n, 8))
    hi = rng.choice([5, 50, 1000])
    lengths = [rng.randint(1, hi) for _ in range(count)]
    groups = partition(lengths, mu, n)
    _check_cover(groups, count, mu, n)
    got = max(sum(lengths[i] for i in g) for g in groups)
    opt = _optimum(lengths, mu, n)
    assert opt <= got <= opt + max(lengths), (lengths, mu, n, groups)


def test_balance_large_against_lower_bound() -> None:
    rng = random.Random(7)
    for _ in range(20):
        mu, n = rng.randint(4, 64), rng.randint(2, 16)
        lengths = [rng.randint(1, 4096) for _ in range(mu * n)]
        groups = partition(lengths, mu, n)
        _check_cover(groups, len(lengths), mu, n)
        got = max(sum(lengths[i] for i in g) for g in groups)
        lower = max(-(-sum(lengths) // n), max(lengths))  # optimum >= both
        assert got <= lower + max(lengths)


def test_equal_lengths_even_split() -> None:
    groups = partition([10] * 12, mu=4, n=3)
    assert [len(g) for g in groups] == [4, 4, 4]
    groups = partition([10] * 7, mu=4, n=3)
    assert sorted(len(g) for g in groups) == [2, 2, 3]


def test_known_example() -> None:
    # LPT: 9 -> b0, 8 -> b1, 7 -> b2, 3 -> b2 (7), 2 -> b1 (8), 1 -> b0 (9)... totals 10, 10, 10
    lengths = [9, 8, 7, 3, 2, 1]
    groups = partition(lengths, mu=2, n=3)
    assert sorted(sum(lengths[i] for i in g) for g in groups) == [10, 10, 10]


def test_deterministic() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(0, 20) for _ in range(50)]  # many ties
    first = partition(lengths, 8, 7)
    for _ in range(3):
        assert partition(list(lengths), 8, 7) == first
    assert partition(tuple(lengths), 8, 7) == first


def test_default_n_is_fewest_micro_batches() -> None:
    assert len(partition([1] * 10, mu=4)) == 3
    assert len(partition([1] * 8, mu=4)) == 2
    assert partition([], mu=4) == []
    assert partition([], mu=4, n=2) == [[], []]


def test_fewer_sequences_than_micro_batches() -> None:
    groups = partition([5, 3], mu=4, n=4)
    _check_cover(groups, 2, 4, 4)
    assert sum(1 for g in groups if not g) == 2


@pytest.mark.parametrize(
    "lengths, mu, n",
    [
        ([1, 2, 3], 1, 2),  # 3 > 1*2
        ([1] * 9, 4, 2),  # 9 > 8
        ([1], 0, 1),
        ([1], 1, 0),
        ([1], -1, None),
        ([1], 2.0, 1),
        ([1], True, 1),
        ([1], 1, 1.5),
        ([-1], 1, 1),
        ([1.5], 1, 1),
        (["3"], 1, 1),
    ],
)
def test_errors(lengths, mu, n) -> None:
    with pytest.raises(ValueError):
        partition(lengths, mu, n)


def test_batches() -> None:
    assert batches(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches(range(8), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches([], 3) == []
    assert batches(["a", "b"], 5) == [["a", "b"]]
    for bad in (0, -2, 1.0, None):
        with pytest.raises(ValueError):
            batches([1, 2], bad)


# ---- length_groups: least padded positions of a grouped KV cache ---------------------------------
def _padded_brute_force(lengths: list[int], max_groups: int) -> int:
    """Exact min over every assignment of rows to at most max_groups groups of sum_g |g| max(g)."""
    best = None
    for assign in itertools.product(range(max_groups), repeat=len(lengths)):
        groups = [[i for i, a in enumerate(assign) if a == g] for g in range(max_groups)]
        cost = padded_positions(lengths, groups)
        best = cost if best is None else min(best, cost)
    return best


def _check_groups(groups: list[list[int]], lengths: list[int], max_groups: int) -> None:
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row exactly once
    assert all(groups) and len(groups) <= min(max_groups, len(set(lengths)))
    assert all(g == sorted(g, key=lambda i: (lengths[i], i)) for g in groups)  # sorted by length inside
    assert all(lengths[a[-1]] < lengths[b[0]] for a, b in zip(groups, groups[1:]))  # increasing, equal lengths together


@pytest.mark.parametrize("seed", range(120))
def test_length_groups_optimal_vs_brute_force(seed: int) -> None:
    rng = random.Random(7000 + seed)
    count, G = rng.randint(1, 7), rng.randint(1, 4)
    lengths = [rng.choice([rng.randint(1, 12), rng.randint(1, 400)]) for _ in range(count)]
    groups = length_groups(lengths, G)
    _check_groups(groups, lengths, G)
    assert padded_positions(lengths, groups) == _padded_brute_force(lengths, G), (lengths, G, groups)


def _padded_dp(lengths: list[int], G: int) -> int:
    """Textbook O(G U^2) DP over the sorted distinct lengths (reference for larger inputs)."""
    u = sorted(set(lengths))
    C = [0]
    for x in u:
        C.append(C[-1] + lengths.count(x))
    f = [0] + [float("inf")] * len(u)
    best = float("inf")
    for _ in range(G):
        f = [float("inf")] + [min(f[i] + (C[j] - C[i]) * u[j - 1] for i in range(j)) for j in range(1, len(u) + 1)]
        best = min(best, f[-1])
    return best


@pytest.mark.parametrize("seed", range(30))
def test_length_groups_equals_quadratic_dp(seed: int) -> None:
    rng = random.Random(9000 + seed)
    lengths = [rng.choice([rng.randint(0, 60), rng.randint(0, 3000)]) for _ in range(rng.randint(1, 150))]
    G = rng.randint(1, 10)
    groups = length_groups(lengths, G)
    _check_groups(groups, lengths, G)
    assert padded_positions(lengths, groups) == _padded_dp(lengths, G)


def test_length_groups_edge_cases_and_speed() -> None:
    assert length_groups([], 8) == []
    assert length_groups([5, 3, 9], 1) == [[1, 0, 2]]  # G = 1: one group, sorted by length
    assert length_groups([4, 4, 4], 8) == [[0, 1, 2]]  # never more groups than distinct lengths
    assert length_groups([3, 90, 5, 41, 40], 3) == [[0, 2], [4, 3], [1]]
    assert length_groups([3, 90, 5, 41, 40], 8) == [[0], [2], [4], [3], [1]]
    with pytest.raises(ValueError):
        length_groups([1, 2], 0)
    with pytest.raises(ValueError):
        length_groups([1, -2], 2)
    rng = random.Random(1)
    lengths = [rng.randint(1, 4096) for _ in range(2048)]
    t0 = time.perf_counter()
    groups = length_groups(lengths, KV_GROUPS)
    assert time.perf_counter() - t0 < 1.0  # O(G U) with U ~ 1600 distinct lengths: milliseconds
    _check_groups(groups, lengths, KV_GROUPS)
    assert len(groups) == KV_GROUPS
    # more groups never pad more; G = U pads nothing
    costs = [padded_positions(lengths, length_groups(lengths, g)) for g in (1, 2, 4, 8, 16)]
    assert costs == sorted(costs, reverse=True) and costs[0] == 2048 * max(lengths)
    assert padded_positions(lengths, length_groups(lengths, len(set(lengths)))) == sum(lengths)
