"""CPU decode attention and pinned host-to-device copies at once: the profile's point for the HRM's (H5').

CGOPipe pages experts to the GPU (DMA reads of host DRAM) while its CPU worker streams KV (CPU reads of host DRAM).
The profile's ``cpu_attention_bandwidth`` and ``pcie_h2d`` are each measured with the machine to itself; this
measures how much of each the two keep when they run together. Both rates are measured in one harness, alone and
together, over the same kind of window: the CPU attention as profiler.measure_cpu_attention_executor runs it (the
layer callable profiler.executor_attention_layer makes), on a worker thread, and a thread that keeps two pinned
host-to-device copies in flight (so the DMA engine never idles between copies) and waits on blocking events (so it
takes no core from the attention while it waits). policy.hrm.dram_sharing turns the fractions into the HRM's rows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..policy.hardware import MiB

START_TIMEOUT_S = 60.0  # seconds PinnedCopyLoad waits for its first copy before it gives up


class PinnedCopyLoad:
    """A thread copying ``nbytes`` of pinned host memory to the GPU on its own stream, two copies in flight, until
    stopped; :attr:`done` holds (time, bytes) of every finished copy (``time.perf_counter`` seconds, taken when its
    blocking event returned). A context manager: starts on enter (and waits for the first copy; a copy thread that
    fails raises its error there, or on exit), stops and joins on exit."""

    def __init__(self, nbytes: int = 64 * MiB, device: str = "cuda"):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.done: list[tuple[float, int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            stream, pending = torch.cuda.Stream(device=self.dev.device), deque()
            with torch.cuda.stream(stream):
                while not self._stop.is_set():
                    self.dev.copy_(self.host, non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning on a core
                    ev.record(stream)
                    pending.append(ev)
                    if len(pending) == 2:  # the next copy is queued before this one is waited for
                        pending.popleft().synchronize()
                        self.done.append((time.perf_counter(), self.host.numel()))
                stream.synchronize()
        except BaseException as e:  # noqa: BLE001 -- handed to the thread that measures
            self.error = e

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"pinned copy thread failed: {type(self.error).__name__}: {self.error}") from self.error

    def __enter__(self) -> "PinnedCopyLoad":
        self._thread.start()
        deadline = time.perf_counter() + START_TIMEOUT_S
        while not self.done and self._thread.is_alive() and time.perf_counter() < deadline:
            time.sleep(1e-3)
        if not self.done:
            self.__exit__()
            raise RuntimeError(f"pinned copy thread finished no copy in {START_TIMEOUT_S:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if not exc or exc[0] is None:
            self._raise()


def window_rate(done: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """Bytes/s of the copies finished inside [t0, t1]: the bytes of all but the first over the time from the first's
    end to the last's (the copies run back to back); 0.0 with fewer than two."""
    inside = [d for d in done if t0 <= d[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return sum(b for _, b in inside[1:]) / (inside[-1][0] - inside[0][0])


@dataclass(frozen=True)
class SharingPoint:
    """One harness's rates (bytes/s): CPU attention and pinned H2D alone, then together (the best window)."""

    cpu_alone: float  # valid KV the attention streams with the machine to itself
    h2d_alone: float  # pinned H2D with the machine to itself
    cpu_together: float  # the attention's rate while the copies run
    h2d_together: float  # the copies' rate over the same window

    @property
    def fractions(self) -> tuple[float, float]:
        """(cpu_together / cpu_alone, h2d_together / h2d_alone), each at most 1 (a noisy window above the rate
        alone is no contention)."""
        return min(1.0, self.cpu_together / self.cpu_alone), min(1.0, self.h2d_together / self.h2d_alone)


def _attention_window(pool: ThreadPoolExecutor, layer: Callable[[int], object], layers: int,
                      window_s: float) -> tuple[float, float, int]:
    """(t0, t1, passes): whole passes over the layers on the worker for at least ``window_s`` seconds."""
    passes, t0 = 0, time.perf_counter()
    while (t1 := time.perf_counter()) - t0 < window_s or passes == 0:
        for l in range(layers):
            pool.submit(layer, l).result()
        passes += 1
    return t0, t1, passes


def measure_cpu_attention_under_h2d(layer: Callable[[int], object], layer_bytes: int, layers: int, windows: int = 3,
                                    window_s: float = 0.4, copy_bytes: int = 64 * MiB) -> SharingPoint:
    """CPU attention and pinned H2D, alone and together, in one harness (a :class:`SharingPoint`).

    ``layer(l)`` runs one layer's CPU decode attention reading ``layer_bytes`` of valid KV
    (profiler.executor_attention_layer). Alone: the best of ``windows`` windows of whole passes over the ``layers``
    layers on a one-thread worker (as CGOPipe), each at least ``window_s`` seconds, and the best of as many windows
    of :class:`PinnedCopyLoad` copying ``copy_bytes`` at a time; together: the same windows with the copies running,
    the window farthest out along both rates (the largest sum of the two fractions of the rates alone): the point
    the HRM's hull is built on. Needs CUDA (raises RuntimeError without it, or when the copy thread fails).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_cpu_attention_under_h2d needs CUDA (pinned host-to-device copies)")
    with ThreadPoolExecutor(max_workers=1) as pool:
        for l in range(layers):  # warm-up pass
            pool.submit(layer, l).result()
        cpu_alone = max(layer_bytes * layers * n / (t1 - t0)
                        for t0, t1, n in (_attention_window(pool, layer, layers, window_s) for _ in range(windows)))
        with PinnedCopyLoad(copy_bytes) as load:
            h2d_alone = 0.0
            for _ in range(windows):
                t0 = time.perf_counter()
                time.sleep(window_s)
                h2d_alone = max(h2d_alone, window_rate(load.done, t0, time.perf_counter()))
            if h2d_alone <= 0:
                raise RuntimeError(f"pinned copy thread finished fewer than two copies in {window_s} s windows")
            best = (0.0, 0.0)
            for _ in range(windows):
                t0, t1, n = _attention_window(pool, layer, layers, window_s)
                point = (layer_bytes * layers * n / (t1 - t0), window_rate(load.done, t0, t1))
                if point[0] / cpu_alone + point[1] / h2d_alone > best[0] / cpu_alone + best[1] / h2d_alone:
                    best = point
    return SharingPoint(cpu_alone, h2d_alone, *best)
