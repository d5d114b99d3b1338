"""A CPU job's prediction: this machine's CPU profile (measured once, cached per machine) and the CPU executor's
roofline (policy.cpu_hrm) for the job's serial batches or cgopipe policy."""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

CPU_PROFILE_ENV = "LIGHTNING_MOE_CPU_PROFILE"  # a CPU profile YAML to use instead of the cached measurement
PROFILE_VERSION = 8  # in the cache file's name: bumped when CpuProfile's fields change or a rate is measured another
#   way (7: the head GEMMs timed cold; 8: scatter_bandwidth times the native row scatter), so versions keep their own
#   files (an older version would refuse newer keys)


def is_cpu_job(job) -> bool:
    """Whether the job runs everything on the CPU (``device: cpu``)."""
    return str(getattr(job, "device", "cpu")).startswith("cpu")


def cpu_profile_path(machine: Optional[str] = None) -> str:
    """Where this machine's measured CPU profile is cached: ``<cache>/cpu-profiles/<machine key>.yaml`` under the
    package cache directory (``$LIGHTNING_MOE_CACHE``, default ``~/.cache/lightning-moe``), named by the profile's
    version (``v<PROFILE_VERSION>-<machine key>.yaml``)."""
    from ..model.tiny import default_cache_dir
    from ..pipeline.cpu_profile import machine_key

    key = re.sub(r"[^A-Za-z0-9._-]+", "_", machine or machine_key()).strip("_")
    return os.path.join(default_cache_dir(), "cpu-profiles", f"v{PROFILE_VERSION}-{key}.yaml")


def measure_and_cache(log=None, path: Optional[str] = None):
    """Measure this machine's CPU profile now and write it to ``path`` (default: the cache); returns it."""
    log = sys.stderr if log is None else log  # read at call time: a default bound at import outlives its stream
    from ..pipeline.cpu_profile import measure_cpu_profile

    path = path or cpu_profile_path()
    from ..kernels.cpu_attention import cpu_attention_mode, native_built

    builds = cpu_attention_mode() != "sdpa" and not native_built()
    print("moe-batch: measuring this machine's CPU rates for the prediction (~10-60 s; cached for later runs"
          + ("; this includes compiling the native CPU attention kernel, once)" if builds else ")"), file=log, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof = measure_cpu_profile(directory=os.path.dirname(os.path.abspath(path)))
    if prof.load_average >= 0.5 * prof.cpu_cores:
        print(f"moe-batch: note: the host's load average was {prof.load_average:g} on {prof.cpu_cores} CPUs while its "
              f"rates were measured: the profile understates this machine, so predictions read low and measured / "
              f"predicted high; run `moe-batch profile --cpu` again on a quiet host", file=log, flush=True)
    tmp = f"{path}.tmp{os.getpid()}"
    prof.save(tmp, header=f"moe-batch CPU profile, {prof.date}\nmachine: {prof.machine}\n{prof.source}")
    os.replace(tmp, path)
    return prof


def cpu_profile(log=None):
    """The CPU profile the prediction uses: ``$LIGHTNING_MOE_CPU_PROFILE``'s YAML; else this machine's cached
    measurement (:func:`cpu_profile_path`); else (none, or one that no longer loads: an older version's fields) measured
    now and cached (:func:`measure_and_cache`)."""
    log = sys.stderr if log is None else log
    from ..policy.cpu_hrm import CpuProfile

    env = os.environ.get(CPU_PROFILE_ENV)
    if env:
        return CpuProfile.load(env)
    from ..policy.hardware import HardwareError

    path = cpu_profile_path()
    if os.path.isfile(path):
        try:
            return CpuProfile.load(path)
        except HardwareError as e:  # written by an older version (a field added since): measured again
            print(f"moe-batch: the cached CPU profile does not load ({e}); measuring again", file=log, flush=True)
    return measure_and_cache(log, path)


def cpu_estimate(job, spec, workload, policy=None, log=None):
    """The CPU executor's estimate (policy.cpu_hrm.estimate_cpu) of a generation job: serial batches of
    ``job.batch_size``, or cgopipe's ``policy``; None for a scoring job (not modelled)."""
    log = sys.stderr if log is None else log
    from ..policy.cpu_hrm import estimate_cpu

    if workload.scoring:
        return None
    dt = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[job.dtype]
    prof = cpu_profile(log)
    if policy is None:
        return estimate_cpu(spec, prof, workload, dt, "serial", job.batch_size)
    return estimate_cpu(spec, prof, workload, dt, "cgopipe", policy.N, policy.mu, policy.prefill_mu,
                        policy.prefill_tokens)


def cpu_predicted_report(est) -> dict:
    """The run report's ``predicted`` block of a CPU job's :class:`CpuEstimate`."""
    return {"prefill_tokens_per_s": est.prefill_tok_s, "decode_tokens_per_s": est.decode_tok_s,
            "end_to_end_tokens_per_s": est.e2e_tok_s, "decode_binding": est.decode_binding,
            "prefill_binding": est.prefill_binding, "hardware": est.profile,
            "stages_seconds": {"prefill": dict(est.prefill_stages), "decode": dict(est.decode_stages)},
            "stages_span": "the whole job",  # estimate_cpu sums its stages over every batch
            "stages_rule": "per layer visit ops + max(flops, memory) + stream",  # how the terms make the time
            "notes": [n for n in est.notes if n.startswith("note:")]}


def plan_cpu_job(job, spec, workload, weight_quant: str, log=None):
    """``policy: auto`` of a cgopipe job on the CPU: policy.cpu_hrm.plan_cpu for this machine's profile, under the
    job's ``cpu_memory`` (else the machine's memory). Returns (Policy, CpuEstimate)."""
    log = sys.stderr if log is None else log
    from ..policy.cpu_hrm import plan_cpu

    dt = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[job.dtype]
    prof = cpu_profile(log)
    return plan_cpu(spec, prof, workload, dt, job.cpu_memory or prof.host_memory or 2**62, weight_quant)
