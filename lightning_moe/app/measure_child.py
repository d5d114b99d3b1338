"""A job's one-time host measurements (this host's profile, its model's expert FFN rates, its host issue probe) run in
a child Python process on a CUDA device, so the job's own process keeps nothing of them.

Measured in the job's process, they left it holding more GPU memory outside torch's allocator (the probes' kernels
and library handles loaded: 0.74 GiB against a clean job's 0.51 GiB on an H100, session 42), which the job's plan then
reserved, and the executor's threads, streams and cached blocks they used. A child measures on the same card and
exits; its result comes back pickled through a temporary file, its error as one line (``Type: message``). For a
device that is not CUDA (tests, a CPU host) the measurement runs in this process: there is no GPU state to keep
apart, and a test's stand-in probes stay in place.

The child is ``python -c`` with this package's own root first on ``sys.path`` (the same code, whatever the working
directory holds), running :func:`main` on a request naming one of :data:`KINDS` and its keyword arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, Optional

CHILD_TIMEOUT_S = 1800  # a child that measures longer than this is taken for hung (the whole profile takes ~30-60 s)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds lightning_moe/
_CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); from lightning_moe.app.measure_child import main; "
          "sys.exit(main(sys.argv[2:]))")


def _profile(device: str, gpu_preset: str, gpu_memory: Optional[int]):
    """This host's profile (profiler.profile_host: the generic host probe; a job's own probe is measured apart)."""
    from ..pipeline import profiler

    return profiler.profile_host(gpu_preset=gpu_preset, gpu_memory=gpu_memory, log=lambda line: None, host_probes=())


def _expert_rates(device: str, shape: list, dtype: str, weights: str):
    """The expert FFN rates of one expert shape (profiler.measure_shape_expert_ffn_rates)."""
    from ..pipeline import profiler

    return profiler.measure_shape_expert_ffn_rates(tuple(shape), dtype, weights, device)


def _host_issue(device: str, probe: str, **sizes: int):
    """One host issue probe (profiler.measure_host_issue; ``sizes``: its layers / mu / steps, else its defaults):
    (CPU-attention, GPU-attention) seconds."""
    from ..pipeline import profiler

    return profiler.measure_host_issue(device=device, probe=probe, **sizes)


KINDS = {"profile": _profile, "expert_rates": _expert_rates, "host_issue": _host_issue}


def _in_child(device: str) -> bool:
    """Whether a measurement for ``device`` runs in a child: a CUDA device on a host with CUDA."""
    import torch

    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def measure(kind: str, device: str, **kwargs: Any) -> Any:
    """Run the measurement ``kind`` (:data:`KINDS`) for ``device`` with ``kwargs`` (JSON values) and return its
    result: in a child process for a CUDA device (the card ``device`` current there), else here. A child that fails
    raises RuntimeError with its error's type and first line."""
    if kind not in KINDS:
        raise ValueError(f"unknown measurement {kind!r} (known: {', '.join(KINDS)})")
    if not _in_child(device):
        return KINDS[kind](device, **kwargs)
    with tempfile.TemporaryDirectory(prefix="moe-measure-") as d:
        req, out, err = (os.path.join(d, n) for n in ("request.json", "result.pkl", "error.txt"))
        with open(req, "w") as f:
            json.dump({"kind": kind, "device": device, "kwargs": kwargs}, f)
        try:
            r = subprocess.run([sys.executable, "-c", _CHILD, _ROOT, req, out, err], capture_output=True, text=True,
                               timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the measuring process took over {CHILD_TIMEOUT_S} s and was stopped") from None
        if r.returncode != 0 or not os.path.isfile(out):
            lines = [ln for ln in (r.stderr or "").splitlines() if ln.strip()]
            why = lines[-1] if lines else "no error output"
            if os.path.isfile(err):
                with open(err) as f:
                    why = f.read().strip() or why
            raise RuntimeError(f"the measuring process exited with {r.returncode}: {why}")
        with open(out, "rb") as f:
            return pickle.load(f)


def _nvml_free(device: str) -> Optional[int]:
    """NVML's free bytes of CUDA ``device`` (read without a CUDA context), or None (not CUDA, no NVML)."""
    import torch

    from .gpu import _nvml_free as free_of, cuda_index

    if torch.device(device).type != "cuda":
        return None
    try:
        return free_of(cuda_index(device))
    except Exception:  # noqa: BLE001 - no count: the measured value stays (a bound)
        return None


def _own_context_bytes(prof, device: str, free_before: Optional[int]):
    """``prof`` with ``gpu_context_bytes`` no larger than what this process holds outside its allocator by NVML's
    count (free before its CUDA context minus free now, less its reserved bytes: app.gpu.apply_gpu_cap's rule), so
    the job's own process and any other on the card are not counted as context; ``prof`` as it is where NVML cannot
    say (the measured value, which counts them, stays a bound)."""
    import torch

    free_now = _nvml_free(device) if free_before is not None else None
    if free_now is None or not getattr(prof, "gpu_context_bytes", 0):
        return prof
    own = max(0, free_before - free_now - torch.cuda.memory_reserved(torch.device(device)))
    return dataclasses.replace(prof, gpu_context_bytes=min(prof.gpu_context_bytes, own))


def main(argv: list) -> int:
    """The child: read the request, measure with the card current, pickle the result; an error's ``Type: first
    line`` goes to the error file (the traceback to stderr) and the exit status is 1."""
    import contextlib
    import traceback

    import torch

    req_path, out_path, err_path = argv
    try:
        with open(req_path) as f:
            req = json.load(f)
        device, kind = req["device"], req["kind"]
        free_before = _nvml_free(device) if kind == "profile" else None  # before entering the card makes a context
        cuda = torch.device(device).type == "cuda"
        with torch.cuda.device(torch.device(device)) if cuda else contextlib.nullcontext():
            result = KINDS[kind](device, **req["kwargs"])
            if kind == "profile":
                result = _own_context_bytes(result, device, free_before)
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the job as one line
        traceback.print_exc()
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        with open(err_path, "w") as f:
            f.write(f"{type(e).__name__}: {first}" if first else type(e).__name__)
        return 1
    return 0
