"""A run report's prefill against the GPU's dense-GEMM bound (issue 22's yardstick): prompt tokens x the matrix
FLOPs per prompt token (``MoESpec.flops_per_token`` of the checkpoint: attention projections, router, the top-k
experts, shared experts and dense layers; the lm_head on every token for scoring jobs, which score every position) / the dense GEMM
peak (default: the committed h200-host profile's ``gpu_flops_bf16``, measured there by ``moe-batch profile``).

    python3 benchmarks/prefill_bound.py RUN.report.json [--label TEXT] [--peak FLOP/s]

Prints one line: measured and predicted prefill tok/s, the bound, measured / bound, measured / predicted, the
warm-up and prefill wall seconds, and which expert kernel the prefill ran. Attention's own S^2 FLOPs are left out
(small at these lengths), so the bound is slightly high: the ratio errs low.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flops_per_token(spec, scoring: bool) -> float:
    """Matrix FLOPs per prompt token: ``MoESpec.flops_per_token`` at no context (attention's own S^2 FLOPs left out),
    less the lm_head unless every position is scored."""
    return spec.flops_per_token(0) - (0 if scoring else 2 * spec.vocab_size * spec.hidden_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--label", default="")
    ap.add_argument("--peak", type=float, default=None, help="dense GEMM FLOP/s (default: --hardware's gpu_flops_bf16)")
    ap.add_argument("--hardware", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       "lightning_moe", "policy", "profiles", "h200-host.yaml"))
    a = ap.parse_args()
    if not os.path.exists(a.report):
        print(f"{a.label}: no report at {a.report}")
        return 1
    r = json.load(open(a.report))
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec(r["model_path"])
    peak = a.peak
    if peak is None:
        from lightning_moe.policy.hardware import resolve_hardware

        peak = resolve_hardware(a.hardware).gpu_flops_bf16
    scoring = r["task"] == "score"
    fpt = flops_per_token(spec, scoring)
    bound = peak / fpt
    m = r.get("prefill_tokens_per_s") or 0.0
    p = (r.get("predicted") or {}).get("prefill_tokens_per_s") or 0.0
    w, st = r.get("wall_seconds") or {}, r.get("stages") or {}
    mem = r.get("memory") or {}
    gib = 2.0**30
    peak_mem = (f"GPU peak predicted {mem.get('predicted_peak_bytes', 0) / gib:.2f} / measured "
                f"{mem.get('measured_peak_allocated_bytes', 0) / gib:.2f} allocated / "
                f"{mem.get('measured_peak_reserved_bytes', 0) / gib:.2f} reserved GiB (cap "
                f"{(mem.get('cap_bytes') or 0) / gib:.0f})")
    kern = {k[len("expert_ffn_prefill_calls_"):]: v for k, v in st.items() if k.startswith("expert_ffn_prefill_calls_")}
    print(f"{a.label}: prefill {m:,.0f} tok/s, predicted {p:,.0f}, bound {bound:,.0f} ({fpt / 1e9:.2f} GFLOP/token at "
          f"{peak / 1e12:.0f} TFLOP/s): measured/bound {m / bound:.2f}, measured/predicted "
          f"{(m / p) if p else float('nan'):.2f}; {r.get('prompt_tokens', 0):,} tokens, prefill {w.get('prefill', 0):.2f} s, "
          f"warmup {w.get('warmup', 0):.2f} s, status {r.get('status')}, {peak_mem}, prefill kernels {kern}, policy "
          f"{ {k: (r.get('policy') or {}).get(k) for k in ('mu', 'n', 'prefill_mu', 'prefill_tokens', 'resident_experts', 'expert_pages')} }")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
