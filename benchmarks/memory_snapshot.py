#!/usr/bin/env python3
"""What is live on the GPU at a job's peak: runs ``moe-batch run JOB.yaml`` in this process under torch's CUDA
memory history, replays the allocation trace to the moment of the largest allocated total, and prints the blocks
live then, grouped by the innermost ``lightning_moe`` frame that allocated them (and that frame's caller).

It locates which allocation the memory model (policy/hrm.py) counts wrong when a run's measured peak and its
prediction disagree: the run report gives one peak per phase; this gives the peak's parts.

  python3 benchmarks/memory_snapshot.py JOB.yaml --out $OUT/snapshot.md      # GPU host
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20


def _site(frames: list[dict]) -> str:
    """'file:line fn <- caller' of the innermost two project frames of an allocation's stack."""
    ours = [f for f in frames if "lightning_moe" in f.get("filename", "")]
    if not ours:
        return "(outside lightning_moe) " + (f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']}"
                                             if frames else "?")
    name = lambda f: f"{f['filename'].split('lightning_moe/')[-1]}:{f['line']} {f['name']}"  # noqa: E731
    return name(ours[0]) + (f" <- {name(ours[1])}" if len(ours) > 1 else "")


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict]:
    """(peak bytes, event index, {addr: event}) of a device trace replayed alloc by free."""
    cur = peak = at = 0
    live: dict[int, dict] = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at = cur, i
        elif ev["action"] in ("free_requested",) and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    return peak, at, live


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="job YAML, run as `moe-batch run JOB --no-progress`")
    p.add_argument("--out", default=None, help="markdown file for the table (default: stdout only)")
    p.add_argument("--top", type=int, default=25, help="allocation sites to list (default 25)")
    a = p.parse_args(argv)
    from lightning_moe import cli

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    rc = cli.main(["run", a.job, "--no-progress"])
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [ev for dev in snap["device_traces"] for ev in dev]
    peak, at, live = live_at_peak(trace)
    by = collections.defaultdict(lambda: [0, 0])
    for ev in live.values():
        s = _site(ev.get("frames", []))
        by[s][0] += ev["size"]
        by[s][1] += 1
    lines = [f"# Live GPU blocks at the allocated peak of {os.path.basename(a.job)}", "",
             f"exit {rc}; trace events {len(trace)}; peak {peak / MiB:,.1f} MiB at event {at}; "
             f"torch max_memory_allocated {torch.cuda.max_memory_allocated() / MiB:,.1f} MiB", "",
             "| MiB | blocks | allocated at |", "|---|---|---|"]
    for s, (b, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top]:
        lines.append(f"| {b / MiB:,.1f} | {n} | {s} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
