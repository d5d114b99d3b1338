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
