"""kernels.prefill_attention.attention_varlen_triton (issue 44: packed varlen causal prefill attention with GQA, a
sliding window, attention sinks, independent q/k and v head widths) under Triton's CPU interpreter
(TRITON_INTERPRET=1), against the torch reference ``attention_varlen_reference`` on fresh random inputs; skipped
where triton is not installed (CI has none; the argument checks and the dispatch rules run there too). The compiled
kernel on CUDA: tests/gpu/test_prefill_attention_triton_gpu.py.

Tolerances, relative to the reference's norm (the reference runs in fp32 on the same rounded inputs): fp32 1e-4
(exact fp32 dots: the error is summation order, ~1e-7); fp16 / bf16 1e-2 (the probabilities rounded to the input
dtype for the value dot, and the output's rounding). Small blocks (16) make every sequence longer than 16 span
several query and key blocks; lengths are not multiples of a block. Outputs are written into NaN-filled buffers
(every row must be written, the padding columns of a wider buffer never), and inputs are views whose columns past
the head width hold NaN (the kernel's padded head lanes must never read them).
The serial executor's prefill of a tiny gpt-oss (sinks, sliding layers) and DeepSeek-V2 (MLA: q/k 16 wide, v 12)
checkpoint through this kernel gives transformers' logits (1e-4), as its torch path does.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.kernels import prefill_attention as PA
from lightning_moe.kernels.fused_moe import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")  # the repo's one wording
interp_warnings = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy's, inside the interpreter


@pytest.fixture
def interpret(monkeypatch):
    """triton imported in compiled mode first (as tests/test_kernels_ref.py does), then the interpreter set."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _nan_padded(T, H, d, dtype, g, extra=8):
    """Random [T, H, d] viewed from a [T, H, d + extra] buffer whose last ``extra`` columns are NaN."""
    buf = torch.full((T, H, d + extra), float("nan"), dtype=dtype)
    buf[..., :d] = torch.randn(T, H, d, generator=g).to(dtype)
    return buf[..., :d]


def _operands(lens, Hq, Hkv, dqk, dv, dtype, seed, sinks):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = _nan_padded(T, Hq, dqk, dtype, g)
    k = _nan_padded(T, Hkv, dqk, dtype, g)
    v = _nan_padded(T, Hkv, dv, dtype, g)
    s = (torch.randn(Hq, generator=g) * 2).float() if sinks else None
    return q, k, v, s


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# (lens, Hq, Hkv, dqk, dv, window, sinks, dtype, block_m, block_n)
CASES = [
    ([1], 1, 1, 16, 16, None, False, torch.float32, 16, 16),  # one sequence of one token
    ([1, 1, 1], 4, 4, 16, 16, None, True, torch.float32, 16, 16),  # only one-token sequences, with sinks
    ([37], 4, 1, 64, 64, None, False, torch.float32, 16, 16),  # B = 1, 3 blocks, the last partial; MQA
    ([37], 4, 1, 64, 64, 5, True, torch.bfloat16, 16, 16),
    ([5, 17, 1, 40, 16], 8, 2, 192, 128, None, False, torch.float32, 16, 16),  # MLA's widths
    ([5, 17, 1, 40, 16], 8, 2, 192, 128, None, True, torch.bfloat16, 16, 16),
    ([5, 17, 1, 40, 16], 8, 2, 192, 128, 7, True, torch.float16, 16, 32),
    ([33, 2, 19], 4, 4, 80, 80, 3, True, torch.float32, 16, 16),  # non power-of-two widths
    ([33, 2, 19], 4, 4, 80, 80, 5, False, torch.bfloat16, 32, 16),  # rows whose first key block is all masked
    ([33, 2, 19], 4, 2, 80, 80, None, False, torch.float16, 16, 16),
    ([23, 9], 8, 8, 96, 48, 1, True, torch.float32, 16, 16),  # window 1: each token sees itself only
    ([23, 9], 8, 4, 16, 16, 100, False, torch.float32, 16, 16),  # window longer than every sequence
    ([3, 0, 12], 4, 2, 64, 64, 4, True, torch.float32, 16, 16),  # an empty sequence in the middle
    ([130, 67, 1, 200], 8, 1, 64, 64, 50, True, torch.float32, None, None),  # T ~ 400, the default blocks
    ([130, 67, 1, 200], 8, 2, 64, 64, None, False, torch.bfloat16, None, None),
    ([70, 3], 4, 2, 192, 128, None, True, torch.bfloat16, None, None),  # default blocks of the wide heads
]


def _case_id(c):
    lens, Hq, Hkv, dqk, dv, w, s, dt, bm, bn = c
    return (f"B{len(lens)}-T{sum(lens)}-H{Hq}x{Hkv}-d{dqk}x{dv}-w{w}-{'sinks' if s else 'nosink'}-"
            f"{str(dt).split('.')[-1]}-b{bm}x{bn}")


@needs_triton
@interp_warnings
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(interpret, case):
    lens, Hq, Hkv, dqk, dv, window, sinks, dtype, bm, bn = case
    q, k, v, s = _operands(lens, Hq, Hkv, dqk, dv, dtype, seed=sum(lens) * 31 + Hq + dqk + (window or 0), sinks=sinks)
    cu = _cu(lens)
    T = sum(lens)
    out = torch.full((T, Hq, dv + 5), float("nan"), dtype=dtype)[..., :dv]  # NaN, and NaN columns past v_hd
    got = PA.attention_varlen_triton(q, k, v, cu, max(lens), window, sinks=s, out=out, block_m=bm, block_n=bn)
    assert got.data_ptr() == out.data_ptr() and got.shape == (T, Hq, dv) and got.dtype == dtype
    assert not got.isnan().any(), "a row left unwritten or NaN from padding"
    assert out._base[..., dv:].isnan().all(), "wrote past the head width"
    ref = PA.attention_varlen_reference(q.float(), k.float(), v.float(), cu, window, sinks=s)
    assert _rel(got, ref) <= TOL[dtype], _rel(got, ref)


@needs_triton
@interp_warnings
def test_scale_default_and_allocated_output(interpret):
    """A custom scale (MLA's softmax_scale) and the default 1/sqrt(hd); without ``out`` a fresh [T, Hq, v_hd]."""
    lens = [9, 20]
    q, k, v, _ = _operands(lens, 4, 2, 24, 40, torch.float32, seed=5, sinks=False)
    cu = _cu(lens)
    for scale in (None, 0.37):
        got = PA.attention_varlen_triton(q, k, v, cu, 20, scale=scale, block_m=16, block_n=16)
        assert got.shape == (29, 4, 40) and got.is_contiguous()
        assert _rel(got, PA.attention_varlen_reference(q, k, v, cu, scale=scale)) <= 1e-4


@needs_triton
@interp_warnings
def test_sink_changes_the_output_and_a_huge_negative_sink_is_no_sink(interpret):
    """The sink term is exercised: a sink near the scores changes the output well beyond the tolerance, a sink of
    -1e4 gives the sink-free attention."""
    lens = [6, 18]
    q, k, v, s = _operands(lens, 4, 2, 32, 32, torch.float32, seed=8, sinks=True)
    cu = _cu(lens)
    with_sinks = PA.attention_varlen_triton(q, k, v, cu, 18, sinks=s, block_m=16, block_n=16)
    plain = PA.attention_varlen_reference(q, k, v, cu)
    assert _rel(with_sinks, plain) > 1e-2
    off = PA.attention_varlen_triton(q, k, v, cu, 18, sinks=torch.full((4,), -1e4), block_m=16, block_n=16)
    assert _rel(off, plain) <= 1e-5


def test_reference_with_sinks_equals_gpt_oss_torch_path():
    """The reference's sinks are gpt-oss's (families.gpt_oss._softmax_with_sinks over per-sequence scores), and
    without sinks and with v as wide as q it is the existing varlen reference (per-sequence attention)."""
    from lightning_moe.model.families.gpt_oss import _softmax_with_sinks

    g = torch.Generator().manual_seed(3)
    lens, Hq, Hkv, hd = [4, 1, 9], 4, 2, 8
    q, k, v = (torch.randn(sum(lens), h, hd, generator=g) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=g)
    cu = _cu(lens)
    out = PA.attention_varlen_reference(q, k, v, cu, 3, sinks=sinks)
    for s, e in [(0, 4), (4, 5), (5, 14)]:
        qh, kh, vh = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0), \
            v[s:e].transpose(0, 1).repeat_interleave(2, 0)
        i = torch.arange(e - s)
        allowed = (i[None] <= i[:, None]) & (i[None] > i[:, None] - 3)
        sc = (qh @ kh.transpose(1, 2) / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
        want = (_softmax_with_sinks(sc, sinks) @ vh).transpose(0, 1)
        assert torch.allclose(out[s:e], want, atol=1e-6)


def test_argument_checks_before_triton_is_needed(monkeypatch):
    """Shapes, dtypes, cu_seqlens, window, sinks, out and blocks are refused by name; CPU tensors without the
    interpreter name CUDA. Runs without triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    f = PA.attention_varlen_triton
    with pytest.raises(ValueError, match="CUDA"):
        f(q, k, v, cu, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for args, kw, match in [
        ((q, k.half(), v, cu, 4), {}, "dtypes"),
        ((q.double(), k.double(), v.double(), cu, 4), {}, "dtypes"),
        ((q, k[..., :8], v, cu, 4), {}, "shapes"),
        ((q, k, v[:5], cu, 4), {}, "shapes"),
        ((torch.randn(6, 3, 16), k, v, cu, 4), {}, "3 query heads over 2 kv heads"),
        ((torch.randn(6, 4, 300), torch.randn(6, 2, 300), v, cu, 4), {}, "head widths"),
        ((q, k, v, cu.long(), 4), {}, "cu_seqlens"),
        ((q, k, v, cu, -1), {}, "max_len"),
        ((q, k, v, cu, 4), {"sliding_window": 0}, "sliding_window"),
        ((q, k, v, cu, 4), {"sinks": torch.zeros(2)}, "sinks"),
        ((q, k, v, cu, 4), {"out": torch.empty(6, 4, 16)}, "out must be"),
        ((q, k, v, cu, 4), {"out": torch.empty(6, 4, 8, dtype=torch.half)}, "out must be"),
        ((q, k, v, cu, 4), {"block_m": 24}, "block_m"),
        ((q, k, v, cu, 4), {"block_n": 8}, "block_n"),
    ]:
        with pytest.raises(ValueError, match=match):
            f(*args, **kw)


def test_dispatch_rules(monkeypatch):
    """use_triton: never on the CPU; on a host where the kernel runs, auto / varlen take it where varlen refuses
    (and always with sinks), triton wherever it runs, efficient / sdpa never."""
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 8)
    assert PA.triton_unsupported(q, k, v) == "not on CUDA"
    assert not any(PA.use_triton(q, k, v, None, None, m, sinks=s) for m in PA.MODES for s in (False, True))
    monkeypatch.setattr(PA, "triton_unsupported", lambda q, k, v: None)
    for varlen_ok in (False, True):
        monkeypatch.setattr(PA, "varlen_unsupported", lambda *a, ok=varlen_ok: None if ok else "refused")
        want = {"auto": not varlen_ok, "varlen": not varlen_ok, "triton": True, "efficient": False, "sdpa": False}
        assert {m: PA.use_triton(q, k, v, None, None, m) for m in PA.MODES} == want
        assert {m: PA.use_triton(q, k, v, None, None, m, sinks=True) for m in PA.MODES} == {
            **want, "auto": True, "varlen": True}


# ---------------------------------------------------------------------------------------------------
# The wiring: model.layers.prefill_attention_packed and the families' prefill through the kernel
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def triton_on_cpu(monkeypatch, interpret):
    """The kernel taken on the CPU as on CUDA (triton_unsupported checks the operands only), its calls counted."""
    monkeypatch.setattr(PA, "triton_unsupported", PA._triton_operands_wrong)
    calls = []
    real = PA.attention_varlen_triton
    monkeypatch.setattr(PA, "attention_varlen_triton", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    return calls


@needs_triton
@interp_warnings
@pytest.mark.parametrize("window,dv,scale", [(None, 24, 0.3), (4, 12, None)])
def test_prefill_attention_packed_takes_the_kernel_where_varlen_refuses(triton_on_cpu, monkeypatch, window, dv, scale):
    from lightning_moe.model.layers import prefill_attention_packed

    monkeypatch.delenv("LIGHTNING_MOE_PREFILL_ATTENTION", raising=False)
    lens = [3, 1, 12, 5]
    q, k, v, _ = _operands(lens, 4, 2, 24, dv, torch.float32, seed=4, sinks=False)
    ends = torch.tensor(lens).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, lens)]
    out = prefill_attention_packed(q, k, v, spans, window, scale=scale)
    assert len(triton_on_cpu) == 1 and out.shape == (21, 4 * dv)
    ref = PA.attention_varlen_reference(q, k, v, _cu(lens), window, scale)
    assert _rel(out, ref.reshape(out.shape)) <= 1e-4
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", "efficient")  # the padded SDPA call: the same values
    assert _rel(prefill_attention_packed(q.contiguous(), k.contiguous(), v.contiguous(), spans, window, scale=scale),
                ref.reshape(out.shape)) <= 1e-5
    assert len(triton_on_cpu) == 1


def _hidden_model_logits(make, tmp_path, prompts, vocab, calls):
    from tests.support.hf_checkpoints import ragged_logit_diff

    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.serial import SerialExecutor

    path, model = make(tmp_path / "ckpt")
    ours = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").logits(prompts)
    assert calls, "the Triton kernel did not run"
    return ragged_logit_diff(ours, model, prompts, vocab)


@needs_triton
@interp_warnings
def test_gpt_oss_prefill_through_the_kernel_equals_transformers(triton_on_cpu, tmp_path):
    """gpt-oss's sinks and sliding layers (window 4 over prompts of up to 13 tokens) through the kernel: the serial
    executor's logits equal transformers' (max abs 1e-4)."""
    pytest.importorskip("transformers")
    from tests.test_family_gpt_oss import PROMPTS, VOCAB, make_hf_gpt_oss

    assert _hidden_model_logits(make_hf_gpt_oss, tmp_path, PROMPTS, VOCAB, triton_on_cpu) < 1e-4
    assert len(triton_on_cpu) == 3  # one call per layer


@needs_triton
@interp_warnings
def test_deepseek_mla_prefill_through_the_kernel_equals_transformers(triton_on_cpu, tmp_path):
    """DeepSeek-V2's MLA prefill (the latent expanded: q/k 16 wide, v 12, its softmax scale with yarn's mscale)
    through prefill_attention_packed and the kernel: logits equal transformers' (max abs 1e-4)."""
    pytest.importorskip("transformers")
    from tests.test_family_deepseek import CASES, PROMPTS, VOCAB, make_hf_deepseek

    version, kw = CASES["v2-group_limited-qlora-yarn"]

    def make(path):
        return make_hf_deepseek(path, version, seed=5, **kw)

    assert _hidden_model_logits(make, tmp_path, PROMPTS, VOCAB, triton_on_cpu) < 1e-4
    assert {s[-1] for s in triton_on_cpu} == {16}  # q's width; v's is 12
