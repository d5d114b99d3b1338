"""Host issue probes per family, edge cases: which jobs probe (none without decode), the CUDA expert FFN a probe runs,
a profile with family entries but no generic probe, the pair format."""
import dataclasses
import json
import os

import pytest

from lightning_moe.app import plan
from tests.test_user_path import _FakeRateProbes, _cgopipe_job, _cuda_host_with_cached_profile


def _ds_host(tmp_path, tiny_dir, monkeypatch):
    from tests.support import make_checkpoint as mk
    from lightning_moe.policy.hardware import HardwareProfile

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", os.path.dirname(tiny_dir))
    ds = mk.write_checkpoint(str(tmp_path / "ds"), mk.Dims.from_registry("deepseek-v2-lite", 2).tiny(),
                             log=open(os.devnull, "w"))["path"]
    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    dataclasses.replace(HardwareProfile.load(path), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006).save(path)
    _FakeRateProbes(monkeypatch)
    calls = []
    monkeypatch.setattr("lightning_moe.pipeline.profiler.measure_host_issue",
                        lambda device="cuda", probe="generic", **kw: calls.append((device, probe)) or (0.009, 0.011))
    return ds, calls


def test_a_scoring_job_runs_no_host_issue_probe(tmp_path, tiny_dir, monkeypatch):
    """A scoring job has no decode: the host term it would price is never used, so no probe should run."""
    ds, calls = _ds_host(tmp_path, tiny_dir, monkeypatch)
    data = tmp_path / "mc.jsonl"
    with open(data, "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"m{i}", "prompt": f"question {i}", "choices": ["a", "b"]}) + "\n")
    job = _cgopipe_job(tmp_path, ds, task="score", score={"mode": "multiple_choice"},
                       data={"source": "jsonl", "path": str(data)})
    jplan = plan.plan_job(job, plan.Prepared(job))
    assert jplan.estimate.host_probe == ""  # the plan priced no host term ...
    assert calls == []  # ... yet the probe ran


def test_a_one_token_generation_runs_no_host_issue_probe(tmp_path, tiny_dir, monkeypatch):
    ds, calls = _ds_host(tmp_path, tiny_dir, monkeypatch)
    job = _cgopipe_job(tmp_path, ds, generation={"max_new_tokens": 1})
    jplan = plan.plan_job(job, plan.Prepared(job))
    assert jplan.estimate.host_probe == ""
    assert calls == []


def test_a_profile_with_family_entries_but_no_generic_probe_is_one_host_stage():
    """A profile whose host_issue_by_family prices the job's host term while its generic fields are 0 (a hand-written
    or merged YAML) must be one host stage everywhere: evaluate prices it, so the note and host_probe must agree."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.policy import Policy, Workload
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("qwen3-30b-a3b")
    hw = dataclasses.replace(get_preset("h200"), host_issue_by_family={"qwen3_moe": (0.05, 0.0)})
    est = hrm.evaluate(Policy(mu=128, n=4, prefill_mu=16, resident_experts=1), spec, hw,
                       Workload(prompt_len=150, gen_len=16))
    assert est.decode_stages["host"] > 0  # priced by the qwen3_moe entry
    assert est.host_probe == "qwen3_moe" and not any("no host issue times" in n for n in est.notes), (
        est.host_probe, est.notes)


def test_every_host_probe_runs_an_expert_ffn_the_executor_accepts_on_cuda():
    """measure_host_issue builds CGOPipeExecutor(ffn=...) on CUDA; check_model (the executor's first step) must accept
    it for every probe key, else that probe always fails on CUDA (gpt_oss dense: biases, clamped SwiGLU)."""
    from lightning_moe.model.families import family_of
    from lightning_moe.pipeline.cgopipe_options import CGOPipeOptions, check_model
    from lightning_moe.pipeline.profiler import _host_probe_ffn, _host_probe_spec, host_probe_keys

    for key in ("generic",) + host_probe_keys():
        spec = _host_probe_spec(2, key)
        scheme = "mxfp4" if key.endswith("/mxfp4") else None
        ffn = _host_probe_ffn(spec, key, cuda=True)
        check_model(spec, family_of(spec), CGOPipeOptions.from_kwargs({"ffn": ffn}), True, scheme)
        assert ffn == ("torch" if key == "gpt_oss" else "triton"), (key, ffn)
        assert _host_probe_ffn(spec, key, cuda=False) == "torch"


def test_a_host_issue_pair_must_be_a_list():
    from lightning_moe.policy.hardware import HardwareError, HardwareProfile, get_preset

    d = get_preset("h100").to_dict()
    with pytest.raises(HardwareError, match="host_issue_by_family: qwen3_moe"):
        HardwareProfile.from_dict({**d, "host_issue_by_family": {"qwen3_moe": "12"}}, "t")  # read as (1.0, 2.0)
