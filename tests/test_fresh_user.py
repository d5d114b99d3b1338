"""Fresh-user leftovers: the report's wall_seconds add up with one-time setup apart; errors name the job file as
typed; merge --output resolves against the current directory, its default against the YAML's."""

import json
import os

from lightning_moe import cli
from lightning_moe.app import engine
from lightning_moe.config import job_from_dict


def test_wall_seconds_add_up_with_setup(tiny_dir, tmp_path, monkeypatch):
    import time

    from lightning_moe.model import tiny

    real, first = tiny.ensure_tiny_mixtral, []

    def slow_first_use(cache_dir=None):  # the embedded model's creation on first use: 0.3 s, once
        if not first:
            first.append(1)
            time.sleep(0.3)
        return tiny_dir

    monkeypatch.setattr(tiny, "ensure_tiny_mixtral", slow_first_use)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "alpha"}) + "\n")
    job = job_from_dict({"model": "tiny-mixtral", "device": "cpu", "dtype": "float32",
                         "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / "o.jsonl")},
                         "generation": {"max_new_tokens": 3}}, "job")
    assert real is not slow_first_use
    w = engine.run_job(job, progress=False)["wall_seconds"]
    assert set(w) == {"total", "setup", "load", "warmup", "prefill", "decode", "other"}
    assert w["setup"] >= 0.3 and w["load"] < w["total"] - 0.3
    assert abs(w["setup"] + w["load"] + w["prefill"] + w["decode"] + w["other"] - w["total"]) < 1e-9
    from lightning_moe.app.report import format_report

    rep = json.loads((tmp_path / "o.report.json").read_text())
    assert f"wall s: total {w['total']:,.2f} = setup {w['setup']:,.2f}" in format_report(rep)


def test_merge_output_relative_to_cwd(tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "p.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": "x"}) + "\n" for i in range(4)))
    (a / "job.yaml").write_text("model: tiny-mixtral\ndata: {path: p.jsonl}\noutput: {path: out.jsonl}\n")
    for s, ids in ((0, ["0", "2"]), (1, ["1", "3"])):
        (a / f"out.shard-{s}-of-2.jsonl").write_text("".join(json.dumps({"id": i, "text": ""}) + "\n" for i in ids))
    monkeypatch.chdir(b)
    assert cli.main(["merge", "../a/job.yaml", "--shards", "2", "--output", "merged.jsonl"]) == 0
    assert "into merged.jsonl" in capsys.readouterr().out
    assert [json.loads(x)["id"] for x in (b / "merged.jsonl").read_text().splitlines()] == ["0", "1", "2", "3"]
    assert not (a / "merged.jsonl").exists()
    assert cli.main(["merge", "../a/job.yaml", "--shards", "2"]) == 0  # default: output.path, beside the YAML
    assert (a / "out.jsonl").exists() and not (b / "out.jsonl").exists()


def test_job_errors_name_the_yaml_as_typed(tiny_dir, tmp_path, monkeypatch, capsys):
    """A policy error (checked against the job before weights) names the YAML as the user typed it."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    (tmp_path / "job.yaml").write_text(f"model: {tiny_dir}\ndevice: cpu\nexecutor: cgopipe\n"
                                       f"policy: {{mu: 2, n: 1, bogus: 3}}\ndata: {{path: p.jsonl}}\n"
                                       f"output: {{path: o.jsonl}}\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "job.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-batch: error: job.yaml: policy") and os.path.abspath("job.yaml") not in err


def test_other_seconds_name_where_other_goes(tiny_dir, tmp_path, monkeypatch):
    """wall_seconds.other is split in the report's other_seconds: a slow planner shows as plan, the parts add up to
    other, and the summary prints them."""
    import time

    real_plan = engine.plan_for_job

    def slow_plan(job, prep):
        time.sleep(0.3)
        return real_plan(job, prep)

    monkeypatch.setattr(engine, "plan_for_job", slow_plan)
    from lightning_moe.app import plan as app_plan

    real_files = app_plan.ModelFiles

    def slow_files(model):  # a slow first transformers import: 0.2 s
        time.sleep(0.2)
        return real_files(model)

    monkeypatch.setattr(app_plan, "ModelFiles", slow_files)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": "alpha " * (i + 1)}) + "\n" for i in range(3)))
    job = job_from_dict({"model": str(tiny_dir), "device": "cpu", "dtype": "float32",
                         "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / "o.jsonl")},
                         "generation": {"max_new_tokens": 3}}, "job")
    rep = engine.run_job(job, progress=False)
    o, w = rep["other_seconds"], rep["wall_seconds"]
    assert set(o) == {"model_files", "requests", "plan", "gpu_init", "run", "rest"}
    assert o["plan"] >= 0.3 and o["plan"] <= w["other"]
    assert o["model_files"] >= 0.2 and o["requests"] < 0.2  # the sleep lands in model_files, not in requests
    assert abs(sum(o.values()) - w["other"]) < 1e-6
    from lightning_moe.app.report import format_report

    assert (f"other s: model_files {o['model_files']:,.2f}, requests {o['requests']:,.2f}, plan {o['plan']:,.2f}"
            in format_report(rep))


def test_other_parts_clamps_and_omits():
    from lightning_moe.app.report import other_parts

    wall = {"warmup": 1.0, "prefill": 2.0, "decode": 3.0, "other": 5.0}
    o = other_parts(wall, {"model_files": 0.25, "requests": 0.25, "plan": 1.0, "gpu_init": 2.0, "run": 6.5})
    assert o == {"model_files": 0.25, "requests": 0.25, "plan": 1.0, "gpu_init": 2.0, "run": 0.5, "rest": 1.0}
    assert other_parts(wall, {"requests": 0.5}) == {"requests": 0.5, "rest": 4.5}
    assert other_parts({**wall, "other": 0.1}, {"requests": 0.5})["rest"] == 0.0


def test_the_embedded_model_is_written_with_plain_modes(tmp_path):
    """The embedded model's directory and files take the modes a plain mkdir / open gives under the umask (not
    mkdtemp's 0700 and safetensors' 0600), so a LIGHTNING_MOE_CACHE shared by several users serves each of them."""
    import os
    import stat

    from lightning_moe.model import tiny

    old = os.umask(0o022)
    try:
        path = tiny.ensure_tiny_mixtral(str(tmp_path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    names = os.listdir(path)
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert {n: stat.S_IMODE(os.stat(os.path.join(path, n)).st_mode) for n in names} == {n: 0o644 for n in names}
