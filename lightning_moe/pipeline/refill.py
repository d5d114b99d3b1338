"""Continuous refill: N decode slots and the requests waiting for one (issue 43.2).

A ``generate`` call may take more prompts than it has slots (``policy.N`` for CGOPipe). The requests wait in the
caller's order; a slot (a KV row and its place in a micro-batch) holds one request at a time. When a request finishes
(EOS, a stop id, a stop string, max_new_tokens) its slot is freed, and once enough slots are free
(:meth:`SlotTable.due`) the next waiting requests are assigned to them (:meth:`SlotTable.assign`) and prefilled together
in one pass over the layers, between two decode steps. A micro-batch's rows never move, so decode shapes stay fixed.

Capacities: slot s holds ``caps[s]`` KV positions, the N largest needs (prompt + max_new_tokens) of the call; a request
goes only to a free slot whose capacity fits it (best fit: the smallest that fits). The N largest needs are the KV
the planner already counts for a batch of the job's N longest prompts (``Workload.kv_positions(N)``), and a first
fill of any N requests always fits (the i-th largest of any N needs is at most the i-th largest of all).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch


class SlotTable:
    """Which request each of ``len(caps)`` slots holds, the waiting requests, and when to refill.

    Args:
        needs: per request (the caller's index), the KV positions it may use: prompt + max_new_tokens (a prefix
            counts in both its prompt side and its output side, so it adds nothing).
        slots: the most requests decoding at once (N); the table has min(slots, len(needs)) slots.
        min_free: free slots that trigger a refill while others still decode (a refill's prefill pass costs a pass
            over every layer's pages, shared by the rows it fills); a refill also runs when the waiting requests all fit
            the free slots' count, or when no slot decodes.
    """

    def __init__(self, needs: Sequence[int], slots: int, min_free: int):
        if slots < 1 or min_free < 1:
            raise ValueError(f"SlotTable: slots {slots} and min_free {min_free} must be >= 1")
        self.needs = [int(n) for n in needs]
        n = min(slots, len(self.needs))
        # slot s's KV positions: the n largest needs, ascending (requests in ascending order of length take slots in
        # ascending order: with N or fewer prompts the micro-batches group them as they grouped the prompts before)
        self.caps = sorted(sorted(self.needs, reverse=True)[:n])
        self.req = [-1] * n  # request in slot s, -1: free
        self.slot_of: dict[int, int] = {}  # request -> its slot while it decodes
        self.waiting = list(range(len(self.needs)))  # requests not started, in the caller's order
        self.free = sorted((c, s) for s, c in enumerate(self.caps))  # free slots by (capacity, slot)
        self.min_free = min_free
        self.where: list[tuple[int, int]] = [(-1, -1)] * n  # slot -> (micro-batch, row in it), set by place()
        self.mb_caps: list[torch.Tensor] = []  # per micro-batch, its slots' capacities (int64 [mu_k]), set by place()

    def place(self, mb_slots: Sequence[Sequence[int]]) -> None:
        """Record the micro-batches' rows: ``mb_slots[k]`` the slots of micro-batch k, in its row order."""
        for k, ss in enumerate(mb_slots):
            for j, s in enumerate(ss):
                self.where[s] = (k, j)
        self.mb_caps = [torch.tensor([self.caps[s] for s in ss], dtype=torch.int64) for ss in mb_slots]  # int64 [mu_k]

    @property
    def live(self) -> int:
        """Slots holding a request that still decodes."""
        return len(self.slot_of)

    def requests(self, slots: Sequence[int]) -> list[int]:
        """The request of each of ``slots`` (-1: free)."""
        return [self.req[s] for s in slots]

    def due(self) -> bool:
        """Whether to refill now: requests wait, some slot is free, and either no slot decodes, at least
        ``min_free`` are free, or the free slots can take every waiting request."""
        free, wait = len(self.free), len(self.waiting)
        if not (wait and free and (not self.slot_of or free >= min(self.min_free, wait))):
            return False
        largest = self.free[-1][0]
        return any(self.needs[r] <= largest for r in self.waiting)  # some waiting request fits a free slot

    def assign(self) -> list[tuple[int, int]]:
        """Give free slots to waiting requests: in the caller's order, each request takes the smallest free slot whose
        capacity fits it (a request that fits none waits on). Returns the ``(slot, request)`` pairs."""
        out, rest = [], []
        for i, r in enumerate(self.waiting):
            if not self.free:
                rest.extend(self.waiting[i:])
                break
            j = bisect.bisect_left(self.free, (self.needs[r], -1))
            if j == len(self.free):
                rest.append(r)
                continue
            _, s = self.free.pop(j)
            self.req[s], self.slot_of[r] = r, s
            out.append((s, r))
        self.waiting = rest
        return out

    def release(self, finished: Sequence[int]) -> list[int]:
        """Free the slots of ``finished`` requests; returns those slots."""
        out = []
        for r in finished:
            s = self.slot_of.pop(r, None)
            if s is None:
                continue
            self.req[s] = -1
            bisect.insort(self.free, (self.caps[s], s))
            out.append(s)
        return out


def commit_live(reqs: list[int], logits: torch.Tensor, rows) -> torch.Tensor:
    """:meth:`.sampling.DecodeRows.commit` of one micro-batch's logits [mu_k, V] for the rows whose slot holds a request
    (``reqs``: the request per row, -1 free); returns every row's next input token (0 for a free row)."""
    if min(reqs) >= 0:
        return rows.commit(reqs, logits)
    live = [j for j, r in enumerate(reqs) if r >= 0]
    toks = torch.zeros(len(reqs), dtype=torch.int64)
    if live:
        toks[live] = rows.commit([reqs[j] for j in live], logits[live])
    return toks


def reset_slots(mbs: list, table: SlotTable, freed: list[int]) -> None:
    """Free slots decode throwaway tokens: reset the KV length of those just ``freed`` (their attention reads
    nothing stale) and of any free slot about to fill its capacity, to 0; their micro-batch's positions and RoPE
    are rebuilt from the cache lengths in the next step."""
    for s in freed:
        k, j = table.where[s]
        mbs[k].kv.lengths[j] = 0
        mbs[k].pos = mbs[k].rope = None
    if len(table.free) == len(freed):
        return
    for mb, caps in zip(mbs, table.mb_caps):
        full = (mb.kv.lengths >= caps - 1) & (torch.tensor(table.requests(mb.rows)) < 0)
        if bool(full.any()):
            mb.kv.lengths[full] = 0
            mb.pos = mb.rope = None
