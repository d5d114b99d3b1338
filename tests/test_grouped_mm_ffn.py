"""The grouped_mm expert FFN (issue 22): kernels.fused_moe.fused_experts_grouped_mm against the torch reference, the
hardware profile's expert_ffn_rates (round trip, kernel choice by measured shape, the HRM's rate), CGOPipe's per-call
kernel choice, and CGOPipe on the CPU with grouped_mm forced against the serial executor.

What runs here: torch 2.13's ``torch._grouped_mm`` on the CPU (its CPU fallback takes fp32, bf16 and fp16), i.e. the
same op sequence the GPU runs (moe_align, the expert-sorted gather, the grouped GEMMs over transposed views, the
skip bucket past the last offset, the fp32 slot sum). What does not: CUTLASS's CUDA kernel itself, its bf16-only and
16-byte alignment rules (checked by grouped_mm_unsupported, exercised on the GPU: tests/gpu), and rows past the last
offset left unwritten by the CUDA kernel (here: the CPU fallback's untouched rows, which hold whatever torch.empty
gave).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.hf_checkpoints import assert_scores_match
from tests.support.nan_workspace import nan_empty, nan_tail_grouped_mm

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm, fused_experts_mm_loop,
                                             grouped_mm_available, grouped_mm_gate_up_chunks, grouped_mm_unsupported)
from lightning_moe.policy.hardware import NO_SYNC_KERNELS, ExpertFFNRate, HardwareError, HardwareProfile, get_preset
from lightning_moe.pipeline.profiler import EXPERT_FFN_TOKENS

# (T, D, F, E, k, expert given no tokens): T = 1, odd T, an expert with no tokens, k = 1 and 3, D not a multiple of 8
CASES = [(1, 64, 48, 8, 2, None), (33, 100, 72, 8, 2, 3), (33, 100, 72, 4, 1, 0), (17, 40, 24, 6, 3, 5),
         (64, 128, 96, 8, 2, 7)]
IDS = [f"T{c[0]}-D{c[1]}-F{c[2]}-E{c[3]}-k{c[4]}-empty{c[5]}" for c in CASES]


def make_inputs(T, D, Fd, E, k, empty, dtype=torch.float32, seed=0):
    """x [T, D], w1/w3 [E, F, D], w2 [E, D, F], fp32 weights [T, k], distinct ids [T, k]; expert ``empty`` unused."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w1 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w3 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, Fd, generator=g) / Fd**0.5).to(dtype)
    allowed = torch.tensor([e for e in range(E) if e != empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    wts = torch.rand(T, k, generator=g).softmax(dim=-1)
    return x, w1, w3, w2, wts, ids.to(torch.int64)


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_grouped_mm_runs_on_this_cpu():
    """torch 2.13 has F.grouped_mm and its CPU fallback takes fp32 and bf16 at these shapes (what the tests below
    rely on)."""
    assert grouped_mm_available("cpu")
    assert hasattr(torch.nn.functional, "grouped_mm")


@pytest.mark.parametrize("fn", [fused_experts_grouped_mm, fused_experts_mm_loop], ids=["grouped_mm", "mm_loop"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grouped_mm_equals_reference_fp32(case, fn):
    """fp32: 1e-5 relative to the torch reference (experts_ffn_reference), every gate/up chunking (grouped_mm: column
    chunks; mm_loop: row blocks), for both library-GEMM paths."""
    x, w1, w3, w2, wts, ids = make_inputs(*case)
    ref = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    for chunks in (None, 1, 4, 16):
        got = fn(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert relerr(got, ref) <= 1e-5, chunks


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grouped_mm_equals_reference_bf16(case):
    """bf16: 1e-2 relative to the fp32 reference over the same bf16 operands (D rounded up to a multiple of 8: bf16
    rows of 16-byte strides, which grouped_mm needs; D = 100 is refused, naming why)."""
    T, D, Fd, E, k, empty = case
    if D % 8:
        x, w1, w3, w2, wts, ids = make_inputs(*case, dtype=torch.bfloat16)
        assert "multiples of 8" in grouped_mm_unsupported(x, w1, w3, w2)
        with pytest.raises(ValueError, match="16-byte strides"):
            fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)
        D = D + 8 - D % 8
    x, w1, w3, w2, wts, ids = make_inputs(T, D, Fd, E, k, empty, dtype=torch.bfloat16)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    got = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)
    assert got.dtype == torch.bfloat16
    assert relerr(got, ref) <= 1e-2


@pytest.mark.parametrize("fn", [fused_experts_grouped_mm, fused_experts_mm_loop], ids=["grouped_mm", "mm_loop"])
def test_grouped_mm_skip_id_splits_a_layer_in_two_groups(fn):
    """(Both library-GEMM paths.) As CGOPipe runs dense pages: the paged and the resident experts as two calls, each marking the other's pairs
    with the skip id (its expert count); the sum equals one call over all experts (fp32 1e-5), and a call whose
    pairs are all skipped adds exactly 0 (even though those rows of its GEMM outputs are never written)."""
    x, w1, w3, w2, wts, ids = make_inputs(29, 64, 48, 8, 2, 5, seed=3)
    ref = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    paged = torch.tensor([0, 2, 3, 6])  # experts in group A; the rest in group B
    in_a = torch.zeros(8, dtype=torch.bool)
    in_a[paged] = True
    row = torch.empty(8, dtype=torch.int64)
    row[in_a] = torch.arange(int(in_a.sum()))
    row[~in_a] = torch.arange(int((~in_a).sum()))
    out = 0
    for member in (in_a, ~in_a):
        n = int(member.sum())
        local = torch.where(member[ids], row[ids], torch.full_like(ids, n))
        sel = member.nonzero().squeeze(1)
        out = out + fn(x, w1[sel], w3[sel], w2[sel], wts, local, skip=True)
    assert relerr(out, ref) <= 1e-5
    none = fn(x, w1[:3], w3[:3], w2[:3], wts, torch.full_like(ids, 3), skip=True)
    assert torch.equal(none, torch.zeros_like(none))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 3\)"):
        fn(x, w1[:3], w3[:3], w2[:3], wts, torch.full_like(ids, 3))  # no skip: 3 is out of range


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grouped_mm_nan_workspaces(case, monkeypatch):
    """Issue 41: every buffer the call allocates is NaN-filled (nan_empty) and the grouped GEMM leaves its rows past
    the last group end NaN (as the CUDA kernel leaves them unwritten) while failing on a non-finite operand row
    before it: the result is finite and within fp32 1e-5 / bf16 1e-2 of the reference, every column chunking, and
    with the skip id (two groups) the skipped pairs' NaN rows add exactly 0."""
    nan_empty(monkeypatch)
    ends = nan_tail_grouped_mm(monkeypatch, fm)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x, w1, w3, w2, wts, ids = make_inputs(*case, dtype=dtype)
        if grouped_mm_unsupported(x, w1, w3, w2) is not None:  # bf16 with D = 100: not 16-byte rows
            continue
        ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
        for chunks in (None, 4):
            got = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks)
            assert torch.isfinite(got).all() and relerr(got, ref) <= tol, (dtype, chunks)
        E = w1.shape[0]
        out = 0
        for lo, hi in ((0, E // 2), (E // 2, E)):
            local = torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, hi - lo))
            out = out + fused_experts_grouped_mm(x, w1[lo:hi], w3[lo:hi], w2[lo:hi], wts, local, skip=True)
        assert torch.isfinite(out).all() and relerr(out, ref) <= tol, dtype
    assert any(end < x.shape[0] * ids.shape[1] for end in ends)  # some calls left NaN rows past the last group


def test_grouped_mm_strided_page_views_and_errors():
    """Strided views of a stacked buffer (as the page buffers give) are taken without a copy; a transposed weight
    (innermost stride != 1) and an unsupported device are refused with the reason; T = 0 gives [0, D]."""
    x, w1, w3, w2, wts, ids = make_inputs(9, 32, 24, 4, 2, None, seed=1)
    big = torch.zeros(6, 24, 32)
    big[1:5] = w1  # w1 as rows 1..4 of a larger stack
    got = fused_experts_grouped_mm(x, big[1:5], w3, w2, wts, ids)
    assert relerr(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5
    bad = w1.transpose(1, 2).contiguous().transpose(1, 2)  # same values, innermost stride D
    assert "innermost stride" in grouped_mm_unsupported(x, bad, w3, w2)
    with pytest.raises(ValueError, match="innermost stride"):
        fused_experts_grouped_mm(x, bad, w3, w2, wts, ids)
    assert grouped_mm_unsupported(x.to("meta"), w1.to("meta"), w3.to("meta"), w2.to("meta")) == "device meta"
    empty = fused_experts_grouped_mm(x[:0], w1, w3, w2, wts[:0], ids[:0])
    assert empty.shape == (0, 32)
    with pytest.raises(ValueError, match="gate_up_chunks"):
        fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=-1)


def test_gate_up_chunks_keep_the_planner_workspace_by_hand():
    """Per pair the planner counts F b + 4 D + 4 D / k (hrm._ffn_stage_bytes: gate|up product, fp32 slot output,
    fp32 sum). Mixtral-8x7B bf16 (D 4096, F 14336, k 2): budget 28672 + 16384 + 8192 = 53248 B; one chunk needs
    2 F b + D b = 65536 (too much), four need F b + F b / 2 + D b = 28672 + 14336 + 8192 = 51200 -> 4.
    Qwen3-30B-A3B (D 2048, F 768, k 8): one chunk, 2 * 1536 + 4096 = 7168 <= 1536 + 8192 + 1024."""
    assert grouped_mm_gate_up_chunks(4096, 14336, 2, 2) == 4
    assert grouped_mm_gate_up_chunks(2048, 768, 8, 2) == 1
    assert grouped_mm_gate_up_chunks(64, 4096, 1, 2) == 16  # F >> D: as many chunks as it allows


# ---- the hardware profile's expert_ffn_rates ------------------------------------------------------------------

MIX = (4096, 14336, 8, 2)


def rates_profile(**kw):
    rows = [ExpertFFNRate(*MIX, "bf16", t, tr, gm) for t, tr, gm in
            ((64, 2.0e14, 1.0e14), (1024, 3.0e14, 5.0e14), (16384, 3.6e14, 6.0e14))]
    return get_preset("h200").with_overrides(expert_ffn_rates=rows, **kw)


def test_profile_round_trips_expert_ffn_rates(tmp_path):
    """save -> load gives the same profile (rates as a list of mappings in the YAML); a profile without the key (all
    older profiles) loads with none."""
    prof = rates_profile()
    path = tmp_path / "p.yaml"
    prof.save(str(path))
    assert "expert_ffn_rates:" in path.read_text()
    back = HardwareProfile.load(str(path))
    assert back == prof and isinstance(back.expert_ffn_rates, tuple) and hash(back) == hash(prof)
    d = prof.to_dict()
    del d["expert_ffn_rates"]
    assert HardwareProfile.from_dict(d).expert_ffn_rates == ()
    h200 = HardwareProfile.load("lightning_moe/policy/profiles/h200-host.yaml")  # rates measured on the H200 host
    assert len(h200.expert_ffn_table(4096, 14336, 8, 2, "bf16")) == len(EXPERT_FFN_TOKENS)  # Mixtral-8x7B, T 16 .. 32768
    assert h200.expert_ffn_kernel(*MIX, "bf16", 16, NO_SYNC_KERNELS) in NO_SYNC_KERNELS  # decode-sized calls
    assert h200.expert_ffn_kernel(*MIX, "bf16", 16384) == "mm_loop"  # prefill-sized calls
    assert h200.expert_ffn_kernel(*MIX, "bf16", 16384, NO_SYNC_KERNELS) == "grouped_mm"  # the same size in a decode step


@pytest.mark.parametrize("entry,msg", [
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "bf16", "tokens": 4, "cuda": 1.0},
     r"expert_ffn_rates\[0\]: unknown key\(s\) cuda"),
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "bf16"}, r"expert_ffn_rates\[0\]: missing tokens"),
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "int4", "tokens": 4}, "dtype: expected bf16"),
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "bf16", "tokens": 0}, "tokens: expected an integer"),
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "bf16", "tokens": 4, "triton": -1.0},
     "triton: expected a non-negative"),
    ({"hidden": 8, "intermediate": 8, "experts": 2, "top_k": 1, "dtype": "bf16", "tokens": 4, "grouped_mm": "fast"},
     "grouped_mm: expected a number"),
])
def test_profile_rejects_bad_rates(entry, msg):
    d = get_preset("l4").to_dict()
    d["expert_ffn_rates"] = [entry]
    with pytest.raises(HardwareError, match=msg):
        HardwareProfile.from_dict(d, where="p.yaml")
    d["expert_ffn_rates"] = {"not": "a list"}
    with pytest.raises(HardwareError, match="expert_ffn_rates: expected a list"):
        HardwareProfile.from_dict(d, where="p.yaml")


def test_profile_kernel_choice_and_rate_by_hand():
    """Choice: the faster kernel at the measured bucket nearest T in log T (tie -> the smaller bucket); rate: the
    faster kernel's, linear in log T between buckets, the end buckets' outside. Another shape or dtype: nothing."""
    p = rates_profile()
    pick = lambda t: p.expert_ffn_kernel(*MIX, "bfloat16", t)  # noqa: E731
    assert [pick(t) for t in (1, 64, 255, 256, 257, 1024, 10**6)] == \
        ["triton", "triton", "triton", "triton", "grouped_mm", "grouped_mm", "grouped_mm"]
    rate = lambda t: p.expert_ffn_rate(*MIX, "bf16", t)  # noqa: E731
    assert rate(8) == 2.0e14 and rate(64) == 2.0e14 and rate(1024) == 5.0e14 and rate(10**6) == 6.0e14
    assert rate(256) == pytest.approx(2.0e14 + 0.5 * 3.0e14)  # halfway between 64 and 1024 in log T
    assert rate(4096) == pytest.approx(5.0e14 + 0.5 * 1.0e14)  # halfway between 1024 and 16384
    assert p.expert_ffn_kernel(*MIX, "fp16", 1024) is None and p.expert_ffn_rate(4096, 14336, 8, 1, "bf16", 9) == 0.0
    assert get_preset("h200").expert_ffn_kernel(*MIX, "bf16", 1024) is None
    unmeasured = get_preset("h200").with_overrides(expert_ffn_rates=[ExpertFFNRate(*MIX, "bf16", 64)])
    assert unmeasured.expert_ffn_kernel(*MIX, "bf16", 64) is None  # an entry of zeros is no measurement


def test_hrm_expert_term_uses_the_measured_rate_by_hand():
    """gpu_experts_time: FLOPs 2 T k 3 D F at min(GEMM peak, the profile's rate for the shape at T); the shape's
    rate wins over gpu_expert_flops; another shape keeps gpu_expert_flops."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("mixtral-8x7b")
    T = 4096
    flops = 2 * T * 2 * 3 * 4096 * 14336
    p = rates_profile(gpu_expert_flops=3.0e14)
    nbytes = hrm.active_experts(T, 8, 2) * spec.expert_bytes("bf16") + T * 2 * 2 * 4096 * 2
    assert hrm.gpu_experts_time(spec, p, T) == pytest.approx(max(flops / 5.5e14, nbytes / p.gpu_hbm_bandwidth))
    assert hrm.gpu_experts_time(spec, p.with_overrides(expert_ffn_rates=()), T) == pytest.approx(flops / 3.0e14)
    qwen = resolve_spec("qwen3-30b-a3b")
    assert hrm.gpu_experts_time(qwen, p, T) == hrm.gpu_experts_time(qwen, p.with_overrides(expert_ffn_rates=()), T)


def test_expert_ffn_probe_on_the_cpu():
    """measure_expert_ffn_rates on the CPU: grouped_mm and mm_loop measured (> 0), Triton not (it needs CUDA or its
    interpreter);
    argument errors."""
    from lightning_moe.pipeline.profiler import expert_shapes_of, measure_expert_ffn_rates

    rows = measure_expert_ffn_rates([(32, 48, 4, 2)], (3, 16), device="cpu", repeats=1)
    assert [(r.shape, r.tokens) for r in rows] == [((32, 48, 4, 2, "fp32"), 3), ((32, 48, 4, 2, "fp32"), 16)]
    assert all(r.grouped_mm > 0 and r.mm_loop > 0 and r.triton == 0 and r.best in ("grouped_mm", "mm_loop")
               for r in rows)
    with pytest.raises(ValueError, match="top_k <= experts"):
        measure_expert_ffn_rates([(8, 8, 2, 3)], (4,), device="cpu")
    with pytest.raises(ValueError, match="tokens >= 1"):
        measure_expert_ffn_rates([(8, 8, 2, 1)], (), device="cpu")
    assert expert_shapes_of(["mixtral-8x7b", "Mixtral-8x7B-v0.1"]) == (MIX,)
    with pytest.raises(ValueError, match="unknown model"):
        expert_shapes_of(["no-such-model"])


# ---- CGOPipe: the kernel per call, and the executor with grouped_mm forced -------------------------------------


def _prompts(n, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def test_kernel_choice_follows_the_profile(tiny_dir, monkeypatch):
    """expert_ffn "auto": each call's kernel is the profile's pick for the layer's shape at the call's T (Triton
    below ~256 tokens, grouped_mm above, in this profile); with no measurement of the shape, Triton for every call
    (today's behaviour); "triton" / "grouped_mm" force one. The Triton kernel is replaced by a recorder running the
    reference (it needs CUDA); grouped_mm runs for real. Every result equals the reference loop's (fp32 1e-5)."""
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline import expert_ffn as X
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    ran = []
    monkeypatch.setattr(X, "fused_experts_triton", lambda h, w1, w3, w2, w, ids, validate=False, skip=False: (
        ran.append(("triton", h.shape[0])) or _skip_reference(h, w1, w3, w2, w, ids, skip)))
    real = X.fused_experts_grouped_mm
    monkeypatch.setattr(X, "fused_experts_grouped_mm", lambda h, *a, **kw: ran.append(("grouped_mm", h.shape[0]))
                        or real(h, *a, **kw))
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32),
                         Policy(mu=2, n=2, prefill_mu=2, resident_experts=3, dtype="fp32", weight_quant="fp32"), "cpu")
    s = ex.spec
    shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
    hw = get_preset("h200").with_overrides(expert_ffn_rates=[
        ExpertFFNRate(*shape, "fp32", 16, triton=2e12, grouped_mm=1e12),
        ExpertFFNRate(*shape, "fp32", 4096, triton=2e12, grouped_mm=3e12)])
    ws = ex.weight_stream
    visit = ws.begin_visit()
    lx = ws.wait_pages(visit)
    ref = ex.expert_ffn.for_visit(lx)  # the torch reference loop
    g = torch.Generator().manual_seed(2)

    def call(strategy, T):
        h = torch.randn(T, s.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(s.num_experts, generator=g)[:2] for _ in range(T)])
        w = torch.softmax(torch.randn(T, 2, generator=g), -1)
        got, want = strategy.for_visit(lx)(h, None, w, ids), ref(h, None, w, ids)
        assert relerr(got, want) <= 1e-5

    for kind, hardware, want in (("auto", hw, {5: "triton", 200: "triton", 300: "grouped_mm", 5000: "grouped_mm"}),
                                 ("auto", get_preset("h200"), {5: "triton", 5000: "triton"}),
                                 ("auto", None, {5000: "triton"}),
                                 ("grouped_mm", get_preset("h200"), {5: "grouped_mm"}),
                                 ("triton", hw, {5000: "triton"})):
        strategy = X.expert_ffn(kind, ex.family.experts_ffn_from, ws.paging, ws.page_layout, s.num_experts,
                                torch.float32, ex.device, hardware=hardware, shape=shape)
        for T, kernel in want.items():
            ran.clear()
            call(strategy, T)
            assert ran == [(kernel, T), (kernel, T)], (kind, T, ran)  # two groups: paged and resident
        calls = {k: 2 * sum(v == k for v in want.values()) for k in ("triton", "grouped_mm", "mm_loop")}
        assert strategy.choice.calls == calls
    ws.end_visit(visit)
    ex.close()
    with pytest.raises(ValueError, match="ffn must be"):
        CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"),
                        "cpu", ffn="cublas")


def _skip_reference(h, w1, w3, w2, w, ids, skip):
    """The reference over a group's stack, with skip-id pairs (id == E) contributing 0."""
    E = w1.shape[0]
    keep = ids < E
    return experts_ffn_reference(h, w1, w3, w2, torch.where(keep, w, 0.0), torch.where(keep, ids, 0))


@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_cpu_grouped_mm_equals_serial(tiny_dir, resident):
    """CGOPipe on the CPU with expert_ffn grouped_mm forced: the serial executor's greedy tokens (ragged batch of 11,
    4 micro-batches, prefill chunks of 2, 12 new tokens), with and without resident experts (two grouped calls per
    layer, the skip id); every expert call ran grouped_mm (the stats count them per phase)."""
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.pipeline.serial import SerialExecutor
    from lightning_moe.policy.policy import Policy

    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    pol = Policy(mu=3, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", ffn="grouped_mm")
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
    st, L, groups = ex.stats.extra, ex.spec.num_layers, 2 if resident else 1
    assert st["expert_ffn_prefill_calls_grouped_mm"] == L * 7 * groups  # micro-batches of 3, 3, 3, 2: 7 chunks of <= 2
    assert st["expert_ffn_decode_calls_grouped_mm"] == L * 4 * 11 * groups  # 11 decode steps x 4 micro-batches
    assert not any("triton" in k for k in st)


def test_cgopipe_cpu_grouped_mm_int4_scratch_equals_serial(tiny_dir, tmp_path, monkeypatch):
    """int4 pages with grouped_mm forced: each visit dequantizes the layer's 8 experts once into the dense scratch
    (5 paged + 3 resident: two dequantizations per layer visit, the CPU path's unpack_expert_page), and every call
    runs grouped_mm over it; greedy tokens equal the serial executor's; prompt log-probs within 1e-4."""
    from lightning_moe.model.quantize import quantize_checkpoint
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline import expert_ffn as X
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.pipeline.serial import SerialExecutor
    from lightning_moe.policy.policy import Policy

    d = quantize_checkpoint(tiny_dir, str(tmp_path / "int4"), experts="int4").dst
    prompts = _prompts(7, seed=5)
    sp = DecodeSampling(max_new_tokens=6, stop_at_eos=False)
    serial = SerialExecutor(load_checkpoint(d, torch.float32), "cpu", torch.float32)
    ref = serial.generate(prompts, sp)
    unpacked = []
    real = X.unpack_expert_page
    monkeypatch.setattr(X, "unpack_expert_page", lambda p, *a: unpacked.append(p.shape[0]) or real(p, *a))
    pol = Policy(mu=4, n=2, prefill_mu=4, resident_experts=3, dtype="fp32", weight_quant="int4")
    ex = CGOPipeExecutor(load_checkpoint(d, torch.float32), pol, "cpu", ffn="grouped_mm")
    out = ex.generate(prompts, sp)
    assert [o for o, _ in out] == [o for o, _ in ref]
    L = ex.spec.num_layers
    assert unpacked == [5, 3] * (L * 6)  # prefill + 5 decode steps, every layer visit once
    assert tuple(ex.expert_ffn.scratch[0].shape) == (8, ex.spec.intermediate_size, ex.spec.hidden_size)
    assert ex.stats.extra["expert_ffn_prefill_calls_grouped_mm"] == L * 2  # 2 prefill chunks, one call each
    seqs = [p + [5, 6] for p in prompts]
    assert_scores_match(ex.prompt_logprobs(seqs), serial.prompt_logprobs(seqs))
    ex.close()


def test_job_key_grouped_mm(tmp_path):
    """expert_ffn: grouped_mm is a job value, given to the executor as is (auto on the CPU stays the torch loop)."""
    from types import SimpleNamespace

    from lightning_moe.pipeline.expert_ffn import expert_ffn_for

    assert expert_ffn_for(SimpleNamespace(expert_ffn="grouped_mm", device="cpu")) == "grouped_mm"
    assert expert_ffn_for(SimpleNamespace(expert_ffn="auto", device="cpu")) == "torch"
    from lightning_moe.config import EXPERT_FFNS

    assert "grouped_mm" in EXPERT_FFNS


def test_cgopipe_warmup_runs_once_and_changes_nothing(tiny_dir):
    """The prefill warm-up (CGOPipe ``warmup=True``; on by default on CUDA): the first prefill runs layer 0 once more
    over throwaway copies of its distinct chunk shapes. Greedy tokens and prompt log-probs are exactly the run
    without it (fp32 CPU, ragged batch of 11 in chunks of <= 2: five chunk shapes, four warmed); its seconds are in
    ``stats.warmup_seconds`` once (the second call does not warm up again), and the per-phase kernel counts are the
    real calls only."""
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.policy.policy import Policy

    prompts = _prompts(11, seed=3)
    seqs = [p + [5, 6] for p in prompts]
    sp = DecodeSampling(max_new_tokens=5, stop_at_eos=False)
    pol = Policy(mu=3, n=4, prefill_mu=2, resident_experts=0, dtype="fp32", weight_quant="fp32")
    runs = {}
    for warm in (False, True):
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", ffn="grouped_mm", warmup=warm)
        out = ex.generate(prompts, sp)
        first = ex.stats.warmup_seconds
        lp = ex.prompt_logprobs(seqs)
        runs[warm] = (out, lp, first, ex.stats.warmup_seconds, dict(ex.stats.extra))
        ex.close()
    (out0, lp0, w0, _, st0), (out1, lp1, w1, w1_after, st1) = runs[False], runs[True]
    assert out1 == out0
    for (a, ga), (b, gb) in zip(lp1, lp0):
        assert torch.equal(a, b) and torch.equal(ga, gb)
    assert w0 == 0.0 and w1 > 0.0 and w1_after == w1
    L = ex.spec.num_layers  # generate: 7 chunks (micro-batches of 3, 3, 3, 2); scoring: 6 chunks of <= 2 rows
    assert st1["expert_ffn_prefill_calls_grouped_mm"] == st0["expert_ffn_prefill_calls_grouped_mm"] == L * (7 + 6)


@pytest.mark.parametrize("family,kinds", [("mixtral", [0]), ("deepseek_v2", [0, 1]), ("gpt_oss", [0, 1])])
def test_cgopipe_warmup_covers_every_layer_kind(family, kinds):
    """The warm-up runs at the first layer of each kind (a dense FFN or experts, the attention window): DeepSeek's
    dense layer 0 and MoE layer 1, gpt-oss's sliding layer 0 and full layer 1, Mixtral's layer 0 only (a kind's
    first prefill call would otherwise compile inside prefill time), over the prefill chunks' shapes and then the decode
    micro-batches' (the decode step's FFN kernel choice). Greedy tokens equal the run without it."""
    from lightning_moe.model.families import read_spec
    from lightning_moe.model.weights import dummy_weights
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.policy.policy import Policy

    from tests.support.tiny_configs import tiny_family_config

    cfg = tiny_family_config(family, vocab=32, hidden=60, inter=16 if family == "mixtral" else 14, dense_inter=22,
                             lora=12, head=10 if family == "gpt_oss" else 6, rope=4)
    spec = read_spec(cfg)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 32, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    pol = Policy(mu=2, n=2, prefill_mu=2, resident_experts=0, dtype="fp32", weight_quant="fp32")
    outs = {}
    for warm in (False, True):
        ffn_kind = "grouped_mm" if family == "mixtral" else "torch"  # a kernel choice (KernelChoice) / none
        ex = CGOPipeExecutor(dummy_weights(spec, torch.float32, seed=5, scale=0.2), pol, "cpu", warmup=warm,
                             ffn=ffn_kind)
        warmed, ffn_calls = [], []  # the warm-ups' layers; the expert FFN's (layer, tokens, prefill choice) in them
        real, choice = ex._warm_up, getattr(ex.expert_ffn, "choice", None)

        def spy(l, chunks, ffn, mbs):
            warmed.append(l)
            seen = None if ffn is None else (
                lambda h, ew, w, ids: (ffn_calls.append((l, h.shape[0], choice and choice.prefill)), ffn(h, ew, w, ids))[1])
            real(l, chunks, seen, mbs)
            assert choice is None or choice.prefill  # the prefill pass's kernel choice again after the warm-up

        ex._warm_up = spy
        outs[warm] = ex.generate(prompts, DecodeSampling(max_new_tokens=4, stop_at_eos=False))
        ex.generate(prompts[:2], DecodeSampling(max_new_tokens=2, stop_at_eos=False))  # no warm-up again
        ex.close()
        assert warmed == (kinds if warm else [])
        assert (ex.stats.warmup_seconds > 0) == warm
        moe_kinds = [l for l in warmed if not spec.is_dense_layer(l)]
        # each MoE kind's warm-up runs the prefill chunks' FFN and the decode step's at the micro-batch size (2), the
        #   latter with the decode kernel choice (KernelChoice.prefill False; the torch FFN has no choice)
        decode = {(l, t) for l, t, pre in ffn_calls if pre is False or (choice is None and t == 2)}
        assert decode == {(l, 2) for l in moe_kinds}
        assert {l for l, t, pre in ffn_calls if pre or (choice is None and t != 2)} == set(moe_kinds)
    assert outs[True] == outs[False]


def test_cgopipe_scoring_first_still_warms_the_decode():
    """A scoring pass warms the prefill kernels only; the executor's first generation after it warms each kind again
    with its decode step (lm-eval runs loglikelihood requests before generate_until); later passes warm nothing."""
    from lightning_moe.model.families import read_spec
    from lightning_moe.model.weights import dummy_weights
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.policy.policy import Policy

    from tests.support.tiny_configs import tiny_family_config

    spec = read_spec(tiny_family_config("mixtral", vocab=32, hidden=60, inter=16))
    pol = Policy(mu=2, n=2, prefill_mu=2, resident_experts=0, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(dummy_weights(spec, torch.float32, seed=5, scale=0.2), pol, "cpu", warmup=True)
    warmed, real = [], ex._warm_up
    ex._warm_up = lambda l, chunks, ffn, mbs: (warmed.append((l, bool(mbs))), real(l, chunks, ffn, mbs))[1]
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    ex.prompt_logprobs([p + [1] for p in prompts])
    assert warmed == [(0, False)]
    ex.generate(prompts, DecodeSampling(max_new_tokens=2, stop_at_eos=False))
    ex.prompt_logprobs([p + [1] for p in prompts])
    ex.generate(prompts, DecodeSampling(max_new_tokens=2, stop_at_eos=False))
    ex.close()
    assert warmed == [(0, False), (0, True)]
