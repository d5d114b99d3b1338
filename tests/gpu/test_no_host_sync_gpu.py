"""The attention paths CGOPipe runs on the GPU never make the host wait for the GPU (written in session 5,
run with the rest of tests/gpu on a CUDA host). A blocking H2D copy of a pageable host tensor synchronizes
the stream; prefill_attention_packed, decode_attention and GroupedKVCache.append / attend copy only small host
index tensors, now with non_blocking=True, and gather packed rows with a host-built index instead of boolean
indexing. torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call inside the block.
Run on a CUDA host: ``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model import layers as M  # noqa: E402
from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.pipeline.kv_cache import GroupedKVCache  # noqa: E402


def _spec():
    return MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=1,
                   num_heads=8, num_kv_heads=2, head_dim=16, num_experts=2, top_k=1, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=4096)


def test_attention_paths_do_not_synchronize():
    g = torch.Generator().manual_seed(0)
    lens = [40, 3, 91, 5, 41]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 16, generator=g).cuda() for h in (8, 2, 2))
    ends = torch.tensor(lens).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, lens)]
    kv = GroupedKVCache(_spec(), [n + 4 for n in lens], torch.float32, "cuda", max_groups=3)
    kv.lengths[:] = torch.tensor(lens)
    qd, kd, vd = (torch.randn(len(lens), h, 16, generator=g).cuda() for h in (8, 2, 2))
    rows = torch.arange(len(lens))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = M.prefill_attention_packed(q, k, v, spans)
        kv.append(0, rows, kd, vd)
        out = kv.attend(0, qd, kv.lengths + 1, lambda qg, K, V, n: M.decode_attention(qg, K, V, n))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = torch.cat([M.prefill_attention(q[s:e], k[s:e], v[s:e]) for s, e in spans])
    assert ((packed - ref).norm() / ref.norm()).item() < 1e-5
    assert out.shape == (len(lens), 8 * 16) and torch.isfinite(out).all()


def test_gpu_attention_micro_batch_steps_do_not_synchronize():
    """CGOPipe's GPU-attention micro-batch after its first decode step (session 39's paths): GroupedKVCache.append_all
    + attend_masked with the family's decode_attention_masked (GQA; a sliding window and none, as gpt-oss alternates)
    and GroupedLatentKVCache.append_all + attend with the family's latent attention (MLA) make no host sync. The
    first step makes its one-time device copies (row order, row bases) and is outside the check; its outputs match
    attend's per-group path."""
    from lightning_moe.model.families import family_of
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache
    from lightning_moe.pipeline.profiler import _host_probe_spec

    g = torch.Generator().manual_seed(1)
    lens = [40, 3, 91, 5, 41, 17]
    B = len(lens)
    kv = GroupedKVCache(_spec(), [n + 8 for n in lens], torch.float32, "cuda", max_groups=3)
    mla_spec = _host_probe_spec(1, "mla")
    lat = GroupedLatentKVCache(mla_spec, [n + 8 for n in lens], torch.float32, "cuda", max_groups=3)
    fam = family_of(mla_spec)
    W = mla_spec.kv_lora_rank + mla_spec.qk_rope_head_dim
    for c in (kv, lat):
        c.lengths[:] = torch.tensor(lens)
    pos = torch.tensor(lens).cuda()

    def step(window):
        qd, kd, vd = (torch.randn(B, h, 16, generator=g).cuda() for h in (8, 2, 2))
        kv.append_all(0, kd, vd, pos)
        out = kv.attend_masked(0, qd, M.decode_attention_masked, window)
        ql = torch.randn(B, mla_spec.num_heads, W, generator=g).cuda()
        cl = torch.randn(B, mla_spec.kv_lora_rank, generator=g).cuda()
        kp = torch.randn(B, mla_spec.qk_rope_head_dim, generator=g).cuda()
        lat.append_all(0, cl, kp, pos)
        o_lat = lat.attend(0, ql, lat.lengths + 1, lambda q, c, n: fam.latent_attention(q, c, n, mla_spec))
        ref = kv.attend(0, qd, kv.lengths + 1, lambda qg, K, V, n: M.decode_attention(qg, K, V, n, window))
        return out, o_lat, ref

    out, _, ref = step(None)  # first step: one-time device copies
    assert torch.equal(out, ref)
    for c in (kv, lat):
        c.lengths += 1
    pos += 1
    for window in (None, 7):
        qd, kd, vd = (torch.randn(B, h, 16, generator=g).cuda() for h in (8, 2, 2))  # inputs made before the check
        ql = torch.randn(B, mla_spec.num_heads, W, generator=g).cuda()
        cl = torch.randn(B, mla_spec.kv_lora_rank, generator=g).cuda()
        kp = torch.randn(B, mla_spec.qk_rope_head_dim, generator=g).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kv.append_all(0, kd, vd, pos)
            out = kv.attend_masked(0, qd, M.decode_attention_masked, window)
            lat.append_all(0, cl, kp, pos)
            o_lat = lat.attend(0, ql, lat.lengths + 1, lambda q, c, n: fam.latent_attention(q, c, n, mla_spec))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref = kv.attend(0, qd, kv.lengths + 1, lambda qg, K, V, n: M.decode_attention(qg, K, V, n, window))
        assert torch.equal(out, ref) and torch.isfinite(o_lat).all()
        assert o_lat.shape == (B, mla_spec.num_heads, mla_spec.kv_lora_rank)
        for c in (kv, lat):
            c.lengths += 1
        pos += 1
