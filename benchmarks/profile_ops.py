"""Operator profile of CGOPipe prefill + decode (torch.profiler): where the GPU and the host spend time.

Run on a CUDA host: ``python benchmarks/profile_ops.py --quant int4 --layers 2 --N 256``. Prints the top
operators by CUDA time and by host (self CPU) time. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import bench_cgopipe as B
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.serial import SamplingParams
    from lightning_moe.policy.policy import Policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--N", type=int, default=256)
    ap.add_argument("--resident", type=int, default=0)
    ap.add_argument("--gpu-attn", type=int, default=0)
    ap.add_argument("--gen", type=int, default=4)
    a = ap.parse_args()
    spec = B.spec_for(B.Case("p", a.layers))
    w = B.shared_dummy_weights(spec, quant=a.quant)
    pol = Policy(mu=a.N, n=1, prefill_mu=32, resident_experts=a.resident, n_gpu_attn=a.gpu_attn,
                 weight_quant=a.quant, dtype="bf16")
    ex = CGOPipeExecutor(w, pol, "cuda", torch.bfloat16, ffn="triton")
    prompts = B.fill(B.mtbench_prompts(), a.N)
    sp = SamplingParams(max_new_tokens=a.gen, stop_at_eos=False)
    ex.generate(prompts, sp)  # warm-up (Triton compilation, allocator)
    ex.stats.__init__()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        ex.generate(prompts, sp)
    s = ex.stats
    print(f"{a.quant} layers={a.layers} N={a.N}: prefill {s.prefill_seconds:.2f} s ({s.prefill_tokens / s.prefill_seconds:.0f} tok/s), "
          f"decode {s.decode_seconds:.2f} s for {s.decode_steps} steps; stages {dict((k, round(v, 3)) for k, v in s.extra.items())}")
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    ex.close()


if __name__ == "__main__":
    main()
