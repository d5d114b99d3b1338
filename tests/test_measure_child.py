"""app.measure_child: a job's one-time measurements in a child process when CUDA is present, in this process without.

No GPU here: CUDA's presence is stood in for (torch.cuda.is_available -> True) while the measurement itself runs on
the CPU, so the child is a real ``python -m lightning_moe.app.measure_child`` process measuring a real (tiny) host
probe."""

import pytest
import torch

from lightning_moe.app import measure_child
from lightning_moe.pipeline import profiler


def _refuse_here(*a, **kw):
    raise AssertionError("measured in the job's process")


def test_with_cuda_a_real_child_process_measures_and_the_result_comes_back(monkeypatch):
    """With CUDA present the probe runs in a child: this process's probe (replaced by one that fails) is never
    called, and the child's measured (CPU-attention, GPU-attention) seconds come back."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profiler, "measure_host_issue", _refuse_here)
    h = measure_child.measure("host_issue", "cpu", probe="generic", layers=1, mu=2, steps=1)
    assert len(h) == 2 and all(isinstance(x, float) and 0 < x < 10 for x in h)


def test_a_failing_child_raises_with_its_last_error_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"the measuring process exited with 1: ValueError: .*no-such-probe"):
        measure_child.measure("host_issue", "cpu", probe="no-such-probe", layers=1, mu=2, steps=1)


def test_without_cuda_the_measurement_runs_in_this_process(monkeypatch):
    """No CUDA: nothing to keep apart, so this process's probe runs (a test's stand-in stays in place)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(profiler, "measure_host_issue", lambda **kw: calls.append(kw) or (1e-3, 2e-3))
    assert measure_child.measure("host_issue", "cpu", probe="olmoe") == (1e-3, 2e-3)
    assert calls == [{"device": "cpu", "probe": "olmoe"}]
    with pytest.raises(ValueError, match="unknown measurement 'nope'"):
        measure_child.measure("nope", "cpu")


def test_the_child_imports_this_code_from_where_this_process_did(monkeypatch):
    """The child's PYTHONPATH starts with the directory this package was imported from (a script that put a source
    tree on sys.path, not installed, gets the same code in its child), the caller's PYTHONPATH kept after it."""
    import os
    import subprocess

    import lightning_moe

    seen = []

    def run(cmd, **kw):
        seen.append(kw.get("env"))
        return subprocess.CompletedProcess(cmd, 3, "", "boom\n")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure_child.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with pytest.raises(RuntimeError, match="exited with 3: boom"):
        measure_child.measure("host_issue", "cpu", probe="generic")
    root = os.path.dirname(os.path.dirname(os.path.abspath(lightning_moe.__file__)))
    assert seen[0]["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
