"""End-to-end jobs on the embedded tiny model: resume, interruption, bad input, sharding, the CLI."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_moe.app.report import format_report

from tests.support.prompt_files import jsonl_prompts as _prompts
from lightning_moe import cli
from lightning_moe.config import job_from_dict
from lightning_moe.data.writer import ResultsWriter, read_results
from lightning_moe.app.engine import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def _job(tmp_path, tiny_dir, data, out="out.jsonl", **kw):
    d = {"model": tiny_dir, "data": {"source": "jsonl", "path": data}, "output": {"path": str(tmp_path / out)},
         "device": "cpu", "dtype": "float32", "executor": "serial", "batch_size": 4,
         "generation": {"max_new_tokens": 6, "temperature": 0.0, "stop_at_eos": False}}
    d.update(kw)
    return job_from_dict(d, "test.yaml", base_dir=str(tmp_path))


def _by_id(path):
    return {r["id"]: r for r in read_results(path)}


def test_generate_writes_all_records_and_report(tmp_path, tiny_dir):
    job = _job(tmp_path, tiny_dir, _prompts(tmp_path / "in.jsonl"))
    rep = run_job(job, progress=False)
    recs = read_results(job.output.path)
    assert len(recs) == 12 and len({r["id"] for r in recs}) == 12
    lens = [r["prompt_tokens"] for r in recs]
    assert lens == sorted(lens) and len(set(lens)) > 3  # batches are formed from length-sorted requests
    r0 = recs[0]
    assert set(r0) >= {"id", "prompt_tokens", "text", "output_ids", "finish_reason"}
    assert len(r0["output_ids"]) == 6 and r0["finish_reason"] == "length"
    saved = json.load(open(job.output.report_path))
    assert saved["status"] == "done" and saved["generated_tokens"] == 72 == rep["generated_tokens"]
    assert saved["decode_tokens_per_s"] > 0 and saved["peak_host_memory_bytes"] > 0


def test_interrupted_run_resumes_to_same_records(tmp_path, tiny_dir, monkeypatch):
    """Interrupted after k records, re-run: exactly N records, no duplicates, same content as uninterrupted."""
    data = _prompts(tmp_path / "in.jsonl")
    ref = _job(tmp_path, tiny_dir, data, out="ref.jsonl")
    run_job(ref, progress=False)
    job = _job(tmp_path, tiny_dir, data, out="int.jsonl")
    real_write, count = ResultsWriter.write, {"n": 0}

    def flaky_write(self, rec):
        if count["n"] == 5:
            raise KeyboardInterrupt("simulated Ctrl-C after 5 records")
        count["n"] += 1
        real_write(self, rec)

    monkeypatch.setattr(ResultsWriter, "write", flaky_write)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, progress=False)
    assert len(read_results(job.output.path)) == 5
    assert json.load(open(job.output.report_path))["status"].startswith("failed")
    monkeypatch.setattr(ResultsWriter, "write", real_write)
    rep = run_job(job, progress=False)
    assert rep["skipped_already_done"] == 5 and rep["records_written_this_run"] == 7
    recs = read_results(job.output.path)
    assert len(recs) == 12 and len({r["id"] for r in recs}) == 12
    assert _by_id(job.output.path) == _by_id(ref.output.path)
    rep2 = run_job(job, progress=False)  # a third run does nothing and keeps the finishing run's report
    assert rep2.pop("nothing_to_do") is True and "nothing_to_do" not in rep
    assert rep2 == json.load(open(job.output.report_path)) == rep and len(read_results(job.output.path)) == 12


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_job_without_cuda_is_a_clear_error(tmp_path, tiny_dir, capsys):
    job = tmp_path / "j.yaml"
    job.write_text(f"model: {tiny_dir}\ndata: {{source: jsonl, path: {_prompts(tmp_path / 'in.jsonl')}}}\n"
                   f"output: {{path: {tmp_path / 'o.jsonl'}}}\n")  # device defaults to cuda
    assert cli.main(["run", str(job), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "device: cuda" in err and "device=cpu" in err and str(job) in err
    assert not (tmp_path / "o.jsonl").exists()


def test_sigkill_midrun_then_rerun_matches_uninterrupted(tmp_path, tiny_dir):
    """A run killed with SIGKILL (and a torn last line) resumes to exactly the uninterrupted records."""
    data = _prompts(tmp_path / "in.jsonl", n=40)
    ref = _job(tmp_path, tiny_dir, data, out="ref.jsonl", batch_size=1)
    run_job(ref, progress=False)
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text(
        f"model: {tiny_dir}\ndata: {{source: jsonl, path: {data}}}\noutput: {{path: {tmp_path / 'k.jsonl'}}}\n"
        "device: cpu\ndtype: float32\nexecutor: serial\nbatch_size: 1\n"
        "generation: {max_new_tokens: 6, temperature: 0.0, stop_at_eos: false}\n")
    out = tmp_path / "k.jsonl"
    cmd = [sys.executable, "-m", "lightning_moe.cli", "run", str(yaml_path), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_before = out.read_text().count("\n")
    assert 3 <= n_before < 40, "the kill must land mid-run"
    with open(out, "ab") as f:  # what a kill inside write() leaves: a partial last line
        f.write(b'{"id": "q39", "prompt_tokens": 7, "te')
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert _by_id(out) == _by_id(ref.output.path)
    assert out.read_text().count("\n") == 40


def test_cli_unknown_key_and_bad_line(tmp_path, tiny_dir, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {tiny_dir}\ndata: {{source: jsonl, path: x.jsonl}}\noutput: {{path: o.jsonl}}\nbatchsize: 3\n")
    assert cli.main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "batchsize" in err and str(bad) in err
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n\n{"id": "b", "prompt": "x"\n')
    good = tmp_path / "g.yaml"
    good.write_text(f"model: {tiny_dir}\ndata: {{source: jsonl, path: d.jsonl}}\noutput: {{path: o.jsonl}}\ndevice: cpu\n")
    assert cli.main(["run", str(good), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:3" in err
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_text() == ""


def test_empty_prompt_error_or_record(tmp_path, tiny_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "prompt": "hello there"}\n{"id": "b", "prompt": ""}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2.*prompt"):
        run_job(_job(tmp_path, tiny_dir, str(data)), progress=False)
    job = _job(tmp_path, tiny_dir, str(data), out="rec.jsonl", on_error="record")
    rep = run_job(job, progress=False)
    recs = _by_id(job.output.path)
    assert set(recs) == {"a", "b"} and "error" in recs["b"] and "prompt" in recs["b"]["error"]
    assert rep["errors_recorded"] == 1 and recs["a"]["finish_reason"] == "length"
    # the printed report shows why, not only how many (the reason is otherwise only inside the results file)
    assert rep["first_error"] == recs["b"]["error"]
    assert f"  first error record: {recs['b']['error']} (every error record" in format_report(rep)
    assert "first error record" not in format_report({**rep, "first_error": None})


def test_shards_then_merge_reproduce_unsharded(tmp_path, tiny_dir):
    data = _prompts(tmp_path / "in.jsonl", n=15)
    full = _job(tmp_path, tiny_dir, data, out="full.jsonl")
    run_job(full, progress=False)
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text(
        f"model: {tiny_dir}\ndata: {{source: jsonl, path: in.jsonl}}\noutput: {{path: sh.jsonl}}\n"
        "device: cpu\ndtype: float32\nexecutor: serial\nbatch_size: 4\n"
        "generation: {max_new_tokens: 6, temperature: 0.0, stop_at_eos: false}\n")
    for i in range(3):
        assert cli.main(["run", str(yaml_path), "--shard", f"{i}/3", "--no-progress"]) == 0
    sizes = [len(read_results(str(tmp_path / f"sh.shard-{i}-of-3.jsonl"))) for i in range(3)]
    assert sum(sizes) == 15 and all(s < 15 for s in sizes)
    assert cli.main(["merge", str(yaml_path), "--shards", "3"]) == 0
    merged = read_results(str(tmp_path / "sh.jsonl"))
    assert [r["id"] for r in merged] == [f"q{i}" for i in range(15)]
    assert {r["id"]: r for r in merged} == _by_id(full.output.path)
    os.remove(tmp_path / "sh.jsonl")
    os.remove(tmp_path / "sh.shard-1-of-3.jsonl")
    assert cli.main(["merge", str(yaml_path), "--shards", "3"]) == 2  # a missing shard is an error


def test_sampling_is_seeded_per_request(tmp_path, tiny_dir):
    """Temperature sampling: same records whatever the batch size (per-request generators)."""
    data = _prompts(tmp_path / "in.jsonl", n=6)
    gen = {"max_new_tokens": 5, "temperature": 0.9, "top_p": 0.9, "seed": 3, "stop_at_eos": False}
    a = _job(tmp_path, tiny_dir, data, out="a.jsonl", batch_size=1, generation=gen)
    b = _job(tmp_path, tiny_dir, data, out="b.jsonl", batch_size=6, generation=gen)
    run_job(a, progress=False)
    run_job(b, progress=False)
    assert _by_id(a.output.path) == _by_id(b.output.path)
    c = _job(tmp_path, tiny_dir, data, out="c.jsonl", generation=dict(gen, seed=4))
    run_job(c, progress=False)
    assert _by_id(c.output.path) != _by_id(a.output.path)


def test_resume_with_other_settings_is_refused(tmp_path, tiny_dir):
    """A results file remembers what its records depend on (<stem>.meta.json): re-running the job with another
    model or other decoding settings into the same file is an error naming the difference, and nothing is written;
    the same settings resume as before, and a results file without a saved record (older versions) is accepted."""
    from lightning_moe.config import ConfigError

    data = _prompts(tmp_path / "in.jsonl", n=4)
    job = _job(tmp_path, tiny_dir, data)
    run_job(job, progress=False)
    before = open(job.output.path, "rb").read()
    meta = json.load(open(job.output.meta_path))
    assert meta["model"] == tiny_dir and meta["generation"]["max_new_tokens"] == 6
    other = _job(tmp_path, tiny_dir, data, generation={"max_new_tokens": 9, "temperature": 0.0, "stop_at_eos": False})
    with pytest.raises(ConfigError, match=r"holds records of different settings \(generation: .*'max_new_tokens': 6.* "
                                          r"then, .*'max_new_tokens': 9.* now; saved in .*out\.meta\.json\)"):
        run_job(other, progress=False)
    with pytest.raises(ConfigError, match=r"dtype: 'float32' then, 'bfloat16' now"):
        run_job(_job(tmp_path, tiny_dir, data, dtype="bfloat16"), progress=False)
    assert open(job.output.path, "rb").read() == before  # nothing written
    run_job(job, progress=False)  # the same settings: fine (all done)
    os.remove(job.output.meta_path)  # an older version's results: accepted, the record is saved now
    run_job(other, progress=False)
    assert json.load(open(job.output.meta_path))["generation"]["max_new_tokens"] == 9


def test_unreadable_meta_file_is_a_clear_error(tmp_path, tiny_dir):
    from lightning_moe.config import ConfigError

    data = _prompts(tmp_path / "in.jsonl", n=2)
    job = _job(tmp_path, tiny_dir, data)
    run_job(job, progress=False)
    before = open(job.output.path, "rb").read()
    with open(job.output.meta_path, "w") as f:
        f.write('{"model": ')  # torn
    with pytest.raises(ConfigError, match=r"out\.meta\.json: unreadable record of what .*out\.jsonl depends on"):
        run_job(job, progress=False)
    assert open(job.output.path, "rb").read() == before


def test_large_checkpoint_read_and_pool_fill_are_announced(tmp_path, tiny_dir, capfd, monkeypatch):
    """A checkpoint of at least LOUD_LOAD_BYTES gets one line before and after its read, and a cgopipe job one line
    before and after filling the page pool (minutes at full size: a user sees where the run is)."""
    from lightning_moe.app import engine

    monkeypatch.setattr(engine, "LOUD_LOAD_BYTES", 1)
    job = _job(tmp_path, tiny_dir, _prompts(tmp_path / "in.jsonl"), executor="cgopipe", policy={"mu": 4, "n": 2})
    run_job(job, progress=False)
    err = capfd.readouterr().err
    size = engine.checkpoint_bytes(tiny_dir)
    # cgopipe reads the experts into its pool a layer at a time: the first read is the rest
    assert size > 0 and (f"moe-batch: reading the non-expert weights of {tiny_dir} ({size / 2**30:.1f} GiB in all; "
                         f"the experts are read a layer at a time as the page pool fills)") in err, err
    assert "moe-batch: non-expert weights read in " in err
    assert "GiB of experts into the pinned page pool and 0 resident experts to cpu" in err, err
    assert "moe-batch: executor ready in " in err
    run_job(_job(tmp_path, tiny_dir, _prompts(tmp_path / "in1.jsonl"), out="o1.jsonl", executor="serial"),
            progress=False)  # the serial executor reads everything at once
    err = capfd.readouterr().err
    assert f"moe-batch: reading {size / 2**30:.1f} GiB of weights from {tiny_dir}" in err, err
    assert "moe-batch: weights read in " in err
    monkeypatch.setattr(engine, "LOUD_LOAD_BYTES", 2**40)  # a small checkpoint stays quiet
    run_job(_job(tmp_path, tiny_dir, _prompts(tmp_path / "in2.jsonl"), out="o2.jsonl"), progress=False)
    assert "reading" not in capfd.readouterr().err
