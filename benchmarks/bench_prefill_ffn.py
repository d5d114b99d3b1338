#!/usr/bin/env python3
"""Issue 22's kernel yardstick: the expert FFN's own rate at prefill shapes against the dense GEMM peak, both
measured in the same process, interleaved (a GPU benchmark, not a test).

Per tokens-per-call T (Mixtral-8x7B experts: E 8, F 14336, top-2, D 4096, bf16, uniformly random routing), each the
best of ``--repeats`` timed calls after a warm-up (the profiler's ``_best_time``), in this order per T:

* ``dense``: the profile's GEMM peak probe, one 8192^3 bf16 ``a @ b`` (``profiler.measure_gpu``'s shape);
* ``ffn``: ``kernels.fused_moe.fused_experts_grouped_mm`` as CGOPipe calls it (the whole call: token sort, gathers,
  gate/up GEMMs in the planner's column chunks, SwiGLU, down GEMM, slot sum) -- the rate the issue asks to be
  >= 0.8 of ``dense``;
* ``mm_loop``: ``kernels.fused_moe.fused_experts_mm_loop`` as CGOPipe calls it (the same steps, one cuBLAS GEMM per
  expert and projection after one host wait for the per-expert row counts), where the build has it;
* ``auto``: the faster of ``ffn`` and ``mm_loop`` (what a prefill pass runs when the profile measured the same);
* ``ffn_torch_epilogue``: the same with the torch SwiGLU / slot sum (``_epilogue="torch"``), where the build has
  that switch;
* ``ffn_1chunk``: the same with ``gate_up_chunks=1`` (two full-width gate/up GEMMs: more workspace than the planner
  counts);
* ``gemms``: the three grouped GEMMs alone over rows already sorted by expert (the ceiling of any epilogue work);
* ``loop``: the same GEMMs as one cuBLAS ``mm`` per expert over known row counts (what a host-synced loop reaches).

FLOPs 2 T k 3 D F per call. Prints a markdown table (TFLOP/s and / dense) and writes it to ``--out``.

    python3 benchmarks/bench_prefill_ffn.py [--tokens 4096,8192,16384,32768] [--repeats 5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_moe.kernels import fused_moe  # noqa: E402
from lightning_moe.kernels.fused_moe import _grouped_mm_fn, fused_experts_grouped_mm, moe_align  # noqa: E402
from lightning_moe.pipeline.profiler import _best_time  # noqa: E402

E, Fd, K, D = 8, 14336, 2, 4096


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,8192,16384,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt, sync = torch.device("cuda"), torch.bfloat16, torch.cuda.synchronize
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(E, Fd, D, device=dev, generator=g) * 0.02).to(dt)
    w3 = (torch.randn(E, Fd, D, device=dev, generator=g) * 0.02).to(dt)
    w2 = (torch.randn(E, D, Fd, device=dev, generator=g) * 0.02).to(dt)
    ga = torch.randn(8192, 8192, device=dev, generator=g).to(dt)
    gb = torch.randn(8192, 8192, device=dev, generator=g).to(dt)
    has_switch = "_epilogue" in inspect.signature(fused_experts_grouped_mm).parameters
    gmm = _grouped_mm_fn()
    mm_loop = getattr(fused_moe, "fused_experts_mm_loop", None)
    lines = ["| T | dense 8192^3 TFLOP/s | ffn (as CGOPipe) | / dense | ffn mm_loop (as CGOPipe) | / dense | "
             "prefill pick (faster) | / dense | ffn, torch epilogue | / dense | "
             "ffn, 1 gate/up chunk | / dense | 3 grouped GEMMs only | / dense | per-expert cuBLAS mm loop | / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).to(dt)
        wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev, generator=g), -1), K, dim=-1)
        flops = 2 * T * K * 3 * D * Fd
        al = moe_align(ids, E)
        offs = al.expert_offsets[1:E + 1].to(torch.int32)
        xs = x[al.sorted_token_idx]
        counts = torch.diff(al.expert_offsets[:E + 1]).tolist()
        hs = torch.empty(xs.shape[0], Fd, device=dev, dtype=dt)

        def gemms():
            gmm(xs, w1.transpose(1, 2), offs=offs)
            gmm(xs, w3.transpose(1, 2), offs=offs)
            gmm(hs, w2.transpose(1, 2), offs=offs)

        def loop():
            s = 0
            for e, c in enumerate(counts):
                if c:
                    xe, he = xs[s:s + c], hs[s:s + c]
                    torch.mm(xe, w1[e].T)
                    torch.mm(xe, w3[e].T)
                    torch.mm(he, w2[e].T)
                    s += c

        rates = {"dense": 2 * 8192**3 / _best_time(lambda: ga @ gb, a.repeats, sync)}
        rates["ffn"] = flops / _best_time(lambda: fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, validate=False),
                                          a.repeats, sync)
        if mm_loop is not None:
            rates["mm_loop"] = flops / _best_time(lambda: mm_loop(x, w1, w3, w2, wts, ids, validate=False),
                                                  a.repeats, sync)
            rates["auto"] = max(rates["ffn"], rates["mm_loop"])
        if has_switch:
            rates["torch_ep"] = flops / _best_time(lambda: fused_experts_grouped_mm(
                x, w1, w3, w2, wts, ids, validate=False, _epilogue="torch"), a.repeats, sync)
        rates["one_chunk"] = flops / _best_time(lambda: fused_experts_grouped_mm(
            x, w1, w3, w2, wts, ids, validate=False, gate_up_chunks=1), a.repeats, sync)
        rates["gemms"] = flops / _best_time(gemms, a.repeats, sync)
        rates["loop"] = flops / _best_time(loop, a.repeats, sync)
        d = rates["dense"]

        def cell(k):
            return (f"{rates[k] / 1e12:.1f} | {rates[k] / d:.2f}") if k in rates else "n/a | -"
        lines.append(f"| {T} | {d / 1e12:.1f} | {cell('ffn')} | {cell('mm_loop')} | {cell('auto')} | {cell('torch_ep')} | {cell('one_chunk')} | {cell('gemms')} | {cell('loop')} |")
        print(lines[-1], flush=True)
        x = xs = hs = None
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
