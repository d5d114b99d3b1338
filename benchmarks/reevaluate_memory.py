#!/usr/bin/env python3
"""Re-evaluate the session-9 GPU runs (run at commit 05e7164) with the current memory model.

For every case of ``run3-suite.jsonl`` / ``run4-sweep.jsonl`` that ran (status ok or OOM; refused cases are
skipped):

1. Recover the exact Policy of the run: in a subprocess with ``PYTHONPATH`` = a worktree of the old commit
   (``--old-tree``), rebuild the case's job as ``benchmarks/cli_sweep.py`` did (``suite_cases`` / ``sweep_cases``,
   ``machine_for``: device cuda, the h200-host profile, cpu_memory 100GiB, ``write_case``) over *hollow*
   checkpoints (config.json + tokenizer files only; the int4 one with the ``quantization`` section ``moe-batch
   quantize`` writes for D=4096, F=14336) and call that commit's ``runner.plan_job``. The recovered policy is
   checked against the row's summary (mu, n, prefill_mu, resident total, n_gpu_attn) and the old predicted
   allocated peak against the row's ``predicted_peak_bytes``.
2. With the current code, ``hrm.memory_estimate(policy, spec, workload)`` of that policy for the job's workload
   (``app.plan.job_workload_from_prepared``): the new predicted allocated peak and its phase.
3. Adjust the measured allocated peak for the page-buffer change (assumption: the buffers are the only
   allocation the executor change moved, and the measured peak contains both buffers):
   ``measured_adj = measured_allocated - (row page_buffer_bytes - current buffer bytes)``, the current buffer
   bytes computed exactly as ``pager.GpuPageBuffers`` would allocate them for the current executor's paging
   (``tiling_page_count`` pages; 256-byte aligned regions), without allocating tensors. The same computation with
   the old paging (n pages) is checked against the row's ``page_buffer_bytes``.
4. Print a Markdown table and write it to ``--md``.

Example:
  git -C /work/main worktree add /tmp/wt-05e7164 05e7164
  LIGHTNING_MOE_CACHE=/tmp/lmcache python3 benchmarks/reevaluate_memory.py --old-tree /tmp/wt-05e7164
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

GiB = 2**30
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RAW = os.path.join(HERE, "raw", "session9")


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["status"] in ("ok", "OOM")]


# ------------------------------------------------------------------------------------------------
# step 1: runs under PYTHONPATH=<old tree>
# ------------------------------------------------------------------------------------------------
def recover(old_tree: str, work: str, case_names: list[str]) -> list[dict]:
    """The old commit's plan of every named case: policy dict, job YAML path, old predicted peaks."""
    sys.path.insert(0, os.path.join(old_tree, "benchmarks"))
    import cli_sweep
    import make_checkpoint
    from lightning_moe.config import load_job
    from lightning_moe.data.tokenize import load_tokenizer
    from lightning_moe.kernels.quant import expert_page_layout
    from lightning_moe.model.quantized import SCALE_DTYPES
    from lightning_moe.pipeline.runner import Prepared, plan_job  # the old commit's module (app.plan now)
    from lightning_moe.policy import hrm
    import lightning_moe

    if not os.path.abspath(lightning_moe.__file__).startswith(os.path.abspath(old_tree) + os.sep):
        raise RuntimeError(f"lightning_moe imported from {lightning_moe.__file__}, not from {old_tree}")
    machine = cli_sweep.machine_for("suite", None, "100GiB")
    dims = machine.dims
    ckpts = {}
    for ck in ("bf16", "int4"):
        d = os.path.join(work, f"hollow-{ck}-L{dims.layers}-h{dims.hidden}-f{dims.intermediate}")
        os.makedirs(d, exist_ok=True)
        cfg = make_checkpoint.config_dict(dims)
        if ck == "int4":  # as lightning_moe/model/quantized.py's quantize writes it; page_bytes depends on D, F
            lay = expert_page_layout(dims.hidden, dims.intermediate, "int4", 128, SCALE_DTYPES["float16"])
            cfg["quantization"] = {"method": "lightning-moe-groupwise", "scheme": "int4", "group_size": 128,
                                   "scale_dtype": "float16", "page_bytes": lay.page_bytes}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        make_checkpoint.copy_tokenizer(d)
        ckpts[ck] = d
    words = cli_sweep.sj.one_token_words(load_tokenizer(ckpts["bf16"]))
    cases = {c.name: c for c in cli_sweep.suite_cases(True) + cli_sweep.sweep_cases()}
    out = []
    for name in case_names:
        case = cases[name]
        job_path, _, _ = cli_sweep.write_case(case, machine, ckpts, words, work, True)
        job = load_job(job_path)
        prep = Prepared(job)
        jp = plan_job(job, prep)
        m = hrm.memory_estimate(jp.policy, prep.spec, cli_sweep_workload(prep))
        out.append({"case": name, "job": job_path, "policy": jp.policy.to_dict(),
                    "resident_total": jp.policy.total_resident(prep.spec),
                    "old_pred_allocated": jp.estimate.memory.gpu_peak_allocated,
                    "old_pred_allocated_recomputed": m.gpu_peak_allocated})
    return out


def cli_sweep_workload(prep):
    from lightning_moe.pipeline.runner import job_workload_from_prepared  # the old commit's module (app.plan now)

    return job_workload_from_prepared(prep)


# ------------------------------------------------------------------------------------------------
# steps 2-3: current code
# ------------------------------------------------------------------------------------------------
def buffer_bytes(policy, spec, tiling: bool) -> int:
    """Bytes of the two GPU page buffers ``pager.GpuPageBuffers`` allocates for ``policy`` (no tensors made):
    the current executor's paging (``tiling``: ``tiling_page_count`` pages) or the old one (``n`` pages)."""
    import torch

    from lightning_moe.kernels.quant import expert_page_layout
    from lightning_moe.pipeline import pager

    counts = policy.resident_counts(spec)
    resident = frozenset((l, e) for l in range(spec.num_layers) for e in range(counts[l]))
    paged = pager.ExpertPaging(spec.num_layers, spec.num_experts, 1, resident).max_nonresident
    pages = pager.tiling_page_count(paged, max(1, policy.n)) if tiling else max(1, policy.n)
    paging = pager.ExpertPaging(spec.num_layers, spec.num_experts, pages, resident)
    if policy.weight_quant in ("int4", "int2", "int2-up"):
        lay = expert_page_layout(spec.hidden_size, spec.intermediate_size, policy.weight_quant, 128, torch.float16)
        specs = [("page", torch.uint8, (lay.page_bytes,))]
    else:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[policy.weight_quant]
        specs = pager.ffn_expert_specs(spec.intermediate_size, spec.hidden_size, dt)
    layout = pager.pool_page_layout(max(paging.experts_per_page, 1), specs)
    capacity = max((paging.layer_pages(l) for l in range(spec.num_layers)), default=0)
    one = 0
    for e in layout.entries:
        one = pager._align(one + capacity * e.nbytes)
    return 2 * one


def evaluate(rows: list[dict], recovered: list[dict]) -> tuple[list[dict], list[str]]:
    from lightning_moe.config import load_job
    from lightning_moe.app.plan import Prepared, job_workload_from_prepared
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Policy

    import lightning_moe

    if not os.path.abspath(lightning_moe.__file__).startswith(REPO + os.sep):
        raise RuntimeError(f"lightning_moe imported from {lightning_moe.__file__}, not from {REPO}")
    rec = {r["case"]: r for r in recovered}
    out, problems = [], []
    for row in rows:
        rc = rec[row["case"]]
        pd, s, mem = rc["policy"], row["policy"], row["memory"]
        prep = Prepared(load_job(rc["job"]))
        spec, wl = prep.spec, job_workload_from_prepared(prep)
        policy = Policy.from_dict({k: tuple(v) if isinstance(v, list) else v for k, v in pd.items()})
        got = (pd["mu"], pd["n"], pd["prefill_mu"], rc["resident_total"], pd["n_gpu_attn"])
        want = (s["mu"], s["n"], s["prefill_mu"], s["resident_experts"], s["n_gpu_attn"])
        if got != want:
            problems.append(f"{row['case']}: recovered (mu, n, prefill_mu, resident, g) {got} != run's {want}")
        if rc["old_pred_allocated"] != mem["predicted_peak_bytes"]:
            problems.append(f"{row['case']}: old predicted {rc['old_pred_allocated']} != run's {mem['predicted_peak_bytes']}")
        old_buf = buffer_bytes(policy, spec, tiling=False)
        if old_buf != s["page_buffer_bytes"]:
            problems.append(f"{row['case']}: old-paging buffer bytes {old_buf} != run's page_buffer_bytes {s['page_buffer_bytes']}")
        new_buf = buffer_bytes(policy, spec, tiling=True)
        m = hrm.memory_estimate(policy, spec, wl)
        meas = mem.get("measured_peak_allocated_bytes")
        adj = meas - (s["page_buffer_bytes"] - new_buf) if meas else None
        phases = {ph: v["allocated"] for ph, v in (mem.get("measured_by_phase") or {}).items() if ph != "load"}
        out.append({"case": row["case"], "status": row["status"], "policy": pd, "resident": rc["resident_total"],
                    "old_phase": mem.get("predicted_peak_phase"), "new_phase": m.gpu_peak_phase,
                    "meas_phase": max(phases, key=phases.get) if phases else None,
                    "old_pred": mem["predicted_peak_bytes"], "meas": meas, "adj": adj, "new_pred": m.gpu_peak_allocated,
                    "new_by_phase": {ph: m.phase_allocated(ph) for ph in m.gpu_phases},
                    "buf_old": s["page_buffer_bytes"], "buf_new": new_buf})
    return out, problems


# ------------------------------------------------------------------------------------------------
# step 4: table
# ------------------------------------------------------------------------------------------------
def markdown(res: list[dict], problems: list[str]) -> str:
    g = lambda b: "-" if b is None else f"{b / GiB:.2f}"  # noqa: E731
    r = lambda a, b: "-" if not a or not b else f"{a / b:.3f}"  # noqa: E731
    head = ["case", "policy (mu x n, resident, g, prefill_mu, prefill_tokens)", "peak phase (old / new / measured)",
            "old pred GiB", "meas alloc GiB (as run)", "buffers old -> new GiB", "meas adj GiB", "new pred GiB",
            "new/adj", "old/meas"]
    lines = ["# Session-9 GPU runs re-evaluated with the current memory model", "",
             "Made by `benchmarks/reevaluate_memory.py`: policies recovered by re-planning each job at 05e7164 (hollow "
             "checkpoints); new prediction = current `hrm.memory_estimate` of that policy (allocated peak); "
             "meas adj = measured allocated peak - (run's page buffers - current executor's page buffers, "
             "`tiling_page_count`, as `GpuPageBuffers` allocates them). OOM: the measured figure is the peak before the "
             "failed allocation.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for x in res:
        p = x["policy"]
        if x["adj"]:
            ratios.append(x["new_pred"] / x["adj"])
        case = x["case"] + (" (OOM)" if x["status"] == "OOM" else "")
        cells = [case, f"{p['mu']}x{p['n']}, r{x['resident']}, g{p['n_gpu_attn']}, pmu {p['prefill_mu']}, "
                       f"pt {p['prefill_tokens']}",
                 f"{x['old_phase']} / {x['new_phase']} / {x['meas_phase']}", g(x["old_pred"]), g(x["meas"]),
                 f"{g(x['buf_old'])} -> {g(x['buf_new'])}", g(x["adj"]), g(x["new_pred"]), r(x["new_pred"], x["adj"]),
                 r(x["old_pred"], x["meas"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if ratios:
        lines.append(f"new/adj over {len(ratios)} cases: min {min(ratios):.3f}, max {max(ratios):.3f}, "
                     f"median {statistics.median(ratios):.3f}")
    lines.append("")
    lines.append("Rebuild checks: " + ("all recovered policies match the runs' summaries, old predicted peaks equal "
                                       "the runs', old-paging buffer bytes equal the runs' page_buffer_bytes."
                                       if not problems else "; ".join(problems)))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--old-tree", required=True, help="worktree of the commit the runs used (05e7164)")
    ap.add_argument("--rows", nargs="+", default=[os.path.join(RAW, "run3-suite.jsonl"), os.path.join(RAW, "run4-sweep.jsonl")],
                    help="sweep jsonl files (default: session9 run3-suite and run4-sweep)")
    ap.add_argument("--work", default="/tmp/lmoe-reeval", help="where hollow checkpoints, data and jobs go")
    ap.add_argument("--md", default=os.path.join(RAW, "reevaluated-memory.md"), help="Markdown table output")
    ap.add_argument("--recover-only", action="store_true", help=argparse.SUPPRESS)  # the old-tree subprocess
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    rows = read_rows(a.rows)
    if a.recover_only:
        json.dump(recover(a.old_tree, a.work, [r["case"] for r in rows]), sys.stdout)
        return 0
    env = dict(os.environ, PYTHONPATH=os.path.abspath(a.old_tree))
    env.setdefault("LIGHTNING_MOE_CACHE", "/tmp/lmcache")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--recover-only", "--old-tree", a.old_tree,
                        "--work", a.work, "--rows", *a.rows], env=env, cwd=a.old_tree, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        return 1
    sys.path.insert(0, REPO)  # the current code
    res, problems = evaluate(rows, json.loads(p.stdout))
    md = markdown(res, problems)
    print(md)
    with open(a.md, "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
