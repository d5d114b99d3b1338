"""Where a job's GPU time goes: run ``moe-batch run JOB.yaml`` in this process under torch.profiler (CUDA activity
only: kernels and copies, no host-side op recording, so the host thread runs as it does unprofiled) and print the
kernels grouped by name, their total time, calls and share, next to the report's prefill / decode walls.

    python3 benchmarks/profile_prefill.py JOB.yaml [--set key=value ...] [--top 25] [--trace trace.json.gz] [--phases]

``--phases``: also mark each phase start (prefill / decode / scoring) and each warm-up's start and end (the
executor's first prefill warms the first layer of each kind: "scoring warm-up 1", then "scoring after warm-up 1"
holds the phase's warm kernels up to the next kind's warm-up) on the device with a spin kernel and print, per
window, its wall, the device's busy time (the union of kernel and copy intervals over all streams), its idle gaps,
its largest kernels, and its largest gaps with the host events inside them (runtime and driver calls > 0.2 ms, lazy
function loads).

For A/B and profiling on the GPU host (a benchmark, not a test); the job writes its results as `moe-batch run`
does (point ``--set output.path=...`` somewhere disposable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel_table(events, top: int) -> str:
    """Markdown table of the profiler's device events grouped by name: total ms, calls, share of the device total."""
    total, calls = defaultdict(float), defaultdict(int)
    for e in events:
        if getattr(e, "device_type", None) is None or "cuda" not in str(e.device_type).lower():
            continue
        total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        calls[e.name] += 1
    all_us = sum(total.values()) or 1.0
    rows = sorted(total, key=total.get, reverse=True)[:top]
    out = [f"device time, all events: {all_us / 1e3:.1f} ms", "", "| kernel / copy | ms | calls | share |",
           "|---|---|---|---|"]
    out += [f"| {n[:110]} | {total[n] / 1e3:.1f} | {calls[n]} | {total[n] / all_us:.3f} |" for n in rows]
    return "\n".join(out)


MARKER = "spin"  # the device kernel torch.cuda._sleep launches (the phase marks of --phases)
HOST_CATS = ("cuda_runtime", "cuda_driver", "overhead")  # host-side trace events (runtime / driver calls, lazy loads)


def read_trace(path: str) -> list:
    """The ``traceEvents`` of a Chrome trace as :meth:`torch.profiler.profile.export_chrome_trace` wrote it (.gz ok)."""
    import gzip

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def phase_table(trace_path: str, phases: list, top: int) -> str:
    """Per phase window of a Chrome trace (between consecutive marker kernels): wall ms, device-busy ms (union of
    kernel and memcpy intervals), idle gaps (count and ms of gaps > 50 us), the largest kernels by total ms, the CUDA
    runtime and driver calls by total ms and the largest gaps with the kernels around them and the host events
    (calls, lazy function loads) inside them."""
    ev = read_trace(trace_path)
    xs = [e for e in ev if e.get("ph") == "X" and "dur" in e]
    dev = sorted((e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    rt = sorted((e for e in xs if e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    marks = [e["ts"] for e in dev if MARKER in e["name"]]
    out = []
    for i, t0 in enumerate(marks):
        t1 = marks[i + 1] if i + 1 < len(marks) else max(e["ts"] + e["dur"] for e in dev)
        win = [e for e in dev if t0 <= e["ts"] < t1 and MARKER not in e["name"]]
        if not win:
            continue
        busy, gaps, gap_us, end, prev, big = 0.0, 0, 0.0, win[0]["ts"], win[0], []
        for e in win:  # union of the intervals (sorted by start)
            s_, f_ = e["ts"], e["ts"] + e["dur"]
            if s_ > end and s_ - end > 50:
                gaps, gap_us = gaps + 1, gap_us + (s_ - end)
                big.append((s_ - end, end, s_, prev["name"], e["name"]))
            busy += max(0.0, f_ - max(s_, end))
            if f_ > end:
                end, prev = f_, e
        tot, calls = defaultdict(float), defaultdict(float)
        for e in win:
            tot[e["name"][:90]] += e["dur"]
        for e in rt:
            if t0 <= e["ts"] < t1:
                calls[e["name"]] += e["dur"]
        name = phases[i] if i < len(phases) else "?"
        out.append(f"phase {i} {name}: wall {(end - t0) / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms, "
                   f"{gaps} gaps > 50 us = {gap_us / 1e3:.1f} ms, first kernel after the mark {(win[0]['ts'] - t0) / 1e3:.1f} ms")
        for n in sorted(tot, key=tot.get, reverse=True)[:top]:
            out.append(f"    {tot[n] / 1e3:9.1f} ms  {n}")
        out.append("  host calls (ms): " + ", ".join(f"{n} {calls[n] / 1e3:.1f}"
                                                           for n in sorted(calls, key=calls.get, reverse=True)[:8]))
        for g, a, b, before, after in sorted(big, reverse=True)[:6]:
            inside = sorted(((e["dur"], e["name"]) for e in rt if e["ts"] < b and e["ts"] + e["dur"] > a
                             and (e["dur"] > 200 or e.get("cat") == "overhead")), reverse=True)[:4]
            out.append(f"  gap {g / 1e3:.2f} ms at +{(a - t0) / 1e3:.1f} ms: after {before[:50]} / before {after[:50]}; "
                       f"runtime inside: {', '.join(f'{n} {d / 1e3:.2f}' for d, n in inside) or '-'}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--set", action="append", default=[], help="a job override, as moe-batch run --set")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace", default=None, help="also write the Chrome trace here")
    ap.add_argument("--phases", action="store_true", help="per-phase device busy time and gaps (marks each phase)")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_moe.cli import main as cli_main

    argv = ["run", a.job, "--no-progress"] + [x for s in a.set for x in ("--set", s)]
    phases: list = []
    if a.phases:
        from lightning_moe.app import gpu as app_gpu

        enter = app_gpu.PhasePeaks.enter

        def marked(self, phase):
            if phase != "load":
                torch.cuda._sleep(1000)  # a marker kernel on the current stream
                phases.append(phase)
            return enter(self, phase)

        app_gpu.PhasePeaks.enter = marked
        from lightning_moe.pipeline.prefill import CGOPipePrefill

        warm_up = CGOPipePrefill._warm_up

        def warm_up_marked(self, *args, **kw):  # a warm-up is a window of its own, and so is what follows it
            phase = phases[-1].split(" ")[0] if phases else "?"
            torch.cuda._sleep(1000)
            phases.append(f"{phase} warm-up {sum(p.startswith(phase + ' warm-up') for p in phases) + 1}")
            out = warm_up(self, *args, **kw)
            torch.cuda._sleep(1000)
            phases.append(f"{phase} after {phases[-1].split(' ', 1)[1]}")
            return out

        CGOPipePrefill._warm_up = warm_up_marked
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rc = cli_main(argv)
        torch.cuda.synchronize()
    print(f"moe-batch {' '.join(argv)}: rc {rc}")
    out = next((s.split("=", 1)[1] for s in a.set if s.startswith("output.path=")), None)
    if out:
        rep = json.load(open(os.path.splitext(out)[0] + ".report.json"))
        st = rep.get("stages") or {}
        print("prefill tok/s", round(rep.get("prefill_tokens_per_s") or 0), "predicted",
              round((rep.get("predicted") or {}).get("prefill_tokens_per_s") or 0), "prefill_wall",
              round(st.get("prefill_wall", 0), 3), "decode_wall", round(st.get("decode_wall", 0), 3),
              "policy", rep.get("policy"))
    print(kernel_table(prof.events(), a.top))
    trace = a.trace or ("/tmp/profile_prefill_trace.json" if a.phases else None)
    if trace:
        prof.export_chrome_trace(trace)
    if a.phases:
        print(phase_table(trace, phases, 12))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
