#!/usr/bin/env python3
"""The cost of partial-generation checkpoints: one cgopipe generation job run through ``moe-batch run`` with the
checkpoint off and on (every ``--every-steps`` decode steps), reporting the checkpoint's share of decode time.

Each variant is a fresh job (its own results file) run in a subprocess: ``python3 -m lightning_moe.cli run JOB.yaml
--no-progress``. From each run report it reads ``wall_seconds.decode``, ``decode_tokens_per_s`` and the stages
``checkpoint_write_s`` / ``checkpoint_write_calls`` / ``checkpoint_bytes`` (the sidecar appends, timed in the runner,
inside decode), and prints a table with ``share = checkpoint_write_s / decode seconds`` and the decode slowdown against
the run with the checkpoint off. Results go to ``--out``: ``checkpoint_cost.jsonl`` (one line per variant) and
``checkpoint_cost.md``.

Model: ``--model`` (a checkpoint directory, e.g. from ``benchmarks/make_checkpoint.py``; default the embedded
``tiny-mixtral``). Policy: ``--policy auto`` (the planner, with ``--gpu-memory``) or ``--mu``/``--n`` explicitly.

Examples:
  OMP_NUM_THREADS=1 python3 benchmarks/checkpoint_cost.py --device cpu --every-steps 1 8   # CPU, tiny model: it works
  (on a 2-core host, one OpenMP thread: the CPU-attention worker's and the main thread's teams otherwise spin)
  python3 benchmarks/checkpoint_cost.py --device cuda --dtype bfloat16 --model /tmp/lmoe/ckpt-bf16 \\
      --gpu-memory 24GiB --prompts 2048 --gen 128 --every-steps 1 16 --out $OUT/ckpt   # GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finish_run_args(a) -> None:
    """The shared set-up of the CLI benchmarks' arguments: ``a.dtype`` by device when not given (float32 on the CPU,
    bfloat16 on CUDA); ``a.out``, and ``a.model`` / ``a.hardware`` where they are existing paths, made absolute (paths
    inside a job YAML resolve against its directory); ``a.out`` created."""
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    a.out = os.path.abspath(a.out)
    for k in ("model", "hardware"):
        if getattr(a, k) and os.path.exists(getattr(a, k)):
            setattr(a, k, os.path.abspath(getattr(a, k)))
    os.makedirs(a.out, exist_ok=True)


def write_prompts(path: str, n: int, words: int) -> None:
    """``n`` prompts of about ``words`` words each, ids p0..p{n-1}."""
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(max(1, words - (i % 5))))
            f.write(json.dumps({"id": f"p{i}", "prompt": f"{text} {i}"}) + "\n")


def job_yaml(a, work: str, name: str, checkpoint: str) -> str:
    """Write the job YAML of one variant; returns its path."""
    policy = "auto" if a.policy == "auto" else f"{{mu: {a.mu}, n: {a.n}}}"
    lines = [f"model: {a.model}", f"data: {{source: jsonl, path: {os.path.join(work, 'prompts.jsonl')}}}",
             f"output: {{path: {os.path.join(work, name + '.jsonl')}}}", f"device: {a.device}", f"dtype: {a.dtype}",
             "executor: cgopipe", f"policy: {policy}", f"checkpoint: {checkpoint}",
             f"generation: {{max_new_tokens: {a.gen}, temperature: 0.0, stop_at_eos: false}}"]
    if a.gpu_memory:
        lines.append(f"gpu_memory: {a.gpu_memory}")
    if a.hardware:
        lines.append(f"hardware: {a.hardware}")
    path = os.path.join(work, name + ".yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_variant(a, work: str, name: str, checkpoint: str) -> dict:
    """Run one variant through the CLI (its results removed first); returns the figures of its report."""
    for ext in (".jsonl", ".partial.jsonl", ".report.json", ".meta.json"):
        p = os.path.join(work, name + ext)
        if os.path.exists(p):
            os.remove(p)
    path = job_yaml(a, work, name, checkpoint)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lightning_moe.cli", "run", path, "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    row = {"variant": name, "checkpoint": checkpoint, "rc": proc.returncode, "wall_s": wall}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return row
    with open(os.path.join(work, name + ".report.json")) as f:
        r = json.load(f)
    st = r.get("stages") or {}
    dec = r["wall_seconds"]["decode"]
    row.update(decode_s=dec, decode_tok_s=r["decode_tokens_per_s"], generated_tokens=r["generated_tokens"],
               checkpoint_write_s=st.get("checkpoint_write_s", 0.0), checkpoint_writes=st.get("checkpoint_write_calls", 0),
               checkpoint_bytes=st.get("checkpoint_bytes", 0), policy=r.get("policy"))
    row["share_of_decode"] = row["checkpoint_write_s"] / dec if dec else None
    return row


def table(rows: list[dict]) -> str:
    """Markdown table of the variants (slowdown against the first, the checkpoint off)."""
    base = rows[0].get("decode_s") if rows else None
    out = ["| variant | checkpoint | decode s | decode tok/s | writes | bytes | write s | share of decode | slowdown |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rc"] != 0:
            out.append(f"| {r['variant']} | {r['checkpoint']} | exit {r['rc']}: {r.get('error', '')} |||||||")
            continue
        slow = f"{r['decode_s'] / base:.3f}x" if base else "-"
        out.append(f"| {r['variant']} | `{r['checkpoint']}` | {r['decode_s']:.3f} | {r['decode_tok_s']:.1f} | "
                   f"{r['checkpoint_writes']} | {r['checkpoint_bytes']} | {r['checkpoint_write_s']:.4f} | "
                   f"{100 * (r['share_of_decode'] or 0):.2f}% | {slow} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--model", default="tiny-mixtral")
    p.add_argument("--policy", default="explicit", choices=["explicit", "auto"])
    p.add_argument("--mu", type=int, default=4)
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--hardware", default=None)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--words", type=int, default=12, help="words per prompt (about)")
    p.add_argument("--gen", type=int, default=24, help="max_new_tokens")
    p.add_argument("--every-steps", type=int, nargs="+", default=[1], help="checkpoint schedules to measure")
    p.add_argument("--work", default="/tmp/lmoe-checkpoint-cost")
    p.add_argument("--out", default=None, help="where the table goes (default: --work)")
    p.add_argument("--timeout", type=int, default=540)
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    os.makedirs(a.work, exist_ok=True)
    out = a.out or a.work
    os.makedirs(out, exist_ok=True)
    write_prompts(os.path.join(a.work, "prompts.jsonl"), a.prompts, a.words)
    variants = [("off", "{enabled: false}")] + [(f"every{k}", f"{{every_steps: {k}, every_seconds: null}}")
                                                for k in a.every_steps]
    rows = []
    for name, ck in variants:
        row = run_variant(a, a.work, name, ck)
        rows.append(row)
        with open(os.path.join(out, "checkpoint_cost.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "policy"}), flush=True)
    md = table(rows)
    with open(os.path.join(out, "checkpoint_cost.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
