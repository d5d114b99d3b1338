"""Packed prefill attention on CUDA (``kernels.prefill_attention``): torch's varlen flash path against its torch
reference, and ``model.layers.prefill_attention_packed`` under every ``LIGHTNING_MOE_PREFILL_ATTENTION`` mode
against per-sequence fp32 attention, on fresh random inputs with awkward lengths (a one-token prompt, odd lengths,
one past a power of two), GQA, a sliding window and a custom scale. Tolerance: bf16 / fp16 outputs within 1e-2
of the fp32 reference relative to its norm (one rounding of the output, fp32 softmax inside the kernels); the
varlen path makes the host wait for nothing."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels import prefill_attention as PA  # noqa: E402
from lightning_moe.model import layers as M  # noqa: E402

LENS = [[1], [7, 300, 1, 129], [1025, 3, 64, 17, 513]]


def _operands(lens, Hq, Hkv, hd, dt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, hd, device="cuda", generator=g).to(dt) for h in (Hq, Hkv, Hkv))
    ends = torch.tensor(lens).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, lens)]
    cu = torch.tensor([0] + ends, dtype=torch.int32, device="cuda")
    return q, k, v, spans, cu


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _varlen_or_skip(q, k, v, window, scale):
    why = PA.varlen_unsupported(q, k, v, window, scale)
    if why is not None and "torch" in why:
        pytest.skip(f"varlen path unavailable: {why}")
    assert why is None, why


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64), (12, 4, 96)])
@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("window", [None, 100])
def test_varlen_matches_reference(lens, heads, dt, window):
    Hq, Hkv, hd = heads
    q, k, v, spans, cu = _operands(lens, Hq, Hkv, hd, dt, seed=sum(lens) + Hq + (window or 0))
    _varlen_or_skip(q, k, v, window, None)
    out = PA.attention_varlen(q, k, v, cu, max(lens), window)
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu, window)
    assert out.shape == q.shape and out.dtype == dt
    assert _rel(out, ref) < 1e-2


def test_varlen_scale_and_reference_equals_per_sequence_attention():
    q, k, v, spans, cu = _operands([5, 260, 33], 8, 2, 64, torch.bfloat16, seed=3)
    _varlen_or_skip(q, k, v, None, 0.05)
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu, None, 0.05)
    assert _rel(PA.attention_varlen(q, k, v, cu, 260, None, 0.05), ref) < 1e-2
    per_seq = torch.cat([M.prefill_attention(q[s:e].float(), k[s:e].float(), v[s:e].float()) for s, e in spans])
    ref_default = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu)
    assert _rel(ref_default.reshape(per_seq.shape), per_seq) < 1e-5


@pytest.mark.parametrize("mode", PA.MODES)
@pytest.mark.parametrize("window", [None, 100])
def test_packed_attention_every_mode_matches_per_sequence(monkeypatch, mode, window):
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", mode)
    lens = [7, 300, 1, 129, 1025]
    q, k, v, spans, _ = _operands(lens, 32, 8, 128, torch.bfloat16, seed=11 + (window or 0))
    out = M.prefill_attention_packed(q, k, v, spans, window)
    ref = torch.cat([M.prefill_attention(q[s:e].float(), k[s:e].float(), v[s:e].float(), window) for s, e in spans])
    assert out.shape == (sum(lens), 32 * 128) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2


def test_auto_takes_varlen_and_never_waits_for_the_gpu(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MOE_PREFILL_ATTENTION", raising=False)
    q, k, v, spans, cu = _operands([40, 3, 91, 5, 41], 32, 8, 128, torch.bfloat16, seed=5)
    _varlen_or_skip(q, k, v, None, None)
    calls = []
    real = PA.attention_varlen
    monkeypatch.setattr(PA, "attention_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = M.prefill_attention_packed(q, k, v, spans)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls == [1]
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu)
    assert _rel(out, ref.reshape(out.shape)) < 1e-2


def test_varlen_refuses_what_it_cannot_take():
    q, k, v, spans, cu = _operands([4, 9], 8, 2, 64, torch.bfloat16, seed=1)
    assert "dtype" in PA.varlen_unsupported(q.float(), k.float(), v.float(), None, None)
    assert "head widths" in PA.varlen_unsupported(q, k, v[..., :32], None, None)  # MLA: v narrower than q / k
    with pytest.raises(ValueError, match="int32"):
        PA.attention_varlen(q, k, v, cu.long(), 9)
