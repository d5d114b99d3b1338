"""A job's shards as Ray tasks, retried and merged, with no shared filesystem (``moe-batch run --ray ADDRESS|local
--shards N``, or the job's ``ray:`` section).

The driver (:func:`run_ray_job`, this process):

1. checks that Ray is importable and the cluster's address reachable, then reads and tokenizes the requests (every
   input error surfaces here, before any task starts or weight is read);
2. keeps its state in ``<stem>.ray/`` beside the results: per shard the records that came back
   (``shard-I-of-N.jsonl``, a :class:`ResultsWriter`: fsync'd, resumable) and the partial generations
   (``shard-I-of-N.partial.jsonl``); records of an earlier run without Ray in the results file are kept there too
   (``prior.jsonl``), and ``meta.json`` holds what the records depend on (checked on every resume);
3. submits one Ray task per shard that still has work (``app.ray_shard``: one GPU -- ``gpus`` GPUs -- per task on a
   CUDA job, ``ray.cpus_per_shard`` CPUs on every job) with the ids already held and the partials, and writes the
   records and partials it streams back as they arrive; a task that fails (worker killed, node lost) is submitted
   again, up to ``ray.max_retries`` times, resuming from what the driver holds;
4. when every shard is done, writes the results file once (:func:`merge_results`: input order, every id exactly once,
   atomically) and the report (per-shard lines, the job's tokens/s, the retries), then removes the state directory.

A driver killed at any point is resumed by running the same command again: the state directory holds every record
that came back. The report lists every run of the job, as a single-process run's does.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import shutil
import socket
import sys
import threading
import time
from typing import Optional

from ..config import ConfigError, Job
from ..data.shard import merge_results, shard_of
from ..data.writer import PartialsFile, ResultsWriter, atomic_write, read_results, write_json_atomic
from .report import REPORT_EVERY_S, job_totals, previous_runs

INSTALL = "pip install 'lightning-moe[ray]'"
CONNECT_TIMEOUT_S = 5.0  # how long the driver waits for the cluster's address to answer


class ShardFailed(RuntimeError):
    """A shard failed more often than ``ray.max_retries`` allows, or with an error a retry cannot fix (one line; the
    records that came back are kept: re-running the command resumes)."""


def import_ray(job: Job):
    """The ``ray`` module, or ConfigError (one line: how to install it)."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{job.label}: ray: running shards on Ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def check_address(job: Job) -> None:
    """ConfigError (one line) when ``ray.address`` names a host:port that does not accept a connection within
    CONNECT_TIMEOUT_S ("local" and "auto" are not checked here: ray.init says)."""
    addr = job.ray.address
    if addr in ("local", "auto"):
        return
    hostport = addr.split("://", 1)[1] if "://" in addr else addr
    host, sep, port = hostport.rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{job.label}: ray.address: expected 'local', 'auto', 'host:port' or 'ray://host:port', "
                          f"got {addr!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"{job.label}: ray.address: cannot reach a Ray cluster at {addr} "
                          f"({e.strerror or type(e).__name__}); is `ray start --head` running there?") from None


def connect(ray, job: Job) -> None:
    """Join the cluster of ``ray.address`` ("local": a Ray runtime started on this machine, or the one this process
    already runs); ConfigError (one line) when Ray refuses."""
    if ray.is_initialized():
        return
    addr = job.ray.address
    try:
        if addr == "local":
            ray.init(log_to_driver=False, include_dashboard=False)
        else:
            ray.init(address=addr, log_to_driver=False)
    except Exception as e:  # ConnectionError, ValueError, ...: whatever Ray says, on one line
        msg = " ".join(str(e).split())[:300]
        raise ConfigError(f"{job.label}: ray.address: cannot join the Ray cluster at {addr}: {msg}") from None


def shipped_files(job: Job) -> dict:
    """The files the job reads besides the checkpoint (the input, a policy or hardware YAML): path -> bytes."""
    paths = [job.data.path, job.policy if isinstance(job.policy, str) and job.policy != "auto" else None,
             job.hardware if job.hardware and os.path.isfile(job.hardware) else None]
    out = {}
    for p in paths:
        if p is not None:
            with open(p, "rb") as f:
                out[p] = f.read()
    return out


class State:
    """The driver's state directory ``<stem>.ray/`` beside the results (module docstring)."""

    def __init__(self, job: Job):
        stem, _ext = os.path.splitext(job.output.path)
        self.dir = stem + ".ray"
        self.count = job.ray.shards

    def shard_path(self, index: int) -> str:
        return os.path.join(self.dir, f"shard-{index}-of-{self.count}.jsonl")

    def partial_path(self, index: int) -> str:
        return os.path.join(self.dir, f"shard-{index}-of-{self.count}.partial.jsonl")

    def record_files(self) -> list[str]:
        """Every records file of the directory (shards of any count, ``prior.jsonl``)."""
        return sorted(p for p in glob.glob(os.path.join(glob.escape(self.dir), "*.jsonl"))
                      if not p.endswith(".partial.jsonl"))

    def check_provenance(self, job: Job) -> None:
        """ConfigError when the held records were made with other settings (``meta.json``); saves it otherwise."""
        from .engine import results_provenance

        meta, now = os.path.join(self.dir, "meta.json"), results_provenance(job)
        held = any(os.path.getsize(p) > 0 for p in self.record_files())
        if held and os.path.exists(meta):
            with open(meta) as f:
                then = json.load(f)
            diff = [k for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)]
            if diff:
                raise ConfigError(f"{job.label}: {self.dir} holds records of different settings ("
                                  + "; ".join(f"{k}: {then.get(k)!r} then, {now.get(k)!r} now" for k in diff)
                                  + "): set output.path to a new file, or move the directory away")
        os.makedirs(self.dir, exist_ok=True)
        write_json_atomic(meta, now)

    def adopt_prior(self, job: Job) -> None:
        """Records already in the results file (a run without Ray) go to ``prior.jsonl`` once, so they count as done
        and are part of the final file."""
        prior = os.path.join(self.dir, "prior.jsonl")
        if os.path.exists(job.output.path) and not os.path.exists(prior):
            with ResultsWriter(job.output.path):  # a torn last line repaired
                pass
            with open(job.output.path, "rb") as f:
                data = f.read()
            if data:
                atomic_write(prior, lambda f: f.write(data))

    def done_ids(self) -> set:
        """Ids with a record in any records file (torn last lines repaired)."""
        done: set = set()
        for p in self.record_files():
            with ResultsWriter(p) as w:
                done |= w.done_ids()
        return done


class ShardRun:
    """One shard's progress in this driver run: the Ray task of each attempt, its records, its retries."""

    def __init__(self, index: int, ids: list, state: State):
        self.index = index
        self.ids = ids  # the shard's request ids, in input order
        self.writer = ResultsWriter(state.shard_path(index))
        self.partials_path = state.partial_path(index)
        self.partials = PartialsFile(self.partials_path)  # the partial generations that came back (appended)
        self.attempts = 0
        self.retries = 0
        self.records = 0  # records that came back in this driver run
        self.generated = 0  # their output tokens
        self.prompt_tokens = 0  # prefilled tokens of the attempts that finished
        self.status = "waiting"
        self.pid: Optional[int] = None
        self.host: Optional[str] = None
        self.errors: list[str] = []  # why earlier attempts failed
        self.report: Optional[dict] = None  # the finished attempt's run report (its main fields)

    def line(self) -> dict:
        """The shard's entry in the job's report."""
        return {"index": self.index, "requests": len(self.ids), "status": self.status, "attempts": self.attempts,
                "retries": self.retries, "records_this_run": self.records, "generated_tokens": self.generated,
                "prompt_tokens": self.prompt_tokens, "host": self.host, "pid": self.pid,
                "failed_attempts": self.errors, "last_attempt": self.report}


class Driver:
    """Runs the shards' tasks and collects what they send (see the module docstring)."""

    def __init__(self, ray, job: Job, state: State, expected: list, done: set, progress: bool, log):
        from tqdm import tqdm

        self.ray, self.job, self.state, self.log = ray, job, state, log
        self.lock = threading.Lock()
        self.done = done  # every id with a record on the driver's disk
        n = job.ray.shards
        self.shards = [ShardRun(i, [r for r in expected if shard_of(r, n) == i], state) for i in range(n)]
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=len(expected), initial=len(done), disable=not progress, unit="rec", file=log,
                        dynamic_ncols=True, desc=f"{n} shards")
        self.files_ref = ray.put(shipped_files(job))  # in the object store once, read by every task
        self.task = self.remote_task()

    def remote_task(self):
        """The Ray task: a streaming generator over :func:`app.ray_shard.shard_messages` (retries are the
        driver's, so each attempt learns what came back before it)."""
        from .ray_shard import shard_messages

        gpus = self.job.gpus if self.job.device.startswith("cuda") else 0
        fn = self.ray.remote(num_returns="streaming", max_retries=0)(shard_messages)
        return fn.options(num_cpus=self.job.ray.cpus_per_shard, num_gpus=gpus,
                          name=f"moe-batch {self.job.name} shard")

    def take(self, sr: ShardRun, msg: dict) -> None:
        """One message of shard ``sr``'s task."""
        kind = msg.get("kind")
        if kind == "start":
            sr.pid, sr.host = msg["pid"], msg["host"]
            write_json_atomic(os.path.join(self.state.dir, f"shard-{sr.index}.task.json"),
                              {"attempt": sr.attempts, "pid": sr.pid, "host": sr.host})
        elif kind == "lines":
            for raw in msg["records"]:
                rec = json.loads(raw)
                with self.lock:
                    if rec["id"] in self.done:  # a retried attempt never sends one again; kept exactly once anyway
                        continue
                    self.done.add(rec["id"])
                sr.writer.write(rec)
                sr.records += 1
                sr.generated += rec.get("output_tokens") or 0
                self._tick()
            lines = [json.loads(raw) for raw in msg["partials"]]
            sr.partials.append([(r["id"], r["start"], r["ids"]) + ((r["logprobs"],) if "logprobs" in r else ())
                                for r in lines])
        elif kind == "end":
            sr.report = msg["report"]
            sr.prompt_tokens += sr.report.get("prompt_tokens") or 0
        elif kind == "error":
            raise ShardFailed(msg["message"])

    def _tick(self) -> None:
        with self.lock:
            self.bar.update(1)
            tok = sum(s.generated for s in self.shards)
            self.bar.set_postfix_str(f"{tok / max(time.perf_counter() - self.t0, 1e-9):.1f} tok/s, "
                                     f"{sum(s.retries for s in self.shards)} retries", refresh=False)

    def _resume_input(self, sr: ShardRun) -> tuple[list, bytes]:
        """What an attempt of ``sr`` starts from: the shard's ids the driver holds, and the partials of the others
        (the sidecar compacted to them first)."""
        with self.lock:
            held = [i for i in sr.ids if i in self.done]
        hs = set(held)
        todo = [i for i in sr.ids if i not in hs]
        sr.partials.close()
        pf = PartialsFile(sr.partials_path)
        pf.load(todo, held)
        sr.partials = pf
        data = b""
        if os.path.exists(sr.partials_path):
            with open(sr.partials_path, "rb") as f:
                data = f.read()
        return held, data

    def drive(self, sr: ShardRun) -> None:
        """Run shard ``sr`` to the end: submit, take its messages, submit again after a failure of the task (thread
        body). An error of the driver's own (its disk) ends the shard: its status says why."""
        try:
            self._drive(sr)
        except Exception as e:
            sr.status = "failed"
            sr.errors.append(" ".join(f"driver: {type(e).__name__}: {e}".split())[:300])

    def _drive(self, sr: ShardRun) -> None:
        task = self.task
        while True:
            held, partials = self._resume_input(sr)
            if len(held) == len(sr.ids):
                sr.status = "done"
                return
            sr.attempts += 1
            sr.status = "running"
            gen = task.remote(self.job, sr.index, self.job.ray.shards, self.files_ref, held, partials)
            try:
                for ref in gen:
                    self.take(sr, self.ray.get(ref))
                with self.lock:
                    left = sum(1 for i in sr.ids if i not in self.done)
                sr.status = "done" if not left else f"failed: its task ended without the records of {left} ids"
                return
            except ShardFailed as e:
                sr.status = "failed"
                sr.errors.append(str(e))
                return
            except self.ray.exceptions.RayError as e:  # the task failed (worker killed, node lost, its error): retried
                why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                sr.errors.append(why)
                if sr.retries >= self.job.ray.max_retries:
                    sr.status = f"failed after {sr.attempts} attempts"
                    return
                sr.retries += 1
                print(f"moe-batch: shard {sr.index}/{self.job.ray.shards}: attempt {sr.attempts} failed ({why}); "
                      f"submitting it again (retry {sr.retries} of {self.job.ray.max_retries}), resuming past the "
                      f"shard's records that came back", file=self.log, flush=True)

    def run(self, save) -> None:
        """Every shard to its end, one thread each; ``save()`` (the report so far) every REPORT_EVERY_S."""
        threads = [threading.Thread(target=self.drive, args=(sr,), name=f"moe-batch-shard-{sr.index}", daemon=True)
                   for sr in self.shards]
        for th in threads:
            th.start()
        last = time.perf_counter()
        try:
            for th in threads:
                while th.is_alive():
                    th.join(timeout=1.0)
                    if time.perf_counter() - last >= REPORT_EVERY_S:
                        save()
                        last = time.perf_counter()
        finally:
            self.bar.close()
            for sr in self.shards:
                sr.writer.close()
                sr.partials.close()


def ray_report(job: Job, prep_n: int, expected: list, skipped: int, drv: Optional[Driver], started: str,
               wall: float, status: str, prev_runs: list) -> dict:
    """The job's report: per-shard lines, tokens/s over the driver's wall time, retries, every run of the job."""
    shards = [sr.line() for sr in drv.shards] if drv is not None else []
    gen = sum(s["generated_tokens"] for s in shards)
    prompt = sum(s["prompt_tokens"] for s in shards)
    records = sum(s["records_this_run"] for s in shards)
    tokens = prompt if job.task == "score" else gen
    run = {"started": started, "wall_seconds": wall, "prompt_tokens": prompt, "generated_tokens": gen,
           "records_written": records, "status": status, "ray_shards": job.ray.shards,
           "retries": sum(s["retries"] for s in shards)}
    runs = prev_runs + [run]
    return {
        "job": job.name, "config": job.config_path, "task": job.task, "model": job.model, "device": job.device,
        "dtype": job.dtype, "executor": job.executor, "host": platform.node(), "status": status,
        "ray": {"address": job.ray.address, "shards": job.ray.shards, "max_retries": job.ray.max_retries,
                "cpus_per_shard": job.ray.cpus_per_shard,
                "gpus_per_shard": job.gpus if job.device.startswith("cuda") else 0},
        "requests_in_input": prep_n, "requests": len(expected), "skipped_already_done": skipped,
        "records_written_this_run": records, "retries": run["retries"], "prompt_tokens": prompt,
        "generated_tokens": gen, "wall_seconds": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
        "results": job.output.path, "shards": shards, "runs": runs,
        "job_totals": job_totals(runs, skipped + records)}


def format_ray_report(r: dict) -> str:
    """Human-readable summary of a Ray job's report (printed at the end of ``moe-batch run --ray``)."""
    ray = r["ray"]
    tps = r.get("tokens_per_s")
    lines = [f"job {r['job']}: {r['status']}  ({r['task']}, {r['model']}, {r['device']}, {r['dtype']}, executor "
             f"{r['executor']}; {ray['shards']} Ray shards at {ray['address']})",
             f"  requests: {r['requests']}, {r['skipped_already_done']} already done, "
             f"{r['records_written_this_run']} written now; tokens: {r['prompt_tokens']:,} prompt, "
             f"{r['generated_tokens']:,} generated; {'-' if tps is None else f'{tps:,.1f}'} tok/s over "
             f"{r['wall_seconds']:,.1f} s; {r['retries']} retries"]
    for s in r["shards"]:
        lines.append(f"  shard {s['index']}: {s['status']}, {s['requests']} requests, {s['records_this_run']} records "
                     f"now, {s['generated_tokens']:,} tokens generated, {s['attempts']} attempts ({s['retries']} "
                     f"retries), last on {s['host'] or '-'}")
        lines += [f"    failed attempt: {e}" for e in s["failed_attempts"]]
    lines.append(f"  results: {r['results']}")
    return "\n".join(lines)


def run_ray_job(job: Job, progress: bool = True, log=None) -> dict:
    """Run ``job``'s shards as Ray tasks (``job.ray``), or resume them, and return the report (also saved as JSON
    beside the results).

    Raises:
        ConfigError / DataError: Ray missing, a cluster address that does not answer, bad job or input (before any
            task starts or weight is read).
        ShardFailed: a shard failed more than ``ray.max_retries`` times or with an error a retry cannot fix (the
            records that came back are kept; re-running resumes).
    """
    from .plan import Prepared

    log = log if log is not None else sys.stderr
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    ray = import_ray(job)
    check_address(job)
    prep = Prepared(_without_ray(job))  # the config, tokenizer and requests: every input error, no weight
    expected = [t.id for t in prep.treqs]
    state = State(job)
    from .engine import check_results_provenance

    if os.path.exists(job.output.report_path) and os.path.exists(job.output.path):
        check_results_provenance(_without_ray(job))  # results of other settings: refused, nothing written
        if _finished(job, expected):
            return _nothing_to_do(job, state, log)
    done = _held(job, state, expected)
    prev_runs = previous_runs(job, bool(done))
    connect(ray, job)
    drv = Driver(ray, job, state, expected, set(done), progress, log)

    def save(status: str = "running") -> dict:
        rep = ray_report(job, prep.n_input, expected, len(done), drv, started, time.perf_counter() - t0, status,
                         prev_runs)
        write_json_atomic(job.output.report_path, rep)
        return rep

    save()
    try:
        drv.run(save)
    except BaseException:
        save("stopped (resumable)")
        raise
    failed = [sr for sr in drv.shards if sr.status != "done"]
    if failed:
        save("failed")
        sr = failed[0]
        raise ShardFailed(f"{job.label}: shard {sr.index}/{job.ray.shards} {sr.status}: "
                          f"{sr.errors[-1] if sr.errors else ''}; the records that came back are kept in {state.dir}: "
                          f"re-run the same command to resume")
    merge_results(state.record_files(), job.output.path, expected)
    report = save("done")
    shutil.rmtree(state.dir, ignore_errors=True)
    return report


def _held(job: Job, state: State, expected: list) -> set:
    """The ids whose records the driver holds (state directory, earlier records of the results file), after checking
    that they were made with the job's settings and belong to its requests (ConfigError otherwise)."""
    from .engine import check_results_provenance

    check_results_provenance(_without_ray(job))
    state.check_provenance(job)
    state.adopt_prior(job)
    held = state.done_ids()
    stray = sorted(held - set(expected))
    if stray:
        raise ConfigError(f"{job.label}: {state.dir} holds the records of {len(stray)} ids not in the job's requests "
                          f"({', '.join(map(repr, stray[:3]))}{', ...' if len(stray) > 3 else ''}): the input changed "
                          f"since they ran; restore it, or move {state.dir} and {job.output.path} away to start over")
    return held


def _without_ray(job: Job) -> Job:
    import dataclasses

    return dataclasses.replace(job, ray=None)


def _finished(job: Job, expected: list) -> bool:
    """Whether the results file holds a record of every expected id and a report is beside it (a finished job)."""
    if not (os.path.exists(job.output.path) and os.path.exists(job.output.report_path)):
        return False
    have = {r.get("id") for r in read_results(job.output.path)}
    return all(i in have for i in expected)


def _nothing_to_do(job: Job, state: State, log) -> dict:
    print(f"moe-batch: all requests of {job.output.path} are done; report of the run that finished them: "
          f"{job.output.report_path}", file=log)
    shutil.rmtree(state.dir, ignore_errors=True)  # a driver killed after its merge left it
    with open(job.output.report_path) as f:
        return {**json.load(f), "nothing_to_do": True}
