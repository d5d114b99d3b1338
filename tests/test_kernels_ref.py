"""CPU tests of lightning_moe.kernels.fused_moe: token sort, reference expert FFN, and (when triton is
installed) the Triton kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1).

Every test draws fresh inputs from a fixed seed and states its tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.fused_moe import (
    REFERENCE_ORDERS,
    MoEKernelConfig,
    experts_ffn_hf_grouped,
    experts_ffn_reference,
    fused_experts_triton,
    moe_align,
)

# (T, D, F, E, k, excluded expert or None): T=1, odd T=33, D not a multiple of 16, an expert with no
# tokens, k=1 and k=3 (k=3 makes the slot-sum order matter).
CASES = [
    (1, 64, 48, 8, 2, None),
    (33, 100, 72, 8, 2, 3),
    (33, 100, 72, 4, 1, 0),
    (17, 40, 24, 6, 3, 5),
    (64, 128, 96, 8, 2, 7),
]
CASE_IDS = [f"T{c[0]}-D{c[1]}-F{c[2]}-E{c[3]}-k{c[4]}-skip{c[5]}" for c in CASES]


def make_inputs(T, D, Fd, E, k, skip, dtype=torch.float32, seed=0):
    """Random x [T,D], w1/w3 [E,F,D], w2 [E,D,F] (scaled so activations stay O(1)), routing [T,k].

    Expert ``skip`` (if not None) receives no tokens; ids of a token are distinct (as top-k gives).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w1 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w3 = (torch.randn(E, Fd, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, Fd, generator=g) / Fd**0.5).to(dtype)
    allowed = torch.tensor([e for e in range(E) if e != skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])  # [T, k]
    wts = torch.rand(T, k, generator=g).softmax(dim=-1)  # fp32 [T, k]
    return x, w1, w3, w2, wts, ids.to(torch.int64)


def naive_dense(x, w1, w3, w2, wts, ids):
    """Per-token, per-slot loop straight from the formula (fp32 math)."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            xt = x[t].float()
            h = torch.nn.functional.silu(w1[e].float() @ xt) * (w3[e].float() @ xt)
            out[t] += float(wts[t, j]) * (w2[e].float() @ h)
    return out


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------
# moe_align
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("block_m", [None, 16, 4])
def test_moe_align_groups_pairs_by_expert(case, block_m):
    """Every pair appears once, grouped by expert in increasing pair id; padded blocks hold one expert."""
    T, D, Fd, E, k, skip = case
    *_, ids = make_inputs(T, D, Fd, E, k, skip, seed=1)
    al = moe_align(ids, E, block_m=block_m)
    P = T * k
    flat = ids.reshape(-1)
    assert al.sorted_pair_idx.tolist() == sorted(range(P), key=lambda p: (int(flat[p]), p))
    assert torch.equal(al.sorted_token_idx, al.sorted_pair_idx // k)
    assert al.counts.tolist() == [int((flat == e).sum()) for e in range(E)]
    assert al.expert_offsets[0] == 0 and al.expert_offsets[-1] == P
    for e in range(E):
        run = al.sorted_pair_idx[al.expert_offsets[e]: al.expert_offsets[e + 1]]
        assert bool((flat[run] == e).all())
    if skip is not None:
        assert al.counts[skip] == 0
    if block_m is None:
        assert al.padded_pair_idx is None and al.block_expert is None
        return
    pad, be = al.padded_pair_idx.long(), al.block_expert.long()
    assert pad.numel() == be.numel() * block_m
    real = pad[pad < P]
    assert sorted(real.tolist()) == list(range(P))  # each pair exactly once
    assert bool((pad[pad >= P] == P).all())  # sentinel is P
    for b in range(be.numel()):
        rows = pad[b * block_m: (b + 1) * block_m]
        rows = rows[rows < P]
        if be[b] < 0:
            assert rows.numel() == 0  # unused trailing block
        else:
            assert rows.numel() > 0 and bool((flat[rows] == be[b]).all())
    used = be[be >= 0]
    assert bool((used[1:] >= used[:-1]).all())  # blocks ordered by expert
    assert skip is None or skip not in used.tolist()


def test_moe_align_rejects_bad_input():
    with pytest.raises(ValueError, match="topk_ids must be \\[T, k\\]"):
        moe_align(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="integer"):
        moe_align(torch.zeros(4, 2), 8)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(torch.zeros(4, 2, dtype=torch.int64), 8, block_m=0)


# ---------------------------------------------------------------------------------------------------
# reference FFN
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("order", REFERENCE_ORDERS)
def test_reference_matches_naive_loop_fp32(case, order):
    """fp32 reference (every order, separate and fused gate/up) == naive per-token loop, atol=rtol=1e-5."""
    x, w1, w3, w2, wts, ids = make_inputs(*case, seed=2)
    want = naive_dense(x, w1, w3, w2, wts, ids)
    for fused in (False, True):
        got = experts_ffn_reference(x, w1, w3, w2, wts, ids, order=order, fused_gate_up=fused)
        assert got.dtype == torch.float32 and got.shape == x.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES[:2], ids=CASE_IDS[:2])
def test_hf_grouped_mirror_matches_naive_loop_fp32(case):
    """experts_ffn_hf_grouped (fp32) == naive loop, atol=rtol=1e-5."""
    x, w1, w3, w2, wts, ids = make_inputs(*case, seed=3)
    torch.testing.assert_close(experts_ffn_hf_grouped(x, w1, w3, w2, wts, ids), naive_dense(x, w1, w3, w2, wts, ids),
                               rtol=1e-5, atol=1e-5)


def test_reference_orders_in_bf16():
    """bf16: every order within 2e-2 relative (||a-b||/||b||) of the fp32 result; hf4 differs from hf-eager
    only by rounding the routing weight (so they are not all identical: the orders are really different)."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 128, 96, 8, 2, 3, dtype=torch.bfloat16, seed=4)
    truth = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    outs = {o: experts_ffn_reference(x, w1, w3, w2, wts, ids, order=o) for o in REFERENCE_ORDERS}
    for o, y in outs.items():
        assert y.dtype == torch.bfloat16
        assert rel_err(y, truth) <= 2e-2, o
    assert not torch.equal(outs["hf"], outs["hf-eager"]) or not torch.equal(outs["hf-eager"], outs["hf4"])


def test_reference_skips_experts_without_tokens():
    """An expert with no tokens is never touched: NaN weights there do not leak into the output."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 100, 72, 8, 2, 5, seed=5)
    for w in (w1, w3, w2):
        w[5] = float("nan")
    for order in REFERENCE_ORDERS:
        assert bool(torch.isfinite(experts_ffn_reference(x, w1, w3, w2, wts, ids, order=order)).all())


def test_reference_empty_batch():
    x, w1, w3, w2, wts, ids = make_inputs(1, 64, 48, 8, 2, None, seed=6)
    for order in REFERENCE_ORDERS:
        y = experts_ffn_reference(x[:0], w1, w3, w2, wts[:0], ids[:0], order=order)
        assert y.shape == (0, 64)


def test_reference_rejects_bad_input():
    x, w1, w3, w2, wts, ids = make_inputs(4, 64, 48, 8, 2, None, seed=7)
    with pytest.raises(ValueError, match="w2 must be"):
        experts_ffn_reference(x, w1, w3, w2.transpose(1, 2), wts, ids)
    with pytest.raises(ValueError, match="dtype"):
        experts_ffn_reference(x, w1.double(), w3, w2, wts, ids)
    with pytest.raises(ValueError, match="hidden size"):
        experts_ffn_reference(x[:, :32], w1, w3, w2, wts, ids)
    with pytest.raises(ValueError, match="lie in"):
        experts_ffn_reference(x, w1, w3, w2, wts, ids + 8)
    with pytest.raises(ValueError, match="topk_weights shape"):
        experts_ffn_reference(x, w1, w3, w2, wts[:, :1], ids)
    with pytest.raises(ValueError, match="order"):
        experts_ffn_reference(x, w1, w3, w2, wts, ids, order="fast")


# ---------------------------------------------------------------------------------------------------
# bit-exact agreement with Hugging Face transformers (>= 5: MixtralExperts with gate_up_proj)
# ---------------------------------------------------------------------------------------------------


def _hf_experts(impl, D, Fd, E, k, w1, w3, w2):
    tr = pytest.importorskip("transformers")
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        pytest.skip(f"transformers {tr.__version__} has no MixtralExperts (4.x)")
    cfg = tr.MixtralConfig(hidden_size=D, intermediate_size=Fd, num_local_experts=E, num_experts_per_tok=k)
    try:
        cfg._experts_implementation = impl
    except Exception as exc:  # pragma: no cover - other transformers versions
        pytest.skip(f"cannot select experts_implementation={impl}: {exc}")
    m = MixtralExperts(cfg).to(w1.dtype)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.cat([w1, w3], dim=1))
        m.down_proj.copy_(w2)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_exact_vs_transformers_eager(dtype):
    """order="hf-eager", fused_gate_up=True reproduces transformers' eager MixtralExperts bit for bit."""
    T, D, Fd, E, k = 33, 100, 72, 8, 2
    x, w1, w3, w2, wts, ids = make_inputs(T, D, Fd, E, k, 3, dtype=dtype, seed=8)
    m = _hf_experts("eager", D, Fd, E, k, w1, w3, w2)
    with torch.no_grad():
        want = m(x, ids, wts)
    got = experts_ffn_reference(x, w1, w3, w2, wts, ids, order="hf-eager", fused_gate_up=True)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_exact_vs_transformers_grouped(dtype):
    """experts_ffn_hf_grouped reproduces transformers' default grouped_mm MixtralExperts bit for bit, and the
    reference's order="hf" agrees within 1e-5 (fp32) / 1e-2 (bf16) relative (observed bit-exact in bf16)."""
    T, D, Fd, E, k = 33, 128, 96, 8, 2  # 16-byte-aligned rows: transformers' CPU grouped_mm needs them
    x, w1, w3, w2, wts, ids = make_inputs(T, D, Fd, E, k, 3, dtype=dtype, seed=9)
    m = _hf_experts("grouped_mm", D, Fd, E, k, w1, w3, w2)
    with torch.no_grad():
        want = m(x, ids, wts)
    got = experts_ffn_hf_grouped(x, w1, w3, w2, wts, ids)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    ref = experts_ffn_reference(x, w1, w3, w2, wts, ids, order="hf")
    assert rel_err(ref, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


# ---------------------------------------------------------------------------------------------------
# Triton kernels under the CPU interpreter (the real GPU run is tests/gpu)
# ---------------------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels in Triton's CPU interpreter. triton is imported first, in compiled mode: importing it
    under TRITON_INTERPRET=1 would turn triton's own @jit helpers into interpreter objects for the rest of
    the session and could break compiled Triton code (e.g. tests/gpu) run later in the same process."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


# The interpreter converts fp32 -> bf16 by truncation and mishandles bf16 tl.dot, so it is run in fp32
# (exact semantics: tolerance 1e-5) and fp16 (tolerance 1e-2, as on the GPU).
INTERP_CASES = [CASES[0], CASES[1], CASES[3]]
INTERP_IDS = [CASE_IDS[0], CASE_IDS[1], CASE_IDS[3]]


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
@pytest.mark.parametrize("case", INTERP_CASES, ids=INTERP_IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("config", [None, MoEKernelConfig(16, 16, 16, 1, 1)], ids=["default", "tiny-tiles"])
def test_triton_interpreter_matches_reference(interpret, case, dtype, tol, config):
    """fused_experts_triton (interpreted) vs experts_ffn_reference: ||a-b||/||b|| <= tol."""
    x, w1, w3, w2, wts, ids = make_inputs(*case, dtype=dtype, seed=10)
    got = fused_experts_triton(x, w1, w3, w2, wts, ids, config=config)
    want = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) <= tol


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
def test_triton_interpreter_strided_inputs(interpret):
    """Non-contiguous x and weights viewed with odd strides give the same result (fp32, 1e-5)."""
    x, w1, w3, w2, wts, ids = make_inputs(33, 100, 72, 8, 2, 3, seed=11)
    xs = torch.stack([x, x], dim=-1)[..., 0]  # == x with strides (2D, 2)
    assert torch.equal(xs, x) and xs.stride() == (2 * x.shape[1], 2)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # stride_k != 1
    got = fused_experts_triton(xs, w1t, w3, w2, wts, ids.to(torch.int32))
    assert rel_err(got, experts_ffn_reference(x, w1, w3, w2, wts, ids)) <= 1e-5


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
def test_triton_interpreter_empty_batch(interpret):
    x, w1, w3, w2, wts, ids = make_inputs(1, 64, 48, 8, 2, None, seed=12)
    assert fused_experts_triton(x[:0], w1, w3, w2, wts[:0], ids[:0]).shape == (0, 64)


def test_triton_wrapper_rejects_cpu_and_bad_input(monkeypatch):
    """Validation happens before triton is needed, so this runs without triton too."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w1, w3, w2, wts, ids = make_inputs(4, 64, 48, 8, 2, None, seed=13)
    with pytest.raises(ValueError, match="CUDA"):
        fused_experts_triton(x, w1, w3, w2, wts, ids)
    with pytest.raises(ValueError, match="w3 must be"):
        fused_experts_triton(x, w1, w3[:, :-1], w2, wts, ids)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fused_experts_triton(x.double(), w1.double(), w3.double(), w2.double(), wts, ids)
    with pytest.raises(ValueError, match="integer"):
        fused_experts_triton(x, w1, w3, w2, wts, ids.float())
    with pytest.raises(ValueError, match="power of two"):
        MoEKernelConfig(block_m=8)


def test_kernels_package_imports_without_triton_or_project():
    """kernels/ imports nothing from the rest of lightning_moe and does not import triton eagerly."""
    import subprocess
    import sys

    code = (
        "import sys, lightning_moe.kernels as k\n"
        "bad = [m for m in sys.modules\n"
        "       if m.startswith('lightning_moe.') and not m.startswith('lightning_moe.kernels')]\n"
        "assert not bad, bad\n"
        "assert 'triton' not in sys.modules\n"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


@needs_triton
def test_kernels_compile_for_sm90_without_gpu(monkeypatch):
    """Every kernel compiles to an sm_90 (H100/H200) cubin with triton's bundled ptxas -- no GPU needed --
    for the tile configs the wrappers launch, within the 227 KiB of shared memory of one sm_90 block."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - other triton versions
        pytest.skip(f"triton {triton.__version__}: no ASTSource/GPUTarget ({exc})")
    from lightning_moe.kernels.fused_moe import _triton_kernels, default_kernel_config
    from lightning_moe.kernels.quant import _quant_tiles

    K = _triton_kernels()
    target = GPUTarget("cuda", 90, 32)

    def compile_(fn, ptr_types, consts, cfg):
        sig = {n: ("constexpr" if n in consts else ptr_types.get(n, "i32")) for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
        try:
            c = triton.compile(src, target=target, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        except FileNotFoundError as exc:  # pragma: no cover - a triton wheel without ptxas
            pytest.skip(f"cannot build sm_90 code here: {exc}")
        assert c.metadata.shared <= 232448, (fn.__name__, consts, c.metadata.shared)

    for wdt, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for pairs in (8, 256, 8000):
            cfg = default_kernel_config(pairs, 8, dt)
            base = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                        DOT_PRECISION="ieee" if wdt == "fp32" else "tf32", UPCAST_DOT=False)
            w = "*" + wdt
            compile_(K.gate_up_kernel, dict(x_ptr=w, w1_ptr=w, w3_ptr=w, h_ptr=w, pair_ptr="*i32",
                                            block_expert_ptr="*i32"), base, cfg)
            compile_(K.down_kernel, dict(h_ptr=w, w2_ptr=w, y_ptr="*fp32", pair_ptr="*i32", block_expert_ptr="*i32",
                                         rw_ptr="*fp32"), base, cfg)
            if wdt == "fp32":
                continue
            for G in (128, 48, 40):
                qcfg, tile = _quant_tiles(cfg, (G, G))
                qbase = dict(base, BLOCK_N=qcfg.block_n, BLOCK_K=qcfg.block_k, GROUP=G, TILE_IN_GROUP=tile)
                t = dict(x_ptr=w, h_ptr=w, pair_ptr="*i32", block_expert_ptr="*i32")
                for p in "13":
                    t.update({f"q{p}_ptr": "*u8", f"s{p}_ptr": "*fp16", f"z{p}_ptr": "*fp16"})
                compile_(K.gate_up_q_kernel, t, dict(qbase, BITS_1=4, BITS_3=2), qcfg)
                compile_(K.down_q_kernel, dict(h_ptr=w, q2_ptr="*u8", s2_ptr="*fp16", z2_ptr="*fp16", y_ptr="*fp32",
                                               pair_ptr="*i32", block_expert_ptr="*i32", rw_ptr="*fp32"),
                         dict(qbase, BITS_2=4), qcfg)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
@pytest.mark.parametrize("T", [1, 33])
def test_triton_interpreter_skip_pairs(interpret, T):
    """skip=True: pairs whose id is E are not computed and add 0; the rest equals the reference over only
    those pairs (fp32, 1e-5). Includes an expert with no tokens and a call where every pair is skipped."""
    E, D, Fd, k = 4, 48, 80, 2
    x, w1, w3, w2, wts, ids = make_inputs(T, D, Fd, E, k, 1, dtype=torch.float32, seed=31)  # expert 1: no tokens
    g = torch.Generator().manual_seed(32)
    drop = torch.rand(ids.shape, generator=g) < 0.4  # [T, k] pairs owned by "another group"
    drop[0, 0] = True
    got = fused_experts_triton(x, w1, w3, w2, wts, torch.where(drop, torch.full_like(ids, E), ids), skip=True)
    want = experts_ffn_reference(x, w1, w3, w2, torch.where(drop, torch.zeros_like(wts), wts), ids)
    assert rel_err(got, want) <= 1e-5
    none = fused_experts_triton(x, w1, w3, w2, wts, torch.full_like(ids, E), skip=True)
    assert torch.equal(none, torch.zeros_like(none))
    with pytest.raises(ValueError):
        fused_experts_triton(x, w1, w3, w2, wts, torch.full_like(ids, E))  # E without skip is out of range


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
def test_triton_interpreter_nan_workspaces(interpret, monkeypatch):
    """Issue 41: every buffer the wrappers allocate NaN-filled (nan_empty): the Triton kernel (tiny tiles: many
    padded rows, masked), with and without the skip id, and the grouped_mm / mm_loop paths with the Triton epilogue
    (the combine never loads a skipped pair's NaN row) stay finite and equal the reference (fp32, 1e-5)."""
    from tests.support.nan_workspace import nan_empty

    nan_empty(monkeypatch)
    E = 4
    x, w1, w3, w2, wts, ids = make_inputs(33, 48, 80, E, 2, 1, dtype=torch.float32, seed=51)
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(52)) < 0.4
    skipped = torch.where(drop, torch.full_like(ids, E), ids)
    want = experts_ffn_reference(x, w1, w3, w2, wts, ids)
    want_kept = experts_ffn_reference(x, w1, w3, w2, torch.where(drop, torch.zeros_like(wts), wts), ids)
    for cfg in (None, MoEKernelConfig(16, 16, 16, 1, 1)):
        got = fused_experts_triton(x, w1, w3, w2, wts, ids, config=cfg)
        kept = fused_experts_triton(x, w1, w3, w2, wts, skipped, config=cfg, skip=True)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-5, cfg
        assert torch.isfinite(kept).all() and rel_err(kept, want_kept) <= 1e-5, cfg
    for fn in (fm.fused_experts_grouped_mm, fm.fused_experts_mm_loop):
        kept = fn(x, w1, w3, w2, wts, skipped, skip=True, _epilogue="triton")
        assert torch.isfinite(kept).all() and rel_err(kept, want_kept) <= 1e-5, fn.__name__
