"""GPU tests of lightning_moe.pipeline.pager: pinned host pool, double-buffered prefetch with events.

Run on a CUDA host: ``pytest -m gpu tests/gpu/test_pager_gpu.py -s`` (``-s`` shows the measured
host-to-device bandwidth). Skipped without CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_moe.kernels.pages import PageLayout, views
from lightning_moe.pipeline.pager import (
    ExpertPaging,
    GpuPageBuffers,
    HostPagePool,
    ResidentExperts,
    ffn_expert_specs,
    page_schedule,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E = 8
NAMES = ("w1", "w3", "w2")


def _experts(L: int, F: int, D: int, dtype: torch.dtype, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(E, F, D, generator=g).to(dtype),
            "w3": torch.randn(E, F, D, generator=g).to(dtype),
            "w2": torch.randn(E, D, F, generator=g).to(dtype),
        }
        for _ in range(L)
    ]


def _pool(paging: ExpertPaging, F: int, D: int, dtype: torch.dtype, experts) -> HostPagePool:
    pool = HostPagePool.for_experts(paging, ffn_expert_specs(F, D, dtype))  # pin=None -> pinned on CUDA
    pool.fill_experts(experts)
    return pool


def test_pool_is_registered_and_copies() -> None:
    paging = ExpertPaging(2, E, 4)
    experts = _experts(2, 37, 24, torch.bfloat16, 0)
    pool = _pool(paging, 37, 24, torch.bfloat16, experts)
    with pool:
        assert pool.registered and pool.register_rc == 0
        assert pool.buffer.is_pinned()
        assert pool.page(1, 3).is_pinned()
        dev = torch.empty(pool.page_bytes, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            dev.copy_(pool.page(1, 3), non_blocking=True)
        s.synchronize()
        assert torch.equal(dev.cpu(), pool.page(1, 3))
        on_gpu, on_host = views(dev, pool.layout), pool.page_views(1, 3)  # views work on a GPU page too
        for n in NAMES:
            assert on_gpu[n].is_cuda and torch.equal(on_gpu[n].cpu(), on_host[n])
        assert torch.equal(on_host["w2"][:2], experts[1]["w2"][6:8])
    assert not pool.registered
    assert not pool.buffer.is_pinned()
    pool.close()  # idempotent


def test_pinned_bandwidth_report() -> None:
    """Times 256 MiB of 64 MiB pages pool -> GPU (informational; asserts only correctness)."""
    page = 64 << 20
    layout = PageLayout.build([("x", torch.uint8, (page,))])
    with HostPagePool(layout, [4]) as pool:
        assert pool.registered
        pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(1))
        dev = torch.empty(pool.nbytes, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        for _ in range(2):  # warm-up, then measure
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                start.record(s)
                for i in range(4):
                    dev[i * page : (i + 1) * page].copy_(pool.page(0, i), non_blocking=True)
                end.record(s)
            issue_s = time.perf_counter() - t0
            end.synchronize()
        gbs = pool.nbytes / (start.elapsed_time(end) * 1e-3) / 1e9
        print(f"\npinned pool h2d: {gbs:.1f} GB/s over {pool.nbytes >> 20} MiB; issue took {issue_s * 1e3:.2f} ms")
        assert torch.equal(dev.cpu(), pool.buffer)


@pytest.mark.parametrize(
    "F, D, dtype, n_pages",
    [(37, 24, torch.bfloat16, 4), (37, 24, torch.float32, 3), (1024, 512, torch.bfloat16, 4), (1024, 512, torch.float32, 3)],
)
def test_double_buffered_prefetch_three_layers(F: int, D: int, dtype: torch.dtype, n_pages: int) -> None:
    L, n_slots, steps = 3, 4, 2
    resident = {(0, 2), (1, 0), (1, 5), (2, 7)}
    paging = ExpertPaging(L, E, n_pages, resident=resident)
    experts = _experts(L, F, D, dtype, seed=F + n_pages)
    with _pool(paging, F, D, dtype, experts) as pool:
        bufs = GpuPageBuffers(pool, "cuda")
        res = ResidentExperts(paging, experts, "cuda")
        h2d, compute = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.randn(512, 512, device="cuda")
        torch.cuda.synchronize()
        outs = []
        b = 0
        bufs.prefetch_layer(0, b, h2d)
        for step in range(steps):
            for l in range(L):
                nxt = (l + 1) % L
                last = step == steps - 1 and l == L - 1
                bufs.wait_layer(l, b, compute)
                for k, pages in enumerate(page_schedule(paging.layer_pages(nxt), n_slots)):
                    with torch.cuda.stream(compute):  # stand-in for micro-batch k's work
                        x = torch.tanh(x @ x)
                    if not last:
                        bufs.prefetch_layer(nxt, 1 - b, h2d, page_range=pages)
                with torch.cuda.stream(compute):
                    lx = bufs.layer_experts(l, b, res)
                    outs.append((l, lx.stacked()))
                bufs.compute_done(b, compute)
                b = 1 - b
        torch.cuda.synchronize()
        assert len(outs) == L * steps
        for l, st in outs:
            for n in NAMES:
                assert st[n].dtype == dtype
                assert torch.equal(st[n].cpu(), experts[l][n]), (l, n)
        del bufs, res, outs
        torch.cuda.synchronize()


def _slow_reader_setup(dtype=torch.float32, F=256, D=128):
    L = 3
    paging = ExpertPaging(L, E, 4)
    experts = _experts(L, F, D, dtype, seed=7)
    pool = _pool(paging, F, D, dtype, experts)
    bufs = GpuPageBuffers(pool, "cuda")
    h2d, compute = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):  # warm up cuBLAS on this stream
        _ = a @ a
    torch.cuda.synchronize()
    bufs.prefetch_layer(0, 0, h2d)
    bufs.prefetch_layer(1, 1, h2d)
    bufs.wait_layer(0, 0, compute)
    with torch.cuda.stream(compute):
        c = a
        for _ in range(12):  # slow compute (~10^13 FLOP) before the read of buffer 0
            c = a @ c
            c = c / c.abs().amax().clamp_min(1.0)
        snapshot = {n: v.clone() for n, v in bufs.expert_weights(0).items()}
    return pool, bufs, experts, h2d, compute, snapshot


def test_no_overwrite_before_compute_done() -> None:
    pool, bufs, experts, h2d, compute, snapshot = _slow_reader_setup()
    with pool:
        bufs.compute_done(0, compute)
        bufs.prefetch_layer(2, 0, h2d)  # targets buffer 0 while the slow reader is still queued
        busy = not compute.query()
        torch.cuda.synchronize()
        for n in NAMES:
            assert torch.equal(snapshot[n].cpu(), experts[0][n]), n  # the reader saw layer 0
        bufs.wait_layer(2, 0, compute)
        with torch.cuda.stream(compute):
            after = {n: v.clone() for n, v in bufs.expert_weights(0).items()}
        bufs.compute_done(0, compute)
        torch.cuda.synchronize()
        for n in NAMES:
            assert torch.equal(after[n].cpu(), experts[2][n]), n  # and then layer 2 landed
        assert busy, "compute finished before the prefetch was issued: the test did not exercise the wait"
        del bufs
        torch.cuda.synchronize()


def test_control_copy_without_wait_does_race() -> None:
    """Sanity check of the slow-reader construction: a raw copy that skips the compute-done wait
    does overwrite buffer 0 before the reader runs (so the test above can detect a missing wait)."""
    pool, bufs, experts, h2d, compute, snapshot = _slow_reader_setup()
    with pool:
        with torch.cuda.stream(h2d):  # bypass prefetch_layer: no wait_event on the compute-done event
            for p in range(pool.pages_per_layer[2]):
                bufs._copy_page(2, p, bufs.buffers[0], non_blocking=True)
        h2d.synchronize()
        busy = not compute.query()
        torch.cuda.synchronize()
        if not busy:
            pytest.skip("compute finished before the raw copy landed; race not constructed")
        for n in NAMES:
            assert torch.equal(snapshot[n].cpu(), experts[2][n]), n  # the reader saw the overwrite
        bufs.compute_done(0, compute)
        del bufs
        torch.cuda.synchronize()


def test_default_streams_and_skip() -> None:
    """stream=None uses the current stream; pages already in a buffer are not re-sent."""
    paging = ExpertPaging(2, E, 2)
    experts = _experts(2, 64, 32, torch.bfloat16, 3)
    with _pool(paging, 64, 32, torch.bfloat16, experts) as pool:
        bufs = GpuPageBuffers(pool, torch.device("cuda"))
        assert bufs.prefetch_layer(0, 0) == 2 * pool.layout.payload_bytes
        assert bufs.prefetch_layer(1, 1) == 2 * pool.layout.payload_bytes
        for _ in range(3):  # two layers, two buffers: after the first pass nothing moves
            for l in range(2):
                assert bufs.prefetch_layer(l, l) == 0
                w = bufs.wait_layer(l, l)
                for n in NAMES:
                    assert torch.equal(w[n].cpu(), experts[l][n])
                bufs.compute_done(l)
        torch.cuda.synchronize()
        del bufs
