"""Two micro-batches of the same rows for comparing CGOPipe's attention placements on the CPU: one built as a
GPU-attention micro-batch would be on CUDA (its cache in the CPU's memory here) and one CPU-attention micro-batch,
their caches filled with the same random prompt entries."""

import torch

PROMPTS = [[3] * n for n in (5, 17, 2, 9)]  # four rows of awkward lengths, two KV length groups


def gpu_and_cpu_micro_batch(ex, kernel: str, shapes: tuple, g: torch.Generator, prompts=PROMPTS):
    """(gpu_mb, cpu_mb) of ``prompts`` from CGOPipe executor ``ex`` (device cpu, policy n_gpu_attn >= 1), the executor's
    GPU-attention kernel set to ``kernel`` ("torch" / "triton"), 4 tokens of room per row; every layer's prompt
    positions written alike in both caches: per token two tensors of ``shapes`` (k / v [Hkv, hd], or MLA's c [Dl] /
    k_pe [rd]) drawn from ``g``."""
    ex.attention.gpu_attention = kernel
    ex.cuda = True  # the first micro-batch is built as a GPU-attention one
    gpu_mb = ex._micro_batches(prompts, 4, True, len(prompts), kv_groups=2)[0]
    ex.cuda = False
    cpu_mb = ex._micro_batches(prompts, 4, True, len(prompts), kv_groups=2)[0]
    assert gpu_mb.on_gpu and not cpu_mb.on_gpu
    for l in range(ex.spec.num_layers):
        for j, r in enumerate(gpu_mb.rows):
            a, b = (torch.randn(len(prompts[r]), *s, generator=g) for s in shapes)
            gpu_mb.kv.write_prefill(l, j, a, b)
            cpu_mb.kv.write_prefill(l, j, a, b)
    return gpu_mb, cpu_mb
