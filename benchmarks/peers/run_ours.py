#!/usr/bin/env python3
"""Ours: ``moe-batch run JOB.yaml`` on the MT-Bench first turns (chat template), ``policy: auto``, one result row.

Writes ``WORK/prompts-R.jsonl`` (R requests: the 80 first turns repeated), ``WORK/JOB.yaml`` (``task: generate``,
``data: {source: jsonl, chat_template: true}``, greedy, ``stop_at_eos: false`` so every request generates exactly
``--gen`` tokens as the peers do, ``policy: auto``, ``gpu_memory: --cap``, ``hardware: --hardware`` when given), deletes an earlier output of the same
job (a fresh run, not a resume), runs ``moe-batch run`` in a subprocess (``python -m lightning_moe.cli``), reads
``<output>.report.json`` and writes the row ``OUT/ours-WEIGHTS-gG.json``: ``tok_s`` is the report's measured
``end_to_end_tokens_per_s`` (generated tokens over warm-up + prefill + decode; load, model files and planning are
outside, as the peers' load is), ``N`` the planner's sequences per batch; ``extra.predicted`` is the report's
``predicted`` block (the HRM's tokens/s per phase, binding stages, the hardware profile it planned with). Without
``--hardware`` the job plans with the host's measured profile: the first job on a fresh GPU host measures it
(~30 s, before the job's timed phases) and caches it, as ``moe-batch profile`` does.

The checkpoint decides the weights: a ``moe-batch quantize --experts int4`` output is ``int4`` (``--weights``
labels it; default: the scheme in the config's ``quantization`` block, else the dtype).

Examples:
  python3 benchmarks/peers/run_ours.py CKPT --gen 128 --requests 2000 --cap 12GiB --out OUT
  python3 benchmarks/peers/run_ours.py CKPT-int4 --gen 32 --requests 2000 --cap 12GiB --out OUT
  python3 benchmarks/peers/run_ours.py CKPT --device cpu --dtype float32 --requests 40 --gen 8 --out OUT  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def quant_scheme(ckpt: str) -> str | None:
    """The expert scheme (``int4`` / ``int2``) of a ``moe-batch quantize`` output (its config.json's
    ``quantization`` block), else None."""
    try:
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization")
    return q.get("scheme") if isinstance(q, dict) else None


def job_dict(a, prompts: Path, output: Path) -> dict:
    job = {
        "name": a.name,
        "model": str(Path(a.ckpt).resolve()),
        "task": "generate",
        "data": {"source": "jsonl", "path": str(prompts.resolve()), "chat_template": True},
        "generation": {"max_new_tokens": a.gen, "temperature": 0.0, "stop_at_eos": False},
        "device": a.device,
        "dtype": a.dtype,
        "executor": a.executor,
        "policy": "auto",
        "cpu_memory": a.cpu_memory,
        "output": {"path": str(output.resolve())},
    }
    if a.cap:
        job["gpu_memory"] = a.cap
    if a.hardware:
        job["hardware"] = str(Path(a.hardware).resolve()) if Path(a.hardware).is_file() else a.hardware
    return job


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="HF checkpoint directory (or a moe-batch quantize output)")
    ap.add_argument("--gen", type=int, default=128, help="max_new_tokens, all generated (default 128)")
    ap.add_argument("--requests", type=int, default=2000, help="requests (MT-Bench first turns repeated; default 2000)")
    ap.add_argument("--cap", default="12GiB", help="gpu_memory of the job (default 12GiB; '' for none)")
    ap.add_argument("--cpu-memory", default="100GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--executor", default="cgopipe")
    ap.add_argument("--hardware", default=None, help="the job's hardware: a preset name or a profile YAML "
                    "(default: none, the host's measured profile, measured by the first job)")
    ap.add_argument("--weights", default=None, help="label: bf16 / int4 (default: from the checkpoint)")
    ap.add_argument("--set", action="append", default=[], help="passed to moe-batch run as --set KEY=VALUE")
    ap.add_argument("--mtbench", default=None, help="MT-Bench question.jsonl (default: see common.mtbench_file)")
    ap.add_argument("--work", default=None, help="job files and outputs (default OUT/ours-work)")
    ap.add_argument("--out", required=True, help="folder of the result rows")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped (row: failed)")
    a = ap.parse_args(argv)

    weights = a.weights or quant_scheme(a.ckpt) or {"bfloat16": "bf16"}.get(a.dtype, a.dtype)
    a.name = f"ours-{weights}-g{a.gen}"
    work = Path(a.work or Path(a.out) / "ours-work")
    prompts = common.write_jsonl(work / f"prompts-{a.requests}.jsonl", common.prompt_records(a.requests, a.mtbench))
    output = work / f"{a.name}.jsonl"
    for p in (output, output.with_suffix(".report.json"), output.with_suffix(".partial.jsonl")):
        if p.exists():
            p.unlink()
    import yaml

    job_path = work / f"{a.name}.yaml"
    job_path.write_text(yaml.safe_dump(job_dict(a, prompts, output), sort_keys=False))
    cmd = [sys.executable, "-m", "lightning_moe.cli", "run", str(job_path)]
    for s in a.set:
        cmd += ["--set", s]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO), env.get("PYTHONPATH")]))
    row = {"peer": "ours", "weights": weights, "model": common.model_label(a.ckpt), "model_dir": a.ckpt,
           "gen_len": a.gen, "requests": a.requests, "cap": a.cap or None, "device": common.device_name(),
           "command": " ".join(cmd)}
    t0 = time.perf_counter()
    log = work / f"{a.name}.log"
    with open(log, "w") as f, common.GpuMemPoller() as mem:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row["wall_s_process"] = round(time.perf_counter() - t0, 2)
    row["gpu_peak_gib"] = mem.peak_gib
    report_path = output.with_suffix(".report.json")
    if rc != 0 or not report_path.exists():
        tail = log.read_text().splitlines()[-15:]
        row.update(status="failed", reason=f"moe-batch run exit {rc}: " + " | ".join(tail)[-600:])
        common.write_row(a.out, a.name, row)
        return 1
    rep = json.loads(report_path.read_text())
    pol = rep.get("policy") or {}
    pred = rep.get("predicted") or {}
    ws = rep.get("wall_seconds") or {}
    n_gen = rep.get("generated_tokens")
    row.update(
        N=pol.get("N"), gen_tokens=n_gen, prompt_tokens=rep.get("prompt_tokens"),
        prompt_len=round(rep["prompt_tokens"] / a.requests, 1) if rep.get("prompt_tokens") else None,
        seconds=round(sum(ws.get(k) or 0.0 for k in ("warmup", "prefill", "decode")), 3),
        tok_s=rep.get("end_to_end_tokens_per_s"),
        status="ok" if rep.get("status") == "done" else "failed",
        extra={"report": str(report_path), "policy": pol, "predicted_end_to_end_tok_s":
               pred.get("end_to_end_tokens_per_s"), "decode_tok_s": rep.get("decode_tokens_per_s"),
               "prefill_tok_s": rep.get("prefill_tokens_per_s"), "wall_seconds": ws,
               "other_seconds": rep.get("other_seconds"), "predicted": pred,
               "peak_gpu_memory_bytes": rep.get("peak_gpu_memory_bytes"), "report_status": rep.get("status")},
    )
    if row["status"] != "ok":
        row["reason"] = f"report status: {rep.get('status')}"
    common.write_row(a.out, a.name, row)
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
