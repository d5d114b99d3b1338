"""Run a job end to end: validate and tokenize everything, then generate or score, writing as it goes.

Order of work (so bad input fails fast and finished work is never lost):
1. read the model's config and tokenizer, the requests, and tokenize them (every input error surfaces
   here, before any weight is loaded);
2. open the results file: records already there are skipped (resume), a torn last line is repaired;
3. load the weights, build the executor, run batch after batch; every finished sequence is appended to
   results.jsonl and fsync'd the moment it finishes; every checkpoint interval (``job.checkpoint``) the new tokens of
   the sequences in flight are appended to the partial-generation sidecar (``<stem>.partial.jsonl``), and a re-run
   prefills a sequence with its prompt and partial and continues it;
4. write the run report (JSON, atomically) beside the results and print it; the report lists every run of the job.

SIGTERM / SIGINT during generation: the current decode step finishes, the partials are flushed, the report is written
and :class:`JobStopped` is raised (``moe-batch run`` exits EXIT_STOPPED); outside generation it is raised at once; a
second signal ends the process at once (exit EXIT_INTERRUPTED): the files only ever get whole fsync'd lines appended.
"""

from __future__ import annotations

import json
import os
import datetime
import platform
import resource
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..config import Job
from ..data.shard import select_shard
from ..data.sources import load_requests
from ..data.tokenize import encode_requests, load_tokenizer
from ..data.writer import PartialsFile, ResultsWriter, error_record, write_json_atomic
from ..model.spec import MoESpec
from ..model.tiny import resolve_model_path
from ..model.weights import load_checkpoint
from . import scoring
from .serial import RunStats, SamplingParams, SerialExecutor, request_seed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _peak_host_bytes() -> int:
    """Peak resident set size of this process in bytes (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cuda_index(device: str) -> int:
    """The CUDA device index of ``device`` ("cuda" is the current device, "cuda:N" is N). Raises ValueError for a
    device that is not CUDA."""
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


def apply_gpu_cap(device: str, gpu_memory: Optional[int]) -> Optional[dict]:
    """Make this process's GPU behave like a ``gpu_memory``-byte card: cap the CUDA caching allocator at
    ``gpu_memory`` minus what the device already holds outside it (the CUDA context, other processes), with
    ``torch.cuda.set_per_process_memory_fraction``.

    Returns ``{"cap_bytes", "outside_torch_bytes", "torch_limit_bytes", "fraction", "device_total_bytes"}`` (None
    when no cap or no CUDA). Raises ValueError when the cap exceeds the device's memory or leaves nothing to torch.
    """
    if not gpu_memory or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    idx = cuda_index(device)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(idx)  # creates the context, so "outside" includes it
    if gpu_memory > total:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.1f} GiB exceeds the device's {total / 2**30:.1f} GiB")
    outside = max(0, total - free - torch.cuda.memory_reserved(idx))
    limit = gpu_memory - outside
    if limit <= 0:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.2f} GiB leaves nothing for tensors: "
                         f"{outside / 2**30:.2f} GiB of the device are already in use outside torch's allocator")
    frac = limit / total
    torch.cuda.set_per_process_memory_fraction(frac, idx)
    return {"cap_bytes": gpu_memory, "outside_torch_bytes": outside, "torch_limit_bytes": limit, "fraction": frac,
            "device_total_bytes": total}


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
    """The planner's Workload from a prepared job's real tokenized requests: prompt lengths (generation, ``gen_len`` =
    max_new_tokens) or the lengths of every sequence a scoring job feeds (perplexity windows included; a prefill-only
    scoring workload)."""
    from ..policy.policy import Workload

    job = prep.job
    ok = [t for t in prep.treqs if t.error is None]
    if job.task == "score":
        lens = [n for t in ok for n in scoring.sequence_lengths(t, job.score.mode, prep.spec.max_position_embeddings,
                                                                 job.score.stride)]
        return Workload.from_lengths(lens, 1, name=job.name, scoring=True)
    return Workload.from_lengths([t.prompt_tokens for t in ok], job.generation.max_new_tokens, name=job.name)


def job_workload(job_path: str, overrides: Optional[dict] = None):
    """Workload of a job YAML (with ``--set`` ``overrides``): its requests tokenized exactly as ``moe-batch run`` would
    (no weights loaded)."""
    from ..config import load_job

    return job_workload_from_prepared(Prepared(load_job(job_path, overrides)))


REPORT_EVERY_S = 30.0  # at checkpoints, the report (its runs list) is rewritten at most this often

_DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _named(job, msg: str) -> str:
    path = getattr(job, "config_path", None)
    return f"{path}: {msg}" if path else msg


def policy_for_job(job, prep):
    """The job's Policy: ``policy: auto`` plans with the MILP (generation) or plan_scoring (scoring) for the job's
    real lengths, ``hardware`` (preset or profile; default: the h200 preset) and ``gpu_memory``/``cpu_memory``; a
    path loads a policy YAML; a mapping gives explicit fields (unknown keys are errors naming the job file and key;
    ``prefill_mu`` defaults to ``mu``, the formats to the job's dtype and the checkpoint's expert pages).

    Returns (Policy, Estimate or None). Raises PlanInfeasible / PolicyError / ValueError with one clear line.
    """
    from ..model.quantized import checkpoint_scheme
    from ..policy.hardware import get_preset, resolve_hardware
    from ..policy.milp import plan
    from ..policy.policy import Budgets, Policy, check_cpu_budget, check_gpu_budget

    dt = _DT[job.dtype]
    wq = checkpoint_scheme(prep.model_path) or dt  # a quantized checkpoint's pages move packed
    if isinstance(job.policy, dict):
        fields = dict(job.policy)
        fields.setdefault("dtype", dt)
        fields.setdefault("weight_quant", wq)
        fields.setdefault("prefill_mu", fields.get("mu", 1))
        return Policy.from_dict(fields, where=_named(job, "policy")), None
    if isinstance(job.policy, str) and job.policy != "auto":
        return Policy.load(job.policy), None
    hw = resolve_hardware(job.hardware) if getattr(job, "hardware", None) else get_preset("h200")
    try:  # the job's caps must fit the card and the machine it plans for
        if job.gpu_memory:
            check_gpu_budget(job.gpu_memory, hw)
        if job.cpu_memory:
            check_cpu_budget(job.cpu_memory, hw)
    except ValueError as e:  # name the job file, as the config errors do
        raise ValueError(_named(job, str(e))) from None
    budgets = Budgets.for_hardware(hw, dtype=dt, weight_quant=wq,
                                   **({"gpu_memory": job.gpu_memory} if job.gpu_memory else {}),
                                   **({"cpu_memory": job.cpu_memory} if job.cpu_memory else {}))
    return plan(prep.spec, hw, job_workload_from_prepared(prep), budgets)


@dataclass(frozen=True)
class JobPlan:
    """What a cgopipe job runs with, decided before any weight is read."""

    policy: object  # policy.Policy
    estimate: object  # hrm.Estimate of the policy for the job's workload (throughput and memory)
    gpu_budget: int  # bytes the policy must fit on the GPU (the job's gpu_memory, else the card's)
    cpu_budget: int  # bytes the policy must fit on the host (the job's cpu_memory, else the hardware's)


def plan_job(job: Job, prep: "Prepared") -> JobPlan:
    """The cgopipe job's policy (:func:`policy_for_job`) with its HRM estimate for the job's real workload, checked
    against the GPU and host budgets with the memory model (hrm.memory_estimate: every allocation of every phase).

    Runs before any weight is loaded. Raises PolicyError (one line naming the policy, its predicted peak and phase,
    and the budget) when a policy -- the planner's, a policy file's or an inline mapping's -- does not fit.
    """
    import dataclasses

    from ..policy import hrm
    from ..policy.hardware import get_preset, resolve_hardware
    from ..policy.policy import PolicyError, format_bytes

    policy, est = policy_for_job(job, prep)
    hw = resolve_hardware(job.hardware) if job.hardware else get_preset("h200")
    gpu = job.gpu_memory or policy.gpu_budget or _device_memory(job.device) or hw.gpu_memory
    cpu = job.cpu_memory or policy.cpu_budget or hw.host_memory
    policy = dataclasses.replace(policy, gpu_budget=gpu, cpu_budget=cpu)
    workload = job_workload_from_prepared(prep)
    if job.task == "score" and policy.n_gpu_attn != policy.n:  # scoring keeps no KV: nothing attends on the CPU
        policy = dataclasses.replace(policy, n_gpu_attn=policy.n)
    bad = hrm.memory_violations(policy, prep.spec, workload)
    if bad:
        m = hrm.memory_estimate(policy, prep.spec, workload)
        source = "the planner's policy" if job.policy in (None, "auto") else (
            f"policy file {job.policy}" if isinstance(job.policy, str) else "the inline policy")
        raise PolicyError(_named(job, f"{source} (mu {policy.mu} x n {policy.n}, {policy.total_resident(prep.spec)} "
                                      f"resident experts, {policy.n_gpu_attn} GPU-attention micro-batches) does not fit: "
                                      f"predicted {m.gpu_peak_phase} peak {format_bytes(m.gpu_peak)} vs gpu_memory "
                                      f"{format_bytes(gpu)}, host {format_bytes(m.cpu_peak)} vs cpu_memory "
                                      f"{format_bytes(cpu)} (" + "; ".join(bad) + ")"))
    est = hrm.evaluate(policy, prep.spec, hw, workload) if est is None else est
    return JobPlan(policy, est, gpu, cpu)


def _device_memory(device: str) -> Optional[int]:
    """Total memory of a CUDA ``device`` in bytes (None on the CPU or without CUDA)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(cuda_index(device)).total_memory
    return None


def make_executor(job: Job, prep: Prepared, weights, jplan: Optional[JobPlan] = None):
    """The executor named by ``job.executor``: "cgopipe" with ``jplan``'s policy, or "serial"."""
    dtype = DTYPES[job.dtype]
    if job.executor == "cgopipe":
        from .cgopipe import CGOPipeExecutor, expert_ffn_for

        ex = CGOPipeExecutor(weights, jplan.policy, job.device, dtype, ffn=expert_ffn_for(job))
        ex.estimate = jplan.estimate
        return ex
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
    results (``OutputConfig.meta_path``); partial generations (``OutputConfig.partial_path``) count as results. No
    results yet: save it. Results without a saved one (older versions): save
    it and go on. Raises ConfigError naming both files and every setting that differs (nothing is written then)."""
    from ..config import ConfigError

    meta, now = job.output.meta_path, results_provenance(job)
    has_results = any(os.path.exists(p) and os.path.getsize(p) > 0 for p in (job.output.path, job.output.partial_path))
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


EXIT_STOPPED = 75  # moe-batch run's exit code after a stop signal: records and partials saved, re-run to resume
EXIT_INTERRUPTED = 130  # a second stop signal: the process ended at once


class JobStopped(BaseException):
    """A stop signal (SIGTERM / SIGINT) ended the run: every finished record and the partials of the sequences in
    flight are saved; re-running the job resumes. A BaseException, so ``except Exception`` does not swallow it."""


class StopSignals:
    """SIGTERM and SIGINT handlers for the duration of a run (installed only in the main thread; the previous handlers
    come back on exit).

    The first signal sets :attr:`requested`; while :attr:`deferred` is true (the generation loop, which checks the flag
    after every decode step, or the end of the run) nothing else happens, otherwise :class:`JobStopped` is raised at
    once. A second signal writes one line to stderr and ends the process with EXIT_INTERRUPTED.
    """

    def __init__(self):
        self.requested: Optional[str] = None  # name of the first signal received
        self.deferred = False
        self._old: dict = {}

    def _handle(self, signum, _frame) -> None:
        if self.requested is not None:
            os.write(2, b"moe-batch: second signal: exiting at once; the records and partials written so far are kept "
                        b"(resumable: re-run the same command)\n")
            os._exit(EXIT_INTERRUPTED)
        self.requested = signal.Signals(signum).name
        if not self.deferred:
            raise JobStopped(f"stopped by {self.requested}")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)
        self._old.clear()


class GpuOutOfMemory(RuntimeError):
    """The CUDA allocator ran out of memory despite the plan; ``str(e)`` is one line naming the phase, the policy, the
    predicted and measured peaks and the cap (finished records are saved)."""


class PhasePeaks:
    """Peak GPU memory (allocated and reserved, bytes) per phase of a run: the executor calls :meth:`enter` at each
    phase boundary ("load", "prefill", "decode", "scoring"); a phase seen again keeps its largest peak."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.idx = cuda_index(device) if self.cuda else None
        self.phase: Optional[str] = None
        self.peaks: dict[str, dict[str, int]] = {}

    def enter(self, phase: str) -> None:
        """Close the current phase and start ``phase`` (the allocator's peak counters restart)."""
        self.close()
        self.phase = phase
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.idx)

    def close(self) -> None:
        """Record the current phase's peaks."""
        if self.phase is None or not self.cuda:
            return
        p = self.peaks.setdefault(self.phase, {"allocated": 0, "reserved": 0})
        p["allocated"] = max(p["allocated"], torch.cuda.max_memory_allocated(self.idx))
        p["reserved"] = max(p["reserved"], torch.cuda.max_memory_reserved(self.idx))

    def overall(self, key: str) -> Optional[int]:
        """Largest peak of ``key`` ("allocated" | "reserved") over the phases (None without CUDA)."""
        return max((p[key] for p in self.peaks.values()), default=0) if self.cuda else None


def _memory_report(jplan: Optional[JobPlan], cap: Optional[dict], peaks: PhasePeaks, spec, job: Job) -> dict:
    """The report's ``memory`` block: the cap as applied, the memory model's prediction per phase (allocated: what
    torch.cuda.max_memory_allocated measures; budget: with the allocator reserve) and the measured peaks."""
    out: dict = {"cap_bytes": job.gpu_memory, **({k: v for k, v in cap.items() if k != "cap_bytes"} if cap else {})}
    if jplan is not None:
        m = jplan.estimate.memory
        out.update(predicted_peak_bytes=m.gpu_peak_allocated, predicted_peak_phase=m.gpu_peak_phase,
                   predicted_budget_bytes=m.gpu_peak, gpu_budget_bytes=jplan.gpu_budget,
                   predicted_by_phase={ph: m.phase_allocated(ph) for ph in m.gpu_phases},
                   predicted_components={ph: dict(c) for ph, c in m.gpu_phases.items()},
                   predicted_host_bytes=m.cpu_peak)
    if peaks.cuda:
        out.update(measured_peak_allocated_bytes=peaks.overall("allocated"),
                   measured_peak_reserved_bytes=peaks.overall("reserved"), measured_by_phase=dict(peaks.peaks))
        if jplan is not None and out["measured_peak_allocated_bytes"]:
            out["predicted_over_measured"] = out["predicted_peak_bytes"] / out["measured_peak_allocated_bytes"]
    return out


def _oom_message(phase: Optional[str], jplan: Optional[JobPlan], peaks: PhasePeaks, job: Job, spec, written: int,
                 results: str) -> str:
    from ..policy.policy import format_bytes

    pol = ""
    pred = ""
    if jplan is not None:
        p, m = jplan.policy, jplan.estimate.memory
        pol = f", policy mu {p.mu} x n {p.n}, {p.total_resident(spec)} resident, {p.n_gpu_attn} GPU-attention"
        ph = phase if phase in m.gpu_phases else m.gpu_peak_phase
        pred = f", predicted {ph} peak {format_bytes(m.phase_allocated(ph))}"
    meas = peaks.peaks.get(phase or "", {})
    cap = f", cap {format_bytes(job.gpu_memory)}" if job.gpu_memory else ""
    return (f"out of GPU memory in {phase or 'load'}{pol}{pred}, measured {format_bytes(meas.get('allocated', 0))} "
            f"allocated / {format_bytes(meas.get('reserved', 0))} reserved{cap}; {written} records are saved in "
            f"{results} (re-run to resume, with a smaller policy or gpu_memory; MOE_BATCH_DEBUG=1 for the traceback)")


def _score_batches(work: list, job: Job, prep: "Prepared", N: int) -> list[list]:
    """Consecutive requests grouped so that each group feeds at most ``N`` sequences (a request with more forms a
    group alone): the scoring policy's N counts sequences (choices, perplexity windows), not requests."""
    out, cur, count = [], [], 0
    for t in work:
        n = len(scoring.sequence_lengths(t, job.score.mode, prep.spec.max_position_embeddings, job.score.stride))
        if cur and count + n > N:
            out.append(cur)
            cur, count = [], 0
        cur.append(t)
        count += n
    if cur:
        out.append(cur)
    return out


def _prepare_cpu_attention(job: Job, jplan: Optional[JobPlan], log) -> None:
    """Build (or load) the native CPU attention kernel before any timer starts, when the job's decode attends on the
    CPU."""
    if job.task != "generate" or (jplan is not None and job.device.startswith("cuda")
                                  and jplan.policy.n_gpu_attn >= jplan.policy.n):
        return
    from ..kernels.cpu_attention import native_available, native_loaded

    if not native_loaded():
        print("moe-batch: preparing the native CPU attention kernel (compiled once per torch install, then cached)",
              file=log, flush=True)
    native_available()


def run_job(job: Job, progress: bool = True, log=sys.stderr) -> dict:
    """Run ``job`` to completion (or resume it) and return the run report (also saved as JSON).

    Raises:
        ConfigError / DataError / PolicyError: bad job, input or policy (before any weight is loaded).
        GpuOutOfMemory: the CUDA allocator ran out of memory (one line; every finished record is saved, the report's
            status says so; set MOE_BATCH_DEBUG=1 to get the original exception instead).
        JobStopped: SIGTERM or SIGINT (one line: what is saved; the report's status is "stopped (resumable)").
        Other exceptions from the executor propagate after every finished record has been fsync'd and a
        report with ``"status": "failed: ..."`` has been written.
    """
    from tqdm import tqdm

    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        from ..config import ConfigError

        raise ConfigError(f"{job.config_path or job.name}: device: {job.device} asked for, but torch sees no CUDA device "
                          f"(set device: cpu, or --set device=cpu)")
    prep = Prepared(job)
    if os.path.exists(job.output.report_path) and os.path.exists(job.output.path):
        check_results_provenance(job)  # results exist: compared, nothing written
        with ResultsWriter(job.output.path) as w:
            if all(t.id in w.done_ids() for t in prep.treqs):  # nothing to do: keep the last run's report
                with open(job.output.report_path) as f:
                    old = json.load(f)
                print(f"moe-batch: all {len(prep.treqs)} requests of {job.output.path} are done; "
                      f"report of the run that finished them: {job.output.report_path}", file=log)
                return {**old, "nothing_to_do": True}  # the flag is not written: the file stays that run's report
    # the policy, with its predicted memory for every phase, is checked before anything is written or read
    valid = any(t.error is None for t in prep.treqs)
    jplan = plan_job(job, prep) if (job.executor == "cgopipe" and valid) else None
    if job.executor != "cgopipe" and isinstance(job.policy, (dict, str)) and job.policy != "auto":
        policy_for_job(job, prep)  # the serial executor runs no policy, but a malformed one is still an error
    check_results_provenance(job)  # never mix records of another model / settings into one results file
    with ResultsWriter(job.output.path) as w:
        done = w.done_ids()
    todo = [t for t in prep.treqs if t.id not in done]
    work = sorted((t for t in todo if t.error is None),
                  key=lambda t: sum(len(q) for q, _ in t.score_inputs) if job.task == "score" else t.prompt_tokens)
    writer = ResultsWriter(job.output.path)
    partials_file, partials = None, {}
    if job.task == "generate":  # the sidecar: torn line repaired, partials of ids with a record or not in the input dropped
        partials_file = PartialsFile(job.output.partial_path)
        partials = partials_file.load([t.id for t in work], done)
    prev_runs = _previous_runs(job, bool(done) or bool(partials))
    skipped = len(prep.treqs) - len(todo)
    report: dict = {
        "job": job.name, "config": job.config_path, "task": job.task, "mode": job.score.mode if job.score else None,
        "model": job.model, "model_path": prep.model_path, "device": job.device, "dtype": job.dtype,
        "executor": job.executor, "shard": list(job.shard) if job.shard else None, "host": platform.node(),
        "requests_in_input": prep.n_input, "requests_in_shard": len(prep.treqs), "skipped_already_done": skipped,
        "results": writer.path, "status": "running",
        "partials": {"path": partials_file.path, "resumed_sequences": len(partials),
                     "resumed_tokens": sum(map(len, partials.values()))} if partials_file is not None else None,
    }
    errors = [t for t in todo if t.error is not None]
    for t in errors:  # validation failures under on_error: record
        writer.write(error_record(t.id, t.error))
    # batches of similar length: decode attention and the KV cache pad each (micro-)batch to its longest row;
    # records are keyed by id, so the order they are written in does not matter (merge restores input order)
    stats = RunStats()
    score_records: list[dict] = []
    t_load = 0.0
    executor = None
    peaks = PhasePeaks(job.device)
    cap = None
    stop = StopSignals()

    def run_entry(status: str) -> dict:
        st = executor.stats if executor is not None else stats
        return {"started": started, "wall_seconds": time.perf_counter() - t_start, "prompt_tokens": st.prefill_tokens,
                "generated_tokens": st.generated_tokens, "records_written": writer.written, "status": status}

    def save_progress() -> None:  # at checkpoints: a run killed later still shows in the report's runs
        runs = prev_runs + [run_entry("running")]
        write_json_atomic(job.output.report_path, {**report, "runs": runs,
                                                   "job_totals": _job_totals(runs, len(done) + writer.written)})

    stop.__enter__()
    try:
        if work:
            cap = apply_gpu_cap(job.device, job.gpu_memory)
            _prepare_cpu_attention(job, jplan, log)  # a first-run compile is not timed as load or decode
            peaks.enter("load")
            t0 = time.perf_counter()
            weights = load_checkpoint(prep.model_path, DTYPES[job.dtype], prep.spec)
            executor = make_executor(job, prep, weights, jplan)
            executor.phase_hook = peaks.enter
            t_load = time.perf_counter() - t0
            report["gpu_memory_fraction"] = cap["fraction"] if cap else None
            if hasattr(executor, "policy_summary"):
                report["policy"] = executor.policy_summary()
            est = jplan.estimate if jplan is not None else None
            if est is not None and job.device.startswith("cuda"):  # on the CPU the GPU-host prediction means nothing
                report["predicted"] = {"prefill_tokens_per_s": est.prefill_tok_s, "decode_tokens_per_s": est.decode_tok_s,
                                       "end_to_end_tokens_per_s": est.e2e_tok_s, "decode_binding": est.decode_binding,
                                       "prefill_binding": est.prefill_binding}
            _run_work(job, prep, executor, work, writer, score_records, progress, log, tqdm, partials=partials,
                      partials_file=partials_file, stop=stop, on_checkpoint=save_progress)
            stats = executor.stats
        report["status"] = "done"
        if partials_file is not None:  # every sequence has its record: the partials are obsolete
            partials_file.remove()
    except torch.OutOfMemoryError:
        peaks.close()
        phase = getattr(executor, "phase", None) or peaks.phase
        report["status"] = f"out of memory in {phase}"
        msg = _oom_message(phase, jplan, peaks, job, prep.spec, writer.written, writer.path)
        report["error"] = msg
        if os.environ.get("MOE_BATCH_DEBUG"):
            raise
        raise GpuOutOfMemory(msg) from None
    except JobStopped:
        report["status"] = "stopped (resumable)"
        left = len(read_partials_ids(job.output.partial_path))
        raise JobStopped(f"stopped by {stop.requested}: {writer.written} records written by this run "
                         f"({len(done) + writer.written} of {len(prep.treqs)} in {writer.path}), the partial generations "
                         f"of {left} sequences in {job.output.partial_path}; resumable: re-run the same command to "
                         f"continue") from None
    except BaseException as e:
        report["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        stop.deferred = True  # a signal now only marks the stop: the report below is written whole
        stats = executor.stats if executor is not None else stats
        peaks.close()
        writer.close()
        if partials_file is not None:
            partials_file.close()
        total = time.perf_counter() - t_start
        report.update(_timing(stats, t_load, total, job.task))
        report["records_written_this_run"] = writer.written
        report["errors_recorded"] = len(errors)
        report["peak_host_memory_bytes"] = _peak_host_bytes()
        report["peak_gpu_memory_bytes"] = peaks.overall("allocated")
        report["memory"] = _memory_report(jplan, cap, peaks, prep.spec, job)
        if job.task == "score":
            report["metrics"] = scoring.summarize(score_records, job.score.mode)
        report["stats"] = {k: v for k, v in asdict(stats).items() if k != "extra"}
        report["stages"] = stats.extra
        if executor is not None and hasattr(executor, "close"):
            executor.close()
        try:
            report["runs"] = prev_runs + [run_entry(report["status"])]
            report["job_totals"] = _job_totals(report["runs"], len(done) + writer.written)
            write_json_atomic(job.output.report_path, report)
        finally:
            stop.__exit__(None, None, None)
    return report


def read_partials_ids(path: str) -> set:
    """Ids with a partial generation in the sidecar ``path`` (none when it is missing)."""
    from ..data.writer import read_partials

    return set(read_partials(path))


def _previous_runs(job: Job, resumed: bool) -> list[dict]:
    """The runs list of the job's earlier runs, from the report beside the results, when this run continues their work
    (``resumed``: records or partials are there); a run still marked "running" ended without its final report
    (killed): it is marked "killed". A report without a runs list gives one entry from its totals."""
    if not resumed or not os.path.exists(job.output.report_path):
        return []
    try:
        with open(job.output.report_path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict):
        return []
    runs = old.get("runs")
    if not isinstance(runs, list):
        w = old.get("wall_seconds") or {}
        runs = [{"started": None, "wall_seconds": w.get("total"), "prompt_tokens": old.get("prompt_tokens"),
                 "generated_tokens": old.get("generated_tokens"),
                 "records_written": old.get("records_written_this_run"), "status": old.get("status")}]
    return [dict(r, status="killed") if r.get("status") == "running" else dict(r) for r in runs if isinstance(r, dict)]


def _job_totals(runs: list[dict], records: int) -> dict:
    """Sums over a job's runs: how many, wall seconds, prompt (prefilled) and generated tokens; records in the file."""
    def total(k):
        return sum(r.get(k) or 0 for r in runs)

    return {"runs": len(runs), "wall_seconds": total("wall_seconds"), "prompt_tokens": total("prompt_tokens"),
            "generated_tokens": total("generated_tokens"), "records": records}


def _run_work(job: Job, prep: "Prepared", executor, work: list, writer, score_records: list, progress: bool, log,
              tqdm, partials: Optional[dict] = None, partials_file: Optional[PartialsFile] = None,
              stop: Optional[StopSignals] = None, on_checkpoint=None) -> int:
    """Generate or score ``work`` batch by batch, writing every record as it finishes; returns records written.

    Generation resumes the sequences of ``partials`` (id -> tokens generated by earlier runs: prefilled with the prompt;
    a complete one is written at once) and appends the new tokens of every sequence in flight to ``partials_file`` at
    each checkpoint (``job.checkpoint``; the write time goes to the executor's stage ``checkpoint_write_s``), calling
    ``on_checkpoint()`` at most every REPORT_EVERY_S. A stop request (``stop.requested``) is served after the decode
    step it arrives in: the partials are flushed and JobStopped raised.

    The progress bar counts generated tokens (advancing every decode step, live tokens/s) or scored requests."""
    t_run = time.perf_counter()
    written = 0
    partials = partials or {}
    if job.task == "generate":
        G = job.generation.max_new_tokens
        params = SamplingParams.from_config(job.generation)
        eos = prep.eos_token_id
        ck = job.checkpoint
        if stop is not None:
            stop.deferred = True  # served after the current decode step (on_tokens below)

        def ends(p: list) -> bool:
            return params.stop_at_eos and eos is not None and bool(p) and p[-1] == eos

        rest = []
        for t in work:  # a partial that is already complete (killed before its record was written) needs no model
            p = partials.get(t.id, [])
            if p and (len(p) >= G or ends(p)):
                writer.write(_gen_record(t, p[:G], "stop" if ends(p[:G]) else "length", prep.tokenizer))
                written += 1
            else:
                rest.append(t)
        bar = tqdm(total=sum(G - len(partials.get(t.id, [])) for t in rest), disable=not progress, unit="tok", file=log,
                   dynamic_ncols=True)
        done = [0]
        stages = executor.stats.extra
        clock = {"steps": 0, "last": time.perf_counter(), "report": None}

        def on_step(tokens: int) -> None:
            bar.update(tokens)
            bar.set_postfix_str(f"{done[0]}/{len(rest)} records, "
                                f"{bar.n / max(time.perf_counter() - t_run, 1e-9):.1f} tok/s", refresh=False)

        batch = max(1, getattr(executor, "batch_size", job.batch_size))
        for chunk in _generation_batches(rest, partials, batch):
            outs = [list(partials.get(t.id, [])) for t in chunk]  # every row's output so far
            saved = [len(o) for o in outs]  # how much of it the sidecar holds
            finished = [False] * len(chunk)

            def on_finish(idx, out_ids, reason, chunk=chunk, finished=finished):
                writer.write(_gen_record(chunk[idx], out_ids, reason, prep.tokenizer))
                finished[idx] = True
                done[0] += 1
                if len(out_ids) < G:  # stopped early: its remaining tokens will never come
                    bar.total -= G - len(out_ids)

            def on_tokens(rows, toks, chunk=chunk, outs=outs, saved=saved, finished=finished):
                for r, t in zip(rows, toks):
                    if not finished[r]:
                        outs[r].append(t)
                clock["steps"] += 1
                now = time.perf_counter()
                stopping = stop is not None and stop.requested is not None
                due = stopping or (ck.every_steps is not None and clock["steps"] >= ck.every_steps) or (
                    ck.every_seconds is not None and now - clock["last"] >= ck.every_seconds)
                if due and ck.enabled and partials_file is not None:
                    lines = [(chunk[i].id, saved[i], outs[i][saved[i]:]) for i in range(len(chunk))
                             if not finished[i] and len(outs[i]) > saved[i]]
                    nbytes = partials_file.append(lines)
                    for i in range(len(chunk)):
                        saved[i] = len(outs[i])
                    stages["checkpoint_write_s"] = stages.get("checkpoint_write_s", 0.0) + time.perf_counter() - now
                    stages["checkpoint_write_calls"] = stages.get("checkpoint_write_calls", 0) + 1
                    stages["checkpoint_bytes"] = stages.get("checkpoint_bytes", 0) + nbytes
                    clock["steps"], clock["last"] = 0, time.perf_counter()
                    if on_checkpoint is not None and (clock["report"] is None or now - clock["report"] >= REPORT_EVERY_S):
                        clock["report"] = now
                        on_checkpoint()
                if stopping:
                    raise JobStopped(f"stopped by {stop.requested}")

            pre = [partials.get(t.id, []) for t in chunk]
            executor.generate([t.prompt_ids for t in chunk], params, on_finish=on_finish,
                              seeds=[request_seed(job.generation.seed, t.id) for t in chunk],
                              eos_token_id=eos, on_step=on_step, prefixes=pre if any(pre) else None,
                              on_tokens=on_tokens)
            written += len(chunk)
        bar.close()
        return written
    bar = tqdm(total=len(work), disable=not progress, unit="req", file=log, dynamic_ncols=True)
    policy = getattr(executor, "policy", None)
    groups = (_score_batches(work, job, prep, policy.N) if policy is not None else
              [work[i : i + job.batch_size] for i in range(0, len(work), job.batch_size)])
    for chunk in groups:
        recs = scoring.score_batch(chunk, job.score.mode, executor.prompt_logprobs,
                                   prep.spec.max_position_embeddings, job.score.stride)
        for r in recs:
            writer.write(r)
        score_records += recs
        written += len(recs)
        bar.update(len(chunk))
        bar.set_postfix_str(f"{executor.stats.prefill_tokens / max(time.perf_counter() - t_run, 1e-9):.1f} tok/s")
    bar.close()
    return written


def _generation_batches(work: list, partials: dict, batch: int) -> list[list]:
    """Batches of at most ``batch`` requests, each of one partial length (resumed sequences first, the longest partial
    first; then the fresh ones), keeping ``work``'s order (by prompt length) within: a cgopipe batch decodes until its
    longest remaining row is done, so equal partial lengths keep every row's KV at prompt + max_new_tokens."""
    groups: dict[int, list] = {}
    for t in work:
        groups.setdefault(len(partials.get(t.id, [])), []).append(t)
    return [g[i : i + batch] for n in sorted(groups, reverse=True) for g in [groups[n]] for i in range(0, len(g), batch)]


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
