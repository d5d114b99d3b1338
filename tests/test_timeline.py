"""The measured stage timeline (moe-batch run --timeline): spans recorded only when asked, per lane and phase, from
the cgopipe executor on the CPU; the CLI draws a PNG, refuses a serial job and a missing matplotlib before running."""

import json
import sys

import torch

from lightning_moe import cli
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.stage_stats import SPAN_LANES, StageTimer
from lightning_moe.policy.policy import Policy


def _executor(path):
    return CGOPipeExecutor(load_checkpoint(path, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")


def test_spans_only_when_asked(hf_mixtral):
    path, _ = hf_mixtral
    prompts = [[1, 5, 6, 7], [1, 9], [1, 3, 3], [1, 8, 8, 8, 8]]
    sp = DecodeSampling(max_new_tokens=5, stop_at_eos=False)
    ex = _executor(path)
    try:
        ex.generate(prompts, sp)
        assert ex.timer._spans == [] and ex.timer._gpu_spans == [] and not ex.timer.spans_on  # default: nothing kept
        ex.timer.start_spans()
        ex.generate(prompts, sp)
        spans = ex.timer.take_spans()
        assert not ex.timer.spans_on
        ex.generate(prompts, sp)
        assert ex.timer._spans == []
    finally:
        ex.close()
    lanes = {s["lane"] for s in spans}
    assert {SPAN_LANES[k] for k in ("h2d_copy", "expert_ffn", "cpu_attention", "gpu_attention")} <= lanes
    phases = {s["phase"]: s for s in spans if s["stage"] == "phase"}
    assert set(phases) == {"prefill", "decode"} and phases["prefill"]["end"] <= phases["decode"]["start"]
    assert len([s for s in spans if s["stage"] == "step"]) == 4  # decode steps after the prefill's token
    for s in spans:
        assert 0 <= s["start"] <= s["end"]
        if s["stage"] not in ("phase", "step"):  # every interval inside its phase
            ph = phases[s["phase"]]
            assert ph["start"] - 1e-6 <= s["start"] and s["end"] <= ph["end"] + 1e-6, s
    ffn = sorted((s["start"], s["end"]) for s in spans if s["stage"] == "expert_ffn")
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(ffn, ffn[1:]))  # one compute stream: no overlap
    # decode: 2 layers x 2 micro-batches x 4 steps expert FFN calls
    assert len([s for s in spans if s["stage"] == "expert_ffn" and s["phase"] == "decode"]) == 2 * 2 * 4


def test_timer_around_records_nothing_by_default():
    t = StageTimer(cuda=False)
    assert t.around("h2d_copy", None, lambda: 3) == 3 and t.timed("expert_ffn", None, lambda: 4) == 4
    t.span("cpu_attention", 0.0, 1.0)
    assert t._spans == [] and t.take_spans() == []


def _job(tmp_path, tiny_dir, executor="cgopipe"):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": f"alpha beta {i}"}) + "\n" for i in range(6)))
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny_dir}\ndevice: cpu\ndtype: float32\nexecutor: {executor}\n"
                   f"policy: {{mu: 2, n: 3}}\ndata: {{path: p.jsonl}}\ngeneration: {{max_new_tokens: 4}}\n"
                   f"output: {{path: out.jsonl}}\n")
    return str(job)


def test_cli_timeline_png(tiny_dir, tmp_path, capsys):
    png = tmp_path / "tl.png"
    assert cli.main(["run", _job(tmp_path, tiny_dir), "--no-progress", "--timeline", str(png)]) == 0
    assert f"timeline: {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


def test_cli_timeline_refusals(tiny_dir, tmp_path, capsys, monkeypatch):
    job = _job(tmp_path, tiny_dir, executor="serial")
    assert cli.main(["run", job, "--no-progress", "--timeline", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert "job.yaml: executor: the timeline draws the cgopipe executor's stages" in err and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    job = _job(tmp_path, tiny_dir)
    assert cli.main(["run", job, "--no-progress", "--timeline", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err == "moe-batch: error: --timeline needs matplotlib: pip install 'lightning-moe[plot]'\n"
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "b.png").exists()  # nothing ran
