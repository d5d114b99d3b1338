"""Where CGOPipe's decode attention runs, and the host transfers around it.

A decode micro-batch (:class:`MicroBatch`) keeps its KV cache and runs its attention either on the GPU (the first
``policy.n_gpu_attn`` micro-batches, on CUDA) or on the CPU: q/k/v go to pinned host buffers on the D2H stream, the
worker thread appends k/v to the CPU cache and attends (the native kernel, GQA or MLA's latent attention; torch
where it is not built), and the result comes back to the GPU by a zero-copy kernel read or a DMA on its own stream
(``attention_h2d``), never queued behind the expert pages. On a CPU-only job (device cpu) there is no worker: the
attention runs inline, since a second thread would only compete with the layer's matmuls for the same cores.
:class:`AttentionPlacement` owns the worker thread, the two transfer streams and these paths; :func:`micro_batches`
builds a batch's micro-batches and their caches.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..kernels.host_read import copy_from_host_triton, host_read_available
from ..policy.batching import group_by_length
from .cgopipe_options import CGOPipeOptions
from .executor import RunStats
from .kv_cache import GroupedKVCache, GroupedLatentKVCache
from .stage_stats import StageTimer, add_counts


@dataclass
class MicroBatch:
    """Sequences of one micro-batch and where its KV cache lives."""

    rows: list[int]  # indices into the batch's prompt list
    kv: Optional[GroupedKVCache]  # this micro-batch's cache (rows 0..len(rows)-1, length groups), CPU or GPU; None: no KV
    #   (MLA: a GroupedLatentKVCache on the CPU)
    on_gpu: bool  # attention + KV on the GPU (policy.n_gpu_attn) instead of the CPU
    x: Optional[torch.Tensor] = None  # [mu_k, D] hidden states on the GPU during a decode step
    pos: Optional[torch.Tensor] = None  # int64 [mu_k] on the GPU: position of the next token of each row
    rope: Optional[tuple] = None  # RoPE (cos, sin) [mu_k, hd] of ``pos``, computed once per decode step for every layer
    #   (MLA: None, the family's pre_attention makes its own tables in its RoPE dtype)
    attn_out: Optional[torch.Tensor] = None  # [mu_k, Hq*hd] host buffer CPU attention writes every layer (pinned on CUDA)
    #   (MLA: the attention-weighted latents [mu_k, Hq, kv_lora])


def micro_batches(prompts: Sequence[Sequence[int]], mu: int, spec, family, policy, device: torch.device, cuda: bool,
                  dtype, extra: int, with_kv: bool, kv_groups: int) -> list[MicroBatch]:
    """Micro-batches of at most ``mu`` rows grouped by prompt length (policy.batching.group_by_length); the first
    ``policy.n_gpu_attn`` (the shortest) keep KV and attention on the GPU (``device``) when ``cuda``.

    With ``with_kv`` each gets a :class:`GroupedKVCache` (MLA: :class:`GroupedLatentKVCache`) whose rows need prompt
    length + ``extra`` positions (``extra`` = the most tokens a row has left to generate), split into at most
    ``kv_groups`` length groups.
    """
    lens = [len(p) for p in prompts]
    n = -(-len(prompts) // mu)
    groups = [g for g in group_by_length(lens, mu, n) if g]
    mbs = []
    cache = GroupedLatentKVCache if family.attention == "mla" else GroupedKVCache
    for k, rows in enumerate(groups):
        on_gpu = cuda and k < policy.n_gpu_attn
        kv = None
        if with_kv:
            kv = cache(spec, [lens[r] + extra for r in rows], dtype, device if on_gpu else "cpu", max_groups=kv_groups)
            kv.lengths[:] = torch.tensor([lens[r] for r in rows])
        mbs.append(MicroBatch(rows, kv, on_gpu))
    return mbs


class AttentionPlacement:
    """Decode attention of a micro-batch on the GPU (:meth:`gpu`) or on the CPU worker (:meth:`submit_cpu`, then
    :meth:`receive`), and the pinned D2H staging both CPU attention and prefill's CPU-cache KV writes use
    (:meth:`to_host`).

    Args:
        spec, family: the model and its family's math (decode and latent attention).
        layers: the executor's layer weights on the device (gpt-oss's sinks are copied to the host once).
        device: the compute device; on the CPU every micro-batch attends on the CPU with synchronous "copies".
        dtype: the compute dtype (bytes of a KV position).
        policy: ``n_gpu_attn`` and ``n`` (whether any micro-batch attends on the CPU: its native kernel is built now).
        opts: ``cpu_threads`` (the worker's torch threads), ``attention_h2d``, ``gpu_attention``.
        timer: the executor's stage timer; compute: the compute stream (None on the CPU); stats: returns the
            executor's counters (``RunStats``) as they are now.
    """

    def __init__(self, spec, family, layers, device: torch.device, dtype, policy, opts: CGOPipeOptions,
                 timer: StageTimer, compute, stats: Callable[[], RunStats]):
        self.spec, self.family, self.device, self.timer, self.compute = spec, family, device, timer, compute
        self._stats = stats  # the executor's current RunStats (the engine replaces it per job)
        self.cuda = device.type == "cuda"
        self.mla = family.attention == "mla"
        self.sinks = family.attention == "gqa_sinks"
        self.gpu_attention = opts.gpu_attention
        if self.cuda:
            self.h2d_a = torch.cuda.Stream(device)  # attention outputs
            self.d2h = torch.cuda.Stream(device)  # q/k/v to the CPU
        else:
            self.h2d_a = self.d2h = None
        # the layers' sinks on the host (fp32 [Hq]), for the worker's CPU attention (no device read per layer and step)
        self._cpu_sinks = [lw.sinks.to("cpu", torch.float32).contiguous() for lw in layers] \
            if self.sinks else None  # (from the device copies: on CUDA the host layers were released)
        # and on the device, for GPU-attention micro-batches (fp32 [Hq] per layer: the Triton kernel's operand)
        self._gpu_sinks = [lw.sinks.to(device, torch.float32).contiguous() for lw in layers] \
            if self.sinks and policy.n_gpu_attn > 0 else None
        self._layers = layers  # the family's sinks attention takes the layer's weights (torch GPU path)
        if not self.cuda or policy.n_gpu_attn < max(1, policy.n):  # some micro-batch attends on the CPU (GQA or MLA)
            from ..kernels.cpu_attention import native_available

            native_available()  # builds the native CPU attention kernel now (once; cached), not in the first decode step
        threads = opts.cpu_threads
        init = (torch.set_num_threads, (threads,)) if threads else (None, ())
        # device cpu: CPU attention runs inline on the calling thread. A worker would only share the cores with the
        # layer's own matmuls (two thread teams on the same cores: tiny-mixtral on 2 cores decoded 2.4x slower).
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attn", initializer=init[0],
                                          initargs=init[1]) if self.cuda else None
        if not self.cuda and threads:
            torch.set_num_threads(threads)  # process-wide, as the worker's initializer would do
        h2d = opts.attention_h2d
        if self.cuda and h2d == "auto":
            h2d = "kernel" if host_read_available(device) else "dma"
        self.attention_h2d = h2d if self.cuda else "dma"
        # K and V (MLA: the latent and the rope key) of one position and layer
        self._kv_bytes_per_position = spec.kv_elems_per_token * torch.empty((), dtype=dtype).element_size()
        self.attn_kv_bytes = 0  # valid K and V bytes read by CPU attention in this decode (worker thread)

    def close(self) -> None:
        """Release the worker thread (CUDA)."""
        if self.workers is not None:
            self.workers.shutdown(wait=True)

    # ---- host transfers ---------------------------------------------------------------------------
    def to_host(self, *tensors: torch.Tensor):
        """Asynchronous D2H of ``tensors`` into pinned host tensors (after the compute stream produced them).

        Returns (host tensors, CUDA event recorded after the copies). Counts the bytes in ``d2h_bytes``.
        """
        self.d2h.wait_stream(self.compute)
        with torch.cuda.stream(self.d2h):
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
            for t in tensors:
                t.record_stream(self.d2h)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        self._stats().d2h_bytes += sum(t.numel() * t.element_size() for t in host)
        return host, ev

    def host_stage(self, name: str, t0: float) -> None:
        """Host seconds since ``t0`` into stage ``name`` (and the timeline's lane while spans are kept)."""
        t1 = time.perf_counter()
        self.timer.add_host(name, t1 - t0)
        self.timer.span(name, t0, t1)

    # ---- GPU attention ----------------------------------------------------------------------------
    def gpu(self, l: int, mb: MicroBatch, q, k, v) -> torch.Tensor:
        """Append k/v to the micro-batch's GPU cache and attend, one family ``decode_attention`` per length group (its
        ``decode_attention_masked`` with the groups' masks made once per decode step: ``GroupedKVCache.attend_masked``).
        q [mu, Hq, hd], k/v [mu, Hkv, hd] on the GPU; returns [mu, Hq*hd] on the GPU. With gpu_attention="triton" one
        kernel appends and attends over every group (positions from ``mb.pos``, no host-to-device copy). MLA: q_lat,
        c, k_pe in, the family's torch ``latent_attention`` per length group over the device latent cache (no Triton
        kernel: gpu_attention "triton" takes this path too), the attention-weighted latents [mu, Hq, kv_lora] out."""
        if self.mla:  # append c / k_pe, then the torch latent attention per length group (never the CPU kernel)
            mb.kv.append_all(l, k, v, mb.pos)  # one scatter of [c, k_pe] at the device positions
            return mb.kv.attend(l, q, mb.kv.lengths + 1, self._latent_attention)
        sw = self.spec.layer_sliding_window(l)
        if self.gpu_attention == "triton":
            sinks = self._gpu_sinks[l] if self.sinks else None
            return mb.kv.append_attend_triton(l, q, k, v, mb.pos, sliding_window=sw, sinks=sinks)
        mb.kv.append_all(l, k, v, mb.pos)  # one scatter per K and V at the device positions
        attend = self.family.decode_attention_masked  # decode_attention, its masks made once per step and window
        if self.sinks:  # gpt-oss: the family's attention takes the layer's weights (its sinks)
            lw = self._layers[l]
            return mb.kv.attend_masked(l, q, lambda qg, K, V, m: attend(lw, qg, K, V, m), sw)
        return mb.kv.attend_masked(l, q, attend, sw)

    # ---- CPU attention ----------------------------------------------------------------------------
    def submit_cpu(self, l: int, mb: MicroBatch, q, k, v) -> Future:
        """D2H of q/k/v (after the compute stream produced them), then the micro-batch's CPU attention on the worker
        thread (:meth:`_cpu_attention`). On the CPU (device cpu) q/k/v are used as they are and the attention runs
        here, inline: the returned future is done."""
        if not self.cuda:
            done: Future = Future()
            done.set_result(self._cpu_attention(l, mb, (q, k, v), None))
            return done
        qkv, ready = self.to_host(q, k, v)
        return self.workers.submit(self._cpu_attention, l, mb, qkv, ready)

    def _cpu_attention(self, l: int, mb: MicroBatch, qkv, ready) -> torch.Tensor:
        """Worker thread: wait for q/k/v to land, append k/v to the CPU cache, attend. Returns [mu, Hq*hd] (MLA:
        q_lat, c, k_pe in, the native MLA kernel or the family's torch latent attention, the attention-weighted latents
        [mu, Hq, kv_lora])."""
        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        t1 = time.perf_counter()
        with torch.inference_mode():  # thread-local: the cache is an inference tensor
            q, k, v = qkv
            shape = (q.shape[0], q.shape[1], self.spec.kv_lora_rank) if self.mla else (q.shape[0], q.shape[1] * q.shape[2])
            if mb.attn_out is None or mb.attn_out.shape != shape or mb.attn_out.dtype != q.dtype:
                # one buffer per micro-batch, rewritten every layer. Safe: this layer's q/k/v copy (``ready``) was
                # ordered after the previous layer's read of the buffer on the GPU (kernel or DMA, before that
                # layer's post-attention on the compute stream, which the q/k/v copy waits for)
                mb.attn_out = torch.empty(shape, dtype=q.dtype, pin_memory=self.cuda)
            out = mb.attn_out
            t2 = time.perf_counter()
            window = self.spec.layer_sliding_window(l)
            if self.mla:  # one native MLA call over the length groups (or append + torch latent attention per group)
                mb.kv.append_attend(l, q, k, v, self._latent_attention, out)
            else:  # one native call over the length groups (or append + SDPA per group), with gpt-oss's sinks
                mb.kv.append_attend(l, q, k, v, out, sliding_window=window,
                                    sinks=self._cpu_sinks[l] if self.sinks else None)
        t3 = time.perf_counter()
        # the stage and its parts: waiting for q/k/v to land, the pinned output buffer, KV append + attention
        self.timer.add_host("cpu_attention", t3 - t0)
        self.timer.add_host("cpu_attention_wait_qkv", t1 - t0)
        self.timer.add_host("cpu_attention_pin", t2 - t1)
        self.timer.add_host("cpu_attention_compute", t3 - t2)
        self.timer.span("cpu_attention", t0, t3)
        n = mb.kv.lengths + 1 if window is None else (mb.kv.lengths + 1).clamp(max=window)
        self.attn_kv_bytes += int(n.sum()) * self._kv_bytes_per_position  # worker thread only
        return out

    def _latent_attention(self, q_lat: torch.Tensor, lat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The family's latent attention of one length group (worker thread): [B_g, Hq, kv_lora]."""
        return self.family.latent_attention(q_lat, lat, lengths, self.spec)

    def warm_up_receive(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Zeros of ``shape`` brought to the device the way :meth:`receive` brings a CPU micro-batch's attention output
        (not counted in the stats): a warm-up pays the transfer's one-time costs (the zero-copy kernel's compile)."""
        host = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        if not self.cuda:
            return host
        if self.attention_h2d == "kernel":
            dev = torch.empty(shape, dtype=dtype, device=self.device)
            copy_from_host_triton(host, dev)
            torch.cuda.synchronize(self.device)  # the kernel reads ``host`` before it is freed
            return dev
        return host.to(self.device)

    def receive(self, fut: Future) -> torch.Tensor:
        """Host waits for the worker, then H2D of the attention output; the compute stream waits on it."""
        t0 = time.perf_counter()
        attn = fut.result()
        self.timer.add_host("host_wait_cpu_attention", time.perf_counter() - t0)
        if not self.cuda:
            return attn  # used by this layer's post-attention before the worker rewrites it (next layer)
        nbytes = attn.numel() * attn.element_size()
        if self.attention_h2d == "kernel":  # zero-copy: SM reads over PCIe, not queued behind the page copies
            dev = torch.empty(attn.shape, dtype=attn.dtype, device=self.device)
            copy_from_host_triton(attn, dev)  # on the compute stream, after everything issued before it
            self._stats().h2d_bytes += nbytes
            add_counts(self._stats().extra, {"attention_zero_copy_bytes": nbytes})
            return dev
        with torch.cuda.stream(self.h2d_a):
            dev = attn.to(self.device, non_blocking=True)
        self._stats().h2d_bytes += nbytes
        ev = torch.cuda.Event()
        ev.record(self.h2d_a)
        self.timer.around("wait_attention", self.compute, lambda: self.compute.wait_event(ev))
        dev.record_stream(self.compute)
        return dev
