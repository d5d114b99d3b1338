#!/usr/bin/env python3
"""Where the host's time goes in one fused_experts_mm_loop call at prefill shapes (a GPU diagnosis, not a test):
Mixtral-8x7B experts (E 8, F 14336, D 4096, top-2, bf16, random routing), per tokens-per-call T.

The GPU is held busy (``torch.cuda._sleep``) while the host issues the calls, so every number is host time, never
a wait for the GPU: the host's wait for the row counts is replaced by the bounds already on the host (``nosync``).

* the host time of one whole call (median of 9);
* the host time of one launch of each step, alone (median of 50): moe_align, the gather, torch.empty, one gate
  GEMM (torch.mm into a slice), silu_mul_triton on one expert's block, moe_combine_triton;
* cProfile of 5 calls, by own time (what the host does, Python and C calls);
* ``--align``: the GPU time of moe_align against moe_align_triton (20 calls queued behind a busy GPU) and
  their host time, at Mixtral's and Qwen3-30B-A3B's routing shapes.

    python3 benchmarks/diag_mm_loop_host.py [--tokens 4096,8192] [--align] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill_ffn import D, E, K, Fd, mixtral_operands  # noqa: E402 (this script's folder)
from lightning_moe.kernels import fused_moe as fm  # noqa: E402


def host_us(fn, n: int) -> float:
    """Median host microseconds of ``fn()`` over ``n`` calls, the GPU held busy meanwhile."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU time: every launch below queues behind it
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def gpu_us(fn, n: int) -> float:
    """GPU microseconds per call of ``fn`` over ``n`` calls queued behind a busy GPU (no launch gaps between them)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s: the host queues all n calls before the GPU reaches the first
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    e1.synchronize()
    return 1e3 * e0.elapsed_time(e1) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--align", action="store_true", help="moe_align against moe_align_triton")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2, _, _ = mixtral_operands(g, dt)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    import triton
    say(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    real_bounds = fm._host_bounds
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.rand(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
        al = fm.moe_align(ids, E)
        bounds = al.expert_offsets.tolist()
        P = T * K
        m = fm.MM_LOOP_TILE * ((bounds[1] - bounds[0]) // fm.MM_LOOP_TILE)
        xs = x[al.sorted_token_idx]
        h = torch.empty(P, Fd, device=dev, dtype=dt)
        up = torch.empty(m, Fd, device=dev, dtype=dt)
        yd = torch.randn(P, D, device=dev, generator=g).to(dt)
        rank = torch.arange(P, device=dev).view(T, K)

        def call():
            return fm.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)

        call()
        fm._host_bounds = lambda offsets, then: (bounds, then())  # nosync: the row counts already on the host
        try:
            call()
            say(f"T {T}: one call (nosync) {host_us(call, 9):.0f} us of host time")
            steps = {
                "moe_align": lambda: fm.moe_align(ids, E),
                "moe_align_triton": lambda: fm.moe_align_triton(ids, E),
                "gather (index_select out=)": lambda: torch.index_select(x, 0, al.sorted_token_idx, out=xs),
                "torch.empty [P, F]": lambda: torch.empty(P, Fd, device=dev, dtype=dt),
                f"torch.mm [{m}, D] x [D, F] into a slice": lambda: torch.mm(xs[:m], w1[0].T, out=h[:m]),
                f"silu_mul_triton [{m}, F]": lambda: fm.silu_mul_triton(h[:m], up, h[:m]),
                f"silu_mul_reference [{m}, F]": lambda: fm.silu_mul_reference(up, up, up),
                "moe_combine_triton": lambda: fm.moe_combine_triton(yd, rank, wts, ids, E, False),
                "rank (index_put of arange)": lambda: torch.empty_like(al.sorted_pair_idx).__setitem__(
                    al.sorted_pair_idx, torch.arange(P, device=dev)),
            }
            for name, fn in steps.items():
                fn()
                say(f"T {T}: {name}: {host_us(fn, 50):.1f} us per launch")
            torch.cuda.synchronize()
            torch.cuda._sleep(int(3e9))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                call()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            say(f"T {T}: cProfile of 5 calls (nosync), by own time\n{s.getvalue()}")
        finally:
            fm._host_bounds = real_bounds
    for T, k, n in ((4096, 2, 8), (8192, 2, 8), (32768, 2, 8), (1024, 8, 128)) if a.align else ():
        ids = torch.randint(0, n, (T, k), device=dev, generator=g)
        if not fm.moe_align_triton_fits(T * k, n):
            continue
        ok = all(torch.equal(u, v) for u, v in zip(fm.moe_align(ids, n)[:4], fm.moe_align_triton(ids, n)[:4]))
        fns = {"moe_align": lambda: fm.moe_align(ids, n), "moe_align_triton": lambda: fm.moe_align_triton(ids, n)}
        gpu = {name: gpu_us(f, 20) for name, f in fns.items()}
        host = {name: host_us(f, 20) for name, f in fns.items()}
        say(f"align T {T} k {k} E {n}: equal {ok}; GPU us per call (20 queued) "
            + ", ".join(f"{k_} {v:.1f}" for k_, v in gpu.items()) + "; host us " + ", ".join(
                f"{k_} {v:.1f}" for k_, v in host.items()))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
