#!/usr/bin/env python3
"""Kill and resume through the CLI: one cgopipe greedy generation job run through ``moe-batch run`` uninterrupted (the
reference), then again with SIGKILL at ``--kills`` random points of its decode, re-launched after each kill until a last
run resumes it to completion; the records of both are compared.

Every attempt is ``python3 -m lightning_moe.cli run JOB.yaml --no-progress`` in a subprocess (its output in
``<out>/ref.log``, ``kill.<k>.log``, ``kill.final.log``). A kill lands once the sidecar ``kill.partial.jsonl`` is new (a
sidecar left by a kill is compacted, i.e. replaced, before decode) and grew by a random number of lines, plus a small
random delay (``--seed``): the detection of tests/test_checkpoint.py. Compared by id: duplicates, the id sets, the share
of records whose ``output_ids`` equal the reference's and the position-wise token agreement. CPU float32: every record
is identical (the resume guarantee); GPU bf16: batches after a resume may be composed differently, so the rates are
reported, not asserted. Before each re-launch the sidecar's partials are read: every final record must begin with the
partial of every earlier kill for its id (``partial_prefix_mismatches``), and no attempt may end out of GPU memory (``oom_attempts``,
its log searched for "out of GPU memory"). ``--no-reference`` skips the uninterrupted run (the comparison is then
empty). Exit 0 when the job completed with all its records, no duplicate, no prefix mismatch and no out-of-memory,
else 1. Results go to
``--out``: ``kill_resume.json`` (attempts, comparison, both reports' status / runs / job_totals), ``kill_resume.md``.

Model: ``--model`` (a checkpoint directory, e.g. from ``benchmarks/make_checkpoint.py``; default the embedded
``tiny-mixtral``). Policy: ``auto`` (the planner, with ``--gpu-memory``) unless ``--mu`` and ``--n`` are both given.

Examples:
  OMP_NUM_THREADS=1 python3 benchmarks/kill_resume.py --device cpu --prompts 24 --gen 32 --mu 4 --n 3 --out /tmp/kr
  python3 benchmarks/kill_resume.py --model $CK --gpu-memory 24GiB \\
      --hardware lightning_moe/policy/profiles/h200-host.yaml --out $OUT/kill_resume   # GPU host, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_cost import REPO, finish_run_args, write_prompts  # noqa: E402

sys.path.insert(0, REPO)
from lightning_moe.data.writer import read_partials, read_results  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def job_yaml(a, name: str) -> str:
    """Write the job YAML ``<out>/<name>.yaml`` (results ``<out>/<name>.jsonl``, its sidecars removed); returns its path."""
    for ext in (".jsonl", ".partial.jsonl", ".report.json", ".meta.json"):
        if os.path.exists(os.path.join(a.out, name + ext)):
            os.remove(os.path.join(a.out, name + ext))
    policy = f"{{mu: {a.mu}, n: {a.n}}}" if a.mu is not None and a.n is not None else "auto"
    lines = [f"model: {a.model}", f"data: {{source: jsonl, path: {os.path.join(a.out, 'prompts.jsonl')}}}",
             f"output: {{path: {os.path.join(a.out, name + '.jsonl')}}}", f"device: {a.device}", f"dtype: {a.dtype}",
             "executor: cgopipe", f"policy: {policy}", f"checkpoint: {{every_steps: {a.every_steps}}}",
             f"generation: {{max_new_tokens: {a.gen}, temperature: 0.0, stop_at_eos: false}}"]
    for key, v in (("gpu_memory", a.gpu_memory), ("hardware", a.hardware), ("batch_size", a.batch_size)):
        if v is not None:
            lines.append(f"{key}: {v}")
    path = os.path.join(a.out, name + ".yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _stat(path: str) -> tuple:
    """(inode, lines) of a file; (None, 0) when there is none."""
    try:
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_ino, f.read().count(b"\n")
    except FileNotFoundError:
        return None, 0


def attempt(a, yaml_path: str, log: str, side: str | None = None, grow: int = 0, delay: float = 0.0) -> dict:
    """One CLI run; with ``side``, SIGKILL it once the sidecar is new and grew by ``grow`` lines (plus ``delay`` s)."""
    before = _stat(side)[0] if side else None
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_moe.cli", "run", yaml_path, "--no-progress"],
                                env=ENV, stdout=lf, stderr=subprocess.STDOUT)
        base, deadline, timed_out = None, time.time() + a.timeout, False
        while proc.poll() is None:
            if time.time() > deadline:
                timed_out = True
                break
            ino, lines = _stat(side) if side else (None, 0)
            if side and base is None and (before is None or ino not in (before, None)):
                base = 0 if before is None else lines
            if side and base is not None and lines >= base + grow:
                time.sleep(delay)
                break
            time.sleep(0.002)
        killed = proc.poll() is None
        if killed:  # the kill point, or the timeout
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    row = {"log": log, "wall_s": time.perf_counter() - t0, "killed": killed, "rc": proc.returncode,
           "timed_out": timed_out, "records": _stat(yaml_path[:-len(".yaml")] + ".jsonl")[1]}
    if side:
        row["sidecar_lines"] = _stat(side)[1]
    return row


def records(path: str) -> tuple[dict, int]:
    """The records of a results file by id, and the number of duplicate ids."""
    recs = read_results(path) if os.path.exists(path) else []
    return {r["id"]: r for r in recs}, len(recs) - len({r["id"] for r in recs})


def compare(ref: dict, got: dict) -> dict:
    """Identical records and position-wise token agreement over the ids of both; the first differing record."""
    same = agree = total = 0
    first = None
    for i in sorted(set(ref) & set(got), key=lambda s: int(s[1:]) if s[1:].isdigit() else s):
        r, g = ref[i].get("output_ids") or [], got[i].get("output_ids") or []
        agree += sum(x == y for x, y in zip(r, g))
        total += max(len(r), len(g))
        if r == g:
            same += 1
        elif first is None:
            pos = next((k for k, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
            first = {"id": i, "position": pos, "ref_ids": r[pos:pos + 8], "got_ids": g[pos:pos + 8],
                     "ref_text": ref[i].get("text"), "got_text": got[i].get("text")}
    n = len(set(ref) & set(got))
    return {"compared": n, "identical_records": same, "identical_fraction": same / n if n else None,
            "token_agreement": agree / total if total else None, "first_difference": first}


def report(path: str) -> dict:
    """``status``, ``runs`` and ``job_totals`` of a run report ({} when there is none)."""
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: r.get(k) for k in ("status", "runs", "job_totals")}


def prefix_mismatches(partials: dict, got: dict) -> list[str]:
    """Ids whose final ``output_ids`` do not begin with the partial tokens a killed run left for them (missing records
    count: the resumed job must finish every id it had a partial for)."""
    bad = []
    for rid, toks in partials.items():
        out = (got.get(rid) or {}).get("output_ids")
        if out is None or list(out[:len(toks)]) != list(toks):
            bad.append(rid)
    return sorted(bad)


def out_of_memory(log: str) -> bool:
    """Whether a run's log says it ran out of GPU memory."""
    try:
        with open(log, errors="replace") as f:
            return "out of GPU memory" in f.read()
    except OSError:
        return False


def markdown(attempts: list[dict], s: dict) -> str:
    out = ["| attempt | wall s | killed | rc | records | sidecar lines |", "|---|---|---|---|---|---|"]
    for r in attempts:
        killed = "timeout" if r["timed_out"] else ("yes" if r["killed"] else "no")
        out.append(f"| {r['name']} | {r['wall_s']:.2f} | {killed} | {r['rc']} | {r['records']} | {r.get('sidecar_lines', '-')} |")
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    out += ["", f"- records: {s['records']} of {s['prompts']} (reference {s['ref_records']}), "
            f"duplicates {s['duplicates']}, same ids: {s['same_ids']}",
            f"- identical records: {s['identical_records']} of {s['compared']} ({pct(s['identical_fraction'])})",
            f"- token agreement: {pct(s['token_agreement'])}; kills landed: {s['kills_landed']} of {s['kills']}",
            f"- partials read after kills: {s['partials_checked']}, prefix mismatches: {s['partial_prefix_mismatches']}; "
            f"attempts out of GPU memory: {s['oom_attempts']}",
            f"- runs in report: {s['runs_in_report']} ({s['kill_status']}); reference: {s['ref_status']}",
            f"- ok: {s['ok']}"]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-mixtral")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--hardware", default=None, help="a preset name or a profile YAML")
    p.add_argument("--mu", type=int, default=None, help="with --n: an explicit policy instead of auto")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--words", type=int, default=40, help="words per prompt (about)")
    p.add_argument("--gen", type=int, default=64, help="max_new_tokens")
    p.add_argument("--every-steps", type=int, default=1, help="checkpoint.every_steps")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/lmoe-kill-resume")
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess")
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted reference run")
    a = p.parse_args(argv)
    finish_run_args(a)
    o = lambda name: os.path.join(a.out, name)  # noqa: E731
    write_prompts(o("prompts.jsonl"), a.prompts, a.words)
    ref_yaml, kill_yaml, side = job_yaml(a, "ref"), job_yaml(a, "kill"), o("kill.partial.jsonl")
    rng = random.Random(a.seed)
    # a run's sidecar lines: about one per sequence per checkpoint; each resumed run goes on from the last, so growths
    # of at most a (kills + 1)-th of them spread the kills over the decode and leave the last run some of it
    span = max(1, a.prompts * -(-a.gen // a.every_steps) // (a.kills + 1))
    attempts, snapshots = [], []  # snapshots: the sidecar's partials after each killed attempt

    def go(name: str, *args) -> dict:
        attempts.append(dict(attempt(a, *args), name=name))
        print(json.dumps(attempts[-1]), flush=True)
        if attempts[-1]["killed"] and os.path.exists(side):  # what every later run must keep as each id's prefix
            snapshots.append(read_partials(side))
        return attempts[-1]

    if not a.no_reference:
        go("reference", ref_yaml, o("ref.log"))
    for k in range(a.kills if a.no_reference or attempts[0]["rc"] == 0 else 0):  # no kills when the reference failed
        if not go(f"kill {k}", kill_yaml, o(f"kill.{k}.log"), side, rng.randint(1, span), rng.random() * 0.02)["killed"]:
            break  # the job finished (or failed) before the kill point
    if attempts[-1]["killed"]:
        go("resume", kill_yaml, o("kill.final.log"))
    (ref, ref_dup), (got, dup) = records(o("ref.jsonl")), records(o("kill.jsonl"))
    rr, kr = report(o("ref.report.json")), report(o("kill.report.json"))
    s = {"prompts": a.prompts, "records": len(got), "ref_records": len(ref), "duplicates": dup + ref_dup,
         "same_ids": None if a.no_reference else set(got) == set(ref), "kills": a.kills, "kills_landed": sum(r["killed"] and not r["timed_out"] for r in attempts if r["name"].startswith("kill")),
         **compare(ref, got), "runs_in_report": len(kr.get("runs") or []), "kill_status": kr.get("status"),
         "ref_status": rr.get("status"), "partials_checked": sum(len(p) for p in snapshots),
         "partial_prefix_mismatches": len(set().union(*(prefix_mismatches(p, got) for p in snapshots))),
         "oom_attempts": sum(out_of_memory(r["log"]) for r in attempts)}
    s["ok"] = (attempts[-1]["rc"] == 0 and kr.get("status") == "done" and s["records"] == a.prompts
               and (a.no_reference or s["same_ids"]) and not s["duplicates"] and not os.path.exists(side)
               and not s["partial_prefix_mismatches"] and not s["oom_attempts"])
    with open(o("kill_resume.json"), "w") as f:
        json.dump({"args": vars(a), "attempts": attempts, "summary": s, "ref_report": rr, "kill_report": kr}, f, indent=1)
    md = markdown(attempts, s)
    with open(o("kill_resume.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if s["first_difference"]:
        print("first differing record:", json.dumps(s["first_difference"]))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
