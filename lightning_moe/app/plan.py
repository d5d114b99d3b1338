"""A job before any weight is read: its model's files (:class:`ModelFiles`), its tokenized requests
(:class:`Prepared`), the planner's workload of them, and the policy it runs with, checked against the memory model
(:func:`plan_job`, :func:`check_plan`)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from ..config import Job
from ..data.shard import select_shard
from ..data.sources import load_requests
from ..data.tokenize import encode_requests, load_tokenizer
from ..model.spec import MoESpec
from ..model.tiny import resolve_model_path
from ..pipeline import scoring
from .cpu_plan import cpu_estimate, is_cpu_job, plan_cpu_job
from .gpu import device_memory, device_name, preset_for_device_name


class ModelFiles:
    """What a model gives before any weight is read: its checkpoint directory, spec and tokenizer (read once; the
    Python API keeps one for all its calls)."""

    def __init__(self, model: str):
        self.model = model  # as the job names it ("tiny-mixtral" or a checkpoint directory)
        self.model_path = resolve_model_path(model)
        self.spec = MoESpec.from_pretrained_dir(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        n_tok = len(self.tokenizer)
        if self.spec.vocab_size > n_tok:  # e.g. a speed-work checkpoint with a borrowed tokenizer
            print(f"moe-batch: {self.model_path}: the model's vocab_size {self.spec.vocab_size:,} exceeds its "
                  f"tokenizer's {n_tok:,} tokens: generated ids >= {n_tok:,} have no text (output_ids keep them)",
                  file=sys.stderr, flush=True)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else self.spec.eos_token_id


class Prepared:
    """Everything a job needs before heavy work: spec, tokenizer, tokenized requests.

    ``requests``: the job's requests when the caller holds them (the Python API); default: read from ``job.data``
    (and ``job.shard`` selected). ``files``: the model's :class:`ModelFiles` when already read (default: read now).
    """

    def __init__(self, job: Job, requests: Optional[list] = None, files: Optional[ModelFiles] = None):
        self.job = job
        t = time.perf_counter()
        self.files = files if files is not None else ModelFiles(job.model)
        self.model_files_seconds = time.perf_counter() - t  # the config and tokenizer read (0 when given)
        self.model_path = self.files.model_path
        self.spec = self.files.spec
        self.tokenizer = self.files.tokenizer
        check_stop_token_ids(job, self.spec)  # before any request is read or any weight
        if requests is None:
            requests = load_requests(job)
            self.n_input = len(requests)
            if job.shard is not None:
                requests = select_shard(requests, *job.shard)
        else:
            self.n_input = len(requests)
        self.treqs = encode_requests(requests, self.tokenizer, job, self.spec.max_position_embeddings)
        self.eos_token_id = self.files.eos_token_id
        self._resumed_rows: Optional[tuple] = None  # (done ids, id -> partial tokens): resumed_rows' cache


def job_workload_from_prepared(prep: "Prepared"):
    """The planner's Workload from a prepared job's real tokenized requests: prompt lengths (generation, ``gen_len`` =
    max_new_tokens) or the lengths of every sequence a scoring job feeds (perplexity windows included; a prefill-only
    scoring workload). A generation job that resumes (:func:`resumed_rows`) is planned for the rows it will run: those
    without a record, a resumed one at its prompt + partial tokens (what its prefill feeds)."""
    from ..policy.policy import Workload

    job = prep.job
    ok = [t for t in prep.treqs if t.error is None]
    if job.task == "score":
        lens = [n for t in ok for n in scoring.sequence_lengths(t, job.score.mode, prep.spec.max_position_embeddings,
                                                                 job.score.stride)]
        return Workload.from_lengths(lens, 1, name=job.name, scoring=True)
    G = job.generation.max_new_tokens
    done, partial = resumed_rows(prep)
    lens = [t.prompt_tokens + partial.get(t.id, 0) for t in ok if t.id not in done and partial.get(t.id, 0) < G]
    if not lens:  # nothing left to run (the engine stops before any weight): the job as a first run
        lens = [t.prompt_tokens for t in ok]
    return Workload.from_lengths(lens, G, name=job.name, sampling=job.generation.temperature > 0)


def resumed_rows(prep: "Prepared") -> tuple[set, dict]:
    """(ids that have a record, id -> tokens of its partial generation) of a generation job's earlier runs: its results
    file and its partial sidecar (``<stem>.partial.jsonl``, the engine's checkpoints), read only, once per
    :class:`Prepared`. Empty for a first run, an in-memory job, or files the engine will refuse (it says why)."""
    got = getattr(prep, "_resumed_rows", None)
    if got is not None:
        return got
    from ..data.writer import WriterError, read_partials, read_results

    job, done, partial = prep.job, set(), {}
    out = getattr(job, "output", None)
    if job.task == "generate" and out is not None:
        try:
            if os.path.exists(out.path):
                done = {r.get("id") for r in read_results(out.path)}
            partial = {i: len(p) for i, p in read_partials(out.partial_path).items() if i not in done and p}
        except (OSError, ValueError, WriterError):  # a corrupt file: the engine's own check names it
            done, partial = set(), {}
    prep._resumed_rows = (done, partial)
    return done, partial


def job_workload(job_path: str, overrides: Optional[dict] = None):
    """Workload of a job YAML (with ``--set`` ``overrides``): its requests tokenized exactly as ``moe-batch run`` would
    (no weights loaded)."""
    from ..config import load_job

    return job_workload_from_prepared(Prepared(load_job(job_path, overrides)))


_DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _named(job, msg: str) -> str:
    label = getattr(job, "source", None) or getattr(job, "config_path", None)
    return f"{label}: {msg}" if label else msg


def check_stop_token_ids(job, spec, where: Optional[str] = None) -> None:
    """ConfigError (a ValueError) naming the field when a generate job's ``generation.stop_token_ids`` holds an id
    outside the model's vocabulary ``[0, spec.vocab_size)`` (the ids its logits can give); before any weight is read.
    ``where``: the field as the caller names it (default ``<job>: generation.stop_token_ids``)."""
    from ..config import ConfigError

    if job.task != "generate":
        return
    V = spec.vocab_size
    for i, t in enumerate(job.generation.stop_token_ids):
        if not 0 <= t < V:
            field = f"{where}[{i}]" if where else _named(job, f"generation.stop_token_ids[{i}]")
            raise ConfigError(f"{field}: {t} is outside the model's vocabulary [0, {V}) (the ids it can generate)")


GPU_PROFILE_VERSION = 4  # in a cached GPU profile's file name: bumped when HardwareProfile's measured fields change
#   (2: host_issue_by_family, session 40; 3: gpu_context_bytes, session 41: a v2 file lacks it, so a host measures
#   once more rather than plan with the 1 GiB default reserve; an older install reading v3 would refuse its new key;
#   4: session 45's layer look-ahead changes the decode the host issue probes run, so a v3 file's host issue times
#   were measured on another schedule)


def gpu_profile_path(device: str) -> str:
    """Where ``moe-batch profile`` caches this host's measured profile for the CUDA card named ``device``:
    ``<cache>/gpu-profiles/v<GPU_PROFILE_VERSION>-<card>-<CPU machine key>.yaml`` under the package cache directory
    (``$LIGHTNING_MOE_CACHE``, default ``~/.cache/lightning-moe``): the card, the CPU, its threads and torch."""
    import re

    from ..model.tiny import default_cache_dir
    from ..pipeline.cpu_profile import machine_key

    key = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device} {machine_key()}").strip("_")
    return os.path.join(default_cache_dir(), "gpu-profiles", f"v{GPU_PROFILE_VERSION}-{key}.yaml")


def cached_gpu_profile(job) -> Optional[str]:
    """The path of this host's cached ``moe-batch profile`` for a CUDA job's card (:func:`gpu_profile_path`), or None
    (a job on the CPU, no CUDA, none measured yet)."""
    name = device_name(job.device)
    path = gpu_profile_path(name) if name else None
    return path if path and os.path.isfile(path) else None


def job_hardware(job, log=None):
    """The hardware profile a cgopipe job plans and runs with: its ``hardware`` (a preset or a profile YAML); else, on
    CUDA, this host's profile cached by ``moe-batch profile`` (:func:`cached_gpu_profile`), measured now and cached
    when there is none (:func:`measure_gpu_profile`, once per card and CPU); else (no CUDA here: a plan made on
    another machine) the h200 preset. :func:`hardware_note` says which, when the job names none."""
    from ..policy.hardware import HardwareProfile, get_preset, resolve_hardware

    if getattr(job, "hardware", None):
        return resolve_hardware(job.hardware)
    name = device_name(job.device)
    if name is None:
        return get_preset("h200")
    cached = cached_gpu_profile(job)
    if cached:
        return HardwareProfile.load(cached)
    return measure_gpu_profile(job.device, name, log)


def measure_gpu_profile(device: str, name: str, log=None):
    """Measure this host as ``moe-batch profile`` does (PCIe, GEMM, HBM, the expert kernels, CPU attention, the
    executor's host issue times; ~30 s; in a child process on CUDA, :mod:`.measure_child`), cache it for the card
    ``name`` (:func:`save_gpu_profile`) and return it. Unmeasured fields come from the preset of the card's family
    (``gpu.PRESET_BY_DEVICE_NAME``, else h200); the GPU memory is the card's. Where the measurement itself fails,
    that preset, with a line saying so."""
    from ..policy.hardware import get_preset
    from .measure_child import measure

    log = sys.stderr if log is None else log  # read at call time: a default bound at import outlives its stream
    preset = preset_for_device_name(name) or "h200"
    print(f"moe-batch: this host's {name} has no measured profile yet: measuring it now (~30 s, once; later jobs "
          f"plan with {gpu_profile_path(name)}; a job's `hardware:` skips this)", file=log, flush=True)
    try:  # in a child process on CUDA, the job's card ("cuda:1") current there; the generic host probe only (the
        #   job's own: with_model_host_probe)
        prof = measure("profile", device, gpu_preset=preset, gpu_memory=device_memory(device))
    except (RuntimeError, ValueError, OSError) as e:  # torch's CUDA errors are RuntimeErrors
        print(f"moe-batch: measuring this host failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); planning "
              f"with the {preset} preset", file=log, flush=True)
        return dataclasses.replace(get_preset(preset), gpu_memory=device_memory(device))
    if _profiler_recording():  # its buffers and callbacks are in every number: this job's, not this host's
        print(f"moe-batch: {gpu_profile_path(name)}: not written (a torch profiler is recording in this process); "
              f"this job plans with the profile just measured", file=log, flush=True)
        return prof
    save_gpu_profile(prof, name, f"moe-batch profile (first job on this host), {prof.date}\nhost: {prof.host}\n"
                     f"{prof.source}")
    return prof


def save_gpu_profile(prof, name: str, header: str) -> str:
    """Write ``prof`` (measured on the CUDA card ``name``) to this host's cache (:func:`gpu_profile_path`), where jobs
    that name no hardware find it; returns the path."""
    path = gpu_profile_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    prof.save(tmp, header=header)
    os.replace(tmp, path)
    return path


def missing_expert_rates(job, prep, hw) -> Optional[str]:
    """The ``weights`` ("dense" | "mxfp4") of the ``expert_ffn_rates`` entries the job's plan (the HRM's routed-expert
    term) and ``expert_ffn: auto`` read for its model's expert shape (D, F, E, k) at its compute dtype, when ``hw`` has
    none of them: "mxfp4" for MXFP4 pages kept packed (:func:`job_expert_pages`), else "dense" (a quantized
    checkpoint's pages are dequantized to the compute dtype first). None when ``hw`` has them, or none are read: a
    model with no MoE layer, or dense experts the grouped kernels cannot compute (gpt-oss's biases: the torch loop
    runs, pipeline.expert_ffn.grouped_kernels_refusal)."""
    from ..pipeline.expert_ffn import grouped_kernels_refusal

    spec = prep.spec
    if spec.num_moe_layers == 0:
        return None
    weights = "mxfp4" if job_expert_pages(job, prep) == "mxfp4" else "dense"
    if weights == "dense" and grouped_kernels_refusal(spec) is not None:
        return None
    shape = (spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k)
    return None if hw.has_expert_ffn_rates(*shape, _DT[job.dtype], weights) else weights


def with_model_expert_rates(job, prep, hw, log=None):
    """``hw`` completed for the job's model: where ``hw`` is this CUDA host's measured profile (a job that names no
    hardware; :func:`cached_gpu_profile`, cached or just measured) and lacks the expert FFN rates the job reads
    (:func:`missing_expert_rates`), they are measured now on the job's device, in a child process on CUDA
    (:mod:`.measure_child`; profiler.measure_shape_expert_ffn_rates: the probes and token buckets of ``moe-batch
    profile``; once per card, CPU, shape, dtype and page format), added and the cache written back
    (:func:`save_gpu_profile`); one line says so. ``hw`` as it was for a job that names hardware, off CUDA, a
    preset (this host's measurement failed), a profile that has them, or where measuring them fails (one line says
    so: the job plans and runs without them)."""
    from .measure_child import measure

    cached = None if getattr(job, "hardware", None) else cached_gpu_profile(job)
    weights = missing_expert_rates(job, prep, hw) if cached else None
    if weights is None:
        return hw
    log = sys.stderr if log is None else log  # read at call time: a default bound at import outlives its stream
    s, dt = prep.spec, _DT[job.dtype]
    shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
    what = (f"{s.name}'s expert shape (D {shape[0]}, F {shape[1]}, {shape[2]} experts, top-{shape[3]}) in {dt}"
            + (" over MXFP4 pages" if weights == "mxfp4" else ""))
    print(f"moe-batch: this host's profile {cached} has no expert FFN rates of {what}: measuring them now on "
          f"{job.device} (once; the plan and expert_ffn: auto use them; a job's `hardware:` skips this)",
          file=log, flush=True)
    try:
        rates = measure("expert_rates", job.device, shape=list(shape), dtype=dt, weights=weights)  # (a child on CUDA)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory on a small card: the job runs without them
        print(f"moe-batch: measuring them failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
              f"); planning with {cached} as it was (no measured rate for this shape: the HRM prices these experts "
              f"at the profile's gpu_expert_flops or GEMM peak, expert_ffn: auto runs Triton)", file=log, flush=True)
        return hw
    prof = dataclasses.replace(hw, expert_ffn_rates=hw.expert_ffn_rates + tuple(rates),
                               source=f"{hw.source}; expert FFN rates of {what} measured by a job's plan")
    return _cache_job_measurement(prof, job, cached, "the rates", log)


def _cache_job_measurement(prof, job, cached: str, what: str, log):
    """``prof`` (this host's profile with what a job's plan just measured) written back to the cache
    (:func:`save_gpu_profile`); a read-only cache, or a torch profiler recording in this process (its buffers count
    outside the allocator, its callbacks slow every launch: not this host's numbers), says so in one line and the job
    plans with ``prof`` anyway."""
    if _profiler_recording():
        print(f"moe-batch: {cached}: not updated (a torch profiler is recording in this process); this job plans "
              f"with {what} just measured", file=log, flush=True)
        return prof
    try:
        save_gpu_profile(prof, device_name(job.device), f"moe-batch profile, {prof.date}\nhost: {prof.host}\n"
                         f"{prof.source}")
    except OSError as e:
        print(f"moe-batch: {cached}: not updated ({e}); this job plans with {what} just measured", file=log,
              flush=True)
    return prof


def missing_host_probe(job, prep, hw) -> Optional[str]:
    """The host_issue_by_family key (hardware.host_probe_key: the model's family and its expert pages' format) whose
    probe prices the job's decode host term, when ``hw`` has a host stage but no entry under that key and the
    profiler has a probe of it (profiler.host_probe_keys; a Mixtral job's dense key is the generic probe itself);
    else None."""
    from ..pipeline.profiler import host_probe_keys
    from ..policy.hardware import host_probe_key
    from ..policy.hrm import has_host_stage

    if not has_host_stage(hw) or prep.spec.num_moe_layers == 0:
        return None
    if getattr(job, "task", "generate") == "score" or job.generation.max_new_tokens <= 1:
        return None  # no decode step: the host term (H6') prices nothing
    key = host_probe_key(prep.spec.model_type, job_expert_pages(job, prep))
    return key if key in host_probe_keys() and key not in dict(hw.host_issue_by_family) else None


def with_model_host_probe(job, prep, hw, log=None):
    """``hw`` completed with the job's own host issue probe: where ``hw`` is this CUDA host's measured profile (a job
    that names no hardware) and lacks the job's key (:func:`missing_host_probe`), the probe runs now on the job's
    device, in a child process on CUDA (:mod:`.measure_child`; profiler.measure_host_issue; once per card, CPU, family
    and expert format), is added to host_issue_by_family and the cache written back; one line says so. ``hw`` as it
    was otherwise, or where the probe fails (one line: the job's host term then takes the fallback probe,
    HardwareProfile.host_issue_for)."""
    from .measure_child import measure

    cached = None if getattr(job, "hardware", None) else cached_gpu_profile(job)
    key = missing_host_probe(job, prep, hw) if cached else None
    if key is None:
        return hw
    log = sys.stderr if log is None else log  # read at call time: a default bound at import outlives its stream
    print(f"moe-batch: this host's profile {cached} has no host issue probe {key!r}: measuring it now on {job.device} "
          f"(once; the HRM's host term of {prep.spec.name}; a job's `hardware:` skips this)", file=log, flush=True)
    try:
        h = tuple(measure("host_issue", job.device, probe=key))  # in a child process on CUDA, the job's card current
    except Exception as e:  # noqa: BLE001 - the job plans with the fallback probe
        print(f"moe-batch: the host issue probe {key!r} failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200] if str(e) else ''}); planning with {cached} as it was", file=log,
              flush=True)
        return hw
    prof = dataclasses.replace(hw, host_issue_by_family={**dict(hw.host_issue_by_family), key: h},
                               source=f"{hw.source}; host issue probe {key} measured by a job's plan")
    return _cache_job_measurement(prof, job, cached, "the probe", log)


def with_model_measurements(job, prep, hw, log=None):
    """``hw`` completed for the job's model on this host: its expert FFN rates (:func:`with_model_expert_rates`),
    then its host issue probe (:func:`with_model_host_probe`)."""
    return with_model_host_probe(job, prep, with_model_expert_rates(job, prep, hw, log), log)


def job_gpu_budget(job, hw) -> int:
    """GPU bytes a job plans for: its ``gpu_memory``; else its CUDA device's memory, no more than ``hw``'s card (a
    profile of a smaller card is kept to); else ``hw``'s card."""
    return job.gpu_memory or min(device_memory(getattr(job, "device", "cpu")) or hw.gpu_memory, hw.gpu_memory)


def hardware_note(job, hw) -> Optional[str]:
    """A line for a job that names no hardware: the profile :func:`job_hardware` took."""
    if getattr(job, "hardware", None):
        return None
    cached = cached_gpu_profile(job)
    if cached:
        return f"note: the job names no hardware: planned with this host's measured profile {cached} (moe-batch profile)"
    name = device_name(job.device)
    if name is None:
        return (f"note: the job names no hardware and this machine has no CUDA device: planned for the {hw.name} "
                f"preset; on the GPU host the job plans with that host's measured profile")
    return (f"note: the job names no hardware: planned for the {hw.name} preset (device: {name}; measuring this "
            f"host failed)")


def job_expert_pages(job, prep) -> str:
    """The format the job's expert pages move (and the HRM prices them) in: a quantized checkpoint's scheme; "mxfp4"
    for gpt-oss's MXFP4 experts under a single-process executor (the expert-parallel one reads them dequantized:
    ModelRunner.load_weights(packed_experts=False)); else the job's dtype ("bf16", "fp16", "fp32"). The planner's
    ``weight_quant`` (:func:`policy_for_job`)."""
    from ..model.quantized import checkpoint_expert_scheme

    wq = checkpoint_expert_scheme(prep.model_path)
    if wq == "mxfp4" and getattr(job, "gpus", 1) > 1:
        wq = None
    return wq or _DT[job.dtype]


def policy_for_job(job, prep, hw=None):
    """The job's Policy: ``policy: auto`` plans with the MILP (generation; its solves kept in and read from the
    solve cache, milp.default_solve_cache) or plan_scoring (scoring) for the job's real lengths, the job's hardware
    ``hw`` (default: :func:`job_hardware`) and ``gpu_memory``/``cpu_memory``; a path loads a policy YAML; a mapping
    gives explicit fields (unknown keys are errors naming the job file and key; ``prefill_mu`` defaults to ``mu``,
    the formats to the job's dtype and the checkpoint's expert pages).

    Returns (Policy, Estimate or None). Raises PlanInfeasible / PolicyError / ValueError with one clear line.
    """
    from ..policy.milp import default_solve_cache, plan
    from ..policy.policy import Budgets, Policy, check_cpu_budget, check_gpu_budget

    dt, wq = _DT[job.dtype], job_expert_pages(job, prep)
    if isinstance(job.policy, dict):
        fields = dict(job.policy)
        fields.setdefault("dtype", dt)
        fields.setdefault("weight_quant", wq)
        fields.setdefault("prefill_mu", fields.get("mu", 1))
        fields.setdefault("gpus", getattr(job, "gpus", 1))
        return Policy.from_dict(fields, where=_named(job, "policy")), None
    if isinstance(job.policy, str) and job.policy != "auto":
        return Policy.load(job.policy), None
    if is_cpu_job(job) and job.task == "generate":  # everything on the CPU: the CPU executor's roofline plans it
        return plan_cpu_job(job, prep.spec, job_workload_from_prepared(prep), wq)
    hw = hw if hw is not None else job_hardware(job)
    try:  # the job's caps must fit the card and the machine it plans for
        if job.gpu_memory:
            check_gpu_budget(job.gpu_memory, hw)
        if job.cpu_memory:
            check_cpu_budget(job.cpu_memory, hw)
    except ValueError as e:  # name the job file, as the config errors do
        raise ValueError(_named(job, str(e))) from None
    budgets = Budgets.for_hardware(hw, dtype=dt, weight_quant=wq, gpus=getattr(job, "gpus", 1),
                                   gpu_memory=job_gpu_budget(job, hw),
                                   **({"cpu_memory": job.cpu_memory} if job.cpu_memory else {}))
    return plan(prep.spec, hw, job_workload_from_prepared(prep), budgets, job_fit=True, solve_cache=default_solve_cache())


@dataclass(frozen=True)
class JobPlan:
    """What a cgopipe job runs with, decided before any weight is read."""

    policy: object  # policy.Policy
    estimate: object  # hrm.Estimate of the policy for the job's workload (throughput and memory)
    gpu_budget: int  # bytes the policy must fit on the GPU (the job's gpu_memory, else the card's)
    cpu_budget: int  # bytes the policy must fit on the host (the job's cpu_memory, else the hardware's)
    hardware: object  # policy.hardware.HardwareProfile the job plans and runs with (job_hardware, resolved once a job)


def plan_job(job: Job, prep: "Prepared") -> JobPlan:
    """The cgopipe job's policy (:func:`policy_for_job`) with its HRM estimate for the job's real workload, checked
    against the GPU and host budgets with the memory model (hrm.memory_estimate: every allocation of every phase).

    Runs before any weight is loaded. Raises PolicyError (one line naming the policy, its predicted peak and phase,
    and the budget) when a policy -- the planner's, a policy file's or an inline mapping's -- does not fit. The job's
    hardware profile is resolved here, once (:func:`job_hardware`; this host's measured profile completed with the
    model's expert FFN rates and host issue probe: :func:`with_model_measurements`), and travels in the JobPlan.
    """
    hw = with_model_measurements(job, prep, job_hardware(job))
    policy, est = policy_for_job(job, prep, hw)
    return check_plan(job, prep, policy, est, hw)


def _cap_need(jplan: JobPlan) -> tuple:
    """(the plan's largest GPU phase, its bytes inside torch's allocator: tensors, fragmentation allowance and library
    workspaces, everything but what the allocator reserve stands for)."""
    from ..policy.policy import LIBRARY_WORKSPACE

    m = jplan.estimate.memory
    phase = max(m.gpu_phases, key=m.phase_total)
    return phase, m.phase_total(phase) - jplan.policy.gpu_reserve + LIBRARY_WORKSPACE


def fit_plan_to_cap(job: Job, prep: "Prepared", jplan: Optional[JobPlan], cap: Optional[dict], log=None):
    """The plan a capped job runs with, once its cap is applied (app.gpu.apply_gpu_cap's ``cap``: torch's allocator
    gets gpu_memory minus what this process holds outside it): ``jplan`` where its largest phase fits that limit; for
    ``policy: auto`` where it does not (the process holds more outside the allocator than the plan reserved: the
    CUDA context grows with every kernel family a process loads, and the profile's gpu_context_bytes is measured
    after its probes only), the plan again with the measured outside bytes as the profile's gpu_context_bytes, and
    this host's cached profile records them for the next job. Then :func:`check_gpu_cap`."""
    if cap and jplan is not None and jplan.estimate is not None and job.policy in (None, "auto") \
            and _cap_need(jplan)[1] > cap["torch_limit_bytes"]:
        log = sys.stderr if log is None else log
        outside = cap["outside_torch_bytes"]
        hw = dataclasses.replace(jplan.hardware, gpu_context_bytes=max(outside, jplan.hardware.gpu_context_bytes))
        print(f"moe-batch: this process holds {outside / 2**30:.2f} GiB of the GPU outside torch's allocator, more than "
              f"the plan reserved ({jplan.policy.gpu_reserve / 2**30:.2f} GiB): planning again with it", file=log,
              flush=True)
        cached = cached_gpu_profile(job) if not getattr(job, "hardware", None) else None
        if cached:
            _cache_job_measurement(hw, job, cached, "its GPU context", log)
        policy, est = policy_for_job(job, prep, hw)
        jplan = check_plan(job, prep, policy, est, hw)
    check_gpu_cap(job, jplan, cap)
    return jplan


def _profiler_recording() -> bool:
    """Whether a torch profiler records in this process (benchmarks/profile_prefill.py runs a job under one): what a
    job measures then (its context: the profiler's device buffers count outside the allocator; rates and host issue
    times: its callbacks slow every launch) is not this host's, and the cached profile is not written."""
    import torch

    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def check_gpu_cap(job: Job, jplan: Optional[JobPlan], cap: Optional[dict]) -> None:
    """Before any weight is read: the plan's largest GPU phase (its tensors, fragmentation allowance and library
    workspaces: everything but what the allocator reserve stands for) must fit what the cap left torch's allocator
    (``cap``: app.gpu.apply_gpu_cap's result, ``torch_limit_bytes`` = gpu_memory minus what this process holds outside
    the allocator). Raises PolicyError (one line) when the process holds more outside the allocator than the plan
    reserved and the phase no longer fits: the run would end out of memory (the GPU host, session 41: a 1.34 GiB
    context against the 1 GiB default reserve)."""
    from ..policy.policy import PolicyError, format_bytes

    if not cap or jplan is None or jplan.estimate is None:
        return
    reserve = jplan.policy.gpu_reserve
    phase, need = _cap_need(jplan)
    if need > cap["torch_limit_bytes"]:
        raise PolicyError(_named(job, f"the policy's predicted {phase} tensors {format_bytes(need)} do not fit the "
                                      f"{format_bytes(cap['torch_limit_bytes'])} gpu_memory {format_bytes(cap['cap_bytes'])} "
                                      f"leaves torch: this process holds {format_bytes(cap['outside_torch_bytes'])} "
                                      f"outside its allocator (CUDA context), the plan reserved {format_bytes(reserve)}; "
                                      f"measure this host (moe-batch profile: its gpu_context_bytes sizes the reserve) "
                                      f"or give the job's hardware profile a gpu_context_bytes"))


def check_plan(job: Job, prep: "Prepared", policy, est=None, hw=None) -> JobPlan:
    """``policy`` for the job's real workload on hardware ``hw`` (default: :func:`job_hardware`): its budgets set (the
    job's caps, else the policy's, the device's or the hardware's), checked with the memory model, and its HRM
    estimate (``est`` when the planner made one for this workload). Raises PolicyError (one line) when it does not
    fit. :func:`plan_job`'s second half; the Python API also asks it whether the policy of an executor it keeps fits
    a later call's workload."""
    from ..policy import hrm
    from ..policy.policy import PolicyError, format_bytes

    hw = hw if hw is not None else job_hardware(job)
    gpu = job.gpu_memory or policy.gpu_budget or job_gpu_budget(job, hw)
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
    if is_cpu_job(job) and job.task == "generate":  # the CPU executor's roofline, the memory model's peaks
        est = dataclasses.replace(est or cpu_estimate(job, prep.spec, workload, policy),
                                  memory=hrm.memory_estimate(policy, prep.spec, workload))
    est = hrm.evaluate(policy, prep.spec, hw, workload) if est is None else est
    return JobPlan(policy, est, gpu, cpu, hw)


def cpu_prediction(job, prep, jplan=None, log=None):
    """The CPU estimate a run of a generation job on the CPU reports: its cgopipe plan's (``jplan``), else the serial
    executor's for the job's batches; None off the CPU, for scoring, or with no valid request. Measures and caches
    the CPU profile on first use (before anything of the run is timed)."""
    log = sys.stderr if log is None else log
    if not is_cpu_job(job) or job.task != "generate" or not any(t.error is None for t in prep.treqs):
        return None
    if jplan is not None:
        return jplan.estimate
    if job.executor != "serial" or getattr(job, "gpus", 1) > 1:
        return None
    return cpu_estimate(job, prep.spec, job_workload_from_prepared(prep), log=log)
