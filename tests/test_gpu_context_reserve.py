"""The GPU memory a capped job's process holds outside torch's allocator (session 41).

On the H100 host (torch 2.11 / CUDA 13) a job's process held 1.12-1.34 GiB outside the caching allocator (CUDA
context, library handles, loaded kernels); the planner reserved 1 GiB for it, so a Qwen3-30B-A3B-width job at 12 GiB
planned 10.7 GiB of tensors into the 10.66 GiB the cap left torch and ran out of memory in prefill. The profile now
measures ``gpu_context_bytes``; the planner's allocator reserve covers it (policy.gpu_reserve_for), and a job whose
process holds more than its plan reserved is refused before any weight is read (app.plan.check_gpu_cap).
"""

import io
import dataclasses
import os

import pytest

from lightning_moe.app.plan import JobPlan, check_gpu_cap
from lightning_moe.config import job_from_dict
from lightning_moe.policy import hrm
from lightning_moe.policy.hardware import HardwareProfile, get_preset
from lightning_moe.policy.milp import plan
from lightning_moe.policy.policy import DEFAULT_GPU_RESERVE, Budgets, PolicyError, Workload, gpu_reserve_for
from lightning_moe.policy.registry import resolve_spec

GiB = 1 << 30
PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_moe", "policy",
                        "profiles")


def test_reserve_is_the_default_or_the_measured_context_and_workspaces():
    hw = get_preset("h100")
    assert hw.gpu_context_bytes == 0 and gpu_reserve_for(hw) == DEFAULT_GPU_RESERVE
    small = dataclasses.replace(hw, gpu_context_bytes=600 << 20)  # 0.6 GiB: the default covers it
    assert gpu_reserve_for(small) == DEFAULT_GPU_RESERVE
    big = dataclasses.replace(hw, gpu_context_bytes=1443233792)
    assert gpu_reserve_for(big) == 1443233792 + hrm.LIBRARY_WORKSPACE
    assert Budgets.for_hardware(big).gpu_reserve == 1443233792 + hrm.LIBRARY_WORKSPACE
    assert Budgets.for_hardware(big, gpu_reserve=5).gpu_reserve == 5  # an explicit reserve stands


def test_the_committed_h100_profile_carries_its_measured_context(tmp_path):
    hw = HardwareProfile.load(os.path.join(PROFILES, "h100-host.yaml"))
    assert hw.gpu_context_bytes == 1443233792
    path = str(tmp_path / "p.yaml")
    hw.save(path)
    assert HardwareProfile.load(path).gpu_context_bytes == hw.gpu_context_bytes  # round trip


def _plan(hw, cap):
    spec = resolve_spec("qwen3-30b-a3b")
    spec = dataclasses.replace(spec, num_layers=8)
    wl = Workload.from_lengths([60 + (7 * i) % 300 for i in range(1000)], gen_len=32)
    return spec, wl, plan(spec, hw, wl, Budgets.for_hardware(hw, gpu_memory=cap, cpu_memory=100 * GiB))


def _cap(cap, outside):
    return {"cap_bytes": cap, "outside_torch_bytes": outside, "torch_limit_bytes": cap - outside}


def _jplan(pol, est):
    return JobPlan(policy=pol, estimate=est, gpu_budget=pol.gpu_budget, cpu_budget=pol.cpu_budget, hardware=None)


def _job(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    return job_from_dict({"model": "tiny-mixtral", "data": {"source": "jsonl", "path": str(tmp_path / "p.jsonl")},
                          "output": {"path": str(tmp_path / "o.jsonl")}}, "t.yaml")


def test_a_plan_with_the_measured_context_fits_what_the_cap_leaves_torch(tmp_path):
    """Planned with the measured context, the largest phase's tensors, fragmentation allowance and library
    workspaces fit gpu_memory minus that context; planned with the 1 GiB default on the same host they do not
    (the session-41 OOM), and check_gpu_cap refuses that plan before the weights are read."""
    cap, ctx = 12 * GiB, 1443233792
    hw = get_preset("h100")
    measured = dataclasses.replace(hw, gpu_context_bytes=ctx)
    _, _, (pol, est) = _plan(measured, cap)
    m = est.memory
    need = max(m.phase_total(p) for p in m.gpu_phases) - pol.gpu_reserve + hrm.LIBRARY_WORKSPACE
    assert pol.gpu_reserve == ctx + hrm.LIBRARY_WORKSPACE and need <= cap - ctx
    check_gpu_cap(_job(tmp_path), _jplan(pol, est), _cap(cap, ctx))  # fits: no error
    _, _, (pol0, est0) = _plan(hw, cap)  # the default reserve on the same host
    m0 = est0.memory
    need0 = max(m0.phase_total(p) for p in m0.gpu_phases) - pol0.gpu_reserve + hrm.LIBRARY_WORKSPACE
    assert need0 > cap - ctx  # the planner filled what a 1 GiB reserve leaves
    with pytest.raises(PolicyError, match=r"t\.yaml: .*do not fit.*outside its allocator"):
        check_gpu_cap(_job(tmp_path), _jplan(pol0, est0), _cap(cap, ctx))
    check_gpu_cap(_job(tmp_path), _jplan(pol0, est0), _cap(cap, DEFAULT_GPU_RESERVE - hrm.LIBRARY_WORKSPACE))
    check_gpu_cap(_job(tmp_path), _jplan(pol0, est0), None)  # no cap: nothing to check


def test_plan_cli_reserves_the_profiles_context(tmp_path, capsys):
    """`moe-batch plan` with a profile that measured its context prints that reserve (no --gpu-reserve)."""
    from lightning_moe.cli import main

    rc = main(["plan", "--model", "qwen3-30b-a3b", "--hardware", os.path.join(PROFILES, "h100-host.yaml"),
               "--gpu-memory", "24GiB", "--num-prompts", "200", "--prompt-len", "100", "--gen-len", "16",
               "--cpu-memory", "100GiB", "--time-limit", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    reserve = gpu_reserve_for(HardwareProfile.load(os.path.join(PROFILES, "h100-host.yaml")))
    lines = [ln.split() for ln in out.splitlines() if ln.strip().startswith("allocator reserve")]
    assert lines and all(ln[-2:] == [f"{reserve / GiB:.1f}", "GiB"] for ln in lines), out


def test_an_auto_plan_that_no_longer_fits_is_made_again_with_the_measured_context(tmp_path, monkeypatch):
    """fit_plan_to_cap: a `policy: auto` plan made with the 1 GiB default that does not fit what the cap left torch
    is planned again with the process's outside bytes as gpu_context_bytes (then fits, and says so in one line);
    a plan that fits is kept as it is; an explicit policy that does not fit is refused (check_gpu_cap)."""
    from lightning_moe.app import plan as app_plan

    cap, ctx = 12 * GiB, 1443233792
    hw = get_preset("h100")
    spec, wl, (pol0, est0) = _plan(hw, cap)
    calls = []

    def policy_for_job(job, prep, hw2):
        calls.append(hw2.gpu_context_bytes)
        return plan(spec, hw2, wl, Budgets.for_hardware(hw2, gpu_memory=cap, cpu_memory=100 * GiB))

    monkeypatch.setattr(app_plan, "policy_for_job", policy_for_job)
    monkeypatch.setattr(app_plan, "check_plan", lambda job, prep, p, e, h: JobPlan(p, e, cap, 100 * GiB, h))
    job = _job(tmp_path)
    first = JobPlan(pol0, est0, cap, 100 * GiB, hw)
    log = []

    class Log:
        def write(self, s):
            log.append(s)

        def flush(self):
            pass

    again = app_plan.fit_plan_to_cap(job, None, first, _cap(cap, ctx), Log())
    assert calls == [ctx] and again.policy.gpu_reserve == ctx + hrm.LIBRARY_WORKSPACE
    assert again.hardware.gpu_context_bytes == ctx and "planning again with it" in "".join(log)
    assert app_plan._cap_need(again)[1] <= cap - ctx
    assert app_plan.fit_plan_to_cap(job, None, first, _cap(cap, 600 << 20), Log()) is first  # fits: kept
    assert calls == [ctx]
    fixed = dataclasses.replace(job, policy={"mu": pol0.mu})
    with pytest.raises(PolicyError, match="do not fit"):
        app_plan.fit_plan_to_cap(fixed, None, first, _cap(cap, ctx), Log())


def test_a_job_under_a_torch_profiler_writes_nothing_to_the_cached_profile(tmp_path, monkeypatch):
    """While a torch profiler records (benchmarks/profile_prefill.py: its device buffers count outside the allocator,
    its callbacks slow every launch; session 42 cached a profiled job's 2.21 GiB context and the next jobs reserved
    it), nothing a job measures is written to the host's cached profile: fit_plan_to_cap's context (the job still
    re-plans with it), a job's expert rates or host probe (_cache_job_measurement) and a first job's whole profile
    (measure_gpu_profile); one line says so. Without a profiler each path writes."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_moe.app import plan as app_plan
    from lightning_moe.pipeline import profiler as prof_mod

    cap, ctx = 12 * GiB, 1443233792
    hw = get_preset("h100")
    spec, wl, (pol0, est0) = _plan(hw, cap)
    monkeypatch.setattr(app_plan, "policy_for_job", lambda job, prep, hw2: plan(
        spec, hw2, wl, Budgets.for_hardware(hw2, gpu_memory=cap, cpu_memory=100 * GiB)))
    monkeypatch.setattr(app_plan, "check_plan", lambda job, prep, p, e, h: JobPlan(p, e, cap, 100 * GiB, h))
    monkeypatch.setattr(app_plan, "cached_gpu_profile", lambda job: str(tmp_path / "host.yaml"))
    monkeypatch.setattr(app_plan, "device_name", lambda device: "card")
    monkeypatch.setattr(prof_mod, "profile_host", lambda **kw: hw)
    written = []
    monkeypatch.setattr(app_plan, "save_gpu_profile", lambda prof, name, header: written.append(prof) or "x")
    job, first = _job(tmp_path), JobPlan(pol0, est0, cap, 100 * GiB, hw)

    def every_path(log):
        again = app_plan.fit_plan_to_cap(job, None, first, _cap(cap, ctx), log)
        assert again.hardware.gpu_context_bytes == ctx  # the job re-plans with what its process holds either way
        app_plan._cache_job_measurement(hw, job, "host.yaml", "the rates", log)
        assert app_plan.measure_gpu_profile("cpu", "card", log) is hw

    log = io.StringIO()
    with profile(activities=[ProfilerActivity.CPU]):
        every_path(log)
    assert written == [] and log.getvalue().count("a torch profiler is recording") == 3, log.getvalue()
    every_path(io.StringIO())
    assert len(written) == 3 and written[0].gpu_context_bytes == ctx
