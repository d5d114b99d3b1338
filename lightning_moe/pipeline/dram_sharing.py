"""CPU decode attention and pinned host-to-device copies at once: the profile's point for the HRM's (H5').

CGOPipe pages experts to the GPU (DMA reads of host DRAM) while its CPU worker streams KV (CPU reads of host DRAM).
The profile's ``cpu_attention_bandwidth`` and ``pcie_h2d`` are each measured with the machine to itself; this
measures the two running together, over the same windows: the CPU attention as
profiler.measure_cpu_attention_executor runs it (the layer callable profiler.executor_attention_layer makes), on a
worker thread, while another thread copies pinned host memory to the GPU back to back. policy.hrm.dram_sharing turns the pair into the HRM's sharing rows.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from ..policy.hardware import MiB


class PinnedCopyLoad:
    """A thread that copies ``nbytes`` of pinned host memory to the GPU back to back, on its own stream, until
    stopped; :attr:`copies` holds (start, end, bytes) of every finished copy (``time.perf_counter`` seconds; end is
    after the stream's synchronize). A context manager: starts on enter, stops and joins on exit."""

    def __init__(self, nbytes: int = 64 * MiB, device: str = "cuda"):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.copies: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream = torch.cuda.Stream(device=self.dev.device)
        with torch.cuda.stream(stream):
            while not self._stop.is_set():
                t0 = time.perf_counter()
                self.dev.copy_(self.host, non_blocking=True)
                stream.synchronize()
                self.copies.append((t0, time.perf_counter(), self.host.numel()))

    def __enter__(self) -> "PinnedCopyLoad":
        self._thread.start()
        while not self.copies:  # running at full rate before anything is timed
            time.sleep(1e-3)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def window_rate(copies: Sequence[tuple[float, float, int]], t0: float, t1: float) -> float:
    """Bytes/s of the copies that lie wholly inside [t0, t1], over the span from the first one's start to the last
    one's end (0.0 when none does)."""
    inside = [c for c in copies if c[0] >= t0 and c[1] <= t1]
    if not inside:
        return 0.0
    span = max(c[1] for c in inside) - min(c[0] for c in inside)
    return sum(c[2] for c in inside) / span if span > 0 else 0.0


def measure_cpu_attention_under_h2d(layer: Callable[[int], object], layer_bytes: int, layers: int, cpu_bw: float,
                                    h2d_bw: float, windows: int = 3, window_s: float = 0.4,
                                    copy_bytes: int = 64 * MiB) -> tuple[float, float]:
    """(bytes/s of valid KV the CPU attention streams, bytes/s of pinned H2D) with both running at once.

    ``layer(l)`` runs one layer's CPU decode attention reading ``layer_bytes`` of valid KV
    (profiler.executor_attention_layer). Each of ``windows`` windows runs whole passes over the ``layers`` layers (on
    a one-thread worker, as CGOPipe) for at least ``window_s`` seconds while :class:`PinnedCopyLoad` copies
    ``copy_bytes`` at a time; the pair of the window farthest out along both rates (the largest cpu / ``cpu_bw`` +
    h2d / ``h2d_bw``, with ``cpu_bw`` and ``h2d_bw`` the rates alone, as the profile measured them) is returned: the
    point the HRM's hull is built on. Needs CUDA (raises RuntimeError without it).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_cpu_attention_under_h2d needs CUDA (pinned host-to-device copies)")
    best = (0.0, 0.0)
    with ThreadPoolExecutor(max_workers=1) as pool, PinnedCopyLoad(copy_bytes) as load:
        for l in range(layers):  # warm-up pass
            pool.submit(layer, l).result()
        for _ in range(windows):
            passes, t0 = 0, time.perf_counter()
            while (t1 := time.perf_counter()) - t0 < window_s or passes == 0:
                for l in range(layers):
                    pool.submit(layer, l).result()
                passes += 1
            point = (layer_bytes * layers * passes / (t1 - t0), window_rate(load.copies, t0, t1))
            if point[0] / cpu_bw + point[1] / h2d_bw > best[0] / cpu_bw + best[1] / h2d_bw:
                best = point
    return best
