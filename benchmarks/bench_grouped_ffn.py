#!/usr/bin/env python3
"""The grouped expert-FFN kernels at each family's real shapes (a GPU benchmark, not a test).

For Mixtral-8x7B (8 experts of 14336, top-2, D 4096), Qwen3-30B-A3B (128 of 768, top-8, D 2048), OLMoE-1B-7B (64 of
1024, top-8) and Qwen1.5-MoE-A2.7B (60 of 1408, top-4), over token counts T from decode (8) to prefill (16384),
uniformly random routing: ms per call of our Triton grouped kernel (``kernels.fused_moe.fused_experts_triton``), of a
per-expert cuBLAS loop (torch matmuls over each expert's rows) and of our grouped_mm path
(``kernels.fused_moe.fused_experts_grouped_mm``, what CGOPipe runs with ``expert_ffn: grouped_mm``: default gate/up
column chunks, the planner's workspace; and with one chunk, two full-width gate/up GEMMs, more memory); TFLOP/s
(6 D F flops per (token, expert) pair) and the HBM rate of the expert weights the call touches (each touched
expert's 3 D F bf16 values read once). 128 narrow experts with few tokens each is the regime where the weight
reads, not the flops, bound the call.

``--choice-table``: instead, the table ``moe-batch profile`` would record in the profile's ``expert_ffn_rates``
(``pipeline.profiler.measure_expert_ffn_rates``, the same probe: Triton vs grouped_mm per shape and T bucket, and
which CGOPipe's ``expert_ffn: auto`` picks), and with ``--rates-yaml FILE`` those entries as a profile fragment.

Usage: ``python3 benchmarks/bench_grouped_ffn.py [--out FILE.md] [--models a,b] [--choice-table [--rates-yaml F]]``
on a CUDA host.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lightning_moe.kernels.fused_moe import (fused_experts_grouped_mm, fused_experts_triton,  # noqa: E402
                                             grouped_mm_unsupported)

SHAPES = {  # name: (experts E, width F, top-k, hidden D)
    "mixtral-8x7b": (8, 14336, 2, 4096),
    "qwen3-30b-a3b": (128, 768, 8, 2048),
    "olmoe-1b-7b": (64, 1024, 8, 2048),
    "qwen1.5-moe-a2.7b": (60, 1408, 4, 2048),
}
TOKENS = (8, 64, 512, 4096, 16384)


def cuda_ms(fn, reps: int = 10) -> float:
    """Mean ms per call over ``reps`` calls after two warm-up calls (CUDA events)."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def loop_ffn(x, w1, w3, w2, topk_w, topk_ids):
    """Per-expert cuBLAS loop: gather each expert's rows, SwiGLU, scatter-add (the host learns the counts)."""
    T, k = topk_ids.shape
    out = torch.zeros_like(x, dtype=torch.float32)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    rows = order // k
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        idx = order[start:start + c]
        r = rows[start:start + c]
        start += c
        xe = x[r]
        h = torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)
        out.index_add_(0, r, (h @ w2[e].T).float() * topk_w.reshape(-1)[idx, None])
    return out.to(x.dtype)


def bench_model(name: str) -> list[str]:
    """The table rows of one model's shapes, one per T (printed as they come)."""
    dev, rows = "cuda", []
    E, F, k, D = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(7)
    w1 = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16, generator=g) / D**0.5
    w3 = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16, generator=g) / D**0.5
    w2 = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16, generator=g) / F**0.5
    for T in TOKENS:
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.argsort(torch.rand(T, E, device=dev, generator=g), dim=1)[:, :k]
        w = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=1)
        touched = int(torch.unique(ids).numel())
        ms = cuda_ms(lambda: fused_experts_triton(x, w1, w3, w2, w, ids, validate=False))
        ours = fused_experts_triton(x, w1, w3, w2, w, ids, validate=False).float()
        scale = ours.abs().max().item()
        err = (loop_ffn(x, w1, w3, w2, w, ids).float() - ours).abs().max().item() / scale
        flops = 6 * D * F * T * k
        wbytes = 3 * D * F * 2 * touched
        loop = cuda_ms(lambda: loop_ffn(x, w1, w3, w2, w, ids), reps=3)
        gmm = []
        for chunks in (None, 1):  # default chunks (the planner's workspace); two full-width gate/up GEMMs
            why = grouped_mm_unsupported(x, w1, w3, w2)
            if why is not None:
                gmm.append(f"n/a ({why[:40]})")
                continue
            try:
                run = lambda: fused_experts_grouped_mm(x, w1, w3, w2, w, ids, validate=False,  # noqa: E731
                                                       gate_up_chunks=chunks)
                gerr = (run().float() - ours).abs().max().item() / scale
                gms = cuda_ms(run)
                gmm.append(f"{gms:.3f} ({gerr:.0e}, {flops / gms / 1e9:.1f})")
            except (RuntimeError, ValueError) as e:  # the build may not take it
                gmm.append(f"n/a ({str(e).splitlines()[0][:40]})")
        rows.append(f"| {name} | {T} | {touched} of {E} | {ms:.3f} | {flops / ms / 1e9:.1f} | "
                    f"{wbytes / ms / 1e6:.0f} | {loop:.3f} ({err:.0e}, {flops / loop / 1e9:.1f}) | {gmm[0]} | {gmm[1]} |")
        print(rows[-1], flush=True)
    return rows


def choice_table(models: list[str], rates_yaml: str | None) -> list[str]:
    """The profile's expert_ffn_rates for ``models`` at the profile's T buckets (profiler.measure_expert_ffn_rates,
    what `moe-batch profile --expert-shapes` runs), as markdown rows; optionally the entries as a YAML fragment."""
    from lightning_moe.pipeline.profiler import EXPERT_FFN_TOKENS, measure_expert_ffn_rates
    from lightning_moe.policy.hardware import NO_SYNC_KERNELS

    shapes = [(SHAPES[m][3], SHAPES[m][1], SHAPES[m][0], SHAPES[m][2]) for m in models]  # (D, F, E, k)
    rows = measure_expert_ffn_rates(shapes, EXPERT_FFN_TOKENS, log=print)
    names = {(D, F, E, k): m for m, (D, F, E, k) in zip(models, shapes)}
    lines = ["| model | T | Triton TFLOP/s | grouped_mm TFLOP/s | mm_loop TFLOP/s | grouped_mm / Triton | auto picks "
             "(decode) | auto picks (prefill) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.grouped_mm / r.triton:.2f}" if r.triton else "-"
        lines.append(f"| {names[r.shape[:4]]} | {r.tokens} | {r.triton / 1e12:.1f} | {r.grouped_mm / 1e12:.1f} | "
                     f"{r.mm_loop / 1e12:.1f} | {ratio} | {r.best_of(NO_SYNC_KERNELS)} | {r.best} |")
    if rates_yaml:
        import yaml
        from dataclasses import asdict

        with open(rates_yaml, "w") as f:
            f.write("# expert_ffn_rates measured by benchmarks/bench_grouped_ffn.py --choice-table (paste into a "
                    "profile YAML)\n")
            yaml.safe_dump({"expert_ffn_rates": [asdict(r) for r in rows]}, f, sort_keys=False, width=120,
                           default_flow_style=None)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    p.add_argument("--choice-table", action="store_true", help="print the profile's expert_ffn_rates table instead")
    p.add_argument("--rates-yaml", default=None, help="with --choice-table: write the entries as a profile fragment")
    a = p.parse_args(argv)
    models = a.models.split(",")
    if a.choice_table:
        lines = choice_table(models, a.rates_yaml)
    else:
        lines = ["| model | T | experts touched | Triton grouped ms | TFLOP/s | weight GB/s | cuBLAS loop ms (max diff "
                 "/ max of ours, TFLOP/s) | grouped_mm ms, default chunks (same) | grouped_mm ms, 1 chunk (same) |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for name in models:
            lines += bench_model(name)
            torch.cuda.empty_cache()
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("# bench_grouped_ffn\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
