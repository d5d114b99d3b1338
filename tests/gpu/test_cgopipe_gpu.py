"""CGOPipe on CUDA: tokens equal the serial executor's (fp32 and bf16 greedy, ragged batch), and the
GPU memory cap holds (torch.cuda.max_memory_allocated stays under it). Run on a CUDA host:
``python -m pytest tests/gpu -m gpu``."""

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.model.weights import dummy_weights, load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.serial import SamplingParams, SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402

DT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _prompts(n, seed=0, vocab=32000, maxlen=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, maxlen, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mu,n,resident,gpu_attn", [(3, 4, 0, 0), (3, 4, 3, 1), (11, 1, 0, 0)])
def test_cgopipe_cuda_equals_serial(tiny_dir, dtype, mu, n, resident, gpu_attn):
    prompts = _prompts(11)
    sp = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, dtype), "cuda").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=resident, n_gpu_attn=gpu_attn, dtype=DT[dtype], weight_quant=DT[dtype])
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, dtype), pol, "cuda")
    out = ex.generate(prompts, sp)
    ex.close()
    mism = [(i, a, b) for i, ((a, _), (b, _)) in enumerate(zip(out, ref)) if a != b]
    assert not mism, f"{len(mism)} of {len(prompts)} sequences differ, first: {mism[0]}"


def test_cgopipe_memory_cap_holds():
    """A model whose experts (0.70 GB bf16) exceed a 0.5 GiB cap runs under the cap, pages streaming."""
    spec = MoESpec(name="mid", model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                   num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128, num_experts=8, top_k=2,
                   rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=4096)
    w = dummy_weights(spec, torch.bfloat16, seed=0)
    expert_bytes = w.expert_bytes
    assert expert_bytes > 2**29
    cap = 2**29  # 0.5 GiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pol = Policy(mu=16, n=4, prefill_mu=16, resident_experts=0, dtype="bf16", weight_quant="bf16")
    ex = CGOPipeExecutor(w, pol, "cuda")
    out = ex.generate(_prompts(64, seed=1, maxlen=60), SamplingParams(max_new_tokens=8, stop_at_eos=False))
    ex.close()
    peak = torch.cuda.max_memory_allocated() - base
    assert all(len(o) == 8 for o, _ in out)
    assert peak < cap, f"peak {peak / 2**20:.0f} MiB >= cap {cap / 2**20:.0f} MiB"
    # every layer visit (prefill + 7 decode steps) streams all experts: 4 layers > 2 buffers
    assert ex.stats.h2d_bytes >= 8 * expert_bytes
