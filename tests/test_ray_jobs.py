"""moe-batch run --ray: a job's shards as Ray tasks, retried and merged (app.ray_jobs), against a single-process run.

One Ray runtime (num_cpus=2) serves the module. The job: the embedded tiny model on the CPU, greedy, on fresh random
arithmetic prompts (the seed is in every assertion message), batch_size 1 so records come back one at a time. The
reference is the single-process run of the same job (``run_job``): records must be equal (exact: the same code, fp32,
greedy), every id exactly once, in input order (the single-process run writes them in the order they finish).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from lightning_moe.app.engine import run_job
from lightning_moe.config import ConfigError, load_job
from lightning_moe.data.shard import shard_of
from lightning_moe.data.writer import read_results

ray = pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = random.SystemRandom().randrange(2**31)
N_REQ = 24
SHARD0 = 22  # requests of shard 0 of 2 (enough that the shard is still running when the test kills it)


@pytest.fixture(scope="module")
def ray_runtime():
    """One local Ray runtime for the module; yields its address (for a second driver process)."""
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def _write_job(d, max_new_tokens=6, extra: str = "") -> str:
    rng = random.Random(SEED)
    os.makedirs(d, exist_ok=True)
    ids: list = []
    while len(ids) < N_REQ:  # random ids, SHARD0 of them in shard 0 of 2: that shard is still running when it is killed
        i = f"r{rng.randrange(10**9)}"
        if (shard_of(i, 2) == 0) == (sum(shard_of(x, 2) == 0 for x in ids) < SHARD0):
            ids.append(i)
    rng.shuffle(ids)
    bad = rng.randrange(N_REQ)  # one request with an empty prompt: an error record naming the input file and line
    with open(os.path.join(d, "in.jsonl"), "w") as f:
        for k, i in enumerate(ids):
            a, b = rng.randrange(100), rng.randrange(100)
            prompt = "" if k == bad else f"Question: what is {a} {rng.choice('+-*')} {b}? Answer:"
            f.write(json.dumps({"id": i, "prompt": prompt}) + "\n")
    path = os.path.join(d, "job.yaml")
    with open(path, "w") as f:
        f.write(f"model: tiny-mixtral\ndevice: cpu\ndtype: float32\nexecutor: serial\nbatch_size: 1\n"
                f"data: {{source: jsonl, path: in.jsonl}}\n"
                f"generation: {{max_new_tokens: {max_new_tokens}, stop_at_eos: false}}\n"
                f"checkpoint: {{every_steps: 1}}\non_error: record\noutput: {{path: out/res.jsonl}}\n{extra}")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(job dir, records of the single-process run)."""
    d = str(tmp_path_factory.mktemp("ref"))
    path = _write_job(d)
    job = load_job(path, {"output.path": os.path.join(d, "single", "res.jsonl")})
    run_job(job, progress=False)
    return d, read_results(job.output.path)


def _as_written_by(job, record, ref_dir):
    """The reference run's record as a run of `job` writes it: an error record's message names `job`'s input file."""
    if "error" not in record:
        return record
    return {**record, "error": record["error"].replace(ref_dir, os.path.dirname(job.data.path))}


def _check_output(job, reference):
    """Every input id exactly once, in input order (a single-process run writes them as they finish), each record
    equal to the single-process run's (an error record's message names the input file: this job's)."""
    ref_dir, ref = reference
    got = read_results(job.output.path)
    ids = [r["id"] for r in got]
    with open(job.data.path) as f:
        assert ids == [json.loads(line)["id"] for line in f], f"seed {SEED}: not every input id once in input order"
    by_id = {r["id"]: _as_written_by(job, r, ref_dir) for r in ref}
    assert got == [by_id[i] for i in ids], f"seed {SEED}: the Ray job's records differ from the single-process run's"


def test_two_shards_local_equal_single_process(ray_runtime, reference, tmp_path):
    from lightning_moe.app.ray_jobs import run_ray_job

    _ref_dir, ref = reference
    job = load_job(_write_job(str(tmp_path)), {"ray.address": "local", "ray.shards": 2})
    rep = run_ray_job(job, progress=False)
    _check_output(job, reference)
    assert rep["status"] == "done" and rep["retries"] == 0
    assert [s["status"] for s in rep["shards"]] == ["done", "done"]
    assert sum(s["records_this_run"] for s in rep["shards"]) == N_REQ
    assert rep["generated_tokens"] == sum(r.get("output_tokens", 0) for r in ref) and rep["tokens_per_s"] > 0
    assert sum("error" in r for r in ref) == 1  # its message names the driver's input file, as the reference's does
    assert not os.path.exists(os.path.join(str(tmp_path), "out", "res.ray"))  # the state directory is gone
    with open(job.output.report_path) as f:
        assert json.load(f)["status"] == "done"
    before = read_results(job.output.path)
    again = run_ray_job(job, progress=False)  # a finished job: nothing to do, the file untouched
    assert again.get("nothing_to_do") and read_results(job.output.path) == before


def _wait(cond, timeout, what):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise AssertionError(f"seed {SEED}: timed out waiting for {what}")
        time.sleep(0.05)


def _records_in(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_worker_sigkill_is_retried_and_resumes(ray_runtime, reference, tmp_path):
    """Shard 0's worker is killed with SIGKILL after its first record came back: the task is submitted again, resumes
    past that record (its retried attempt skips it), the job ends done with every id once and equal records."""
    from lightning_moe.app.ray_jobs import run_ray_job

    _ref_dir, ref = reference
    job = load_job(_write_job(str(tmp_path)), {"ray.address": "local", "ray.shards": 2})
    state = os.path.join(str(tmp_path), "out", "res.ray")
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("rep", run_ray_job(job, progress=False)), daemon=True)
    th.start()
    shard0 = os.path.join(state, "shard-0-of-2.jsonl")
    _wait(lambda: _records_in(shard0) >= 1 or not th.is_alive(), 240, "shard 0's first record")
    with open(os.path.join(state, "shard-0.task.json")) as f:
        pid = json.load(f)["pid"]
    held = _records_in(shard0)
    os.kill(pid, signal.SIGKILL)
    th.join(300)
    assert not th.is_alive() and "rep" in box, f"seed {SEED}: the driver did not finish"
    rep = box["rep"]
    _check_output(job, reference)
    s0 = rep["shards"][0]
    assert held < s0["requests"], f"seed {SEED}: shard 0 had finished before the kill; the test kills too late"
    assert rep["status"] == "done" and rep["retries"] == 1 and s0["retries"] == 1 and s0["attempts"] == 2
    assert "WorkerCrashedError" in s0["failed_attempts"][0] or "died" in s0["failed_attempts"][0]
    assert s0["last_attempt"]["skipped_already_done"] >= held  # the retried attempt resumed past what came back
    assert rep["shards"][1]["retries"] == 0
    print("resumed partials:", s0["last_attempt"]["resumed_sequences"], s0["last_attempt"]["resumed_tokens"])
    assert not [n for n in os.listdir(tempfile.gettempdir()) if f"-pid{pid}-" in n]  # the killed task's dir removed


def test_driver_killed_then_rerun_resumes(ray_runtime, reference, tmp_path):
    """The driver (a moe-batch process joined to the module's runtime) is killed with SIGKILL mid-run; the same
    command again resumes: nothing lost or duplicated, the report lists the killed run."""
    _ref_dir, ref = reference
    path = _write_job(str(tmp_path))
    cmd = [sys.executable, "-m", "lightning_moe.cli", "run", path, "--ray", ray_runtime, "--shards", "2",
           "--no-progress"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    state = os.path.join(str(tmp_path), "out", "res.ray")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    files = [os.path.join(state, f"shard-{i}-of-2.jsonl") for i in range(2)]
    _wait(lambda: sum(map(_records_in, files)) >= 2 or p.poll() is not None, 240, "the driver's first records")
    held = sum(map(_records_in, files))
    p.kill()
    p.wait(30)
    assert held < N_REQ, f"seed {SEED}: the driver had finished before the kill; the test kills too late"
    assert not os.path.exists(os.path.join(str(tmp_path), "out", "res.jsonl"))  # written only at the end
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    job = load_job(path)
    _check_output(job, reference)
    with open(job.output.report_path) as f:
        rep = json.load(f)
    assert rep["status"] == "done" and rep["skipped_already_done"] >= held
    assert [x["status"] for x in rep["runs"]] == ["killed", "done"]
    assert rep["records_written_this_run"] == N_REQ - rep["skipped_already_done"]


def test_bad_address_one_line_error_before_anything(tmp_path, capsys):
    """An address where nothing listens: one line, exit 2, nothing written, no weight read (the driver never reads
    weights; it fails before the requests are read)."""
    import socket

    from lightning_moe.cli import main

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    path = _write_job(str(tmp_path))
    t0 = time.time()
    assert main(["run", path, "--ray", f"127.0.0.1:{port}", "--shards", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot reach a Ray cluster at 127.0.0.1:{port}" in err, err
    assert time.time() - t0 < 30
    assert not os.path.exists(os.path.join(str(tmp_path), "out"))


def test_without_ray_one_line_install_hint(tmp_path, capsys, monkeypatch):
    from lightning_moe.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    path = _write_job(str(tmp_path))
    assert main(["run", path, "--ray", "local", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'lightning-moe[ray]'" in err, err


def test_ray_section_in_yaml(tmp_path):
    path = _write_job(str(tmp_path), extra="ray: {address: 'head:6379', shards: 3, max_retries: 1}\n")
    job = load_job(path)
    assert dataclasses.astuple(job.ray) == ("head:6379", 3, 1, 1)
    with pytest.raises(ConfigError, match=r"ray\.shrads: unknown key"):
        load_job(_write_job(str(tmp_path / "b"), extra="ray: {shrads: 3}\n"))
    with pytest.raises(ConfigError, match=r"ray\.shards \(from override\): must be >= 1"):
        load_job(path, {"ray.shards": 0})
    with pytest.raises(ConfigError, match=r"ray: a job runs either as Ray shards or as one shard"):
        load_job(path, {"shard": "0/2"})
    with pytest.raises(ConfigError, match=r"ray: a job with a ray section runs its shards on Ray"):
        run_job(job, progress=False)  # the single-process engine refuses it (run-batch, the API)


def test_resumes_prior_records_and_another_shard_count(ray_runtime, reference, tmp_path):
    """Records of a run without Ray in the results file, and of an earlier Ray run with 3 shards in the state
    directory, are kept and skipped by a 2-shard run: each id once, equal to the single-process run."""
    from lightning_moe.app.engine import results_provenance
    from lightning_moe.app.ray_jobs import run_ray_job
    from lightning_moe.data.writer import ResultsWriter, write_json_atomic

    ref_dir, ref = reference
    job = load_job(_write_job(str(tmp_path)), {"ray.shards": 2})
    rng = random.Random(SEED + 1)
    picked = [_as_written_by(job, r, ref_dir) for r in rng.sample(ref, 5)]  # records an earlier run of this job wrote
    with ResultsWriter(job.output.path) as w:  # a run without Ray stopped after 3 records
        for r in picked[:3]:
            w.write(r)
    state = os.path.join(str(tmp_path), "out", "res.ray")
    with ResultsWriter(os.path.join(state, "shard-1-of-3.jsonl")) as w:  # a 3-shard Ray run was killed
        for r in picked[3:]:
            w.write(r)
    write_json_atomic(os.path.join(state, "meta.json"), results_provenance(job))
    rep = run_ray_job(job, progress=False)
    _check_output(job, reference)
    assert rep["skipped_already_done"] == 5 and rep["records_written_this_run"] == N_REQ - 5, f"seed {SEED}"


def test_resume_refuses_other_settings(tmp_path):
    """Records held in the state directory were made with another max_new_tokens, or belong to an id the input no longer
    has: refused, naming it, before anything runs."""
    from lightning_moe.app.engine import results_provenance
    from lightning_moe.app.ray_jobs import run_ray_job
    from lightning_moe.data.writer import ResultsWriter, write_json_atomic

    job = load_job(_write_job(str(tmp_path)), {"ray.shards": 2})
    state = os.path.join(str(tmp_path), "out", "res.ray")
    with ResultsWriter(os.path.join(state, "shard-0-of-2.jsonl")) as w:
        w.write({"id": "x", "text": "held"})
    other = load_job(_write_job(str(tmp_path), max_new_tokens=9))
    write_json_atomic(os.path.join(state, "meta.json"), results_provenance(other))
    with pytest.raises(ConfigError, match=r"res\.ray holds records of different settings \(generation:"):
        run_ray_job(job, progress=False)
    assert not os.path.exists(job.output.path)
    write_json_atomic(os.path.join(state, "meta.json"), results_provenance(job))  # the same settings, but an id
    with pytest.raises(ConfigError, match=r"res\.ray holds the records of 1 ids not in the job's requests \('x'\)"):
        run_ray_job(job, progress=False)  # the input changed since: refused before anything runs
    assert not os.path.exists(job.output.path)


def test_retries_spent_fails_then_rerun_resumes(ray_runtime, reference, tmp_path):
    """max_retries 0 and shard 0's worker killed: ShardFailed (one line, the records kept), report status failed; the
    same run again resumes to done with the single-process run's records."""
    from lightning_moe.app.ray_jobs import ShardFailed, run_ray_job

    job = load_job(_write_job(str(tmp_path)), {"ray.shards": 2, "ray.max_retries": 0})
    state = os.path.join(str(tmp_path), "out", "res.ray")
    box = {}

    def drive():
        try:
            run_ray_job(job, progress=False)
        except ShardFailed as e:
            box["error"] = str(e)

    th = threading.Thread(target=drive, daemon=True)
    th.start()
    shard0 = os.path.join(state, "shard-0-of-2.jsonl")
    _wait(lambda: _records_in(shard0) >= 1 or not th.is_alive(), 240, "shard 0's first record")
    with open(os.path.join(state, "shard-0.task.json")) as f:
        os.kill(json.load(f)["pid"], signal.SIGKILL)
    th.join(300)
    msg = box.get("error", "")
    assert "\n" not in msg and "shard 0/2 failed after 1 attempts" in msg and "re-run the same command" in msg, msg
    with open(job.output.report_path) as f:
        assert json.load(f)["status"] == "failed"
    held = _records_in(shard0)
    assert held >= 1 and not os.path.exists(job.output.path)
    rep = run_ray_job(job, progress=False)
    _check_output(job, reference)
    assert rep["status"] == "done" and rep["skipped_already_done"] >= held
    assert [r["status"] for r in rep["runs"]] == ["failed", "done"]
