"""Re-evaluate the HRM for a benchmark result's own policy with another profile (or one field changed): how far the
measured tokens/s are from the prediction, without a GPU. Used for RESULTS.md 10d (the expert kernel's FLOP rate).

    LIGHTNING_MOE_CACHE=... python benchmarks/reevaluate.py --result benchmarks/raw/session8/run30-int4.jsonl \
        --profile benchmarks/raw/session8/run29-profile.yaml --expert-flops 388.2e12

Prints, per result line: the policy, then prefill / decode / e2e measured, predicted and measured / predicted, once with
the profile as it is and once with ``--expert-flops`` (``HardwareProfile.gpu_expert_flops``) when given. The workload is
the bench's: the 80 MT-Bench first-turn prompt lengths, the case's gen length and job size (bench_cgopipe.CASES).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import bench_cgopipe as B
    from lightning_moe.policy.hardware import resolve_hardware
    from lightning_moe.policy.hrm import evaluate
    from lightning_moe.policy.policy import Policy, Workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True, help="bench.jsonl written by bench_cgopipe.py")
    ap.add_argument("--profile", required=True, help="hardware profile YAML (or preset name)")
    ap.add_argument("--expert-flops", type=float, default=None, help="gpu_expert_flops to evaluate with as well (FLOP/s)")
    a = ap.parse_args()
    hw0 = resolve_hardware(a.profile)
    profiles = [("profile", hw0)]
    if a.expert_flops is not None:
        profiles.append((f"gpu_expert_flops {a.expert_flops / 1e12:.1f}T", dataclasses.replace(hw0, gpu_expert_flops=a.expert_flops)))
    lens = [len(p) for p in B.mtbench_prompts()]
    with open(a.result) as f:
        for line in f:
            r = json.loads(line)
            if r.get("executor") != "cgopipe":
                continue
            case = B.CASES[r["case"]]
            fields = dict(r["policy"])
            if isinstance(fields.get("resident_experts"), list):
                fields["resident_experts"] = tuple(fields["resident_experts"])
            pol = Policy(**fields)
            wl = dataclasses.replace(Workload.from_lengths(lens, case.gen_len, name="mtbench"), num_requests=case.requests)
            print(f"{r['case']}: {pol.mu} x {pol.n} = {pol.N}, resident {sum(pol.resident_counts(B.spec_for(case)))}, "
                  f"g {pol.n_gpu_attn}, prefill {pol.prefill_mu} rows")
            for name, hw in profiles:
                e = evaluate(pol, B.spec_for(case), hw, wl)
                parts = []
                for key, pred in (("prefill", e.prefill_tok_s), ("decode", e.decode_tok_s), ("e2e", e.e2e_tok_s)):
                    got = r[f"{key}_tok_s"]
                    parts.append(f"{key} {got:.1f} / {pred:.1f} = {got / pred:.2f}")
                print(f"  {name:28s} " + "; ".join(parts) + f" (binding: decode {e.decode_binding})")


if __name__ == "__main__":
    main()
