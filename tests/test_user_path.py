"""The user path before and around the executor: the GPU cap's device handling, policies checked against the memory
model before any weight is read, out-of-memory reporting, progress per decode step, scoring batches in sequences."""

import json
import os
import sys

import pytest
import torch

from tests.support.prompt_files import jsonl_prompts as _prompts
from lightning_moe import cli
from lightning_moe.app import engine, plan
from lightning_moe.app import gpu
from lightning_moe.app.gpu import apply_gpu_cap, cuda_index

GiB = 1 << 30


class _FakeCuda:
    """Stands in for torch.cuda on a machine without a GPU: two devices of 80 GiB, 0.5 GiB used outside torch."""

    def __init__(self):
        self.calls = []

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "init", lambda: None)
        monkeypatch.setattr(c, "current_device", lambda: 1)
        monkeypatch.setattr(c, "mem_get_info", lambda i: (80 * GiB - GiB // 2, 80 * GiB))
        monkeypatch.setattr(c, "memory_reserved", lambda i: 0)
        monkeypatch.setattr(c, "set_per_process_memory_fraction", lambda f, i: self.calls.append((f, i)))
        monkeypatch.setattr(gpu, "_has_context", lambda i: True)  # NVML cannot isolate this process: all counts


@pytest.fixture(autouse=True)
def _measure_in_this_process(monkeypatch):
    """The tests stand in for the profiler's probes in this process: the measurements stay here even on a CUDA host
    (app.measure_child would run the real probes in a child)."""
    from lightning_moe.app import measure_child

    monkeypatch.setattr(measure_child, "_in_child", lambda device: False)


def test_gpu_cap_accepts_cuda_and_cuda_index(monkeypatch):
    """The cap takes "cuda" (the current device) and "cuda:N"; set_per_process_memory_fraction gets an int index
    (a bare torch.device("cuda") is what it rejected) and the fraction nets out what the device holds outside torch."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    assert cuda_index("cuda:0") == 0 and cuda_index("cuda") == 1 and cuda_index("cuda:3") == 3
    with pytest.raises(ValueError, match="not a CUDA device"):
        cuda_index("cpu")
    info = apply_gpu_cap("cuda", 24 * GiB)
    assert fake.calls[-1] == (pytest.approx((24 * GiB - GiB // 2) / (80 * GiB)), 1)
    assert info["torch_limit_bytes"] == 24 * GiB - GiB // 2 and info["outside_torch_bytes"] == GiB // 2
    apply_gpu_cap("cuda:0", 16 * GiB)
    assert fake.calls[-1][1] == 0 and isinstance(fake.calls[-1][1], int)
    assert apply_gpu_cap("cuda:0", None) is None and apply_gpu_cap("cpu", 16 * GiB) is None
    with pytest.raises(ValueError, match="exceeds the device's 80.0 GiB"):
        apply_gpu_cap("cuda:0", 81 * GiB)
    with pytest.raises(ValueError, match="leaves nothing for tensors"):
        apply_gpu_cap("cuda:0", GiB // 4)




def test_use_device_makes_the_jobs_cuda_device_current(monkeypatch):
    """Triton launches and torch.cuda.Event / Stream() made without a device go to the current device, so a job on
    cuda:N makes N current; "cuda" keeps the current one; a CPU job touches nothing."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    gpu.use_device("cuda:3")
    gpu.use_device("cuda")
    gpu.use_device("cpu")
    assert chosen == [3, 1]


def test_run_and_llm_make_the_jobs_device_current_before_the_cap(tmp_path, tiny_dir, monkeypatch):
    """`moe-batch run` and the Python API call use_device with the job's device before the GPU cap (which creates the
    CUDA context) and before any weight reaches the executor."""
    from lightning_moe import api

    order = []
    real_cap = gpu.apply_gpu_cap
    monkeypatch.setattr(engine, "use_device", lambda d: order.append(("device", d)))
    monkeypatch.setattr(engine, "apply_gpu_cap", lambda d, m: order.append(("cap", d)) or real_cap(d, m))
    job = _write_job(tmp_path, tiny_dir, {"mu": 4, "n": 1})
    assert cli.main(["run", job, "--no-progress"]) == 0
    assert order == [("device", "cpu"), ("cap", "cpu")]
    order.clear()
    monkeypatch.setattr(gpu, "use_device", lambda d: order.append(("device", d)))
    monkeypatch.setattr(gpu, "apply_gpu_cap", lambda d, m: order.append(("cap", d)) or real_cap(d, m))
    with api.LLM(tiny_dir, device="cpu", dtype="float32", executor="serial"):
        pass
    assert order == [("device", "cpu"), ("cap", "cpu")]


def test_cuda_index_past_the_devices_is_one_line_before_any_weight(tmp_path, tiny_dir, no_weights, monkeypatch,
                                                                   capsys):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    job = _write_job(tmp_path, tiny_dir, {"mu": 4, "n": 1}, device="cuda:2")
    assert cli.main(["run", job, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"moe-batch: error: {job}: device: cuda:2 asked for, but torch sees 2 CUDA device(s): "
                   "cuda:0 to cuda:1")


def test_gpu_cap_counts_own_context_not_other_processes(monkeypatch):
    """With NVML, the cap nets out only this process's CUDA context (NVML free before minus after creating it):
    20 GiB held by another process on the device do not shrink a 24 GiB cap, but the device must have it free."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (59.5 * GiB, 80 * GiB))  # 20 GiB other + 0.5 ours
    monkeypatch.setattr(gpu, "_has_context", lambda i: False)
    nvml = iter([60 * GiB, 59.5 * GiB] * 2)  # free before and after this process's context
    monkeypatch.setattr(gpu, "_nvml_free", lambda i: next(nvml))
    info = apply_gpu_cap("cuda:0", 24 * GiB)
    assert info["outside_torch_bytes"] == GiB // 2 and info["other_processes_bytes"] == 20 * GiB
    assert info["torch_limit_bytes"] == 24 * GiB - GiB // 2
    assert fake.calls[-1] == (pytest.approx((24 * GiB - GiB // 2) / (80 * GiB)), 0)
    with pytest.raises(ValueError, match="the device has 59.50 GiB free .20.00 GiB held by other processes"):
        apply_gpu_cap("cuda:0", 70 * GiB)


def _write_job(tmp_path, tiny_dir, policy, **extra):
    import yaml

    d = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "in.jsonl")},
         "output": {"path": str(tmp_path / "out.jsonl")}, "device": "cpu", "dtype": "float32", "executor": "cgopipe",
         "policy": policy, "generation": {"max_new_tokens": 4, "stop_at_eos": False}, **extra}
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read fails the test: refusals must come before it."""
    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(engine, "load_checkpoint", boom)


def test_oversized_inline_policy_refused_before_weights(tmp_path, tiny_dir, no_weights, capsys):
    job = _write_job(tmp_path, tiny_dir, {"mu": 20000, "n": 2, "resident_experts": 8}, gpu_memory="2GiB")
    assert cli.main(["run", job, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"moe-batch: error: {job}: the inline policy (mu 20000 x n 2")
    assert "does not fit: predicted" in err and "vs gpu_memory 2.0 GiB" in err
    assert not os.path.exists(tmp_path / "out.jsonl") or os.path.getsize(tmp_path / "out.jsonl") == 0


def test_oversized_policy_file_refused_before_weights(tmp_path, tiny_dir, no_weights, capsys):
    from lightning_moe.policy.policy import Policy

    pfile = tmp_path / "big.yaml"
    Policy(mu=20000, n=2, prefill_mu=4, dtype="fp32", weight_quant="fp32").save(str(pfile))
    job = _write_job(tmp_path, tiny_dir, str(pfile), gpu_memory="2GiB")
    assert cli.main(["run", job, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"policy file {pfile}" in err and "does not fit" in err and "\n" not in err


def test_unknown_inline_policy_key_refused_before_weights(tmp_path, tiny_dir, no_weights, capsys):
    job = _write_job(tmp_path, tiny_dir, {"mu": 4, "nn": 2})
    assert cli.main(["run", job, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-batch: error: {job}: policy: unknown key(s) nn (known: mu, n,") and "\n" not in err


def test_fitting_inline_policy_runs_and_reports_predicted_memory(tmp_path, tiny_dir):
    job = _write_job(tmp_path, tiny_dir, {"mu": 4, "n": 3, "resident_experts": 2}, gpu_memory="2GiB")
    assert cli.main(["run", job, "--no-progress"]) == 0
    rep = json.load(open(tmp_path / "out.report.json"))
    mem = rep["memory"]
    assert mem["cap_bytes"] == 2 * GiB and set(mem["predicted_by_phase"]) == {"prefill", "decode"}
    assert mem["predicted_peak_bytes"] == max(mem["predicted_by_phase"].values())
    assert rep["policy"]["mu"] == 4 and rep["policy"]["N"] == 12


def test_out_of_memory_is_one_line_and_keeps_records(tmp_path, tiny_dir, monkeypatch, capsys):
    """A CUDA out-of-memory inside the executor: exit 3, one line naming the phase and the policy, every finished
    record kept, the report's status says so."""
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor

    real = CGOPipeExecutor.generate
    calls = {"n": 0}

    def flaky(self, prompts, params, on_finish=None, **kw):  # out of memory once 4 records are written (the job
        done = {"n": 0}  # runs as one refilling call: a fault after some records, inside the decode)

        def finish(*a):
            on_finish(*a)
            done["n"] += 1
            if done["n"] == 4 and calls["n"] >= 1:
                self._enter("decode")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        calls["n"] += 1
        return real(self, prompts, params, on_finish=finish, **kw)

    monkeypatch.setattr(CGOPipeExecutor, "generate", flaky)
    job = _write_job(tmp_path, tiny_dir, {"mu": 2, "n": 2})
    assert cli.main(["run", job, "--no-progress"]) == 3
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "native CPU attention kernel" not in x]
    assert len(err) == 1 and err[0].startswith("moe-batch: error: out of GPU memory in decode, policy mu 2 x n 2")
    assert "predicted decode peak" in err[0] and "4 records are saved" in err[0]
    assert len(open(tmp_path / "out.jsonl").read().splitlines()) == 4
    rep = json.load(open(tmp_path / "out.report.json"))
    assert rep["status"] == "out of memory in decode" and rep["records_written_this_run"] == 4
    monkeypatch.setenv("MOE_BATCH_DEBUG", "1")  # the debug flag gives the original exception
    with pytest.raises(torch.OutOfMemoryError):
        cli.main(["run", job, "--no-progress"])


@pytest.mark.parametrize("executor", ["serial", "cgopipe"])
def test_progress_advances_every_decode_step(tiny_dir, executor):
    """on_step is called after prefill and after every decode step with the tokens that step generated."""
    from lightning_moe.model.spec import MoESpec
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.pipeline.serial import SerialExecutor
    from lightning_moe.policy.policy import Policy

    w = load_checkpoint(tiny_dir, torch.float32, MoESpec.from_pretrained_dir(tiny_dir))
    ex = (SerialExecutor(w, "cpu") if executor == "serial" else
          CGOPipeExecutor(w, Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu"))
    steps = []
    out = ex.generate([[1, 5, 9], [1, 7], [1, 3, 4, 5], [1]], DecodeSampling(max_new_tokens=5, stop_at_eos=False),
                      on_step=steps.append)
    assert steps == [4, 4, 4, 4, 4] and sum(steps) == sum(len(o) for o, _ in out)
    if hasattr(ex, "close"):
        ex.close()


def test_scoring_batches_count_sequences(tmp_path, tiny_dir):
    """A multiple-choice batch of a scoring policy with N sequences holds at most N sequences (choices), not N
    requests; a request with more choices than N is a batch alone."""
    from lightning_moe.config import job_from_dict

    data = tmp_path / "mc.jsonl"
    with open(data, "w") as f:
        for i in range(7):
            f.write(json.dumps({"id": f"m{i}", "prompt": f"question {i}", "choices": ["a", "b", "c"][: 1 + i % 3]}) + "\n")
    job = job_from_dict({"model": tiny_dir, "task": "score", "score": {"mode": "multiple_choice"},
                         "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / "o.jsonl")},
                         "device": "cpu", "dtype": "float32"}, "t.yaml", base_dir=str(tmp_path))
    prep = plan.Prepared(job)
    groups = engine._score_batches(prep.treqs, job, prep, 4)
    sizes = [sum(len(t.score_inputs) for t in g) for g in groups]
    assert all(s <= 4 for s in sizes) and sum(len(g) for g in groups) == 7
    assert engine._score_batches(prep.treqs, job, prep, 1)[2] == [prep.treqs[2]]  # 3 choices > N: alone
    wl = plan.job_workload_from_prepared(prep)
    assert wl.scoring and wl.gen_len == 1 and wl.num_requests == sum(1 + i % 3 for i in range(7))


def test_refused_policy_writes_nothing(tmp_path, tiny_dir, no_weights):
    """A policy refused before the run leaves no results, meta or report file behind."""
    job = _write_job(tmp_path, tiny_dir, {"mu": 20000, "n": 2}, gpu_memory="2GiB")
    assert cli.main(["run", job, "--no-progress"]) == 2
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_serial_executor_still_refuses_a_malformed_policy(tmp_path, tiny_dir, no_weights, capsys):
    job = _write_job(tmp_path, tiny_dir, {"mu": 4, "nn": 2}, executor="serial")
    assert cli.main(["run", job, "--no-progress"]) == 2
    assert "policy: unknown key(s) nn" in capsys.readouterr().err


def test_vocab_larger_than_tokenizer_is_announced(tmp_path, tiny_dir, capsys):
    """A model whose vocab_size exceeds its tokenizer (a speed-work checkpoint with a borrowed tokenizer): one line
    says generated ids past the tokenizer have no text; a matching tokenizer says nothing."""
    from tests.support.hf_checkpoints import write_config

    from lightning_moe.app.plan import ModelFiles

    ModelFiles(tiny_dir)
    assert "exceeds its tokenizer" not in capsys.readouterr().err
    n = len(ModelFiles(tiny_dir).tokenizer)
    big = write_config(tiny_dir, tmp_path / "big", vocab_size=n + 1000)
    ModelFiles(big)
    err = capsys.readouterr().err
    assert f"the model's vocab_size {n + 1000:,} exceeds its tokenizer's {n:,} tokens: generated ids >= {n:,} " \
           f"have no text" in err, err


def test_auto_policy_without_a_cap_plans_for_the_card_it_runs_on(tmp_path, tiny_dir, monkeypatch):
    """A cuda job with no gpu_memory plans for the card's memory, not the hardware profile's (the default h200
    preset says 141 GB; an L4 has 24): on a small card the plan the preset allows would not fit, the card's plan
    does. A job's own cap still wins, and a card larger than the profile's plans for the profile's."""
    from lightning_moe.config import job_from_dict
    from lightning_moe.policy.hardware import get_preset

    with open(tmp_path / "p.jsonl", "w") as f:
        f.writelines(json.dumps({"id": str(i), "prompt": "hello world " * 30}) + "\n" for i in range(200))
    monkeypatch.setattr(plan, "device_name", lambda device: None)  # the h200 preset, on a GPU host too (no
    #   measurement of that host into the user's cache)

    def planned(card, **keys):
        monkeypatch.setattr(plan, "device_memory", lambda device: card)
        job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": str(tmp_path / "p.jsonl")},
                             "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
                             "executor": "cgopipe", "generation": {"max_new_tokens": 32}, **keys}, "t.yaml")
        return plan.plan_job(job, plan.Prepared(job))

    card = int(1.05 * GiB)  # the memory model's 1 GiB allocator reserve, and a little: the preset's plan does not fit
    assert planned(None).estimate.gpu_peak > card
    small = planned(card)
    assert small.gpu_budget == small.policy.gpu_budget == card and small.estimate.gpu_peak <= card
    assert planned(card, gpu_memory="2GiB").gpu_budget == 2 * GiB
    assert planned(10**15).gpu_budget == get_preset("h200").gpu_memory


@pytest.mark.parametrize("name, preset", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                          ("NVIDIA A100-SXM4-80GB", "a100-40g"), ("NVIDIA L4", "l4"),
                                          ("Tesla T4", "t4"), ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", None)])
def test_preset_for_device_name_matches_whole_words(name, preset):
    assert gpu.preset_for_device_name(name) == preset


def test_job_without_hardware_on_cuda_measures_this_host_once(tmp_path, tiny_dir, monkeypatch, capsys):
    """A cuda job that names no hardware, on a host with no measured profile, measures the host (profile_host over
    the preset of its card's family, with the card's memory), caches it and plans with it; the next job loads the
    cache without measuring; `moe-batch plan JOB.yaml` plans the same way; a job's hardware wins (nothing measured);
    a failed measurement plans with the family's preset and says so; with no CUDA here, the h200 preset."""
    import dataclasses

    import yaml

    from lightning_moe.config import job_from_dict, load_job
    from lightning_moe.policy.hardware import get_preset

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))
    card = int(22.5 * GiB)
    monkeypatch.setattr(plan, "device_memory", lambda device: card if device.startswith("cuda") else None)
    monkeypatch.setattr(plan, "device_name", lambda device: "NVIDIA L4" if device.startswith("cuda") else None)
    calls = []

    def fake_profile_host(gpu_preset, gpu_memory, **kw):
        calls.append((gpu_preset, gpu_memory))
        assert kw["host_probes"] == ()  # a job measures its host's generic host probe; its own key on demand
        return dataclasses.replace(get_preset(gpu_preset), name="measured", gpu_memory=gpu_memory, pcie_h2d=11e9)

    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", fake_profile_host)
    _FakeRateProbes(monkeypatch)  # plan_job adds the tiny model's expert FFN rates (tested below)
    keys = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
            "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
            "executor": "cgopipe", "generation": {"max_new_tokens": 8}}
    job = job_from_dict(keys, "t.yaml")
    named = job_from_dict({**keys, "hardware": "t4"}, "t.yaml")
    assert plan.job_hardware(named).name == "t4" and plan.hardware_note(named, plan.job_hardware(named)) is None
    assert calls == [] and plan.cached_gpu_profile(job) is None
    hw = plan.job_hardware(job)
    assert calls == [("l4", card)] and (hw.name, hw.gpu_memory, hw.pcie_h2d) == ("measured", card, 11e9)
    cached = plan.gpu_profile_path("NVIDIA L4")
    assert "measuring it now" in capsys.readouterr().err and plan.cached_gpu_profile(job) == cached
    assert plan.hardware_note(job, hw) == (f"note: the job names no hardware: planned with this host's measured "
                                           f"profile {cached} (moe-batch profile)")
    assert plan.job_hardware(job).pcie_h2d == 11e9 and len(calls) == 1  # the cache, not a second measurement
    assert plan.plan_job(job, plan.Prepared(job)).gpu_budget == card
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(keys))
    assert load_job(str(path)).hardware is None
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"planned with this host's measured profile {cached}" in out and "hardware  measured" in out
    assert len(calls) == 1
    monkeypatch.setattr(plan, "device_name", lambda device: "NVIDIA L40S" if device.startswith("cuda") else None)

    def failing(**kw):
        raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", failing)
    hw = plan.job_hardware(job)  # a card no preset names, whose measurement fails: the h200 preset, its memory
    assert (hw.name, hw.gpu_memory) == ("h200", card) and plan.cached_gpu_profile(job) is None
    assert "measuring this host failed (RuntimeError: CUDA error: out of memory)" in capsys.readouterr().err
    assert plan.hardware_note(job, hw).endswith("planned for the h200 preset (device: NVIDIA L40S; measuring this "
                                                "host failed)")
    monkeypatch.setattr(plan, "device_name", lambda device: None)  # no CUDA here: a plan for another machine
    hw = plan.job_hardware(job)
    assert hw.name == "h200" and "has no CUDA device: planned for the h200 preset" in plan.hardware_note(job, hw)


def test_a_job_on_cuda_1_measures_that_card(tmp_path, tiny_dir, monkeypatch):
    """The first job on cuda:1 measures the host in a child process (app.measure_child; here the child's main runs
    in this process in place of the subprocess) with cuda:1 the current device there (the probes run on the current
    one); this process's current device is never switched."""
    import contextlib
    import dataclasses
    import subprocess

    from lightning_moe.app import measure_child

    from lightning_moe.config import job_from_dict
    from lightning_moe.policy.hardware import get_preset

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan, "device_memory", lambda device: 80 * GiB)
    monkeypatch.setattr(plan, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    current, entered = ["cuda:0"], []

    @contextlib.contextmanager
    def cuda_device(d):
        entered.append(str(d))
        before, current[0] = current[0], str(d)
        yield
        current[0] = before

    def fake_profile_host(gpu_preset, gpu_memory, **kw):
        return dataclasses.replace(get_preset(gpu_preset), name="measured", gpu_name=current[0])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", cuda_device)
    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", fake_profile_host)
    children = []

    def child(cmd, **kw):  # the child process, run here: its entry point with the parent's request and result paths
        assert cmd[:2] == [sys.executable, "-c"] and entered == []
        children.append(cmd)
        return subprocess.CompletedProcess(cmd, measure_child.main(cmd[4:]), "", "")

    monkeypatch.setattr(measure_child.subprocess, "run", child)
    monkeypatch.setattr(measure_child, "_in_child", lambda device: True)  # (this module's fixture keeps it off)
    job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
                         "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda:1", "dtype": "bfloat16",
                         "executor": "cgopipe"}, "t.yaml")
    assert plan.measure_gpu_profile(job.device, "NVIDIA H100 80GB HBM3").gpu_name == "cuda:1"
    assert entered == ["cuda:1"] and current == ["cuda:0"] and len(children) == 1


def test_moe_batch_profile_caches_this_hosts_profile_for_jobs_without_hardware(tmp_path, tiny_dir, monkeypatch, capsys):
    """`moe-batch profile` on CUDA also writes the profile to this host's cache (app.plan.gpu_profile_path: the card
    and the CPU); a cuda job that names no hardware then plans with it and says so; another card does not take it,
    and a job's hardware still wins."""
    import argparse
    import dataclasses

    from lightning_moe import plan_cli
    from lightning_moe.config import job_from_dict
    from lightning_moe.policy.hardware import get_preset

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))
    card = [lambda device: "NVIDIA H100 80GB HBM3" if device.startswith("cuda") else None]
    monkeypatch.setattr(plan, "device_name", lambda device: card[0](device))
    monkeypatch.setattr(gpu, "device_name", lambda device: card[0](device))
    monkeypatch.setattr(plan, "device_memory", lambda device: 80 * GiB if device.startswith("cuda") else None)
    keys = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
            "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
            "executor": "cgopipe", "generation": {"max_new_tokens": 8}}
    job = job_from_dict(keys, "t.yaml")
    assert plan.cached_gpu_profile(job) is None
    measured = dataclasses.replace(get_preset("h100"), name="measured", pcie_h2d=12.5e9)
    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", lambda **kw: measured)
    args = argparse.Namespace(cpu=False, expert_shapes=None, name="measured", gpu_preset="h200", gpu_memory=None,
                              quick=True, output=str(tmp_path / "profile.yaml"))
    assert plan_cli.cmd_profile(args) == 0
    cached = plan.gpu_profile_path("NVIDIA H100 80GB HBM3")
    assert f"cached as {cached}" in capsys.readouterr().out and os.path.isfile(tmp_path / "profile.yaml")
    hw = plan.job_hardware(job)
    assert (hw.name, hw.pcie_h2d) == ("measured", 12.5e9) and plan.cached_gpu_profile(job) == cached
    assert plan.hardware_note(job, hw) == (f"note: the job names no hardware: planned with this host's measured "
                                           f"profile {cached} (moe-batch profile)")
    assert plan.job_hardware(job_from_dict({**keys, "hardware": "t4"}, "t.yaml")).name == "t4"
    card[0] = lambda device: "NVIDIA L4" if device.startswith("cuda") else None
    assert plan.cached_gpu_profile(job) is None  # another card: not this profile (a job would measure the L4)
    card[0] = lambda device: None  # no CUDA: moe-batch profile writes only --output (its GPU fields are a preset's)
    args.output = str(tmp_path / "cpu-only.yaml")
    assert plan_cli.cmd_profile(args) == 0 and "cached as" not in capsys.readouterr().out


class _FakeRateProbes:
    """Stands in for the expert-FFN rate probes of pipeline.profiler (no GPU here): records each call's (weights,
    shapes, tokens, dtype, device) and returns one entry per bucket (dense: Triton 50, grouped_mm 80 TFLOP/s; MXFP4:
    Triton 30); ``fail``: an exception to raise instead."""

    def __init__(self, monkeypatch):
        self.calls, self.fail = [], None
        monkeypatch.setattr("lightning_moe.pipeline.profiler.measure_expert_ffn_rates", self.dense)
        monkeypatch.setattr("lightning_moe.pipeline.profiler.measure_mxfp4_ffn_rates", self.mxfp4)

    def _rates(self, weights, shapes, tokens, dtype, device, **rates):
        from lightning_moe.policy.hardware import ExpertFFNRate

        self.calls.append((weights, list(shapes), tuple(tokens), dtype, device))
        if self.fail is not None:
            raise self.fail
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        return tuple(ExpertFFNRate(*shape, name, T, weights=weights, **rates) for shape in shapes for T in tokens)

    def dense(self, shapes, tokens, dtype=None, device="cuda", repeats=5, seed=0, log=None):
        return self._rates("dense", shapes, tokens, dtype, device, triton=50e12, grouped_mm=80e12)

    def mxfp4(self, shapes, tokens, device="cuda", repeats=5, seed=0, log=None, dtype=torch.bfloat16):
        return self._rates("mxfp4", shapes, tokens, dtype, device, triton=30e12)


def _cuda_host_with_cached_profile(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3"):
    """A fake CUDA host (every cuda device is the card ``name``, 80 GiB) whose cache holds a measured profile with
    expert FFN rates of Mixtral-8x7B's shape only (what `moe-batch profile` measures by default); its path."""
    import dataclasses

    from lightning_moe.pipeline.profiler import EXPERT_FFN_TOKENS
    from lightning_moe.policy.hardware import ExpertFFNRate, get_preset

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan, "device_name", lambda device: name if device.startswith("cuda") else None)
    monkeypatch.setattr(plan, "device_memory", lambda device: 80 * GiB if device.startswith("cuda") else None)
    mixtral = tuple(ExpertFFNRate(4096, 14336, 8, 2, "bf16", T, triton=100e12) for T in EXPERT_FFN_TOKENS)
    prof = dataclasses.replace(get_preset("h100"), name="measured", expert_ffn_rates=mixtral)
    return plan.save_gpu_profile(prof, name, "a test's measured profile")


def _cgopipe_job(tmp_path, model, **keys):
    from lightning_moe.config import job_from_dict

    return job_from_dict({"model": model, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
                          "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
                          "executor": "cgopipe", "generation": {"max_new_tokens": 8}, **keys}, "t.yaml")


def test_a_job_whose_expert_shape_the_hosts_profile_lacks_measures_it_once(tmp_path, tiny_dir, monkeypatch, capsys):
    """A CUDA job that names no hardware, planned with this host's cached profile that has no expert FFN rates of its
    model's shape (D, F, E, k) at its dtype, measures exactly that shape once on the job's device (the dense probe,
    `moe-batch profile`'s token buckets), adds the entries to the cache (the earlier ones kept) and plans with them (the
    HRM reads them); a second job measures nothing; another dtype is another measurement; a job naming hardware and a
    job on the CPU measure nothing."""
    from lightning_moe.pipeline.profiler import EXPERT_FFN_TOKENS
    from lightning_moe.policy import hrm
    from lightning_moe.policy.hardware import HardwareProfile

    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    probes = _FakeRateProbes(monkeypatch)
    job = _cgopipe_job(tmp_path, tiny_dir, device="cuda:1")
    prep = plan.Prepared(job)
    s = prep.spec
    shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
    before = HardwareProfile.load(path)
    assert not before.has_expert_ffn_rates(*shape, "bf16")
    capsys.readouterr()
    jplan = plan.plan_job(job, prep)
    assert probes.calls == [("dense", [shape], EXPERT_FFN_TOKENS, torch.bfloat16, "cuda:1")]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"this host's profile {path} has no expert FFN rates of {s.name}'s expert shape (D " \
        f"{shape[0]}, F {shape[1]}, {shape[2]} experts, top-{shape[3]}) in bf16: measuring them now on cuda:1" in err, err
    cached = HardwareProfile.load(path)
    assert cached.expert_ffn_rates == jplan.hardware.expert_ffn_rates and len(cached.expert_ffn_rates) == 16
    assert cached.has_expert_ffn_rates(4096, 14336, 8, 2, "bf16") and cached.name == "measured"
    assert cached.expert_ffn_rate(*shape, "bf16", 1024) == 80e12  # grouped_mm's: the faster the fakes measured
    # the HRM prices the experts at the measured rate (below the GEMM peak it used without it)
    assert hrm.gpu_experts_time(s, jplan.hardware, 1024, "bf16") > hrm.gpu_experts_time(s, before, 1024, "bf16")
    again = plan.plan_job(job, plan.Prepared(job))
    assert len(probes.calls) == 1 and "measuring" not in capsys.readouterr().err
    assert again.hardware.expert_ffn_rates == cached.expert_ffn_rates
    fp32 = _cgopipe_job(tmp_path, tiny_dir, dtype="float32")
    plan.plan_job(fp32, plan.Prepared(fp32))  # the job's compute dtype: its own entries
    assert probes.calls[1] == ("dense", [shape], EXPERT_FFN_TOKENS, torch.float32, "cuda")
    assert HardwareProfile.load(path).has_expert_ffn_rates(*shape, "fp32") and "in fp32: measuring" in capsys.readouterr().err
    for other in (_cgopipe_job(tmp_path, tiny_dir, dtype="float16", hardware="h100"),
                  _cgopipe_job(tmp_path, tiny_dir, dtype="float16", device="cpu")):
        assert plan.plan_job(other, plan.Prepared(other)).hardware.name in ("h100", "h200")
    assert len(probes.calls) == 2 and "measuring" not in capsys.readouterr().err


def test_moe_batch_plan_of_a_job_measures_its_models_expert_rates_as_run_does(tmp_path, tiny_dir, monkeypatch, capsys):
    """`moe-batch plan JOB.yaml` (no --hardware) on a CUDA host whose cached profile lacks the model's expert FFN
    rates measures them as `moe-batch run`'s plan_job does (once, into the cache), so the plan shown is the plan run
    makes; with --hardware nothing is measured."""
    import yaml

    from lightning_moe.policy.hardware import HardwareProfile

    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    probes = _FakeRateProbes(monkeypatch)
    keys = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
            "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
            "executor": "cgopipe", "generation": {"max_new_tokens": 8}}
    job = tmp_path / "j.yaml"
    job.write_text(yaml.safe_dump(keys))
    assert cli.main(["plan", str(job), "--hardware", "h100"]) == 0 and probes.calls == []
    assert cli.main(["plan", str(job)]) == 0
    assert len(probes.calls) == 1 and "measuring them now on cuda" in capsys.readouterr().err
    assert len(HardwareProfile.load(path).expert_ffn_rates) == 16
    assert cli.main(["plan", str(job)]) == 0 and len(probes.calls) == 1  # the cache has them now


def test_a_failing_expert_rate_probe_leaves_the_cache_and_the_job_plans(tmp_path, tiny_dir, monkeypatch, capsys):
    """Where measuring the model's expert FFN rates fails (out of memory on a small card), the cache is left byte for
    byte, one line says so, and the job plans with the profile as it was (and tries again next job); where this host's
    own measurement failed (a preset), nothing is measured."""
    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    with open(path, "rb") as f:
        before = f.read()
    probes = _FakeRateProbes(monkeypatch)
    probes.fail = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    job = _cgopipe_job(tmp_path, tiny_dir)
    capsys.readouterr()
    jplan = plan.plan_job(job, plan.Prepared(job))
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "measuring them failed (OutOfMemoryError: CUDA out of memory. Tried to allocate " \
        f"2.00 GiB); planning with {path} as it was" in err, err
    with open(path, "rb") as f:
        assert f.read() == before
    assert jplan.hardware.name == "measured" and len(jplan.hardware.expert_ffn_rates) == 8 and jplan.estimate
    os.remove(path)  # no cache, and this host's measurement fails: the family's preset, no rate probe

    def failing(**kw):
        raise RuntimeError("no measurement in this test")

    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", failing)
    assert plan.plan_job(job, plan.Prepared(job)).hardware.name == "h100" and len(probes.calls) == 1


def test_expert_rates_by_model_kind_mxfp4_pages_mla_and_dense_layers(tmp_path, tiny_dir, monkeypatch, capsys):
    """Which entries a job measures: gpt-oss's MXFP4 checkpoint, the MXFP4 kernel's (`weights: mxfp4`, its pages
    are kept packed; no dense entries); its dense-bf16 checkpoint, none (expert biases: the torch loop runs, no
    grouped kernel to rate); DeepSeek (MLA, a dense first layer), its routed experts' shape (a config whose layers are
    all dense is refused when read: every model planned has an MoE layer)."""
    from tests.support import make_checkpoint as mk

    from lightning_moe.pipeline.profiler import EXPERT_FFN_TOKENS
    from lightning_moe.policy import hrm
    from lightning_moe.policy.hardware import HardwareProfile

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", os.path.dirname(tiny_dir))  # the tokenizer the checkpoints copy
    quiet = open(os.devnull, "w")
    oss = mk.Dims.from_registry("gpt-oss-20b", 2).tiny()
    mx = mk.write_checkpoint(str(tmp_path / "mx"), mk.dataclasses.replace(oss, mxfp4=True), log=quiet)["path"]
    bf = mk.write_checkpoint(str(tmp_path / "bf"), oss, log=quiet)["path"]
    ds = mk.write_checkpoint(str(tmp_path / "ds"), mk.Dims.from_registry("deepseek-v2-lite", 2).tiny(), log=quiet)["path"]
    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    before = HardwareProfile.load(path)
    probes = _FakeRateProbes(monkeypatch)
    got = {}
    for name, model in (("mx", mx), ("bf", bf), ("ds", ds)):
        job = _cgopipe_job(tmp_path, model)
        prep = plan.Prepared(job)
        got[name] = (prep.spec, plan.plan_job(job, prep).hardware)
    sx, sd = got["mx"][0], got["ds"][0]
    mx_shape = (sx.hidden_size, sx.intermediate_size, sx.num_experts, sx.top_k)
    ds_shape = (sd.hidden_size, sd.intermediate_size, sd.num_experts, sd.top_k)
    assert sd.num_moe_layers == 1 and sd.dense_layers == (0,) and sd.kv_lora_rank > 0
    assert probes.calls == [("mxfp4", [mx_shape], EXPERT_FFN_TOKENS, torch.bfloat16, "cuda"),
                            ("dense", [ds_shape], EXPERT_FFN_TOKENS, torch.bfloat16, "cuda")]
    assert "over MXFP4 pages: measuring them now" in capsys.readouterr().err
    cached = HardwareProfile.load(path)
    assert cached.has_expert_ffn_rates(*mx_shape, "bf16", "mxfp4") and not cached.has_expert_ffn_rates(*mx_shape, "bf16")
    assert cached.has_expert_ffn_rates(*ds_shape, "bf16") and len(cached.expert_ffn_rates) == 24
    hw = got["mx"][1]  # the HRM prices the MXFP4 pages at the MXFP4 kernel's measured rate
    assert hw.expert_ffn_rate(*mx_shape, "bf16", 64, ("triton",), "mxfp4") == 30e12
    assert hrm.gpu_experts_time(sx, hw, 1024, "bf16", "mxfp4") > hrm.gpu_experts_time(sx, before, 1024, "bf16", "mxfp4")


def test_report_names_the_hardware_and_notes_what_the_prediction_stands_on(tmp_path, tiny_dir, monkeypatch):
    """The run report's predicted block (a cuda run): the profile the job planned with, the note naming the preset a
    job without hardware got, then the estimate's own notes (a preset has no host stage); a measured profile the
    job names gets neither note, only, where its decode attends on the CPU, the one saying it lacks (H5')'s point of
    CPU attention beside pinned copies (the shipped h200-host profile was measured before that point existed)."""
    from lightning_moe.config import job_from_dict

    monkeypatch.setattr(plan, "device_memory", lambda device: 22 * GiB)
    monkeypatch.setattr(plan, "device_name", lambda device: "NVIDIA L4")
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))

    def failing(**kw):  # this host's measurement fails: the job plans with its card's preset
        raise RuntimeError("no measurement in this test")

    monkeypatch.setattr("lightning_moe.pipeline.profiler.profile_host", failing)
    keys = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
            "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
            "executor": "cgopipe", "generation": {"max_new_tokens": 8}}
    job = job_from_dict(keys, "t.yaml")
    block = engine.predicted_report(job, plan.plan_job(job, plan.Prepared(job)))
    assert block["hardware"] == "l4" and block["decode_tokens_per_s"] > 0
    assert [n.split(":")[1].split(" (")[0] for n in block["notes"]] == [
        " the job names no hardware", " hardware l4 has no host issue times"], block["notes"]
    assert block["host_probe"] is None  # no host stage: no probe
    profile = os.path.join(os.path.dirname(plan.__file__), "..", "policy", "profiles", "h200-host.yaml")
    measured = job_from_dict({**keys, "hardware": profile, "gpu_memory": "12GiB"}, "t.yaml")
    jplan = plan.plan_job(measured, plan.Prepared(measured))
    block = engine.predicted_report(measured, jplan)
    assert block["hardware"] == measured.hardware
    cpu_attention = jplan.policy.n_cpu_attn > 0
    assert [n.split(" (")[0] for n in block["notes"]] == (
        ["note: hardware measured has no measured point of CPU attention beside pinned H2D copies"] if cpu_attention
        else []), block["notes"]
    assert block["host_probe"] == "generic"  # tiny-mixtral: the generic (Mixtral-shaped) probe priced its host term


def test_hardware_profile_is_resolved_once_per_job(tmp_path, tiny_dir, monkeypatch):
    """plan_job resolves the job's hardware profile once and JobPlan carries it: a cgopipe run (plan, executor,
    report) asks app.plan.job_hardware once, and the executor runs with the profile the job planned with."""
    from lightning_moe.config import job_from_dict

    calls = []
    real = plan.job_hardware
    monkeypatch.setattr(plan, "job_hardware", lambda job: calls.append(job.name) or real(job))
    keys = {"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl", n=5)},
            "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cpu", "dtype": "float32",
            "executor": "cgopipe", "hardware": "t4", "generation": {"max_new_tokens": 3}}
    job = job_from_dict(keys, "t.yaml")
    jplan = plan.plan_job(job, plan.Prepared(job))
    assert len(calls) == 1 and jplan.hardware == real(job) and jplan.hardware.name == "t4"
    calls.clear()
    from lightning_moe.pipeline import cgopipe

    given = []
    real_cls = cgopipe.CGOPipeExecutor
    monkeypatch.setattr(cgopipe, "CGOPipeExecutor", lambda *a, **k: given.append(k["hardware"]) or real_cls(*a, **k))
    report = engine.run_job(job, progress=False)
    assert report["status"] == "done" and report["records_written_this_run"] == 5
    assert len(calls) == 1, calls
    assert [hw.name for hw in given] == ["t4"]


def test_report_carries_and_prints_the_hrm_terms(tmp_path, tiny_dir):
    """A cuda run's predicted block carries the HRM's terms of the plan's estimate (stage -> seconds per phase, the
    same numbers ``moe-batch plan`` prints) and the run summary prints them beside the measured-vs-predicted table."""
    from lightning_moe.app.report import format_report
    from lightning_moe.config import job_from_dict

    profile = os.path.join(os.path.dirname(plan.__file__), "..", "policy", "profiles", "h200-host.yaml")
    job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": _prompts(tmp_path / "p.jsonl")},
                         "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cuda", "dtype": "bfloat16",
                         "executor": "cgopipe", "generation": {"max_new_tokens": 8}, "hardware": profile,
                         "gpu_memory": "12GiB"}, "t.yaml")
    jplan = plan.plan_job(job, plan.Prepared(job))
    block = engine.predicted_report(job, jplan)
    est = jplan.estimate
    assert block["stages_seconds"] == {"prefill": dict(est.prefill_stages), "decode": dict(est.decode_stages)}
    assert set(block["stages_seconds"]["decode"]) >= {"h2d", "cpu", "gpu", "host", "head"}
    assert all(v >= 0 for v in est.decode_stages.values()) and est.decode_stages["h2d"] > 0
    rep = {"job": "t", "status": "done", "task": "generate", "model": tiny_dir, "device": "cuda", "dtype": "bfloat16",
           "executor": "cgopipe", "requests_in_shard": 3, "skipped_already_done": 0, "records_written_this_run": 3,
           "errors_recorded": 0, "predicted": block, "peak_host_memory_bytes": 2**30, "results": "o.jsonl"}
    text = format_report(rep)
    dec = ", ".join(f"{k} {v:,.3f}" for k, v in est.decode_stages.items())
    assert f"HRM terms, decode (predicted s, one batch of N, summed over layers and steps): {dec}" in text
    assert block["stages_span"] == "one batch of N"
    assert f"{dec}; time = each layer its longest overlapped stage, head added" in text
    assert "HRM terms, prefill" in text


def test_a_job_whose_host_probe_the_hosts_profile_lacks_measures_it_once(tmp_path, tiny_dir, monkeypatch, capsys):
    """A CUDA job that names no hardware, planned with this host's cached profile (a host stage, no host_issue_by_family
    entry of its family and expert format), runs that host probe once on the job's device, adds it to the cache and
    plans with it (the report's host probe names it); a second job probes nothing; a Mixtral bf16 job (the generic
    probe's own model), a job naming hardware and a profile with no host stage probe nothing; a failing probe leaves
    the cache byte for byte and the job plans with the fallback."""
    import dataclasses

    from tests.support import make_checkpoint as mk

    from lightning_moe.policy import hrm
    from lightning_moe.policy.hardware import HardwareProfile

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", os.path.dirname(tiny_dir))  # the tokenizer the checkpoints copy
    quiet = open(os.devnull, "w")
    ds = mk.write_checkpoint(str(tmp_path / "ds"), mk.Dims.from_registry("deepseek-v2-lite", 2).tiny(), log=quiet)["path"]
    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    dataclasses.replace(HardwareProfile.load(path), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006).save(path)
    _FakeRateProbes(monkeypatch)
    calls, fail = [], []

    def probe(device="cuda", probe="generic", **kw):
        calls.append((device, probe))
        if fail:
            raise fail[0]
        return (0.009, 0.011)

    monkeypatch.setattr("lightning_moe.pipeline.profiler.measure_host_issue", probe)
    job = _cgopipe_job(tmp_path, ds, device="cuda:1")
    prep = plan.Prepared(job)
    capsys.readouterr()
    jplan = plan.plan_job(job, prep)
    assert calls == [("cuda:1", "deepseek_v2")]
    assert f"this host's profile {path} has no host issue probe 'deepseek_v2': measuring it now on cuda:1" in \
        capsys.readouterr().err
    cached = HardwareProfile.load(path)
    assert dict(cached.host_issue_by_family) == {"deepseek_v2": (0.009, 0.011)} and cached.host_issue_cpu_attn == 0.004
    assert hrm.host_probe(jplan.hardware, prep.spec, "bf16") == "deepseek_v2"
    assert hrm.host_issue_times(jplan.hardware, prep.spec, "bf16") == (0.009, 0.011)
    plan.plan_job(job, plan.Prepared(job))
    mixtral = _cgopipe_job(tmp_path, tiny_dir)
    plan.plan_job(mixtral, plan.Prepared(mixtral))
    named = _cgopipe_job(tmp_path, ds, hardware=path)
    plan.plan_job(named, plan.Prepared(named))
    assert calls == [("cuda:1", "deepseek_v2")] and "host issue probe" not in capsys.readouterr().err
    dataclasses.replace(cached, host_issue_by_family={}).save(path)  # the probe fails: the cache is left, the fallback prices it
    with open(path, "rb") as f:
        before = f.read()
    fail.append(RuntimeError("broke\nmore"))
    jplan = plan.plan_job(job, plan.Prepared(job))
    assert "the host issue probe 'deepseek_v2' failed (RuntimeError: broke); planning with" in capsys.readouterr().err
    with open(path, "rb") as f:
        assert f.read() == before
    assert hrm.host_probe(jplan.hardware, prep.spec, "bf16") == "generic" and len(calls) == 2
    dataclasses.replace(HardwareProfile.load(path), host_issue_cpu_attn=0.0, host_issue_gpu_attn=0.0).save(path)
    plan.plan_job(job, plan.Prepared(job))  # no host stage in the profile: nothing to price, nothing probed
    assert len(calls) == 2


def test_a_read_only_cache_still_plans_with_what_the_job_measured(tmp_path, tiny_dir, monkeypatch, capsys):
    """Where this host's cached profile cannot be written back (a read-only cache), a job that measured its expert FFN
    rates or its host probe says so in one line each and plans with what it measured; the file is left as it was."""
    import dataclasses

    from tests.support import make_checkpoint as mk

    from lightning_moe.policy.hardware import HardwareProfile

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", os.path.dirname(tiny_dir))
    ds = mk.write_checkpoint(str(tmp_path / "ds"), mk.Dims.from_registry("deepseek-v2-lite", 2).tiny(),
                             log=open(os.devnull, "w"))["path"]
    path = _cuda_host_with_cached_profile(monkeypatch, tmp_path)
    dataclasses.replace(HardwareProfile.load(path), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006).save(path)
    with open(path, "rb") as f:
        before = f.read()
    _FakeRateProbes(monkeypatch)
    monkeypatch.setattr("lightning_moe.pipeline.profiler.measure_host_issue", lambda device, probe: (0.009, 0.011))

    def read_only(*a, **kw):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(plan, "save_gpu_profile", read_only)
    job = _cgopipe_job(tmp_path, ds)
    capsys.readouterr()
    hw = plan.plan_job(job, plan.Prepared(job)).hardware
    err = capsys.readouterr().err
    assert "not updated ([Errno 13] Permission denied" in err and "this job plans with the rates just measured" in err
    assert "this job plans with the probe just measured" in err
    assert dict(hw.host_issue_by_family) == {"deepseek_v2": (0.009, 0.011)} and len(hw.expert_ffn_rates) > 8
    with open(path, "rb") as f:
        assert f.read() == before
