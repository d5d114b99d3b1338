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

from typing import Sequence

import torch

from ..policy.refill_schedule import Slots


class SlotTable(Slots):
    """:class:`~lightning_moe.policy.refill_schedule.Slots` (the slots, the waiting requests, when to refill: the
    rules the planner's schedule simulation replays) with each slot's place in the micro-batches (:meth:`place`)."""

    def __init__(self, needs: Sequence[int], slots: int, min_free: int):
        super().__init__(needs, slots, min_free)
        self.where: list[tuple[int, int]] = [(-1, -1)] * len(self.caps)  # slot -> (micro-batch, row in it), place()

    def place(self, mb_slots: Sequence[Sequence[int]]) -> None:
        """Record the micro-batches' rows: ``mb_slots[k]`` the slots of micro-batch k, in its row order."""
        for k, ss in enumerate(mb_slots):
            for j, s in enumerate(ss):
                self.where[s] = (k, j)


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


def reset_slots(mbs: list, table: SlotTable) -> None:
    """Free slots decode throwaway tokens over an empty cache: after each step (and each refill) every free slot's KV
    length goes back to 0, so its next throwaway token attends one position, as the refill schedule prices it (a free
    slot attends ~nothing: :func:`~lightning_moe.policy.refill_schedule.schedule_seconds`), instead of a context that
    grows through the drain; the micro-batch's positions and RoPE are rebuilt from the cache lengths in the next
    step."""
    if not table.free:
        return
    for mb in mbs:
        stale = (torch.tensor(table.requests(mb.rows)) < 0) & (mb.kv.lengths > 0)  # bool [mu_k]
        if bool(stale.any()):
            mb.kv.lengths[stale] = 0
            mb.pos = mb.rope = None
