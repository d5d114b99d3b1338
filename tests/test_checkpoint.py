"""Partial-generation checkpoints: kill -9 at random points of decode and resume to the uninterrupted records (cgopipe
greedy and sampled, serial), SIGTERM (exit 75, partials flushed), the sidecar's repairs and the per-position RNG."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_moe.config import ConfigError, job_from_dict
from lightning_moe.data.writer import PartialsFile, WriterError, read_partials, read_results
from lightning_moe.app.engine import EXIT_STOPPED, check_results_provenance, run_job
from lightning_moe.pipeline.sampling import DecodeSampling, position_seed, sample
from tests.support.prompt_files import count_lines

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one OpenMP thread: on a 2-core host the main thread's and the CPU-attention worker's OpenMP teams spin against each
# other (cgopipe decode steps take ~1 s instead of ~10 ms)
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
N_PROMPTS, G = 24, 32


def _prompts(path, n=N_PROMPTS):
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt": " ".join(words[: 1 + (i * 3) % 8]) + f" number {i}"}) + "\n")
    return str(path)


def _yaml(tmp_path, tiny_dir, name, executor="cgopipe", gen=None, checkpoint="{every_steps: 1}", n=N_PROMPTS):
    data = _prompts(tmp_path / "in.jsonl", n)
    gen = gen or f"{{max_new_tokens: {G}, temperature: 0.0, stop_at_eos: false}}"
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"model: {tiny_dir}\ndata: {{source: jsonl, path: {data}}}\noutput: {{path: {tmp_path / name}.jsonl}}\n"
                 f"device: cpu\ndtype: float32\nexecutor: {executor}\nbatch_size: 12\npolicy: {{mu: 4, n: 3}}\n"
                 f"expert_ffn: torch\ncheckpoint: {checkpoint}\ngeneration: {gen}\n")
    return p


def _cmd(yaml_path, *extra):
    return [sys.executable, "-m", "lightning_moe.cli", "run", str(yaml_path), "--no-progress", *extra]


def _by_id(path):
    recs = read_results(str(path))
    assert len(recs) == len({r["id"] for r in recs}), "duplicate records"
    return {r["id"]: r for r in recs}




def _inode(path):
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _kill_resume(tmp_path, tiny_dir, executor, gen, kills, seed):
    """Run the job uninterrupted (reference), then again with SIGKILL at ``kills`` random points of its decode (after
    the sidecar grew by a random number of lines, plus a random delay), resuming each time; returns both results."""
    ref = _yaml(tmp_path, tiny_dir, "ref", executor, gen)
    subprocess.run(_cmd(ref), env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    job = _yaml(tmp_path, tiny_dir, "k", executor, gen)
    out, side = tmp_path / "k.jsonl", tmp_path / "k.partial.jsonl"
    rng = random.Random(seed)
    landed = 0
    for attempt in range(3 * kills):
        if landed == kills:
            break
        before = _inode(side)  # a sidecar left by the last kill is compacted (replaced) before decode starts
        proc = subprocess.Popen(_cmd(job), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        grow, base = rng.randint(1, 30), None
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline:
            if base is None and (before is None or _inode(side) not in (before, None)):
                base = 0 if before is None else count_lines(side)
            if base is not None and count_lines(side) >= base + grow:
                time.sleep(rng.random() * 0.01)
                break
            time.sleep(0.002)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not alive:
            break  # the job finished first
        landed += 1
        if attempt % 3 == 1 and side.exists():  # what a kill inside write() leaves: a torn last line
            with open(side, "ab") as f:
                f.write(b'{"id": "q3", "start": 5, "ids": [1, 2')
        _by_id(out)  # never a duplicate record
    assert landed == kills, f"only {landed} of {kills} kills landed before the job finished"
    assert read_partials(str(side)), "the last kill must leave partials to resume"
    subprocess.run(_cmd(job), env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    assert out.read_text().count("\n") == N_PROMPTS and not side.exists()
    report = json.load(open(tmp_path / "k.report.json"))
    assert report["status"] == "done" and report["runs"][-1]["status"] == "done"
    assert report["job_totals"]["runs"] == len(report["runs"]) >= 2 and report["job_totals"]["records"] == N_PROMPTS
    killed = [r for r in report["runs"] if r["status"] == "killed"]  # a killed run says its counts may be stale
    assert killed and all("report save" in r["counts"] or "results file" in r["counts"] for r in killed)
    assert sum(r["records_written"] for r in report["runs"]) == N_PROMPTS  # every record counted by one run
    return _by_id(out), _by_id(tmp_path / "ref.jsonl")


def test_sigkill_cgopipe_greedy_resumes_token_for_token(tmp_path, tiny_dir):
    got, ref = _kill_resume(tmp_path, tiny_dir, "cgopipe", None, kills=10, seed=19)
    assert got == ref


def test_sigkill_cgopipe_sampled_resumes_token_for_token(tmp_path, tiny_dir):
    gen = f"{{max_new_tokens: {G}, temperature: 0.8, top_p: 0.9, seed: 5, stop_at_eos: false}}"
    got, ref = _kill_resume(tmp_path, tiny_dir, "cgopipe", gen, kills=4, seed=7)
    assert got == ref


def test_sigkill_serial_resumes_token_for_token(tmp_path, tiny_dir):
    got, ref = _kill_resume(tmp_path, tiny_dir, "serial", None, kills=4, seed=3)
    assert got == ref


def test_sigterm_in_decode_stops_resumably(tmp_path, tiny_dir):
    """SIGTERM during a batch's decode: exit 75 with one "resumable" line, the sequences in flight have their partials
    flushed (no schedule would have written any), and the resumed run ends with the uninterrupted records."""
    ck = "{every_steps: null, every_seconds: null}"  # partials only when the stop comes
    g_long = 160  # a long decode, so the signal sent just after the first batch's records lands in the second's decode
    gen = f"{{max_new_tokens: {g_long}, temperature: 0.0, stop_at_eos: false}}"
    ref = _yaml(tmp_path, tiny_dir, "ref", checkpoint=ck, gen=gen, n=36)
    subprocess.run(_cmd(ref), env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    job = _yaml(tmp_path, tiny_dir, "t", checkpoint=ck, gen=gen, n=36)  # 3 batches of 12
    out, side = tmp_path / "t.jsonl", tmp_path / "t.partial.jsonl"
    proc = subprocess.Popen(_cmd(job), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while count_lines(out) < 12 and time.time() < deadline:  # the first batch is done: the second is in flight
        time.sleep(0.002)
    time.sleep(0.2)  # past the second batch's prefill
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_STOPPED == 75, err
    lines = [l for l in err.splitlines() if "resumable" in l]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and str(side) in lines[0]
    done = set(_by_id(out))
    parts = read_partials(str(side))
    assert len(done) in (12, 24) and parts and set(parts).isdisjoint(done) and len(parts) == 12
    assert all(0 < len(p) < g_long for p in parts.values())
    report = json.load(open(tmp_path / "t.report.json"))
    assert report["status"] == "stopped (resumable)" and report["runs"][-1]["status"] == "stopped (resumable)"
    subprocess.run(_cmd(job), env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    got = _by_id(out)
    refs = _by_id(tmp_path / "ref.jsonl")
    assert len(got) == 36 and all(got[i] == refs[i] for i in refs)
    report = json.load(open(tmp_path / "t.report.json"))
    assert [r["status"] for r in report["runs"]] == ["stopped (resumable)", "done"]
    assert report["job_totals"]["generated_tokens"] == sum(r["generated_tokens"] for r in report["runs"])
    assert report["partials"]["resumed_sequences"] == 12


# ---- in-process: the sidecar and the RNG ---------------------------------------------------------------------------
def _job(tmp_path, tiny_dir, data, out="o.jsonl", **kw):
    d = {"model": tiny_dir, "data": {"source": "jsonl", "path": data}, "output": {"path": str(tmp_path / out)},
         "device": "cpu", "dtype": "float32", "executor": "serial", "batch_size": 4, "checkpoint": {"every_steps": 1},
         "generation": {"max_new_tokens": 6, "temperature": 0.0, "stop_at_eos": False}}
    d.update(kw)
    return job_from_dict(d, "test.yaml", base_dir=str(tmp_path))


def test_partials_file_torn_line_stale_ids_and_compaction(tmp_path, capsys):
    p = tmp_path / "x.partial.jsonl"
    p.write_bytes(b'{"id": "a", "start": 0, "ids": [5, 6]}\n{"id": "b", "start": 0, "ids": [7]}\n'
                  b'{"id": "a", "start": 2, "ids": [8]}\n{"id": "c", "start": 0, "ids": [9]}\n'
                  b'{"id": "a", "start": 1, "ids": [4, 4]}\n{"id": "b", "start": 1, "ids": [1, ')
    f = PartialsFile(str(p))
    assert "removed a torn last line" in capsys.readouterr().err and f.repaired_bytes > 0
    assert p.read_bytes().endswith(b'[4, 4]}\n')  # truncated on open: an append now starts a whole line
    assert f.partials == {"a": [5, 4, 4], "b": [7], "c": [9]}  # a line at an earlier start replaces from there
    got = f.load(todo_ids=["a", "b"], done_ids=["c", "z"])  # c has a record: obsolete, dropped silently
    assert got == {"a": [5, 4, 4], "b": [7]} and "not in the input" not in capsys.readouterr().err
    assert read_partials(str(p)) == got and count_lines(p) == 2  # compacted: one line per sequence
    f.append([("a", 3, [1]), ("b", 1, [2, 3])])
    f.close()
    f = PartialsFile(str(p))
    assert f.load(todo_ids=["a"], done_ids=[]) == {"a": [5, 4, 4, 1]}
    assert "ignoring the partial generations of 1 ids not in the input ('b')" in capsys.readouterr().err
    assert f.load(todo_ids=[], done_ids=["a"]) == {} and not p.exists()  # nothing left: removed
    p.write_bytes(b'{"id": "a", "start": 0, "ids": [1]}\nnot json\n{"id": "a", "start": 1, "ids": [2]}\n')
    with pytest.raises(WriterError, match=r"x\.partial\.jsonl:2: not a JSON object"):
        PartialsFile(str(p))
    p.write_bytes(b'{"id": "a", "start": 3, "ids": [1]}\n')
    with pytest.raises(WriterError, match=r"x\.partial\.jsonl:1: start: 3 leaves a gap"):
        PartialsFile(str(p))


def test_resume_from_partials_in_process(tmp_path, tiny_dir):
    """Partials planted in the sidecar (one complete, one half done, one for an id with a record, one for an id not in
    the input, a torn last line) resume to the uninterrupted records; the sidecar is removed when the job is done."""
    data = _prompts(tmp_path / "in.jsonl", n=6)
    ref = _job(tmp_path, tiny_dir, data, out="ref.jsonl")
    run_job(ref, progress=False)
    refs = _by_id(ref.output.path)
    job = _job(tmp_path, tiny_dir, data)
    with open(job.output.path, "w") as f:
        f.write(json.dumps(refs["q0"]) + "\n")
    check_results_provenance(job)
    lines = [{"id": "q1", "start": 0, "ids": refs["q1"]["output_ids"]},  # complete: its record needs no model
             {"id": "q2", "start": 0, "ids": refs["q2"]["output_ids"][:3]},
             {"id": "q0", "start": 0, "ids": [1, 2, 3]},  # has a record: obsolete
             {"id": "gone", "start": 0, "ids": [4]}]  # not in the input: stale
    with open(job.output.partial_path, "w") as f:
        f.write("".join(json.dumps(l) + "\n" for l in lines) + '{"id": "q3", "sta')
    rep = run_job(job, progress=False)
    assert _by_id(job.output.path) == refs and not os.path.exists(job.output.partial_path)
    assert rep["partials"]["resumed_sequences"] == 2 and rep["partials"]["resumed_tokens"] == 6 + 3
    assert rep["generated_tokens"] == 6 * 3 + 3  # q3..q5 whole, q2's rest; q1 and q0 none
    assert rep["stages"]["checkpoint_write_calls"] > 0 and rep["stages"]["checkpoint_write_s"] >= 0


def test_changed_job_with_partials_refuses_to_resume(tmp_path, tiny_dir):
    data = _prompts(tmp_path / "in.jsonl", n=2)
    job = _job(tmp_path, tiny_dir, data)
    check_results_provenance(job)  # the first run saves what the results depend on, then is killed mid-decode:
    with open(job.output.partial_path, "w") as f:  # partials only, no record yet
        f.write('{"id": "q0", "start": 0, "ids": [5, 6]}\n')
    other = _job(tmp_path, tiny_dir, data, generation={"max_new_tokens": 6, "temperature": 0.5, "stop_at_eos": False})
    with pytest.raises(ConfigError, match=r"holds records of different settings \(generation: .*'temperature': 0\.0"):
        run_job(other, progress=False)
    assert read_partials(job.output.partial_path) == {"q0": [5, 6]}  # untouched


def test_sampling_rng_is_keyed_by_seed_and_position():
    """The draw at a position depends only on (request seed, position) and that row's logits: the same tokens
    whatever the batch and whatever position a run resumed at."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    params = DecodeSampling(8, temperature=0.8, top_p=0.9)
    seeds = [11, 12, 13, 14, 15]
    full = sample(logits, params, seeds, [0, 1, 2, 3, 4])
    for b in range(5):  # one row alone, at its own position
        assert sample(logits[b : b + 1], params, [seeds[b]], [b]).item() == full[b].item()
    perm = [4, 2, 0, 3, 1]  # another batch order
    assert sample(logits[perm], params, [seeds[i] for i in perm], [perm[i] for i in range(5)]).tolist() == \
        [full[i].item() for i in perm]
    draws = {tuple(sample(logits, params, seeds, [p] * 5).tolist()) for p in range(6)}
    assert len(draws) > 1  # the position changes the draw
    assert position_seed(1, 2) == position_seed(1, 2) != position_seed(1, 3) != position_seed(2, 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_checkpoints_append_only_the_new_tokens_when_due(tmp_path, seed):
    """app.checkpointing: every `every_steps` decode steps, and at once when a stop is served, the rows still running
    append the tokens the sidecar lacks (a resumed row from its partial's end); a row finished before a checkpoint
    appends nothing; the sidecar then reads back as each running row's output so far (exact ints). on_checkpoint
    runs at the first checkpoint only (at most every REPORT_EVERY_S), the stage counters count every write."""
    from lightning_moe.app.checkpointing import InFlight, PartialCheckpoints
    from lightning_moe.config import CheckpointConfig

    rng = random.Random(seed)
    path = str(tmp_path / "o.partial.jsonl")
    earlier = [rng.randrange(50_000) for _ in range(rng.randrange(1, 6))]
    first = PartialsFile(path)
    first.append([("b", 0, earlier)])
    first.close()
    ids = ["a", "b", "c", "d"][: rng.randrange(3, 5)]
    side = PartialsFile(path)
    partials = side.load(ids, set())
    rows = InFlight(ids, partials, None)
    every = rng.randrange(1, 4)
    steps = rng.randrange(every + 1, 3 * every + 3)
    stages, saves = {}, []
    ck = PartialCheckpoints(CheckpointConfig(every_steps=every, every_seconds=None), side, stages,
                            lambda: saves.append(1))
    want = {i: list(partials.get(i, [])) for i in ids}
    for step in range(steps):
        toks = [rng.randrange(50_000) for _ in ids]
        rows.add_tokens(list(range(len(ids))), toks)
        for r, (i, t) in enumerate(zip(ids, toks)):
            if not rows.finished[r]:
                want[i].append(t)
        if step == 0:
            rows.finished[ids.index("c")] = True  # its record written before any checkpoint
        ck.step(rows, stopping=step == steps - 1)
    side.close()
    writes = steps // every + (steps % every != 0)  # every `every` steps, and the stop at the last one
    assert stages["checkpoint_write_calls"] == writes and saves == [1]
    assert read_partials(path) == {i: t for i, t in want.items() if i != "c"}
