"""Run a job end to end: validate and tokenize everything, then generate or score, writing as it goes.

Order of work (so bad input fails fast and finished work is never lost):
1. read the model's config and tokenizer, the requests, and tokenize them (every input error surfaces
   here, before any weight is loaded);
2. open the results file: records already there are skipped (resume), a torn last line is repaired;
3. load the weights, build the executor, run batch after batch; every finished sequence is appended to
   results.jsonl and fsync'd the moment it finishes;
4. write the run report (JSON, atomically) beside the results and print it.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch

from ..config import Job
from ..data.shard import select_shard
from ..data.sources import load_requests
from ..data.tokenize import encode_requests, load_tokenizer
from ..data.writer import ResultsWriter, error_record, write_json_atomic
from ..model.spec import MoESpec
from ..model.tiny import resolve_model_path
from ..model.weights import load_checkpoint
from . import scoring
from .serial import RunStats, SamplingParams, SerialExecutor, request_seed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _peak_host_bytes() -> int:
    """Peak resident set size of this process in bytes (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def apply_gpu_cap(device: str, gpu_memory: Optional[int]) -> Optional[float]:
    """Cap this process's CUDA caching allocator at ``gpu_memory`` bytes (a 141 GB card acts like a small one).

    Uses ``torch.cuda.set_per_process_memory_fraction``; returns the fraction set (None when no cap or no CUDA).
    Raises ValueError when the cap exceeds the device's memory.
    """
    if not gpu_memory or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    total = torch.cuda.get_device_properties(dev).total_memory
    if gpu_memory > total:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.1f} GiB exceeds the device's {total / 2**30:.1f} GiB")
    frac = gpu_memory / total
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    return frac


class Prepared:
    """Everything a job needs before heavy work: spec, tokenizer, tokenized requests, resume state."""

    def __init__(self, job: Job):
        self.job = job
        self.model_path = resolve_model_path(job.model)
        self.spec = MoESpec.from_pretrained_dir(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        requests = load_requests(job)
        self.n_input = len(requests)
        if job.shard is not None:
            requests = select_shard(requests, *job.shard)
        self.treqs = encode_requests(requests, self.tokenizer, job, self.spec.max_position_embeddings)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else self.spec.eos_token_id


def job_workload_from_prepared(prep: "Prepared"):
    """The planner's Workload from a prepared job's real tokenized requests (lengths fed to prefill)."""
    from ..policy.policy import Workload

    lens = []
    for t in prep.treqs:
        if t.error is None:
            lens += [len(seq) for seq, _ in t.score_inputs] if prep.job.task == "score" else [t.prompt_tokens]
    gen = prep.job.generation.max_new_tokens if prep.job.task == "generate" else 1
    return Workload.from_lengths(lens, gen, name=prep.job.name)


def job_workload(job_path: str):
    """Workload of a job YAML: its requests tokenized exactly as ``moe-batch run`` would (no weights loaded)."""
    from ..config import load_job

    return job_workload_from_prepared(Prepared(load_job(job_path)))


def make_executor(job: Job, prep: Prepared, weights):
    """The executor named by ``job.executor`` ("serial" or "cgopipe"), with its policy when it has one."""
    dtype = DTYPES[job.dtype]
    if job.executor == "cgopipe":
        from .cgopipe import build_cgopipe  # lazy: it needs the planner

        return build_cgopipe(job, prep, weights)
    return SerialExecutor(weights, job.device, dtype)


def _gen_record(tr, out_ids: list[int], reason: str, tokenizer) -> dict:
    rec = {"id": tr.id, "prompt_tokens": tr.prompt_tokens,
           "text": tokenizer.decode(out_ids, skip_special_tokens=True), "output_ids": out_ids,
           "output_tokens": len(out_ids), "finish_reason": reason}
    if tr.truncated:
        rec["truncated_tokens"] = tr.truncated
    return rec


def results_provenance(job: Job) -> dict:
    """What the records of ``job.output.path`` depend on: the model (as the job names it), dtype, task, the decoding
    (generate) or scoring settings, and how prompts are formatted. Device, executor, batch size and policy are left
    out: they change speed, not what a record means."""
    return {"model": job.model, "dtype": job.dtype, "task": job.task,
            "generation": asdict(job.generation) if job.task == "generate" else None,
            "score": asdict(job.score) if job.score is not None else None,
            "chat_template": job.data.chat_template, "system_prompt": job.data.system_prompt,
            "truncate": job.data.truncate}


def check_results_provenance(job: Job) -> None:
    """Before a run appends to ``job.output.path``: compare :func:`results_provenance` with the one saved beside the
    results (``OutputConfig.meta_path``). No results yet: save it. Results without a saved one (older versions): save
    it and go on. Raises ConfigError naming both files and every setting that differs (nothing is written then)."""
    from ..config import ConfigError

    meta, now = job.output.meta_path, results_provenance(job)
    has_results = os.path.exists(job.output.path) and os.path.getsize(job.output.path) > 0
    if has_results and os.path.exists(meta):
        try:
            with open(meta) as f:
                then = json.load(f)
            if not isinstance(then, dict):
                raise ValueError(f"expected a JSON object, got {type(then).__name__}")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"{meta}: unreadable record of what {job.output.path} depends on ({e}); delete it to "
                              f"accept the results as they are, or set output.path to a new file") from None
        diff = [k for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)]
        if diff:
            lines = "; ".join(f"{k}: {then.get(k)!r} then, {now.get(k)!r} now" for k in diff)
            raise ConfigError(f"{job.config_path or job.name}: {job.output.path} holds records of different settings "
                              f"({lines}; saved in {meta}). Resuming would mix them: set output.path to a new file "
                              f"(e.g. --set output.path=...), or move the old results away")
        return
    os.makedirs(os.path.dirname(meta) or ".", exist_ok=True)
    write_json_atomic(meta, now)


def run_job(job: Job, progress: bool = True, log=sys.stderr) -> dict:
    """Run ``job`` to completion (or resume it) and return the run report (also saved as JSON).

    Raises:
        ConfigError / DataError: bad job or input (before any weights are loaded; nothing is written).
        Exceptions from the executor propagate after every finished record has been fsync'd and a
        report with ``"status": "failed"`` has been written.
    """
    from tqdm import tqdm

    t_start = time.perf_counter()
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        from ..config import ConfigError

        raise ConfigError(f"{job.config_path or job.name}: device: {job.device} asked for, but torch sees no CUDA device "
                          f"(set device: cpu, or --set device=cpu)")
    prep = Prepared(job)
    check_results_provenance(job)  # never mix records of another model / settings into one results file
    if os.path.exists(job.output.report_path) and os.path.exists(job.output.path):
        with ResultsWriter(job.output.path) as w:
            if all(t.id in w.done_ids() for t in prep.treqs):  # nothing to do: keep the last run's report
                with open(job.output.report_path) as f:
                    old = json.load(f)
                print(f"moe-batch: all {len(prep.treqs)} requests of {job.output.path} are done; "
                      f"report of the run that finished them: {job.output.report_path}", file=log)
                return {**old, "nothing_to_do": True}  # the flag is not written: the file stays that run's report
    writer = ResultsWriter(job.output.path)
    done = writer.done_ids()
    todo = [t for t in prep.treqs if t.id not in done]
    skipped = len(prep.treqs) - len(todo)
    report: dict = {
        "job": job.name, "config": job.config_path, "task": job.task, "mode": job.score.mode if job.score else None,
        "model": job.model, "model_path": prep.model_path, "device": job.device, "dtype": job.dtype,
        "executor": job.executor, "shard": list(job.shard) if job.shard else None, "host": platform.node(),
        "requests_in_input": prep.n_input, "requests_in_shard": len(prep.treqs), "skipped_already_done": skipped,
        "results": writer.path, "status": "running",
    }
    errors = [t for t in todo if t.error is not None]
    for t in errors:  # validation failures under on_error: record
        writer.write(error_record(t.id, t.error))
    # batches of similar length: decode attention and the KV cache pad each (micro-)batch to its longest row;
    # records are keyed by id, so the order they are written in does not matter (merge restores input order)
    work = sorted((t for t in todo if t.error is None),
                  key=lambda t: sum(len(q) for q, _ in t.score_inputs) if job.task == "score" else t.prompt_tokens)
    stats = RunStats()
    records_written = len(errors)
    score_records: list[dict] = []
    t_load = 0.0
    executor = None
    try:
        if work:
            frac = apply_gpu_cap(job.device, job.gpu_memory)
            if job.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            weights = load_checkpoint(prep.model_path, DTYPES[job.dtype], prep.spec)
            executor = make_executor(job, prep, weights)
            t_load = time.perf_counter() - t0
            report["gpu_memory_fraction"] = frac
            if hasattr(executor, "policy_summary"):
                report["policy"] = executor.policy_summary()
            est = getattr(executor, "estimate", None)
            if est is not None and job.device.startswith("cuda"):  # on the CPU the GPU-host prediction means nothing
                report["predicted"] = {"prefill_tokens_per_s": est.prefill_tok_s, "decode_tokens_per_s": est.decode_tok_s,
                                       "end_to_end_tokens_per_s": est.e2e_tok_s, "decode_binding": est.decode_binding,
                                       "prefill_binding": est.prefill_binding}
            bar = tqdm(total=len(work), disable=not progress, unit="req", file=log, dynamic_ncols=True)
            t_run = time.perf_counter()
            batch = max(1, getattr(executor, "batch_size", job.batch_size))
            for i in range(0, len(work), batch):
                chunk = work[i : i + batch]
                before = executor.stats.generated_tokens + executor.stats.prefill_tokens
                if job.task == "generate":
                    params = SamplingParams.from_config(job.generation)

                    def on_finish(idx, out_ids, reason, chunk=chunk):
                        writer.write(_gen_record(chunk[idx], out_ids, reason, prep.tokenizer))
                        bar.update(1)

                    executor.generate([t.prompt_ids for t in chunk], params, on_finish=on_finish,
                                      seeds=[request_seed(job.generation.seed, t.id) for t in chunk],
                                      eos_token_id=prep.eos_token_id)
                    records_written += len(chunk)
                else:
                    recs = scoring.score_batch(chunk, job.score.mode, executor.prompt_logprobs,
                                               prep.spec.max_position_embeddings, job.score.stride)
                    for r in recs:
                        writer.write(r)
                    score_records += recs
                    records_written += len(recs)
                    bar.update(len(chunk))
                s = executor.stats
                elapsed = time.perf_counter() - t_run
                tokens = s.generated_tokens if job.task == "generate" else s.prefill_tokens
                bar.set_postfix_str(f"{tokens / max(elapsed, 1e-9):.1f} tok/s")
            bar.close()
            stats = executor.stats
        report["status"] = "done"
    except BaseException as e:
        report["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        writer.close()
        total = time.perf_counter() - t_start
        report.update(_timing(stats, t_load, total, job.task))
        report["records_written_this_run"] = records_written
        report["errors_recorded"] = len(errors)
        report["peak_host_memory_bytes"] = _peak_host_bytes()
        report["peak_gpu_memory_bytes"] = (torch.cuda.max_memory_allocated() if job.device.startswith("cuda")
                                           and torch.cuda.is_available() else None)
        if job.task == "score":
            report["metrics"] = scoring.summarize(score_records, job.score.mode)
        report["stats"] = {k: v for k, v in asdict(stats).items() if k != "extra"}
        report["stages"] = stats.extra
        if executor is not None and hasattr(executor, "close"):
            executor.close()
        write_json_atomic(job.output.report_path, report)
    return report


def _timing(s: RunStats, t_load: float, total: float, task: str) -> dict:
    """Throughput figures (tokens/s) and wall times (s) for the report."""
    busy = s.prefill_seconds + s.decode_seconds
    return {
        "wall_seconds": {"total": total, "load": t_load, "prefill": s.prefill_seconds, "decode": s.decode_seconds},
        "prompt_tokens": s.prefill_tokens, "generated_tokens": s.generated_tokens,
        "prefill_tokens_per_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tokens_per_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
        "end_to_end_tokens_per_s": (s.generated_tokens if task == "generate" else s.prefill_tokens) / busy if busy else None,
    }


def format_report(r: dict) -> str:
    """Human-readable summary of a run report (printed at the end of ``moe-batch run``)."""
    def f(v, unit=""):
        return "-" if v is None else (f"{v:,.1f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    w = r.get("wall_seconds", {})
    lines = [
        f"job {r['job']}: {r['status']}  ({r['task']}{'/' + r['mode'] if r.get('mode') else ''}, {r['model']}, "
        f"{r['device']}, {r['dtype']}, executor {r['executor']})",
        f"  requests: {r['requests_in_shard']} in {'shard' if r.get('shard') else 'input'}, "
        f"{r['skipped_already_done']} already done, {r['records_written_this_run']} written now, "
        f"{r['errors_recorded']} error records",
        f"  tokens: {r.get('prompt_tokens', 0)} prompt, {r.get('generated_tokens', 0)} generated",
        f"  throughput: prefill {f(r.get('prefill_tokens_per_s'))} tok/s, decode {f(r.get('decode_tokens_per_s'))} tok/s, "
        f"end-to-end {f(r.get('end_to_end_tokens_per_s'))} tok/s",
        f"  wall: total {f(w.get('total'), ' s')}, load {f(w.get('load'), ' s')}, prefill {f(w.get('prefill'), ' s')}, "
        f"decode {f(w.get('decode'), ' s')}",
        f"  peak memory: host {r['peak_host_memory_bytes'] / 2**30:.2f} GiB"
        + (f", GPU {r['peak_gpu_memory_bytes'] / 2**30:.2f} GiB" if r.get("peak_gpu_memory_bytes") is not None else ""),
    ]
    if r.get("policy"):
        lines.append(f"  policy: {r['policy']}")
    if r.get("predicted"):
        p = r["predicted"]
        lines.append(f"  predicted (HRM): decode {p['decode_tokens_per_s']:,.1f} tok/s, end-to-end "
                     f"{p['end_to_end_tokens_per_s']:,.1f} tok/s, decode bound by {p['decode_binding']}")
    if r.get("stages"):
        counts = ("_calls", "_threads")  # native_stats counters among the stage seconds (team threads summed over calls)
        lines.append("  stages (s): " + ", ".join(f"{k}={v:.3f}" for k, v in r["stages"].items()
                                                 if isinstance(v, float) and not k.endswith(counts)))
        n = {k: v for k, v in r["stages"].items() if isinstance(v, (int, float)) and k.endswith(counts)}
        if n:
            lines.append("  counts: " + ", ".join(f"{k}={int(v)}" for k, v in n.items()))
    if r.get("metrics"):
        lines.append("  metrics: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items()))
    lines.append(f"  results: {r['results']}")
    return "\n".join(lines)
