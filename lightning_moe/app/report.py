"""The run report's parts: throughput and wall times, the memory block (predicted next to measured per phase), the
out-of-memory line, the runs of a resumed job and their totals, and the human-readable summary."""

from __future__ import annotations

import json
import os
import resource
from typing import TYPE_CHECKING, Optional

from ..config import Job

if TYPE_CHECKING:
    from ..pipeline.serial import RunStats
    from .gpu import PhasePeaks
    from .plan import JobPlan


def peak_host_bytes() -> int:
    """Peak resident set size of this process in bytes (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_report(jplan: Optional[JobPlan], cap: Optional[dict], peaks: PhasePeaks, spec, job: Job) -> dict:
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


def oom_message(phase: Optional[str], jplan: Optional[JobPlan], peaks: PhasePeaks, job: Job, spec, written: int,
                results: str) -> str:
    """The one line of an out-of-memory run: the phase, the policy, the predicted and measured peaks, the cap and
    what is saved."""
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


def previous_runs(job: Job, resumed: bool) -> list[dict]:
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


def job_totals(runs: list[dict], records: int) -> dict:
    """Sums over a job's runs: how many, wall seconds, prompt (prefilled) and generated tokens; records in the file."""
    def total(k):
        return sum(r.get(k) or 0 for r in runs)

    return {"runs": len(runs), "wall_seconds": total("wall_seconds"), "prompt_tokens": total("prompt_tokens"),
            "generated_tokens": total("generated_tokens"), "records": records}


def timing(s: RunStats, t_load: float, total: float, task: str) -> dict:
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
