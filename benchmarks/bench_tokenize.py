#!/usr/bin/env python3
"""Request tokenizing (``data.tokenize.encode_requests``) of scoring jobs, as ``moe-batch run`` does it before any
weight is read (a CPU benchmark, not a test): ``--n`` records per mode of ``suite_jobs.records_for`` on the embedded
model's tokenizer (Mixtral v1), best of ``--repeats`` seconds per mode, for this tree and optionally for another
tree (``--before DIR``, e.g. a ``git worktree`` of an earlier commit) in its own process; the token ids of both
trees are compared.

    python3 benchmarks/bench_tokenize.py [--n 1000] [--modes loglikelihood,multiple_choice] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE_JOBS = os.path.join(os.path.dirname(HERE), "tests", "support", "suite_jobs.py")
LENGTHS = {"loglikelihood": (32, 600), "multiple_choice": (200, 0), "perplexity": (64, 1024), "generate": (16, 400)}


def measure(tree: str, modes: list[str], n: int, repeats: int, ids_out: str) -> dict:
    """Best seconds of encode_requests per mode with ``tree``'s package (imported here: run in a fresh process)."""
    import importlib.util

    sys.path[:0] = [tree]
    spec = importlib.util.spec_from_file_location("suite_jobs", SUITE_JOBS)  # this tree's generators, by file
    sj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sj)
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.sources import load_requests
    from lightning_moe.data.tokenize import encode_requests, load_tokenizer
    from lightning_moe.model.tiny import resolve_model_path

    d = resolve_model_path("tiny-mixtral")
    tok = load_tokenizer(d)
    words = sj.one_token_words(tok)
    out, ids = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            lo, hi = LENGTHS[mode]
            path = os.path.join(tmp, f"{mode}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in sj.records_for(mode, words, n, lo, prompt_tokens_max=hi))
            task = "generate" if mode == "generate" else "score"
            job = job_from_dict({"model": d, "task": task, **({"score": {"mode": mode}} if task == "score" else {}),
                                 "device": "cpu", "data": {"source": "jsonl", "path": path},
                                 "output": {"path": os.path.join(tmp, "o.jsonl")}}, "bench")
            reqs = load_requests(job)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                tr = encode_requests(reqs, tok, job, 1 << 20)
                best = min(best, time.perf_counter() - t)
            out[mode] = best
            ids[mode] = [(t.prompt_ids, t.continuation_ids, t.choice_ids, t.text_ids) for t in tr]
    with open(ids_out, "w") as f:
        json.dump(ids, f)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="loglikelihood,multiple_choice")
    ap.add_argument("--before", default=None, help="another tree to time in its own process (its ids compared)")
    ap.add_argument("--_child", nargs=2, default=None, help=argparse.SUPPRESS)  # TREE IDS_FILE: print its times
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a._child:
        print(json.dumps(measure(a._child[0], modes, a.n, a.repeats, a._child[1])))
        return 0
    trees = [("now", os.path.dirname(HERE))] + ([("before", os.path.abspath(a.before))] if a.before else [])
    res, files = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in trees:
            files[name] = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--n", str(a.n), "--repeats", str(a.repeats), "--modes",
                   a.modes, "--_child", tree, files[name]]
            res[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        same = None
        if a.before:
            with open(files["now"]) as f1, open(files["before"]) as f2:
                same = json.load(f1) == json.load(f2)
    print(f"encode_requests, {a.n} records per mode, best of {a.repeats} (s)")
    for mode in modes:
        line = f"  {mode}: now {res['now'][mode]:.3f}"
        if a.before:
            line += f", before {res['before'][mode]:.3f} ({res['before'][mode] / res['now'][mode]:.2f}x)"
        print(line)
    if same is not None:
        print(f"  token ids identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
