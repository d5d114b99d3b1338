"""pipeline.huge_pages: CPU KV caches advised onto transparent huge pages before their first touch (Linux THP in mode
always or madvise); the values are torch.zeros' either way."""

import re
import sys

import pytest
import torch

from lightning_moe.pipeline import huge_pages
from lightning_moe.pipeline.kv_cache import GroupedKVCache
from lightning_moe.policy.registry import resolve_spec


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "none"


def _anon_huge_bytes(ptr: int) -> int:
    """AnonHugePages of the mapping of this process that holds address ``ptr`` (/proc/self/smaps)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def test_zeros_are_zeros_of_the_dtype():
    for n, dt in ((0, torch.bfloat16), (7, torch.float32), (3 << 20, torch.bfloat16)):
        t = huge_pages.zeros(n, dt)
        assert t.dtype == dt and t.shape == (n,) and t.device.type == "cpu" and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="needs Linux transparent huge pages in mode always or madvise")
def test_a_cpu_kv_cache_lies_on_huge_pages():
    """A GroupedKVCache of 64 MiB per layer: its storage's mapping holds huge pages (in mode madvise only the advice
    gives them; without it this fails there). Twice, the second after freeing the first (memory a process has
    touched before is where plain allocations lose them)."""
    spec = resolve_spec("mixtral-8x7b").with_layers(1)
    for _ in range(2):
        kv = GroupedKVCache(spec, [2048] * 16, torch.bfloat16)  # 16 rows x 2048 positions x 4 KiB = 128 MiB (K and V)
        for t in (kv.k_flat[0], kv.v_flat[0]):
            assert _anon_huge_bytes(t.data_ptr()) >= 32 << 20 and not t.any()
        del kv
