#!/usr/bin/env python3
"""fused_experts_mm_loop's row tiling on the GPU (a benchmark, not a test): the whole FFN call as CGOPipe runs it at
Mixtral-8x7B expert shapes (E 8, F 14336, D 4096, top-2, bf16, random routing) for several variants of the code, and
the cuBLAS rate of one expert GEMM per row count M around an expert's share of a prefill chunk.

Variants (best of ``--repeats`` after a warm-up, ``profiler._best_time``): ``tiles`` (this tree: row counts padded to
MM_LOOP_TILE, blocks of at most MM_LOOP_MAX_ROWS), ``exact`` (this tree with tile 1 and no row cap: the row counts as
routed), ``gather`` (``tiles`` with the expert-sorted gather as ``x[idx]`` copied into the padded buffer instead of
``index_select(out=)``), ``before`` (``--before DIR``: that tree's fused_moe.py, e.g. the code before the tiling).

    python3 benchmarks/bench_mm_loop_tiles.py [--tokens 4096,8192] [--m 960:1120] [--before .carry/before]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill_ffn import D, E, K, Fd, b2b_time, mixtral_operands  # noqa: E402 (this script's folder)
from lightning_moe.kernels import fused_moe as fm  # noqa: E402
from lightning_moe.pipeline.profiler import _best_time  # noqa: E402



def load_before(tree: str):
    """The fused_moe module of another tree, under its own name (it imports only torch and its own package's
    _triton_kernels lazily, which this tree's copy serves)."""
    path = os.path.join(tree, "lightning_moe", "kernels", "fused_moe.py")
    spec = importlib.util.spec_from_file_location("lightning_moe.kernels.fused_moe_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--m", default="960:1120", help="row counts lo:hi of the single-GEMM sweep")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", default=None)
    a = ap.parse_args(argv)
    dev, dt, sync = torch.device("cuda"), torch.bfloat16, torch.cuda.synchronize
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2 = mixtral_operands(g, dt)[:3]
    before = load_before(a.before) if a.before else None
    real_index_select = torch.index_select

    def gather_copy(x, dim, idx, out=None):  # x[idx] (advanced indexing) copied into out
        return out.copy_(x[idx]) if out is not None else x[idx]

    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.rand(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
        flops = 2 * T * K * 3 * D * Fd
        variants = {"tiles": lambda: fm.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)}
        variants["exact"] = variants["tiles"]
        variants["gather"] = variants["tiles"]
        if before is not None:
            variants["before"] = lambda: before.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)
        out = {}
        for name, fn in variants.items():
            tile, cap, warm = fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm
            if name == "exact":  # no warm-up pass either (it would run every row count up to the block)
                fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm = 1, 1 << 30, lambda *a: None
            if name == "gather":
                torch.index_select = gather_copy
            try:
                out[name] = flops / _best_time(fn, a.repeats, sync) / 1e12
            finally:
                fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm = tile, cap, warm
                torch.index_select = real_index_select
        rows.append((T, out))
        print(f"T {T}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()) + " TFLOP/s", flush=True)
    lo, hi = (int(v) for v in a.m.split(":"))
    xs = torch.randn(hi, D, device=dev, generator=g).to(dt)
    h = torch.empty(hi, Fd, device=dev, dtype=dt)
    y = torch.empty(hi, D, device=dev, dtype=dt)
    sweep = {"gate": [], "down": []}
    for M in range(lo, hi + 1):
        for name, (inp, w, o) in (("gate", (xs, w1[1], h)), ("down", (h, w2[1], y))):
            t = b2b_time(lambda: torch.mm(inp[:M], w.T, out=o[:M]), 10, 1)
            sweep[name].append((M, 2 * M * D * Fd / t / 1e12))
    for name, pts in sweep.items():
        m32 = [r for M, r in pts if M % 32 == 0]
        other = [r for M, r in pts if M % 32]
        print(f"{name} GEMM M {lo}..{hi}: M % 32 == 0 mean {sum(m32) / len(m32):.1f} TFLOP/s (n {len(m32)}), "
              f"others mean {sum(other) / len(other):.1f} (n {len(other)}); min {min(r for _, r in pts):.1f} "
              f"max {max(r for _, r in pts):.1f}", flush=True)
        print("  " + " ".join(f"{M}:{r:.0f}" for M, r in pts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
