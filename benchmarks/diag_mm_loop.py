#!/usr/bin/env python3
"""Where fused_experts_mm_loop's time goes at prefill shapes (a GPU diagnosis, not a test): Mixtral-8x7B experts
(E 8, F 14336, D 4096, top-2, bf16, random routing), per tokens-per-call T:

* rates (TFLOP/s, 2 T k 3 D F FLOPs per call) of the dense 8192^3 GEMM and of mm_loop variants, each timed two ways:
  ``sync`` (best of 5 single calls, a sync after each: bench_prefill_ffn's way) and ``b2b`` (best of 3 runs of 4
  calls back to back between CUDA events, as a prefill pass issues them);
* variants: ``now`` (this tree), ``exact`` (no tiles: the routed row counts), ``nosilu`` (the SwiGLU kernel skipped:
  its cost), ``two_streams`` (exact row counts, blocks alternating over two CUDA streams), ``gemms_zero`` /
  ``gemms_real`` (the per-expert GEMMs alone over sorted rows, the down GEMM's input zeros / real values);
* a torch.profiler table of one ``now`` call (CUDA time per kernel, and the call's wall time);
* the cuBLAS rate of the gate, down and concatenated gate|up GEMMs per tile row count (32 .. 2048 step 32).

    python3 benchmarks/diag_mm_loop.py [--tokens 4096,8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill_ffn import D, E, K, Fd, b2b_time, mixtral_operands, per_expert_gemms  # noqa: E402 (this script's folder)
from lightning_moe.kernels import fused_moe as fm  # noqa: E402
from lightning_moe.pipeline.profiler import _best_time  # noqa: E402



def two_stream_ffn(x, sorted_token_idx, offsets, w1, w3, w2, n_chunks, silu_mul):
    """_mm_loop_ffn with the routed row counts (no padding: blocks never overlap) and blocks alternating over the
    current stream and a second one."""
    P, Dm, F = sorted_token_idx.numel(), x.shape[1], w1.shape[1]
    xs = torch.empty((P, Dm), dtype=x.dtype, device=x.device)
    bounds, _ = fm._host_bounds(offsets, lambda: torch.index_select(x, 0, sorted_token_idx, out=xs))
    block = fm.mm_loop_block_rows(P, n_chunks)
    blocks = []
    for e in range(len(bounds) - 1):
        for s in range(bounds[e], bounds[e + 1], block):
            blocks.append((e, s, min(block, bounds[e + 1] - s)))
    h = torch.empty((P, F), dtype=x.dtype, device=x.device)
    ups = [torch.empty((block, F), dtype=x.dtype, device=x.device) for _ in range(2)]
    cur = torch.cuda.current_stream()
    side = two_stream_ffn.side = getattr(two_stream_ffn, "side", None) or torch.cuda.Stream()
    side.wait_stream(cur)
    streams = (cur, side)
    for i, (e, s, m) in enumerate(blocks):
        with torch.cuda.stream(streams[i % 2]):
            torch.mm(xs[s:s + m], w1[e].T, out=h[s:s + m])
            silu_mul(h[s:s + m], torch.mm(xs[s:s + m], w3[e].T, out=ups[i % 2][:m]), h[s:s + m])
    yd = torch.empty((P, Dm), dtype=x.dtype, device=x.device)
    side.wait_stream(cur)
    cur.wait_stream(side)
    for i, (e, s, m) in enumerate(blocks):
        with torch.cuda.stream(streams[i % 2]):
            torch.mm(h[s:s + m], w2[e].T, out=yd[s:s + m])
    cur.wait_stream(side)
    return yd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt, sync = torch.device("cuda"), torch.bfloat16, torch.cuda.synchronize
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2, ga, gb = mixtral_operands(g, dt)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    real_ffn, real_silu = fm._mm_loop_ffn, fm.silu_mul_triton
    tile, cap, warm = fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.rand(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
        flops = 2 * T * K * 3 * D * Fd
        al = fm.moe_align(ids, E)
        counts = torch.diff(al.expert_offsets).tolist()
        xs = x[al.sorted_token_idx]
        h_real = torch.randn(xs.shape[0], Fd, device=dev, generator=g).to(dt) * 0.05
        h_zero = torch.zeros_like(h_real)
        say(f"T {T}: rows per expert {counts}")

        def call():
            return fm.fused_experts_mm_loop(x, w1, w3, w2, wts, ids, validate=False)

        def gemms(hs):
            return lambda: per_expert_gemms(xs, hs, counts, w1, w3, w2)

        def variant(name):
            fm._mm_loop_ffn, fm.silu_mul_triton = real_ffn, real_silu
            fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm = tile, cap, warm
            if name in ("exact", "two_streams"):
                fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS, fm._mm_loop_warm = 1, 1 << 30, lambda *a: None
            if name == "nosilu":
                fm.silu_mul_triton = lambda gate, up, out=None: out
            if name == "two_streams":
                fm._mm_loop_ffn = two_stream_ffn
            return {"gemms_zero": gemms(h_zero), "gemms_real": gemms(h_real)}.get(name, call)

        for order in range(2):  # twice, the second pass in reverse order (drift with the GPU's temperature)
            names = ["dense", "now", "exact", "nosilu", "two_streams", "gemms_zero", "gemms_real"]
            res = {}
            for name in (names if order == 0 else names[::-1]):
                fn = (lambda: ga @ gb) if name == "dense" else variant(name)
                fl = 2 * 8192 ** 3 if name == "dense" else flops
                try:
                    res[name] = (fl / _best_time(fn, 5, sync) / 1e12, fl / b2b_time(fn, 4, 3) / 1e12)
                finally:
                    variant("now")
            d = res["dense"]
            say(f"T {T} pass {order}: " + "; ".join(
                f"{k} sync {v[0]:.1f} ({v[0] / d[0]:.3f}) b2b {v[1]:.1f} ({v[1] / d[1]:.3f})" for k, v in res.items()))
        call()
        sync()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(3):
                call()
            e1.record()
            sync()
        say(f"T {T} profile: 3 back-to-back calls, {e0.elapsed_time(e1) / 3:.3f} ms per call")
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        x = xs = h_real = h_zero = None
    hi = 2048
    xs = torch.randn(hi, D, device=dev, generator=g).to(dt)
    h = torch.randn(hi, Fd, device=dev, generator=g).to(dt) * 0.05
    o1 = torch.empty(hi, Fd, device=dev, dtype=dt)
    o2 = torch.empty(hi, D, device=dev, dtype=dt)
    w13 = torch.cat([w1[1], w3[1]])  # [2F, D]: gate and up as one GEMM (2 M 2F D FLOPs)
    o13 = torch.empty(hi, 2 * Fd, device=dev, dtype=dt)
    for name, (inp, w, o) in (("gate", (xs, w1[1], o1)), ("down", (h, w2[1], o2)), ("gate_up", (xs, w13, o13))):
        pts = []
        for M in range(32, hi + 1, 32):
            t = b2b_time(lambda: torch.mm(inp[:M], w.T, out=o[:M]), calls=6, repeats=2)
            pts.append(f"{M}:{2 * M * w.shape[0] * w.shape[1] / t / 1e12:.0f}")
        say(f"{name} GEMM TFLOP/s per M: " + " ".join(pts))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
