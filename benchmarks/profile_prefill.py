"""Where a job's GPU time goes: run ``moe-batch run JOB.yaml`` in this process under torch.profiler (CUDA activity
only: kernels and copies, no host-side op recording, so the host thread runs as it does unprofiled) and print the
kernels grouped by name, their total time, calls and share, next to the report's prefill / decode walls.

    python3 benchmarks/profile_prefill.py JOB.yaml [--set key=value ...] [--top 25] [--trace trace.json.gz]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--set", action="append", default=[], help="a job override, as moe-batch run --set")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace", default=None, help="also write the Chrome trace here")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_moe.cli import main as cli_main

    argv = ["run", a.job, "--no-progress"] + [x for s in a.set for x in ("--set", s)]
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
    if a.trace:
        prof.export_chrome_trace(a.trace)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
