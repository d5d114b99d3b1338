#!/usr/bin/env python3
"""Issue 22's kernel yardstick: the expert FFN's own rate at prefill shapes against the dense GEMM peak, both
measured in the same process, interleaved (a GPU benchmark, not a test).

Per tokens-per-call T (Mixtral-8x7B experts: E 8, F 14336, top-2, D 4096, bf16, uniformly random routing),
``--rounds`` rounds; each round times every variant below in a rotating order, each as ``--calls`` calls back to
back between two CUDA events (best of 2), as a prefill pass issues them (no sync between calls but the call's own):

* ``dense``: the profile's GEMM peak probe, one 8192^3 bf16 ``a @ b`` (``profiler.measure_gpu``'s shape);
* ``ffn``: ``kernels.fused_moe.fused_experts_grouped_mm`` as CGOPipe calls it (the whole call: token sort, gathers,
  gate/up GEMMs in the planner's column chunks, SwiGLU, down GEMM, slot sum);
* ``mm_loop``: ``kernels.fused_moe.fused_experts_mm_loop`` as CGOPipe calls it (the same steps, one cuBLAS GEMM per
  expert and projection after one host wait for the per-expert row counts);
* ``auto``: the faster of ``ffn`` and ``mm_loop`` (what a prefill pass runs when the profile measured the same);
* ``gemms``: the three grouped GEMMs alone over rows already sorted by expert (the ceiling of any epilogue work);
* ``loop``: the same GEMMs as one cuBLAS ``mm`` per expert over known row counts (the down GEMM's input holds
  SwiGLU-scale random values: a GEMM over zeros draws less power and runs faster);
* ``mm_loop/R`` (``--mm-loop-rows R,...``): mm_loop with row blocks of about R rows (``gate_up_chunks`` = ceil(2 T
  k / R)): blocks whose gate and up products fit the L2 cache leave the SwiGLU pass reading from L2.

The H200's clock falls as it heats (the 8192^3 GEMM measured from ~790 TFLOP/s cold to ~610-690 after seconds of
GEMMs), so only rates measured close together compare. Each cell gives the variant's median rate over the rounds,
its median ratio to the dense GEMM of the same round (``/ dense``: same thermal state -- the issue's yardstick) and
the median rate over the fastest dense GEMM of the run (``/ peak``: the cold peak) and over the profile's
``gpu_flops_bf16`` (``/ profile``: the peak the prefill bound divides by). ``--cool S``: the GPU idles S seconds
before each timing, so every variant, the dense GEMM included, is timed from the same cold clock (its peak).
FLOPs 2 T k 3 D F per call. Prints a markdown table, written to ``--out``.

    python3 benchmarks/bench_prefill_ffn.py [--tokens 4096,8192,16384,32768] [--rounds 6] [--cool 0]
        [--mm-loop-rows 512,1024] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_moe.policy.hardware import HardwareProfile  # noqa: E402
from lightning_moe.kernels.fused_moe import (_grouped_mm_fn, fused_experts_grouped_mm, fused_experts_mm_loop,  # noqa: E402
                                             moe_align)

E, Fd, K, D = 8, 14336, 2, 4096


def b2b_time(fn: Callable[[], object], calls: int, repeats: int = 2, cool: float = 0.0) -> float:
    """Seconds per call of ``fn`` run ``calls`` times back to back between two CUDA events, best of ``repeats``
    (after one call); ``cool`` > 0: the GPU idles that many seconds before each timing (its clock recovers: every
    variant timed from the same cold state)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        if cool > 0:
            time.sleep(cool)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3 / calls)
    return best


def per_expert_gemms(xs: torch.Tensor, hs: torch.Tensor, counts: list, w1: torch.Tensor, w3: torch.Tensor,
                     w2: torch.Tensor) -> None:
    """The expert FFN's GEMMs alone: one cuBLAS ``mm`` per expert and projection over expert-sorted rows ``xs`` (gate,
    up) and ``hs`` (down), ``counts[e]`` rows of expert e."""
    s = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(xs[s:s + c], w1[e].T)
            torch.mm(xs[s:s + c], w3[e].T)
            torch.mm(hs[s:s + c], w2[e].T)
            s += c


def mixtral_operands(g: torch.Generator, dt: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """Mixtral-8x7B expert weights w1, w3 [E, F, D], w2 [E, D, F] (0.02-scaled normal) and the dense probe's two
    8192^3 operands, in ``dt`` on ``g``'s device (the benchmarks of the expert FFN share them)."""
    w1 = (torch.randn(E, Fd, D, device=g.device, generator=g) * 0.02).to(dt)
    w3 = (torch.randn(E, Fd, D, device=g.device, generator=g) * 0.02).to(dt)
    w2 = (torch.randn(E, D, Fd, device=g.device, generator=g) * 0.02).to(dt)
    ga = torch.randn(8192, 8192, device=g.device, generator=g).to(dt)
    gb = torch.randn(8192, 8192, device=g.device, generator=g).to(dt)
    return w1, w3, w2, ga, gb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192,16384,32768")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--cool", type=float, default=0.0, help="idle seconds before each timing (0: back to back)")
    ap.add_argument("--mm-loop-rows", default="", help="extra mm_loop variants with row blocks of about R rows")
    ap.add_argument("--hardware", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       "lightning_moe", "policy", "profiles", "h200-host.yaml"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    prof = HardwareProfile.load(a.hardware).gpu_flops_bf16 / 1e12
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2, ga, gb = mixtral_operands(g, dt)
    gmm = _grouped_mm_fn()
    block_rows = [int(r) for r in a.mm_loop_rows.split(",") if r]
    kinds = ["ffn", "mm_loop", "auto", "gemms", "loop"] + [f"mm_loop/{r}" for r in block_rows]
    lines = [f"cool {a.cool:g} s, {a.rounds} rounds x {a.calls} calls; profile peak {prof:.1f} TFLOP/s", "",
             "| T | dense TFLOP/s (median; peak) | "
             + " | ".join(f"{k} | / dense | / peak | / profile" for k in kinds) + " |",
             "|---|---|" + "---|---|---|---|" * len(kinds)]
    print("\n".join(lines), flush=True)
    rows, peak = [], 0.0
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=g), -1), K, dim=-1)
        flops = 2 * T * K * 3 * D * Fd
        al = moe_align(ids, E)
        offs = al.expert_offsets[1:E + 1].to(torch.int32)
        xs = x[al.sorted_token_idx]
        counts = torch.diff(al.expert_offsets[:E + 1]).tolist()
        hs = (torch.randn(xs.shape[0], Fd, device=dev, generator=g) * 0.05).to(dt)  # SwiGLU-scale values, not zeros

        def gemms():
            gmm(xs, w1.transpose(1, 2), offs=offs)
            gmm(xs, w3.transpose(1, 2), offs=offs)
            gmm(hs, w2.transpose(1, 2), offs=offs)

        def loop():
            per_expert_gemms(xs, hs, counts, w1, w3, w2)

        fns = {"dense": (lambda: ga @ gb, 2 * 8192 ** 3),
               "ffn": (lambda: fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, validate=False), flops),
               "mm_loop": (lambda: fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False), flops),
               "gemms": (gemms, flops), "loop": (loop, flops)}
        for r in block_rows:  # n = ceil(2 P / r) column-chunk count gives blocks of ~r rows (mm_loop_block_rows)
            n = -(-2 * T * K // r)
            fns[f"mm_loop/{r}"] = (lambda n=n: fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False,
                                                                     gate_up_chunks=n), flops)
        names = list(fns)
        rates: dict = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                fn, fl = fns[n]
                rates[n].append(fl / b2b_time(fn, a.calls, repeats=1 if a.cool else 2, cool=a.cool) / 1e12)
        rates["auto"] = [max(f, m) for f, m in zip(rates["ffn"], rates["mm_loop"])]
        peak = max(peak, max(rates["dense"]))
        rows.append((T, rates))
        x = xs = hs = None
    for T, rates in rows:  # every row against the run's peak (the coldest dense GEMM, which may come late)
        d = rates["dense"]

        def cell(k):
            same = median(v / dv for v, dv in zip(rates[k], d))
            m = median(rates[k])
            return f"{m:.1f} | {same:.2f} | {m / peak:.2f} | {m / prof:.2f}"
        lines.append(f"| {T} | {median(d):.1f}; {peak:.1f} | " + " | ".join(cell(k) for k in kinds) + " |")
        print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
