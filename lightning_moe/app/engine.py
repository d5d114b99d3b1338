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

The Python API (``lightning_moe.api``) runs through the same parts, without files: :class:`Prepared` (tokenizer and
requests), :func:`plan_for_job` (the policy), :class:`ModelRunner` (the weights, read once, and the executor),
:func:`work_order` and the batch loop :func:`_run_work`, its records collected by :class:`RecordCollector`
(:func:`run_in_memory`); :func:`run_job` adds resume, checkpoints, signals and the report around them, in named
stages over one :class:`JobRun`: ``_prepare`` (1) -> ``_plan`` -> ``_resume`` (2) -> ``_load`` -> ``_loop`` (3) ->
``_report`` (4). Checkpoints and progress: app.checkpointing; the report's parts: app.report.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from ..config import ConfigError, Job, recorded
from ..data.stops import StopWatch, cut_at_stop
from ..data.writer import PartialsFile, ResultsWriter, error_record, read_partials, write_json_atomic
from ..kernels.cpu_attention import cpu_attention_mode, native_available, native_built, native_loaded
from ..kernels.prefill_attention import prefill_attention_mode
from ..model.quantized import checkpoint_expert_scheme
from ..model.spec import MoESpec
from ..model.tiny import resolve_model_path
from ..model.weights import load_checkpoint
from ..pipeline import scoring
from ..pipeline.executor import RunStats
from ..pipeline.sampling import DecodeSampling, finish_reason, request_seed
from ..pipeline.serial import SerialExecutor
from ..policy.policy import PolicyError
from .checkpointing import InFlight, PartialCheckpoints, RunProgress
from .expert_parallel import NoWriter, group_info, in_group, run_expert_parallel, share_work
from .gpu import PhasePeaks, apply_gpu_cap, use_device
from .cpu_plan import cpu_predicted_report
from .plan import (JobPlan, ModelFiles, Prepared, check_gpu_cap, check_plan, cpu_prediction, fit_plan_to_cap,
                   job_workload_from_prepared, plan_job, policy_for_job)
from .report import (end_of_run, oom_message, predicted_report, previous_runs, reconcile_killed_runs, refill_report,
                     report_head, slot_occupancy)

# pipeline.cgopipe, .expert_parallel and .expert_ffn are imported where used: a serial job (and `moe-batch --help`)
# does not load the pipelined executor's and the grouped kernels' modules

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KEEP_POLICY_SPEED = 0.9  # ModelRunner keeps its cgopipe executor for a job whose plan differs while the executor's
#   policy fits and is predicted at >= this fraction of the planner's end-to-end tokens/s for that job


LOUD_LOAD_BYTES = 2**30  # checkpoints at least this large get a line before and after their read
PROGRESS_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]"  # a generate job's
#   bar: tokens generated of the job's total, and (postfix) records written and the run's average tokens/s


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's ``*.safetensors`` files (their apparent sizes)."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return 0
    return sum(os.path.getsize(os.path.join(model_dir, n)) for n in names if n.endswith(".safetensors"))


def _expert_scheme(prep) -> Optional[str]:
    """The checkpoint's packed expert scheme ("mxfp4" for gpt-oss's MXFP4, which the loader keeps packed for a
    single-process executor; model.quantized.checkpoint_expert_scheme), None for dense experts or no directory."""
    path = getattr(prep, "model_path", None)
    return checkpoint_expert_scheme(path) if path else None


def make_executor(job: Job, prep: Prepared, weights, jplan: Optional[JobPlan] = None):
    """The executor named by ``job.executor``: "cgopipe" with ``jplan``'s policy, or "serial"."""
    dtype = DTYPES[job.dtype]
    if job.executor == "cgopipe":
        from ..pipeline.cgopipe import CGOPipeExecutor, expert_ffn_for

        ex = CGOPipeExecutor(weights, jplan.policy, job.device, dtype,  # the profile the job planned with
                             ffn=expert_ffn_for(job, prep.spec, _expert_scheme(prep)), hardware=jplan.hardware)
        ex.estimate = jplan.estimate
        return ex
    if job.gpus > 1:  # one process of the expert-parallel group (app.expert_parallel started it)
        from ..pipeline.expert_parallel import ExpertParallelExecutor

        rank, world = group_info()
        return ExpertParallelExecutor(weights, rank, world, device=job.device, dtype=dtype)
    return SerialExecutor(weights, job.device, dtype)


def check_kernel_env(label: str) -> None:
    """ConfigError starting with ``label`` when an environment variable that picks a kernel
    (``LIGHTNING_MOE_PREFILL_ATTENTION``, ``LIGHTNING_MOE_CPU_ATTENTION``) holds a value the kernel does not know:
    the one place both are checked, before anything is written (a fresh run and a re-run of a finished job alike)."""
    for mode in (prefill_attention_mode, cpu_attention_mode):
        try:
            mode()
        except ValueError as e:
            raise ConfigError(f"{label}: {e}") from None


def check_device(job: Job) -> None:
    """ConfigError when ``job.device`` is CUDA and torch sees no CUDA device, or when an environment variable that
    picks a kernel holds a value the kernel does not know (:func:`check_kernel_env`): before anything is written."""
    check_kernel_env(job.label)
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{job.label}: device: {job.device} asked for, but torch sees no CUDA device "
                          f"(set device: cpu, or --set device=cpu)")
    index = torch.device(job.device).index if job.device.startswith("cuda") else None
    count = torch.cuda.device_count() if index is not None else 0
    if index is not None and index >= count:
        raise ConfigError(f"{job.label}: device: {job.device} asked for, but torch sees {count} CUDA device(s): "
                          f"cuda:0 to cuda:{count - 1}")


def check_expert_parallel(job: Job) -> None:
    """ConfigError naming the job's ``gpus`` when expert parallelism cannot run its model's family (read from the
    checkpoint's config.json only: before any process is started or weight read)."""
    if job.gpus <= 1:
        return
    from ..pipeline.expert_parallel import expert_parallel_refusal

    why = expert_parallel_refusal(MoESpec.from_pretrained_dir(resolve_model_path(job.model)))
    if why is not None:
        raise ConfigError(f"{job.label}: gpus: {job.gpus}: {why} (set gpus: 1)")


def plan_for_job(job: Job, prep: Prepared) -> Optional[JobPlan]:
    """The plan a run executes with, before any weight is read: a cgopipe job's :func:`plan_job` (None when no request
    is valid); None for the serial executor, which runs no policy -- though a malformed one is still an error."""
    if job.executor == "cgopipe":
        from ..pipeline.cgopipe import cgopipe_refusal

        why = cgopipe_refusal(prep.spec)
    else:
        why = None
    if why is not None:
        raise ConfigError(f"{job.config_path or job.name}: executor: cgopipe: {prep.spec.name}: {why}; set "
                          f"executor: serial")
    valid = any(t.error is None for t in prep.treqs)
    jplan = plan_job(job, prep) if (job.executor == "cgopipe" and valid) else None
    if job.executor == "cgopipe" and getattr(job, "expert_ffn", "torch") in ("triton", "grouped_mm", "mm_loop"):
        from ..pipeline.expert_ffn import grouped_kernels_refusal

        # auto picks torch for such a model (expert_ffn_for); MXFP4 pages kept packed: the MXFP4 kernel
        why = grouped_kernels_refusal(prep.spec, job.expert_ffn, _expert_scheme(prep))
        if why is not None:
            raise ConfigError(f"{job.config_path or job.name}: executor: cgopipe: {prep.spec.name}: expert_ffn "
                              f"{job.expert_ffn}: {why}")
    if job.executor != "cgopipe" and isinstance(job.policy, (dict, str)) and job.policy != "auto":
        policy_for_job(job, prep)  # the serial executor runs no policy, but a malformed one is still an error
    return jplan


def work_order(job: Job, treqs: list) -> list:
    """The valid requests of ``treqs`` in the order the batch loop takes them: by prompt length (scoring: by the
    tokens of all its sequences), so each batch holds similar lengths (decode attention and the KV cache pad each
    (micro-)batch to its longest row); records are keyed by id, so the order they come out in does not matter."""
    return sorted((t for t in treqs if t.error is None),
                  key=lambda t: sum(len(q) for q, _ in t.score_inputs) if job.task == "score" else t.prompt_tokens)


class ModelRunner:
    """A model's weights and the executor that runs them, for one run (:func:`run_job`) or many (the Python API).

    The weights are read on first need (:meth:`load_weights`; :attr:`weight_loads` counts the reads). :meth:`executor`
    builds the job's executor and keeps it: a later job with the same executor settings reuses it -- a cgopipe one
    also when its policy differs from the later plan's but fits that job's workload (:func:`check_plan`) and is
    predicted at KEEP_POLICY_SPEED or more of the plan's end-to-end tokens/s. A cgopipe executor takes the host copies
    of the experts into its page pool, so replacing it reads the weights again.
    """

    def __init__(self, files: ModelFiles, dtype: str, log=None):
        self.files = files
        self.dtype = dtype
        self.log = log  # where its messages go (None: sys.stderr at the time)
        self.weight_loads = 0  # checkpoint reads so far
        self._weights = None  # host weights not yet given to a cgopipe executor
        self._weights_lazy = False  # whether _weights left the routed experts in the files (ExpertsOnDisk)
        self._weights_packed = True  # whether _weights kept a family's packed experts packed (gpt-oss MXFP4)
        self._executor = None
        self._key: Optional[tuple] = None  # (executor, device, expert FFN) of the executor held

    def load_weights(self, lazy_experts: bool = False, packed_experts: bool = True):
        """The host weights, read from the checkpoint unless already held. ``lazy_experts``: the routed experts stay
        in the files (``ExpertsOnDisk``) for an executor that reads them layer by layer (CGOPipe's page pool); held
        lazy weights are read again in full for a caller that needs the experts in memory. ``packed_experts``: experts
        a family stores packed (gpt-oss's MXFP4) stay packed (the serial and CGOPipe executors compute MXFP4 pages;
        the expert-parallel executor, which cuts no packed pages, reads them dequantized); held weights of the other
        kind are read again."""
        if self._weights is not None and ((self._weights_lazy and not lazy_experts)
                                          or self._weights_packed != packed_experts):
            self._weights = None
        if self._weights is None:
            if self.weight_loads:
                print(f"moe-batch: reading the weights of {self.files.model_path} again (the previous executor's page "
                      f"pool held them)", file=self.log or sys.stderr, flush=True)
            size = checkpoint_bytes(self.files.model_path)
            loud = size >= LOUD_LOAD_BYTES  # a large read takes minutes: say so before and after
            if loud:
                what = (f"the non-expert weights of {self.files.model_path} ({size / 2**30:.1f} GiB in all; the "
                        f"experts are read a layer at a time as the page pool fills)" if lazy_experts else
                        f"{size / 2**30:.1f} GiB of weights from {self.files.model_path}")
                print(f"moe-batch: reading {what}", file=self.log or sys.stderr, flush=True)
            t0 = time.perf_counter()
            self._weights = load_checkpoint(self.files.model_path, DTYPES[self.dtype], self.files.spec,
                                            lazy_experts=lazy_experts, packed_experts=packed_experts)
            self._weights_lazy = lazy_experts
            self._weights_packed = packed_experts
            self.weight_loads += 1
            if loud:
                print(f"moe-batch: {'non-expert ' if lazy_experts else ''}weights read in {time.perf_counter() - t0:.1f} s", file=self.log or sys.stderr,
                      flush=True)
        return self._weights

    def executor(self, job: Job, prep: Prepared, jplan: Optional[JobPlan], cap: Optional[dict] = None):
        """The executor for ``job`` (:func:`make_executor` with ``jplan``'s policy), reused when the one held fits
        (the job's budgets, and what the job's GPU ``cap`` leaves torch: app.plan.check_gpu_cap); its stats start
        from zero for each job."""
        if job.dtype != self.dtype:
            raise ValueError(f"ModelRunner: job dtype {job.dtype} differs from the runner's {self.dtype}")
        key = (job.executor, job.device, None)
        if job.executor == "cgopipe":
            from ..pipeline.cgopipe import expert_ffn_for

            key = (job.executor, job.device, expert_ffn_for(job, prep.spec, _expert_scheme(prep)))
        ex = self._executor
        if ex is not None and key == self._key:
            if jplan is None or ex.policy == jplan.policy:
                ex.stats = RunStats()
                return ex
            try:  # the held policy, for this job's workload (budgets as the job's), on the profile it planned with
                kept = check_plan(job, prep, ex.policy, hw=jplan.hardware)
                check_gpu_cap(job, kept, cap)  # its reserve may be smaller than this process's context
            except PolicyError:
                kept = None
            if kept is not None and kept.estimate.e2e_tok_s >= KEEP_POLICY_SPEED * jplan.estimate.e2e_tok_s:
                ex.estimate = kept.estimate
                ex.stats = RunStats()
                return ex
            p = ex.policy
            print(f"moe-batch: the executor's policy (mu {p.mu} x n {p.n}) "
                  + ("does not fit" if kept is None else "is predicted slower than the planner's")
                  + f" for this workload: rebuilding with the planner's (mu {jplan.policy.mu} x n {jplan.policy.n})",
                  file=self.log or sys.stderr, flush=True)
        ex = None  # the old executor's GPU tensors go before the new one's are made
        self.close()
        # cgopipe's pool and each expert-parallel process take the experts a layer at a time from the files
        weights = self.load_weights(lazy_experts=job.executor == "cgopipe" or job.gpus > 1, packed_experts=job.gpus <= 1)
        pool = jplan.estimate.memory.cpu.get("pinned experts (not resident)", 0) if jplan is not None else 0
        if pool >= LOUD_LOAD_BYTES:
            print(f"moe-batch: copying {pool / 2**30:.1f} GiB of experts into the pinned page pool and "
                  f"{jplan.policy.total_resident(prep.spec)} resident experts to {job.device}",
                  file=self.log or sys.stderr, flush=True)
        t0 = time.perf_counter()
        ex = make_executor(job, prep, weights, jplan)
        if pool >= LOUD_LOAD_BYTES:
            print(f"moe-batch: executor ready in {time.perf_counter() - t0:.1f} s", file=self.log or sys.stderr,
                  flush=True)
        if job.executor == "cgopipe":
            self._weights = None  # its page pool holds the experts now (the host copies are released)
        self._executor, self._key = ex, key
        return ex

    def close(self) -> None:
        """Close the executor held (its worker thread, pinned pool); the weights stay if still held."""
        ex, self._executor, self._key = self._executor, None, None
        if ex is not None and hasattr(ex, "close"):
            ex.close()


class RecordCollector:
    """The batch loop's writer when the records stay in memory (the Python API): :meth:`write` keeps each record."""

    def __init__(self):
        self.records: list[dict] = []
        self.written = 0

    def write(self, record: dict) -> None:
        """Keep ``record``."""
        self.records.append(record)
        self.written += 1


def run_in_memory(job: Job, prep: Prepared, runner: ModelRunner, jplan: Optional[JobPlan], progress: bool = False,
                  log=None, cap: Optional[dict] = None) -> list[dict]:
    """Run the tokenized requests of ``prep`` (none with an error) through ``runner``'s executor and the batch loop,
    and return their records -- the ones :func:`run_job` writes for the same requests -- in ``prep.treqs`` order.
    Nothing is written to disk and no signal handler is installed (the Python API's run). ``cap``: the GPU cap the
    caller applied (app.gpu.apply_gpu_cap's result): the plan is fitted to it first (:func:`fit_plan_to_cap`, as
    :func:`run_job`'s load does)."""
    log = log or sys.stderr
    work = work_order(job, prep.treqs)
    sink = RecordCollector()
    if work:
        jplan = fit_plan_to_cap(job, prep, jplan, cap, log)
        _prepare_cpu_attention(job, jplan, log)
        executor = runner.executor(job, prep, jplan, cap)
        _run_work(job, prep, executor, work, sink, [], progress, log, tqdm)
    order = {t.id: i for i, t in enumerate(prep.treqs)}
    return sorted(sink.records, key=lambda r: order[r["id"]])


def _gen_record(tr, out_ids: list[int], reason: str, tokenizer, stops: Sequence[str] = (),
                lps: Optional[list] = None, k: Optional[int] = None) -> dict:
    """A generation record; with stop strings the text is cut before the earliest one and the reason is "stop".
    ``lps``: one log-prob entry (``[logprob, top]``, pipeline.sampling.token_logprobs) per output token, written as
    ``logprobs`` (the chosen tokens') and, with ``k >= 1``, ``top_logprobs`` (per token its k best ``[id, logprob]``)."""
    text = tokenizer.decode(out_ids, skip_special_tokens=True)
    if stops:
        text, found = cut_at_stop(text, stops)
        reason = "stop" if found else reason
    rec = {"id": tr.id, "prompt_tokens": tr.prompt_tokens, "text": text, "output_ids": out_ids,
           "output_tokens": len(out_ids), "finish_reason": reason}
    if lps is not None:
        rec["logprobs"] = [e[0] for e in lps]
        if k:
            rec["top_logprobs"] = [[list(p) for p in e[1]] for e in lps]
    if tr.truncated:
        rec["truncated_tokens"] = tr.truncated
    return rec


def results_provenance(job: Job) -> dict:
    """What the records of ``job.output.path`` depend on: the model (as the job names it), dtype, task, the decoding
    (generate) or scoring settings, and how prompts are formatted. Device, executor, batch size and policy are left
    out: they change speed, not what a record means."""
    gen = None
    if job.task == "generate":  # as JSON holds it (lists); a when_set field (config.job_field) only when set, so
        #   older results still match
        gen = recorded(json.loads(json.dumps(asdict(job.generation))))
    return {"model": job.model, "dtype": job.dtype, "task": job.task, "generation": gen,
            "score": asdict(job.score) if job.score is not None else None,
            "chat_template": job.data.chat_template, "system_prompt": job.data.system_prompt,
            "truncate": job.data.truncate,
            # only when set, so results written before the key existed still match
            **({"chat_template_kwargs": job.data.chat_template_kwargs} if job.data.chat_template_kwargs else {})}


def check_results_provenance(job: Job) -> None:
    """Before a run appends to ``job.output.path``: compare :func:`results_provenance` with the one saved beside the
    results (``OutputConfig.meta_path``); partial generations (``OutputConfig.partial_path``) count as results. No
    results yet: save it. Results without a saved one (older versions): save
    it and go on. Raises ConfigError naming both files and every setting that differs (nothing is written then)."""
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
            raise ConfigError(f"{job.label}: {job.output.path} holds records of different settings "
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
    if not native_loaded() and cpu_attention_mode() != "sdpa" and not native_built():
        print("moe-batch: compiling the native CPU attention kernel (once per torch install and CPU, ~20-60 s)",
              file=log, flush=True)
    native_available()


@dataclass
class JobRun:
    """One :func:`run_job` call's state, filled in stage by stage (prepare, plan, resume, load, loop, report)."""

    job: Job
    log: object  # where messages go
    t_start: float = field(default_factory=time.perf_counter)  # the run's start (perf_counter)
    started: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"))  # the run's start (UTC, ISO)
    t_setup: float = 0.0  # one-time setup: the embedded model's creation on first use, the native kernel's build or load
    t_load: float = 0.0  # the weights read and the executor built
    parts: dict = field(default_factory=dict)  # report.other_parts' pieces of wall_seconds.other (s)
    prep: Optional[Prepared] = None  # the tokenized requests
    jplan: Optional[JobPlan] = None  # plan_for_job's plan (None: serial, or no valid request)
    cpu_est: object = None  # on the CPU: the CPU executor's roofline estimate (app.plan.cpu_prediction), else None
    done: set = field(default_factory=set)  # ids with a record when the run started
    todo: list = field(default_factory=list)  # the requests without one (errors included)
    work: list = field(default_factory=list)  # the valid ones in work_order
    writer: Optional[ResultsWriter] = None  # the results file, appended to
    partials_file: Optional[PartialsFile] = None  # the partial-generation sidecar (generate)
    partials: dict = field(default_factory=dict)  # id -> tokens generated by earlier runs
    report: dict = field(default_factory=dict)  # the run report as it stands
    progress: Optional[RunProgress] = None  # this run's entry of the report's runs list
    errors: list = field(default_factory=list)  # requests recorded as errors (on_error: record)
    score_records: list = field(default_factory=list)  # scoring records, for the report's metrics
    runner: Optional[ModelRunner] = None  # the weights and the executor
    own_runner: bool = False  # whether this run made the runner (and closes it)
    executor: object = None  # the runner's executor, once built
    stats: RunStats = field(default_factory=RunStats)  # the executor's counters (zero before one is built)
    peaks: Optional[PhasePeaks] = None  # memory peaks per phase
    cap: Optional[dict] = None  # apply_gpu_cap's result
    stop: StopSignals = field(default_factory=StopSignals)  # the run's SIGTERM / SIGINT handling

    def current_stats(self) -> RunStats:
        """The executor's counters so far (zeros before it is built)."""
        return self.executor.stats if self.executor is not None else self.stats


def run_job(job: Job, progress: bool = True, log=None, runner: Optional[ModelRunner] = None,
            spans: Optional[list] = None) -> dict:
    """Run ``job`` to completion (or resume it) and return the run report (also saved as JSON).

    ``log``: where its messages go (None: ``sys.stderr`` at the time of the call).

    ``spans``: a list to receive the run's measured stage timeline (``moe-batch run --timeline``): the cgopipe
    executor's intervals per lane and phase (:meth:`pipeline.stage_stats.StageTimer.take_spans`), appended when the
    run ends (also after a stop or a failure). Recorded only when given; a serial job is refused (ConfigError,
    before anything is read).

    ``runner``: a :class:`ModelRunner` of the job's model and dtype that outlives this run (``moe-batch run-batch``
    runs one job per group of sampling settings through one): its tokenizer and weights are reused and its executor
    is kept, not closed, at the end. Default: a runner of this run alone.

    Raises:
        ConfigError / DataError / PolicyError: bad job, input or policy (before any weight is loaded).
        GpuOutOfMemory: the CUDA allocator ran out of memory (one line; every finished record is saved, the report's
            status says so; set MOE_BATCH_DEBUG=1 to get the original exception instead).
        JobStopped: SIGTERM or SIGINT (one line: what is saved; the report's status is "stopped (resumable)").
        Other exceptions from the executor propagate after every finished record has been fsync'd and a
        report with ``"status": "failed: ..."`` has been written.
    """
    log = log if log is not None else sys.stderr
    if job.ray is not None:
        raise ConfigError(f"{job.label}: ray: a job with a ray section runs its shards on Ray (moe-batch run, "
                          f"app.ray_jobs.run_ray_job), not in this process")
    if job.gpus > 1 and not in_group():  # start the expert-parallel processes; process 0 comes back here
        check_device(job)
        check_expert_parallel(job)
        return run_expert_parallel(job, run_job, follow_job, progress, log)
    run = _prepare(job, runner, spans, log)
    _plan(run)  # before the finished-job check: a re-run of a finished job checks the policy too
    finished = _finished_report(run)
    if finished is not None:
        return finished
    _resume(run, runner)
    run.stop.__enter__()
    try:
        if run.work:
            _load(run, spans)
            _loop(run, progress)
        run.report["status"] = "done"
        if run.partials_file is not None:  # every sequence has its record: the partials are obsolete
            run.partials_file.remove()
    except torch.OutOfMemoryError:
        msg = _out_of_memory(run)
        if os.environ.get("MOE_BATCH_DEBUG"):
            raise
        raise GpuOutOfMemory(msg) from None
    except JobStopped:
        raise _stopped(run) from None
    except BaseException as e:
        run.report["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        _report(run, spans)
    return run.report


def _prepare(job: Job, runner: Optional[ModelRunner], spans: Optional[list], log) -> JobRun:
    """Stage prepare: the device and kernel settings checked, the model's config and tokenizer read, the requests
    read and tokenized -- every input error surfaces here, before any weight is read and any file is written."""
    run = JobRun(job, log)
    check_device(job)
    if runner is None:
        t = time.perf_counter()
        resolve_model_path(job.model)  # creates tiny-mixtral on first use (instant otherwise)
        run.t_setup += time.perf_counter() - t
    if spans is not None and job.executor != "cgopipe":
        raise ConfigError(f"{job.label}: executor: the timeline draws the cgopipe executor's stages; this job runs "
                          f"executor: {job.executor} (--set executor=cgopipe)")
    t = time.perf_counter()
    run.prep = Prepared(job, files=runner.files if runner is not None else None)
    t_read = time.perf_counter() - t  # what wall_seconds.other holds (report: other_seconds)
    run.parts = {"model_files": run.prep.model_files_seconds,
                 "requests": max(0.0, t_read - run.prep.model_files_seconds)}
    return run


def _plan(run: JobRun) -> None:
    """Stage plan: the policy, with its predicted memory for every phase, checked before anything is written or read
    (:func:`plan_for_job`); a bad policy key is an error whether or not work is left."""
    t = time.perf_counter()
    run.jplan = plan_for_job(run.job, run.prep)
    run.cpu_est = cpu_prediction(run.job, run.prep, run.jplan, run.log)  # device cpu: policy.cpu_hrm's roofline
    run.parts["plan"] = time.perf_counter() - t


def _finished_report(run: JobRun) -> Optional[dict]:
    """The last run's report, flagged ``nothing_to_do``, when every request of the job has its record already (the
    results' provenance compared first; nothing is written); None when work is left."""
    job, prep = run.job, run.prep
    if not (os.path.exists(job.output.report_path) and os.path.exists(job.output.path)):
        return None
    check_results_provenance(job)  # results exist: compared, nothing written
    with ResultsWriter(job.output.path) as w:
        if not all(t.id in w.done_ids() for t in prep.treqs):
            return None
    with open(job.output.report_path) as f:
        old = json.load(f)
    share_work([], {})  # the other expert-parallel processes have nothing to do either
    print(f"moe-batch: all {len(prep.treqs)} requests of {job.output.path} are done; "
          f"report of the run that finished them: {job.output.report_path}", file=run.log)
    return {**old, "nothing_to_do": True}  # the flag is not written: the file stays that run's report


def _resume(run: JobRun, runner: Optional[ModelRunner]) -> None:
    """Stage resume: the results file opened (records there are skipped, a torn last line repaired), the partials
    sidecar read, the report started with the job's earlier runs, validation failures recorded; the runner made
    when the caller gave none."""
    job, prep = run.job, run.prep
    check_results_provenance(job)  # never mix records of another model / settings into one results file
    with ResultsWriter(job.output.path) as w:
        run.done = w.done_ids()
    run.todo = [t for t in prep.treqs if t.id not in run.done]
    run.work = work_order(job, run.todo)
    run.writer = ResultsWriter(job.output.path)
    if job.task == "generate":  # the sidecar: torn line repaired, partials of ids with a record or not in the input dropped
        run.partials_file = PartialsFile(job.output.partial_path)
        run.partials = run.partials_file.load([t.id for t in run.work], run.done)
    share_work([t.id for t in run.work if t.error is None], run.partials)  # the other processes run the same
    prev_runs = reconcile_killed_runs(previous_runs(job, bool(run.done) or bool(run.partials)), len(run.done))
    run.progress = RunProgress(job.output.report_path, prev_runs, len(run.done), run.writer, run.started, run.t_start)
    run.report = report_head(job, prep, run.writer.path, len(prep.treqs) - len(run.todo), run.partials_file,
                             run.partials)
    run.errors = [t for t in run.todo if t.error is not None]
    for t in run.errors:  # validation failures under on_error: record
        run.writer.write(error_record(t.id, t.error))
    run.own_runner = runner is None
    run.runner = ModelRunner(prep.files, job.dtype, run.log) if runner is None else runner
    run.peaks = PhasePeaks(job.device)


def _load(run: JobRun, spans: Optional[list]) -> None:
    """Stage load: the device set up and capped, the native CPU attention kernel ready, the weights read and the
    executor built; the report gets the cap, the policy and the prediction."""
    job, report = run.job, run.report
    run.progress.save(report, run.current_stats())  # the run is in the report's runs from its start: killed before a
    #   checkpoint, it still shows
    t = time.perf_counter()
    use_device(job.device)
    run.cap = apply_gpu_cap(job.device, job.gpu_memory)
    run.jplan = fit_plan_to_cap(job, run.prep, run.jplan, run.cap, run.log)  # this process's context measured
    run.parts["gpu_init"] = time.perf_counter() - t
    t = time.perf_counter()
    _prepare_cpu_attention(job, run.jplan, run.log)  # a first-run compile is not timed as load or decode
    run.t_setup += time.perf_counter() - t
    run.peaks.enter("load")
    t0 = time.perf_counter()
    run.executor = run.runner.executor(job, run.prep, run.jplan, run.cap)  # reads the weights
    run.executor.phase_hook = run.peaks.enter
    run.t_load = time.perf_counter() - t0
    if hasattr(run.executor, "calls"):  # this run's calls only (a ModelRunner's executor outlives a run)
        run.executor.calls = []
    if spans is not None:
        run.executor.timer.start_spans()
    report["gpu_memory_fraction"] = run.cap["fraction"] if run.cap else None
    if hasattr(run.executor, "policy_summary"):
        report["policy"] = run.executor.policy_summary()
    if run.jplan is not None and job.device.startswith("cuda"):  # on the CPU the GPU-host prediction means nothing
        report["predicted"] = predicted_report(job, run.jplan, run.prep.spec)
    elif run.cpu_est is not None:  # on the CPU: the CPU executor's roofline, not the GPU host's HRM
        report["predicted"] = cpu_predicted_report(run.cpu_est)


def _loop(run: JobRun, progress: bool) -> None:
    """Stage loop: the batch loop :func:`_run_work` over the work, with the sidecar's checkpoints, the report's
    progress at them, and the stop signals served after a decode step."""
    t = time.perf_counter()
    _run_work(run.job, run.prep, run.executor, run.work, run.writer, run.score_records, progress, run.log, tqdm,
              partials=run.partials, partials_file=run.partials_file, stop=run.stop,
              on_checkpoint=lambda: run.progress.save(run.report, run.current_stats()))
    run.parts["run"] = time.perf_counter() - t
    run.stats = run.executor.stats


def _out_of_memory(run: JobRun) -> str:
    """The report's status and error for an out-of-memory run; returns the one line (report.oom_message)."""
    run.peaks.close()
    phase = getattr(run.executor, "phase", None) or run.peaks.phase
    run.report["status"] = f"out of memory in {phase}"
    msg = oom_message(phase, run.jplan, run.peaks, run.job, run.prep.spec, run.writer.written, run.writer.path)
    run.report["error"] = msg
    return msg


def _stopped(run: JobRun) -> JobStopped:
    """The report's status for a stopped run, and the one-line JobStopped saying what is saved."""
    job, writer = run.job, run.writer
    run.report["status"] = "stopped (resumable)"
    left = len(read_partials_ids(job.output.partial_path) - writer.done_ids())  # sequences still in flight
    return JobStopped(f"stopped by {run.stop.requested}: {writer.written} records written by this run "
                      f"({len(run.done) + writer.written} of {len(run.prep.treqs)} in {writer.path}), the partial "
                      f"generations of {left} sequences in {job.output.partial_path}; resumable: re-run the same "
                      f"command to continue")


def _report(run: JobRun, spans: Optional[list]) -> None:
    """Stage report (whatever ended the run): the files closed, the report's figures filled in (report.end_of_run)
    and its runs list, and the report written atomically; the signal handlers restored last."""
    run.stop.deferred = True  # a signal now only marks the stop: the report below is written whole
    stats = run.current_stats()
    if spans is not None and run.executor is not None and run.executor.timer.spans_on:
        spans.extend(run.executor.timer.take_spans())
    run.peaks.close()
    run.writer.close()
    if run.partials_file is not None:
        run.partials_file.close()
    run.report.update(end_of_run(run.job, run.prep.spec, stats, t_load=run.t_load,
                                 total=time.perf_counter() - run.t_start, t_setup=run.t_setup, parts=run.parts,
                                 written=run.writer.written, errors=len(run.errors), jplan=run.jplan, cap=run.cap,
                                 peaks=run.peaks, score_records=run.score_records))
    if run.errors:  # the first error record's reason, so the terminal shows why (all of them are in the results)
        run.report["first_error"] = run.errors[0].error
    run.report["slot_occupancy"] = (stats.slot_occupancy if stats.slot_steps  # the executor's own count (refill)
                                    else slot_occupancy(run.report["stats"], run.report.get("policy")))
    calls = getattr(run.executor, "calls", None)
    if calls and run.job.task == "generate":  # the schedule over the measured lengths (and its HRM price on a GPU)
        gpu = run.jplan is not None and run.job.device.startswith("cuda")
        run.report["refill"] = refill_report(calls, stats, run.jplan if gpu else None, run.prep.spec,
                                             job_workload_from_prepared(run.prep) if gpu else None)
    if run.own_runner:
        run.runner.close()
    try:
        run.report.update(run.progress.runs(run.report["status"], stats))
        write_json_atomic(run.job.output.report_path, run.report)
    finally:
        run.stop.__exit__(None, None, None)


def follow_job(job: Job, log=None) -> None:
    """Processes 1..G-1: the work process 0 sends (:func:`share_work`), run batch by batch with the job's executor,
    nothing written."""
    log = sys.stderr if log is None else log
    prep = Prepared(job)
    ids, partials = share_work([], {})
    if not ids:
        return
    by_id = {t.id: t for t in prep.treqs}
    work = [by_id[i] for i in ids]
    runner = ModelRunner(prep.files, job.dtype, log)
    try:
        executor = runner.executor(job, prep, None)
        _run_work(job, prep, executor, work, NoWriter(), [], False, log, tqdm, partials=partials)
    finally:
        runner.close()


def read_partials_ids(path: str) -> set:
    """Ids with a partial generation in the sidecar ``path`` (none when it is missing)."""
    return set(read_partials(path))


def _run_work(job: Job, prep: "Prepared", executor, work: list, writer, score_records: list, progress: bool, log,
              tqdm, partials: Optional[dict] = None, partials_file: Optional[PartialsFile] = None,
              stop: Optional[StopSignals] = None, on_checkpoint=None) -> int:
    """Generate or score ``work`` batch by batch, writing every record as it finishes; returns records written.

    Generation resumes the sequences of ``partials`` (id -> tokens generated by earlier runs: prefilled with the prompt;
    a complete one is written at once) and appends the new tokens of every sequence in flight to ``partials_file`` at
    each checkpoint (``job.checkpoint``; the write time goes to the executor's stage ``checkpoint_write_s``), calling
    ``on_checkpoint()`` at most every report.REPORT_EVERY_S (app.checkpointing). A stop request (``stop.requested``) is
    served after the decode step it arrives in: the partials are flushed and JobStopped raised.

    The progress bar counts generated tokens (advancing every decode step, live tokens/s) or scored requests."""
    if job.task == "generate":
        bar = functools.partial(tqdm, disable=not progress, unit="tok", file=log, dynamic_ncols=True,
                                bar_format=PROGRESS_FORMAT)  # one rate: the postfix's average, not tqdm's smoothed one
        return _generate_work(job, prep, executor, work, writer, bar, partials or {}, partials_file, stop,
                              on_checkpoint)
    return _score_work(job, prep, executor, work, writer, score_records,
                       tqdm(total=len(work), disable=not progress, unit="req", file=log, dynamic_ncols=True))


class _GenerationRecords:
    """How a generate job's records are made: its sampling settings, end of sequence, stop strings and log-probs."""

    def __init__(self, job: Job, prep: "Prepared", writer):
        self.G = job.generation.max_new_tokens
        self.params = DecodeSampling.from_config(job.generation)
        self.eos = prep.eos_token_id
        self.stops = job.generation.stop
        self.k = self.params.logprobs  # None: no log-probs (nothing computed, nothing kept)
        self.tokenizer = prep.tokenizer
        self.writer = writer
        self.watch = StopWatch(self.stops, lambda rows: prep.tokenizer.batch_decode(rows, skip_special_tokens=True))

    def ends(self, p: list) -> bool:
        """Whether output ``p`` ends the sequence (an end-of-sequence or stop token)."""
        return bool(p) and finish_reason(self.params, self.eos, p[-1], len(p)) == "stop"

    def write(self, tr, out_ids: list, reason: str, lps: Optional[list]) -> None:
        """Write the record of request ``tr``."""
        self.writer.write(_gen_record(tr, out_ids, reason, self.tokenizer, self.stops,
                                      lps if self.k is not None else None, self.k))


def _resumable(gen: _GenerationRecords, partials: dict, partials_file: Optional[PartialsFile]) -> tuple[dict, dict]:
    """(partials, their log-prob entries) a run can continue: with log-probs asked for, a partial without its log-probs
    (not written by a job that asked for them) starts over."""
    if gen.k is None:
        return partials, {}
    plps = partials_file.logprobs if partials_file is not None else {}
    return {i: p for i, p in partials.items() if plps.get(i) is not None and len(plps[i]) == len(p)}, plps


def _write_complete_partials(gen: _GenerationRecords, work: list, partials: dict, plps: dict) -> list:
    """Write the record of every request whose partial is complete (killed before its record was written: it needs no
    model); returns the rest of ``work``."""
    rest = []
    stopped = gen.watch.hits({i: p for i, t in enumerate(work) if (p := partials.get(t.id))}) if gen.watch else set()
    for i, t in enumerate(work):
        p = partials.get(t.id, [])
        if p and (len(p) >= gen.G or gen.ends(p) or i in stopped):
            out = p[:gen.G]
            gen.write(t, out, "stop" if gen.ends(out) or i in stopped else "length", plps.get(t.id, [])[:gen.G])
        else:
            rest.append(t)
    return rest


def _generate_work(job: Job, prep: "Prepared", executor, work: list, writer, bar, partials: dict,
                   partials_file: Optional[PartialsFile], stop: Optional[StopSignals], on_checkpoint) -> int:
    """:func:`_run_work` for a generate job (``bar``: the progress bar's maker)."""
    t_run = time.perf_counter()
    gen = _GenerationRecords(job, prep, writer)
    if stop is not None:
        stop.deferred = True  # served after the current decode step (on_tokens below)
    partials, plps = _resumable(gen, partials, partials_file)
    rest = _write_complete_partials(gen, work, partials, plps)
    written = len(work) - len(rest)
    bar = bar(total=sum(gen.G - len(partials.get(t.id, [])) for t in rest))
    done = [0]  # records written by the loop
    ckpt = PartialCheckpoints(job.checkpoint, partials_file, executor.stats.extra, on_checkpoint)

    def show(refresh: bool = False) -> None:
        bar.set_postfix_str(f"{done[0]}/{len(rest)} records, "
                            f"{bar.n / max(time.perf_counter() - t_run, 1e-9):.1f} tok/s average", refresh=refresh)

    batch = max(1, getattr(executor, "batch_size", job.batch_size))
    chunks = _generation_batches(rest, partials, batch)
    if getattr(executor, "refills", False) and rest:  # one call: N rows decode, the rest wait for a freed slot
        chunks = [[t for c in chunks for t in c]]
    try:  # the bar ends its line whatever ends the loop (a stop, an out-of-memory)
        for chunk in chunks:
            _generate_batch(job, executor, gen, chunk, partials, plps if gen.k is not None else None, ckpt, stop,
                            bar, done, show)
            written += len(chunk)
        show(refresh=True)  # the last step's count
    finally:
        bar.close()
    return written


def _generate_batch(job: Job, executor, gen: _GenerationRecords, chunk: list, partials: dict, plps: Optional[dict],
                    ckpt: PartialCheckpoints, stop: Optional[StopSignals], bar, done: list, show) -> None:
    """One batch of the generation loop: the executor's callbacks write each record as it finishes, keep every row's
    tokens (and log-probs) in flight, write the sidecar's checkpoints and serve a stop request."""
    rows = InFlight([t.id for t in chunk], partials, plps)

    def on_step(tokens: int) -> None:
        bar.update(tokens)
        show()

    def on_finish(idx, out_ids, reason) -> None:
        gen.write(chunk[idx], out_ids, reason, rows.lpss[idx] if rows.lpss is not None else None)
        rows.finished[idx] = True
        done[0] += 1
        if len(out_ids) < gen.G:  # stopped early: its remaining tokens will never come
            bar.total -= gen.G - len(out_ids)

    def on_tokens(rws, toks) -> None:
        rows.add_tokens(rws, toks)
        stopping = stop is not None and stop.requested is not None
        ckpt.step(rows, stopping)
        if stopping:
            raise JobStopped(f"stopped by {stop.requested}")

    pre = [partials.get(t.id, []) for t in chunk]
    executor.generate([t.prompt_ids for t in chunk], gen.params, on_finish=on_finish,
                      seeds=[request_seed(job.generation.seed, t.id) for t in chunk],
                      eos_token_id=gen.eos, on_step=on_step, prefixes=pre if any(pre) else None,
                      on_tokens=on_tokens, stop_rows=gen.watch.hits if gen.watch else None,
                      on_logprobs=rows.add_logprobs if gen.k is not None else None)


def _score_work(job: Job, prep: "Prepared", executor, work: list, writer, score_records: list, bar) -> int:
    """:func:`_run_work` for a score job: batches of at most the policy's N sequences (else ``job.batch_size``
    requests), every record written as its batch ends."""
    t_run = time.perf_counter()
    written = 0
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
