"""What a run saves while it goes, so a killed or stopped run loses little: the partial generations of the sequences
in flight (the sidecar ``<stem>.partial.jsonl``, every ``job.checkpoint`` interval) and the run's progress in the
report's runs list (rewritten at a checkpoint at most every REPORT_EVERY_S, so a run killed later still shows).

:class:`InFlight` holds the rows of one generation batch (their tokens so far and how much of them the sidecar holds);
:class:`PartialCheckpoints` decides when a checkpoint is due and appends the rows' new tokens; :class:`RunProgress`
is this run's entry of the report's runs list.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..config import CheckpointConfig
from ..data.writer import PartialsFile, write_json_atomic
from .report import REPORT_EVERY_S, job_totals


class InFlight:
    """The rows of one generation batch: each row's output tokens so far (its partial from earlier runs first), how
    many of them the sidecar holds, whether its record is written, and its log-prob entries (None: none asked)."""

    def __init__(self, ids: list[str], partials: dict, plps: Optional[dict]):
        self.ids = ids
        self.outs = [list(partials.get(i, [])) for i in ids]  # every row's output so far
        self.saved = [len(o) for o in self.outs]  # how much of it the sidecar holds
        self.finished = [False] * len(ids)
        self.lpss = [list(plps.get(i, [])) for i in ids] if plps is not None else None  # log-prob entries

    def add_tokens(self, rows, toks) -> None:
        """Append one decode step's tokens to the rows still running."""
        for r, t in zip(rows, toks):
            if not self.finished[r]:
                self.outs[r].append(t)

    def add_logprobs(self, rows, entries) -> None:
        """Append one decode step's log-prob entries."""
        for r, e in zip(rows, entries):
            self.lpss[r].append(e)

    def unsaved(self) -> list[tuple]:
        """The sidecar lines of the rows still running with tokens the sidecar lacks: (id, offset, tokens[, lps])."""
        return [(self.ids[i], self.saved[i], self.outs[i][self.saved[i]:])
                + ((self.lpss[i][self.saved[i]:],) if self.lpss is not None else ()) for i in range(len(self.ids))
                if not self.finished[i] and len(self.outs[i]) > self.saved[i]]

    def mark_saved(self) -> None:
        """Every row's tokens are in the sidecar now."""
        self.saved = [len(o) for o in self.outs]


class PartialCheckpoints:
    """The sidecar's checkpoints of one batch loop: after every decode step :meth:`step` appends the new tokens of the
    rows in flight when ``ck`` says one is due (every ``every_steps`` steps or ``every_seconds``; always when a stop is
    being served), times the write into the executor's ``stages`` (``checkpoint_write_s``, ``_calls``, ``_bytes``)
    and calls ``on_checkpoint()`` at most every REPORT_EVERY_S."""

    def __init__(self, ck: CheckpointConfig, partials_file: Optional[PartialsFile], stages: dict,
                 on_checkpoint: Optional[Callable[[], None]] = None):
        self.ck = ck
        self.file = partials_file  # None: nothing is saved (the Python API, the other expert-parallel processes)
        self.stages = stages
        self.on_checkpoint = on_checkpoint
        self.steps = 0  # decode steps since the last checkpoint
        self.last = time.perf_counter()  # when the last checkpoint was written
        self.reported: Optional[float] = None  # when on_checkpoint last ran

    def step(self, rows: InFlight, stopping: bool) -> None:
        """One decode step done: write a checkpoint of ``rows`` when one is due (``stopping``: always)."""
        self.steps += 1
        now = time.perf_counter()
        ck = self.ck
        due = stopping or (ck.every_steps is not None and self.steps >= ck.every_steps) or (
            ck.every_seconds is not None and now - self.last >= ck.every_seconds)
        if not (due and ck.enabled and self.file is not None):
            return
        nbytes = self.file.append(rows.unsaved())
        rows.mark_saved()
        st = self.stages
        st["checkpoint_write_s"] = st.get("checkpoint_write_s", 0.0) + time.perf_counter() - now
        st["checkpoint_write_calls"] = st.get("checkpoint_write_calls", 0) + 1
        st["checkpoint_bytes"] = st.get("checkpoint_bytes", 0) + nbytes
        self.steps, self.last = 0, time.perf_counter()
        if self.on_checkpoint is not None and (self.reported is None or now - self.reported >= REPORT_EVERY_S):
            self.reported = now
            self.on_checkpoint()


class RunProgress:
    """This run's entry in the report's runs list, after the ``previous`` runs of the job; ``records_before``:
    records in the results file at this run's start; ``writer``: the results writer (its ``written`` count)."""

    def __init__(self, report_path: str, previous: list[dict], records_before: int, writer, started: str,
                 t_start: float):
        self.report_path = report_path
        self.previous = previous
        self.records_before = records_before
        self.writer = writer
        self.started = started  # UTC ISO time of the run's start
        self.t_start = t_start  # its perf_counter

    def entry(self, status: str, stats) -> dict:
        """The run's entry with ``status`` and the executor's ``stats`` so far."""
        return {"started": self.started, "wall_seconds": time.perf_counter() - self.t_start,
                "prompt_tokens": stats.prefill_tokens, "generated_tokens": stats.generated_tokens,
                "records_written": self.writer.written, "status": status}

    def runs(self, status: str, stats) -> dict:
        """The report's ``runs`` and ``job_totals`` with this run's entry as ``status``."""
        runs = self.previous + [self.entry(status, stats)]
        return {"runs": runs, "job_totals": job_totals(runs, self.records_before + self.writer.written)}

    def save(self, report: dict, stats) -> None:
        """Rewrite the report with this run "running" (at its start and at checkpoints: a run killed later still
        shows in the report's runs)."""
        write_json_atomic(self.report_path, {**report, **self.runs("running", stats)})
