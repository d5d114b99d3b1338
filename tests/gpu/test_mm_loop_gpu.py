"""The per-expert library-GEMM expert FFN (kernels.fused_moe.fused_experts_mm_loop) on CUDA: cuBLAS GEMMs over
row slices, the pinned copy of the group bounds (one host wait per call), rows past the last bound unwritten (the
skip bucket), fp16 and D not a multiple of 8 (no 16-byte rule), the tile row counts run once by the first call, the
Triton epilogue's row count compiled once, and CGOPipe with the profile picking it for prefill
only (CGOPipe with it forced: test_grouped_mm_gpu.py's CGOPipe test, parametrized over both library kernels). Run on a CUDA host: ``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.gpu.test_grouped_mm_gpu import _inputs, _rel, _seqs  # noqa: E402

from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm,  # noqa: E402
                                             fused_experts_mm_loop, fused_experts_triton)
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.expert_ffn import KernelChoice  # noqa: E402
from lightning_moe.policy.hardware import ExpertFFNRate, get_preset  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


@pytest.mark.parametrize("T,D", [(1, 512), (33, 500), (512, 512), (4096, 512)])
def test_mm_loop_matches_reference_triton_and_grouped_mm(T, D):
    """bf16, an expert with no tokens: 1e-2 relative to the fp32 reference and to the Triton kernel; equal to
    grouped_mm within 1e-2 (D = 500: grouped_mm refuses it, mm_loop takes it); every gate/up row blocking; fp16."""
    x, w1, w3, w2, wts, ids = _inputs(T, D=D, empty=3)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    got = fused_experts_mm_loop(x, w1, w3, w2, wts, ids)
    tri = fused_experts_triton(x, w1, w3, w2, wts, ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, ref) < 1e-2 and _rel(got, tri) < 1e-2
    if D % 8 == 0:
        assert _rel(got, fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)) < 1e-2
    for chunks in (1, 4, 16):
        assert _rel(fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks), ref) < 1e-2
    h = fused_experts_mm_loop(x.half(), w1.half(), w3.half(), w2.half(), wts, ids)
    assert h.dtype == torch.float16 and _rel(h, ref) < 1e-2


def test_mm_loop_skip_rows_and_one_host_wait(monkeypatch):
    """Two groups with the skip id sum to one call (the unwritten skip rows add exactly 0); each call waits on the
    host once (one Event.synchronize) and makes no other sync (set_sync_debug_mode('error'))."""
    x, w1, w3, w2, wts, ids = _inputs(300, seed=1)
    ref = fused_experts_mm_loop(x, w1, w3, w2, wts, ids)
    a = ids < 5
    la = torch.where(a, ids, torch.full_like(ids, 5))
    lb = torch.where(~a, ids - 5, torch.full_like(ids, 3))
    waits, real = [], torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waits.append(1) or real(self))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ya = fused_experts_mm_loop(x, w1[:5], w3[:5], w2[:5], wts, la, validate=False, skip=True)
        yb = fused_experts_mm_loop(x, w1[5:], w3[5:], w2[5:], wts, lb, validate=False, skip=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(waits) == 2
    assert torch.isfinite(ya).all() and torch.isfinite(yb).all() and _rel(ya + yb, ref) < 1e-2
    none = fused_experts_mm_loop(x, w1[:5], w3[:5], w2[:5], wts, torch.full_like(ids, 5), skip=True)
    assert torch.equal(none, torch.zeros_like(none))


def test_cgopipe_auto_runs_mm_loop_in_prefill_only(tiny_dir):
    """A profile where mm_loop is fastest at every size, grouped_mm second: generation runs mm_loop in the prefill
    and grouped_mm in every decode step (no host wait per decode call); greedy tokens equal the torch path's for all
    but at most one of the 9 sequences (bf16 near-ties of the random tiny model)."""
    from lightning_moe.pipeline.sampling import DecodeSampling

    seqs, sp = _seqs(), DecodeSampling(max_new_tokens=8, stop_at_eos=False)
    pol = Policy(mu=3, n=3, prefill_mu=3, resident_experts=2, dtype="bf16", weight_quant="bf16")
    outs = {}
    for ffn in ("torch", "auto"):
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.bfloat16), pol, "cuda", ffn=ffn)
        if ffn == "auto":
            s = ex.spec
            shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
            hw = get_preset("h200").with_overrides(expert_ffn_rates=[
                ExpertFFNRate(*shape, "bf16", t, triton=1e11, grouped_mm=1e12, mm_loop=2e12) for t in (4, 64)])
            ex.expert_ffn.choice = KernelChoice(None, hw, shape, torch.bfloat16)
        outs[ffn] = [o for o, _ in ex.generate(seqs, sp)]
        st = dict(ex.stats.extra)
        ex.close()
    assert st.get("expert_ffn_prefill_calls_mm_loop", 0) > 0 and st.get("expert_ffn_decode_calls_grouped_mm", 0) > 0
    assert not any(k.startswith("expert_ffn_decode_calls_mm_loop") or k.startswith("expert_ffn_prefill_calls_grouped")
                   for k in st)
    same = sum(a == b for a, b in zip(outs["auto"], outs["torch"]))
    assert same >= len(seqs) - 1, f"{same} of {len(seqs)} greedy sequences equal"


def test_mm_loop_first_call_runs_each_tile_once(monkeypatch):
    """Mixtral-like routing over 8 experts, 4096 tokens (P 8192, blocks of 2048 rows): the first call runs the gate
    (whose layout the up GEMM shares) and the down GEMM once at each of the 64 tile row counts before its own; a
    second call with other row counts runs only its own blocks' GEMMs, every one of a tile row count; both 1e-2
    relative to the fp32 reference."""
    from lightning_moe.kernels import fused_moe as fm

    monkeypatch.setattr(fm, "_MM_LOOP_WARMED", {})
    real, seen = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(a.shape[0]) or real(a, b, **kw))
    tiles = list(range(fm.MM_LOOP_TILE, fm.MM_LOOP_MAX_ROWS + 1, fm.MM_LOOP_TILE))
    for seed, warm in ((0, True), (1, False)):
        x, w1, w3, w2, wts, ids = _inputs(4096, D=512, seed=seed)
        seen.clear()
        got = fused_experts_mm_loop(x, w1, w3, w2, wts, ids)
        ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
        assert _rel(got, ref) < 1e-2
        counts = torch.bincount(ids.reshape(-1), minlength=w1.shape[0]).tolist()
        bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
        blocks = fm.mm_loop_blocks(bounds, fm.mm_loop_block_rows(ids.numel(), fm.grouped_mm_gate_up_chunks(
            512, w1.shape[1], ids.shape[1])))
        assert sorted(seen) == sorted([m for _, _, m in blocks] * 3 + (tiles * 2 if warm else [])), seed


def test_triton_row_counts_compile_once():
    """silu_mul and rms_norm over 16, 17, 33 and 2000 rows: one compiled variant each (the row count is not
    specialized on its divisibility by 16), with results equal to their torch references."""
    from lightning_moe.kernels import fused_moe as fm
    from lightning_moe.kernels.norm_rope import rms_norm_torch, rms_norm_triton

    kern, nr = fm._triton_kernels(), fm._triton_kernels("_triton_norm_rope")

    def variants(fn):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            pytest.skip("this triton keeps no per-device kernel cache to count")
        return sum(len(c[0]) for c in caches.values())

    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    for M in (16, 17, 33, 2000):
        g, u = torch.randn(2, M, 256, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(fm.silu_mul_triton(g.clone(), u), fm.silu_mul_reference(g.clone(), u))
        torch.testing.assert_close(rms_norm_triton(g, w, 1e-5), rms_norm_torch(g, w, 1e-5), rtol=2 ** -6, atol=0)  # 2 ulps
        if M == 16:
            first = (variants(kern.silu_mul_kernel), variants(nr.rms_norm_kernel))
    assert (variants(kern.silu_mul_kernel), variants(nr.rms_norm_kernel)) == first
