#!/usr/bin/env python3
"""The current memory model's predicted GPU peak for runs already measured: for each row of a ``cli_sweep.py``
``sweep.jsonl`` it rebuilds the case's data and job (cli_sweep's own writers, against config-only model directories:
config.json and the tokenizer, no weights), plans the job as ``moe-batch run`` would (``app.plan.plan_job``), and
prints the new prediction next to the peak the run measured.

It answers "would this model change have predicted those runs" without a GPU. A row counts only when the planner
now picks the policy that ran, with the same micro-batches in the executor (``prefill_mu`` may differ where the
executor's even split of a batch gives the same rows); other rows are listed as "policy changed" (they need a run).

  python3 benchmarks/repredict.py benchmarks/raw/session11/suite.jsonl --preset suite --work /tmp/repredict
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import cli_sweep as cs  # noqa: E402
import make_checkpoint  # noqa: E402
import suite_jobs as sj  # noqa: E402

GiB = 1 << 30


def config_only_dirs(work: str, dims) -> dict:
    """bf16 and int4 model directories holding config.json (the int4 one with its quantization section) and the
    tokenizer: what planning reads."""
    out = {}
    for name, quant in (("bf16", None), ("int4", {"scheme": "int4"})):
        d = os.path.join(work, f"config-{name}")
        os.makedirs(d, exist_ok=True)
        cfg = make_checkpoint.config_dict(dims)
        if quant:
            cfg["quantization"] = quant
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        make_checkpoint.copy_tokenizer(d)
        out[name] = d
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", help="a cli_sweep sweep.jsonl with measured runs")
    p.add_argument("--preset", required=True, choices=["suite", "sweep"], help="the preset the runs came from")
    p.add_argument("--work", required=True, help="scratch directory (config-only models, data, jobs)")
    p.add_argument("--out", default=None, help="markdown table here as well")
    a = p.parse_args(argv)
    from lightning_moe.app.plan import Prepared, job_workload_from_prepared, plan_job
    from lightning_moe.config import load_job
    from lightning_moe.data.tokenize import load_tokenizer

    machine = cs.machine_for(a.preset, None, "100GiB")
    cases = {c.name: c for c in cs.cases_for(a.preset, sj.mtbench_available())}
    ckpts = config_only_dirs(os.path.abspath(a.work), machine.dims)
    words = sj.one_token_words(load_tokenizer(ckpts["bf16"]))
    lines = ["| case | policy that ran | measured MiB | predicted then | predicted now | now / measured | note |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for row in sj.read_jsonl(a.jsonl):
        case, mem = cases.get(row["case"]), row.get("memory") or {}
        meas = row.get("peak_gpu_memory_bytes")
        if case is None or not meas or not mem.get("predicted_peak_bytes"):
            continue
        job_path, _, _ = cs.write_case(case, machine, ckpts, words, os.path.abspath(a.work), sj.mtbench_available())
        prep = Prepared(load_job(job_path))
        jp = plan_job(prep.job, prep)
        ran, now = row["policy"], jp.policy
        seqs = job_workload_from_prepared(prep).num_requests or ran["N"]
        fields_same = all(ran.get(k) == getattr(now, k) for k in ("mu", "n", "N", "n_gpu_attn", "prefill_tokens"))
        r_now = sum(now.resident_counts(prep.spec))  # the run reports resident experts over all layers
        same = fields_same and ran.get("resident_experts") == r_now
        B = min(ran["N"], seqs)
        split = lambda q: math.ceil(B / math.ceil(B / max(1, q)))  # noqa: E731
        same = same and split(ran["prefill_mu"]) == split(now.prefill_mu)
        pred = jp.estimate.memory.gpu_peak_allocated if jp.estimate is not None else None
        pol = f"mu {ran['mu']} x n {ran['n']}, r {ran['resident_experts']}, pmu {ran['prefill_mu']}"
        note = "" if same else (f"policy changed (needs a run): mu {now.mu} x n {now.n}, r {r_now}, "
                                f"pmu {now.prefill_mu}, tokens {now.prefill_tokens}")
        r = pred / meas if pred and same else None
        if same and r:
            ratios.append(r)
        lines.append(f"| {row['case']} | {pol} | {meas / 2**20:,.0f} | {mem['predicted_peak_bytes'] / 2**20:,.0f} | "
                     f"{pred / 2**20:,.0f} | {f'{r:.3f}' if r else '-'} | {note} |" if pred else f"| {row['case']} | {pol} | - | - | - | - | {note} |")
    if ratios:
        lines.append("")
        lines.append(f"{len(ratios)} rows with the policy that ran: now / measured {min(ratios):.3f}-{max(ratios):.3f}, "
                     f"{sum(abs(x - 1) <= 0.10 for x in ratios)} within 10%")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
