"""CPU tests of lightning_moe.pipeline.pager (host page pool, page layout, CPU page buffers)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels.pages import PageLayout, views
from lightning_moe.pipeline.pager import (
    ALIGN,
    ExpertPaging,
    ExpertSlot,
    GpuPageBuffers,
    HostPagePool,
    ResidentExperts,
    ffn_expert_specs,
    page_schedule,
    pool_page_layout,
)

E, F, D = 8, 37, 24


def _experts(num_layers: int, dtype: torch.dtype, seed: int = 0, F: int = F, D: int = D) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(E, F, D, generator=g).to(dtype),
            "w3": torch.randn(E, F, D, generator=g).to(dtype),
            "w2": torch.randn(E, D, F, generator=g).to(dtype),
        }
        for _ in range(num_layers)
    ]


def _pool(paging: ExpertPaging, dtype: torch.dtype, experts) -> HostPagePool:
    pool = HostPagePool.for_experts(paging, ffn_expert_specs(F, D, dtype), pin=False)
    pool.fill_experts(experts)
    return pool


# ---- layout -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.uint8])
def test_layout_alignment_and_sizes(dtype: torch.dtype) -> None:
    layout = pool_page_layout(3, ffn_expert_specs(F, D, dtype))
    assert layout.names == ("w1", "w3", "w2")
    assert layout.rows == 3
    assert layout.page_bytes % ALIGN == 0
    end = 0
    for e in layout.entries:
        assert e.offset % ALIGN == 0
        assert e.offset >= end  # no overlap, byte order
        end = e.offset + e.nbytes
        assert e.nbytes == 3 * F * D * dtype.itemsize
        assert e.row_bytes == F * D * dtype.itemsize
    assert end <= layout.page_bytes < end + ALIGN
    assert layout.entry("w2").shape == (3, D, F)
    with pytest.raises(KeyError):
        layout.entry("w4")


def test_layout_errors() -> None:
    with pytest.raises(ValueError):
        PageLayout.build([])
    with pytest.raises(ValueError):
        PageLayout.build([("a", torch.float32, (2, 3)), ("a", torch.float32, (2, 3))])
    with pytest.raises(ValueError):
        PageLayout.build([("a", torch.float32, ())])
    with pytest.raises(ValueError):
        PageLayout.build([("a", torch.float32, (2, 0))])
    with pytest.raises(ValueError):
        pool_page_layout(0, ffn_expert_specs(F, D, torch.float32))
    mixed = PageLayout.build([("a", torch.float32, (2, 3)), ("b", torch.int8, (4,))])
    with pytest.raises(ValueError):
        _ = mixed.rows


def test_views_mixed_dtypes_roundtrip() -> None:
    tensors = {
        "q": torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8),
        "s": torch.randn(3, 5, 1).to(torch.float16),
        "z": torch.randn(3, 11, dtype=torch.float64),
        "b": torch.randn(3, 2).to(torch.bfloat16),
    }
    layout = PageLayout.from_tensors(tensors)
    pool = HostPagePool(layout, [2, 0, 1], pin=False)
    assert pool.registered is False
    pool.write_page(2, 0, tensors)
    got = views(pool.page(2, 0), layout)
    for n, t in tensors.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)
        assert got[n].data_ptr() % t.element_size() == 0
    # views share memory with the page (no copy)
    got["z"][0, 0] = 123.0
    assert pool.page_views(2, 0)["z"][0, 0].item() == 123.0


def test_views_errors() -> None:
    layout = pool_page_layout(1, ffn_expert_specs(F, D, torch.float32))
    with pytest.raises(ValueError):
        views(torch.zeros(layout.page_bytes, dtype=torch.int8), layout)
    with pytest.raises(ValueError):
        views(torch.zeros(layout.page_bytes - 1, dtype=torch.uint8), layout)
    with pytest.raises(ValueError):
        views(torch.zeros(2, layout.page_bytes, dtype=torch.uint8), layout)


# ---- paging -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_pages, epp, pages",
    [(4, 2, 4), (3, 3, 3), (5, 2, 4), (8, 1, 8), (16, 1, 8), (1, 8, 1), (6, 2, 4), (7, 2, 4)],
)
def test_paging_all_nonresident(n_pages: int, epp: int, pages: int) -> None:
    p = ExpertPaging(num_layers=2, num_experts=E, n_pages=n_pages)
    assert p.experts_per_page == epp
    assert p.pages_per_layer == (pages, pages)
    assert pages <= n_pages
    seen = [e for i in range(pages) for e in p.page_experts(0, i)]
    assert seen == list(range(E))
    for e in range(E):
        assert p.locate(0, e) == (e // epp, e % epp)
        assert p.index_map(0)[e] == ExpertSlot(True, e)


def test_paging_with_resident() -> None:
    resident = {(0, 1), (0, 5)} | {(1, e) for e in range(E)} | {(2, 0)}
    p = ExpertPaging(num_layers=3, num_experts=E, n_pages=3, resident=resident)
    assert p.resident_experts(0) == (1, 5)
    assert p.nonresident(0) == (0, 2, 3, 4, 6, 7)
    assert p.nonresident(1) == ()
    assert p.max_nonresident == 7
    assert p.experts_per_page == 3
    assert p.pages_per_layer == (2, 0, 3)
    assert p.page_experts(2, 2) == (7,)
    m = p.index_map(0)
    assert m[1] == ExpertSlot(False, 0) and m[5] == ExpertSlot(False, 1)
    assert m[6] == ExpertSlot(True, 4)
    assert p.locate(0, 6) == (1, 1)
    with pytest.raises(KeyError):
        p.locate(0, 1)
    with pytest.raises(IndexError):
        p.page_experts(1, 0)
    is_paged, row = p.index_tensors(0)
    assert is_paged.tolist() == [True, False, True, True, True, False, True, True]
    assert row.tolist() == [0, 0, 1, 2, 3, 1, 4, 5]
    all_res = ExpertPaging(2, 4, 2, resident={(l, e) for l in range(2) for e in range(4)})
    assert all_res.experts_per_page == 0 and all_res.pages_per_layer == (0, 0)


def test_paging_errors() -> None:
    for kw in (dict(num_layers=0), dict(num_experts=0), dict(n_pages=0), dict(n_pages=1.5), dict(resident={(0, 8)}), dict(resident={(3, 0)})):
        args = dict(num_layers=2, num_experts=E, n_pages=2)
        args.update(kw)
        with pytest.raises(ValueError):
            ExpertPaging(**args)


def test_page_schedule() -> None:
    assert page_schedule(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    sched = page_schedule(3, 8)
    assert sorted(p for r in sched for p in r) == [0, 1, 2]
    assert sum(1 for r in sched if len(r) == 0) == 5
    sched = page_schedule(10, 4)
    assert [p for r in sched for p in r] == list(range(10))
    assert max(len(r) for r in sched) - min(len(r) for r in sched) <= 1
    assert page_schedule(0, 2) == [range(0, 0), range(0, 0)]
    with pytest.raises(ValueError):
        page_schedule(2, 0)


# ---- host pool ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_pages", [4, 3, 5, 8, 16])
def test_pool_roundtrip_exact(dtype: torch.dtype, n_pages: int) -> None:
    L = 3
    experts = _experts(L, dtype, seed=n_pages)
    paging = ExpertPaging(L, E, n_pages)
    pool = _pool(paging, dtype, experts)
    epp = paging.experts_per_page
    # exact byte accounting
    assert pool.nbytes == sum(paging.pages_per_layer) * pool.page_bytes
    assert pool.buffer.numel() == pool.nbytes and pool.buffer.dtype == torch.uint8
    sizes = {pool.page(l, i).numel() for l in range(L) for i in range(paging.layer_pages(l))}
    assert sizes == {pool.layout.page_bytes}
    for l in range(L):
        for i in range(paging.layer_pages(l)):
            page = pool.page(l, i)
            assert (page.data_ptr() - pool.buffer.data_ptr()) % ALIGN == 0
            v = views(page, pool.layout)
            ids = paging.page_experts(l, i)
            for n in ("w1", "w3", "w2"):
                assert v[n].dtype == dtype
                assert v[n].shape[0] == epp
                assert torch.equal(v[n][: len(ids)], experts[l][n][list(ids)])
                assert not v[n][len(ids) :].any()  # padding rows are zero


def test_pool_uneven_pages_padding() -> None:
    paging = ExpertPaging(1, E, 3)  # 8 experts, 3 pages -> 3 + 3 + 2(+1 padding)
    experts = _experts(1, torch.float32)
    pool = _pool(paging, torch.float32, experts)
    assert paging.experts_per_page == 3 and paging.layer_pages(0) == 3
    assert pool.nbytes == 3 * pool.layout.page_bytes
    last = pool.page_views(0, 2)
    assert torch.equal(last["w2"][:2], experts[0]["w2"][6:8])
    assert torch.equal(last["w2"][2], torch.zeros(D, F))


def test_pool_with_resident_and_empty_layers() -> None:
    resident = {(1, e) for e in range(E)} | {(0, 3)}
    paging = ExpertPaging(3, E, 2, resident=resident)
    experts = _experts(3, torch.bfloat16)
    pool = _pool(paging, torch.bfloat16, experts)
    assert paging.pages_per_layer == (2, 0, 2)
    assert pool.nbytes == 4 * pool.layout.page_bytes
    assert pool.max_pages_per_layer == 2
    with pytest.raises(IndexError):
        pool.page(1, 0)
    v = pool.page_views(0, 1)
    assert torch.equal(v["w1"][:3], experts[0]["w1"][[5, 6, 7]])  # nonresident 0,1,2,4 | 5,6,7
    assert not v["w1"][3].any()


def test_write_page_sequence_order_and_errors() -> None:
    layout = pool_page_layout(2, ffn_expert_specs(F, D, torch.float32))
    pool = HostPagePool(layout, [2], pin=False)
    ex = _experts(1, torch.float32)[0]
    pool.write_page(0, 1, [ex["w1"][:2], ex["w3"][:2], ex["w2"][:2]])
    v = pool.page_views(0, 1)
    assert torch.equal(v["w3"], ex["w3"][:2]) and torch.equal(v["w2"], ex["w2"][:2])
    # non-contiguous source
    pool.write_page(0, 0, [ex["w1"][::4], ex["w3"][1::4], ex["w2"][2::4]])
    assert torch.equal(pool.page_views(0, 0)["w3"], ex["w3"][1::4])
    bad = [
        [ex["w1"][:2], ex["w3"][:2]],  # too few
        [ex["w1"][:2].double(), ex["w3"][:2], ex["w2"][:2]],  # dtype
        [ex["w1"][:3], ex["w3"][:2], ex["w2"][:2]],  # too many rows
        [ex["w2"][:2], ex["w3"][:2], ex["w1"][:2]],  # shape (order)
        {"w1": ex["w1"][:2], "w3": ex["w3"][:2]},  # missing name
    ]
    for t in bad:
        with pytest.raises(ValueError):
            pool.write_page(0, 0, t)
    with pytest.raises(IndexError):
        pool.write_page(0, 2, [ex["w1"][:2], ex["w3"][:2], ex["w2"][:2]])
    with pytest.raises(IndexError):
        pool.page(1, 0)


def test_write_expert_streaming_matches_fill() -> None:
    resident = {(0, 2), (1, 7)}
    paging = ExpertPaging(2, E, 3, resident=resident)
    experts = _experts(2, torch.bfloat16, seed=5)
    ref = _pool(paging, torch.bfloat16, experts)
    pool = HostPagePool.for_experts(paging, ffn_expert_specs(F, D, torch.bfloat16), pin=False)
    for l in range(2):
        for e in paging.nonresident(l):
            pool.write_expert(l, e, {n: experts[l][n][e] for n in ("w1", "w3", "w2")})
    for l in range(2):
        for i in range(paging.layer_pages(l)):
            k = len(paging.page_experts(l, i))
            a, b = ref.page_views(l, i), pool.page_views(l, i)
            for n in a:
                assert torch.equal(a[n][:k], b[n][:k])
    with pytest.raises(KeyError):
        pool.write_expert(0, 2, {n: experts[0][n][2] for n in ("w1", "w3", "w2")})
    with pytest.raises(RuntimeError):
        HostPagePool(pool.layout, [1], pin=False).fill_experts(experts)


def test_pool_close_and_context_cpu() -> None:
    layout = pool_page_layout(1, ffn_expert_specs(F, D, torch.float32))
    with HostPagePool(layout, [1, 1], pin=False) as pool:
        assert not pool.registered
    pool.close()
    pool.close()
    empty = HostPagePool(layout, [0, 0], pin=False)
    assert empty.nbytes == 0 and empty.max_pages_per_layer == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_without_cuda_raises() -> None:
    layout = pool_page_layout(1, ffn_expert_specs(F, D, torch.float32))
    with pytest.raises(RuntimeError):
        HostPagePool(layout, [1], pin=True)
    assert HostPagePool(layout, [1]).registered is False  # pin=None: auto, no CUDA -> not pinned


# ---- page buffers on the CPU device ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_pages", [4, 3])
def test_cpu_double_buffer_loop(dtype: torch.dtype, n_pages: int) -> None:
    L = 3
    resident = {(0, 0), (0, 7), (2, 4)}
    paging = ExpertPaging(L, E, n_pages, resident=resident)
    experts = _experts(L, dtype, seed=11)
    pool = _pool(paging, dtype, experts)
    bufs = GpuPageBuffers(pool, "cpu")
    res = ResidentExperts(paging, experts, "cpu")
    cap = paging.pages_per_layer
    assert bufs.capacity_pages == max(cap)
    expect = 2 * sum(-(-bufs.capacity_pages * e.nbytes // ALIGN) * ALIGN for e in pool.layout.entries)
    assert bufs.nbytes == expect == sum(b.numel() for b in bufs.buffers)
    assert bufs.buffer_bytes <= bufs.capacity_pages * pool.page_bytes
    assert res.nbytes == 3 * 3 * F * D * dtype.itemsize

    n_slots = 4
    b = 0
    bufs.prefetch_layer(0, b)
    for step in range(2):
        for l in range(L):
            views_ = bufs.wait_layer(l, b)
            nxt = (l + 1) % L
            for k, pages in enumerate(page_schedule(paging.layer_pages(nxt), n_slots)):
                if step == 1 and l == L - 1:
                    break  # no next layer after the last step
                bufs.prefetch_layer(nxt, 1 - b, page_range=pages)
            lx = bufs.layer_experts(l, b, res)
            assert views_["w1"].shape == (len(paging.nonresident(l)), F, D)
            assert views_["w2"].shape == (len(paging.nonresident(l)), D, F)
            assert views_["w1"].is_contiguous()
            st = lx.stacked()
            for n in ("w1", "w3", "w2"):
                assert torch.equal(st[n], experts[l][n])
            for e in range(E):
                assert torch.equal(lx.expert(e)["w3"], experts[l]["w3"][e])
            bufs.compute_done(b)
            b = 1 - b


def test_cpu_buffers_protocol_errors_and_skip() -> None:
    paging = ExpertPaging(3, E, 4)
    experts = _experts(3, torch.float32)
    pool = _pool(paging, torch.float32, experts)
    bufs = GpuPageBuffers(pool, "cpu")
    with pytest.raises(RuntimeError):
        bufs.wait_layer(0, 0)  # nothing prefetched
    assert bufs.prefetch_layer(0, 0, page_range=[0, 1]) == 2 * pool.layout.payload_bytes
    with pytest.raises(RuntimeError):
        bufs.wait_layer(0, 0)  # pages 2, 3 missing
    assert bufs.prefetch_layer(0, 0) == 2 * pool.layout.payload_bytes  # only the missing two
    assert bufs.prefetch_layer(0, 0) == 0  # already held
    bufs.wait_layer(0, 0)
    with pytest.raises(RuntimeError):
        bufs.prefetch_layer(2, 0)  # layer 0's compute still reads buffer 0
    with pytest.raises(RuntimeError):
        bufs.prefetch_layer(0, 0, force=True)
    assert bufs.prefetch_layer(0, 0) == 0  # same layer, nothing to copy: allowed
    bufs.compute_done(0)
    assert bufs.prefetch_layer(2, 0) == 4 * pool.layout.payload_bytes
    assert torch.equal(bufs.expert_weights(0)["w2"], experts[2]["w2"])
    with pytest.raises(IndexError):
        bufs.prefetch_layer(1, 2)
    with pytest.raises(IndexError):
        bufs.prefetch_layer(1, 1, page_range=[4])
    with pytest.raises(ValueError):
        GpuPageBuffers(pool, "meta")


def test_layer_experts_needs_the_resident_experts() -> None:
    paging = ExpertPaging(1, E, 2, resident={(0, 1), (0, 6)})
    experts = _experts(1, torch.float32)
    pool = _pool(paging, torch.float32, experts)
    bufs = GpuPageBuffers(pool, "cpu")
    bufs.prefetch_layer(0, 0)
    bufs.wait_layer(0, 0)
    with pytest.raises(RuntimeError):
        bufs.layer_experts(0, 0, None)  # layer 0 has resident experts


def test_all_resident_zero_size() -> None:
    paging = ExpertPaging(2, E, 2, resident={(l, e) for l in range(2) for e in range(E)})
    experts = _experts(2, torch.float32)
    pool = _pool(paging, torch.float32, experts)
    assert pool.nbytes == 0
    bufs = GpuPageBuffers(pool, "cpu")
    assert bufs.nbytes == 0
    assert bufs.prefetch_layer(1, 0) == 0
    bufs.wait_layer(1, 0)
    lx = bufs.layer_experts(1, 0, ResidentExperts(paging, experts, "cpu"))
    assert torch.equal(lx.stacked()["w1"], experts[1]["w1"])
    bufs.compute_done(0)


def test_tiling_page_count_fills_buffers_exactly():
    """The page count CGOPipe uses tiles the most-paged layer's experts exactly, so a page buffer holds that many
    experts and no more (8 paged experts over 3 slots: ceil(8 / 3) = 3 per page would make 9)."""
    from lightning_moe.pipeline.pager import ExpertPaging, tiling_page_count

    assert tiling_page_count(8, 3) == 4 and tiling_page_count(8, 1) == 1 and tiling_page_count(8, 8) == 8
    assert tiling_page_count(7, 3) == 7 and tiling_page_count(6, 3) == 3 and tiling_page_count(5, 9) == 5
    assert tiling_page_count(0, 4) == 1
    for m in range(1, 17):
        for slots in range(1, 12):
            p = tiling_page_count(m, slots)
            paging = ExpertPaging(2, 16, p, frozenset((0, e) for e in range(16 - m)) | frozenset((1, e) for e in range(16 - m)))
            assert paging.max_nonresident == m and p * paging.experts_per_page == m and p >= min(m, slots)
    with pytest.raises(ValueError):
        tiling_page_count(3, 0)
