"""pipeline/kv_cache.GroupedKVCache: storage per length group, caller row order, attention equal to one padded cache."""

import pytest
import torch

from lightning_moe.model import layers as M
from lightning_moe.model.spec import MoESpec
from lightning_moe.pipeline.cpu_attention import cpu_decode_attention
from lightning_moe.pipeline.kv_cache import GroupedKVCache, GroupedLatentKVCache, KVCache
from lightning_moe.policy.batching import length_groups, padded_positions


def _spec(sliding_window=None, L=2) -> MoESpec:
    return MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=L,
                   num_heads=8, num_kv_heads=2, head_dim=16, num_experts=2, top_k=1, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=4096, sliding_window=sliding_window)


def _filled(spec, prompts, gen, groups, seed=0):
    """A GroupedKVCache and one big padded KVCache holding the same random prompt KV; rows in caller order."""
    g = torch.Generator().manual_seed(seed)
    final = [p + gen for p in prompts]
    grouped = GroupedKVCache(spec, final, torch.float32, max_groups=groups)
    big = KVCache(spec, len(prompts), max(final), torch.float32)
    for layer in range(spec.num_layers):
        for r, S in enumerate(prompts):
            k = torch.randn(S, spec.num_kv_heads, spec.head_dim, generator=g)
            v = torch.randn(S, spec.num_kv_heads, spec.head_dim, generator=g)
            grouped.write_prefill(layer, r, k, v)
            big.write_prefill(layer, r, k, v)
    grouped.lengths[:] = torch.tensor(prompts)
    big.lengths[:] = torch.tensor(prompts)
    return grouped, big


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_attend_equals_one_padded_cache(sliding_window):
    """Ragged rows (one group of a single row), several decode steps: attend == decode_attention on the padded cache."""
    spec = _spec(sliding_window)
    prompts = [40, 3, 91, 5, 41, 4, 200, 39]  # caller order is not length order
    gen = 4
    grouped, big = _filled(spec, prompts, gen, groups=4)
    sizes = sorted(len(r) for r in grouped.rows)
    assert grouped.num_groups == 4 and sizes[0] == 1  # 200 alone
    assert grouped.padded_positions == padded_positions([p + gen for p in prompts], length_groups([p + gen for p in prompts], 4))
    assert grouped.nbytes == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * grouped.padded_positions
    assert grouped.nbytes < big.nbytes
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, hd = len(prompts), spec.num_heads, spec.num_kv_heads, spec.head_dim
    rows = torch.arange(B)
    seen_fns = []
    for _ in range(gen - 1):
        for layer in range(spec.num_layers):
            q = torch.randn(B, Hq, hd, generator=g)
            k, v = torch.randn(B, Hkv, hd, generator=g), torch.randn(B, Hkv, hd, generator=g)
            grouped.append(layer, rows, k, v)
            big.append(layer, rows, k, v)
            new = big.lengths + 1
            K, V = big.view(layer, None, big.max_len)
            ref = M.decode_attention(q, K, V, new, sliding_window)

            def fn(qg, Kg, Vg, n):
                seen_fns.append((qg.shape[0], Kg.shape[2], int(n.max())))
                return M.decode_attention(qg, Kg, Vg, n, sliding_window)

            out = grouped.attend(layer, q, grouped.lengths + 1, fn)
            assert out.shape == (B, Hq * hd)
            assert (out - ref).abs().max().item() < 1e-6
            fused = grouped.attend(layer, q, grouped.lengths + 1, lambda a, b, c, n: cpu_decode_attention(a, b, c, n, sliding_window))
            assert (fused - ref).abs().max().item() < 1e-5
        grouped.lengths += 1
        big.lengths += 1
    # each group attends over its own bucketed length only, never the batch's longest
    assert all(S <= -(-n // 16) * 16 for _, S, n in seen_fns) and min(S for _, S, _ in seen_fns) < 32


def test_rows_subset_append_and_errors():
    spec = _spec(L=1)
    prompts = [3, 30, 4, 31]
    grouped, big = _filled(spec, prompts, 2, groups=2)
    g = torch.Generator().manual_seed(3)
    rows = torch.tensor([3, 0])  # a subset, out of order
    k, v = torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    grouped.append(0, rows, k, v)
    big.append(0, rows, k, v)
    for r in range(4):
        gi, slot = int(grouped.group_of[r]), int(grouped.slot_of[r])
        n = prompts[r] + 1
        assert torch.equal(grouped.k[0][gi][slot, :, :n], big.k[0][r, :, :n])
        assert torch.equal(grouped.v[0][gi][slot, :, :n], big.v[0][r, :, :n])
    with pytest.raises(ValueError, match="exceeds"):
        grouped.write_prefill(0, 0, torch.zeros(7, 2, 16), torch.zeros(7, 2, 16))  # row 0's group holds 4 + 2 positions
    grouped.lengths[:] = torch.tensor([5, 32, 6, 33])  # every group full
    with pytest.raises(ValueError, match="full"):
        grouped.append(0, torch.arange(4), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))
    with pytest.raises(ValueError, match="rows"):
        grouped.attend(0, torch.zeros(3, 8, 16), torch.ones(3, dtype=torch.int64), M.decode_attention)
    with pytest.raises(ValueError):
        GroupedKVCache(spec, [], torch.float32)
    with pytest.raises(ValueError):
        GroupedKVCache(spec, [4, 0], torch.float32)


def test_one_group_is_the_plain_cache():
    """max_groups=1: one [B, Hkv, S_max, hd] tensor per layer in caller order, as KVCache."""
    spec = _spec(L=1)
    grouped, big = _filled(spec, [9, 2, 17], 3, groups=1)
    assert grouped.num_groups == 1 and grouped.nbytes == big.nbytes
    assert torch.equal(grouped.k[0][0], big.k[0]) and torch.equal(grouped.v[0][0], big.v[0])


def _nan_caches(spec, final, groups, dtype=torch.bfloat16, n=2):
    """``n`` GroupedKVCaches (GroupedLatentKVCache for an MLA spec) with every stored element NaN."""
    cls = GroupedLatentKVCache if spec.is_mla else GroupedKVCache
    caches = [cls(spec, final, dtype, max_groups=groups) for _ in range(n)]
    for kv in caches:
        for f in (kv.lat_flat if spec.is_mla else kv.k_flat + kv.v_flat):
            f.fill_(float("nan"))
    return caches


def _bitwise_equal(a, b) -> bool:
    """Every element of two same-dtype tensors has the same bits (NaN == NaN; a copy must be exact)."""
    w = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(w), b.contiguous().view(w))


def _packed(prompt, gap=0):
    """Spans of prompts packed back to back; ``gap`` > 0: that many unused chunk rows before each prompt (tok is then
    not 0..n-1). Returns (spans, T)."""
    spans, t = [], 0
    for n in prompt:
        spans.append((t + gap, t + gap + n))
        t += gap + n
    return spans, t


def _check_prefill_index(spec, final, groups, rows, prompt, gap=0, src_dtype=torch.bfloat16, seed=0):
    """write_prefill_index of a packed chunk == write_prefill per sequence, bit for bit, into NaN caches: every written
    position equals the reference and every other one stays NaN. Returns the index."""
    a, b = _nan_caches(spec, final, groups)
    spans, T = _packed(prompt, gap)
    index = a.prefill_index(rows, spans)
    assert index.dst.shape == (sum(prompt), 1 if spec.is_mla else spec.num_kv_heads)
    assert (index.tok is None) == (gap == 0)
    g = torch.Generator().manual_seed(seed)
    widths = (spec.kv_lora_rank, spec.qk_rope_head_dim) if spec.is_mla else (None, None)
    for layer in range(spec.num_layers):
        if spec.is_mla:
            k, v = (torch.randn(T, w, generator=g).to(src_dtype) for w in widths)
        else:
            k, v = (torch.randn(T, spec.num_kv_heads, spec.head_dim, generator=g).to(src_dtype) for _ in range(2))
        a.write_prefill_index(layer, index, k, v)
        for r, (s, e) in zip(rows, spans):
            b.write_prefill(layer, r, k[s:e], v[s:e])
    flats = zip(a.lat_flat, b.lat_flat) if spec.is_mla else zip(a.k_flat + a.v_flat, b.k_flat + b.v_flat)
    for fa, fb in flats:
        assert _bitwise_equal(fa, fb)
    written = sum(prompt) * (spec.kv_lora_rank + spec.qk_rope_head_dim if spec.is_mla
                             else spec.num_kv_heads * spec.head_dim)
    for f in (a.lat_flat if spec.is_mla else a.k_flat + a.v_flat):
        assert int((~f.isnan()).sum()) == written  # exactly the prompts' elements written, nothing else
    return index


@pytest.fixture(params=["native", "torch"])
def scatter_path(request, monkeypatch):
    """Run a test through the native row scatter (checked to be called) and through the torch fallback
    (LIGHTNING_MOE_CPU_ATTENTION=sdpa: no native kernel)."""
    from lightning_moe.pipeline import kv_cache

    calls = []
    if request.param == "native":
        real = kv_cache.scatter_rows
        monkeypatch.setattr(kv_cache, "scatter_rows", lambda *a: (calls.append(1), real(*a)))
    else:
        monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", "sdpa")
    yield request.param
    assert bool(calls) == (request.param == "native")


@pytest.mark.parametrize("groups", [1, 3, 8])
def test_write_prefill_index_equals_per_row_writes(groups, scatter_path):
    """A packed chunk scattered by prefill_index / write_prefill_index == write_prefill row by row, bit for bit, the
    untouched rows and positions NaN still, for a chunk of rows off.. in several length groups, bf16."""
    final = [5, 40, 9, 41, 1, 77, 12, 30, 2, 60]
    # rows 2..6 (row 4 a single token); rows 0, 1, 7.. untouched
    _check_prefill_index(_spec(L=2), final, groups, [2, 3, 4, 5, 6], [9, 41, 1, 70, 3])


def _gqa_spec(Hkv, hd, L=2) -> MoESpec:
    return MoESpec(name="t", model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_layers=L,
                   num_heads=2 * Hkv, num_kv_heads=Hkv, head_dim=hd, num_experts=2, top_k=1, rope_theta=1e4,
                   rms_norm_eps=1e-5, max_position_embeddings=4096)


@pytest.mark.parametrize("Hkv,hd", [(1, 64), (4, 128), (3, 192), (16, 128), (2, 24)])
@pytest.mark.parametrize("gap", [0, 2])
def test_write_prefill_index_awkward_shapes(Hkv, hd, gap, scatter_path):
    """Random final lengths in 8 groups, a chunk of an odd number of rows in no particular order: 1-token prompts,
    prompts of exactly their group's size, the rest random; ``gap``: unused chunk rows between prompts."""
    g = torch.Generator().manual_seed(Hkv * hd + gap)
    final = torch.randint(1, 60, (23,), generator=g).tolist()
    final[5] = 1
    spec = _gqa_spec(Hkv, hd)
    probe = GroupedKVCache(spec, final, torch.bfloat16, max_groups=8)
    rows = [5] + [r for r in torch.randperm(23, generator=g).tolist() if r != 5][:12]  # 13 of the rows, shuffled
    prompt = [int(torch.randint(1, int(probe.row_cap[r]) + 1, (1,), generator=g)) for r in rows]
    prompt[1] = 1
    prompt[2], prompt[3] = int(probe.row_cap[rows[2]]), int(probe.row_cap[rows[3]])  # a group's full size
    _check_prefill_index(spec, final, 8, rows, prompt, gap, seed=gap)


def test_write_prefill_index_converts_the_source_dtype(scatter_path):
    """fp32 k / v into a bf16 cache: cast once (after the gather), equal to write_prefill's cast."""
    _check_prefill_index(_gqa_spec(2, 64), [7, 30, 12, 3], 3, [3, 1, 0], [3, 28, 6], gap=1, src_dtype=torch.float32)


def test_write_prefill_index_empty_chunk(scatter_path):
    """A chunk of no rows writes nothing."""
    a, = _nan_caches(_spec(L=1), [4, 9], 2, n=1)
    index = a.prefill_index([], [])
    assert index.dst.shape == (0, 2)
    a.write_prefill_index(0, index, torch.zeros(0, 2, 16), torch.zeros(0, 2, 16))
    assert a.k_flat[0].isnan().all() and a.v_flat[0].isnan().all()


def test_prefill_index_errors():
    """Mismatched rows / spans, an empty span and a prompt longer than its row's group are errors naming the row."""
    spec = _spec(L=1)
    c = GroupedKVCache(spec, [4, 30], torch.float32, max_groups=2)
    with pytest.raises(ValueError, match="2 rows but 1 spans"):
        c.prefill_index([0, 1], [(0, 3)])
    with pytest.raises(ValueError, match="empty span"):
        c.prefill_index([0, 1], [(0, 3), (3, 3)])
    with pytest.raises(ValueError, match="prompt of 5 tokens exceeds row 0's cache of 4 positions"):
        c.prefill_index([0, 1], [(0, 5), (5, 9)])
    with pytest.raises(ValueError, match="a row repeats"):  # two prompts into one row: overlapping parallel copies
        c.prefill_index([1, 1], [(0, 3), (3, 6)])
    index = c.prefill_index([1], [(0, 3)])
    with pytest.raises(ValueError, match="does not match"):  # k of the wrong head dim
        c.write_prefill_index(0, index, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))


# ---- GroupedLatentKVCache (MLA): the length groups as views of one flat array per layer --------------------------
MLA_CASES = [([7], 1), ([40, 3, 91, 5, 41, 4, 20, 39], 3), ([12, 1, 33, 2, 34, 9, 1, 60, 5], 8)]  # finals, groups


def _mla_spec(L=2) -> MoESpec:
    """kv_lora_rank 20 + rope 4: a 24-element position (no power of two)."""
    return MoESpec(name="t-mla", model_type="deepseek_v2", vocab_size=64, hidden_size=64, intermediate_size=32,
                   num_layers=L, num_heads=4, num_kv_heads=4, head_dim=24, num_experts=2, top_k=1, rope_theta=1e4,
                   rms_norm_eps=1e-5, max_position_embeddings=4096, kv_lora_rank=20, qk_rope_head_dim=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a bf16 tensor (NaN == NaN)."""
    return t.view(torch.int16)


@pytest.mark.parametrize("final,groups", MLA_CASES)
def test_latent_groups_partition_one_flat_array(final, groups):
    """Each layer's groups are contiguous [B_g, S_g, W] views of ``lat_flat[layer]`` in group order that cover it
    exactly (no gap, no overlap); row r's block is positions row_base[r] .. + row_cap[r] of the flat array, the memory
    of its slot in its group's view; nbytes is the planner's count."""
    spec = _mla_spec()
    kv = GroupedLatentKVCache(spec, final, torch.bfloat16, max_groups=groups)
    W = kv.width
    assert W == 24 and kv.num_groups == min(groups, len(set(final)))
    assert kv.nbytes == kv.padded_positions * spec.kv_bytes_per_token("bf16")
    assert kv.nbytes == sum(f.numel() * f.element_size() for f in kv.lat_flat)
    for layer in range(spec.num_layers):
        f = kv.lat_flat[layer]
        f.fill_(float("nan"))
        for g, (rows, S) in enumerate(zip(kv.rows, kv.sizes)):
            t = kv.lat[layer][g]
            assert t.shape == (len(rows), S, W) and t.is_contiguous()
            t.fill_(g + 1)  # through the view
        want = torch.cat([torch.full((len(r) * S * W,), g + 1.0) for g, (r, S) in enumerate(zip(kv.rows, kv.sizes))])
        assert torch.equal(f.float(), want)  # every element written once, by its own group, in group order
        f.copy_(torch.randn(f.numel(), generator=torch.Generator().manual_seed(layer)))
        pos = f.view(-1, W)
        for r in range(len(final)):
            g, slot, base, cap = int(kv.group_of[r]), int(kv.slot_of[r]), int(kv.row_base[r]), int(kv.row_cap[r])
            assert cap == kv.sizes[g] and cap >= final[r]
            assert kv.lat[layer][g][slot].data_ptr() == pos[base].data_ptr()
            assert torch.equal(kv.lat[layer][g][slot], pos[base: base + cap])


@pytest.mark.parametrize("final,groups", MLA_CASES)
def test_latent_write_prefill_index_equals_per_row_writes(final, groups, scatter_path):
    """MLA: a packed chunk scattered by write_prefill_index == write_prefill row by row == the same latents written
    into separate per-group tensors (the layout before the flat array), bit for bit, with the caches NaN first (every
    untouched position stays NaN), on a chunk of every other row."""
    spec = _mla_spec()
    a, b = (GroupedLatentKVCache(spec, final, torch.bfloat16, max_groups=groups) for _ in range(2))
    for kv in (a, b):
        for f in kv.lat_flat:
            f.fill_(float("nan"))
    ref = [[torch.full(t.shape, float("nan"), dtype=torch.bfloat16) for t in layer] for layer in a.lat]
    rows = list(range(0, len(final), 2))
    prompt = [max(1, final[r] - 2) for r in rows]
    ends = torch.tensor(prompt).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, prompt)]
    index = a.prefill_index(rows, spans)
    g = torch.Generator().manual_seed(len(final))
    for layer in range(spec.num_layers):
        c = torch.randn(ends[-1], spec.kv_lora_rank, generator=g).bfloat16()
        k_pe = torch.randn(ends[-1], spec.qk_rope_head_dim, generator=g).bfloat16()
        a.write_prefill_index(layer, index, c, k_pe)
        for r, (s, e) in zip(rows, spans):
            b.write_prefill(layer, r, c[s:e], k_pe[s:e])
            ref[layer][int(a.group_of[r])][int(a.slot_of[r]), :e - s] = torch.cat([c[s:e], k_pe[s:e]], dim=-1)
    for layer in range(spec.num_layers):
        for gi in range(a.num_groups):
            assert torch.equal(_bits(a.lat[layer][gi]), _bits(ref[layer][gi]))
            assert torch.equal(_bits(b.lat[layer][gi]), _bits(ref[layer][gi]))


@pytest.mark.parametrize("gap", [0, 3])
@pytest.mark.parametrize("dims", [(512, 64), (20, 4), (7, 3)])  # DeepSeek's 576; the tests' 24; odd widths
def test_latent_write_prefill_index_awkward_shapes(dims, gap, scatter_path):
    """MLA, c and k_pe scattered into the columns of the flat array: random final lengths in 8 groups, an odd chunk
    of shuffled rows with a 1-token prompt and prompts of exactly their group's size, NaN caches, bit for bit."""
    spec = MoESpec(name="t-mla", model_type="deepseek_v2", vocab_size=64, hidden_size=64, intermediate_size=32,
                   num_layers=2, num_heads=4, num_kv_heads=4, head_dim=24, num_experts=2, top_k=1, rope_theta=1e4,
                   rms_norm_eps=1e-5, max_position_embeddings=4096, kv_lora_rank=dims[0], qk_rope_head_dim=dims[1])
    g = torch.Generator().manual_seed(sum(dims) + gap)
    final = torch.randint(1, 50, (17,), generator=g).tolist()
    probe = GroupedLatentKVCache(spec, final, torch.bfloat16, max_groups=8)
    rows = torch.randperm(17, generator=g)[:9].tolist()
    prompt = [int(torch.randint(1, int(probe.row_cap[r]) + 1, (1,), generator=g)) for r in rows]
    prompt[0], prompt[1] = 1, int(probe.row_cap[rows[1]])
    _check_prefill_index(spec, final, 8, rows, prompt, gap, seed=gap)
