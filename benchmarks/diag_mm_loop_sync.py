#!/usr/bin/env python3
"""fused_experts_mm_loop's host wait and sort at prefill shapes (a GPU diagnosis, not a test): Mixtral-8x7B experts
(E 8, F 14336, D 4096, top-2, bf16, random routing). Per T, rounds of back-to-back timings (4 calls between CUDA
events, best of 2) in a rotating order, each variant's rate over the mean dense 8192^3 GEMM rate of its round
(the GPU's clock falls as it heats: only rates measured close together compare):

* ``now``: this tree; ``nosync``: the group bounds given on the host (no copy, no wait: what the drain costs);
  ``sort16``: moe_align's sort over int16 keys (2 radix passes instead of 8);
* the host's time to issue one ``nosync`` call while the GPU is held busy (``torch.cuda._sleep``).

    python3 benchmarks/diag_mm_loop_sync.py [--tokens 4096,8192] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill_ffn import D, E, K, Fd, b2b_time, mixtral_operands  # noqa: E402 (this script's folder)
from lightning_moe.kernels import fused_moe as fm  # noqa: E402



def align16(topk_ids, num_experts, block_m=None):
    """moe_align (no block_m) with the sort over int16 keys."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    _, sorted_pair = torch.sort(flat.to(torch.int16), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    sorted_token = torch.div(sorted_pair, max(k, 1), rounding_mode="floor")
    return fm.MoEAlignment(sorted_token, offsets, sorted_pair, counts, None, None, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2, ga, gb = mixtral_operands(g, dt)
    real_bounds, real_align = fm._host_bounds, fm.moe_align
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.rand(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
        flops = 2 * T * K * 3 * D * Fd
        ref = fm.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)
        bounds = fm.moe_align(ids, E).expert_offsets.tolist()

        def call():
            return fm.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)

        def setv(name):
            fm._host_bounds, fm.moe_align = real_bounds, real_align
            if name == "nosync":
                fm._host_bounds = lambda offsets, then: (bounds, then())
            if name == "sort16":
                fm.moe_align = align16

        for name in ("nosync", "sort16"):
            setv(name)
            try:
                err = (call().float() - ref.float()).abs().max().item()
            finally:
                setv("now")
            print(f"T {T} {name}: max |diff| vs now {err:.3g}", flush=True)
        names = ["dense", "now", "nosync", "sort16"]
        ratios = {n: [] for n in names[1:]}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            res = {}
            for name in order:
                setv(name)
                try:
                    fn = (lambda: ga @ gb) if name == "dense" else call
                    res[name] = (2 * 8192 ** 3 if name == "dense" else flops) / b2b_time(fn, 4) / 1e12
                finally:
                    setv("now")
            for n in ratios:
                ratios[n].append(res[n] / res["dense"])
            print(f"T {T} round {r}: " + ", ".join(f"{n} {res[n]:.1f}" for n in order), flush=True)
        print(f"T {T} median / dense of the round: " + ", ".join(
            f"{n} {statistics.median(v):.3f} (min {min(v):.3f} max {max(v):.3f})" for n, v in ratios.items()), flush=True)
        setv("nosync")
        try:
            for _ in range(3):
                torch.cuda._sleep(int(4e7))  # ~20 ms of GPU time: the host issues the call while the GPU is busy
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                print(f"T {T}: host issue time of one nosync call {1e3 * (t1 - t0):.3f} ms", flush=True)
        finally:
            setv("now")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
