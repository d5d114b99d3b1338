#!/usr/bin/env python3
"""Run ``moe-batch run JOB.yaml`` in subprocesses over a list of cases and tabulate what each run reported.

Each case is one job (checkpoint bf16 or int4, task/mode, GPU cap, request count, prompt length, generated
tokens, policy ``auto`` or an explicit mapping); the sweep writes its data and job YAML into ``--work``, runs
``python3 -m lightning_moe.cli run JOB.yaml --no-progress`` with a per-case timeout, and records the exit code,
status, wall time and the run report (``<output stem>.report.json``: ``status``, ``policy``, ``predicted``,
tokens/s, ``peak_gpu_memory_bytes`` and, when the report has it, the ``memory`` block). Exit codes: 0 done,
2 refused (bad job or a policy that does not fit: one stderr line), 3 out of memory. A case expected to be
refused passes when it exits 2; an OOM or timeout is a failure.

Outputs in ``--out``: ``sweep.jsonl`` (one line per case, appended as each finishes) and ``sweep.md`` (the
table, rewritten after every case), plus ``logs/<case>.log`` (stdout + stderr of the run) and
``reports/<case>.report.json``. The whole sweep is bounded by ``--time-budget`` seconds (checkpoint creation
included): a case starts only when ``--min-case-seconds`` remain, its timeout is cut to what is left, and the
table is written whatever happens. ``--skip-done`` skips cases already in ``--out/sweep.jsonl``.

Presets:
  smoke  CPU, a tiny-width checkpoint (2 layers, hidden 64), 6 cases, < 3 minutes.
  suite  GPU acceptance: 4-layer Mixtral-8x7B-width checkpoint, bf16 and int4; generation and each scoring
         mode with policy auto at 12 and 24 GiB; 1000 perplexity texts of 300 tokens; two explicit policies
         that fit, one oversized explicit policy and one with an unknown key, both to be refused.
  sweep  GPU: 24 auto-planned cases over caps 8/12/16/24 GiB, gen 8-256, prompts 20-2000 tokens, N up to 2048,
         bf16 and int4, generation and scoring.
  families  GPU: one family's real-width checkpoint (``--dims-preset``, any preset make_checkpoint writes), bf16 and
         int4 generation / scoring at 12 GiB (``--cap`` changes it). A case CGOPipe refuses for the family (its
         ``executor: cgopipe: ...; set executor: serial`` refusal) runs again, and the later cases run, with
         ``executor: serial``; int4 cases are ``skipped`` when ``moe-batch quantize`` refuses the family (gpt-oss).
         ``--mxfp4`` (a gpt-oss ``--dims-preset``): the checkpoint's experts are the Hub's MXFP4 blocks / scales
         (``make_checkpoint --mxfp4``; its own directory, never taken for the bf16 one); the ``*-bf16`` cases run
         on it (bf16 compute, MXFP4 expert pages).
  roofline  GPU, issue 44's matrix: one family's real-width checkpoint (``--dims-preset``, ``--layers``, ``--mxfp4``;
         default the Mixtral width), ``policy: auto`` at 12 and 16 GiB (``--cap`` keeps one): 1000 MT-Bench first turns
         (repeated, chat template) x 32 new tokens (greedy), and 300 perplexity texts of 440 tokens; ``--int4`` runs
         them on the ``moe-batch quantize`` int4 copy. Writes ``roofline.md`` beside ``sweep.md``: per case prefill,
         decode and end-to-end measured / predicted with the HRM's binding stage, its terms, and the job's ``other``.
  prefill  GPU, issue 22: an 8-layer Mixtral-8x7B-width checkpoint (22.6 GiB), bf16 and int4, at 12 and 24 GiB:
         1000 perplexity texts of 300 tokens and 2000 generation prompts of 100 tokens (16 new), one
         loglikelihood job of 1000 x 200 tokens; off those: many lengths (perplexity 64-1024 and generation
         16-400 at 16 GiB, loglikelihood 32-600 in int4 at 12 GiB), 300 texts of 2000 tokens, a 16 GiB cap; each
         case's prefill against the dense-GEMM bound with ``benchmarks/prefill_bound.py``.

GPU cases use ``--hardware`` (default: the committed h200-host profile) and ``cpu_memory: 100GiB``.
The tiny model's tokenizer comes from ``$LIGHTNING_MOE_CACHE``/tiny-mixtral-v1.

Examples:
  python3 benchmarks/cli_sweep.py --preset smoke --work /tmp/lmoe-smoke --out /tmp/lmoe-smoke/out
  python3 benchmarks/cli_sweep.py --preset suite --work /tmp/lmoe --out $OUT/suite --time-budget 540 --gen-device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: lightning_moe, tests
from tests.support import make_checkpoint  # noqa: E402
from tests.support import suite_jobs as sj  # noqa: E402

from lightning_moe.model.families import read_spec  # noqa: E402

GiB = 2**30
TINY_DIMS = make_checkpoint.Dims(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2)
SUITE_DIMS = make_checkpoint.Dims(layers=4)
PREFILL_DIMS = make_checkpoint.Dims(layers=8)  # issue 22's checkpoint: 22.6 GiB, twice the 12 GiB cap
REFUSED_POLICY = {"mu": 1000, "n": 2, "resident_experts": 8}  # 4 x 8 x 336 MiB = 10.5 GiB resident > a 12 GiB cap
UNKNOWN_KEY_POLICY = {"mu": 4, "nn": 2}


@dataclass
class Case:
    """One ``moe-batch run`` of the sweep."""

    name: str  # unique; names the job, data and output files
    ckpt: str  # "bf16" | "int4"
    mode: str  # "generate" | "loglikelihood" | "multiple_choice" | "perplexity"
    cap_gib: float  # gpu_memory of the job
    n: int  # requests (MT-Bench: over 80, its first turns repeated with the chat template)
    prompt_len: int  # tokens per prompt / text with the BOS (0: MT-Bench questions)
    gen: int = 16  # generation.max_new_tokens (generate only)
    policy: Any = "auto"  # "auto" or an explicit policy mapping
    expect: str = "ok"  # "ok" | "refused"
    extra: dict = field(default_factory=dict)  # more job keys (expert_ffn, executor, device, ...)
    timeout_s: float = 240.0  # per-case limit
    prompt_len_max: int = 0  # > prompt_len: each record's length uniform in [prompt_len, prompt_len_max]


@dataclass
class Machine:
    """Where the cases run and what the jobs say about the host."""

    device: str  # job device: "cpu" | "cuda"
    dims: make_checkpoint.Dims  # checkpoint architecture
    hardware: Optional[str]  # job hardware: preset name or profile path
    cpu_memory: str = "100GiB"  # job cpu_memory
    dtype: str = "bfloat16"  # job dtype


def smoke_cases() -> list[Case]:
    """CPU: the tiny-width checkpoint, each mode once, int4 once, two policies that must be refused."""
    return [
        Case("smoke-gen-bf16", "bf16", "generate", 8, 8, 20, gen=8, timeout_s=120),
        Case("smoke-ll-int4", "int4", "loglikelihood", 8, 8, 40, timeout_s=120),
        Case("smoke-mc-bf16", "bf16", "multiple_choice", 8, 8, 30, timeout_s=120),
        Case("smoke-ppl-bf16", "bf16", "perplexity", 8, 32, 300, timeout_s=120),
        Case("smoke-refuse-oversized", "bf16", "generate", 0.0625, 8, 20, gen=8, expect="refused",
             policy={"mu": 100000, "n": 8, "resident_experts": 8}, timeout_s=120),
        Case("smoke-refuse-unknown-key", "bf16", "generate", 8, 8, 20, gen=8, expect="refused",
             policy=dict(UNKNOWN_KEY_POLICY), timeout_s=120),
    ]


def suite_cases(mtbench: bool) -> list[Case]:
    """GPU acceptance: auto at 12 and 24 GiB for every mode and both checkpoints, the perplexity acceptance case,
    two explicit policies that fit and two that must be refused."""
    out = []
    for ck in ("bf16", "int4"):
        for cap in (12, 24):
            t = f"{ck}-{cap}g"
            out += [
                Case(f"suite-gen-{t}", ck, "generate", cap, 80, 0 if mtbench else 128, gen=32),
                Case(f"suite-ll-{t}", ck, "loglikelihood", cap, 256, 200),
                Case(f"suite-mc-{t}", ck, "multiple_choice", cap, 128, 100),
                Case(f"suite-ppl-{t}", ck, "perplexity", cap, 256, 300),
            ]
    out += [
        Case("suite-ppl-accept-bf16-12g", "bf16", "perplexity", 12, 1000, 300, timeout_s=300),
        Case("suite-explicit-a-bf16-12g", "bf16", "generate", 12, 64, 128, gen=32,
             policy={"mu": 32, "n": 2, "prefill_mu": 8, "resident_experts": 4, "n_gpu_attn": 0}),
        Case("suite-explicit-b-int4-12g", "int4", "generate", 12, 64, 128, gen=32,
             policy={"mu": 16, "n": 4, "prefill_mu": 16, "resident_experts": 2, "n_gpu_attn": 1}),
        Case("suite-refuse-oversized-bf16-12g", "bf16", "generate", 12, 64, 128, gen=32, expect="refused",
             policy=dict(REFUSED_POLICY), timeout_s=120),
        Case("suite-refuse-unknown-key-bf16-12g", "bf16", "generate", 12, 64, 128, gen=32, expect="refused",
             policy=dict(UNKNOWN_KEY_POLICY), timeout_s=120),
    ]
    return out


def prefill_cases() -> list[Case]:
    """GPU, issue 22's prefill acceptance on the 8-layer Mixtral-width checkpoint (``PREFILL_DIMS``), ``policy: auto``:
    a 1000-text perplexity job (300 tokens each) and a 2000-prompt generation job (100-token prompts, 16 new tokens),
    bf16 and int4, at 12 and 24 GiB; one loglikelihood job of other lengths (1000 x 200 + 8) at 12 GiB; then the
    ``pf-*-mix-*`` / ``-long-`` / 16 GiB cases off those lengths and caps."""
    out = []
    for cap in (12, 24):
        for ck in ("bf16", "int4"):
            t = f"{ck}-{cap}g"
            out += [Case(f"pf-ppl-{t}", ck, "perplexity", cap, 1000, 300, timeout_s=300),
                    Case(f"pf-gen-{t}", ck, "generate", cap, 2000, 100, gen=16, timeout_s=300)]
    out.append(Case("pf-ll-bf16-12g", "bf16", "loglikelihood", 12, 1000, 200, timeout_s=300))
    # off the tuned lengths and caps: many lengths (every packed chunk a new shape), long texts, a 16 GiB cap
    out += [Case("pf-ppl-mix-bf16-16g", "bf16", "perplexity", 16, 1000, 64, timeout_s=300, prompt_len_max=1024),
            Case("pf-gen-mix-int4-16g", "int4", "generate", 16, 2000, 16, gen=16, timeout_s=300, prompt_len_max=400),
            Case("pf-ll-mix-int4-12g", "int4", "loglikelihood", 12, 1000, 32, timeout_s=300, prompt_len_max=600),
            Case("pf-ppl-bf16-16g", "bf16", "perplexity", 16, 1000, 300, timeout_s=300),
            Case("pf-ppl-long-int4-16g", "int4", "perplexity", 16, 300, 2000, timeout_s=300)]
    return out


def families_cases(mtbench: bool) -> list[Case]:
    """GPU, one family's real-width checkpoint (``--dims-preset``): generation and perplexity in bf16, generation and
    loglikelihood on its int4 copy, ``policy: auto`` at 12 GiB."""
    return [
        Case("fam-gen-bf16-12g", "bf16", "generate", 12, 80, 0 if mtbench else 128, gen=32),
        Case("fam-ppl-bf16-12g", "bf16", "perplexity", 12, 256, 300),
        Case("fam-gen-int4-12g", "int4", "generate", 12, 80, 0 if mtbench else 128, gen=32),
        Case("fam-ll-int4-12g", "int4", "loglikelihood", 12, 256, 200),
    ]


def roofline_cases(int4: bool = False) -> list[Case]:
    """GPU, issue 44's matrix for one family's real-width checkpoint (``--dims-preset``): ``policy: auto`` at 12 and
    16 GiB, 1000 MT-Bench first turns (repeated, chat template) x 32 new tokens and 300 perplexity texts of 440
    tokens; ``int4``: on the int4 copy."""
    ck = "int4" if int4 else "bf16"
    return [c for cap in (12, 16) for c in (
        Case(f"rf-gen-{ck}-{cap}g", ck, "generate", cap, 1000, 0, gen=32, timeout_s=300),
        Case(f"rf-ppl-{ck}-{cap}g", ck, "perplexity", cap, 300, 440, timeout_s=300))]


def sweep_cases() -> list[Case]:
    """GPU: 24 auto-planned cases; (mode, cap GiB, N, prompt tokens, gen) for bf16 and for int4."""
    grid = [
        ("generate", 8, 64, 20, 32), ("generate", 8, 256, 300, 64), ("generate", 12, 256, 128, 64),
        ("generate", 12, 64, 1000, 128), ("generate", 16, 512, 512, 16), ("generate", 16, 2048, 64, 16),
        ("generate", 24, 1024, 20, 128), ("generate", 24, 128, 2000, 8), ("generate", 16, 64, 100, 256),
        ("loglikelihood", 8, 512, 200, 1), ("multiple_choice", 12, 256, 100, 1), ("perplexity", 24, 256, 2000, 1),
    ]
    out = []
    for ck in ("bf16", "int4"):
        for mode, cap, n, p, g in grid:
            out.append(Case(f"sweep-{mode[:3]}-{ck}-{cap}g-n{n}-p{p}-g{g}", ck, mode, cap, n, p, gen=g, timeout_s=200))
    return out


# ------------------------------------------------------------------------------------------------
# preparation: checkpoints
# ------------------------------------------------------------------------------------------------
def _ckpt_matches(path: str, dims: make_checkpoint.Dims) -> bool:
    """True when ``path`` holds a finished checkpoint (index written last) of these dims, MXFP4 experts (a
    ``quantization_config`` of quant_method mxfp4) exactly when ``dims.mxfp4``."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return False
    if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return False
    try:
        spec = read_spec(c)
    except ValueError:
        return False
    mxfp4 = (c.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return (spec.model_type == dims.family and spec.num_layers == dims.layers and spec.hidden_size == dims.hidden
            and spec.intermediate_size == dims.intermediate and spec.num_experts == dims.experts
            and mxfp4 == dims.mxfp4)


def ensure_checkpoints(work: str, dims: make_checkpoint.Dims, need_int4: bool, gen_device: str, log) -> dict:
    """The bf16 checkpoint (written when missing; ``dims.mxfp4``: its experts MXFP4, in a directory of its own) and,
    when ``need_int4``, its ``moe-batch quantize`` int4 copy. Returns ``{"bf16": dir, "int4": dir or None}``."""
    tag = ("" if dims.family == "mixtral" else dims.family + "-") + f"L{dims.layers}-h{dims.hidden}-f{dims.intermediate}"
    tag += "-mxfp4" if dims.mxfp4 else ""
    bf16 = os.path.join(work, f"ckpt-bf16-{tag}")
    if not _ckpt_matches(bf16, dims):
        shutil.rmtree(bf16, ignore_errors=True)
        res = make_checkpoint.write_checkpoint(bf16, dims, device=gen_device, log=log)
        print(f"checkpoint {bf16}: {res['bytes'] / GiB:.2f} GiB in {res['seconds']:.1f} s", file=log, flush=True)
    out = {"bf16": bf16, "int4": None}
    if need_int4:
        int4 = os.path.join(work, f"ckpt-int4-{tag}")
        if not _ckpt_matches(int4, dims):
            shutil.rmtree(int4, ignore_errors=True)
            t0 = time.perf_counter()
            q = subprocess.run([sys.executable, "-m", "lightning_moe.cli", "quantize", bf16, int4, "--experts", "int4",
                                "--quiet"], env=_env(), stderr=subprocess.PIPE, text=True)
            if q.returncode == 2:  # refused (gpt-oss: its experts' biases): the int4 cases are skipped, by name
                shutil.rmtree(int4, ignore_errors=True)
                lines = [ln for ln in q.stderr.splitlines() if ln.strip()]
                out["int4_refused"] = lines[-1] if lines else "moe-batch quantize exit 2"
                print(f"quantize refused: {out['int4_refused']}", file=log, flush=True)
                return out
            if q.returncode != 0:
                raise subprocess.CalledProcessError(q.returncode, q.args, stderr=q.stderr)
            print(f"quantized {int4} in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
        out["int4"] = int4
    return out


def cgopipe_refused(case: Case, rc: Optional[int], msg: str) -> bool:
    """True when the run was refused because CGOPipe does not run the model's family (``plan_for_job``'s
    ``executor: cgopipe: ...; set executor: serial``) and the case named no executor itself."""
    return (rc == 2 and "executor" not in case.extra and "executor: cgopipe:" in msg
            and msg.rstrip().endswith("set executor: serial"))


def _env() -> dict:
    """The environment of the subprocesses: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = sj.REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ------------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------------
def write_case(case: Case, machine: Machine, ckpts: dict, words: list[str], work: str, mtbench: bool) -> tuple[str, str, int]:
    """Write the case's data and job YAML into ``work``; remove an earlier run's output. Returns
    (job path, output path, expected record count)."""
    use_mtbench = case.mode == "generate" and case.prompt_len == 0
    if use_mtbench and not mtbench:
        raise RuntimeError("MT-Bench questions not installed")
    data = None
    repeated = use_mtbench and case.n > 80  # the first turns repeated, from a JSONL of chat prompts
    if repeated:
        data = sj.write_jsonl(os.path.join(work, "data", case.name + ".jsonl"), sj.mtbench_repeated(case.n))
    elif not use_mtbench:
        data = sj.write_jsonl(os.path.join(work, "data", case.name + ".jsonl"),
                              sj.records_for(case.mode, words, case.n, case.prompt_len,
                                             prompt_tokens_max=case.prompt_len_max))
    output = os.path.join(work, "results", case.name + ".jsonl")
    root = os.path.splitext(output)[0]
    for p in (output, root + ".report.json", root + ".meta.json"):
        if os.path.exists(p):
            os.remove(p)
    cap = f"{int(case.cap_gib * 1024)}MiB" if case.cap_gib < 1 else f"{case.cap_gib:g}GiB"
    job = sj.job_dict(ckpts[case.ckpt], case.mode, data, output, device=machine.device, dtype=machine.dtype,
                      policy=case.policy, hardware=machine.hardware, gpu_memory=cap, cpu_memory=machine.cpu_memory,
                      max_new_tokens=case.gen, limit=case.n if use_mtbench and not repeated else None,
                      mtbench=use_mtbench and not repeated, name=case.name)
    if repeated:
        job["data"]["chat_template"] = True
    job.update(case.extra)
    path = sj.write_job(os.path.join(work, "jobs", case.name + ".yaml"), job)
    return path, output, (min(case.n, 80) if use_mtbench and not repeated else case.n)


def run_moe_batch(job_path: str, timeout_s: float, log_path: str) -> tuple[Optional[int], float, str]:
    """``python3 -m lightning_moe.cli run JOB --no-progress`` in its own process group; stdout+stderr go to
    ``log_path``. Returns (exit code or None on timeout, wall seconds, last stderr line)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        p = subprocess.Popen([sys.executable, "-m", "lightning_moe.cli", "run", job_path, "--no-progress"],
                             stdout=logf, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        try:
            _, err = p.communicate(timeout=timeout_s)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            rc = None
        logf.write("\n--- stderr ---\n" + (err or ""))
    lines = [ln for ln in (err or "").splitlines() if ln.strip()]
    return rc, time.perf_counter() - t0, (lines[-1] if lines else "")


def _count_records(path: str) -> int:
    try:
        return len(sj.read_jsonl(path))
    except (OSError, ValueError):
        return -1


def classify(case: Case, rc: Optional[int], records: int, expected: int, report: dict, msg: str) -> str:
    """``ok`` / ``ok (refused)`` or a failure: ``FAIL: ...``, ``OOM``, ``TIMEOUT``."""
    if rc is None:
        return "TIMEOUT"
    if rc == 3:
        return "OOM"
    if case.expect == "either":  # --check-on-cpu: a refusal sized for the GPU model need not hold on the tiny one
        return "ok (refused)" if rc == 2 else "ok" if rc == 0 and records == expected else f"FAIL: exit {rc}: {msg[:160]}"
    if case.expect == "refused":
        return "ok (refused)" if rc == 2 else f"FAIL: expected a refusal (exit 2), got exit {rc}"
    if rc == 2:
        return f"FAIL: refused: {msg[:160]}"
    if rc != 0:
        return f"FAIL: exit {rc}: {msg[:160]}"
    if report.get("status") != "done":
        return f"FAIL: report status {report.get('status')!r}"
    if records != expected:
        return f"FAIL: {records} of {expected} records"
    mem = report.get("memory") or {}
    cap, res = mem.get("cap_bytes"), mem.get("measured_peak_reserved_bytes")
    if cap and res and res > cap:
        return f"FAIL: reserved {res / GiB:.2f} GiB > cap {cap / GiB:.2f} GiB"
    return "ok"


def row_from(case: Case, machine: Machine, rc, wall: float, msg: str, records: int, expected: int, report: dict,
             status: str) -> dict:
    """The sweep.jsonl line of one case (the report's figures read with .get: older reports lack ``memory``)."""
    mem = report.get("memory") or {}
    pol = report.get("policy") or {}
    pred = report.get("predicted") or {}
    metric = "end_to_end_tokens_per_s" if case.mode == "generate" else "prefill_tokens_per_s"
    return {
        "case": case.name, "family": machine.dims.family, "layers": machine.dims.layers, "hidden": machine.dims.hidden,
        "ckpt": case.ckpt, "mxfp4": machine.dims.mxfp4,
        "mode": case.mode, "cap_bytes": int(case.cap_gib * GiB), "n": case.n, "prompt_len": case.prompt_len,
        "prompt_len_max": case.prompt_len_max,
        "gen": case.gen if case.mode == "generate" else None, "policy_asked": case.policy, "expect": case.expect,
        "exit_code": rc, "status": status, "wall_s": round(wall, 2), "message": msg if rc not in (0, None) else "",
        "records": records, "records_expected": expected, "report_status": report.get("status"),
        "policy": pol, "predicted": pred, "metric": metric,
        "predicted_tok_s": pred.get(metric), "measured_tok_s": report.get(metric),
        "prefill_tokens_per_s": report.get("prefill_tokens_per_s"), "decode_tokens_per_s": report.get("decode_tokens_per_s"),
        "end_to_end_tokens_per_s": report.get("end_to_end_tokens_per_s"),
        "peak_gpu_memory_bytes": report.get("peak_gpu_memory_bytes"), "memory": mem,
        "peak_host_memory_bytes": report.get("peak_host_memory_bytes"),
        "wall_seconds": report.get("wall_seconds"),
        # the executor's stage counters (partial-generation checkpoints, copies, CPU attention, expert FFN)
        "stages": report.get("stages"), "stats": report.get("stats"),
    }


# ------------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------------
def _gib(b) -> str:
    return "-" if not b else f"{b / GiB:.2f}"


def _num(v) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def _policy_cell(r: dict) -> str:
    p = r.get("policy") or {}
    if p.get("mu") is not None:
        return f"{p.get('mu')}x{p.get('n')}, r{p.get('resident_experts')}, g{p.get('n_gpu_attn')}"
    asked = r.get("policy_asked")
    return "auto" if asked == "auto" else json.dumps(asked, separators=(",", ":"))


def markdown(rows: list[dict], title: str) -> str:
    """The sweep table (one row per case)."""
    head = ["case", "model/layers", "dtype", "task", "cap GiB", "N", "prompt", "gen", "policy (mu x n, resident, g)",
            "pred peak GiB", "meas alloc / reserved GiB", "pred/meas", "host pred / meas GiB", "pred tok/s", "meas tok/s",
            "pred/meas", "wall s", "status"]
    lines = [f"# {title}", "",
             "tok/s: end-to-end for generate, prefill for scoring; pred/meas peak = predicted / measured reserved "
             "(allocated when no reserved figure); `-`: not in the report.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mem = r.get("memory") or {}
        alloc = mem.get("measured_peak_allocated_bytes") or r.get("peak_gpu_memory_bytes")
        res = mem.get("measured_peak_reserved_bytes")
        pred = mem.get("predicted_peak_bytes")
        phase = mem.get("predicted_peak_phase")
        cells = [r["case"], f"{r.get('family', 'mixtral')}-w{r['hidden']}/{r['layers']}L", r["ckpt"] + ("/mxfp4" if r.get("mxfp4") else ""), r["mode"], f"{r['cap_bytes'] / GiB:g}",
                 str(r["n"]), "mtbench" if r["prompt_len"] == 0 else (
                     f"{r['prompt_len']}-{r['prompt_len_max']}" if r.get("prompt_len_max") else str(r["prompt_len"])), str(r["gen"] or "-"),
                 _policy_cell(r), _gib(pred) + (f" ({phase})" if phase else ""), f"{_gib(alloc)} / {_gib(res)}",
                 _ratio(pred, res or alloc),
                 f"{_gib(mem.get('predicted_host_bytes'))} / {_gib(r.get('peak_host_memory_bytes'))}"
                 + (f" ({mem['predicted_host_phase']})" if mem.get("predicted_host_phase") else ""),
                 _num(r.get("predicted_tok_s")), _num(r.get("measured_tok_s")),
                 _ratio(r.get("predicted_tok_s"), r.get("measured_tok_s")), f"{r['wall_s']:.1f}",
                 r["status"].replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    ok = sum(r["status"].startswith("ok") for r in rows)
    skipped = sum(r["status"].startswith("skipped") for r in rows)
    lines += ["", f"{ok} of {len(rows)} cases passed" + (f", {skipped} skipped." if skipped else ".")]
    return "\n".join(lines) + "\n"


def _mp(r: dict, key: str, bind: Optional[str] = None) -> str:
    """``measured / predicted = ratio (binding)`` of one phase's tokens/s in a case's row."""
    m, p = r.get(key), (r.get("predicted") or {}).get(key)
    if not m or not p:
        return "-"
    b = (r.get("predicted") or {}).get(bind) if bind else None
    return f"{_num(m)} / {_num(p)} = **{m / p:.2f}**" + (f" ({b})" if b else "")


def _terms(r: dict, phase: str) -> str:
    """The HRM's terms of one phase (the report's ``predicted.stages_seconds``), seconds per batch, largest first."""
    st = ((r.get("predicted") or {}).get("stages_seconds") or {}).get(phase) or {}
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(st.items(), key=lambda kv: -kv[1]) if v > 0) or "-"


def roofline_markdown(rows: list[dict], title: str) -> str:
    """Issue 44's table: per case prefill, decode and end-to-end measured / predicted (the HRM's binding stage), the
    HRM's terms (decode's for generation, prefill's for scoring) and the job's ``other`` seconds."""
    head = ["case", "model/layers", "pages", "cap GiB", "policy (mu x n, resident, g)", "prefill m / p (binds)",
            "decode m / p (binds)", "end-to-end m / p", "HRM terms, s per batch", "other s (of wall)", "status"]
    lines = [f"# {title}", "", "m / p: the report's measured tokens/s over the HRM's predicted (the profile's peak "
             "rates); end-to-end over warm-up + prefill + decode; other: model files, requests, planning, records, "
             "outside every rate.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        gen = r["mode"] == "generate"
        ws = r.get("wall_seconds") or {}
        cells = [r["case"], f"{r.get('family', 'mixtral')}-w{r['hidden']}/{r['layers']}L",
                 r["ckpt"] + ("/mxfp4" if r.get("mxfp4") else ""), f"{r['cap_bytes'] / GiB:g}", _policy_cell(r),
                 _mp(r, "prefill_tokens_per_s", "prefill_binding"),
                 _mp(r, "decode_tokens_per_s", "decode_binding") if gen else "-",
                 _mp(r, "end_to_end_tokens_per_s") if gen else "-", _terms(r, "decode" if gen else "prefill"),
                 f"{ws['other']:.1f} ({ws['total']:.1f})" if ws.get("total") else "-", r["status"].replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def machine_for(preset: str, hardware: Optional[str], cpu_memory: str) -> Machine:
    """smoke: CPU and the tiny-width dims; suite / sweep: CUDA and the 4-layer Mixtral-width dims; prefill: CUDA and
    the 8-layer Mixtral-width dims."""
    if preset == "smoke":
        return Machine("cpu", TINY_DIMS, hardware or sj.H200_PROFILE, cpu_memory)
    if preset == "prefill":
        return Machine("cuda", PREFILL_DIMS, hardware or sj.H200_PROFILE, cpu_memory)
    return Machine("cuda", SUITE_DIMS, hardware or sj.H200_PROFILE, cpu_memory)


def cpu_check_case(c: Case) -> Case:
    """The case shrunk for --check-on-cpu: at most 4 requests, 2 generated tokens, prompts up to 300 tokens,
    device cpu; a refusal is not expected (the caps are sized for the Mixtral-width model)."""
    return dataclasses.replace(c, n=min(c.n, 4), gen=min(c.gen, 2), prompt_len=min(c.prompt_len, 300),
                               prompt_len_max=min(c.prompt_len_max, 300),
                               expect="either" if c.expect == "refused" else c.expect, timeout_s=120)


def _recap(name: str, old: float, new: float) -> str:
    """A case name with its ``-<cap>g`` suffix changed to the new cap."""
    tail = f"-{old:g}g"
    return (name[:-len(tail)] if name.endswith(tail) else name) + f"-{new:g}g"


def cases_for(preset: str, mtbench: bool, int4: bool = False) -> list[Case]:
    """The preset's case list (``int4``: the roofline preset's cases on the int4 copy)."""
    return {"smoke": smoke_cases, "suite": lambda: suite_cases(mtbench), "sweep": sweep_cases,
            "families": lambda: families_cases(mtbench), "prefill": prefill_cases,
            "roofline": lambda: roofline_cases(int4)}[preset]()


def run_sweep(cases: list[Case], machine: Machine, work: str, out: str, time_budget: float, gen_device: str,
              min_case_s: float = 20.0, skip_done: bool = False, title: str = "sweep", log=sys.stderr) -> list[dict]:
    """Prepare the checkpoints, run every case within ``time_budget`` seconds, write sweep.jsonl and sweep.md."""
    t_start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    jsonl, md = os.path.join(out, "sweep.jsonl"), os.path.join(out, "sweep.md")
    rows = sj.read_jsonl(jsonl) if skip_done and os.path.exists(jsonl) else []
    if not skip_done and os.path.exists(jsonl):
        os.remove(jsonl)
    done = {r["case"] for r in rows}
    todo = [c for c in cases if c.name not in done]
    ckpts = ensure_checkpoints(work, machine.dims, any(c.ckpt == "int4" for c in todo), gen_device, log)
    from lightning_moe.data.tokenize import load_tokenizer

    words = sj.one_token_words(load_tokenizer(ckpts["bf16"]))
    mtbench = sj.mtbench_available()
    serial_why = None  # CGOPipe's refusal of the family, once seen: the later cases run with executor: serial
    for case in todo:
        left = time_budget - (time.perf_counter() - t_start)
        if left < min_case_s:
            print(f"time budget: {left:.0f} s left, stopping before {case.name}", file=log, flush=True)
            break
        if case.ckpt == "int4" and ckpts.get("int4_refused"):
            row = row_from(case, machine, None, 0.0, "", 0, 0, {}, f"skipped: quantize refused: {ckpts['int4_refused']}")
            rows.append(row)
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{case.name}: {row['status'][:200]}", file=log, flush=True)
            continue
        if serial_why:
            case = dataclasses.replace(case, extra={**case.extra, "executor": "serial"})
        try:
            job_path, output, expected = write_case(case, machine, ckpts, words, work, mtbench)
        except RuntimeError as e:
            print(f"{case.name}: skipped ({e})", file=log, flush=True)
            continue
        rc, wall, msg = run_moe_batch(job_path, min(case.timeout_s, left), os.path.join(out, "logs", case.name + ".log"))
        if cgopipe_refused(case, rc, msg):  # detected by the refusal, not by the family's name
            serial_why = msg
            print(f"{case.name}: cgopipe refused ({msg[:160]}); again with executor: serial", file=log, flush=True)
            case = dataclasses.replace(case, extra={**case.extra, "executor": "serial"})
            job_path, output, expected = write_case(case, machine, ckpts, words, work, mtbench)
            left = time_budget - (time.perf_counter() - t_start)
            rc, wall, msg = run_moe_batch(job_path, min(case.timeout_s, left),
                                          os.path.join(out, "logs", case.name + ".log"))
        report = {}
        if os.path.exists(sj.report_path(output)):
            with open(sj.report_path(output)) as f:
                report = json.load(f)
            os.makedirs(os.path.join(out, "reports"), exist_ok=True)
            shutil.copy(sj.report_path(output), os.path.join(out, "reports", case.name + ".report.json"))
        records = _count_records(output) if os.path.exists(output) else 0
        status = classify(case, rc, records, expected, report, msg)
        if serial_why and status.startswith("ok"):
            status += " (executor serial: cgopipe refused the family)"
        row = row_from(case, machine, rc, wall, msg, records, expected, report, status)
        rows.append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(md, "w") as f:
            f.write(markdown(rows, title))
        print(f"{case.name}: {status} (exit {rc}, {wall:.1f} s){' -- ' + msg if rc not in (0, None) else ''}",
              file=log, flush=True)
    with open(md, "w") as f:
        f.write(markdown(rows, title))
    if any(r["case"].startswith("rf-") for r in rows):  # the roofline preset's table beside it
        with open(os.path.join(out, "roofline.md"), "w") as f:
            f.write(roofline_markdown(rows, title))
    return rows


def prepare(cases: list[Case], machine: Machine, work: str, gen_device: str, log=None) -> None:
    """Both checkpoints, then every case's data and job YAML (nothing is run)."""
    log = sys.stderr if log is None else log
    ckpts = ensure_checkpoints(work, machine.dims, True, gen_device, log)
    from lightning_moe.data.tokenize import load_tokenizer

    words = sj.one_token_words(load_tokenizer(ckpts["bf16"]))
    mtbench = sj.mtbench_available()
    for case in cases:
        try:
            job_path, _, _ = write_case(case, machine, ckpts, words, work, mtbench)
            print(f"{case.name}: {job_path}", file=log)
        except RuntimeError as e:
            print(f"{case.name}: skipped ({e})", file=log)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=["smoke", "suite", "sweep", "families", "prefill", "roofline"],
                   help="which case list")
    p.add_argument("--int4", action="store_true", help="roofline: the cases on the moe-batch quantize int4 copy")
    p.add_argument("--dims-preset", default=None, help="the checkpoint's dims from a registry model (qwen3-30b-a3b, "
                   "olmoe-1b-7b, qwen1.5-moe-a2.7b, ...) instead of the preset's Mixtral width; with --layers")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of a --dims-preset checkpoint (default 4)")
    p.add_argument("--mxfp4", action="store_true", help="with a gpt-oss --dims-preset: the checkpoint's experts as the "
                   "Hub's MXFP4 blocks / scales (make_checkpoint --mxfp4)")
    p.add_argument("--work", required=True, help="work directory: checkpoints, data, jobs, results (reused)")
    p.add_argument("--out", required=True, help="directory for sweep.jsonl, sweep.md, logs/ and reports/")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole sweep (default 540)")
    p.add_argument("--min-case-seconds", type=float, default=20.0, help="start a case only when this much is left")
    p.add_argument("--hardware", default=None, help="job hardware (default: lightning_moe/policy/profiles/h200-host.yaml; "
                   "'none': the jobs name none, so each plans with this host's measured profile, the first measuring it)")
    p.add_argument("--cpu-memory", default="100GiB", help="job cpu_memory (default 100GiB)")
    p.add_argument("--gen-device", default=None, help="where the checkpoint's random weights are drawn (default: "
                   "cuda for suite/sweep when available, else cpu)")
    p.add_argument("--cases", default=None, help="comma-separated case names (or prefixes) to run; default all")
    p.add_argument("--cap", type=float, default=None, help="gpu_memory of every case in GiB (default: each case's)")
    p.add_argument("--list", action="store_true", help="print the preset's cases and exit")
    p.add_argument("--check-on-cpu", action="store_true", help="run the preset's cases shrunk (4 requests, 2 tokens) "
                   "on the CPU with the tiny-width checkpoint: checks every job the preset writes parses and runs")
    p.add_argument("--prepare-only", action="store_true", help="write the checkpoints (bf16 and int4) and every "
                   "case's data and job YAML into --work, run nothing")
    p.add_argument("--skip-done", action="store_true", help="keep --out/sweep.jsonl and skip the cases in it")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.int4 and a.preset != "roofline":
        build_parser().error("--int4: the roofline preset's option (the other presets name each case's checkpoint)")
    cases = cases_for(a.preset, sj.mtbench_available(), a.int4)
    if a.cases:
        wanted = [s.strip() for s in a.cases.split(",") if s.strip()]
        cases = [c for c in cases if any(c.name == w or c.name.startswith(w) for w in wanted)]
    if a.cap is not None:  # every case at this gpu_memory; the name's -<cap>g suffix follows
        cases = [dataclasses.replace(c, cap_gib=a.cap, name=_recap(c.name, c.cap_gib, a.cap)) for c in cases]
    if a.list:
        for c in cases:
            print(json.dumps(dataclasses.asdict(c)))
        return 0
    machine = machine_for(a.preset, a.hardware, a.cpu_memory)
    if a.hardware == "none":  # the jobs name no hardware: each plans with this host's measured profile
        machine = dataclasses.replace(machine, hardware=None)
    if a.dims_preset:
        machine = dataclasses.replace(machine, dims=make_checkpoint.Dims.from_registry(a.dims_preset, a.layers))
    if a.mxfp4:
        if machine.dims.family != "gpt_oss":
            build_parser().error(f"--mxfp4: MXFP4 experts are gpt_oss's; give a gpt-oss --dims-preset "
                                 f"(the checkpoint's family is {machine.dims.family})")
        machine = dataclasses.replace(machine, dims=dataclasses.replace(machine.dims, mxfp4=True))
    if a.check_on_cpu:
        fam = machine.dims
        machine = machine_for("smoke", a.hardware, a.cpu_memory)
        machine = dataclasses.replace(machine, dims=fam.tiny())  # the tiny width of the same family
        cases = [cpu_check_case(c) for c in cases]
    gen_device = a.gen_device
    if gen_device is None:
        import torch

        gen_device = "cuda" if a.preset != "smoke" and torch.cuda.is_available() else "cpu"
    if a.prepare_only:
        prepare(cases, machine, os.path.abspath(a.work), gen_device)
        return 0
    rows = run_sweep(cases, machine, os.path.abspath(a.work), os.path.abspath(a.out), a.time_budget, gen_device,
                     a.min_case_seconds, a.skip_done,
                     title=f"cli_sweep --preset {a.preset}" + (f" --dims-preset {a.dims_preset}" if a.dims_preset else "")
                     + (" --mxfp4" if a.mxfp4 else ""))
    ok = sum(r["status"].startswith("ok") for r in rows)
    skipped = sum(r["status"].startswith("skipped") for r in rows)
    print(f"{ok} of {len(rows)} cases passed" + (f", {skipped} skipped (quantize refused)" if skipped else "")
          + f" ({len(cases)} in the preset); table: {os.path.join(a.out, 'sweep.md')}")
    return 0 if ok + skipped == len(rows) == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
