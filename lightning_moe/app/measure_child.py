"""A job's one-time host measurements (this host's profile, its model's expert FFN rates, its host issue probe) run in
a child Python process on CUDA, so the job's own process keeps nothing of them.

Measured in the job's process, they left it holding more GPU memory outside torch's allocator (the probes' kernels
and library handles loaded: 0.74 GiB against a clean job's 0.51 GiB on an H100, session 42), which the job's plan then
reserved, and the executor's threads, streams and cached blocks they used. A child measures on the same card and
exits; its result comes back pickled through a temporary file. Without CUDA (tests, a CPU host) the measurement runs
in this process, as it always did: there is no GPU state to keep apart, and a test's stand-in probes stay in place.

``python -m lightning_moe.app.measure_child REQUEST.json RESULT.pkl`` is the child's entry point (this module's own
use; the request names one of :data:`KINDS` and its keyword arguments).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any


def _profile(device: str, gpu_preset: str, gpu_memory: int):
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


def measure(kind: str, device: str, **kwargs: Any) -> Any:
    """Run the measurement ``kind`` (:data:`KINDS`) for ``device`` with ``kwargs`` (JSON values) and return its
    result: in a child process when CUDA is present (the card ``device`` current there), else here. A child that fails
    raises RuntimeError with its error's last line."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"unknown measurement {kind!r} (known: {', '.join(KINDS)})")
    if not torch.cuda.is_available():
        return KINDS[kind](device, **kwargs)
    with tempfile.TemporaryDirectory(prefix="moe-measure-") as d:
        req, out = os.path.join(d, "request.json"), os.path.join(d, "result.pkl")
        with open(req, "w") as f:
            json.dump({"kind": kind, "device": device, "kwargs": kwargs}, f)
        r = subprocess.run([sys.executable, "-m", "lightning_moe.app.measure_child", req, out],
                           capture_output=True, text=True, env=_child_env())
        if r.returncode != 0 or not os.path.isfile(out):
            lines = [ln for ln in (r.stderr or "").splitlines() if ln.strip()]
            raise RuntimeError(f"the measuring process exited with {r.returncode}: "
                               f"{lines[-1] if lines else 'no error output'}")
        with open(out, "rb") as f:
            return pickle.load(f)


def _child_env() -> dict:
    """This process's environment with the directory this package was imported from first on ``PYTHONPATH``: the
    child imports this same code (a source tree put on ``sys.path`` by a script, not installed, included)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def main(argv: list) -> int:
    """The child: read the request, measure with the card current, pickle the result."""
    import contextlib

    import torch

    req_path, out_path = argv
    with open(req_path) as f:
        req = json.load(f)
    device = req["device"]
    card = torch.cuda.device(torch.device(device)) if torch.device(device).type == "cuda" else contextlib.nullcontext()
    with card:
        result = KINDS[req["kind"]](device, **req["kwargs"])
    with open(out_path, "wb") as f:
        pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
