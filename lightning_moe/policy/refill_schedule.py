"""Continuous refill, planned: the slot table's rules (:class:`Slots`), the schedule a call of given output lengths
runs (:func:`simulate`: decode steps with their live rows and context, prefill passes with their rows), its price by
the HRM (:func:`schedule_seconds`) and the refill threshold from the HRM (:func:`hrm_min_free`). Pure Python.

The executor (pipeline/cgopipe.py, ``generate``) runs N slots over a call's requests: the first fill and every refill
is one prefill pass over every layer's pages (the rows it fills; their first tokens come from it), then decode steps
of all N slots (a free slot decodes a throwaway token: a step costs the same whatever rows are live), a refill
between two steps when :meth:`Slots.due`. A request of L output tokens this call holds its slot for L - 1 decode
steps. When no request waits, the live rows fall while each step still costs a full step: the drain, up to
max_new_tokens - 1 steps. :func:`simulate` replays that loop exactly (the same :class:`Slots`, the same order of
assign / release), event by event (a request's finish step is known when it is filled), so a job of thousands of
requests simulates in milliseconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence


class Slots:
    """Which request each of ``len(caps)`` slots holds, the waiting requests, and when to refill (no torch: the
    executor's :class:`~lightning_moe.pipeline.refill.SlotTable` adds the micro-batch rows).

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


def default_min_free(N: int) -> int:
    """The executor's refill threshold without a plan's: max(1, N // 16)."""
    return max(1, N // 16)


@dataclass(frozen=True)
class Schedule:
    """What a refilling call runs: ``steps`` (per decode step: live rows, the KV positions those rows attend in all)
    and ``passes`` (per prefill pass, the first fill included: rows, prompt tokens), over ``slots`` slots."""

    slots: int  # N (the table's slot count)
    min_free: int  # the refill threshold it ran with
    steps: tuple  # ((live rows, attended positions summed over them), ...) per decode step
    passes: tuple  # ((rows, prefill tokens), ...) per prefill pass
    drain_steps: int  # decode steps after the last pass (no request waits: the live rows only fall)

    @property
    def decode_steps(self) -> int:
        return len(self.steps)

    @property
    def decode_tokens(self) -> int:
        """Tokens of the decode steps (the passes give each filled row its first token)."""
        return sum(live for live, _ in self.steps)

    @property
    def generated_tokens(self) -> int:
        return self.decode_tokens + sum(rows for rows, _ in self.passes)

    @property
    def slot_occupancy(self) -> float:
        """decode tokens / (decode steps x N), as ``RunStats.slot_occupancy`` counts it (1.0 without a step)."""
        return self.decode_tokens / (self.decode_steps * self.slots) if self.steps else 1.0

    def summary(self) -> dict:
        return {"slots": self.slots, "min_free": self.min_free, "decode_steps": self.decode_steps,
                "prefill_passes": len(self.passes), "drain_steps": self.drain_steps,
                "decode_tokens": self.decode_tokens, "generated_tokens": self.generated_tokens,
                "slot_occupancy": self.slot_occupancy}


def simulate(needs: Sequence[int], prefill_lens: Sequence[int], out_lens: Sequence[int], slots: int,
             min_free: int) -> Schedule:
    """The schedule of ``CGOPipeExecutor.generate`` for requests (the caller's order) of KV ``needs`` (prompt +
    max_new_tokens), ``prefill_lens`` (prompt + prefix: what a pass prefills) and ``out_lens`` (tokens each generates
    in the call, >= 1), at ``slots`` slots and refill threshold ``min_free``. A request filled before decode step j + 1
    with L tokens to make has its first from the pass and finishes at step j + L - 1; at its i-th step it attends
    prefill + i positions."""
    if not (len(needs) == len(prefill_lens) == len(out_lens)) or not needs:
        raise ValueError("simulate: needs, prefill_lens and out_lens must be non-empty and of one length")
    if min(out_lens) < 1:
        raise ValueError("simulate: every request generates at least one token (out_lens >= 1)")
    t = Slots(needs, slots, min_free)
    heap: list[tuple[int, int]] = []  # (finish step, request) of the live requests
    steps: list[tuple[int, int]] = []
    passes: list[tuple[int, int]] = []
    ctx = 0  # positions the live requests attend at the next step
    last_pass = 0

    def fill(step: int) -> int:
        nonlocal ctx
        while True:  # CGOPipeExecutor._refill: repeated while a refill is due and no slot decodes
            pairs = t.assign()
            passes.append((len(pairs), sum(prefill_lens[r] for _, r in pairs)))
            done = []
            for _, r in pairs:
                if out_lens[r] <= 1:
                    done.append(r)
                else:
                    heapq.heappush(heap, (step + out_lens[r] - 1, r))
                    ctx += prefill_lens[r] + 1
            t.release(done)
            if t.live or not t.due():
                return step

    step = last_pass = fill(0)
    while t.live or t.waiting:
        still_due = False
        if t.due():
            last_pass = fill(step)
            if not t.live:
                continue
            still_due = t.due()  # rows that finished at their first tokens freed their slots again
        # the next finish: the live set and due() are constant until then; the executor runs one step after a refill
        # before it asks due() again
        end = min(heap[0][0], step + 1) if still_due else heap[0][0]
        for _ in range(step, end):
            steps.append((t.live, ctx))
            ctx += t.live
        step, done = end, []
        while heap and heap[0][0] == end:
            r = heapq.heappop(heap)[1]
            done.append(r)
            ctx -= prefill_lens[r] + out_lens[r]
        t.release(done)
    return Schedule(slots=len(t.caps), min_free=min_free, steps=tuple(steps), passes=tuple(passes),
                    drain_steps=step - last_pass)


@dataclass(frozen=True)
class RefillCall:
    """What one finished ``generate`` call of a refilling executor ran: per request (the caller's order) its KV need,
    prefill tokens and tokens generated in the call; its slots and refill threshold."""

    needs: list
    prefill_lens: list
    out_lens: list
    slots: int
    min_free: int

    def schedule(self) -> Schedule:
        """The call's schedule, replayed (:func:`simulate`)."""
        return simulate(self.needs, self.prefill_lens, self.out_lens, self.slots, self.min_free)


def schedule_seconds(schedule: Schedule, step_time: Callable[[float], float],
                     pass_time: Callable[[int, float], float]) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of ``schedule``: the sum over its passes of ``pass_time(rows, mean prompt
    tokens)`` and over its steps of ``step_time(mean attended positions per slot)`` (all N slots run every step; a free
    slot attends ~nothing). Each distinct argument is priced once."""
    cache: dict = {}

    def once(fn, *args):
        if (fn, args) not in cache:
            cache[(fn, args)] = fn(*args)
        return cache[(fn, args)]

    pre = sum(once(pass_time, rows, tok / rows) for rows, tok in schedule.passes if rows)
    dec = sum(once(step_time, c / schedule.slots) for _, c in schedule.steps)
    return pre, dec


def hrm_min_free(slots: int, pass_fixed: float, step: float, mean_out: float) -> int:
    """The refill threshold f that balances a pass's fixed cost against the slot-steps lost while freed slots wait.

    In the steady state slots free at lambda = N / L per step (L: mean output tokens). Refilling at f free slots, a
    pass (fixed cost ``pass_fixed`` s: the page pass, whatever rows it fills) comes every f / lambda steps, and
    between passes the free slots grow from 0 to f: f^2 / (2 lambda) slot-steps idle, each worth ``step`` / N s.
    Per step: pass_fixed lambda / f + f step / (2 N), least at f* = N sqrt(2 pass_fixed / (L step)); clamped to
    [1, N]."""
    if slots < 1 or step <= 0 or mean_out <= 0:
        return default_min_free(max(1, slots))
    f = slots * math.sqrt(2.0 * max(0.0, pass_fixed) / (mean_out * step))
    return int(min(slots, max(1, round(f))))
