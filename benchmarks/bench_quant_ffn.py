"""Expert FFN of one Mixtral-8x7B MoE layer from int4 pages: fused in-register kernel vs dequantize + bf16
grouped kernel vs the bf16 grouped kernel on dense weights, over token counts (a GPU benchmark, not a test).

Run on a CUDA host: ``python benchmarks/bench_quant_ffn.py``. Prints ms per call for T = 8 .. 4096 tokens
(top-2 of 8 experts; the dequant path pays its dequantization on every call here, CGOPipe pays it once per
layer visit) and the dequantization kernel's GB/s (packed bytes read + bf16 bytes written). These numbers chose
the dequantize + dense path at every T (kernels.quant's default mode "dequant", what CGOPipe runs; a run where the
fused kernel wins at small T would call for a crossover in T * k / E again) and check the HRM's dequantization time
(policy/hrm.py assumes the GPU's HBM bandwidth). Append the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import torch


def cuda_ms(fn, reps: int = 5) -> float:
    """Mean milliseconds per call of ``fn`` over ``reps`` calls after one warm-up call (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main(dequant_only: bool = False) -> None:
    """Print the dequantization rate, then (unless ``dequant_only``) the FFN table."""
    from lightning_moe.kernels.fused_moe import fused_experts_triton
    from lightning_moe.kernels.quant import (dense_expert_scratch, dequantize_pages_triton, fused_experts_paged_triton,
                                             pack_expert_pages)

    dev, E, D, Fd, k = "cuda", 8, 4096, 14336, 2
    g = torch.Generator(device=dev).manual_seed(213)
    w1 = torch.randn(E, Fd, D, device=dev, generator=g, dtype=torch.bfloat16) / D**0.5
    w3 = torch.randn(E, Fd, D, device=dev, generator=g, dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, Fd, device=dev, generator=g, dtype=torch.bfloat16) / Fd**0.5
    pages, lay = pack_expert_pages(w1, w3, w2, "int4")
    scratch = dense_expert_scratch(E, D, Fd, torch.bfloat16, dev)
    t_deq = cuda_ms(lambda: dequantize_pages_triton(pages, lay, torch.bfloat16, out=scratch))
    moved = E * lay.page_bytes + sum(t.numel() * t.element_size() for t in scratch)
    print(f"{torch.cuda.get_device_name(0)}: dequantize {E} experts: {t_deq:.3f} ms, {moved / t_deq / 1e6:.0f} GB/s")
    if dequant_only:
        return
    print("| T | pairs/expert | fused int4 ms | dequant + bf16 ms | bf16 dense ms |")
    print("|---|---|---|---|---|")
    for T in (8, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
        gc = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=gc)[:k] for _ in range(T)]).to(dev)
        wts = torch.rand(T, k, generator=gc).softmax(-1).to(dev)
        tf = cuda_ms(lambda: fused_experts_paged_triton(x, pages, lay, wts, ids, mode="fused", validate=False), reps=3)
        td = cuda_ms(lambda: fused_experts_paged_triton(x, pages, lay, wts, ids, mode="dequant", scratch=scratch,
                                                         validate=False), reps=3)
        tb = cuda_ms(lambda: fused_experts_triton(x, w1, w3, w2, wts, ids, validate=False), reps=3)
        print(f"| {T} | {T * k / E:.1f} | {tf:.3f} | {td:.3f} | {tb:.3f} |")


if __name__ == "__main__":
    import sys

    main(dequant_only="--dequant-only" in sys.argv[1:])
