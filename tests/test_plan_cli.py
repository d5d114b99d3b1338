"""``moe-batch plan`` / ``moe-batch profile`` through plan_cli.add_subcommands (our own parser)."""

import argparse
import sys
import types

import pytest
import torch

from lightning_moe import plan_cli as commands
from lightning_moe.policy.hardware import GiB, HardwareProfile
from lightning_moe.policy.policy import Policy, Workload


def run(argv):
    parser = argparse.ArgumentParser(prog="moe-batch")
    commands.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


L4_ARGS = ["plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--gpu-memory", "24GiB", "--cpu-memory", "192GiB",
           "--prompt-len", "77", "--gen-len", "32"]


def test_plan_mixtral_l4_prints_table_and_writes_policy(tmp_path, capsys):
    out_path = tmp_path / "policy.yaml"
    assert run(L4_ARGS + ["--output", str(out_path)]) == 0
    out = capsys.readouterr().out
    for needle in ("mu (sequences / micro-batch)", "attention split", "resident experts", "GPU ", "/ budget 24.0 GiB",
                   "/ budget 192.0 GiB", "bytes per MoE layer", "h2d", "d2h", "cpu", "gpu", "* = binds", "predicted:",
                   "end-to-end", "tok/s", "binding: prefill", "proven optimal", "solved in"):
        assert needle in out, needle
    pol = Policy.load(str(out_path))
    assert f"  N  (sequences in flight)         {pol.N}" in out
    assert pol.gpu_budget == 24 * GiB and pol.cpu_budget == 192 * GiB
    assert out_path.read_text().startswith("# moe-batch plan: mixtral-8x7b on l4")


def test_plan_int4_shows_bytes_before_and_after(capsys):
    """Quantized pages: the table gives an expert's and a layer's bytes packed and in the model dtype (by hand:
    Mixtral-8x7B expert 3 x 14336 x 4096 bf16 = 336 MiB; 8 per layer = 2.6 GiB); dense pages print no 'before'."""
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("mixtral-8x7b")
    assert spec.expert_bytes("bf16") == 3 * 14336 * 4096 * 2
    assert run(L4_ARGS + ["--quant", "int4"]) == 0
    out = capsys.readouterr().out
    assert "int4, 89.2 MiB per expert (336.0 MiB in bf16)" in out
    assert "experts 714.0 MiB (2.6 GiB in bf16)" in out
    assert run(L4_ARGS) == 0
    out = capsys.readouterr().out
    assert "bf16, 336.0 MiB per expert\n" in out and "in bf16)" not in out


def test_plan_infeasible_gpu_one_line(capsys):
    args = list(L4_ARGS)
    args[args.index("24GiB")] = "6GiB"
    assert run(args) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "\n" not in err and "Traceback" not in cap.err and cap.out == ""
    assert err.startswith("moe-batch plan: infeasible: GPU memory 6.00 GiB < ") and "non-expert weights" in err


def test_plan_infeasible_host_one_line(capsys):
    args = list(L4_ARGS)
    args[args.index("192GiB")] = "40GiB"
    assert run(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("moe-batch plan: infeasible: host memory 40.00 GiB < ")


def test_plan_usage_errors(capsys):
    assert run(["plan", "--model", "mixtral-8x7b", "--hardware", "l4"]) == 2
    assert "--prompt-len and --gen-len" in capsys.readouterr().err
    assert run(["plan", "--model", "nope", "--hardware", "l4", "--prompt-len", "8", "--gen-len", "2"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert run(["plan", "--model", "mixtral-8x7b", "--hardware", "v100", "--prompt-len", "8", "--gen-len", "2"]) == 2
    assert "unknown hardware preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(L4_ARGS[:-2] + ["--gpu-memory", "lots", "--gen-len", "2"])


def test_plan_refuses_more_gpu_memory_than_the_card(capsys):
    """A budget over the hardware's GPU memory (t4: 15 GiB) is an error naming both, not a plan that cannot run."""
    args = ["plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--gpu-memory", "16GiB", "--prompt-len", "77",
            "--gen-len", "8"]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "gpu_memory 16.0 GiB exceeds the 15.0 GiB of GPU memory of hardware 't4'" in err and "Traceback" not in err
    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.policy import check_gpu_budget

    with pytest.raises(ValueError, match="exceeds"):  # the check policy: auto jobs run too (cgopipe.policy_for_job)
        check_gpu_budget(16 << 30, get_preset("t4"))
    check_gpu_budget(15 << 30, get_preset("t4"))  # the whole card is allowed


def test_plan_refuses_more_cpu_memory_than_the_host(capsys):
    """A host budget over the hardware's DRAM (l4 preset: 192 GiB) is an error naming both; the whole DRAM is allowed."""
    args = L4_ARGS[:L4_ARGS.index("--cpu-memory") + 1] + ["193GiB"] + L4_ARGS[L4_ARGS.index("--cpu-memory") + 2:]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "cpu_memory 193.0 GiB exceeds the 192.0 GiB of host memory of hardware 'l4'" in err and "Traceback" not in err
    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.policy import check_cpu_budget

    with pytest.raises(ValueError, match="exceeds"):
        check_cpu_budget(129 << 30, get_preset("h200"))
    check_cpu_budget(128 << 30, get_preset("h200"))


def test_plan_job_without_app_plan_errors_clearly(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "lightning_moe.app.plan", None)  # import fails
    assert run(["plan", str(tmp_path / "job.yaml"), "--hardware", "l4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "job_workload" in err and "not available" in err


def test_plan_job_uses_job_workload_and_job_fields(monkeypatch, capsys, tmp_path):
    seen = {}

    def job_workload(path):
        seen["path"] = path
        return Workload.from_lengths([50, 60, 70, 80] * 20, gen_len=16, name="fake-job")

    job = types.SimpleNamespace(model="olmoe-1b-7b", hardware="t4", gpu_memory=8 * GiB, cpu_memory=32 * GiB, dtype="bfloat16")
    monkeypatch.setitem(sys.modules, "lightning_moe.app.plan", types.SimpleNamespace(
        job_workload=job_workload, job_hardware=None, hardware_note=None,
        job_gpu_budget=lambda job, hw: job.gpu_memory))
    monkeypatch.setitem(sys.modules, "lightning_moe.config", types.SimpleNamespace(load_job=lambda p: job))
    assert run(["plan", "job.yaml", "--output", str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out
    assert seen["path"] == "job.yaml"
    assert "olmoe-1b-7b" in out and "hardware  t4" in out and "prompt 65.0 tokens mean (max 80), generate 16" in out
    pol = Policy.load(str(tmp_path / "p.yaml"))
    assert pol.N <= 80 and pol.gpu_budget == 8 * GiB and pol.cpu_budget == 32 * GiB


def test_profile_command_cpu_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "host.yaml"
    assert run(["profile", "--quick", "--output", str(path), "--gpu-preset", "t4", "--gpu-memory", "12GiB"]) == 0
    out = capsys.readouterr().out
    assert "GPU side skipped" in out and "CPU decode attention" in out
    prof = HardwareProfile.load(str(path))
    assert prof.gpu_memory == 12 * GiB and prof.gpu_hbm_bandwidth == 300 * GiB and prof.date
    text = path.read_text()
    assert text.startswith("# moe-batch profile, ") and "# host: " in text
    # the measured profile plans
    assert run(["plan", "--model", "olmoe-1b-7b", "--hardware", str(path), "--prompt-len", "64", "--gen-len", "8"]) == 0


def test_plan_job_takes_set_overrides(capsys, tiny_dir, tmp_path):
    """`moe-batch plan JOB.yaml --set key=value` plans the overridden job (here a smaller GPU budget); a note says when
    the job names no hardware (no CUDA here: the h200 preset) and when its executor takes no policy (serial); --set without a job
    is an error."""
    import yaml

    data = tmp_path / "in.jsonl"
    data.write_text("".join(f'{{"id": {i}, "prompt": "hello number {i}"}}\n' for i in range(8)))
    job = tmp_path / "j.yaml"
    job.write_text(yaml.safe_dump({"model": tiny_dir, "data": {"source": "jsonl", "path": str(data)}, "device": "cuda",
                                   "dtype": "float32", "executor": "cgopipe", "output": {"path": str(tmp_path / "o.jsonl")}}))
    assert run(["plan", str(job), "--set", "gpu_memory=2GiB"]) == 0
    out = capsys.readouterr().out
    assert "/ budget 2.0 GiB" in out and "names no hardware and this machine has no CUDA device: planned for the h200 preset" in out
    assert "takes no policy" not in out  # a cgopipe job runs the plan
    assert run(["plan", str(job), "--set", "executor=serial", "--set", "hardware=l4"]) == 0
    out = capsys.readouterr().out
    assert "note: the job runs executor: serial (device cuda), which takes no policy" in out and "names no hardware" not in out
    assert run(["plan", str(job), "--set", "device=cpu"]) == 0  # on the CPU: the CPU executor's roofline (cpu_hrm)
    out = capsys.readouterr().out
    assert "CPU profile cpu-test" in out and "executor  cgopipe on the CPU" in out and "binding: prefill cpu-" in out
    assert run(["plan", "--model", "mixtral-8x7b", "--set", "gpu_memory=2GiB", "--prompt-len", "8", "--gen-len", "2"]) == 2
    assert "--set overrides a job's keys" in capsys.readouterr().err


def test_plan_cpu_job_writes_its_policy(capsys, tiny_dir, tmp_path):
    """`moe-batch plan JOB.yaml -o policy.yaml` on a device: cpu cgopipe job writes the policy the CPU planner printed
    (it printed the table and wrote nothing before); a serial CPU job has no policy: -o is a one-line error."""
    import yaml

    data = tmp_path / "in.jsonl"
    data.write_text("".join(f'{{"id": {i}, "prompt": "hello number {i}"}}\n' for i in range(8)))
    job = tmp_path / "j.yaml"
    job.write_text(yaml.safe_dump({"model": tiny_dir, "data": {"source": "jsonl", "path": str(data)}, "device": "cpu",
                                   "dtype": "float32", "executor": "cgopipe", "output": {"path": str(tmp_path / "o.jsonl")}}))
    out_path = tmp_path / "policy.yaml"
    assert run(["plan", str(job), "-o", str(out_path)]) == 0
    out = capsys.readouterr().out
    pol = Policy.load(str(out_path))
    assert f"policy written to {out_path}" in out and f"mu {pol.mu} x n {pol.n} (N {pol.N})" in out
    assert run(["plan", str(job), "--set", "executor=serial", "-o", str(tmp_path / "p2.yaml")]) == 2
    assert "--output: the serial executor takes no policy" in capsys.readouterr().err
    assert not (tmp_path / "p2.yaml").exists()


@pytest.mark.parametrize("extra,want", [
    (["--quant", "int4"], "--quant int4: the gpt_oss family's experts (clamped_swiglu, their own checkpoint layout) "
                          "are not implemented by quantize's packed pages"),
    (["--gpus", "2"], "--gpus 2: expert parallelism: gpt_oss: expert activation 'clamped_swiglu' (silu only)"),
])
def test_plan_refuses_what_run_cannot_execute_for_gpt_oss(extra, want, capsys):
    """A registry gpt-oss with quantize's int4 pages or expert parallelism: refused in one line, as `quantize` and
    the expert-parallel executor refuse them (no plan for a setup `run` cannot execute); mixtral plans both."""
    args = ["plan", "--model", "gpt-oss-20b", "--hardware", "h200", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB",
            "--prompt-len", "64", "--gen-len", "16", "--time-limit", "5"]
    assert run(args + extra) == 2
    assert f"moe-batch plan: error: {want}" in capsys.readouterr().err
    assert run(L4_ARGS + extra + ["--time-limit", "5"]) == 0


def test_reader_leaving_stdout_early_is_not_an_error():
    """`moe-batch plan ... | head -1`: the reader closes the pipe before the table is written; the command exits 0
    with nothing on stderr (was exit 1 with Python's broken-pipe noise)."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "lightning_moe.cli", "plan", "--model", "mixtral-8x7b", "--hardware", "l4",
           "--gpu-memory", "24GiB", "--cpu-memory", "192GiB", "--prompt-len", "77", "--gen-len", "32"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root, env=env)
    p.stdout.close()  # the reader is gone before the command writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err


def test_plan_twice_is_answered_by_the_solve_cache(tmp_path, monkeypatch, capsys):
    """``moe-batch plan`` keeps its solves in $LIGHTNING_MOE_SOLVE_CACHE (conftest turns it off): a second plan of
    the same inputs runs no HiGHS solve, says so in the MILP note, and prints and writes the same policy, table and
    predicted numbers (the lines but the times)."""
    import re

    from lightning_moe.policy import milp

    monkeypatch.setenv("LIGHTNING_MOE_SOLVE_CACHE", str(tmp_path / "solves"))
    runs, run_highs = [], milp._run_highs
    monkeypatch.setattr(milp, "_run_highs", lambda *a, **k: runs.append(1) or run_highs(*a, **k))

    def plan(i: int):
        assert run(L4_ARGS + ["--output", str(tmp_path / f"p{i}.yaml")]) == 0
        out = capsys.readouterr().out
        return out, re.sub(r"(solved in|,) [0-9.]+ s( \(build [0-9.]+ s\))?", "", out.replace(" (again)", ""))

    first, first_fixed = plan(1)
    n = len(runs)
    assert n > 0 and len(list((tmp_path / "solves").glob("*" + milp.SOLVE_CACHE_SUFFIX))) > 0
    again, again_fixed = plan(2)
    assert len(runs) == n and f"({n} from the solve cache)" not in first and "from the solve cache" in again
    assert re.sub(r" \(\d+ from the solve cache\)", "", again_fixed).replace("p2.yaml", "p1.yaml") == first_fixed
    assert (tmp_path / "p1.yaml").read_text() == (tmp_path / "p2.yaml").read_text()


def test_policy_for_job_plans_with_the_solve_cache(tmp_path, monkeypatch, tiny_dir):
    """``policy: auto`` (moe-batch run) plans with default_solve_cache(): $LIGHTNING_MOE_SOLVE_CACHE."""
    from types import SimpleNamespace

    from lightning_moe.app import plan as app_plan
    from lightning_moe.policy import milp
    from lightning_moe.policy.registry import resolve_spec

    monkeypatch.setenv("LIGHTNING_MOE_SOLVE_CACHE", str(tmp_path / "solves"))
    seen = []
    monkeypatch.setattr(milp, "plan", lambda *a, **k: seen.append(k.get("solve_cache")) or (None, None))
    monkeypatch.setattr(app_plan, "job_workload_from_prepared", lambda prep: Workload(prompt_len=64, gen_len=8))
    job = SimpleNamespace(device="cuda", task="generate", dtype="bfloat16", policy="auto", hardware="h200",
                          gpu_memory=None, cpu_memory=None)
    app_plan.policy_for_job(job, SimpleNamespace(model_path=tiny_dir, spec=resolve_spec("mixtral-8x7b")))
    assert seen == [str(tmp_path / "solves")]
