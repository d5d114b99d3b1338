"""The decode layer's host work (benchmarks/host_ops.py): the per-step caches of the grouped KV cache, the one-scatter
append of GPU-attention micro-batches, and bounds on the ATen ops and host syncs of a decode layer."""

import argparse
import types

import pytest
import torch

from benchmarks.host_ops import measure
from lightning_moe.kernels.cpu_attention import decode_attention_torch, decode_attention_torch_masked, decode_mask
from lightning_moe.model.families import families
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline import kv_cache
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


@pytest.mark.parametrize("prompts,groups", [([6], 1), ([40, 3, 91, 5, 41, 4, 20, 39], 3),
                                             ([12, 1, 33, 2, 34, 9, 1, 60, 5], 8)])
def test_latent_append_all_equals_append_per_group(prompts, groups):
    """MLA: one scatter of [c, k_pe] into the layer's flat latent array (the groups are views of it) writes exactly
    what append (per group) writes, and what a write into separate per-group tensors (the layout before) writes, bit
    for bit with the caches NaN first, every layer and step, up to each group's longest row filling its last
    position; then a full row raises (append_all and append alike)."""
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache
    from lightning_moe.pipeline.profiler import _host_probe_spec

    spec, gen = _host_probe_spec(2, "mla"), 3
    a, b = (GroupedLatentKVCache(spec, [p + gen for p in prompts], torch.bfloat16, max_groups=groups) for _ in range(2))
    for c in (a, b):
        c.lengths[:] = torch.tensor(prompts)
        for f in c.lat_flat:
            f.fill_(float("nan"))
    ref = [[torch.full(t.shape, float("nan"), dtype=torch.bfloat16) for t in layer] for layer in a.lat]
    B, g = len(prompts), torch.Generator().manual_seed(len(prompts))
    for _ in range(gen):
        for layer in range(2):
            lat, kpe = torch.randn(B, 64, generator=g).bfloat16(), torch.randn(B, 16, generator=g).bfloat16()
            a.append(layer, torch.arange(B), lat, kpe)
            b.append_all(layer, lat, kpe, b.lengths.clone())
            for r in range(B):
                ref[layer][int(a.group_of[r])][int(a.slot_of[r]), int(a.lengths[r])] = torch.cat([lat[r], kpe[r]])
        a.lengths += 1
        b.lengths += 1
    bits = lambda t: t.view(torch.int16)  # noqa: E731  (NaN == NaN)
    for layer in range(2):
        for x, y, z in zip(a.lat[layer], b.lat[layer], ref[layer]):
            assert torch.equal(bits(x), bits(z)) and torch.equal(bits(y), bits(z))
    assert all(bool((b.lengths[r] == S).any()) for r, S in zip(b.rows, b.sizes))  # each group's longest row is full
    zeros = torch.zeros(B, 64).bfloat16(), torch.zeros(B, 16).bfloat16()
    with pytest.raises(ValueError, match="KV cache full"):
        b.append_all(0, *zeros, b.lengths.clone())
    with pytest.raises(ValueError, match="KV cache full"):
        a.append(0, torch.arange(B), *zeros)


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


def _old_attend(cache, layer, q, new_lengths, fn):
    """GroupedKVCache.attend as it was before the step masks and cut views (the reference): per group, q's rows
    gathered, the cache sliced, the group's lengths to the device, its output put back by index."""
    from lightning_moe.pipeline.cpu_attention import bucket_len

    out = None
    for g, rows in enumerate(cache.rows):
        n = new_lengths[rows]
        upto = bucket_len(int(n.max()), cache.sizes[g])
        o = fn(q.index_select(0, rows), cache.k[layer][g][:, :, :upto], cache.v[layer][g][:, :, :upto], n)
        out = torch.empty((q.shape[0],) + tuple(o.shape[1:]), dtype=o.dtype) if out is None else out
        out[rows] = o
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_attend_masked_equals_per_group_decode_attention(window, sinks, monkeypatch):
    """attend_masked (masks made once per step and window, cut views reused while upto holds, outputs put back by one
    gather) gives, bit for bit in bf16, the family's decode_attention per length group as attend ran it before,
    every layer and step, across an upto bucket change and a reset slot; the masks are made once per step."""
    prompts = [40, 3, 91, 5, 41, 4, 20, 15]  # row 7 crosses a 16-position bucket at step 1
    cache = GroupedKVCache(_spec(), [p + 6 for p in prompts], torch.bfloat16, max_groups=3)
    cache.lengths[:] = torch.tensor(prompts)
    g = torch.Generator().manual_seed(2)
    for layer in range(2):
        for K in cache.k[layer] + cache.v[layer]:
            K.copy_(torch.randn(K.shape, generator=g))
    sk = torch.randn(8, generator=g) if sinks else None
    masked = lambda qg, K, V, m: decode_attention_torch_masked(qg, K, V, m, sk)  # noqa: E731
    made = []  # the windows of the masks made
    monkeypatch.setattr(kv_cache, "decode_mask", lambda n, S, sw: made.append(sw) or decode_mask(n, S, sw))
    for step in range(3):
        for layer in range(2):
            q = torch.randn(len(prompts), 8, 16, generator=g).bfloat16()
            ref = _old_attend(cache, layer, q, cache.lengths + 1,
                              lambda qg, K, V, n: decode_attention_torch(qg, K, V, n, window, sk))
            assert torch.equal(cache.attend_masked(layer, q, masked, window), ref), (step, layer)
        assert made == [window] * cache.num_groups * (step + 1)  # once per step and group, not per layer
        cache.lengths[2] = 0 if step == 1 else cache.lengths[2]  # a reset slot (refill.reset_slots)
        cache.lengths += 1


def test_family_decode_attention_masked_equals_decode_attention():
    """Every GQA family's decode_attention_masked with kernels.cpu_attention.decode_mask is its decode_attention, bit
    for bit in bf16 (the GPU-attention path runs the masked one)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 16, generator=g).bfloat16()
    K, V = (torch.randn(5, 2, 32, 16, generator=g).bfloat16() for _ in range(2))
    n = torch.tensor([1, 7, 32, 20, 16])
    lw = types.SimpleNamespace(sinks=torch.randn(8, generator=g).bfloat16())
    checked = 0
    for fam in families():
        if fam.attention == "mla":
            continue
        for sw in (None, 6):
            m = decode_mask(n, 32, sw)  # [5, 1, 1, 32]
            if fam.attention == "gqa_sinks":
                a, b = fam.decode_attention(lw, q, K, V, n, sw), fam.decode_attention_masked(lw, q, K, V, m)
            else:
                a, b = fam.decode_attention(q, K, V, n, sw), fam.decode_attention_masked(q, K, V, m)
            assert torch.equal(a, b), (fam.name, sw)
            checked += 1
    assert checked >= 2 * 5  # mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss


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


def test_mla_gpu_attention_path_append_all_equals_append(monkeypatch):
    """CGOPipe's MLA GPU-attention micro-batch (on the CPU device by setting ``on_gpu``) decodes the same tokens with
    its one-scatter append as with the per-group append."""
    from lightning_moe.model.weights import dummy_weights
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache
    from lightning_moe.pipeline.profiler import _host_probe_spec

    spec = _host_probe_spec(2, "mla")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, spec.vocab_size, (m,), generator=g).tolist() for m in (40, 3, 30, 5, 21, 7, 60)]
    appended = []

    def run():
        pol = Policy(mu=4, n=2, prefill_mu=2, resident_experts=2, dtype="fp32", weight_quant="fp32")
        ex = CGOPipeExecutor(dummy_weights(spec, torch.float32, scale=0.2), pol, "cpu")  # (an executor takes its weights)
        orig = ex._micro_batches

        def gpu_first(*a, **k):
            mbs = orig(*a, **k)
            mbs[0].on_gpu = True
            return mbs

        ex._micro_batches = gpu_first
        out = ex.generate(prompts, DecodeSampling(max_new_tokens=6, stop_at_eos=False))
        ex.close()
        return [o for o, _ in out]

    all_ = GroupedLatentKVCache.append_all
    monkeypatch.setattr(GroupedLatentKVCache, "append_all", lambda self, *a: appended.append(1) or all_(self, *a))
    new = run()
    assert len(appended) == 2 * 5  # 2 layers x 5 decode steps, one call each
    monkeypatch.setattr(GroupedLatentKVCache, "append_all",
                        lambda self, layer, c, k_pe, pos: self.append(layer, self._all, c, k_pe))  # the per-group one
    assert run() == new


def _host_ops(n_gpu: int, count_step: int = 1, mla: bool = False) -> dict:
    args = argparse.Namespace(layers=2, mu=16, steps=1, ffn="grouped_mm", probe="mla" if mla else "generic", profile=False, top=5,
                              count_step=count_step)
    return measure(args, n_gpu)


@pytest.mark.parametrize("n_gpu", [0, 2])
def test_decode_layer_ops_and_no_device_sync(n_gpu):
    """The host-probe model's decode layer (2 layers, 2 micro-batches of 16 rows, 8 KV length groups each, the sync-free
    grouped expert FFN), its second decode step (steady state): no host read of a device tensor, and at most this many
    ATen ops per micro-batch and layer in its parts (torch 2.13 counts; before: the CPU path's group lengths per layer,
    17.5 attention ops; the GPU path's append and lengths copies per length group and layer, 294, then its masks and
    cache slices per length group and layer and its outputs put back per group, 206 (139 after); the expert FFN's
    local ids built from the routing per call, 237)."""
    res = _host_ops(n_gpu, count_step=2)
    assert res["device_syncs_per_layer"] == 0, res["sync_sites"]
    ops = res["ops_by_region"]
    assert ops["attention"] <= (16 if n_gpu == 0 else 150), ops
    assert ops["expert_ffn"] <= 232, ops


def test_mla_gpu_attention_path_ops():
    """The DeepSeek-V2-shaped probe's GPU-attention micro-batches (2 layers, 16 rows, 8 length groups), second decode
    step: no host read of a device tensor, and at most this many attention ops per micro-batch and layer (before: the
    latent append per length group, with a host read of each group's positions, 234.5)."""
    res = _host_ops(2, count_step=2, mla=True)
    assert res["device_syncs_per_layer"] == 0, res["sync_sites"]
    assert res["ops_by_region"]["attention"] <= 180, res["ops_by_region"]
