"""The native CPU decode attention kernel (kernels/cpu_attention.py) against its pure-torch reference.

Tolerances (relative Frobenius error of the output rows): fp32 1e-5, fp16 2e-3, bf16 1e-2 (the kernel keeps scores
in fp32 where the reference rounds them to the storage dtype, as transformers' eager attention does). The
appended K/V rows must be bit-identical, and output rows outside ``rows`` must stay untouched.
"""

import os

import pytest
import torch

from lightning_moe.kernels import cpu_attention as C
from lightning_moe.model.layers import decode_attention
from lightning_moe.model.spec import MoESpec
from lightning_moe.pipeline.cpu_attention import cpu_decode_attention
from lightning_moe.pipeline.kv_cache import GroupedKVCache

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _need_kernel():
    if os.environ.get("LIGHTNING_MOE_CPU_ATTENTION", "").lower() == "sdpa":
        pytest.skip("native CPU attention disabled by LIGHTNING_MOE_CPU_ATTENTION=sdpa")
    if not C.native_available():
        pytest.fail("the native CPU attention kernel did not build (a C++ compiler with OpenMP and ninja are needed; "
                    "the warning logged above names what failed)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _case(dtype, B, Hq, Hkv, hd, S, lens, rows, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    Bg = len(rows)
    return dict(q=r(B, Hq, hd), k_new=r(B, Hkv, hd), v_new=r(B, Hkv, hd), rows=torch.tensor(rows, dtype=torch.int64),
                k_cache=r(Bg, Hkv, S, hd), v_cache=r(Bg, Hkv, S, hd), lengths=torch.tensor(lens, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,hd", [(32, 8, 128), (8, 2, 16), (7, 1, 20), (6, 2, 33), (1, 1, 128), (12, 4, 100)])
@pytest.mark.parametrize("window", [None, 5])
def test_append_attend_matches_reference(dtype, Hq, Hkv, hd, window):
    """Awkward shapes: one position (length 0 + the new token), the last slot (S-1), G = 1, 3, 4, 6, 7 query heads per
    KV head (head blocks of 4, 2, 1), hd = 128 (the compile-time path) and odd head dims; a permuted subset of rows."""
    B, S = 9, 21
    rows, lens = [6, 0, 3, 8, 1], [0, 7, 20, 13, 1]
    a = _case(dtype, B, Hq, Hkv, hd, S, lens, rows, seed=hash((Hq, hd, str(dtype), window)) % 1000)
    b = {k: v.clone() for k, v in a.items()}
    out_k = torch.full((B, Hq * hd), float("nan"), dtype=dtype)
    out_r = out_k.clone()
    C.decode_attention_append(**a, out=out_k, sliding_window=window)
    C.decode_attention_append_reference(**b, out=out_r, sliding_window=window)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])  # append: exact
    r = a["rows"]
    others = [i for i in range(B) if i not in rows]
    assert torch.isnan(out_k[others]).all()  # rows of other groups untouched
    assert torch.isfinite(out_k[r]).all()
    assert _rel(out_k[r], out_r[r]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,hd", [(8, 2, 16), (7, 1, 20), (64, 8, 64), (12, 4, 128)])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_the_reference_and_the_family(dtype, Hq, Hkv, hd, window):
    """Attention sinks (gpt-oss): one fp32 logit per query head in the softmax, its share dropped. The kernel equals
    the reference (and, fp32, gpt-oss's own torch decode attention) on the awkward shapes above (a row of one
    position, G = 4 / 7 / 8 / 3 query heads per KV head, hd 128 and odd), with sinks large enough to take most of
    some heads' probability."""
    from types import SimpleNamespace

    from lightning_moe.model.families import gpt_oss

    B, S = 9, 21
    rows, lens = [6, 0, 3, 8, 1], [0, 7, 20, 13, 1]
    a = _case(dtype, B, Hq, Hkv, hd, S, lens, rows, seed=hash((Hq, hd, str(dtype), window, "sinks")) % 1000)
    sinks = 3.0 * torch.randn(Hq, generator=torch.Generator().manual_seed(Hq + hd))
    b = {k: v.clone() for k, v in a.items()}
    c = {k: v.clone() for k, v in a.items()}
    out_k = torch.full((B, Hq * hd), float("nan"), dtype=dtype)
    out_r, out_plain = out_k.clone(), out_k.clone()
    C.decode_attention_append(**a, out=out_k, sliding_window=window, sinks=sinks)
    C.decode_attention_append_reference(**b, out=out_r, sliding_window=window, sinks=sinks)
    C.decode_attention_append(**c, out=out_plain, sliding_window=window)
    r = a["rows"]
    assert torch.isfinite(out_k[r]).all()
    assert _rel(out_k[r], out_r[r]) < TOL[dtype]
    assert _rel(out_plain[r], out_r[r]) > 10 * TOL[dtype]  # the sinks change the output
    if dtype == torch.float32:  # the family's own decode attention over the appended cache
        fam = gpt_oss.decode_attention(SimpleNamespace(sinks=sinks), a["q"][r], a["k_cache"], a["v_cache"],
                                       a["lengths"] + 1, window)
        assert _rel(out_k[r], fam) < TOL[dtype]
    with pytest.raises(ValueError, match="sinks must be"):
        C.decode_attention_append(**c, out=out_plain, sinks=sinks[:-1])


def test_attend_without_append_and_sliced_cache():
    """k_new = v_new = None: attend over ``lengths`` positions of a slice [:, :, :n] of a larger cache."""
    a = _case(torch.float32, 4, 8, 2, 16, 30, [3, 10, 1, 7], [0, 1, 2, 3], seed=5)
    K, V = a["k_cache"][:, :, :12], a["v_cache"][:, :, :12]  # strided views, positions contiguous per head
    out = torch.empty(4, 8 * 16)
    C.decode_attention_append(a["q"], None, None, a["rows"], K, V, a["lengths"], out)
    ref = decode_attention(a["q"], K, V, a["lengths"])
    assert _rel(out, ref) < 1e-5


def test_empty_group_is_a_no_op():
    a = _case(torch.bfloat16, 3, 4, 2, 8, 6, [], [], seed=1)
    out = torch.full((3, 32), 7.0, dtype=torch.bfloat16)
    C.decode_attention_append(**a, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("what", ["len_full", "len_neg", "row_range", "dtype", "heads", "strides", "half_append"])
def test_bad_inputs_raise(what):
    a = _case(torch.float32, 4, 8, 2, 16, 10, [1, 2], [0, 3], seed=2)
    out = torch.empty(4, 128)
    if what == "len_full":
        a["lengths"] = torch.tensor([1, 10])  # position 10 does not exist
    elif what == "len_neg":
        a["lengths"] = torch.tensor([-1, 2])
    elif what == "row_range":
        a["rows"] = torch.tensor([0, 4])
    elif what == "dtype":
        a["q"] = a["q"].to(torch.bfloat16)
    elif what == "heads":
        a["q"] = torch.randn(4, 7, 16)  # 7 query heads over 2 KV heads
        out = torch.empty(4, 7 * 16)
    elif what == "strides":
        a["k_cache"] = a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)  # positions not contiguous
    elif what == "half_append":
        a["v_new"] = None
    with pytest.raises(ValueError):
        C.decode_attention_append(**a, out=out)


def _spec():
    return MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=16, num_experts=2, top_k=1, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=4096)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_grouped_cache_append_attend(native, sinks, monkeypatch):
    """GroupedKVCache.append_attend (one native call per group, or the torch fallback) equals append + attend with
    the reference attention, rows back in the caller's order, for ragged lengths in several groups; with sinks
    (gpt-oss), against gpt-oss's own decode attention."""
    from types import SimpleNamespace

    from lightning_moe.model.families import gpt_oss

    sk = 2.0 * torch.randn(8, generator=torch.Generator().manual_seed(5)) if sinks else None
    if not native:
        monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "sdpa")
    spec = _spec()
    g = torch.Generator().manual_seed(11 + native)
    lens = torch.randint(1, 40, (13,), generator=g)
    caches = [GroupedKVCache(spec, (lens + 3).tolist(), torch.float32, max_groups=4) for _ in range(2)]
    for c in caches:
        c.lengths[:] = lens
        for l in range(spec.num_layers):
            for t in c.k[l] + c.v[l]:
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())))
    assert caches[0].num_groups > 1
    q, k, v = (torch.randn(13, h, 16, generator=g) for h in (8, 2, 2))
    out = torch.full((13, 128), float("nan"))
    caches[0].append_attend(1, q, k, v, out, sinks=sk)
    caches[1].append(1, torch.arange(13), k, v)
    if sinks:
        ref = caches[1].attend(1, q, lens + 1, lambda qg, K, V, n: gpt_oss.decode_attention(
            SimpleNamespace(sinks=sk), qg, K, V, n))
    else:
        ref = caches[1].attend(1, q, lens + 1, lambda qg, K, V, n: decode_attention(qg, K, V, n))
    assert _rel(out, ref) < 1e-5
    for a, b in zip(caches[0].k[1] + caches[0].v[1], caches[1].k[1] + caches[1].v[1]):
        assert torch.equal(a, b)


def test_cpu_decode_attention_native_equals_sdpa(monkeypatch):
    """The public routine gives the same result through the native kernel and through PyTorch's SDPA (bf16)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 32, 128, generator=g).bfloat16()
    k, v = (torch.randn(6, 8, 50, 128, generator=g).bfloat16() for _ in range(2))
    n = torch.tensor([1, 50, 17, 33, 2, 49])
    native = cpu_decode_attention(q, k, v, n)
    monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "sdpa")
    sdpa = cpu_decode_attention(q, k, v, n)
    assert _rel(native, sdpa) < 1e-2 and not torch.equal(native, sdpa)  # two different routines, one result


def test_bad_mode_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "spda")
    with pytest.raises(ValueError, match="LIGHTNING_MOE_CPU_ATTENTION='spda'"):
        C.native_available()
    monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "Native")
    assert C.native_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("append", [True, False])
def test_groups_in_one_call_equal_one_call_per_group(dtype, window, append):
    """decode_attention_append_groups (one parallel region, longest rows first) == decode_attention_append once per
    group, bit for bit: outputs, appended K/V; groups of different S, an empty group, rows interleaved across groups,
    and rows in no group left untouched. Each call is also checked against the pure-torch reference."""
    B, Hq, Hkv, hd = 11, 8, 2, 128
    groups = [([9, 2, 5], [0, 30, 17], 31), ([], [], 4), ([0, 7], [3, 1], 8), ([4, 1, 6, 10], [12, 12, 2, 40], 41)]
    if not append:  # attend over ``lengths`` positions: lengths >= 1
        groups = [(r, [max(1, n) for n in lens], S) for r, lens, S in groups]
    g = torch.Generator().manual_seed(11 + append + 2 * (window is not None))
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, kn, vn = rnd(B, Hq, hd), rnd(B, Hkv, hd), rnd(B, Hkv, hd)
    caches = [(rnd(len(r), Hkv, S, hd), rnd(len(r), Hkv, S, hd)) for r, _, S in groups]
    rows = [torch.tensor(r, dtype=torch.int64) for r, _, _ in groups]
    lens = [torch.tensor(n, dtype=torch.int64) for _, n, _ in groups]
    one = [(k.clone(), v.clone()) for k, v in caches]
    ref = [(k.clone(), v.clone()) for k, v in caches]
    out_g = torch.full((B, Hq * hd), float("nan"), dtype=dtype)
    out_1, out_r = out_g.clone(), out_g.clone()
    nk, nv = (kn, vn) if append else (None, None)
    C.decode_attention_append_groups(q, nk, nv, rows, [k for k, _ in caches], [v for _, v in caches], lens, out_g, window)
    for i in range(len(groups)):
        C.decode_attention_append(q, nk, nv, rows[i], one[i][0], one[i][1], lens[i], out_1, window)
        C.decode_attention_append_reference(q, nk, nv, rows[i], ref[i][0], ref[i][1], lens[i], out_r, window)
    assert torch.equal(torch.nan_to_num(out_g, 9.0), torch.nan_to_num(out_1, 9.0))  # bit for bit (NaN: untouched rows)
    for (k, v), (k1, v1), (kr, vr) in zip(caches, one, ref):
        assert torch.equal(k, k1) and torch.equal(v, v1) and torch.equal(k, kr) and torch.equal(v, vr)
    covered = sorted(int(x) for r in rows for x in r)
    assert covered == [0, 1, 2, 4, 5, 6, 7, 9, 10] and torch.isnan(out_g[[3, 8]]).all()
    assert torch.isfinite(out_g[covered]).all() and _rel(out_g[covered], out_r[covered]) < TOL[dtype]


def test_groups_errors_name_the_group():
    B, Hq, Hkv, hd = 4, 4, 2, 16
    q, kn, vn = torch.randn(B, Hq, hd), torch.randn(B, Hkv, hd), torch.randn(B, Hkv, hd)
    out = torch.empty(B, Hq * hd)
    k0, v0 = torch.zeros(2, Hkv, 8, hd), torch.zeros(2, Hkv, 8, hd)
    r0, n0 = torch.tensor([0, 1]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="one rows / k_cache / v_cache / lengths per group"):
        C.decode_attention_append_groups(q, kn, vn, [r0], [k0, k0], [v0], [n0], out)
    with pytest.raises(ValueError, match="appears twice"):
        C.decode_attention_append_groups(q, kn, vn, [r0, torch.tensor([1])], [k0, k0[:1].clone()], [v0, v0[:1].clone()],
                                         [n0, torch.tensor([0])], out)
    with pytest.raises(ValueError, match=r"\(group 1\).*Hkv, hd as in group 0"):
        C.decode_attention_append_groups(q, kn, vn, [r0, torch.tensor([2])], [k0, torch.zeros(1, 1, 8, hd)],
                                         [v0, torch.zeros(1, 1, 8, hd)], [n0, torch.tensor([0])], out)
    with pytest.raises(ValueError, match=r"\(group 1\): lengths in \[8, 8\]"):
        C.decode_attention_append_groups(q, kn, vn, [r0, torch.tensor([2])], [k0, torch.zeros(1, Hkv, 8, hd)],
                                         [v0, torch.zeros(1, Hkv, 8, hd)], [n0, torch.tensor([8])], out)


def test_native_stats_account_for_each_region():
    """native_stats: one region per call; the team's busy thread-seconds within its team thread-seconds; the region
    inside the caller's wall time; reset zeroes every sum. A 2-row call with 64 KV heads uses the whole team."""
    B, Hq, Hkv, hd, S = 2, 64, 64, 128, 600
    d = _case(torch.float32, B, Hq, Hkv, hd, S, [500, 599], [0, 1], seed=5)
    C.native_stats(reset=True)
    import time

    t0 = time.perf_counter()
    for _ in range(3):
        C.decode_attention_append(d["q"], None, None, d["rows"], d["k_cache"], d["v_cache"], d["lengths"],
                                  torch.empty(B, Hq * hd))
    wall = time.perf_counter() - t0
    st = C.native_stats()
    assert set(st) == set(C.NATIVE_STATS_KEYS)
    assert st["calls"] == 3
    team = st["threads"] / 3
    assert 1 <= team <= max(1, torch.get_num_threads())
    assert 0 < st["region_s"] <= wall
    assert st["team_thread_s"] == pytest.approx(st["region_s"] * team, rel=1e-6)
    assert 0 < st["busy_thread_s"] <= st["team_thread_s"] * (1 + 1e-9)
    assert 0 <= st["lag_s"] <= st["region_s"] and 0 <= st["tail_s"] <= st["region_s"]
    C.native_stats(reset=True)
    assert all(v == 0 for v in C.native_stats().values())


@pytest.mark.skipif(not C.native_available(), reason="native kernel not buildable here")
def test_a_stale_build_lock_does_not_hang_the_next_process(tmp_path):
    """torch's build lock file, left by a process killed mid-build, is removed under our own flock and the next
    process builds and loads the kernel (before: it waited on the file forever). Private TORCH_EXTENSIONS_DIR: a
    fresh build (~20-60 s), the user's cache untouched."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=repo)
    py = lambda code, **kw: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, **kw)  # noqa: E731
    build_dir = py("from lightning_moe.kernels.cpu_attention import build_directory; print(build_directory()[1])",
                   check=True).stdout.strip()
    assert build_dir.startswith(str(tmp_path))
    os.makedirs(build_dir)
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()  # what a SIGKILL during torch's build leaves
    r = py("from lightning_moe.kernels.cpu_attention import native_available; print(native_available())", timeout=300)
    assert r.stdout.strip() == "True", r.stderr[-2000:]
    assert "removing" in r.stderr and not os.path.exists(lock)
    again = py("from lightning_moe.kernels.cpu_attention import native_available; print(native_available())", timeout=300)
    assert again.stdout.strip() == "True" and "removing" not in again.stderr  # a finished build leaves no lock


def test_build_directory_depends_on_the_torch_install(monkeypatch):
    """Two torch installs of one version get two build directories (they no longer rebuild one back and forth)."""
    name, d = C.build_directory()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    name2, d2 = C.build_directory()
    assert name != name2 and d != d2 and name.startswith("lightning_moe_cpu_attention_")


def test_softmax_exp_is_within_two_ulp_of_torch_exp():
    """The kernel's vectorizable exponential (exp_fast, the softmax's): relative error <= 2.5e-7 (~2 ulp) against
    torch.exp in float64 over [-87, 88] (the softmax's inputs are <= 0), ~0 below -87.3, finite at the top."""
    x = torch.cat([torch.linspace(-87.0, 88.0, 200001), torch.randn(10000) * 3, torch.tensor([0.0, -1e-8, 1e-8])])
    got, want = C.softmax_exp(x).double(), torch.exp(x.double())
    assert ((got - want).abs() / want).max().item() <= 2.5e-7
    low = C.softmax_exp(torch.tensor([-90.0, -1e4, float("-inf")]))
    assert (low >= 0).all() and (low < 1e-37).all()
    assert torch.isfinite(C.softmax_exp(torch.tensor([88.3, 1e4]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [(0, 128), (0, 512), (512, 576), (1, 5), (0, 3)])  # dst columns of a [N, 576] array
@pytest.mark.parametrize("gather", [False, True])
def test_scatter_rows_equals_torch(dtype, cols, gather):
    """The native row scatter == scatter_rows_torch == plain indexing, bit for bit, into NaN rows (the others stay
    NaN): whole rows of a column slice of a wider array (MLA's c / k_pe; odd offsets and widths, where the torch path
    cannot view rows as int64), H = 3 heads, with and without a source-row gather."""
    g = torch.Generator().manual_seed(cols[0] + cols[1] + gather)
    N, T, H, w = 500, 37, 3, cols[1] - cols[0]
    n = 29 if gather else T
    dst_idx = torch.randperm(N, generator=g)[:n * H].view(n, H)  # distinct rows
    tok = torch.randperm(T, generator=g)[:n] if gather else None
    src = torch.randn(T, H, w, generator=g).to(dtype)
    outs = []
    for fn in (C.scatter_rows, C.scatter_rows_torch):
        big = torch.full((N, 576), float("nan"), dtype=dtype)
        fn(big[:, cols[0]:cols[1]], src, dst_idx, tok)
        outs.append(big)
    ref = torch.full((N, 576), float("nan"), dtype=dtype)
    ref[dst_idx, cols[0]:cols[1]] = src if tok is None else src[tok]
    w_int = {2: torch.int16, 4: torch.int32}[ref.element_size()]
    for out in outs:
        assert torch.equal(out.view(w_int), ref.view(w_int))


def test_scatter_rows_bad_inputs_raise():
    """Out-of-range indexes (destination or source) and mismatched operands are ValueErrors, nothing written out of
    bounds; the rows with valid indexes are written."""
    dst = torch.zeros(10, 4)
    src = torch.ones(3, 2, 4)
    with pytest.raises(ValueError, match=r"index 1 out of range \(a destination row not in \[0, 10\)\)"):
        C.scatter_rows(dst, src, torch.tensor([[0, 1], [2, 10], [4, 5]]))
    assert dst[[0, 1, 2, 4, 5]].eq(1).all() and dst[[3, 6, 7, 8, 9]].eq(0).all()
    with pytest.raises(ValueError, match=r"source row 3 of 3"):
        C.scatter_rows(dst, src, torch.tensor([[0, 1]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="index 0 out of range"):
        C.scatter_rows(dst, src, torch.tensor([[-1, 1]]))
    for fn in (C.scatter_rows, C.scatter_rows_torch):
        with pytest.raises(ValueError, match="does not match"):
            fn(dst, torch.ones(3, 2, 5), torch.tensor([[0, 1]]))
        with pytest.raises(ValueError, match="must be dst's"):
            fn(dst, src.double(), torch.tensor([[0, 1]]))
        with pytest.raises(ValueError, match="does not match"):  # tok None: more rows than the source has
            fn(dst, src, torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous rows"):
        C.scatter_rows(torch.zeros(4, 8)[:, ::2], src, torch.tensor([[0, 1]]))
