"""The decode layer's host work (benchmarks/host_ops.py): the per-step caches of the grouped KV cache, the one-scatter
append of GPU-attention micro-batches, and bounds on the ATen ops and host syncs of a decode layer."""

import argparse

import pytest
import torch

from benchmarks.host_ops import measure
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.kv_cache import GroupedKVCache
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy


def _spec() -> MoESpec:
    return MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=16, num_experts=2, top_k=1, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=4096)


def _cache(prompts, gen=6, groups=3):
    cache = GroupedKVCache(_spec(), [p + gen for p in prompts], torch.float32, max_groups=groups)
    cache.lengths[:] = torch.tensor(prompts)
    return cache


def test_append_all_equals_append_per_group():
    """One scatter per K and V at the device positions writes exactly what append (per group) writes, every layer and
    step; a full row raises."""
    prompts = [40, 3, 91, 5, 41, 4, 20, 39]  # caller order is not length order; 3 groups
    a, b = _cache(prompts), _cache(prompts)
    assert a.num_groups == 3
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for layer in range(2):
            k, v = (torch.randn(len(prompts), 2, 16, generator=g) for _ in range(2))
            a.append(layer, torch.arange(len(prompts)), k, v)
            b.append_all(layer, k, v, b.lengths.clone())
        a.lengths += 1
        b.lengths += 1
    for layer in range(2):
        assert torch.equal(a.k_flat[layer], b.k_flat[layer]) and torch.equal(a.v_flat[layer], b.v_flat[layer])
    full = _cache([4], gen=1, groups=1)
    full.lengths[:] = 5
    with pytest.raises(ValueError, match="KV cache full"):
        full.append_all(0, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), full.lengths.clone())


def test_per_step_plans_follow_the_lengths():
    """attend's per-group lengths and windows, and the native kernels' group lengths, are made once per step and
    reused across layers, but never after the lengths changed (a stale plan attends the old positions)."""
    prompts = [40, 3, 91, 5, 41, 4, 20, 39]
    cache = _cache(prompts)
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        for K in cache.k[layer] + cache.v[layer]:
            K.copy_(torch.randn(K.shape, generator=g))
    q = torch.randn(len(prompts), 8, 16, generator=g)
    fn = lambda qg, K, V, n: torch.cat([(K.sum((1, 3)) * (torch.arange(K.shape[2]) < n[:, None])).sum(1, keepdim=True),  # noqa: E731
                                        n[:, None].float(), torch.full_like(n[:, None], K.shape[2]).float()], 1)
    for step in range(3):
        for layer in range(2):
            got = cache.attend(layer, q, cache.lengths + 1, fn)
            cache._attend_plan = None  # what a fresh plan gives
            assert torch.equal(got, cache.attend(layer, q, cache.lengths + 1, fn)), (step, layer)
            assert [t.tolist() for t in cache.group_lengths()] == [cache.lengths[r].tolist() for r in cache.rows]
        cache.lengths[step] = 0 if step == 1 else cache.lengths[step]  # a reset slot (refill.reset_slots)
        cache.lengths += 1


@pytest.mark.parametrize("kv_groups", [1, 3])
def test_gpu_attention_path_on_cpu_equals_serial(tiny_dir, kv_groups):
    """CGOPipe's GPU-attention micro-batches (append_all, the per-step attend plan, the family's torch attention per
    length group), run on the CPU device by setting ``on_gpu``, give the serial executor's tokens."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (m,), generator=g).tolist() for m in (40, 3, 90, 5, 41, 7, 60)]
    sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    pol = Policy(mu=4, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", kv_groups=kv_groups)
    orig = ex._micro_batches

    def gpu_first(*a, **k):
        mbs = orig(*a, **k)
        mbs[0].on_gpu = True
        return mbs

    ex._micro_batches = gpu_first
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]


def _host_ops(n_gpu: int) -> dict:
    args = argparse.Namespace(layers=2, mu=16, steps=1, ffn="grouped_mm", mla=False, profile=False, top=5)
    return measure(args, n_gpu)


@pytest.mark.parametrize("n_gpu", [0, 2])
def test_decode_layer_ops_and_no_device_sync(n_gpu):
    """The host-probe model's decode layer (2 layers, 2 micro-batches of 16 rows, 8 KV length groups each, the sync-free
    grouped expert FFN): no host read of a device tensor, and at most this many ATen ops per micro-batch and layer in
    its parts (torch 2.13 counts; before: the CPU path's group lengths per layer, 17.5 attention ops; the GPU path's
    append and lengths copies per length group and layer, 294; the expert FFN's local ids built from the routing
    per call, 237)."""
    res = _host_ops(n_gpu)
    assert res["device_syncs_per_layer"] == 0, res["sync_sites"]
    ops = res["ops_by_region"]
    assert ops["attention"] <= (16 if n_gpu == 0 else 220), ops
    assert ops["expert_ffn"] <= 232, ops
