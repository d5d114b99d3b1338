"""The native CPU MLA decode kernel (kernels/cpu_latent_attention.py) against its pure-torch reference, and its wiring
into the CPU executors' latent caches.

Tolerances (relative Frobenius error of the output rows): fp32 1e-5, fp16 2e-3, bf16 1e-2 (both sides keep scores in
fp32; the kernel rounds its output once). Appended latent rows must be bit-identical, output rows outside ``rows``
untouched, and the cache past each row's attended positions is NaN: a kernel that read it would return NaN.
"""

import os

import pytest
import torch

from lightning_moe.kernels import cpu_attention as C
from lightning_moe.kernels import cpu_latent_attention as LA

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAN = float("nan")


@pytest.fixture(autouse=True)
def _need_kernel():
    if os.environ.get("LIGHTNING_MOE_CPU_ATTENTION", "").lower() == "sdpa":
        pytest.skip("native CPU attention disabled by LIGHTNING_MOE_CPU_ATTENTION=sdpa")
    if not C.native_available():
        pytest.fail("the native CPU attention kernel did not build (a C++ compiler with OpenMP and ninja are needed)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _case(dtype, B, Hq, Dl, rd, S, lens, rows, seed, append=True):
    """Random q_lat / c_new / kpe_new / cache with NaN past each row's attended positions (lens + 1 with append)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    cache = r(len(rows), S, Dl + rd)
    for i, n in enumerate(lens):
        cache[i, n + (1 if append else 0):] = NAN
        if append:
            cache[i, n] = NAN  # the append's slot: the kernel must write it before reading it
    return dict(q_lat=r(B, Hq, Dl + rd), c_new=r(B, Dl) if append else None, kpe_new=r(B, rd) if append else None,
                rows=torch.tensor(rows, dtype=torch.int64), cache=cache, lengths=torch.tensor(lens, dtype=torch.int64))


def _same(a, b):  # equal, NaN == NaN
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0)) and torch.equal(a.isnan(), b.isnan())


def _run_both(a, B, Hq, Dl, dtype, scale):
    b = {k: (v.clone() if v is not None else None) for k, v in a.items()}
    out_k = torch.full((B, Hq, Dl), NAN, dtype=dtype)
    out_r = out_k.clone()
    LA.latent_attention_append(**a, out=out_k, scale=scale)
    LA.latent_attention_append_reference(**b, out=out_r, scale=scale)
    return out_k, out_r, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Dl,rd", [(16, 512, 64), (5, 7, 3), (1, 64, 0), (7, 100, 20), (3, 130, 1)])
def test_append_attend_matches_reference(dtype, Hq, Dl, rd):
    """Awkward shapes: DeepSeek-V2-Lite's (the compile-time width 576), odd widths (Dl not a multiple of the column
    chunk, no rope part), 1 / 3 / 5 / 7 heads (head blocks of 4, 2, 1); ragged lengths 0 and 1, the last slot (S-1),
    rows across several 32-position tiles and on tile edges; a permuted subset of caller rows."""
    B, S = 9, 100
    rows, lens = [6, 0, 3, 8, 1, 4], [0, 1, 99, 31, 32, 70]
    scale = 0.3 / (Dl + rd) ** 0.5
    a = _case(dtype, B, Hq, Dl, rd, S, lens, rows, seed=hash((Hq, Dl, str(dtype))) % 1000)
    out_k, out_r, b = _run_both(a, B, Hq, Dl, dtype, scale)
    assert _same(a["cache"], b["cache"])  # the append: exact, at the reference's position; nothing else written
    r = a["rows"]
    others = [i for i in range(B) if i not in rows]
    assert torch.isnan(out_k[others]).all()  # rows of other groups untouched
    assert torch.isfinite(out_k[r]).all()  # never read past a row's positions (NaN there)
    assert _rel(out_k[r], out_r[r]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_heads_split_over_the_team(dtype):
    """DeepSeek-V3's 128 heads over two rows, one long: with 4 team threads the heads are split in blocks (each
    reading the row); a softmax whose maximum moves late (a large scale) checks the online rescaling."""
    B, Hq, Dl, rd, S = 3, 128, 512, 64, 520
    a = _case(dtype, B, Hq, Dl, rd, S, [500, 3], [2, 0], seed=11)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out_k, out_r, _ = _run_both(a, B, Hq, Dl, dtype, scale=0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.isnan(out_k[1]).all()
    assert _rel(out_k[[2, 0]], out_r[[2, 0]]) < TOL[dtype]


def test_without_append_over_a_slice_of_a_larger_cache():
    """c_new = kpe_new = None: attend over ``lengths`` positions of a slice [:, :n] of a larger cache."""
    a = _case(torch.float32, 4, 6, 24, 8, 40, [3, 10, 1, 7], [0, 1, 2, 3], seed=5, append=False)
    full = a["cache"]
    a["cache"] = full[:, :12]
    out = torch.full((4, 6, 24), NAN)
    LA.latent_attention_append(**a, out=out, scale=0.1)
    ref = torch.stack([LA.latent_attention_torch(a["q_lat"][i:i + 1], full[i:i + 1, :n], a["lengths"][i:i + 1], 24,
                                                 0.1)[0] for i, n in enumerate([3, 10, 1, 7])])
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("append", [True, False])
def test_groups_in_one_call_equal_one_call_per_group(append):
    B, Hq, Dl, rd = 7, 5, 33, 5
    parts = [([4, 1], [2, 17], 20), ([0, 6, 3], [0, 40, 9], 41), ([5, 2], [33, 1], 34)]
    cases = [_case(torch.bfloat16, B, Hq, Dl, rd, S, [n if append else max(n, 1) for n in lens], rows, seed=i,
                   append=append) for i, (rows, lens, S) in enumerate(parts)]
    q, c, k = cases[0]["q_lat"], cases[0]["c_new"], cases[0]["kpe_new"]
    caches_one = [cs["cache"].clone() for cs in cases]
    out_one = torch.full((B, Hq, Dl), NAN, dtype=torch.bfloat16)
    out_each = out_one.clone()
    LA.latent_attention_append_groups(q, c, k, [cs["rows"] for cs in cases], caches_one,
                                      [cs["lengths"] for cs in cases], out_one, 0.2)
    for cs in cases:
        LA.latent_attention_append(q, c, k, cs["rows"], cs["cache"], cs["lengths"], out_each, 0.2)
    assert torch.isfinite(out_one).all()
    assert torch.equal(out_one, out_each)
    assert all(_same(x, cs["cache"]) for x, cs in zip(caches_one, cases))


def test_empty_group_is_a_no_op():
    a = _case(torch.bfloat16, 3, 4, 8, 2, 6, [], [], seed=1)
    out = torch.full((3, 4, 8), 7.0, dtype=torch.bfloat16)
    LA.latent_attention_append(**a, out=out, scale=0.5)
    assert (out == 7.0).all()


@pytest.mark.parametrize("what,match", [("len_full", "do not fit"), ("len_zero_no_append", "do not fit"),
                                        ("row_range", "rows must lie"), ("dtype", "dtype"), ("width", "q_lat"),
                                        ("half_append", "both c_new"), ("strides", "contiguous")])
def test_bad_inputs_raise(what, match):
    a = _case(torch.float32, 4, 3, 8, 2, 10, [1, 2], [0, 3], seed=2)
    out = torch.empty(4, 3, 8)
    if what == "len_full":
        a["lengths"] = torch.tensor([1, 10])
    elif what == "len_zero_no_append":
        a["c_new"] = a["kpe_new"] = None
        a["lengths"] = torch.tensor([0, 2])
    elif what == "row_range":
        a["rows"] = torch.tensor([0, 4])
    elif what == "dtype":
        a["q_lat"] = a["q_lat"].to(torch.bfloat16)
    elif what == "width":
        a["q_lat"] = a["q_lat"][:, :, :9].contiguous()
    elif what == "half_append":
        a["kpe_new"] = None
    elif what == "strides":
        a["cache"] = torch.empty(10, 2, 10).transpose(0, 1)  # [2, 10, 10], positions 20 elements apart
    with pytest.raises(ValueError, match=match):
        LA.latent_attention_append(**a, out=out, scale=0.1)


def _mla_spec(L=2):
    """A DeepSeek-style spec with yarn's mscale_all_dim: softmax_scale != (Dl + rd) ** -0.5 and != head_dim ** -0.5."""
    from lightning_moe.model.spec import MoESpec

    spec = MoESpec(name="t-mla", model_type="deepseek_v2", vocab_size=64, hidden_size=64, intermediate_size=32,
                   num_layers=L, num_heads=6, num_kv_heads=6, head_dim=24, num_experts=2, top_k=1, rope_theta=1e4,
                   rms_norm_eps=1e-5, max_position_embeddings=4096, kv_lora_rank=40, qk_rope_head_dim=8,
                   rope_type="yarn", rope_factor=4.0, rope_mscale_all_dim=0.707)
    assert abs(spec.softmax_scale - 24 ** -0.5) > 1e-3
    return spec


def _fill_latents(kv, spec, prompt_lens, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in range(spec.num_layers):
        for row, n in enumerate(prompt_lens):
            kv.write_prefill(layer, row, torch.randn(n, spec.kv_lora_rank, generator=g).to(kv.lat[layer][0].dtype),
                             torch.randn(n, spec.qk_rope_head_dim, generator=g).to(kv.lat[layer][0].dtype))
            kv.lengths[row] = n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_latent_cache_native_equals_the_family_torch_path(dtype, monkeypatch):
    """CGOPipe's CPU path: GroupedLatentKVCache.append_attend in one native call over the length groups equals the
    torch path (``LIGHTNING_MOE_CPU_ATTENTION=sdpa``: append + the family's latent_attention per group), latents and
    outputs, with the spec's yarn-scaled softmax_scale, for two layers and three decode steps."""
    from lightning_moe.model.families import deepseek_v2
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache

    spec = _mla_spec()
    prompts, gen = [5, 1, 30, 33, 12, 2, 64], 3
    caches = [GroupedLatentKVCache(spec, [n + gen for n in prompts], dtype, max_groups=3) for _ in range(2)]
    for kv in caches:
        _fill_latents(kv, spec, prompts, seed=1)
    fn = lambda q, x, n: deepseek_v2.latent_attention(q, x, n, spec)  # noqa: E731
    g = torch.Generator().manual_seed(2)
    B, Hq, Dl, E = len(prompts), spec.num_heads, spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim
    for _ in range(gen):
        for layer in range(spec.num_layers):
            q = torch.randn(B, Hq, E, generator=g).to(dtype)
            c, k = torch.randn(B, Dl, generator=g).to(dtype), torch.randn(B, E - Dl, generator=g).to(dtype)
            out = torch.full((B, Hq, Dl), NAN, dtype=dtype)
            caches[0].append_attend(layer, q, c, k, fn, out)
            monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "sdpa")
            ref = caches[1].append_attend(layer, q, c, k, fn)
            monkeypatch.delenv("LIGHTNING_MOE_CPU_ATTENTION")
            assert _rel(out, ref) < TOL[dtype]
        for kv in caches:
            kv.lengths += 1
    assert all(torch.equal(x, y) for a, b in zip(caches[0].lat, caches[1].lat) for x, y in zip(a, b))


@pytest.mark.parametrize("groups", [1, 3, 8])
def test_grouped_latent_cache_native_reads_its_flat_views(groups):
    """The native kernel over GroupedLatentKVCache's groups, views of one flat array per layer at their offsets
    (append_attend), equals the same kernel over separate contiguous copies of the groups (the layout before), bit for
    bit, outputs and appended latents, for two layers and three steps, with every position past the prompts NaN
    first: a kernel that read another offset, group or position would return NaN or other numbers."""
    from lightning_moe.model.families import deepseek_v2
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache

    spec, dtype, gen = _mla_spec(), torch.bfloat16, 3
    prompts = [5, 1, 30, 33, 12, 2, 64, 9, 31]
    kv = GroupedLatentKVCache(spec, [n + gen for n in prompts], dtype, max_groups=groups)
    for f in kv.lat_flat:
        f.fill_(NAN)
    _fill_latents(kv, spec, prompts, seed=groups)
    sep = [[t.clone() for t in layer] for layer in kv.lat]  # [layer][g]: separate contiguous tensors
    assert all(t.storage_offset() > 0 for t in kv.lat[0][1:])
    fn = lambda q, x, n: deepseek_v2.latent_attention(q, x, n, spec)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    B, Hq, Dl, E = len(prompts), spec.num_heads, spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim
    for _ in range(gen):
        for layer in range(spec.num_layers):
            q = torch.randn(B, Hq, E, generator=g).to(dtype)
            c, k = torch.randn(B, Dl, generator=g).to(dtype), torch.randn(B, E - Dl, generator=g).to(dtype)
            out, ref = (torch.full((B, Hq, Dl), NAN, dtype=dtype) for _ in range(2))
            LA.latent_attention_append_groups(q, c, k, kv.rows, sep[layer], kv.group_lengths(), ref, kv.softmax_scale)
            kv.append_attend(layer, q, c, k, fn, out)
            assert not out.isnan().any() and torch.equal(out, ref)
        kv.lengths += 1
    bits = lambda t: t.view(torch.int16)  # noqa: E731  (NaN == NaN)
    assert all(torch.equal(bits(x), bits(y)) for a, b in zip(kv.lat, sep) for x, y in zip(a, b))


def test_serial_helper_native_equals_the_torch_fallback(monkeypatch):
    """The serial executor's call (pipeline.cpu_attention.cpu_latent_attention): native over a latent cache view
    (rows, bucket-padded positions past the lengths) equals the family's torch latent attention; with
    ``LIGHTNING_MOE_CPU_ATTENTION=sdpa`` the fallback runs."""
    from lightning_moe.model.families import deepseek_v2
    from lightning_moe.pipeline.cpu_attention import cpu_latent_attention

    spec = _mla_spec()
    g = torch.Generator().manual_seed(3)
    E = spec.kv_lora_rank + spec.qk_rope_head_dim
    lat = torch.randn(4, 48, E, generator=g)[:, :32]  # a view [:, :upto] of a larger cache
    q, n = torch.randn(4, spec.num_heads, E, generator=g), torch.tensor([1, 32, 17, 5])
    calls = []

    def fallback(qg, x, m):
        calls.append(1)
        return deepseek_v2.latent_attention(qg, x, m, spec)

    out = cpu_latent_attention(q, lat, n, spec.kv_lora_rank, spec.softmax_scale, fallback)
    assert not calls and _rel(out, deepseek_v2.latent_attention(q, lat, n, spec)) < TOL[torch.float32]
    monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "sdpa")
    cpu_latent_attention(q, lat, n, spec.kv_lora_rank, spec.softmax_scale, fallback)
    assert calls == [1]
