"""gpt-oss's MXFP4 expert FFN (kernels.mxfp4.fused_experts_mxfp4_triton) at one layer's shape, over tile configs and
token counts, against the bf16 grouped Triton kernel (kernels.fused_moe.fused_experts_triton) on dense weights of the
same shape: the same FLOPs (2 T k 3 D F), the rate issue 44 compares it with (a GPU benchmark, not a test).

    python benchmarks/bench_mxfp4_ffn.py [--experts 128] [--top-k 4] [--hidden 2880] [--tokens 80,8192]

Prints, per T: the default config's ms and TFLOP/s, every config of the sweep, and the bf16 kernel's. The pages are
random bytes (E2M1 codes, scales 118..126): the rates do not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_quant_ffn import cuda_ms  # noqa: E402

# (block_m, block_n, block_k, warps, stages), most promising first: prefill (many pairs per expert), decode (few)
PREFILL_SWEEP = [(128, 128, 128, 8, 3), (128, 128, 128, 4, 3), (128, 128, 128, 8, 4), (128, 128, 128, 8, 2),
                 (256, 128, 128, 8, 3), (128, 256, 128, 8, 2), (128, 128, 256, 8, 2), (64, 128, 128, 8, 3),
                 (128, 64, 128, 4, 3), (256, 64, 128, 8, 3), (64, 64, 128, 4, 3), (128, 128, 64, 8, 4),
                 (64, 256, 128, 8, 3), (128, 64, 64, 4, 3)]
# (PAIRED_NIBBLES, DOT_SCALED, JOINT_GATE_UP)
MODES = {"one column": (False, False, False), "paired": (True, False, False), "scaled": (True, True, False),
         "scaled joint": (True, True, True)}
DECODE_SWEEP = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 64, 64, 4, 3), (16, 32, 128, 2, 4),
                (16, 64, 256, 4, 2), (32, 64, 64, 4, 3), (16, 128, 64, 4, 3), (64, 64, 128, 4, 3)]


def _pages(E: int, D: int, F: int, dev: str):
    """Random MXFP4 pages of E experts (gate_up [2F, D], down [D, F]) and their layout."""
    from lightning_moe.kernels.mxfp4 import pack_mxfp4_pages

    g = torch.Generator(device=dev).manual_seed(5)

    def blocks(R, C):
        return torch.randint(0, 256, (E, R, C // 32, 16), device=dev, generator=g, dtype=torch.uint8)

    def scales(R, C):
        return torch.randint(118, 127, (E, R, C // 32), device=dev, generator=g, dtype=torch.uint8)

    bias = torch.randn(E, 2 * F, device=dev, generator=g, dtype=torch.bfloat16), torch.randn(E, D, device=dev, generator=g, dtype=torch.bfloat16)
    return pack_mxfp4_pages(blocks(2 * F, D), scales(2 * F, D), bias[0], blocks(D, F), scales(D, F), bias[1])


def main() -> None:
    from lightning_moe.kernels.fused_moe import MoEKernelConfig, fused_experts_triton
    from lightning_moe.kernels import mxfp4
    from lightning_moe.kernels.mxfp4 import fused_experts_mxfp4_triton, mxfp4_kernel_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--tokens", default="80,8192")
    ap.add_argument("--seconds", type=float, default=120.0, help="sweep time per token count")
    a = ap.parse_args()
    dev, E, k, D = "cuda", a.experts, a.top_k, a.hidden
    F = D
    pages, lay = _pages(E, D, F, dev)
    g = torch.Generator(device=dev).manual_seed(7)
    w1 = torch.randn(E, F, D, device=dev, generator=g, dtype=torch.bfloat16) / D**0.5
    w3 = torch.randn(E, F, D, device=dev, generator=g, dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, F, device=dev, generator=g, dtype=torch.bfloat16) / F**0.5
    print(f"{torch.cuda.get_device_name(0)}: E {E}, top-{k}, D = F = {D}")
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
        gc = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=gc)[:k] for _ in range(T)]).to(dev)
        wts = torch.rand(T, k, generator=gc).softmax(-1).to(dev)
        flop = 2 * T * k * 3 * D * F

        def mx(cfg, mode):
            mxfp4.PAIRED_NIBBLES, mxfp4.DOT_SCALED, mxfp4.JOINT_GATE_UP = MODES[mode]
            return cuda_ms(lambda: fused_experts_mxfp4_triton(x, pages, lay, wts, ids, limit=7.0, alpha=1.702,
                                                             config=cfg, validate=False), reps=3)

        def line(name, t):
            return f"{name}: {t:.3f} ms ({flop / t / 1e9:.1f} TFLOP/s, {tb / t:.2f} of bf16)"

        tb = cuda_ms(lambda: fused_experts_triton(x, w1, w3, w2, wts, ids, validate=False), reps=3)
        d = mxfp4_kernel_config(T * k, E)
        print(f"T {T}: bf16 grouped {tb:.3f} ms ({flop / tb / 1e9:.1f} TFLOP/s); MXFP4 default "
              f"{d.block_m}x{d.block_n}x{d.block_k} w{d.num_warps} s{d.num_stages}")
        for mode in MODES:
            print("  " + line(f"default, {mode}", mx(None, mode)))
        rows, t0 = [], time.perf_counter()
        for bm, bn, bk, w, s in (PREFILL_SWEEP if T * k / E > 16 else DECODE_SWEEP):
            if time.perf_counter() - t0 > a.seconds:
                print("  (sweep time spent)")
                break
            for mode in ("scaled", "scaled joint"):
                try:
                    t = mx(MoEKernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s), mode)
                except Exception as e:  # out of shared memory / registers for this tile
                    print(f"  {bm}x{bn}x{bk} w{w} s{s} {mode}: {type(e).__name__}")
                    continue
                rows.append((t, f"{bm}x{bn}x{bk} w{w} s{s} {mode}"))
        for t, name in sorted(rows)[:12]:
            print("  " + line(name, t))
        mxfp4.PAIRED_NIBBLES, mxfp4.DOT_SCALED, mxfp4.JOINT_GATE_UP = MODES["scaled"]


if __name__ == "__main__":
    main()
