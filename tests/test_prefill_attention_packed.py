"""model.layers.prefill_attention_packed (one padded SDPA call over packed prompts) equals prefill_attention per
sequence (fp32, 1e-5 relative), for ragged spans including a one-token prompt, with and without a sliding window;
rows come back in packed order (the output gather is an index built on the host, no boolean indexing)."""

import pytest
import torch

from lightning_moe.model.layers import prefill_attention, prefill_attention_packed


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lens", [[1], [5, 1, 9], [7, 7], [2, 11, 1, 4]])
def test_packed_equals_per_sequence(lens, window):
    g = torch.Generator().manual_seed(sum(lens) * 31 + (window or 0))
    T, Hq, Hkv, hd = sum(lens), 8, 2, 16
    q = torch.randn(T, Hq, hd, generator=g)
    k = torch.randn(T, Hkv, hd, generator=g)
    v = torch.randn(T, Hkv, hd, generator=g)
    ends = torch.tensor(lens).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, lens)]
    out = prefill_attention_packed(q, k, v, spans, window)
    ref = torch.cat([prefill_attention(q[s:e], k[s:e], v[s:e], window) for s, e in spans])
    assert out.shape == (T, Hq * hd)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
