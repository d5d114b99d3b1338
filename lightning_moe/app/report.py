"""The run report's parts: throughput and wall times, the memory block (predicted next to measured per phase), the
out-of-memory line, the runs of a resumed job and their totals, and the human-readable summary."""

from __future__ import annotations

import json
import os
import platform
import resource
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional

from ..config import Job
from ..pipeline import scoring
from ..policy.hardware import format_bytes, host_probe_line
from ..policy.hrm import cpu_attention_kv_rate, dram_sharing
from .plan import hardware_note

if TYPE_CHECKING:
    from ..pipeline.executor import RunStats
    from .gpu import PhasePeaks
    from .plan import JobPlan, Prepared


REPORT_EVERY_S = 30.0  # at checkpoints, the report (its runs list) is rewritten at most this often


def report_head(job: Job, prep: Prepared, results: str, skipped: int, partials_file, partials: dict) -> dict:
    """The run report as a run starts (status "running"): the job, its model and settings, its requests (``skipped``:
    already in ``results``) and the partial generations it resumes (``partials_file``: the sidecar, None for a score
    job)."""
    return {
        "job": job.name, "config": job.config_path, "task": job.task, "mode": job.score.mode if job.score else None,
        "model": job.model, "model_path": prep.model_path, "device": job.device, "dtype": job.dtype,
        "executor": job.executor, "shard": list(job.shard) if job.shard else None, "host": platform.node(),
        "host_load_at_start": host_load(),
        "requests_in_input": prep.n_input, "requests_in_shard": len(prep.treqs), "skipped_already_done": skipped,
        "results": results, "status": "running",
        "expert_parallel": {"processes": job.gpus, "backend": "nccl" if job.device.startswith("cuda") else "gloo"}
        if job.gpus > 1 else None,
        "partials": {"path": partials_file.path, "resumed_sequences": len(partials),
                     "resumed_tokens": sum(map(len, partials.values()))} if partials_file is not None else None,
    }


def predicted_report(job: Job, jplan: JobPlan, spec=None) -> dict:
    """The run report's ``predicted`` block: the HRM's tokens/s and binding stages for the plan's estimate, the
    hardware profile it planned with (``jplan.hardware``), and the notes on what the prediction stands on (the
    profile a job that names none got; what the estimate leaves out). ``spec`` (the model's): also the valid-KV rate
    of its CPU attention the HRM allows (``cpu_attention_rate``)."""
    est, hw = jplan.estimate, jplan.hardware
    rate = cpu_attention_kv_rate(spec, hw, jplan.policy.dtype) if spec is not None else None
    return {"prefill_tokens_per_s": est.prefill_tok_s, "decode_tokens_per_s": est.decode_tok_s,
            "end_to_end_tokens_per_s": est.job_e2e_tok_s, "batch_end_to_end_tokens_per_s": est.e2e_tok_s,
            "job_batches": list(est.job_rows), "job_seconds": est.job_time or None,
            "refill_min_free": est.refill_min_free or None, "decode_binding": est.decode_binding,
            "prefill_binding": est.prefill_binding, "hardware": job.hardware or hw.name,  # the preset or the YAML
            "stages_seconds": {"prefill": dict(est.prefill_stages), "decode": dict(est.decode_stages)},
            "stages_span": "one batch of N",  # what stages_seconds covers (a CPU job's: the whole job)
            "stages_rule": "each layer its longest overlapped stage, head added",  # how the terms make the time
            "host_probe": est.host_probe or None,  # the profile's host probe that priced the decode host stage
            "cpu_attention_bandwidth": hw.cpu_attention_bandwidth,  # B/s of valid KV: (H5)'s rate, the cpu term's
            # B/s of valid KV (H5) allows this model: the bandwidth, or lower where its FLOP term binds (None: no spec)
            "cpu_attention_rate": rate,
            # (H5')'s point: the same rate while pinned H2D copies run beside it (None: unmeasured, no sharing rows)
            "cpu_attention_bandwidth_under_h2d": hw.cpu_attention_bandwidth_under_h2d if dram_sharing(hw) else None,
            "notes": [n for n in (hardware_note(job, hw), *est.notes) if n and n.startswith("note:")]}


def refill_report(calls: list, stats: RunStats, jplan: Optional[JobPlan] = None, spec=None, workload=None) -> Optional[dict]:
    """The report's ``refill`` block for a refilling executor's finished ``generate`` calls (``calls``:
    policy.refill_schedule.RefillCall, the lengths each request generated): the schedule replayed over the measured
    lengths (decode steps, prefill passes, drain steps, occupancy) next to the executor's counts, and, given the job
    plan, its spec and workload (a GPU job), ``predicted_from_lengths``: that schedule priced by the HRM (every pass at
    hrm.prefill_pass_time, every step at hrm.decode_step_time): the bound at the profile's peak rates for the job's
    real lengths, no measured time in it. None without a finished call."""
    if not calls:
        return None
    from ..policy import jobplan

    scheds = [c.schedule() for c in calls]
    sim = {k: sum(s.summary()[k] for s in scheds)
           for k in ("decode_steps", "prefill_passes", "drain_steps", "decode_tokens", "generated_tokens")}
    sim["slot_occupancy"] = (sim["decode_tokens"] / sum(s.decode_steps * s.slots for s in scheds)
                             if sim["decode_steps"] else None)
    out = {"min_free": calls[-1].min_free, "slots": calls[-1].slots, "schedule_from_lengths": sim,
           "measured": {"decode_steps": stats.decode_steps, "prefill_passes": stats.prefill_passes,
                        "slot_occupancy": stats.slot_occupancy}}
    if jplan is not None and spec is not None and workload is not None:
        pre = dec = 0.0
        for sch in scheds:
            p, d = jobplan.schedule_seconds(sch, jplan.policy, spec, jplan.hardware, workload)
            pre, dec = pre + p, dec + d
        out["predicted_from_lengths"] = {
            "prefill_seconds": pre, "decode_seconds": dec,
            "decode_tokens_per_s": sim["decode_tokens"] / dec if dec else None,
            "end_to_end_tokens_per_s": sim["generated_tokens"] / (pre + dec) if pre + dec else None}
    return out


def end_of_run(job: Job, spec, stats: RunStats, *, t_load: float, total: float, t_setup: float, parts: dict,
               written: int, errors: int, jplan: Optional[JobPlan], cap: Optional[dict], peaks: PhasePeaks,
               score_records: list) -> dict:
    """The report's fields a run's end fills in, whatever ended it: throughput and wall times (:func:`timing`, with
    ``other`` split by :func:`other_parts`), records and error records written, peak memory and the memory block, a
    score job's metrics, the executor's counters and stage times."""
    out = timing(stats, t_load, total, job.task, t_setup)
    out["other_seconds"] = other_parts(out["wall_seconds"], parts)
    out["records_written_this_run"] = written
    out["errors_recorded"] = errors
    out["peak_host_memory_bytes"] = peaks.host_overall() or peak_host_bytes()
    out["peak_gpu_memory_bytes"] = peaks.overall("allocated")
    out["memory"] = memory_report(jplan, cap, peaks, spec, job)
    if job.task == "score":
        out["metrics"] = scoring.summarize(score_records, job.score.mode)
    out["stats"] = {k: v for k, v in asdict(stats).items() if k != "extra"}
    out["stages"] = stats.extra
    return out


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
                   predicted_host_bytes=m.cpu_peak, predicted_host_phase=m.cpu_peak_phase,
                   predicted_host_components={"run": dict(m.cpu), "load": dict(m.cpu_load)})
    if peaks.host:
        out["measured_host_by_phase"] = {ph: dict(h) for ph, h in peaks.host.items()}
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
    killed = {"status": "killed", "counts": f"as of its last report save (at most {REPORT_EVERY_S:.0f} s before it "
                                            f"ended; its records are all in the results)"}
    return [dict(r, **killed) if r.get("status") == "running" else dict(r) for r in runs if isinstance(r, dict)]


def reconcile_killed_runs(runs: list[dict], records: int) -> list[dict]:
    """``runs`` with the records of the results file (``records`` at this run's start) that no entry counts given to
    the last killed run (its entry was saved before it wrote them), or to a new killed entry when there is none (a
    run killed before any report was saved)."""
    missing = records - sum(r.get("records_written") or 0 for r in runs)
    if missing <= 0:
        return runs
    runs = [dict(r) for r in runs]
    killed = [r for r in runs if r.get("status") == "killed"]
    if killed:
        killed[-1]["records_written"] = (killed[-1].get("records_written") or 0) + missing
        killed[-1]["counts"] = "records from the results file; times and tokens as of its last report save"
    else:
        runs.append({"started": None, "wall_seconds": None, "prompt_tokens": None, "generated_tokens": None,
                     "records_written": missing, "status": "killed",
                     "counts": "records from the results file; no report of this run was saved"})
    return runs


def job_totals(runs: list[dict], records: int) -> dict:
    """Sums over a job's runs: how many, wall seconds, prompt (prefilled) and generated tokens; records in the file."""
    def total(k):
        return sum(r.get(k) or 0 for r in runs)

    return {"runs": len(runs), "wall_seconds": total("wall_seconds"), "prompt_tokens": total("prompt_tokens"),
            "generated_tokens": total("generated_tokens"), "records": records}


def timing(s: RunStats, t_load: float, total: float, task: str, t_setup: float = 0.0) -> dict:
    """Throughput figures (tokens/s) and wall times (s) for the report. ``wall_seconds`` adds up: ``total`` = ``setup``
    (one-time: the embedded model's creation on first use, building or loading the native CPU attention kernel) +
    ``load`` (the weights, the executor) + ``warmup`` (the kernels' one-time costs before the first prefill: compile,
    plans; not in prefill tokens/s, in end-to-end) + ``prefill`` + ``decode`` + ``other`` (the rest: reading and
    tokenizing the requests, planning, writing records, checkpoints and the report)."""
    busy = s.warmup_seconds + s.prefill_seconds + s.decode_seconds
    other = max(0.0, total - t_setup - t_load - busy)
    return {
        "wall_seconds": {"total": total, "setup": t_setup, "load": t_load, "warmup": s.warmup_seconds,
                         "prefill": s.prefill_seconds, "decode": s.decode_seconds, "other": other},
        "prompt_tokens": s.prefill_tokens, "generated_tokens": s.generated_tokens,
        "prefill_tokens_per_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tokens_per_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
        "slot_occupancy": s.slot_occupancy,  # decode tokens / (decode steps x slots): continuous refill keeps it near 1
        "end_to_end_tokens_per_s": (s.generated_tokens if task == "generate" else s.prefill_tokens) / busy if busy else None,
    }


def _terms_lines(stages: Optional[dict], scoring: bool, span: str, rule: Optional[str] = None) -> list[str]:
    """The summary's lines of the HRM's terms (the ``predicted.stages_seconds`` block): per phase each stage's
    predicted seconds summed over layers (decode: and its steps), over ``span`` (``predicted.stages_span``: one batch
    of N for a GPU job, the whole job for a CPU job); a layer takes its longest overlapped stage, so the binding stage
    of the table is not always the largest sum; ``head`` is not overlapped. ``rule`` (``predicted.stages_rule``): how
    the terms make the predicted time (they are not added), printed after them."""
    lines = []
    for phase in ("prefill",) if scoring else ("prefill", "decode"):
        st = (stages or {}).get(phase)
        if st:
            over = "layers" if phase == "prefill" else "layers and steps"
            lines.append(f"  HRM terms, {phase} (predicted s, {span}, summed over {over}): "
                         + ", ".join(f"{k} {v:,.3f}" for k, v in st.items()) + (f"; time = {rule}" if rule else ""))
    return lines


def _cpu_attention_rate_line(stages: dict, pred: dict) -> list[str]:
    """The summary's line comparing the decode's CPU attention as it ran with the rate the HRM's ``cpu`` term divides
    by: valid KV bytes read (``stages.cpu_attention_valid_kv_bytes``) per second of the worker's attention
    (``stages.cpu_attention_compute``), against ``predicted.cpu_attention_bandwidth`` (the profile's); none where no
    micro-batch attended on the CPU or the report has no such rate."""
    kv, sec, rate = (stages.get("cpu_attention_valid_kv_bytes"), stages.get("cpu_attention_compute"),
                     pred.get("cpu_attention_bandwidth"))
    if not kv or not sec or not rate:
        return []
    under = pred.get("cpu_attention_bandwidth_under_h2d")
    beside = f"; {under / 1e9:,.1f} GB/s beside pinned H2D copies, the HRM's sharing point" if under else ""
    ran = f"  CPU attention as it ran: {kv / 1e9:,.1f} GB of KV in {sec:,.2f} s, {kv / sec / 1e9:,.1f} GB/s "
    flop = pred.get("cpu_attention_rate")
    if flop and flop < rate * (1 - 1e-9):  # the model's FLOPs per KV byte bind (H5) below the KV bandwidth
        return [ran + f"({kv / sec / flop:.2f} of {flop / 1e9:,.1f} GB/s, the rate of the HRM's cpu term: the profile's "
                f"CPU attention FLOP rate at this model's FLOPs per KV byte; its KV bandwidth {rate / 1e9:,.1f} GB/s"
                f"{beside})"]
    return [ran + f"({kv / sec / rate:.2f} of the profile's {rate / 1e9:,.1f} GB/s, the rate of the HRM's cpu term{beside})"]


def _end_to_end_binding(r: dict, pred: dict) -> str:
    """The end-to-end row's binding stage: the phase the HRM gives more seconds (prompt tokens over its prefill rate,
    generated tokens over its decode rate) and that phase's stage, e.g. ``decode: cpu-ops``; "-" without rates."""
    pre, dec = pred.get("prefill_tokens_per_s"), pred.get("decode_tokens_per_s")
    if not pre or not dec or not pred.get("decode_binding"):
        return "-"
    t_pre, t_dec = (r.get("prompt_tokens") or 0) / pre, (r.get("generated_tokens") or 0) / dec
    return f"prefill: {pred.get('prefill_binding')}" if t_pre > t_dec else f"decode: {pred['decode_binding']}"


def slot_occupancy(stats: Optional[dict], policy: Optional[dict]) -> Optional[float]:
    """How full the decode slots were: tokens of decode steps / (decode steps x N), N the policy's sequences in flight
    (``stats``: the report's ``stats``, ``policy``: its ``policy``). 1.0: every step decoded N live rows; a tail batch
    of a few rows, or rows finished early keeping their slot, lower it. None without a policy or a decode step."""
    N = (policy or {}).get("N")
    steps = (stats or {}).get("decode_steps")
    if not N or not steps:
        return None
    return (stats.get("decode_tokens") or 0) / (steps * N)


def other_parts(wall: dict, parts: dict) -> dict:
    """``wall_seconds.other`` split (s): ``model_files`` (the model's config and tokenizer read: the first
    transformers import lands here), ``requests`` (the requests read and tokenized), ``plan`` (the policy and its
    memory check), ``gpu_init`` (the CUDA context and the memory cap), ``run`` (the work loop outside warm-up, prefill
    and decode: records, checkpoints, detokenizing) and ``rest`` (the other's remainder: result-file checks, report
    writing). A part that did not happen this run is absent."""
    busy = wall["warmup"] + wall["prefill"] + wall["decode"]
    out = {k: parts[k] for k in ("model_files", "requests", "plan", "gpu_init") if k in parts}
    if "run" in parts:
        out["run"] = max(0.0, parts["run"] - busy)
    out["rest"] = max(0.0, wall["other"] - sum(out.values()))
    return out


_COUNTERS = ("_calls", "_threads", "_bytes")  # stage entries that count things, not seconds
_DIAGNOSTICS = ("cpu_attention_native_",)  # the native kernel's own counters (thread-seconds, lag): JSON only
_POLICY_NAMES = {"mu": "micro-batch rows (mu)", "n": "micro-batches (n)", "N": "sequences per batch (N)",
                 "prefill_mu": "prefill rows per chunk", "prefill_tokens": "prefill tokens per chunk",
                 "resident_experts": "resident experts", "n_gpu_attn": "GPU-attention micro-batches",
                 "expert_pages": "expert pages", "expert_ffn": "expert FFN", "host_pool_bytes": "host page pool",
                 "page_buffer_bytes": "GPU page buffers", "resident_bytes": "resident expert bytes"}


def _refill_lines(ref: Optional[dict], e2e: Optional[float]) -> list[str]:
    """The summary's lines of the ``refill`` block (:func:`refill_report`)."""
    if not ref:
        return []
    sim, meas = ref["schedule_from_lengths"], ref["measured"]
    out = [f"  refill (N {ref['slots']}, min_free {ref['min_free']}): over the measured lengths {sim['decode_steps']} "
           f"decode steps ({sim['drain_steps']} draining: after the last refill), {sim['prefill_passes']} prefill passes, "
           f"occupancy "
           f"{sim['slot_occupancy'] or 0:.2f}; the executor ran {meas['decode_steps']} steps, {meas['prefill_passes']} passes"]
    pl = ref.get("predicted_from_lengths")
    if pl and pl.get("end_to_end_tokens_per_s"):
        ratio = f" (measured / predicted {e2e / pl['end_to_end_tokens_per_s']:.2f})" if e2e else ""
        out.append(f"  predicted end-to-end over the measured lengths: {pl['end_to_end_tokens_per_s']:,.1f} tok/s"
                   f" (passes {pl['prefill_seconds']:,.2f} s + steps {pl['decode_seconds']:,.2f} s){ratio}")
    return out


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:,.2f}"


def _wrap_fields(head: str, fields: list[str], width: int = 118) -> list[str]:
    """``head`` + comma-separated ``fields`` wrapped at field boundaries, indented (a field never splits)."""
    out, cur = [], "  " + head
    for i, f in enumerate(fields):
        piece = f + ("," if i < len(fields) - 1 else "")
        if len(cur) + 1 + len(piece) > width and cur.strip():
            out.append(cur)
            cur = "    " + piece
        else:
            cur += (" " if cur.strip() else "") + piece
    out.append(cur)
    return out


def _table(rows: list[dict]) -> str:
    """A pandas-rendered table (right-aligned columns, '-' for missing), indented two spaces."""
    import pandas as pd  # lazy: only the printed summary needs it (start-up time)

    df = pd.DataFrame(rows, columns=list(rows[0])).fillna("-")
    return "\n".join("  " + line for line in df.to_string(index=False).splitlines())


def host_load() -> Optional[list]:
    """[1-minute load average, CPUs] of this host (None where the OS has no load average)."""
    try:
        return [round(os.getloadavg()[0], 2), os.cpu_count() or 1]
    except (AttributeError, OSError):
        return None


def _load_note(load) -> list:
    """A note when the host was busy as the run started (1-minute load >= half its CPUs): other processes then
    share the cores the measured rates assume, and measured / predicted reads low."""
    if not load or load[0] < 0.5 * load[1]:
        return []
    return [f"  note: the host's load average was {load[0]:g} on {load[1]} CPUs as the run started: other processes "
            f"shared the cores, so measured tok/s are not this machine's best (a CPU profile measured at such a "
            f"time understates the machine, and the prediction with it: `moe-batch profile --cpu` on a quiet host)"]


def format_report(r: dict, top_stages: int = 8) -> str:
    """Human-readable summary of a run report (printed at the end of ``moe-batch run``; the JSON keeps everything):
    throughput measured vs predicted per phase with the HRM's binding stage, the policy's fields by name, GPU
    memory predicted vs measured per phase against the cap, the largest stage times, metrics, where results are."""
    def num(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)

    w, pred = r.get("wall_seconds", {}), r.get("predicted") or {}
    scoring = r.get("task") == "score"
    lines = [
        f"job {r['job']}: {r['status']}  ({r['task']}{'/' + r['mode'] if r.get('mode') else ''}, {r['model']}, "
        f"{r['device']}, {r['dtype']}, executor {r['executor']})",
        f"  requests: {r['requests_in_shard']} in {'shard' if r.get('shard') else 'input'}, "
        f"{r['skipped_already_done']} already done, {r['records_written_this_run']} written now, "
        f"{r['errors_recorded']} error records; tokens: {r.get('prompt_tokens', 0):,} prompt, "
        f"{r.get('generated_tokens', 0):,} generated",
    ]
    if r.get("first_error"):
        lines.append(f"  first error record: {r['first_error']} (every error record is in the results file)")
    lines.append("")
    # each row's wall seconds are the span its tokens/s is over: end-to-end is warm-up + prefill + decode
    spans = {"prefill": w.get("prefill"), "decode": w.get("decode"),
             "end-to-end": sum(w.get(k) or 0.0 for k in ("warmup", "prefill", "decode")) if w else None}
    phases = [("prefill", "prefill_tokens_per_s", "prefill_binding")]
    if not scoring:
        phases += [("decode", "decode_tokens_per_s", "decode_binding"), ("end-to-end", "end_to_end_tokens_per_s", None)]
    rows = []
    for name, key, bind in phases:
        m, p = r.get(key), pred.get(key)
        rows.append({"phase": name, "measured tok/s": num(m), "predicted tok/s": num(p),
                     "measured / predicted": num(m / p, "{:.2f}") if m and p else "-",
                     "wall s": num(spans[name], "{:,.2f}"),
                     "bound by (HRM)": pred.get(bind) if bind else _end_to_end_binding(r, pred)})
    terms = _terms_lines(pred.get("stages_seconds"), scoring, pred.get("stages_span", "one batch of N"),
                         pred.get("stages_rule"))
    probe = [f"  {host_probe_line(pred['host_probe'])}"] if pred.get("host_probe") and not scoring else []
    lines += [_table(rows)] + terms + probe + _cpu_attention_rate_line(r.get("stages") or {}, pred)
    lines += [f"  {n}" for n in pred.get("notes", ())]
    lines += _load_note(r.get("host_load_at_start"))
    if pred.get("job_batches"):
        lines.append(f"  predicted end-to-end is the job's: {len(pred['job_batches'])} prefill pass(es) of "
                     f"{' + '.join(map(str, pred['job_batches']))} rows into {r.get('policy', {}).get('N', '?')} "
                     f"slots, every pass and decode step counted (N slots in steady state: "
                     f"{num(pred.get('batch_end_to_end_tokens_per_s'))} tok/s)")
    occ = r.get("slot_occupancy")
    if occ is not None:
        lines.append(f"  slot occupancy {occ:.2f} (decode tokens / (decode steps x N))")
    lines += _refill_lines(r.get("refill"), r.get("end_to_end_tokens_per_s"))
    lines.append("")
    if "setup" in w:
        lines += [f"  wall s: total {w['total']:,.2f} = setup {w['setup']:,.2f} (one-time: model creation, native "
                  f"kernel) + load {w['load']:,.2f} + warmup {w.get('warmup', 0.0):,.2f} (one-time: kernel compile, "
                  f"plans) + prefill {w['prefill']:,.2f} + decode {w['decode']:,.2f} + other {w['other']:,.2f}"]
        if r.get("other_seconds"):
            lines.append("  other s: " + ", ".join(f"{k} {v:,.2f}" for k, v in r["other_seconds"].items()))
        lines.append("")
    pol = r.get("policy")
    if pol:
        fields = [f"{_POLICY_NAMES.get(k, k)} {format_bytes(v) if k.endswith('_bytes') else v}" for k, v in pol.items()]
        lines += _wrap_fields("policy:", fields)
    mem = r.get("memory") or {}
    on_cpu = str(r.get("device", "")).startswith("cpu")
    if mem.get("predicted_by_phase") and not on_cpu:  # device cpu: the GPU model's bytes are in the host line below
        cap = mem.get("cap_bytes")
        meas = mem.get("measured_by_phase") or {}
        rows = []
        for ph, pb in mem["predicted_by_phase"].items():
            mb = meas.get(ph) or {}
            rows.append({"GPU memory (GiB)": ph, "predicted": _gib(pb), "measured allocated": _gib(mb.get("allocated")),
                         "measured reserved": _gib(mb.get("reserved")), "cap": _gib(cap)})
        lines += ["", _table(rows)]
    peak_gpu = r.get("peak_gpu_memory_bytes")
    host_pred = (r.get("memory") or {}).get("predicted_host_bytes")
    dev_pred = mem.get("predicted_peak_bytes") if on_cpu else None
    phase = mem.get("predicted_host_phase", "run")
    reserve = ((mem.get("predicted_host_components") or {}).get(phase) or {}).get("host reserve")
    lines.append(f"  peak memory: host {r['peak_host_memory_bytes'] / 2**30:.2f} GiB"
                 + (f" (predicted {host_pred / 2**30:.2f} GiB, {phase} phase"
                    + (f", of which {reserve / 2**30:.2f} GiB the planner's host reserve (policy cpu_reserve: an "
                       f"allowance for the process, not a measurement)" if reserve else "")
                    + (f"; and on top, {dev_pred / 2**30:.2f} GiB the GPU model counts, which device cpu holds in host "
                       f"memory" if dev_pred else "") + ")" if host_pred else "")
                 + (f", GPU {peak_gpu / 2**30:.2f} GiB" if peak_gpu is not None else ""))
    host_phases = mem.get("measured_host_by_phase") or {}
    if host_phases:  # where the host peak is, and how much of it is mapped files (reclaimable) rather than anon
        fields = [f"{ph} {_gib(h.get('peak_rss'))} (anon {_gib(h.get('anon'))}, file {_gib(h.get('file'))})"
                  for ph, h in host_phases.items()]
        lines += _wrap_fields("host GiB by phase: peak rss (anon, mapped files at its end):", fields)
    st = r.get("stages") or {}
    secs = {k: v for k, v in st.items()  # stages that took no measurable time are left to the JSON
            if isinstance(v, float) and v >= 5e-4 and not k.endswith(_COUNTERS) and not k.startswith(_DIAGNOSTICS)}
    if secs:
        top = sorted(secs.items(), key=lambda kv: -kv[1])[:top_stages]
        lines += _wrap_fields(f"stages (s, largest {len(top)} of {len(secs)}; all in the JSON):",
                              [f"{k} {v:.3f}" for k, v in top])
    if r.get("metrics"):
        lines.append("  metrics: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in r["metrics"].items()))
    lines.append(f"  results: {r['results']}")
    return "\n".join(lines)
