"""The profile's ``prefill_elementwise_rows`` from a prefill's kernel trace: the device time of the kernels the HRM's
roofline terms do not model (everything but the expert FFN kernels, the GEMMs, fused attention, copies, and the
scoring head after the last expert call), over the prefill's token-layers, as bytes at the HBM bandwidth in hidden
rows (hidden_size x 2 bytes).

    python3 benchmarks/prefill_elementwise.py TRACE.json.gz RUN.report.json [--hardware PROFILE.yaml] [--write OUT.yaml]

TRACE: ``benchmarks/profile_prefill.py --trace`` of a scoring job (one prefill pass per batch, every token through
every layer); RUN.report.json: that job's report (prompt tokens; the checkpoint's spec for MoE layers and width).
Kernel durations do not include the first-call gaps (compilation, plans), so a first run's trace serves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # profile_prefill

EXPERT = re.compile(r"gate_up|down_kernel|grouped_mm|_mx_kernel|dequant|silu_mul|moe_combine|RadixSort")  # the expert FFN's own kernels (its sort too)
MODELED = re.compile(r"nvjet|gemm|sdpa|flash|fmha|cutlass|xmma|Memcpy|Memset")  # GEMMs, attention, copies: HRM terms


def unmodeled_seconds(events: list) -> tuple[float, int]:
    """Seconds of device kernels from the first GEMM to the end of the last expert kernel that are neither expert,
    GEMM, attention nor copy kernels, and the number of expert kernel calls (a check that the trace is a prefill)."""
    ks = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    experts = [e for e in ks if EXPERT.search(e["name"])]
    if not experts:
        raise SystemExit("no expert FFN kernels in the trace")
    lo = next(e["ts"] for e in ks if MODELED.search(e["name"]))
    hi = experts[-1]["ts"] + experts[-1]["dur"]
    us = sum(e["dur"] for e in ks if lo <= e["ts"] < hi and not EXPERT.search(e["name"]) and not MODELED.search(e["name"]))
    return us / 1e6, len(experts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("report")
    ap.add_argument("--hardware", default=os.path.join(REPO, "lightning_moe", "policy", "profiles", "h200-host.yaml"))
    ap.add_argument("--write", default=None, help="also write the value into this profile YAML (a copy of --hardware "
                    "with prefill_elementwise_rows replaced)")
    a = ap.parse_args()
    from lightning_moe.policy.hardware import resolve_hardware

    from profile_prefill import read_trace

    events = read_trace(a.trace)
    from lightning_moe.policy.registry import resolve_spec

    r = json.load(open(a.report))
    spec = resolve_spec(r["model_path"])
    token_layers = r["prompt_tokens"] * (spec.num_layers - len(spec.dense_layers))  # MoE layers: the term's layers
    secs, calls = unmodeled_seconds(events)
    bw = resolve_hardware(a.hardware).gpu_hbm_bandwidth
    rows = secs * bw / token_layers / (spec.hidden_size * 2)
    print(f"{calls} expert kernel calls; unmodeled kernels {secs * 1e3:.1f} ms over {token_layers:,} token-layers = "
          f"{secs / token_layers * 1e9:.1f} ns each = {rows:.1f} hidden rows at {bw / 1e12:.2f} TB/s")
    print(f"prefill_elementwise_rows: {rows:.1f}")
    if a.write:
        from dataclasses import replace

        prof = resolve_hardware(a.hardware)
        replace(prof, prefill_elementwise_rows=round(rows, 1)).save(
            a.write, header=f"{os.path.basename(a.hardware)} with prefill_elementwise_rows {rows:.1f} from {a.trace}")
        print(f"wrote {a.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
