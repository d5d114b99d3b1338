"""Measure a CPU-only host for the CPU executor's roofline (policy.cpu_hrm): peak rates and per-call costs.

Each number is a micro-benchmark, the minimum over repeats of a timed loop (the machine's best, as a roofline's peak
is): a large fp32 (and bf16) matmul's FLOP/s, a 64 MiB copy's bandwidth (bytes read + written), the per-call cost of a
small ``F.linear``, a small element-wise op, a view op, a tiny CPU decode-attention call and a hand-off to a worker
thread, and the write rate of an advanced-index scatter into a KV-cache-shaped tensor. A few seconds in all, run
with the process's torch thread count (which the executors use).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from ..policy.cpu_hrm import CpuProfile
from ..policy.hardware import MiB


def _per_call(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Seconds per call of ``fn``: the best over ``repeats`` loops of ``calls`` calls, after one warm-up loop."""
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 512) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` (2 n^3 FLOP per call)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _per_call(lambda: torch.mm(a, b), 4, 3)


def memory_bandwidth(nbytes: int = 64 * MiB) -> float:
    """Copy bandwidth in bytes/s: 2 nbytes / time of ``dst.copy_(src)`` (read + write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _per_call(lambda: dst.copy_(src), 3, 3)


def call_costs(calls: int = 400) -> dict:
    """Per-call seconds of the small ops the executors issue at decode shapes: ``gemm_call`` (F.linear of 16 rows
    64 -> 128), ``op_call`` (an add of two [16, 64] tensors), ``view_call`` (a select), ``attention_call`` (the CPU
    decode-attention routine on 4 rows of 16 positions), ``handoff`` (a no-op submitted to a worker thread, waited)."""
    from .cpu_attention import cpu_decode_attention

    x, w, y = torch.randn(16, 64), torch.randn(128, 64), torch.randn(16, 64)
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16, 16), torch.randn(4, 2, 16, 16)
    lengths = torch.full((4,), 16, dtype=torch.int64)
    out = {"gemm_call": _per_call(lambda: F.linear(x, w), calls), "op_call": _per_call(lambda: x + y, calls),
           "view_call": _per_call(lambda: x.select(0, 3), calls),
           "attention_call": _per_call(lambda: cpu_decode_attention(q, k, v, lengths), calls // 4)}
    with ThreadPoolExecutor(max_workers=1) as pool:
        out["handoff"] = _per_call(lambda: pool.submit(int).result(), calls // 4)
    return out


def scatter_bandwidth(rows: int = 64, positions: int = 256, heads: int = 2, head_dim: int = 16) -> float:
    """Bytes/s of values written by ``K[slot, :, pos] = x`` (the grouped KV cache's prefill write) for every position
    of ``rows`` rows of a [rows, heads, positions, head_dim] fp32 cache."""
    K = torch.zeros(rows, heads, positions, head_dim)
    slot = torch.arange(rows).repeat_interleave(positions)
    pos = torch.arange(positions).repeat(rows)
    x = torch.randn(rows * positions, heads, head_dim)

    def write():
        K[slot, :, pos] = x

    return x.numel() * x.element_size() / _per_call(write, 3, 3)


def machine_key() -> str:
    """What a cached CPU profile is valid for: CPU model, logical CPUs, torch threads, torch version."""
    return f"{cpu_model()} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_memory_bytes() -> int:
    """Physical memory in bytes (sysconf), 0 when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_cpu_profile(name: str = "cpu") -> CpuProfile:
    """This host's :class:`CpuProfile` (a few seconds)."""
    bf16 = matmul_flops(torch.bfloat16, 256) if hasattr(torch, "bfloat16") else 0.0
    costs = call_costs()
    return CpuProfile(
        name=name, machine=machine_key(), cpu_model=cpu_model(), cpu_cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(), torch_version=str(torch.__version__), host_memory=host_memory_bytes(),
        memory_bandwidth=memory_bandwidth(), matmul_flops_fp32=matmul_flops(torch.float32), matmul_flops_bf16=bf16,
        scatter_bandwidth=scatter_bandwidth(), source="measured by lightning_moe.pipeline.cpu_profile "
        "(best of repeated micro-benchmarks)", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **costs)
