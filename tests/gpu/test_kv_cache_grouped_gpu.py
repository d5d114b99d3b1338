"""GroupedKVCache on CUDA (GPU-attention micro-batches): append from GPU tensors and per-group
``decode_attention`` equal one padded cache; CGOPipe with ragged prompts and GPU attention equals serial.
Run on a CUDA host: ``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model import layers as M  # noqa: E402
from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.kv_cache import GroupedKVCache, KVCache  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_grouped_cache_cuda_equals_padded(sliding_window):
    spec = MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=1,
                   num_heads=8, num_kv_heads=2, head_dim=16, num_experts=2, top_k=1, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=4096, sliding_window=sliding_window)
    prompts, gen = [40, 3, 91, 5, 41, 4, 200, 39], 3
    grouped = GroupedKVCache(spec, [p + gen for p in prompts], torch.float32, "cuda", max_groups=4)
    big = KVCache(spec, len(prompts), max(prompts) + gen, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for r, S in enumerate(prompts):
        k, v = torch.randn(S, 2, 16, generator=g), torch.randn(S, 2, 16, generator=g)
        grouped.write_prefill(0, r, k, v)
        big.write_prefill(0, r, k, v)
    grouped.lengths[:] = big.lengths[:] = torch.tensor(prompts)
    rows = torch.arange(len(prompts))
    for _ in range(gen - 1):
        q = torch.randn(len(prompts), 8, 16, generator=g)
        k, v = torch.randn(len(prompts), 2, 16, generator=g), torch.randn(len(prompts), 2, 16, generator=g)
        grouped.append(0, rows, k.cuda(), v.cuda())
        big.append(0, rows, k, v)
        K, V = big.view(0, None, big.max_len)
        ref = M.decode_attention(q, K, V, big.lengths + 1, sliding_window)
        out = grouped.attend(0, q.cuda(), grouped.lengths + 1, lambda a, b, c, n: M.decode_attention(a, b, c, n, sliding_window))
        assert out.is_cuda and (out.cpu() - ref).abs().max().item() < 1e-5
        grouped.lengths += 1
        big.lengths += 1


@pytest.mark.parametrize("gpu_attn", [0, 1, 2])
def test_cgopipe_cuda_grouped_kv_equals_serial(tiny_dir, gpu_attn):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (m,), generator=g).tolist() for m in (40, 3, 90, 5, 41, 7, 60, 12)]
    sp = DecodeSampling(max_new_tokens=10, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cuda").generate(prompts, sp)
    pol = Policy(mu=4, n=2, prefill_mu=2, n_gpu_attn=gpu_attn, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cuda", kv_groups=2)
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
