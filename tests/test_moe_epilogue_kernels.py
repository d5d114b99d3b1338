"""The element-wise epilogues of the grouped_mm expert FFN (kernels.fused_moe.silu_mul_triton, moe_combine_triton)
under Triton's CPU interpreter, against their torch references (silu_mul_reference, moe_combine_reference: the torch
code of fused_experts_grouped_mm), and fused_experts_grouped_mm with the Triton epilogue forced on CPU tensors
against its torch epilogue and experts_ffn_reference.

Tolerances (measured here, stated in the tests):
* silu_mul, bf16 / fp16: within 1 ulp of the dtype and (measured) bit-identical on these inputs; what differs is
  only fp32 ``exp``: the interpreter's kernel takes exp in fp64 rounded to fp32, torch's CPU silu Sleef's expf
  (<= 1 ulp), each silu within 2 fp32 ulp of exact, so fp32 silu_mul within 4 fp32 ulp. The rounding structure
  (silu rounded to the dtype, then its fp32 product with up rounded once, round to nearest even) is tested bit for
  bit: kernel(g, u) == torch.mul(kernel(g, 1), u). On CUDA (libdevice expf, IEEE division) the kernel is bitwise
  torch's: tests/gpu/test_moe_epilogue_gpu.py.
* moe_combine: the fp32 sum differs from torch's only by FMA contraction (torch's CPU addcmul_ contracts, numpy in
  the interpreter does not): fp32 |a - b| <= 1e-6 * sum_j |w_j y_j| per element; bf16 / fp16 within 1 ulp after the
  cast.
"""

from __future__ import annotations

import pytest
import torch
from tests.test_grouped_mm_ffn import make_inputs, relerr

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm, moe_align,
                                             moe_combine_reference, moe_combine_triton, silu_mul_reference,
                                             silu_mul_triton)

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["fp32", "bf16", "fp16"]
SENTINEL = 7.0


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first in compiled mode, as tests/test_kernels_ref.py explains)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their dtype (int64), via the ordered integer image (+0 == -0)."""
    assert a.dtype == b.dtype
    if a.dtype == torch.float32:
        ia, ib, m = a.view(torch.int32).long(), b.view(torch.int32).long(), 0x7FFFFFFF
    else:
        ia, ib, m = a.view(torch.int16).long(), b.view(torch.int16).long(), 0x7FFF
    key = lambda i: torch.where(i < 0, -(i & m), i)  # noqa: E731
    return (key(ia) - key(ib)).abs()


# ---- silu_mul -------------------------------------------------------------------------------------------------

# (M rows, N columns, left / right padding of the output buffer's rows): widths not powers of 2, a one-row call,
# rows more than one tile, column tails
SILU_SHAPES = [(1, 24, 8, 0), (5, 200, 16, 8), (37 * 2, 136, 0, 40), (37 * 6, 1000, 24, 8), (3, 1032, 8, 16)]
SILU_IDS = [f"M{s[0]}-N{s[1]}-pad{s[2]}.{s[3]}" for s in SILU_SHAPES]


def silu_inputs(M, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(M, N, generator=g) * 4).to(dtype)  # covers the saturated tails of silu
    up = torch.randn(M, N, generator=g).to(dtype)
    return gate, up


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=SILU_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_silu_mul_matches_torch_into_strided_view(interpret, shape, dtype, seed):
    """Into a column slice of a wider buffer (row stride != width): the slice gets silu(gate) * up (16-bit: <= 1 ulp,
    and at most 1e-4 of the elements differ (measured: none); fp32 <= 4 ulp), the columns around it are untouched,
    gate and up are not modified."""
    M, N, left, right = shape
    gate, up = silu_inputs(M, N, dtype, seed)
    g0, u0 = gate.clone(), up.clone()
    buf = torch.full((M, left + N + right), SENTINEL, dtype=dtype)
    view = buf[:, left:left + N]
    assert M == 1 or view.stride(0) != N
    got = silu_mul_triton(gate, up, view)
    assert got is view
    want = silu_mul_reference(gate.clone(), up, torch.empty(M, N, dtype=dtype))
    d = ulps(view, want)
    if dtype == torch.float32:
        assert int(d.max()) <= 4
    else:
        assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 1e-4
    assert bool((buf[:, :left] == SENTINEL).all()) and bool((buf[:, left + N:] == SENTINEL).all())
    assert torch.equal(gate, g0) and torch.equal(up, u0)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf / NaN
@pytest.mark.parametrize("seed", [3, 4])
def test_silu_mul_rounds_once_after_rounding_silu_bitwise(interpret, dtype, seed):
    """The roundings, bit for bit: kernel(g, u) == torch.mul(kernel(g, 1), u) (silu rounded to the dtype, then its
    fp32 product with up rounded once to nearest even: what torch.mul does), in place (out = gate, the n_chunks == 1
    path) and into a strided view; special values (0, -0, inf, -inf, NaN, fp32 denormals, saturated silu) as
    torch's silu gives them."""
    gate, up = silu_inputs(37, 264, dtype, seed)
    gate[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 88.8]).to(dtype)
    silu = silu_mul_triton(gate, torch.ones_like(gate), torch.empty_like(gate))
    want = torch.mul(silu, up)
    inplace = gate.clone()
    assert silu_mul_triton(inplace, up) is inplace
    assert torch.equal(inplace, want) or torch.equal(inplace.isnan(), want.isnan()) and torch.equal(
        torch.nan_to_num(inplace), torch.nan_to_num(want))
    special = torch.nn.functional.silu(gate[0, :8].float()).to(dtype)
    assert torch.equal(silu[0, :8].isnan(), special.isnan())
    assert torch.equal(torch.nan_to_num(silu[0, :8]), torch.nan_to_num(special))
    wide = torch.zeros(37, 300, dtype=dtype)
    silu_mul_triton(gate, up, wide[:, 20:284])
    assert torch.equal(torch.nan_to_num(wide[:, 20:284]), torch.nan_to_num(want))


def test_silu_mul_reference_is_the_torch_epilogue():
    """silu_mul_reference: F.silu in place in gate, then torch.mul into out (default: gate)."""
    gate, up = silu_inputs(5, 24, torch.bfloat16, 9)
    want = torch.mul(torch.nn.functional.silu(gate), up)
    g = gate.clone()
    assert silu_mul_reference(g, up) is g and torch.equal(g, want)


@needs_triton
def test_silu_mul_rejects_bad_operands(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate, up = silu_inputs(4, 16, torch.bfloat16, 5)
    with pytest.raises(ValueError, match="CUDA"):
        silu_mul_triton(gate, up)
    with pytest.raises(ValueError, match="up must be"):
        silu_mul_triton(gate, up[:, :8])
    with pytest.raises(ValueError, match="dtype"):
        silu_mul_triton(gate, up.float())
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_mul_triton(gate, up, torch.empty(16, 4, dtype=torch.bfloat16).t())


# ---- moe_combine ----------------------------------------------------------------------------------------------

# (T, k, D): T = 1, 5, 37; k = 1, 2, 4, 6; D = 64, 96, 2880 (gpt-oss: not a multiple of the column block)
COMBINE_SHAPES = [(1, 1, 64), (5, 2, 96), (37, 4, 96), (37, 6, 64), (5, 6, 2880), (37, 2, 2880)]
COMBINE_IDS = [f"T{s[0]}-k{s[1]}-D{s[2]}" for s in COMBINE_SHAPES]


def combine_inputs(T, k, D, dtype, seed, skip, E=8, empty=3, wdtype=torch.float32):
    """yd [P, D] laid out as fused_experts_grouped_mm leaves it (pairs sorted by expert, the skip bucket last), its
    rank [T, k], weights, ids (expert ``empty`` gets no pair; with ``skip`` about a quarter of the ids are E, whose
    rows of yd hold NaN: a kernel that reads them returns NaN)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e != empty])
    ids = allowed[torch.randint(0, len(allowed), (T, k), generator=g)]
    if skip:
        ids = torch.where(torch.rand(T, k, generator=g) < 0.25, E, ids)
        ids[0, 0] = E  # at least one skipped pair
    al = moe_align(ids, E + 1 if skip else E)
    rank = torch.empty_like(al.sorted_pair_idx)
    rank[al.sorted_pair_idx] = torch.arange(T * k)
    rank = rank.view(T, k)
    yd = torch.randn(T * k, D, generator=g).to(dtype)
    if skip:
        yd[rank[ids == E]] = float("nan")
    w = torch.rand(T, k, generator=g).softmax(-1).to(wdtype)
    return yd, rank, w, ids


def assert_combine_close(got, want, yd, rank, w, ids, skip, E=8):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bool(torch.isfinite(got).all())
    if got.dtype == torch.float32:
        terms = yd[rank].float().abs() * w.float().abs()[..., None]  # [T, k, D]
        if skip:
            terms = torch.where((ids == E)[..., None], 0.0, terms)
        assert bool(((got - want).abs() <= 1e-6 * terms.sum(1)).all())
    else:
        assert int(ulps(got, want).max()) <= 1


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("shape", COMBINE_SHAPES, ids=COMBINE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "noskip"])
def test_moe_combine_matches_torch(interpret, shape, dtype, skip):
    """Kernel vs moe_combine_reference over 2 seeds (fp32 1e-6 of sum |w y|, 16-bit 1 ulp); the NaN rows of skipped
    pairs never reach the output; a token whose every slot is skipped is exactly 0."""
    T, k, D = shape
    for seed in (0, 1):
        yd, rank, w, ids = combine_inputs(T, k, D, dtype, seed, skip)
        if skip:
            ids[-1] = 8  # the last token: all slots skipped
            yd[rank[-1]] = float("nan")
        got = moe_combine_triton(yd, rank, w, ids, 8, skip=skip)
        want = moe_combine_reference(yd, rank, w, ids, 8, skip=skip)
        assert_combine_close(got, want, yd, rank, w, ids, skip)
        if skip:
            assert torch.equal(got[-1], torch.zeros(D, dtype=dtype)) and not torch.signbit(got[-1]).any()


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float64], ids=["w-bf16", "w-fp64"])
def test_moe_combine_weight_dtypes_int32_rank_and_strides(interpret, wdtype):
    """Weights in another float dtype are converted to fp32 as torch's .to does; int32 rank and ids; strided (not
    contiguous) rank / weights / ids and yd rows of a wider buffer give the same result."""
    yd, rank, w, ids = combine_inputs(37, 4, 96, torch.bfloat16, 5, True, wdtype=wdtype)
    want = moe_combine_reference(yd, rank, w, ids, 8, skip=True)
    got = moe_combine_triton(yd, rank.to(torch.int32), w, ids.to(torch.int32), 8, skip=True)
    assert_combine_close(got, want, yd, rank, w, ids, True)
    wide = torch.full((yd.shape[0], 128), float("nan"), dtype=yd.dtype)
    wide[:, 16:112] = yd
    t = lambda a: a.t().contiguous().t()  # noqa: E731  same values, column-major
    got2 = moe_combine_triton(wide[:, 16:112], t(rank), t(w), t(ids), 8, skip=True)
    assert torch.equal(got2, got)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_moe_combine_sums_slots_in_increasing_order_from_zero(interpret):
    """fp32, weights 1, rows 1e8, -1e8, 1: slots (rows 0, 1, 2) sum to (1e8 - 1e8) + 1 = 1 in increasing j, slots
    (rows 2, 0, 1) to (1 + 1e8) - 1e8 = 0 (1 + 1e8 rounds to 1e8); slot values -0.0 give +0.0 (the sum starts from
    +0), as the reference."""
    yd = torch.tensor([[1e8, -0.0], [-1e8, -0.0], [1.0, -0.0]])
    w = torch.ones(1, 3)
    for order, value in (([0, 1, 2], 1.0), ([2, 0, 1], 0.0)):
        rank = torch.tensor([order])
        got = moe_combine_triton(yd, rank, w, rank, 8)
        assert torch.equal(got, moe_combine_reference(yd, rank, w, rank, 8))
        assert got.tolist() == [[value, 0.0]] and not torch.signbit(got).any()


@needs_triton
def test_moe_combine_rejects_bad_operands(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yd, rank, w, ids = combine_inputs(5, 2, 64, torch.bfloat16, 6, True)
    with pytest.raises(ValueError, match="CUDA"):
        moe_combine_triton(yd, rank, w, ids, 8, skip=True)
    with pytest.raises(ValueError, match="rank must be"):
        moe_combine_triton(yd, rank.float(), w, ids, 8)
    with pytest.raises(ValueError, match="topk_weights shape"):
        moe_combine_triton(yd, rank, w[:, :1], ids, 8)
    with pytest.raises(ValueError, match="skip needs num_experts"):
        moe_combine_triton(yd, rank, w, ids, None, skip=True)
    with pytest.raises(ValueError, match="contiguous last dim"):
        moe_combine_triton(yd.t().contiguous().t(), rank, w, ids, 8)


# ---- fused_experts_grouped_mm with the Triton epilogue ----------------------------------------------------------

# (T, D, F, E, k, expert given no tokens): from tests/test_grouped_mm_ffn.py, D and F multiples of 8 (16-bit
# grouped_mm), k up to 6, T = 1, 5, 37
FUSED_CASES = [(1, 64, 48, 8, 2, None), (5, 96, 72, 8, 6, 3), (37, 64, 120, 6, 4, 5), (37, 128, 96, 8, 1, 7)]
FUSED_IDS = [f"T{c[0]}-D{c[1]}-F{c[2]}-E{c[3]}-k{c[4]}-empty{c[5]}" for c in FUSED_CASES]
fused_inputs = make_inputs  # tests/test_grouped_mm_ffn.py's inputs: an expert with no tokens, distinct ids
REF_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # tests/test_grouped_mm_ffn.py's


def assert_epilogues_agree(tri, tor):
    """The Triton epilogue vs the torch one: 16-bit within 1 ulp (silu_mul measured bit-identical, the combine's fp32
    sum differs by FMA contraction); fp32 1e-5 relative (silu within 4 ulp goes through the down GEMM)."""
    assert tri.dtype == tor.dtype and tri.shape == tor.shape and bool(torch.isfinite(tri).all())
    if tri.dtype == torch.float32:
        assert relerr(tri, tor) <= 1e-5
    else:
        assert int(ulps(tri, tor).max()) <= 1


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_grouped_mm_triton_epilogue_equals_torch_epilogue(interpret, case, dtype):
    """fused_experts_grouped_mm with _epilogue="triton" (interpreted, CPU tensors) vs _epilogue="torch", for one
    full-width gate/up chunk (in place) and 4 column chunks (strided views; widths 24, 32 + 24, 24: not powers of 2); both
    within tests/test_grouped_mm_ffn.py's tolerance of experts_ffn_reference."""
    x, w1, w3, w2, wts, ids = fused_inputs(*case, dtype=dtype, seed=sum(case[:5]))
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    for chunks in (1, 4):
        tri = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks, _epilogue="triton")
        tor = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks, _epilogue="torch")
        assert_epilogues_agree(tri, tor)
        assert relerr(tri, ref) <= REF_TOL[dtype], chunks


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # silu_mul over the skipped pairs' unwritten gate rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_triton_epilogue_skip_groups(interpret, dtype):
    """Two skip-id calls (paged / resident experts, as CGOPipe runs them) with the Triton epilogue: each equals the
    torch epilogue's call and their sum the one-call reference; a call whose pairs are all skipped is exactly 0 (the
    unwritten rows of yd are never read)."""
    x, w1, w3, w2, wts, ids = fused_inputs(37, 64, 48, 8, 2, 5, dtype=dtype, seed=3)
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    a = ids < 4
    la, lb = torch.where(a, ids, torch.full_like(ids, 4)), torch.where(~a, ids - 4, torch.full_like(ids, 4))
    out = 0
    for sl, loc in ((slice(0, 4), la), (slice(4, 8), lb)):
        tri = fused_experts_grouped_mm(x, w1[sl], w3[sl], w2[sl], wts, loc, skip=True, _epilogue="triton")
        tor = fused_experts_grouped_mm(x, w1[sl], w3[sl], w2[sl], wts, loc, skip=True, _epilogue="torch")
        assert_epilogues_agree(tri, tor)
        out = out + tri.float()
    assert relerr(out, ref) <= REF_TOL[dtype]
    none = fused_experts_grouped_mm(x, w1[:4], w3[:4], w2[:4], wts, torch.full_like(ids, 4), skip=True,
                                    _epilogue="triton")
    assert torch.equal(none, torch.zeros_like(none))


def test_grouped_mm_epilogue_choice(monkeypatch):
    """Auto (None) on CPU tensors takes the torch epilogue (the Triton wrappers are not called); an unknown value is
    refused."""
    def boom(*a, **kw):
        raise AssertionError("Triton epilogue called on the CPU")

    monkeypatch.setattr(fm, "silu_mul_triton", boom)
    monkeypatch.setattr(fm, "moe_combine_triton", boom)
    x, w1, w3, w2, wts, ids = fused_inputs(5, 64, 48, 8, 2, None, dtype=torch.float32, seed=1)
    got = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)
    assert relerr(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5
    with pytest.raises(ValueError, match="_epilogue"):
        fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, _epilogue="cuda")


# ---- row counts are not specialized -------------------------------------------------------------------------------

ROW_COUNT_ARGS = [("_triton_kernels", k, "num_pairs") for k in
                  ("gate_up_kernel", "down_kernel", "gate_up_q_kernel", "down_q_kernel", "gate_up_mx_kernel",
                   "down_mx_kernel")] + [("_triton_kernels", "silu_mul_kernel", "M"),
                                         ("_triton_norm_rope", "rms_norm_kernel", "R")]


@needs_triton
@pytest.mark.parametrize("module,kernel,arg", ROW_COUNT_ARGS, ids=[f"{k}.{a}" for _, k, a in ROW_COUNT_ARGS])
def test_row_count_arguments_are_not_specialized(module, kernel, arg, monkeypatch):
    """The kernels' row-count arguments vary call to call (routed pairs, rows of a block, tokens of a chunk): each is
    declared do_not_specialize, so a new value's divisibility by 16 (or == 1) never compiles a second variant in the
    middle of a prefill (tests/gpu/test_mm_loop_gpu.py counts the compiled variants on CUDA)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = getattr(fm._triton_kernels(module), kernel)
    assert [p.name for p in fn.params if p.do_not_specialize] == [arg]


# ---- moe_align_triton ---------------------------------------------------------------------------------------

# (T tokens, k slots, E experts, id dtype, how the ids are drawn): one pair, E 1, E not a power of 2, pairs past
# one block (BLOCK = 8192 / E_PAD: 1024 at E 8, 128 at E 33..64), an expert with no pairs, every pair on one
# expert, int32 ids, a non-contiguous [T, k] view
ALIGN_CASES = [(1, 1, 1, torch.int64, "random"), (7, 2, 3, torch.int64, "random"), (1100, 2, 8, torch.int64, "random"),
               (300, 2, 40, torch.int32, "random"), (257, 3, 8, torch.int64, "no-expert-5"),
               (90, 2, 8, torch.int64, "one-expert"), (500, 2, 8, torch.int64, "transposed")]
ALIGN_IDS = [f"T{c[0]}-k{c[1]}-E{c[2]}-{str(c[3])[6:]}-{c[4]}" for c in ALIGN_CASES]


@needs_triton
@pytest.mark.parametrize("case", ALIGN_CASES, ids=ALIGN_IDS)
def test_moe_align_triton_equals_moe_align(interpret, case):
    """moe_align_triton (interpreted) returns moe_align's four tensors exactly: the stable order by expert (pairs of
    one expert in increasing pair id), their tokens, the counts and the offsets, int64."""
    T, k, E, dt, how = case
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.randint(0, E, (T, k), generator=g)
    if how == "no-expert-5":
        ids = torch.where(ids == 5, 6, ids)
    if how == "one-expert":
        ids = torch.full((T, k), E - 2, dtype=torch.int64)
    if how == "transposed":
        ids = torch.randint(0, E, (k, T), generator=g).t()  # [T, k] with strides (1, T)
    ids = ids.to(dt)
    want = moe_align(ids, E)
    got = fm.moe_align_triton(ids, E)
    for name in ("sorted_token_idx", "expert_offsets", "sorted_pair_idx", "counts"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int64 and torch.equal(a, b), name
    assert got.block_m is None and got.padded_pair_idx is None and got.block_expert is None


@needs_triton
def test_moe_align_triton_skip_bucket_and_refusals(interpret):
    """With the skip id E counted as a bucket (num_experts E + 1, as the FFNs call it) the skipped pairs come last;
    an id past the buckets is left out of the offsets; the wrapper refuses what its one program cannot take."""
    E = 6
    ids = torch.tensor([[E, 0], [2, E], [0, 2], [5, 1]])
    want, got = moe_align(ids, E + 1), fm.moe_align_triton(ids, E + 1)
    assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
    assert got.expert_offsets.tolist()[-2:] == [6, 8]
    out = fm.moe_align_triton(torch.tensor([[0, E + 3], [1, 0]]), E + 1)
    assert out.expert_offsets[-1] == 3 and out.sorted_pair_idx[:3].tolist() == [0, 3, 2]
    assert fm.moe_align_triton(ids[:0], E).expert_offsets.tolist() == [0] * (E + 1)
    with pytest.raises(ValueError, match="one-program limit"):
        fm.moe_align_triton(torch.zeros(fm.MOE_ALIGN_TRITON_MAX // 8 + 1, 1, dtype=torch.int64), 8)
    for dt in (torch.int16, torch.uint8):  # the FFNs accept these id dtypes: one int32 copy, the same grouping
        assert all(torch.equal(a, b) for a, b in zip(fm.moe_align_triton(ids.to(dt), E + 1)[:4], want[:4]))
    with pytest.raises(ValueError, match="int64/int32/int16/uint8"):
        fm.moe_align_triton(ids.float(), E)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        fm.moe_align_triton(ids.reshape(-1), E)


def test_moe_align_triton_refuses_cpu_tensors_when_compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        fm.moe_align_triton(torch.zeros(2, 2, dtype=torch.int64), 4)
