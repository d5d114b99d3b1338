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
(:func:`run_in_memory`); :func:`run_job` adds resume, checkpoints, signals and the report around them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Optional, Sequence

import torch

from ..config import Job
from ..data.stops import StopWatch, cut_at_stop
from ..data.writer import PartialsFile, ResultsWriter, error_record, write_json_atomic
from ..model.quantized import checkpoint_expert_scheme
from ..model.weights import load_checkpoint
from ..pipeline import scoring
from ..pipeline.executor import RunStats
from ..pipeline.sampling import DecodeSampling, finish_reason, request_seed
from ..pipeline.serial import SerialExecutor
from .gpu import PhasePeaks, apply_gpu_cap, use_device
from .plan import JobPlan, ModelFiles, Prepared, check_plan, hardware_note, job_hardware, plan_job, policy_for_job
from .report import (REPORT_EVERY_S, job_totals, memory_report, oom_message, other_parts, peak_host_bytes, previous_runs,
                     reconcile_killed_runs, timing)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KEEP_POLICY_SPEED = 0.9  # ModelRunner keeps its cgopipe executor for a job whose plan differs while the executor's
#   policy fits and is predicted at >= this fraction of the planner's end-to-end tokens/s for that job


LOUD_LOAD_BYTES = 2**30  # checkpoints at least this large get a line before and after their read


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


def predicted_report(job: Job, est) -> dict:
    """The run report's ``predicted`` block: the HRM's tokens/s and binding stages for the plan's estimate ``est``,
    the hardware profile it planned with, and the notes on what the prediction stands on (the profile a job that
    names none got; what the estimate leaves out)."""
    hw = job_hardware(job)
    return {"prefill_tokens_per_s": est.prefill_tok_s, "decode_tokens_per_s": est.decode_tok_s,
            "end_to_end_tokens_per_s": est.e2e_tok_s, "decode_binding": est.decode_binding,
            "prefill_binding": est.prefill_binding, "hardware": job.hardware or hw.name,  # the preset or the YAML
            "notes": [n for n in (hardware_note(job, hw), *est.notes) if n and n.startswith("note:")]}


def make_executor(job: Job, prep: Prepared, weights, jplan: Optional[JobPlan] = None):
    """The executor named by ``job.executor``: "cgopipe" with ``jplan``'s policy, or "serial"."""
    dtype = DTYPES[job.dtype]
    if job.executor == "cgopipe":
        from ..pipeline.cgopipe import CGOPipeExecutor, expert_ffn_for

        hw = job_hardware(job)  # the planner's profile
        ex = CGOPipeExecutor(weights, jplan.policy, job.device, dtype,
                             ffn=expert_ffn_for(job, prep.spec, _expert_scheme(prep)), hardware=hw)
        ex.estimate = jplan.estimate
        return ex
    if job.gpus > 1:  # one process of the expert-parallel group (app.expert_parallel started it)
        from ..pipeline.expert_parallel import ExpertParallelExecutor
        from .expert_parallel import group_info

        rank, world = group_info()
        return ExpertParallelExecutor(weights, rank, world, device=job.device, dtype=dtype)
    return SerialExecutor(weights, job.device, dtype)


def check_kernel_env(label: str) -> None:
    """ConfigError starting with ``label`` when an environment variable that picks a kernel
    (``LIGHTNING_MOE_PREFILL_ATTENTION``, ``LIGHTNING_MOE_CPU_ATTENTION``) holds a value the kernel does not know:
    the one place both are checked, before anything is written (a fresh run and a re-run of a finished job alike)."""
    from ..kernels.cpu_attention import cpu_attention_mode
    from ..kernels.prefill_attention import prefill_attention_mode

    for mode in (prefill_attention_mode, cpu_attention_mode):
        try:
            mode()
        except ValueError as e:
            from ..config import ConfigError

            raise ConfigError(f"{label}: {e}") from None


def check_device(job: Job) -> None:
    """ConfigError when ``job.device`` is CUDA and torch sees no CUDA device, or when an environment variable that
    picks a kernel holds a value the kernel does not know (:func:`check_kernel_env`): before anything is written."""
    check_kernel_env(job.label)
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        from ..config import ConfigError

        raise ConfigError(f"{job.label}: device: {job.device} asked for, but torch sees no CUDA device "
                          f"(set device: cpu, or --set device=cpu)")
    index = torch.device(job.device).index if job.device.startswith("cuda") else None
    count = torch.cuda.device_count() if index is not None else 0
    if index is not None and index >= count:
        from ..config import ConfigError

        raise ConfigError(f"{job.label}: device: {job.device} asked for, but torch sees {count} CUDA device(s): "
                          f"cuda:0 to cuda:{count - 1}")


def check_expert_parallel(job: Job) -> None:
    """ConfigError naming the job's ``gpus`` when expert parallelism cannot run its model's family (read from the
    checkpoint's config.json only: before any process is started or weight read)."""
    if job.gpus <= 1:
        return
    from ..model.spec import MoESpec
    from ..model.tiny import resolve_model_path
    from ..pipeline.expert_parallel import expert_parallel_refusal

    why = expert_parallel_refusal(MoESpec.from_pretrained_dir(resolve_model_path(job.model)))
    if why is not None:
        from ..config import ConfigError

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
        from ..config import ConfigError

        raise ConfigError(f"{job.config_path or job.name}: executor: cgopipe: {prep.spec.name}: {why}; set "
                          f"executor: serial")
    valid = any(t.error is None for t in prep.treqs)
    jplan = plan_job(job, prep) if (job.executor == "cgopipe" and valid) else None
    if job.executor == "cgopipe" and getattr(job, "expert_ffn", "torch") in ("triton", "grouped_mm", "mm_loop"):
        from ..pipeline.expert_ffn import grouped_kernels_refusal

        # auto picks torch for such a model (expert_ffn_for); MXFP4 pages kept packed: the MXFP4 kernel
        why = grouped_kernels_refusal(prep.spec, job.expert_ffn, _expert_scheme(prep))
        if why is not None:
            from ..config import ConfigError

            raise ConfigError(f"{job.config_path or job.name}: executor: cgopipe: {prep.spec.name}: expert_ffn "
                              f"{job.expert_ffn}: {why}")
    if jplan is not None and job.task != "score" and jplan.policy.n_gpu_attn > 0 and job.device.startswith("cuda"):
        from ..pipeline.cgopipe import gpu_attention_refusal

        why = gpu_attention_refusal(prep.spec)  # MLA, sinks: the planner plans none; a policy file or inline one may
        if why is not None:
            from ..config import ConfigError

            raise ConfigError(f"{job.config_path or job.name}: executor: cgopipe: {prep.spec.name}: {why} (policy "
                              f"n_gpu_attn={jplan.policy.n_gpu_attn}; set it to 0)")
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

    def executor(self, job: Job, prep: Prepared, jplan: Optional[JobPlan]):
        """The executor for ``job`` (:func:`make_executor` with ``jplan``'s policy), reused when the one held fits;
        its stats start from zero for each job."""
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
            from ..policy.policy import PolicyError

            try:  # the held policy, for this job's workload (budgets as the job's)
                kept = check_plan(job, prep, ex.policy)
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
                  log=None) -> list[dict]:
    """Run the tokenized requests of ``prep`` (none with an error) through ``runner``'s executor and the batch loop,
    and return their records -- the ones :func:`run_job` writes for the same requests -- in ``prep.treqs`` order.
    Nothing is written to disk and no signal handler is installed (the Python API's run)."""
    from tqdm import tqdm

    log = log or sys.stderr
    work = work_order(job, prep.treqs)
    sink = RecordCollector()
    if work:
        _prepare_cpu_attention(job, jplan, log)
        executor = runner.executor(job, prep, jplan)
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
    if job.task == "generate":  # as JSON holds it (lists); stop and logprobs settings only when set, so older results
        #   still match
        gen = {k: v for k, v in json.loads(json.dumps(asdict(job.generation))).items()
               if not (k in ("stop", "stop_token_ids") and not v) and not (k == "logprobs" and v is None)}
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
    from ..kernels.cpu_attention import native_available, native_loaded

    if not native_loaded():
        print("moe-batch: loading the native CPU attention kernel (compiled on the first run per torch install, ~20-60 s)",
              file=log, flush=True)
    native_available()


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
    from tqdm import tqdm

    from .expert_parallel import in_group, run_expert_parallel, share_work

    log = log if log is not None else sys.stderr
    if job.gpus > 1 and not in_group():  # start the expert-parallel processes; process 0 comes back here
        check_device(job)
        check_expert_parallel(job)
        return run_expert_parallel(job, run_job, follow_job, progress, log)
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    check_device(job)
    t_setup = 0.0  # one-time setup: the embedded model's creation on first use, the native kernel's build or load
    if runner is None:
        from ..model.tiny import resolve_model_path

        t = time.perf_counter()
        resolve_model_path(job.model)  # creates tiny-mixtral on first use (instant otherwise)
        t_setup += time.perf_counter() - t
    if spans is not None and job.executor != "cgopipe":
        from ..config import ConfigError

        raise ConfigError(f"{job.label}: executor: the timeline draws the cgopipe executor's stages; this job runs "
                          f"executor: {job.executor} (--set executor=cgopipe)")
    t = time.perf_counter()
    prep = Prepared(job, files=runner.files if runner is not None else None)
    t_read = time.perf_counter() - t  # what wall_seconds.other holds (report: other_seconds)
    parts = {"model_files": prep.model_files_seconds, "requests": max(0.0, t_read - prep.model_files_seconds)}
    # the policy, with its predicted memory for every phase, is checked before anything is written or read; a re-run
    # of a finished job checks it too (a bad policy key is an error whether or not work is left)
    t = time.perf_counter()
    jplan = plan_for_job(job, prep)
    parts["plan"] = time.perf_counter() - t
    if os.path.exists(job.output.report_path) and os.path.exists(job.output.path):
        check_results_provenance(job)  # results exist: compared, nothing written
        with ResultsWriter(job.output.path) as w:
            if all(t.id in w.done_ids() for t in prep.treqs):  # nothing to do: keep the last run's report
                with open(job.output.report_path) as f:
                    old = json.load(f)
                share_work([], {})  # the other expert-parallel processes have nothing to do either
                print(f"moe-batch: all {len(prep.treqs)} requests of {job.output.path} are done; "
                      f"report of the run that finished them: {job.output.report_path}", file=log)
                return {**old, "nothing_to_do": True}  # the flag is not written: the file stays that run's report
    check_results_provenance(job)  # never mix records of another model / settings into one results file
    with ResultsWriter(job.output.path) as w:
        done = w.done_ids()
    todo = [t for t in prep.treqs if t.id not in done]
    work = work_order(job, todo)
    writer = ResultsWriter(job.output.path)
    partials_file, partials = None, {}
    if job.task == "generate":  # the sidecar: torn line repaired, partials of ids with a record or not in the input dropped
        partials_file = PartialsFile(job.output.partial_path)
        partials = partials_file.load([t.id for t in work], done)
    share_work([t.id for t in work if t.error is None], partials)  # the other expert-parallel processes run the same
    prev_runs = reconcile_killed_runs(previous_runs(job, bool(done) or bool(partials)), len(done))
    skipped = len(prep.treqs) - len(todo)
    report: dict = {
        "job": job.name, "config": job.config_path, "task": job.task, "mode": job.score.mode if job.score else None,
        "model": job.model, "model_path": prep.model_path, "device": job.device, "dtype": job.dtype,
        "executor": job.executor, "shard": list(job.shard) if job.shard else None, "host": platform.node(),
        "requests_in_input": prep.n_input, "requests_in_shard": len(prep.treqs), "skipped_already_done": skipped,
        "results": writer.path, "status": "running",
        "expert_parallel": {"processes": job.gpus, "backend": "nccl" if job.device.startswith("cuda") else "gloo"}
        if job.gpus > 1 else None,
        "partials": {"path": partials_file.path, "resumed_sequences": len(partials),
                     "resumed_tokens": sum(map(len, partials.values()))} if partials_file is not None else None,
    }
    errors = [t for t in todo if t.error is not None]
    for t in errors:  # validation failures under on_error: record
        writer.write(error_record(t.id, t.error))
    stats = RunStats()
    score_records: list[dict] = []
    t_load = 0.0
    executor = None
    own_runner = runner is None
    if own_runner:
        runner = ModelRunner(prep.files, job.dtype, log)
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
                                                   "job_totals": job_totals(runs, len(done) + writer.written)})

    stop.__enter__()
    try:
        if work:
            save_progress()  # this run is in the report's runs from its start: killed before a checkpoint, it still shows
            t = time.perf_counter()
            use_device(job.device)
            cap = apply_gpu_cap(job.device, job.gpu_memory)
            parts["gpu_init"] = time.perf_counter() - t
            t = time.perf_counter()
            _prepare_cpu_attention(job, jplan, log)  # a first-run compile is not timed as load or decode
            t_setup += time.perf_counter() - t
            peaks.enter("load")
            t0 = time.perf_counter()
            executor = runner.executor(job, prep, jplan)  # reads the weights
            executor.phase_hook = peaks.enter
            t_load = time.perf_counter() - t0
            if spans is not None:
                executor.timer.start_spans()
            report["gpu_memory_fraction"] = cap["fraction"] if cap else None
            if hasattr(executor, "policy_summary"):
                report["policy"] = executor.policy_summary()
            est = jplan.estimate if jplan is not None else None
            if est is not None and job.device.startswith("cuda"):  # on the CPU the GPU-host prediction means nothing
                report["predicted"] = predicted_report(job, est)
            t = time.perf_counter()
            _run_work(job, prep, executor, work, writer, score_records, progress, log, tqdm, partials=partials,
                      partials_file=partials_file, stop=stop, on_checkpoint=save_progress)
            parts["run"] = time.perf_counter() - t
            stats = executor.stats
        report["status"] = "done"
        if partials_file is not None:  # every sequence has its record: the partials are obsolete
            partials_file.remove()
    except torch.OutOfMemoryError:
        peaks.close()
        phase = getattr(executor, "phase", None) or peaks.phase
        report["status"] = f"out of memory in {phase}"
        msg = oom_message(phase, jplan, peaks, job, prep.spec, writer.written, writer.path)
        report["error"] = msg
        if os.environ.get("MOE_BATCH_DEBUG"):
            raise
        raise GpuOutOfMemory(msg) from None
    except JobStopped:
        report["status"] = "stopped (resumable)"
        left = len(read_partials_ids(job.output.partial_path) - writer.done_ids())  # sequences still in flight
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
        if spans is not None and executor is not None and executor.timer.spans_on:
            spans.extend(executor.timer.take_spans())
        peaks.close()
        writer.close()
        if partials_file is not None:
            partials_file.close()
        total = time.perf_counter() - t_start
        report.update(timing(stats, t_load, total, job.task, t_setup))
        report["other_seconds"] = other_parts(report["wall_seconds"], parts)
        report["records_written_this_run"] = writer.written
        report["errors_recorded"] = len(errors)
        report["peak_host_memory_bytes"] = peaks.host_overall() or peak_host_bytes()
        report["peak_gpu_memory_bytes"] = peaks.overall("allocated")
        report["memory"] = memory_report(jplan, cap, peaks, prep.spec, job)
        if job.task == "score":
            report["metrics"] = scoring.summarize(score_records, job.score.mode)
        report["stats"] = {k: v for k, v in asdict(stats).items() if k != "extra"}
        report["stages"] = stats.extra
        if own_runner:
            runner.close()
        try:
            report["runs"] = prev_runs + [run_entry(report["status"])]
            report["job_totals"] = job_totals(report["runs"], len(done) + writer.written)
            write_json_atomic(job.output.report_path, report)
        finally:
            stop.__exit__(None, None, None)
    return report


def follow_job(job: Job, log=sys.stderr) -> None:
    """Processes 1..G-1: the work process 0 sends (:func:`share_work`), run batch by batch with the job's executor,
    nothing written."""
    from tqdm import tqdm

    from .expert_parallel import NoWriter, share_work

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
    from ..data.writer import read_partials

    return set(read_partials(path))


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
        params = DecodeSampling.from_config(job.generation)
        eos = prep.eos_token_id
        ck = job.checkpoint
        if stop is not None:
            stop.deferred = True  # served after the current decode step (on_tokens below)

        stops = job.generation.stop
        watch = StopWatch(stops, lambda rows: prep.tokenizer.batch_decode(rows, skip_special_tokens=True))
        k = params.logprobs  # None: no log-probs (nothing computed, nothing kept)
        plps: dict = {}  # id -> the log-prob entries of its partial
        if k is not None:
            plps = partials_file.logprobs if partials_file is not None else {}
            # a partial without its log-probs (not written by a job that asked for them) starts over
            partials = {i: p for i, p in partials.items() if plps.get(i) is not None and len(plps[i]) == len(p)}

        def ends(p: list) -> bool:
            return bool(p) and finish_reason(params, eos, p[-1], len(p)) == "stop"

        rest = []
        stopped = watch.hits({i: p for i, t in enumerate(work) if (p := partials.get(t.id))}) if watch else set()
        for i, t in enumerate(work):  # a complete partial (killed before its record was written) needs no model
            p = partials.get(t.id, [])
            if p and (len(p) >= G or ends(p) or i in stopped):
                writer.write(_gen_record(t, p[:G], "stop" if ends(p[:G]) or i in stopped else "length",
                                         prep.tokenizer, stops, plps[t.id][:G] if k is not None else None, k))
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
        chunks = _generation_batches(rest, partials, batch)
        if getattr(executor, "refills", False) and rest:  # one call: N rows decode, the rest wait for a freed slot
            chunks = [[t for c in chunks for t in c]]
        try:  # the bar ends its line whatever ends the loop (a stop, an out-of-memory)
            for chunk in chunks:
                outs = [list(partials.get(t.id, [])) for t in chunk]  # every row's output so far
                saved = [len(o) for o in outs]  # how much of it the sidecar holds
                finished = [False] * len(chunk)
                lpss = [list(plps.get(t.id, [])) for t in chunk] if k is not None else None  # log-prob entries

                def on_logprobs(rows, entries, lpss=lpss):
                    for r, e in zip(rows, entries):
                        lpss[r].append(e)

                def on_finish(idx, out_ids, reason, chunk=chunk, finished=finished, lpss=lpss):
                    writer.write(_gen_record(chunk[idx], out_ids, reason, prep.tokenizer, stops,
                                             lpss[idx] if lpss is not None else None, k))
                    finished[idx] = True
                    done[0] += 1
                    if len(out_ids) < G:  # stopped early: its remaining tokens will never come
                        bar.total -= G - len(out_ids)

                def on_tokens(rows, toks, chunk=chunk, outs=outs, saved=saved, finished=finished, lpss=lpss):
                    for r, t in zip(rows, toks):
                        if not finished[r]:
                            outs[r].append(t)
                    clock["steps"] += 1
                    now = time.perf_counter()
                    stopping = stop is not None and stop.requested is not None
                    due = stopping or (ck.every_steps is not None and clock["steps"] >= ck.every_steps) or (
                        ck.every_seconds is not None and now - clock["last"] >= ck.every_seconds)
                    if due and ck.enabled and partials_file is not None:
                        lines = [(chunk[i].id, saved[i], outs[i][saved[i]:])
                                 + ((lpss[i][saved[i]:],) if lpss is not None else ()) for i in range(len(chunk))
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
                                  on_tokens=on_tokens, stop_rows=watch.hits if watch else None,
                                  on_logprobs=on_logprobs if k is not None else None)
                written += len(chunk)
            bar.set_postfix_str(f"{done[0]}/{len(rest)} records, "
                                f"{bar.n / max(time.perf_counter() - t_run, 1e-9):.1f} tok/s")  # the last step's count
        finally:
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
