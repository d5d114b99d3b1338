"""The per-expert library-GEMM expert FFN (issue 22): kernels.fused_moe.fused_experts_mm_loop against the torch
reference (bf16 1e-2 relative; one token, odd sizes, an expert with no tokens, k = 1 and 3, the skip id; the fp32
cases with every row blocking are test_grouped_mm_ffn's, parametrized over both library-GEMM paths), the profile's third kernel column (choice by measured shape, decode restricted to
the kernels with no host sync, the HRM's prefill and decode rates), and CGOPipe on the CPU with it forced, and with
it picked for prefill passes only, against the serial executor.

What runs here: torch.mm on the CPU (the same op sequence the GPU runs but for the pinned copy of the group bounds,
which only CUDA takes; tests/gpu/test_mm_loop_gpu.py runs it on CUDA against the Triton kernel).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.nan_workspace import finite_operand_mm, nan_empty
from tests.test_grouped_mm_ffn import CASES, IDS, MIX, _prompts, make_inputs, relerr

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm, fused_experts_mm_loop,
                                             moe_align)
from lightning_moe.policy.hardware import (EXPERT_FFN_KERNELS, NO_SYNC_KERNELS, ExpertFFNRate, HardwareProfile,
                                           get_preset)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_mm_loop_equals_reference_bf16(case):
    """bf16: 1e-2 relative to the fp32 reference over the same bf16 operands, D = 100 included (torch.mm has no
    16-byte stride rule, unlike grouped_mm)."""
    x, w1, w3, w2, wts, ids = make_inputs(*case, dtype=torch.bfloat16)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    got = fused_experts_mm_loop(x, w1, w3, w2, wts, ids)
    assert got.dtype == torch.bfloat16
    assert relerr(got, ref) <= 1e-2


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_mm_loop_nan_workspaces(case, monkeypatch):
    """Issue 41: every buffer the call allocates is NaN-filled (nan_empty: uninitialized memory made deterministic)
    and torch.mm fails on a non-finite operand row: no GEMM reads a row nobody wrote (the padded last block reads
    the spare rows, which the call zeroes), and the result is finite and within bf16 1e-2 / fp32 1e-5 of the
    reference, every row blocking; with the skip id (two groups), the unwritten rows of skipped pairs add 0."""
    nan_empty(monkeypatch)
    seen = finite_operand_mm(monkeypatch)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        x, w1, w3, w2, wts, ids = make_inputs(*case, dtype=dtype)
        ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
        for chunks in (None, 16):
            got = fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks)
            assert torch.isfinite(got).all() and relerr(got, ref) <= tol, (dtype, chunks)
        E = w1.shape[0]
        half = E // 2 or 1  # group A: experts [0, half), group B: the rest (empty when E = 1)
        out = 0
        for lo, hi in ((0, half), (half, E)):
            local = torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, hi - lo))
            out = out + fused_experts_mm_loop(x, w1[lo:hi], w3[lo:hi], w2[lo:hi], wts, local, skip=True)
        assert torch.isfinite(out).all() and relerr(out, ref) <= tol, dtype
    assert any(m % fm.MM_LOOP_TILE == 0 for m in seen)  # the strict torch.mm ran the padded blocks


def test_mm_loop_blocks_by_hand():
    """Row blocks: each expert's rows in equal blocks of at most ``block`` rows rounded up to the tile, experts in
    ascending order, the last block of each padded up to a multiple of the tile; no block for an expert with no rows;
    the block size rounds 2 P / n down to a tile multiple within [tile, MM_LOOP_MAX_ROWS]."""
    assert fm.MM_LOOP_TILE == 32 and fm.MM_LOOP_MAX_ROWS == 2048
    # experts 0..3 hold 5, 0, 35 and 60 rows; blocks of 32
    assert fm.mm_loop_blocks([0, 5, 5, 40, 100], 32) == [(0, 0, 32), (2, 5, 32), (2, 37, 32), (3, 40, 32), (3, 72, 32)]
    # blocks of at most 64: a 65-row expert is two blocks of 33 rows rounded up to 64 (the second padded from 1 row)
    assert fm.mm_loop_blocks([0, 65, 130], 64) == [(0, 0, 64), (0, 64, 32), (1, 65, 64), (1, 129, 32)]
    # blocks of at most 2048: 2070 rows are 1056 + 1014 (padded to 1024), 4097 rows three of 1376 (the last padded)
    assert fm.mm_loop_blocks([0, 2070, 6167], 2048) == [(0, 0, 1056), (0, 1056, 1024), (1, 2070, 1376),
                                                        (1, 3446, 1376), (1, 4822, 1376)]
    assert fm.mm_loop_blocks([0, 0, 0], 64) == []
    assert [fm.mm_loop_block_rows(P, n) for P, n in ((80, 1), (80, 16), (10**6, 1), (12800, 4), (3000, 4), (1, 1))] \
        == [64, 32, 2048, 2048, 1472, 32]


def test_mm_loop_launches_tile_sized_gemms(monkeypatch):
    """The GEMMs by hand: per block of mm_loop_blocks one gate and one up GEMM, then one down GEMM, each of the block's
    padded rows (a multiple of the tile, at most the block size), over its own expert's weights; an expert with no
    rows launches none; on the CPU no warm-up GEMMs."""
    x, w1, w3, w2, wts, ids = make_inputs(40, 32, 24, 6, 2, 4, seed=7)  # P = 80 pairs, expert 4 gets none
    counts = torch.bincount(ids.reshape(-1), minlength=6).tolist()
    assert counts[4] == 0
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    expert_of = {w[e].data_ptr(): e for w in (w1, w3, w2) for e in range(6)}
    real, seen = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append((a.shape[0], b.shape[1], expert_of[b.data_ptr()]))
                        or real(a, b, **kw))
    for n in (1, 16):  # blocks of 64 and of 32 rows (experts hold ~16 rows)
        seen.clear()
        got = fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=n)
        assert relerr(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5
        block = fm.mm_loop_block_rows(80, n)
        want = [(m, e) for e, s, m in fm.mm_loop_blocks(bounds, block)]
        assert all(m % fm.MM_LOOP_TILE == 0 and m <= block for m, _ in want) and 4 not in {e for _, e in want}
        assert sorted((r, e) for r, cols, e in seen if cols == 24) == sorted(want * 2), n  # gate and up
        assert sorted((r, e) for r, cols, e in seen if cols == 32) == sorted(want), n  # down


def test_mm_loop_awkward_row_counts_and_padding_order():
    """Experts of 1, 31, 32, 33, 0 and 2 * 2048 + 5 rows (k = 1: row counts set by hand): fp32 1e-5 to the reference,
    with blocks of at most MM_LOOP_MAX_ROWS, every block padded into the next expert's rows or the spare rows."""
    sizes = [1, 31, 32, 33, 0, 2 * fm.MM_LOOP_MAX_ROWS + 5]
    g = torch.Generator().manual_seed(11)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(sizes)])[torch.randperm(sum(sizes), generator=g)][:, None]
    x, w1, w3, w2, _, _ = make_inputs(ids.shape[0], 16, 24, len(sizes), 1, None, seed=5)
    wts = torch.ones(ids.shape[0], 1)
    ref = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    for chunks in (1, 16):
        assert relerr(fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks), ref) <= 1e-5, chunks


def test_mm_loop_first_call_warms_each_tile_once(monkeypatch):
    """With the warm-up on (as on CUDA; tests/gpu/test_mm_loop_gpu.py runs it there): the first call runs the gate
    GEMM (whose layout the up GEMM shares) and the down GEMM once at each tile row count up to its block, besides its
    blocks' three GEMMs; a second call only its blocks' GEMMs; both equal to the reference (fp32 1e-5)."""
    monkeypatch.setattr(fm, "_MM_LOOP_WARMED", {})
    monkeypatch.setattr(fm, "_warms_tiles", lambda x: True)
    real, seen = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(a.shape[0]) or real(a, b, **kw))
    for seed, warm in ((0, True), (1, False)):
        x, w1, w3, w2, wts, ids = make_inputs(100, 16, 24, 4, 2, None, seed=seed)  # P = 200, block 192
        seen.clear()
        assert relerr(fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=1),
                      experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5
        bounds = [0] + torch.bincount(ids.reshape(-1), minlength=4).cumsum(0).tolist()
        block = fm.mm_loop_block_rows(200, 1)
        tiles = list(range(fm.MM_LOOP_TILE, block + 1, fm.MM_LOOP_TILE))
        assert block == 192 and len(tiles) == 6
        assert sorted(seen) == sorted([m for _, _, m in fm.mm_loop_blocks(bounds, block)] * 3
                                      + (tiles * 2 if warm else [])), seed


def test_mm_loop_warm_runs_each_tile_once(monkeypatch):
    """_mm_loop_warm: one GEMM per tile row count up to the given rows, none again for the same operand layout, only
    the new ones for more rows, all again for another layout (strides)."""
    real, seen = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(a.shape[0]) or real(a, b, **kw))
    monkeypatch.setattr(fm, "_MM_LOOP_WARMED", {})
    t = fm.MM_LOOP_TILE
    a, w, out = torch.randn(5 * t, 8), torch.randn(12, 8), torch.empty(5 * t, 12)
    fm._mm_loop_warm(a, w, out, 3 * t + 5)
    assert seen == [t, 2 * t, 3 * t]
    fm._mm_loop_warm(a, w, out, 3 * t)
    assert seen == [t, 2 * t, 3 * t]
    fm._mm_loop_warm(a, w, out, 5 * t)
    assert seen == [t, 2 * t, 3 * t, 4 * t, 5 * t]
    seen.clear()
    fm._mm_loop_warm(a, torch.randn(8, 12).T, out, t)  # the same shape, transposed storage: another cuBLAS layout
    assert seen == [t]


def test_mm_loop_equals_grouped_mm_and_errors():
    """Equal to grouped_mm (fp32 1e-6: the same roundings, other GEMM kernels); T = 0 gives [0, D]; bad arguments
    raise (the skip id: test_grouped_mm_ffn's two-group test, parametrized over both paths)."""
    x, w1, w3, w2, wts, ids = make_inputs(29, 64, 48, 8, 2, 5, seed=3)
    assert relerr(fused_experts_mm_loop(x, w1, w3, w2, wts, ids), fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)) <= 1e-6
    assert fused_experts_mm_loop(x[:0], w1, w3, w2, wts[:0], ids[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="gate_up_chunks"):
        fused_experts_mm_loop(x, w1, w3, w2, wts, ids, gate_up_chunks=-1)
    with pytest.raises(ValueError, match="_epilogue"):
        fused_experts_mm_loop(x, w1, w3, w2, wts, ids, _epilogue="cuda")


def test_host_bounds_on_the_cpu():
    """The group bounds as a host list, and ``then()``'s result (the gather queued before the wait)."""
    al = moe_align(torch.tensor([[2, 0], [2, 1], [0, 2]]), 4)
    bounds, got = fm._host_bounds(al.expert_offsets[:5], lambda: "gathered")
    assert bounds == [0, 2, 3, 6, 6] and got == "gathered"


# ---- the profile's third kernel: prefill-only choice, the HRM's rates ---------------------------------------------


def loop_profile(**kw):
    """mm_loop fastest at 4096 and 16384, grouped_mm second there; Triton fastest at 64."""
    rows = [ExpertFFNRate(*MIX, "bf16", t, tr, gm, ml) for t, tr, gm, ml in
            ((64, 2.0e14, 1.0e14, 1.5e14), (4096, 3.0e14, 5.0e14, 6.0e14), (16384, 3.6e14, 6.0e14, 7.0e14))]
    return get_preset("h200").with_overrides(expert_ffn_rates=rows, **kw)


def test_profile_picks_mm_loop_for_prefill_only_by_hand(tmp_path):
    """With every kernel: the fastest (mm_loop at 4096 and above); with NO_SYNC_KERNELS (decode): grouped_mm there.
    Rates follow the same kernels (log-T interpolation of each bucket's best of them). A tie goes to the earlier
    kernel; a YAML without the mm_loop key (older profiles) reads it as 0; the round trip keeps it."""
    p = loop_profile()
    assert EXPERT_FFN_KERNELS == ("triton", "grouped_mm", "mm_loop") and NO_SYNC_KERNELS == ("triton", "grouped_mm")
    assert [p.expert_ffn_kernel(*MIX, "bf16", t) for t in (16, 4096, 10**6)] == ["triton", "mm_loop", "mm_loop"]
    assert [p.expert_ffn_kernel(*MIX, "bf16", t, NO_SYNC_KERNELS) for t in (16, 4096, 10**6)] == \
        ["triton", "grouped_mm", "grouped_mm"]
    assert p.expert_ffn_rate(*MIX, "bf16", 4096) == 6.0e14
    assert p.expert_ffn_rate(*MIX, "bf16", 4096, NO_SYNC_KERNELS) == 5.0e14
    assert p.expert_ffn_rate(*MIX, "bf16", 8192) == pytest.approx(6.5e14)  # halfway in log T
    assert p.expert_ffn_rate(*MIX, "bf16", 8192, NO_SYNC_KERNELS) == pytest.approx(5.5e14)
    assert ExpertFFNRate(*MIX, "bf16", 8, 1.0, 2.0, 2.0).best == "grouped_mm"  # tie: the earlier kernel
    assert ExpertFFNRate(*MIX, "bf16", 8).best == "triton"
    only_loop = get_preset("h200").with_overrides(expert_ffn_rates=[ExpertFFNRate(*MIX, "bf16", 64, mm_loop=1e14)])
    assert only_loop.expert_ffn_kernel(*MIX, "bf16", 64) == "mm_loop"
    assert only_loop.expert_ffn_kernel(*MIX, "bf16", 64, NO_SYNC_KERNELS) is None  # nothing measured for decode
    path = tmp_path / "p.yaml"
    p.save(str(path))
    assert HardwareProfile.load(str(path)) == p
    d = p.to_dict()
    for r in d["expert_ffn_rates"]:
        del r["mm_loop"]
    assert all(r.mm_loop == 0 for r in HardwareProfile.from_dict(d).expert_ffn_rates)


def test_hrm_prefill_terms_use_mm_loop_and_decode_terms_do_not():
    """gpu_experts_time(prefill=True) runs at the fastest kernel's rate (mm_loop), the decode default at the fastest
    with no host sync (grouped_mm); prefill_layer_times goes through the prefill rate."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Policy
    from lightning_moe.policy.registry import resolve_spec

    spec, p, T = resolve_spec("mixtral-8x7b"), loop_profile(), 4096
    flops = 2 * T * 2 * 3 * 4096 * 14336
    assert hrm.gpu_experts_time(spec, p, T, prefill=True) == pytest.approx(flops / 6.0e14)
    assert hrm.gpu_experts_time(spec, p, T) == pytest.approx(flops / 5.0e14)
    pol = Policy(mu=8, n=1, prefill_mu=8, dtype="bf16", weight_quant="bf16", resident_experts=0)
    no_loop = p.with_overrides(expert_ffn_rates=[ExpertFFNRate(*r.shape, r.tokens, r.triton, r.grouped_mm)
                                                 for r in p.expert_ffn_rates])
    fast, slow = (hrm.prefill_layer_times(spec, hw, pol, 0, 8, 512).gpu for hw in (p, no_loop))
    T = 8 * 512
    assert slow - fast == pytest.approx(2 * T * 2 * 3 * 4096 * 14336 * (1 / p.expert_ffn_rate(*MIX, "bf16", T, NO_SYNC_KERNELS)
                                                                         - 1 / p.expert_ffn_rate(*MIX, "bf16", T)))


def test_kernel_choice_runs_mm_loop_in_prefill_passes_only(tiny_dir, monkeypatch):
    """CGOPipe on the CPU with a profile where mm_loop is fastest at every size and grouped_mm second: every prefill
    call runs mm_loop, every decode call grouped_mm (a decode step never waits for the host); forced mm_loop runs in
    both. Greedy tokens equal the serial executor's in each case."""
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.expert_ffn import KernelChoice
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.pipeline.serial import SerialExecutor
    from lightning_moe.policy.policy import Policy

    prompts = _prompts(9, seed=4)
    sp = DecodeSampling(max_new_tokens=6, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    pol = Policy(mu=3, n=3, prefill_mu=2, resident_experts=2, dtype="fp32", weight_quant="fp32")
    for forced in (False, True):
        ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", ffn="mm_loop" if forced else "grouped_mm")
        s = ex.spec
        shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
        if not forced:
            hw = get_preset("h200").with_overrides(expert_ffn_rates=[
                ExpertFFNRate(*shape, "fp32", t, triton=0.0, grouped_mm=1e12, mm_loop=2e12) for t in (4, 64)])
            ex.expert_ffn.choice = KernelChoice(None, hw, shape, torch.float32)
        out = ex.generate(prompts, sp)
        ex.close()
        assert [o for o, _ in out] == [o for o, _ in ref], forced
        st, L = ex.stats.extra, s.num_layers
        decode_kernel = "mm_loop" if forced else "grouped_mm"
        assert st["expert_ffn_prefill_calls_mm_loop"] == L * 6 * 2  # micro-batches of 3: 6 chunks of <= 2, 2 groups
        assert st[f"expert_ffn_decode_calls_{decode_kernel}"] == L * 3 * 5 * 2  # 5 decode steps x 3 micro-batches
        assert not any(k.startswith("expert_ffn_decode_calls_mm_loop") for k in st) or forced
        assert ex.expert_ffn.choice.prefill is False


def test_job_key_mm_loop():
    """expert_ffn: mm_loop is a job value, given to the executor as is."""
    from types import SimpleNamespace

    from lightning_moe.config import EXPERT_FFNS
    from lightning_moe.pipeline.expert_ffn import expert_ffn_for

    assert "mm_loop" in EXPERT_FFNS
    assert expert_ffn_for(SimpleNamespace(expert_ffn="mm_loop", device="cpu")) == "mm_loop"
