"""CGOPipe's stage statistics: where a decode's time went, per stage, next to the HRM's prediction.

:class:`StageTimer` collects two kinds of seconds under stage names: GPU time around waits enqueued on a stream
(pairs of CUDA events, read at one synchronization per batch, never during the decode) and host seconds measured
with ``time.perf_counter`` (the CPU-attention worker, the host thread's waits). :func:`add_counts` adds a batch's
numbers into ``RunStats.extra``, which the run report prints (its "stages" block).

Stage names: ``h2d_copy`` (expert pages on the weight stream), ``wait_h2d`` (the compute stream waiting for a
visit's pages), ``wait_attention`` (for a CPU attention output copied by DMA), ``cpu_attention`` and its parts
``cpu_attention_wait_qkv`` / ``_pin`` / ``_compute`` (the worker), ``host_wait_cpu_attention`` (the host thread
waiting for the worker), ``decode_wall``; counters ``cpu_attention_valid_kv_bytes``, ``attention_zero_copy_bytes``
and the native CPU attention kernel's ``cpu_attention_native_*`` (kernels.cpu_attention.native_stats).
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

import torch

T = TypeVar("T")


class StageTimer:
    """Pairs of CUDA events on a stream around waits, and host seconds; summed lazily (one sync per batch).

    Args:
        cuda: whether the executor runs on CUDA (elsewhere :meth:`around` only calls ``fn``).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pairs: dict[str, list] = {}
        self.host: dict[str, float] = {}

    def around(self, name: str, stream, fn: Callable[[], T]) -> T:
        """``fn()``, with a CUDA event recorded on ``stream`` before and after it (the GPU time of the work it
        enqueues there, e.g. a wait); returns what ``fn`` returns."""
        if not self.cuda:
            return fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        out = fn()
        b.record(stream)
        self.pairs.setdefault(name, []).append((a, b))
        return out

    def add_host(self, name: str, seconds: float) -> None:
        """Add host seconds to stage ``name``."""
        self.host[name] = self.host.get(name, 0.0) + seconds

    def collect(self) -> dict[str, float]:
        """Seconds per name since the last collect (GPU event pairs are synchronized here); starts over."""
        out = dict(self.host)
        for name, pairs in self.pairs.items():
            out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        self.pairs.clear()
        self.host = {}
        return out


def add_counts(extra: dict, counts: Mapping[str, float], prefix: str = "") -> None:
    """``extra[prefix + name] += value`` for every count (a missing name starts at 0)."""
    for k, v in counts.items():
        extra[prefix + k] = extra.get(prefix + k, 0) + v
