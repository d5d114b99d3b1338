#!/usr/bin/env python3
"""Token sampling (issue 43): the old per-row loop (fp32 logits to the host, softmax, top-p sort, one
``torch.Generator`` and ``torch.multinomial`` per row, as ``pipeline/serial.py``'s ``sample`` did) against
``kernels.sampling.sample_tokens`` (vectorized, an exponential race over hashed uniforms) and, on CUDA with triton,
``kernels.sampling.sample_tokens_triton`` (one launch; the path ``pipeline.sampling.sample`` takes there), best of
``--repeats`` milliseconds per call (the paths alternating, so on a loaded host both see the same quiet windows), for each B in ``--batch`` at
vocabulary ``--vocab`` on ``--device`` (a CPU benchmark by default; on CUDA the old path includes its device-to-host
copy, the new one only the B token ids' copy).

    python3 benchmarks/bench_sampler.py [--batch 80,512] [--vocab 32000] [--device cpu] [--repeats 5] [--threads 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_moe.kernels.fused_moe import triton_available  # noqa: E402
from lightning_moe.kernels.sampling import keys_from_seeds, sample_tokens, sample_tokens_triton  # noqa: E402


def old_sample(logits: torch.Tensor, temperature: float, top_p: float, seeds: list[int]) -> torch.Tensor:
    """The pre-issue-43 sampler: host softmax, optional top-p sort, a generator and a multinomial draw per row."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    for b in range(probs.shape[0]):
        out[b] = torch.multinomial(probs[b], 1, generator=torch.Generator().manual_seed(seeds[b]))[0]
    return out


def best_ms(fns: list, repeats: int, device: str) -> list[float]:
    """Best wall milliseconds of each ``fn()`` over ``repeats`` rounds after one warm-up; the functions alternate
    within a round, so on a loaded host each sees the same quiet windows."""
    best = [float("inf")] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="80,512", help="comma-separated batch sizes B")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size V")
    ap.add_argument("--device", default="cpu", help="where the logits live")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per case (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"device {a.device}, V {a.vocab}, threads {torch.get_num_threads()}; ms per call, best of {a.repeats}")
    tri = a.device.startswith("cuda") and triton_available()
    print(f"{'B':>6} {'case':<28} {'old loop':>10} {'vectorized':>11} {'triton':>8} {'speed-up':>9}")
    for B in (int(b) for b in a.batch.split(",")):
        logits = (torch.randn(B, a.vocab, generator=g) * 2).to(a.device)
        seeds = [int(s) for s in torch.randint(0, 2**62, (B,), generator=g)]
        for name, kw in [("temperature 1", {}), ("top_p 0.9", {"top_p": 0.9}), ("top_k 50", {"top_k": 50}),
                         ("min_p 0.05", {"min_p": 0.05}), ("top_k 50 top_p 0.9 min_p .05",
                                                            {"top_k": 50, "top_p": 0.9, "min_p": 0.05})]:
            fns = {"vec": lambda: sample_tokens(logits, 1.0, keys=keys_from_seeds(seeds), **kw).cpu()}
            if tri:  # the path pipeline.sampling.sample takes on CUDA: one launch, the keys copied over
                fns["tri"] = lambda: sample_tokens_triton(logits, 1.0, keys=keys_from_seeds(seeds).to(a.device),
                                                          **kw).cpu()
            if set(kw) <= {"top_p"}:
                fns["old"] = lambda: old_sample(logits, 1.0, kw.get("top_p", 1.0), seeds)
            t = dict(zip(fns, best_ms(list(fns.values()), a.repeats, a.device)))
            best = min(t.get("tri", t["vec"]), t["vec"])
            cols = [f"{t[k]:.1f}" if k in t else "-" for k in ("old", "vec", "tri")]
            up = f"{t['old'] / best:.1f}x" if "old" in t else "-"
            print(f"{B:>6} {name:<28} {cols[0]:>10} {cols[1]:>11} {cols[2]:>8} {up:>9}")

if __name__ == "__main__":
    main()
