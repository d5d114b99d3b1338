"""app.measure_child: a job's one-time measurements in a child process for a CUDA device, in this process otherwise.

No GPU here: the child path is forced (``_in_child`` -> True) while the measurement itself runs on the CPU, so the
child is a real ``python -c`` process measuring a real (tiny) host probe."""

import dataclasses
import json
import os

import pytest
import torch

from lightning_moe.app import measure_child
from lightning_moe.pipeline import profiler
from lightning_moe.policy.hardware import GiB, get_preset


def _refuse_here(*a, **kw):
    raise AssertionError("measured in the job's process")


@pytest.fixture
def child(monkeypatch):
    """The child path for the CPU device, and this process's host probe replaced by one that fails."""
    monkeypatch.setattr(measure_child, "_in_child", lambda device: True)
    monkeypatch.setattr(profiler, "measure_host_issue", _refuse_here)


def test_a_real_child_process_measures_and_the_result_comes_back(child):
    """The probe runs in the child (this process's fails if called) and its measured (CPU-attention,
    GPU-attention) seconds come back."""
    h = measure_child.measure("host_issue", "cpu", probe="generic", layers=1, mu=2, steps=1)
    assert len(h) == 2 and all(isinstance(x, float) and 0 < x < 10 for x in h)


def test_a_failing_child_raises_with_its_errors_type_and_first_line(child):
    with pytest.raises(RuntimeError, match=r"the measuring process exited with 1: ValueError: .*no-such-probe"):
        measure_child.measure("host_issue", "cpu", probe="no-such-probe", layers=1, mu=2, steps=1)


def test_the_child_imports_this_code_whatever_the_working_directory_holds(child, tmp_path, monkeypatch):
    """A working directory holding another ``lightning_moe`` (here one that fails to import) does not shadow this
    package in the child."""
    fake = tmp_path / "lightning_moe"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the wrong lightning_moe')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert len(measure_child.measure("host_issue", "cpu", probe="generic", layers=1, mu=2, steps=1)) == 2


def test_only_a_cuda_device_measures_in_a_child(monkeypatch):
    """A CUDA device on a host with CUDA: a child; the CPU device (even on a CUDA host) or no CUDA: this process,
    where a stand-in probe stays in place."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert measure_child._in_child("cuda:1") and measure_child._in_child("cuda")
    assert not measure_child._in_child("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not measure_child._in_child("cuda:0")
    calls = []
    monkeypatch.setattr(profiler, "measure_host_issue", lambda **kw: calls.append(kw) or (1e-3, 2e-3))
    assert measure_child.measure("host_issue", "cuda:0", probe="olmoe") == (1e-3, 2e-3)
    assert calls == [{"device": "cuda:0", "probe": "olmoe"}]
    with pytest.raises(ValueError, match="unknown measurement 'nope'"):
        measure_child.measure("nope", "cpu")


def test_the_childs_profile_counts_only_its_own_context(monkeypatch, tmp_path):
    """The profile kind: the child reads NVML's free bytes before its CUDA context exists and after the measurement;
    what it holds outside its allocator by that count (free before - free after - its reserved bytes) caps the
    profile's gpu_context_bytes, which counts everything on the card outside the child's allocator (the job's process
    too); where NVML cannot say, the measured value stays."""
    import contextlib
    import pickle

    measured = dataclasses.replace(get_preset("h100"), gpu_context_bytes=3 * GiB)
    monkeypatch.setattr(profiler, "profile_host", lambda **kw: measured)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: GiB // 4)
    req, out, err = (str(tmp_path / n) for n in ("req.json", "out.pkl", "err.txt"))
    with open(req, "w") as f:
        json.dump({"kind": "profile", "device": "cuda:0", "kwargs": {"gpu_preset": "h100", "gpu_memory": None}}, f)
    for frees, want in (([80 * GiB, 79 * GiB], 3 * GiB // 4), ([None, None], 3 * GiB), ([80 * GiB, 70 * GiB], 3 * GiB)):
        seq = iter(frees)
        monkeypatch.setattr(measure_child, "_nvml_free", lambda device: next(seq))
        assert measure_child.main([req, out, err]) == 0 and not os.path.exists(err)
        with open(out, "rb") as f:
            assert pickle.load(f).gpu_context_bytes == want, frees
