"""Host tensors on transparent huge pages: the CPU KV caches.

A job's CPU KV cache is tens of GB (60 GB for the full-size Mixtral at N 2,000). On 4 KiB pages its first touch
faults page by page (6 GiB: 3.4 s on 4 KiB pages against 0.8 s on 2 MiB ones, on our 2-core KVM host), and its
page tables (8 bytes per 4 KiB page: 120 MB for 60 GB) do not fit the CPU caches, so the attention's TLB misses may
walk tables in DRAM (not measured on the GPU host yet: session 43's in-job CPU attention ran at 0.63 of the profile's
rate, over 40 times the probe's KV). ``madvise(MADV_HUGEPAGE)`` on the storage before its first touch asks the kernel
for 2 MiB pages
there (Linux transparent huge pages in mode ``always`` or ``madvise``; mode ``never``, or another OS: plain pages,
nothing else changes).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype)`` in host memory, on transparent huge pages where the OS gives them.

    At least :data:`HUGE_PAGE` bytes, where Python's ``mmap`` knows ``MADV_HUGEPAGE`` (Linux): a private anonymous
    mapping of its own, advised before anything touches it (memory from the C allocator may be pages touched
    before, which the advice does not turn into huge pages: seen under the test suite), then zeroed, so its pages
    are faulted in here rather than inside a timed decode step. The tensor keeps the mapping alive; it is unmapped
    with the tensor. Smaller, or elsewhere: ``torch.zeros``.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: plain pages
        pass
    return torch.frombuffer(buf, dtype=dtype, count=numel).zero_()
