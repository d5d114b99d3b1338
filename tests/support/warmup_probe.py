"""Which Triton kernels compile in which phase of a CGOPipe run (tests/gpu/test_warmup_gpu.py runs it in a fresh
process: Triton compiles a kernel specialization once per process, so only a fresh process shows what a first run on a
user's machine compiles where).

    python -m tests.support.warmup_probe FAMILY on|off TMPDIR

FAMILY: ``mixtral`` (bf16, one GPU-attention micro-batch and one on the CPU), ``deepseek_v2`` (bf16, MLA, a dense first
layer) or ``gpt_oss`` (MXFP4 expert pages, sliding and full layers, sinks). Prints one JSON line: the phases' Triton
compile counts ``{"prefill": n, "decode": n, ...}`` and the kernels compiled in decode.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch


def _install_hook(ex, counts: Counter, names: list) -> None:
    """Count every Triton compile (an in-process cache miss: a new kernel specialization) by the executor's phase."""
    import triton

    def hook(*args, **kwargs):
        phase = getattr(ex, "phase", None) or "setup"
        counts[phase] += 1
        if phase == "decode":
            names.append(str(kwargs.get("repr", ""))[:120])
        return False  # compile as usual

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = hook
    else:
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = hook


def _executor(family: str, warm: bool, tmp: str):
    from lightning_moe.model.families import read_spec
    from lightning_moe.model.weights import dummy_weights, load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy
    from tests.support.tiny_configs import tiny_family_config

    if family == "gpt_oss":
        from tests.test_family_gpt_oss import _mxfp4_checkpoint, make_hf_gpt_oss

        path, model = make_hf_gpt_oss(f"{tmp}/ckpt")
        qdir, _ = _mxfp4_checkpoint(path, f"{tmp}/mxfp4", model)
        pol = Policy(mu=3, n=2, prefill_mu=2, resident_experts=0, dtype="bf16", weight_quant="bf16")
        w = load_checkpoint(qdir, torch.bfloat16, lazy_experts=True, packed_experts=True)
        return CGOPipeExecutor(w, pol, "cuda", ffn="triton", warmup=warm)
    cfg = tiny_family_config(family, vocab=64, hidden=96, inter=40 if family == "mixtral" else 32, dense_inter=64,
                             lora=32, head=16, rope=16)
    gpu_attn = 1 if family == "mixtral" else 0  # the MLA case warms CPU-attention micro-batches only
    pol = Policy(mu=3, n=2, prefill_mu=2, resident_experts=0, n_gpu_attn=gpu_attn, dtype="bf16", weight_quant="bf16")
    return CGOPipeExecutor(dummy_weights(read_spec(cfg), torch.bfloat16, seed=3, scale=0.1), pol, "cuda",
                           ffn="triton", warmup=warm)


def main(argv: list[str]) -> int:
    from lightning_moe.pipeline.sampling import DecodeSampling

    family, warm, tmp = argv[0], argv[1] == "on", argv[2]
    ex = _executor(family, warm, tmp)
    counts, names = Counter(), []
    _install_hook(ex, counts, names)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 12, 4)]
    try:
        out = ex.generate(prompts, DecodeSampling(max_new_tokens=6, temperature=1.0, stop_at_eos=False), seeds=list(range(6)))
    finally:
        ex.close()
    print(json.dumps({**counts, "warmup_seconds": ex.stats.warmup_seconds, "decode_kernels": names,
                      "tokens": [o for o, _ in out]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
