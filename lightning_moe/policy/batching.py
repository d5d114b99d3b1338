"""Length-balanced partition of a batch of sequences into micro-batches.

CGOPipe (MoE-Lightning, arXiv 2411.11217, Sec. 4.1) runs a batch of N = mu * n sequences as n
micro-batches of at most mu sequences each. The CPU attention of a micro-batch costs time roughly
proportional to the total context length of its sequences, so the micro-batches are balanced by
total length: the slowest micro-batch sets the pace of the whole pipeline.

Everything here works on sequence *indices* (positions into the caller's list) and plain ints;
nothing imports torch.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence, TypeVar

T = TypeVar("T")

KV_GROUPS = 8  # length groups per micro-batch KV cache (kv_cache.GroupedKVCache; the planner's memory model)
SCORE_CHUNK_TOKENS = 1024  # rows per scoring-head chunk (token_scores.token_scores): chunk * V * 4 * 2 bytes of
#                            fp32 logits + log_softmax output, whatever the micro-batch's token count (the planner's memory model)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def partition(lengths: Sequence[int], mu: int, n: Optional[int] = None) -> list[list[int]]:
    """Split sequences (by index) into ``n`` micro-batches of at most ``mu`` sequences, balanced by length.

    Greedy LPT (longest processing time first) with a cardinality cap: indices are taken in order of
    decreasing length (ties: smaller index first) and each goes to the micro-batch with the smallest
    total length among those holding fewer than ``mu`` sequences (ties: fewer sequences, then lower
    micro-batch number). Without the cap LPT's largest total is at most the optimum plus the
    longest sequence (Graham 1969, "Bounds on multiprocessing timing anomalies"); the tests check that
    bound against the exact optimum on random inputs.

    Args:
        lengths: ``lengths[i]`` is the length of sequence ``i`` in tokens (its context length; >= 0).
        mu: maximum sequences per micro-batch (>= 1).
        n: number of micro-batches (>= 1). ``None``: the fewest that hold every sequence,
            ``ceil(len(lengths) / mu)`` (0 micro-batches for an empty ``lengths``).

    Returns:
        ``n`` lists of sequence indices; every index in ``range(len(lengths))`` appears exactly once,
        each list is sorted ascending and holds at most ``mu`` indices. Lists may be empty when
        ``len(lengths) < n``. Deterministic: the same input always gives the same output.

    Raises:
        ValueError: ``mu`` or ``n`` not a positive int, a length not a non-negative int, or
            ``len(lengths) > mu * n`` (the sequences do not fit).
    """
    _check_int("mu", mu, 1)
    lens = [_check_int(f"lengths[{i}]", v, 0) for i, v in enumerate(lengths)]
    if n is None:
        n = -(-len(lens) // mu)
    else:
        _check_int("n", n, 1)
    if len(lens) > mu * n:
        raise ValueError(f"{len(lens)} sequences do not fit in n={n} micro-batches of at most mu={mu} (capacity {mu * n})")

    groups: list[list[int]] = [[] for _ in range(n)]
    # heap of (total length, count, micro-batch number) over micro-batches that are not full
    heap = [(0, 0, j) for j in range(n)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        total, count, j = heapq.heappop(heap)
        groups[j].append(i)
        if count + 1 < mu:
            heapq.heappush(heap, (total + lens[i], count + 1, j))
    for g in groups:
        g.sort()
    return groups


def batches(indices: Sequence[T], N: int) -> list[list[T]]:
    """Cut a request list into consecutive batches of ``N`` (the last one may be shorter).

    Args:
        indices: items in order (request indices or the requests themselves).
        N: batch size in sequences (>= 1), normally the policy's ``mu * n``.

    Returns:
        ``[indices[0:N], indices[N:2N], ...]`` as lists; ``[]`` for an empty input.

    Raises:
        ValueError: ``N`` is not a positive int.
    """
    _check_int("N", N, 1)
    items = list(indices)
    return [items[s : s + N] for s in range(0, len(items), N)]


def group_by_length(lengths: Sequence[int], mu: int, n: Optional[int] = None) -> list[list[int]]:
    """Sequences grouped into micro-batches of similar length: sort by length, cut into n runs of <= mu.

    CGOPipe's decode attention and KV cache pad every row of a micro-batch to the micro-batch's longest
    sequence, so grouping similar lengths keeps the bytes read per step (and the KV memory) close to
    the sum of the real lengths; :func:`partition` (LPT balancing) would instead put one long prompt in
    every micro-batch. Sizes differ by at most one; deterministic (stable sort, ties by index).

    Raises:
        ValueError: ``len(lengths) > mu * n``, ``mu < 1`` or ``n < 1``.
    """
    N = len(lengths)
    if isinstance(mu, bool) or not isinstance(mu, int) or mu < 1:
        raise ValueError(f"group_by_length: mu must be an int >= 1, got {mu!r}")
    n = -(-N // mu) if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group_by_length: n must be an int >= 1, got {n!r}")
    if N > mu * n:
        raise ValueError(f"group_by_length: {N} sequences do not fit in {n} micro-batches of {mu}")
    order = sorted(range(N), key=lambda i: (lengths[i], i))
    base, extra = divmod(N, n)
    out, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(sorted(order[start : start + size]))
        start += size
    return out


def length_groups(lengths: Sequence[int], max_groups: int) -> list[list[int]]:
    """Rows (by index) grouped by similar length, minimising the padded positions of per-group dense storage.

    A grouped KV cache (pipeline/kv_cache.GroupedKVCache) stores each group as one dense tensor sized for
    the group's longest row, so it holds sum_g |g| * max(lengths[i] for i in g) positions. This returns
    the grouping into at most ``max_groups`` groups that minimises that objective, exactly.

    Method: an optimal grouping exists whose groups are runs of consecutive *distinct* lengths in sorted
    order (moving a row to the group with the smallest maximum >= its length never costs more), and
    splitting a run with two distinct lengths always saves, so the optimum uses exactly
    K = min(max_groups, U) groups over the U distinct lengths. Dynamic program over the distinct lengths
    u_1 < ... < u_U with C_j rows of length <= u_j:
    ``f_k(j) = min_{i<j} f_{k-1}(i) + (C_j - C_i) u_j``; each layer's inner minimum is a lower envelope of
    lines (slopes -C_i decreasing, queries u_j increasing), so the whole program runs in O(K U) integer
    operations (the textbook form is O(K U^2)), a few ms for thousands of rows.

    Args:
        lengths: ``lengths[i]`` is the length of row ``i`` (an int >= 0, e.g. prompt + new tokens).
        max_groups: the most groups to form (an int >= 1).

    Returns:
        Between 1 and ``min(max_groups, number of distinct lengths)`` non-empty lists of row indices (``[]``
        for an empty ``lengths``), ordered by increasing length; inside a group rows are sorted by
        (length, index). Every index in ``range(len(lengths))`` appears exactly once; rows of equal
        length are always in the same group. Deterministic.

    Raises:
        ValueError: ``max_groups`` not a positive int, or a length not a non-negative int.
    """
    _check_int("max_groups", max_groups, 1)
    lens = [_check_int(f"lengths[{i}]", v, 0) for i, v in enumerate(lengths)]
    if not lens:
        return []
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    u: list[int] = []  # distinct lengths, ascending
    C = [0]  # C[j]: rows with length <= u[j-1] (C[0] = 0)
    for i in order:
        if u and lens[i] == u[-1]:
            C[-1] += 1
        else:
            u.append(lens[i])
            C.append(C[-1] + 1)
    U = len(u)
    K = min(max_groups, U)
    # f[j]: least padded positions of the first j distinct lengths in k groups (layer k); arg[k][j]: split point
    f = [C[j] * u[j - 1] if j else 0 for j in range(U + 1)]  # k = 1
    arg: list[list[int]] = [[0] * (U + 1)]
    for k in range(2, K + 1):
        g = [0] * (U + 1)
        a = [0] * (U + 1)
        hull: list[int] = []  # candidate split points i (lines y = f[i] - C[i] x), lower envelope
        head = 0
        for j in range(k, U + 1):
            i = j - 1  # split point j - 1 becomes usable (k - 1 groups over its first j - 1 lengths)
            while len(hull) - head >= 2:  # hull[-1] is useless if (i, hull[-2]) cross before (hull[-1], hull[-2])
                i1, i2 = hull[-2], hull[-1]
                # lines l1 = (C[i1], f[i1]), l2, l3 = i with slopes -C decreasing: l2 never below both if
                # x(l1, l3) <= x(l1, l2), i.e. (f[i]-f[i1]) (C[i2]-C[i1]) <= (f[i2]-f[i1]) (C[i]-C[i1])
                if (f[i] - f[i1]) * (C[i2] - C[i1]) <= (f[i2] - f[i1]) * (C[i] - C[i1]):
                    hull.pop()
                else:
                    break
            hull.append(i)
            if head >= len(hull):
                head = len(hull) - 1
            x = u[j - 1]
            while len(hull) - head >= 2 and f[hull[head + 1]] - C[hull[head + 1]] * x <= f[hull[head]] - C[hull[head]] * x:
                head += 1
            best = hull[head]
            g[j] = f[best] + (C[j] - C[best]) * x
            a[j] = best
        f = g
        arg.append(a)
    cuts = [U]  # group boundaries over the distinct lengths, from the top
    j = U
    for k in range(K, 1, -1):
        j = arg[k - 1][j]
        cuts.append(j)
    cuts.append(0)
    cuts.reverse()
    return [order[C[cuts[k]] : C[cuts[k + 1]]] for k in range(K)]


def padded_positions(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """sum_g |g| * max(lengths[i] for i in g): the positions a grouped cache of ``groups`` allocates."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
