"""The compiled Triton prefill attention (``kernels.prefill_attention.attention_varlen_triton``, issue 44) on CUDA:
against the fp32 torch reference on fresh random inputs at full size (one-token prompts, lengths past a block,
GQA / MQA, MLA's q/k 192 and v 128, 64, 80, 16 wide heads, a sliding window, sinks; fp32 within 1e-4, bf16 / fp16
within 1e-2 of the reference's norm); its GPU memory (the output and nothing of [S, S] or padded size);
``model.layers.prefill_attention_packed`` taking it where varlen refuses without waiting for the GPU; and the
serial executor's fp32 prefill of a tiny gpt-oss (sinks, sliding layers) and DeepSeek-V2 (MLA) checkpoint through it
giving transformers' logits (max abs 1e-4, TF32 off). The interpreter runs the same checks small on the CPU:
tests/test_prefill_attention_triton.py."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels import prefill_attention as PA  # noqa: E402
from lightning_moe.kernels.fused_moe import triton_available  # noqa: E402
from lightning_moe.model import layers as M  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")

LENS = [[1], [7, 300, 1, 129], [1025, 3, 64, 17, 513]]


def _operands(lens, Hq, Hkv, dqk, dv, dt, seed, sinks=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, Hq, dqk, device="cuda", generator=g).to(dt)
    k = torch.randn(T, Hkv, dqk, device="cuda", generator=g).to(dt)
    v = torch.randn(T, Hkv, dv, device="cuda", generator=g).to(dt)
    s = torch.randn(Hq, device="cuda", generator=g) * 2 if sinks else None
    ends = torch.tensor(lens).cumsum(0).tolist()
    cu = torch.tensor([0] + ends, dtype=torch.int32, device="cuda")
    return q, k, v, s, [(e - n, e) for e, n in zip(ends, lens)], cu


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@needs_triton
@pytest.mark.parametrize("dt,tol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-2), (torch.float32, 1e-4)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("heads", [(32, 8, 64, 64), (16, 16, 192, 128), (12, 4, 80, 80), (8, 1, 16, 16)],
                         ids=lambda h: "H{}x{}-d{}x{}".format(*h))
@pytest.mark.parametrize("lens", LENS, ids=lambda lens: f"B{len(lens)}-max{max(lens)}")
@pytest.mark.parametrize("window,sinks", [(None, False), (100, True), (None, True)], ids=["plain", "w100-sinks", "sinks"])
def test_kernel_matches_reference(lens, heads, dt, tol, window, sinks):
    Hq, Hkv, dqk, dv = heads
    q, k, v, s, _, cu = _operands(lens, Hq, Hkv, dqk, dv, dt, seed=sum(lens) + Hq + dqk + (window or 0), sinks=sinks)
    out = torch.full((sum(lens), Hq, dv), float("nan"), dtype=dt, device="cuda")
    got = PA.attention_varlen_triton(q, k, v, cu, max(lens), window, sinks=s, out=out)
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu, window, sinks=s)
    assert got.shape == (sum(lens), Hq, dv) and got.dtype == dt and not got.isnan().any()
    assert _rel(got, ref) < tol


@needs_triton
def test_kernel_allocates_only_its_output():
    """8 prompts of 1,000 tokens, 32 heads: the call's peak above its inputs is the [T, Hq, v_hd] output (+ the
    allocator's rounding), not the [rows, Hq, S, S] scores (2 GB in fp32) nor a padded copy."""
    q, k, v, s, _, cu = _operands([1000] * 8, 32, 8, 64, 64, torch.bfloat16, seed=1, sinks=True)
    PA.attention_varlen_triton(q, k, v, cu, 1000, 128, sinks=s)  # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = PA.attention_varlen_triton(q, k, v, cu, 1000, 128, sinks=s)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= out.numel() * out.element_size() + (2 << 20)


@needs_triton
@pytest.mark.parametrize("mode,dv,dt", [("auto", 128, torch.bfloat16), ("varlen", 128, torch.bfloat16),
                                        ("auto", 64, torch.float32), ("triton", 64, torch.bfloat16)])
def test_packed_attention_takes_the_kernel_and_never_waits(monkeypatch, mode, dv, dt):
    """MLA's widths (192 / 128) and fp32 under auto / varlen, and any operands under triton, go to the Triton kernel
    on the packed rows, and the host never waits for the GPU."""
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", mode)
    dqk = 192 if dv == 128 else 64
    q, k, v, _, spans, cu = _operands([40, 3, 91, 5, 41], 16, 16 if dv == 128 else 4, dqk, dv, dt, seed=5)
    calls = []
    real = PA.attention_varlen_triton
    monkeypatch.setattr(PA, "attention_varlen_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    M.prefill_attention_packed(q, k, v, spans, None, scale=0.1)  # compile before the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = M.prefill_attention_packed(q, k, v, spans, None, scale=0.1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls == [1, 1]
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu, None, 0.1)
    assert _rel(out, ref.reshape(out.shape)) < (1e-4 if dt == torch.float32 else 1e-2)


def _serial_logits_through_the_kernel(path, prompts, monkeypatch):
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.serial import SerialExecutor

    monkeypatch.delenv("LIGHTNING_MOE_PREFILL_ATTENTION", raising=False)
    calls = []
    real = PA.attention_varlen_triton
    monkeypatch.setattr(PA, "attention_varlen_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ours = SerialExecutor(load_checkpoint(path, torch.float32), "cuda").logits(prompts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert calls, "the Triton prefill kernel did not run"
    return ours


@needs_triton
def test_gpt_oss_prefill_on_cuda_equals_transformers(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from tests.support.hf_checkpoints import ragged_logit_diff
    from tests.test_family_gpt_oss import PROMPTS, VOCAB, make_hf_gpt_oss

    path, model = make_hf_gpt_oss(tmp_path / "ckpt")
    ours = _serial_logits_through_the_kernel(path, PROMPTS, monkeypatch)
    assert ragged_logit_diff(ours, model, PROMPTS, VOCAB) < 1e-4


@needs_triton
@pytest.mark.parametrize("case", ["v2-group_limited-qlora-yarn", "v3-interleave-qlora"])
def test_deepseek_mla_prefill_on_cuda_equals_transformers(monkeypatch, tmp_path, case):
    pytest.importorskip("transformers")
    from tests.support.hf_checkpoints import ragged_logit_diff
    from tests.test_family_deepseek import CASES, PROMPTS, VOCAB, make_hf_deepseek

    version, kw = CASES[case]
    path, model = make_hf_deepseek(tmp_path / "ckpt", version, seed=5, **kw)
    ours = _serial_logits_through_the_kernel(path, PROMPTS, monkeypatch)
    assert ragged_logit_diff(ours, model, PROMPTS, VOCAB) < 1e-4
