"""CGOPipe's stage statistics: where a decode's time went, per stage, next to the HRM's prediction.

:class:`StageTimer` collects two kinds of seconds under stage names: GPU time around waits enqueued on a stream
(pairs of CUDA events, read at one synchronization per batch, never during the decode) and host seconds measured
with ``time.perf_counter`` (the CPU-attention worker, the host thread's waits). :func:`add_counts` adds a batch's
numbers into ``RunStats.extra``, which the run report prints (its "stages" block).

Stage names: ``h2d_copy`` (expert pages on the weight stream), ``wait_h2d`` (the compute stream waiting for a
visit's pages), ``wait_attention`` (for a CPU attention output copied by DMA), ``cpu_attention`` and its parts
``cpu_attention_wait_qkv`` / ``_pin`` / ``_compute`` (the worker), ``host_wait_cpu_attention`` (the host thread
waiting for the worker), ``decode_wall``; a prefill's as ``prefill_<stage>`` (the page copies and waits, ``kv_write``:
its KV scattered into CPU caches, ``host_wait_kv_write``: the host thread waiting for those writes, ``prefill_wall``); counters ``cpu_attention_valid_kv_bytes``, ``attention_zero_copy_bytes``
and the native CPU attention kernel's ``cpu_attention_native_*`` (kernels.cpu_attention.native_stats).

Spans (``moe-batch run --timeline``): only after :meth:`StageTimer.start_spans`, the timer also keeps every interval
of the timeline's lanes (:data:`SPAN_LANES`: H2D page copies, the compute stream's waits for them, GPU attention, the
GPU expert FFN, CPU attention on the worker, the prefill's KV writes into CPU caches and the host's waits for them)
with the phase it ran in, and the phases themselves. GPU intervals are
the CUDA event pairs of :meth:`StageTimer.around` / :meth:`StageTimer.timed`, placed on the host clock by one reference
event recorded at a synchronization; on the CPU they are host seconds around the synchronous call.
:meth:`StageTimer.take_spans` returns them and stops recording. Without ``start_spans`` nothing of this runs.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, TypeVar

import time

import torch

T = TypeVar("T")

SPAN_LANES = {  # stage name -> timeline lane (in drawing order, top to bottom)
    "h2d_copy": "H2D expert pages",
    "wait_h2d": "GPU waits for pages",
    "gpu_attention": "GPU attention",
    "expert_ffn": "GPU expert FFN",
    "cpu_attention": "CPU attention (worker)",
    "kv_write": "prefill KV into the CPU cache",
    "host_wait_kv_write": "host waits for KV writes",
}


class StageTimer:
    """Pairs of CUDA events on a stream around waits, and host seconds; summed lazily (one sync per batch).

    Args:
        cuda: whether the executor runs on CUDA (elsewhere :meth:`around` only calls ``fn``).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pairs: dict[str, list] = {}
        self.host: dict[str, float] = {}
        self.spans_on = False  # start_spans() .. take_spans(): the timeline's intervals are kept
        self.phase: Optional[str] = None  # the executor's phase, stamped on each span
        self._spans: list[tuple] = []  # (stage, phase, t0, t1) host seconds (perf_counter)
        self._gpu_spans: list[tuple] = []  # (stage, phase, event a, event b)
        self._ref = None  # (CUDA event, its host time) placing GPU events on the host clock
        self._t0 = 0.0

    def around(self, name: str, stream, fn: Callable[[], T]) -> T:
        """``fn()``, with a CUDA event recorded on ``stream`` before and after it (the GPU time of the work it
        enqueues there, e.g. a wait); returns what ``fn`` returns. While spans are recorded, a stage of
        :data:`SPAN_LANES` also keeps its interval (on the CPU: host seconds around ``fn``)."""
        if not self.cuda:
            if self.spans_on and name in SPAN_LANES:
                t0 = time.perf_counter()
                out = fn()
                self._spans.append((name, self.phase, t0, time.perf_counter()))
                return out
            return fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        out = fn()
        b.record(stream)
        self.pairs.setdefault(name, []).append((a, b))
        if self.spans_on and name in SPAN_LANES:
            self._gpu_spans.append((name, self.phase, a, b))
        return out

    # ---- spans (the timeline) -----------------------------------------------------------------
    def start_spans(self) -> None:
        """Start keeping the timeline's intervals (from now; earlier ones are dropped)."""
        self._spans, self._gpu_spans = [], []
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            self._ref = (ev, time.perf_counter())
        self._t0 = time.perf_counter()
        self.spans_on = True

    def timed(self, name: str, stream, fn: Callable[[], T]) -> T:
        """``fn()``; while spans are recorded, its interval as stage ``name`` (GPU: events on ``stream``, not summed
        into the stage times). Costs one attribute test otherwise."""
        if not self.spans_on:
            return fn()
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn()
            self._spans.append((name, self.phase, t0, time.perf_counter()))
            return out
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        out = fn()
        b.record(stream)
        self._gpu_spans.append((name, self.phase, a, b))
        return out

    def span(self, name: str, t0: float, t1: float, phase: Optional[str] = None) -> None:
        """Keep a host interval (perf_counter seconds) as stage ``name`` while spans are recorded (``"phase"``: a
        phase's own interval, ``phase`` naming it)."""
        if self.spans_on:
            self._spans.append((name, phase or self.phase, t0, t1))

    def take_spans(self) -> list[dict]:
        """The intervals since :meth:`start_spans` as ``{"stage", "lane", "phase", "start", "end"}`` (seconds from
        the start), sorted by start; recording stops."""
        out = [(n, ph, a - self._t0, b - self._t0) for n, ph, a, b in self._spans]
        if self.cuda and self._gpu_spans:
            torch.cuda.synchronize()
            ev, t_ref = self._ref
            off = t_ref - self._t0
            out += [(n, ph, off + ev.elapsed_time(a) / 1e3, off + ev.elapsed_time(b) / 1e3)
                    for n, ph, a, b in self._gpu_spans]
        self.spans_on, self._spans, self._gpu_spans = False, [], []
        return sorted(({"stage": n, "lane": SPAN_LANES.get(n, n), "phase": ph, "start": a, "end": b}
                       for n, ph, a, b in out), key=lambda d: d["start"])

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
