#!/usr/bin/env python3
"""The grouped expert-FFN kernel at each family's real shapes (a GPU benchmark, not a test).

For Mixtral-8x7B (8 experts of 14336, top-2, D 4096), Qwen3-30B-A3B (128 of 768, top-8, D 2048), OLMoE-1B-7B (64 of
1024, top-8) and Qwen1.5-MoE-A2.7B (60 of 1408, top-4), over token counts T from decode (8) to prefill (16384),
uniformly random routing: ms per call of our Triton grouped kernel (``kernels.fused_moe.fused_experts_triton``,
what CGOPipe runs), of a per-expert cuBLAS loop (torch matmuls over each expert's rows) and of
``torch._grouped_mm`` where the build has it; TFLOP/s (6 D F flops per (token, expert) pair) and the HBM rate of
the expert weights the call touches (each touched expert's 3 D F bf16 values read once). 128 narrow experts with
few tokens each is the regime where the weight reads, not the flops, bound the call.

Usage: ``python3 benchmarks/bench_grouped_ffn.py [--out FILE.md]`` on a CUDA host.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

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


def grouped_mm_ffn(x, w1t, w3t, w2t, topk_w, topk_ids):
    """torch._grouped_mm over the expert-sorted rows (offsets on the device, no host sync)."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat)
    offs = torch.cumsum(torch.bincount(flat, minlength=w1t.shape[0]), 0).to(torch.int32)
    xs = x[order // k]
    h = torch.nn.functional.silu(torch._grouped_mm(xs, w1t, offs=offs)) * torch._grouped_mm(xs, w3t, offs=offs)
    y = torch._grouped_mm(h, w2t, offs=offs).float() * topk_w.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, order // k, y).to(x.dtype)


def bench_model(name: str, fused_experts_triton) -> list[str]:
    """The table rows of one model's shapes, one per T (printed as they come)."""
    dev, rows = "cuda", []
    E, F, k, D = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(7)
    w1 = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16, generator=g) / D**0.5
    w3 = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16, generator=g) / D**0.5
    w2 = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16, generator=g) / F**0.5
    w1t, w3t, w2t = (w.transpose(1, 2) for w in (w1, w3, w2))  # [E, D, F] / [E, F, D] views for _grouped_mm
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
        gmm = "-"
        if hasattr(torch, "_grouped_mm"):
            try:
                gerr = (grouped_mm_ffn(x, w1t, w3t, w2t, w, ids).float() - ours).abs().max().item() / scale
                gmm = f"{cuda_ms(lambda: grouped_mm_ffn(x, w1t, w3t, w2t, w, ids)):.3f} ({gerr:.0e})"
            except (RuntimeError, TypeError) as e:  # the build or the strides may not take it
                gmm = f"n/a ({str(e).splitlines()[0][:40]})"
        rows.append(f"| {name} | {T} | {touched} of {E} | {ms:.3f} | {flops / ms / 1e9:.1f} | "
                    f"{wbytes / ms / 1e6:.0f} | {loop:.3f} ({err:.0e}) | {gmm} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    a = p.parse_args(argv)
    from lightning_moe.kernels.fused_moe import fused_experts_triton

    lines = ["| model | T | experts touched | Triton grouped ms | TFLOP/s | weight GB/s | cuBLAS loop ms (max diff / "
             "max of ours) | torch._grouped_mm ms (same) |", "|---|---|---|---|---|---|---|---|"]
    for name in a.models.split(","):
        lines += bench_model(name, fused_experts_triton)
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("# bench_grouped_ffn\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
