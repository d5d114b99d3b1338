"""CGOPipe: the pipelined executor (MoE-Lightning, arXiv 2411.11217, Sec. 4.1 and Alg. 1).

Per decode step, for each layer l and micro-batch k:

    gpu:  pre_attention(l, k)         norm, q/k/v, RoPE                       (compute stream)
    d2h:  q, k, v of (l, k) -> pinned staging                                  (d2h stream)
    cpu:  attention(l, k) over the CPU KV cache, appending the new k/v         (worker thread)
    h2d:  attention output of (l, k) -> GPU                                    (act stream)
    h2d:  one slot of layer l+1's expert pages into the other page buffer      (weight stream)
    gpu:  post_attention(l, k)        o_proj, residual, norm, router, experts  (compute stream)

The host thread issues GPU work for micro-batch k+1 while the worker runs the CPU attention of k, and
the weight stream copies layer l+1's pages the whole time, so per layer the time approaches
max(T_io, T_cpu, T_gpu), which is what the HRM (policy/hrm.py) predicts. Micro-batches whose KV the
policy puts on the GPU run attention on the GPU instead. Prefill runs per micro-batch with GPU
attention, writing KV to the micro-batch's home (CPU or GPU), with experts paged the same way.

Deviation from DESIGN.md: the small activation transfers (attention outputs) use their own stream
instead of being enqueued between pages on one H2D stream; the copy engines interleave them with the
page copies, and a page never waits behind a CPU-attention result (or the reverse) in one FIFO.

On ``device: cpu`` the same loop runs with synchronous copies (CI checks its tokens equal the serial
executor's).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels.cpu_attention import native_stats
from ..kernels.fused_moe import TRITON_ACTIVATIONS
from ..kernels.host_read import copy_from_host_triton, host_read_available
from ..kernels.quant import PageLayout as QuantPageLayout, unpack_expert_page
from ..model.families import family_of
from ..model.layers import ExpertWeights
from ..model.quantized import QuantExperts
from ..model.weights import ModelWeights
from ..policy.policy import Policy
from .kv_cache import KV_GROUPS, GroupedKVCache
from ..policy.batching import group_by_length
from .pager import (ExpertPaging, GpuPageBuffers, HostPagePool, ResidentExperts, ffn_expert_specs, page_schedule,
                    tiling_page_count)
from .serial import (FinishCallback, RunStats, SamplingParams, StepCallback, StopRowsCallback, TokensCallback,
                     check_prefixes, finish_reason, sample)
from .token_scores import SCORE_CHUNK_TOKENS, next_token_targets, split_scores, token_scores

_PAGE = "page"  # pool tensor of packed (quantized) experts: one uint8 [page_bytes] page per expert


@dataclass
class MicroBatch:
    """Sequences of one micro-batch and where its KV cache lives."""

    rows: list[int]  # indices into the batch's prompt list
    kv: Optional[GroupedKVCache]  # this micro-batch's cache (rows 0..len(rows)-1, length groups), CPU or GPU; None: no KV
    on_gpu: bool  # attention + KV on the GPU (policy.n_gpu_attn) instead of the CPU
    x: Optional[torch.Tensor] = None  # [mu_k, D] hidden states on the GPU during a decode step
    pos: Optional[torch.Tensor] = None  # int64 [mu_k] on the GPU: position of the next token of each row
    rope: Optional[tuple] = None  # RoPE (cos, sin) [mu_k, hd] of ``pos``, computed once per decode step for every layer
    attn_out: Optional[torch.Tensor] = None  # [mu_k, Hq*hd] host buffer CPU attention writes every layer (pinned on CUDA)


class _Timer:
    """Pairs of CUDA events on the compute stream around waits; summed lazily (one sync per batch)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pairs: dict[str, list] = {}
        self.host: dict[str, float] = {}

    def around(self, name: str, stream, fn):
        if not self.cuda:
            return fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        out = fn()
        b.record(stream)
        self.pairs.setdefault(name, []).append((a, b))
        return out

    def add_host(self, name: str, seconds: float) -> None:
        self.host[name] = self.host.get(name, 0.0) + seconds

    def collect(self) -> dict[str, float]:
        """Seconds per name (GPU event pairs are synchronized here)."""
        out = dict(self.host)
        for name, pairs in self.pairs.items():
            out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        self.pairs.clear()
        self.host = {}
        return out


class CGOPipeExecutor:
    """Pipelined executor driven by a :class:`Policy`.

    Args:
        weights: host weights. Their experts are moved into one exact-size pinned page pool (and the
            per-layer expert tensors are released from ``weights`` as they are copied, so host memory
            holds each expert once). Quantized checkpoints (:class:`QuantExperts`) stay packed: the pool,
            the page buffers and the resident experts hold one ``uint8 [page_bytes]`` page per expert, so
            pages cross PCIe as packed bytes and are dequantized on the device.
        policy: mu, n, prefill micro-batch, resident experts, GPU-attention micro-batches.
        device: "cuda[:i]" (or "cpu": same loop, synchronous copies; for tests).
        dtype: compute dtype (default: the weights').
        ffn: "torch" (the reference expert loop, bit-identical to the serial executor) or "triton"
            (kernels.fused_moe.fused_experts_triton, or kernels.quant.fused_experts_paged_triton over
            packed pages; CUDA only).
        kv_groups: length groups per micro-batch KV cache (:class:`GroupedKVCache`; default KV_GROUPS = 8,
            the number the planner's memory model assumes).
        page_queue_depth: None (default): each slot of the next layer's pages is issued on the weight stream at
            once. An int d >= 1: pages are issued one at a time, at most d of them in flight on the copy engine,
            topped up whenever the host would issue a slot, while it waits for CPU attention and between
            prefill chunks; a visit's remaining pages are issued before its first expert FFN. Copies of one
            direction may run in issue order on the copy engine; a short queue bounds how long an attention
            output waits behind expert pages. An A/B switch for the GPU benchmark
            (`bench_cgopipe.py --page-queue-depth`).
        cpu_threads: None (default): CPU attention uses torch's intra-op thread count. An int n >= 1: the
            worker thread calls ``torch.set_num_threads(n)`` when it starts (process-wide: torch has one
            intra-op setting), e.g. to leave cores to the host thread and the CUDA driver. An A/B switch for
            the GPU benchmark (`bench_cgopipe.py --cpu-threads`).
        attention_h2d: how a CPU micro-batch's attention output [mu_k, Hq*hd] reaches the GPU. "kernel": a
            zero-copy kernel on the compute stream reads the pinned buffer over PCIe
            (kernels.host_read.copy_from_host_triton), beside the page copies instead of queued behind them on
            the copy engine; "dma": a copy on the attention H2D stream (the copy engine, in issue order with
            the pages); "auto" (default): "kernel" where kernels.host_read.host_read_available() says a kernel
            can read pinned memory here, else "dma". Ignored on the CPU. Raises ValueError on another value.
        gpu_attention: how a GPU-attention micro-batch appends its k/v and attends. "torch" (default): per KV length
            group, :meth:`GroupedKVCache.append` + :meth:`GroupedKVCache.attend` with the family's decode_attention
            (~20 ops per group, bit-identical to the serial executor); "triton": one kernel for all groups
            (:meth:`GroupedKVCache.append_attend_triton`, scores in fp32: bf16 outputs differ by rounding). Raises
            ValueError on another value.
        score_chunk_tokens: rows per chunk of the scoring head in :meth:`prompt_logprobs` (default
            SCORE_CHUNK_TOKENS; its fp32 logits + log_softmax take ``score_chunk_tokens * V * 8`` bytes, whatever
            the prefill chunk's token count). Raises ValueError unless an int >= 1.
    """

    def __init__(self, weights: ModelWeights, policy: Policy, device: str | torch.device = "cuda",
                 dtype: Optional[torch.dtype] = None, ffn: str = "torch", kv_groups: int = KV_GROUPS,
                 page_queue_depth: Optional[int] = None, cpu_threads: Optional[int] = None,
                 attention_h2d: str = "auto", gpu_attention: str = "torch", score_chunk_tokens: int = SCORE_CHUNK_TOKENS):
        if isinstance(score_chunk_tokens, bool) or not isinstance(score_chunk_tokens, int) or score_chunk_tokens < 1:
            raise ValueError(f"CGOPipeExecutor: score_chunk_tokens must be an int >= 1, got {score_chunk_tokens!r}")
        self.score_chunk_tokens = score_chunk_tokens
        if gpu_attention not in ("torch", "triton"):
            raise ValueError(f"CGOPipeExecutor: gpu_attention must be torch or triton, got {gpu_attention!r}")
        self.gpu_attention = gpu_attention
        if attention_h2d not in ("auto", "kernel", "dma"):
            raise ValueError(f"CGOPipeExecutor: attention_h2d must be auto, kernel or dma, got {attention_h2d!r}")
        if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
            raise ValueError(f"CGOPipeExecutor: cpu_threads must be None or an int >= 1, got {cpu_threads!r}")
        if page_queue_depth is not None and (not isinstance(page_queue_depth, int) or page_queue_depth < 1):
            raise ValueError(f"CGOPipeExecutor: page_queue_depth must be None or an int >= 1, got {page_queue_depth!r}")
        self.spec = spec = weights.spec
        self.family = fam = family_of(spec)  # the model family's layer math (model/families/)
        if fam.attention != "gqa":
            raise ValueError(f"CGOPipeExecutor: {fam.name}: attention {fam.attention!r} is not implemented (gqa only)")
        self.policy = policy
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype or weights.dtype
        self.ffn = ffn
        if ffn == "triton" and self.cuda and fam.expert_activation not in TRITON_ACTIVATIONS:
            raise ValueError(f"CGOPipeExecutor: the Triton expert FFN computes {', '.join(TRITON_ACTIVATIONS)}, not the "
                             f"{fam.name} family's {fam.expert_activation!r} (use expert_ffn: torch)")
        self.kv_groups = kv_groups
        self.batch_size = policy.N
        dev, dt = self.device, self.dtype
        self.layers = [lw.to(dev, dt) for lw in weights.layers]
        self.embed = weights.embed.to(dev, dt)
        self.norm = weights.norm.to(dev, dt)
        self.lm_head = weights.lm_head.to(dev, dt)
        self.inv_freq = fam.rope_inv_freq(spec, dev)
        counts = policy.resident_counts(spec)
        resident = frozenset((l, e) for l in range(spec.num_layers) for e in range(counts[l]))
        if isinstance(policy.resident_experts, tuple) and policy.resident_experts and isinstance(policy.resident_experts[0], tuple):
            resident = frozenset(policy.resident_experts)
        paged = ExpertPaging(spec.num_layers, spec.num_experts, 1, resident).max_nonresident
        pages = tiling_page_count(paged, max(1, policy.n))  # buffers hold exactly the most paged experts of a layer
        self.paging = ExpertPaging(spec.num_layers, spec.num_experts, pages, resident)
        experts = weights.experts
        self.page_layout = self._packed_layout(experts)  # kernels.quant layout of packed pages, or None (dense)
        if self.page_layout is None:
            specs = ffn_expert_specs(spec.intermediate_size, spec.hidden_size, dt)
        else:  # one packed page per expert, moved as it is (dequantized on the device)
            specs = [(_PAGE, torch.uint8, (self.page_layout.page_bytes,))]
        names = tuple(n for n, _, _ in specs)
        self.pool = HostPagePool.for_experts(self.paging, specs, pin=self.cuda)
        self.resident = ResidentExperts(self.paging, [self._expert_tensors(e) for e in experts], dev, names)
        for l in range(spec.num_layers):  # stream layer by layer into the pool, releasing host copies
            ew = self._expert_tensors(experts[l])
            for p in range(self.paging.layer_pages(l)):
                ids = list(self.paging.page_experts(l, p))
                if ids and ids == list(range(ids[0], ids[0] + len(ids))):  # contiguous experts: a view, no gather copy
                    self.pool.write_page(l, p, {n: ew[n][ids[0] : ids[0] + len(ids)] for n in names})
                else:
                    self.pool.write_page(l, p, {n: ew[n][ids] for n in names})
            experts[l] = None  # the pool now holds this layer's experts
        self.buffers = GpuPageBuffers(self.pool, dev, 2)
        # dense (w1, w3, w2) [E, ...] in the compute dtype: the Triton FFN dequantizes a layer visit's packed
        # experts (paged and resident) into it (_triton_ffn); the planner counts it (hrm "dequantized expert
        # scratch"). Allocated here on CUDA, lazily by _triton_ffn otherwise (interpreter tests).
        self._dq_scratch = None
        if self.cuda and ffn == "triton" and self.page_layout is not None:
            self._dequant_scratch()
        if self.cuda:
            self.compute = torch.cuda.current_stream(dev)
            self.h2d_w = torch.cuda.Stream(dev)  # expert pages
            self.h2d_a = torch.cuda.Stream(dev)  # attention outputs
            self.d2h = torch.cuda.Stream(dev)  # q/k/v to the CPU
        else:
            self.compute = self.h2d_w = self.h2d_a = self.d2h = None
        if not self.cuda or policy.n_gpu_attn < max(1, policy.n):  # some micro-batch attends on the CPU
            from ..kernels.cpu_attention import native_available

            native_available()  # builds the native CPU attention kernel now (once; cached), not in the first decode step
        init = (torch.set_num_threads, (cpu_threads,)) if cpu_threads else (None, ())
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attn", initializer=init[0], initargs=init[1])
        self.cpu_threads = cpu_threads
        self._visit = 0  # layer visits so far: buffer = visit % 2, continuing across steps
        self._prefetched = -1  # last visit whose pages were issued (or queued, with page_queue_depth)
        self.page_queue_depth = page_queue_depth
        self._backlog: deque[tuple[int, int]] = deque()  # (visit, page) queued, not yet issued (page_queue_depth)
        self._inflight: deque = deque()  # CUDA events of issued pages not yet known complete (None on CPU)
        if self.cuda and attention_h2d == "auto":
            attention_h2d = "kernel" if host_read_available(self.device) else "dma"
        self.attention_h2d = attention_h2d if self.cuda else "dma"
        self.stats = RunStats()
        self.phase: Optional[str] = None  # the phase running now (:meth:`_enter`)
        self.phase_hook = None  # called with each phase's name as it starts (the runner's per-phase memory peaks)
        self.timer = _Timer(self.cuda)
        self._kv_bytes_per_position = 2 * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=self.dtype).element_size()
        self._attn_kv_bytes = 0  # valid K and V bytes read by CPU attention in this decode (worker thread)

    # ---- setup helpers -------------------------------------------------------------------------
    def _cast(self, ew: ExpertWeights) -> ExpertWeights:
        return ew if ew.w1.dtype == self.dtype else ExpertWeights(ew.w1.to(self.dtype), ew.w3.to(self.dtype), ew.w2.to(self.dtype))

    def _expert_tensors(self, ew) -> dict[str, torch.Tensor]:
        """A layer's experts as the pool's named tensors: ``{"page": uint8 [E, page_bytes]}`` for packed
        experts (no dequantization on the host), else ``{"w1", "w3", "w2"}`` in the compute dtype."""
        if isinstance(ew, QuantExperts):
            return {_PAGE: ew.pages}
        ew = self._cast(ew)
        return {"w1": ew.w1, "w3": ew.w3, "w2": ew.w2}

    @staticmethod
    def _packed_layout(experts) -> Optional[QuantPageLayout]:
        """The page layout shared by every layer's :class:`QuantExperts`, or None for dense experts.

        Raises:
            ValueError: some layers packed and others dense, or layers with different page layouts.
        """
        layouts = {e.layout for e in experts if isinstance(e, QuantExperts)}
        if not layouts:
            return None
        if len(layouts) > 1 or any(not isinstance(e, QuantExperts) for e in experts):
            raise ValueError("cgopipe: every layer's experts must be packed pages of one layout "
                             f"(got {len(layouts)} layouts, dense layers mixed in: "
                             f"{any(not isinstance(e, QuantExperts) for e in experts)})")
        return layouts.pop()

    def close(self) -> None:
        """Release the worker thread and unregister the pinned pool."""
        self.workers.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.pool.close()

    def _enter(self, phase: str) -> None:
        """Start a phase ("prefill", "decode", "scoring"): ``self.phase`` names it (out-of-memory messages) and
        ``phase_hook`` (set by the runner: per-phase peak memory) is told."""
        self.phase = phase
        if self.phase_hook is not None:
            self.phase_hook(phase)

    def policy_summary(self) -> dict:
        """The policy as a dict (for the run report)."""
        p = self.policy
        return {"expert_ffn": self.ffn, "mu": p.mu, "n": p.n, "N": p.N, "prefill_mu": p.prefill_mu,
                "prefill_tokens": p.prefill_tokens, "resident_experts": sum(
            len(self.paging.resident_experts(l)) for l in range(self.spec.num_layers)),
            "n_gpu_attn": p.n_gpu_attn if self.cuda else 0,  # on the CPU every micro-batch attends on the CPU
            "expert_pages": self.page_layout.scheme if self.page_layout is not None else str(self.dtype).replace("torch.", ""),
            "host_pool_bytes": self.pool.nbytes, "page_buffer_bytes": self.buffers.nbytes, "resident_bytes": self.resident.nbytes}

    # ---- weights: page buffers ------------------------------------------------------------------
    def _layer_of_visit(self, visit: int) -> int:
        return visit % self.spec.num_layers

    def _prefetch_slot(self, visit: int, slot: int, slots: int) -> None:
        """Issue slot ``slot`` of ``slots`` of the pages of layer-visit ``visit`` on the weight stream (or queue
        them, with ``page_queue_depth``: :meth:`_pump`)."""
        layer = self._layer_of_visit(visit)
        rng = page_schedule(self.pool.pages_per_layer[layer], slots)[slot]
        if len(rng) == 0:
            return
        if self.page_queue_depth is None:
            self._issue_pages(visit, rng)
            return
        self._backlog.extend((visit, p) for p in rng)
        self._pump()

    def _issue_pages(self, visit: int, pages: range) -> None:
        """Copy ``pages`` of visit's layer into its buffer on the weight stream (after the buffer is free)."""
        layer, b = self._layer_of_visit(visit), visit % 2
        if self.cuda:  # wait for the buffer to be free first, so the timed span is the copies alone
            self.h2d_w.wait_event(self.buffers._done_events[b])
        self.stats.h2d_bytes += self.timer.around("h2d_copy", self.h2d_w,
                                                  lambda: self.buffers.prefetch_layer(layer, b, self.h2d_w, pages))

    def _pump(self, upto_visit: int = -1) -> None:
        """``page_queue_depth``: forget completed pages, then issue queued pages while fewer than the depth are
        in flight; every queued page of a visit <= ``upto_visit`` is issued regardless (its FFN is next)."""
        if self.page_queue_depth is None:
            return
        while self._inflight and (self._inflight[0] is None or self._inflight[0].query()):
            self._inflight.popleft()
        while self._backlog and (len(self._inflight) < self.page_queue_depth or self._backlog[0][0] <= upto_visit):
            visit, p = self._backlog.popleft()
            self._issue_pages(visit, range(p, p + 1))
            ev = None
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.h2d_w)
            self._inflight.append(ev)

    def _begin_layer(self, visit: int):
        """Start a layer visit: make sure its pages are issued; returns its FFN (:meth:`_visit_ffn`).

        The compute stream does NOT wait for the pages here: pre-attention and attention need no expert
        weights, so they run while the pages are still crossing PCIe; the wait is enqueued just before the
        visit's first expert FFN.
        """
        if self._prefetched < visit:  # not prefetched during the previous layer (first layer of a run)
            self._prefetch_slot(visit, 0, 1)
            self._prefetched = visit
        return self._visit_ffn(visit)

    def _wait_pages(self, visit: int):
        """Compute stream waits (on the GPU) until the visit's pages landed; returns its LayerExperts."""
        self._pump(upto_visit=visit)  # page_queue_depth: the visit's queued pages are issued now
        layer, b = self._layer_of_visit(visit), visit % 2
        self.timer.around("wait_h2d", self.compute, lambda: self.buffers.wait_layer(layer, b, self.compute))
        return self.buffers.layer_experts(layer, b, self.resident)

    def _visit_ffn(self, visit: int):
        """The expert FFN ``ffn(h, ew, w, ids)`` of one layer visit (all its micro-batches): its first call
        enqueues the wait for the visit's pages (:meth:`_wait_pages`) and builds :meth:`_experts_fn`."""
        built: list = []

        def ffn(h, ew, w, ids):
            if not built:
                built.append(self._experts_fn(self._wait_pages(visit)))
            return built[0](h, ew, w, ids)

        return ffn

    def _end_layer(self, visit: int) -> None:
        self.buffers.compute_done(visit % 2, self.compute)

    def _experts_fn(self, lx):
        """FFN over the layer's experts (resident + paged).

        "torch": the reference expert loop with the same per-expert ops as the serial executor (exact
        equality of tokens; it synchronizes the host once per expert to gather tokens); packed pages are
        dequantized per expert on the device, as the serial executor does. "triton": the sync-free
        grouped kernel, once over the paged experts and once over the resident ones; each call marks the
        other group's (token, slot) pairs with the skip id, so the kernels align them into a bucket they never
        compute (no host sync, no pair computed twice); packed pages go through fused_experts_paged_triton.
        """
        if self.ffn == "triton" and self.cuda:
            return self._triton_ffn(lx)
        get, E, ffn_from = self._expert_getter(lx), self.spec.num_experts, self.family.experts_ffn_from
        return lambda h, ew, w, ids: ffn_from(h, get, E, w, ids)

    def _expert_getter(self, lx):
        """``get(e) -> (w1 [F, D], w3 [F, D], w2 [D, F])`` of expert ``e`` in the compute dtype."""
        if self.page_layout is None:
            def get(e):
                t = lx.expert(e)
                return t["w1"], t["w3"], t["w2"]
        else:
            lay, dt = self.page_layout, self.dtype

            def get(e):  # the same pure-torch dequantization as QuantExperts.dequantize (serial executor)
                return unpack_expert_page(lx.expert(e)[_PAGE], lay, dt)
        return get

    def _dequant_scratch(self) -> tuple:
        """The dense (w1, w3, w2) scratch ``[E, F, D], [E, F, D], [E, D, F]`` for one layer's experts, in the
        compute dtype (kernels.quant.dense_expert_scratch), allocated on first use."""
        if self._dq_scratch is None:
            from ..kernels.quant import dense_expert_scratch

            lay = self.page_layout
            self._dq_scratch = dense_expert_scratch(self.spec.num_experts, lay.hidden_size, lay.intermediate_size,
                                                    self.dtype, self.device)
        return self._dq_scratch

    def _dequantize_visit(self, lx, dtype: torch.dtype) -> tuple:
        """Dequantize every packed expert of layer visit ``lx`` into the scratch: the P paged experts to rows
        ``[0, P)``, the R resident ones to rows ``[P, P + R)``. Returns ``(w1, w3, w2)`` views ``[P + R, ...]``."""
        from ..kernels.quant import dequantize_pages_triton

        scratch, P, R = self._dequant_scratch(), lx.paged[_PAGE].shape[0], lx.resident[_PAGE].shape[0]
        for pages, first, count in ((lx.paged[_PAGE], 0, P), (lx.resident[_PAGE], P, R)):
            if count:
                dequantize_pages_triton(pages, self.page_layout, dtype, out=tuple(w[first:] for w in scratch))
        return tuple(w[: P + R] for w in scratch)

    def _triton_ffn(self, lx):
        """Grouped Triton FFN over the paged and the resident experts of ``lx`` (see :meth:`_experts_fn`).

        The returned closure serves one layer visit (all its micro-batches). Dense pages: one grouped call over
        the paged stack and one over the resident stack, each skipping the other's (token, slot) pairs.
        Quantized pages: the first call with ``T * k / E >= kernels.quant.DEQUANT_MIN_PAIRS_PER_EXPERT`` (0,
        the default: always) dequantizes ALL the visit's experts, paged and
        resident, once into ``self._dq_scratch`` (:meth:`_dequantize_visit`), and this and every later call of
        the visit run ONE dense grouped kernel over them; calls before that run the fused in-register kernel
        on each group's packed pages.
        """
        from ..kernels import quant as Q
        from ..kernels.fused_moe import fused_experts_triton

        lay = self.page_layout
        is_paged, row = self.paging.index_tensors(lx.layer, self.device)
        first = _PAGE if lay is not None else "w1"
        groups = [(g, m) for g, m in ((lx.paged, is_paged), (lx.resident, ~is_paged)) if g[first].shape[0] > 0]
        dense: list = []  # this visit's dequantized experts (w1, w3, w2), views of self._dq_scratch
        n_paged = lx.paged[first].shape[0]
        dense_row = torch.where(is_paged, row, row + n_paged)  # [E] expert -> its row in the dense scratch

        def group_ffn(h, g, w, ids):
            # ids == the group's expert count: the slot's expert is in the other group (skip=True: not computed)
            if lay is None:
                return fused_experts_triton(h, g["w1"], g["w3"], g["w2"], w, ids, validate=False, skip=True)
            return Q.fused_experts_paged_triton(h, g[_PAGE], lay, w, ids, validate=False, mode="fused", skip=True)

        def triton_ffn(h, ew, w, ids):
            if lay is not None and (dense or Q.use_dequant_path("auto", ids.numel(), self.spec.num_experts)):
                if not dense:  # first large call of the visit: dequantize the layer's experts once
                    dense.extend(self._dequantize_visit(lx, h.dtype))
                return fused_experts_triton(h, *dense, w, dense_row[ids], validate=False)
            out = None
            for g, member in groups:
                sel = member[ids]  # [T, k] expert of this slot lives in group g
                local = torch.where(sel, row[ids], torch.full_like(ids, g[first].shape[0]))  # [T, k] row in g, or skip
                y = group_ffn(h, g, w, local)
                out = y if out is None else out + y
            return out

        return triton_ffn

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_chunks(self, prompts: Sequence[Sequence[int]], mb: MicroBatch) -> list[tuple[int, list[int]]]:
        """Split a micro-batch's rows (in order) into prefill micro-batches: (first row, rows).

        A chunk takes rows while it has at most ``policy.prefill_mu`` rows and at most
        ``policy.prefill_tokens`` padded tokens (rows x longest row), so its workspace stays within what
        the planner counted for any mix of lengths; a single longer prompt forms a chunk alone.
        """
        cap_rows, cap_tok = max(1, self.policy.prefill_mu), self.policy.prefill_tokens
        out, start, longest = [], 0, 0
        for j, r in enumerate(mb.rows):
            n = len(prompts[r])
            if j > start and (j - start + 1 > cap_rows or (j - start + 1) * max(longest, n) > cap_tok):
                out.append((start, mb.rows[start:j]))
                start, longest = j, 0
            longest = max(longest, n)
        if mb.rows:
            out.append((start, mb.rows[start:]))
        return out

    def _prefill_kv_index(self, mb: MicroBatch, off: int, spans) -> Optional[list]:
        """The chunk's scatter index into its micro-batch's cache rows off.. (GroupedKVCache.prefill_index), on
        the device its k / v are written from (the GPU for GPU caches, the host for CPU caches); None without KV."""
        if mb.kv is None:
            return None
        src = self.device if (mb.on_gpu or not self.cuda) else torch.device("cpu")
        return mb.kv.prefill_index(range(off, off + len(spans)), spans, src)

    def _store_prefill_kv(self, l: int, mb: MicroBatch, index: list, k: torch.Tensor, v: torch.Tensor, pending: list) -> None:
        """Write a prefill chunk's k, v [T, Hkv, hd] into its micro-batch's cache (one scatter per length group, by
        ``index`` from :meth:`_prefill_kv_index`, not a copy per sequence).

        GPU caches are written in place. For CPU caches on CUDA the copy is asynchronous: k/v go to pinned
        host buffers on the D2H stream and the worker thread writes them into the cache once they landed,
        so the host keeps issuing GPU work (a pageable ``.cpu()`` blocked it on every chunk and layer).
        At most two chunks are in flight (bounded pinned staging, as the planner counts).
        """
        if mb.on_gpu or not self.cuda:
            mb.kv.write_prefill_index(l, index, k, v)
            return
        (kh, vh), ready = self._to_host(k, v)

        def write():
            ready.synchronize()
            with torch.inference_mode():  # thread-local: the caches are inference tensors
                mb.kv.write_prefill_index(l, index, kh, vh)

        while len(pending) >= 2:
            pending.pop(0).result()
        pending.append(self.workers.submit(write))

    def _to_host(self, *tensors: torch.Tensor):
        """Asynchronous D2H of ``tensors`` into pinned host tensors (after the compute stream produced them).

        Returns (host tensors, CUDA event recorded after the copies). Counts the bytes in stats.d2h_bytes.
        """
        self.d2h.wait_stream(self.compute)
        with torch.cuda.stream(self.d2h):
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
            for t in tensors:
                t.record_stream(self.d2h)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        self.stats.d2h_bytes += sum(t.numel() * t.element_size() for t in host)
        return host, ev

    def _prefill(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], score: bool = False) -> list:
        """Prefill every micro-batch layer by layer (weights streamed once per layer for the whole batch).

        Each micro-batch is computed in prefill micro-batches (:meth:`_prefill_chunks`: at most
        ``policy.prefill_mu`` rows and ``policy.prefill_tokens`` padded tokens), writing each chunk's KV
        into its micro-batch's cache rows (:meth:`_store_prefill_kv`).
        Returns per micro-batch: fp32 logits of the last token of each row [mu_k, V]; with ``score``, (fp32 logprob
        [T_k], bool greedy [T_k]) of every packed row's next token instead (:func:`token_scores.token_scores`, run
        per prefill chunk, ``score_chunk_tokens`` rows at a time: no chunk's [T, V] logits exist).
        """
        chunks = []  # [micro-batch index, KV scatter index (or None), hidden [T, D], positions [T], spans, ends, RoPE,
        #            attention layout]
        for i, mb in enumerate(mbs):
            for off, rows in self._prefill_chunks(prompts, mb):
                lens = [len(prompts[r]) for r in rows]
                ids = torch.tensor([t for r in rows for t in prompts[r]], dtype=torch.int64)
                ends = torch.tensor(lens).cumsum(0)
                spans = [(int(e) - n, int(e)) for e, n in zip(ends, lens)]
                pos = torch.cat([torch.arange(n) for n in lens]).to(self.device, non_blocking=True)
                x = self.embed[ids.to(self.device, non_blocking=True)]  # [T, D]
                rope = self.family.rope_cos_sin(pos, self.inv_freq.to(self.device), x.dtype)  # [T, hd] x2, every layer
                layout = self.family.prefill_packed_layout(spans, x.shape[0], self.device)  # for every layer
                chunks.append([i, self._prefill_kv_index(mb, off, spans), x, pos, spans, ends, rope, layout])
        pending: list[Future] = []  # KV writes of CPU-cache chunks in flight (worker thread)
        fam = self.family
        for l in range(self.spec.num_layers):
            visit = self._visit
            ffn = self._begin_layer(visit)
            self._prefetch_slot(visit + 1, 0, 1)
            self._prefetched = visit + 1
            for ch in chunks:
                i, kv_index, x, pos, spans, _, rope, layout = ch
                mb = mbs[i]
                q, k, v = fam.pre_attention(self.layers[l], x, pos, self.spec, self.inv_freq, rope)  # [T,Hq,hd] [T,Hkv,hd] x2
                attn = fam.prefill_attention_packed(q, k, v, spans, self.spec.sliding_window, layout)  # [T, Hq*hd]
                if mb.kv is not None:
                    self._store_prefill_kv(l, mb, kv_index, k, v, pending)
                ch[2] = fam.post_attention(self.layers[l], None, x, attn, self.spec, ffn)  # [T, D]
                self._pump()
            self._end_layer(visit)
            self._visit += 1
        for f in pending:  # every KV row is in its cache before decode reads it
            f.result()
        if score:
            return self._score_chunks(prompts, mbs, chunks)
        per_mb: list[list[torch.Tensor]] = [[] for _ in mbs]
        for i, _, x, _, _, ends, _, _ in chunks:
            x = x[(ends - 1).to(self.device)]
            per_mb[i].append(fam.final_logits(x, self.norm, self.lm_head, self.spec.rms_norm_eps))
        return [torch.cat(parts) for parts in per_mb]

    def _score_chunks(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], chunks: list) -> list:
        """The scoring head over each prefill chunk's final hidden states (in :meth:`_prefill`'s chunk order, which
        follows each micro-batch's rows); a chunk's hidden states are released once scored. Returns per micro-batch
        (fp32 logprob [T_k], bool greedy [T_k]) on the device, rows packed in ``mb.rows`` order."""
        per_mb: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in mbs]
        offs = [0] * len(mbs)  # rows of each micro-batch scored so far
        eps = self.spec.rms_norm_eps
        for ch in chunks:
            i, x, ends = ch[0], ch[2], ch[5]
            rows = mbs[i].rows[offs[i] : offs[i] + len(ends)]
            offs[i] += len(ends)
            targets = next_token_targets([prompts[r] for r in rows], self.device)  # [T_c]
            per_mb[i].append(token_scores(x, self.norm, self.lm_head, eps, targets, self.score_chunk_tokens,
                                          self.family.final_logits))  # [T_c] x2
            ch[2] = None  # this chunk's hidden states are no longer needed
        return [(torch.cat([lp for lp, _ in parts]), torch.cat([g for _, g in parts])) for parts in per_mb]

    # ---- decode -------------------------------------------------------------------------------
    def _pre_attention(self, l: int, mb: MicroBatch):
        if mb.rope is None:  # once per decode step: the same positions in every layer
            mb.rope = self.family.rope_cos_sin(mb.pos, self.inv_freq.to(self.device), mb.x.dtype)  # [mu, hd] x2
        return self.family.pre_attention(self.layers[l], mb.x, mb.pos, self.spec, self.inv_freq, mb.rope)  # [mu,Hq,hd] [mu,Hkv,hd] x2

    def _gpu_attention(self, l: int, mb: MicroBatch, q, k, v) -> torch.Tensor:
        """Append k/v to the micro-batch's GPU cache and attend, one family ``decode_attention`` per length group.
        q [mu, Hq, hd], k/v [mu, Hkv, hd] on the GPU; returns [mu, Hq*hd] on the GPU. With gpu_attention="triton" one
        kernel appends and attends over every group (positions from ``mb.pos``, no host-to-device copy)."""
        if self.gpu_attention == "triton":
            return mb.kv.append_attend_triton(l, q, k, v, mb.pos)
        rows = torch.arange(len(mb.rows))
        mb.kv.append(l, rows, k, v)
        sw, attend = self.spec.sliding_window, self.family.decode_attention
        return mb.kv.attend(l, q, mb.kv.lengths + 1, lambda qg, K, V, n: attend(qg, K, V, n, sw))

    def _send_qkv(self, q, k, v):
        """D2H of q/k/v (after the compute stream produced them); returns host tensors + ready event."""
        if not self.cuda:
            return (q, k, v), None
        return self._to_host(q, k, v)

    def _cpu_attention(self, l: int, mb: MicroBatch, qkv, ready) -> torch.Tensor:
        """Worker thread: wait for q/k/v to land, append k/v to the CPU cache, attend. Returns [mu, Hq*hd]."""
        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        t1 = time.perf_counter()
        with torch.inference_mode():  # thread-local: the cache is an inference tensor
            q, k, v = qkv
            shape = (q.shape[0], q.shape[1] * q.shape[2])
            if mb.attn_out is None or mb.attn_out.shape != shape or mb.attn_out.dtype != q.dtype:
                # one buffer per micro-batch, rewritten every layer. Safe: this layer's q/k/v copy (``ready``) was
                # ordered after the previous layer's read of the buffer on the GPU (kernel or DMA, before that
                # layer's post-attention on the compute stream, which the q/k/v copy waits for)
                mb.attn_out = torch.empty(shape, dtype=q.dtype, pin_memory=self.cuda)
            out = mb.attn_out
            t2 = time.perf_counter()
            mb.kv.append_attend(l, q, k, v, out)  # one native call over the length groups (or append + SDPA per group)
        t3 = time.perf_counter()
        # the stage and its parts: waiting for q/k/v to land, the pinned output buffer, KV append + attention
        self.timer.add_host("cpu_attention", t3 - t0)
        self.timer.add_host("cpu_attention_wait_qkv", t1 - t0)
        self.timer.add_host("cpu_attention_pin", t2 - t1)
        self.timer.add_host("cpu_attention_compute", t3 - t2)
        n = mb.kv.lengths + 1 if self.spec.sliding_window is None else (mb.kv.lengths + 1).clamp(max=self.spec.sliding_window)
        self._attn_kv_bytes += int(n.sum()) * self._kv_bytes_per_position  # worker thread only
        return out

    def _recv_attention(self, fut: Future) -> torch.Tensor:
        """Host waits for the worker, then H2D of the attention output; the compute stream waits on it."""
        t0 = time.perf_counter()
        while self._backlog and not fut.done():  # page_queue_depth: keep the copy engine fed meanwhile
            self._pump()
            wait_futures([fut], timeout=2e-4)
        attn = fut.result()
        self.timer.add_host("host_wait_cpu_attention", time.perf_counter() - t0)
        if not self.cuda:
            return attn  # used by this layer's post-attention before the worker rewrites it (next layer)
        if self.attention_h2d == "kernel":  # zero-copy: SM reads over PCIe, not queued behind the page copies
            dev = torch.empty(attn.shape, dtype=attn.dtype, device=self.device)
            copy_from_host_triton(attn, dev)  # on the compute stream, after everything issued before it
            self.stats.h2d_bytes += attn.numel() * attn.element_size()
            self.stats.extra["attention_zero_copy_bytes"] = (self.stats.extra.get("attention_zero_copy_bytes", 0)
                                                             + attn.numel() * attn.element_size())
            return dev
        with torch.cuda.stream(self.h2d_a):
            dev = attn.to(self.device, non_blocking=True)
        self.stats.h2d_bytes += attn.numel() * attn.element_size()
        ev = torch.cuda.Event()
        ev.record(self.h2d_a)
        self.timer.around("wait_attention", self.compute, lambda: self.compute.wait_event(ev))
        dev.record_stream(self.compute)
        return dev

    def _post_attention(self, l: int, mb: MicroBatch, attn: torch.Tensor, ffn) -> None:
        mb.x = self.family.post_attention(self.layers[l], None, mb.x, attn, self.spec, ffn)  # [mu_k, D]

    def _decode_layer(self, l: int, mbs: list[MicroBatch]) -> None:
        """One layer of one decode step over all micro-batches (the CGOPipe schedule).

        Micro-batch k's slot of layer l+1's pages is issued right after k's attention result is on its way
        to the GPU (CPU attention) or computed (GPU attention), never before: copies of one direction queue on
        the copy engine in issue order, so a slot issued earlier would hold the attention output behind
        megabytes of pages while the GPU waits for it. (Submitting every CPU micro-batch's attention before the
        GPU micro-batches' work gains nothing: the GPU then waits for the CPU micro-batch instead.)
        """
        visit = self._visit
        ffn = self._begin_layer(visit)
        pending: Optional[tuple[int, MicroBatch, Future]] = None  # the CPU attention in flight
        for k, mb in enumerate(mbs):
            q, kk, v = self._pre_attention(l, mb)
            if mb.on_gpu:
                attn = self._gpu_attention(l, mb, q, kk, v)
            else:
                qkv, ready = self._send_qkv(q, kk, v)
                fut = self.workers.submit(self._cpu_attention, l, mb, qkv, ready)
            if pending is not None:  # finish the previous CPU micro-batch while this one's attention runs
                self._finish_cpu_micro_batch(l, visit, len(mbs), *pending, ffn)
                pending = None
            if mb.on_gpu:
                self._prefetch_slot(visit + 1, k, len(mbs))
                self._post_attention(l, mb, attn, ffn)
            else:
                pending = (k, mb, fut)
        if pending is not None:
            self._finish_cpu_micro_batch(l, visit, len(mbs), *pending, ffn)
        self._prefetched = visit + 1
        self._end_layer(visit)
        self._visit += 1

    def _finish_cpu_micro_batch(self, l: int, visit: int, slots: int, k: int, mb: MicroBatch, fut: Future, ffn) -> None:
        """Micro-batch k after its CPU attention: its output goes to the GPU, then slot k of the next visit's
        pages is issued behind it, then k's post-attention (o_proj, router, expert FFN) is enqueued."""
        attn = self._recv_attention(fut)
        self._prefetch_slot(visit + 1, k, slots)
        self._post_attention(l, mb, attn, ffn)

    def _decode_step(self, mbs: list[MicroBatch], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed one token per row of every micro-batch; returns fp32 logits [mu_k, V] per micro-batch."""
        for mb, t in zip(mbs, tokens):
            mb.x = self.embed[t.to(self.device, non_blocking=True)]  # [mu_k, D]
            if mb.pos is None:
                mb.pos = mb.kv.lengths.to(self.device, copy=True)  # [mu_k]
        for l in range(self.spec.num_layers):
            self._decode_layer(l, mbs)
        for mb in mbs:
            mb.kv.lengths += 1
            mb.pos += 1
            mb.rope = None  # positions moved: the next step recomputes its RoPE tables
        return [self.family.final_logits(mb.x, self.norm, self.lm_head, self.spec.rms_norm_eps) for mb in mbs]

    # ---- public API ---------------------------------------------------------------------------
    def _micro_batches(self, prompts: Sequence[Sequence[int]], extra: int, with_kv: bool, mu: int,
                       kv_groups: Optional[int] = None) -> list[MicroBatch]:
        """Micro-batches of at most ``mu`` rows grouped by prompt length (policy.batching.group_by_length); the first
        ``policy.n_gpu_attn`` (the shortest) keep KV and attention on the GPU when on CUDA.

        With ``with_kv`` each gets a :class:`GroupedKVCache` whose rows need prompt length + ``extra``
        positions (``extra`` = the most tokens a row has left to generate), split into at most ``kv_groups``
        (default ``self.kv_groups``) length groups.
        """
        lens = [len(p) for p in prompts]
        n = -(-len(prompts) // mu)
        groups = [g for g in group_by_length(lens, mu, n) if g]
        mbs = []
        for k, rows in enumerate(groups):
            on_gpu = self.cuda and k < self.policy.n_gpu_attn
            kv = None
            if with_kv:
                kv = GroupedKVCache(self.spec, [lens[r] + extra for r in rows], self.dtype,
                                    self.device if on_gpu else "cpu", max_groups=kv_groups or self.kv_groups)
                kv.lengths[:] = torch.tensor([lens[r] for r in rows])
            mbs.append(MicroBatch(rows, kv, on_gpu))
        return mbs

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, on_finish: Optional[FinishCallback] = None,
                 seeds: Optional[Sequence[int]] = None, eos_token_id: Optional[int] = None,
                 on_step: Optional[StepCallback] = None, prefixes: Optional[Sequence[Sequence[int]]] = None,
                 on_tokens: Optional[TokensCallback] = None,
                 stop_rows: Optional[StopRowsCallback] = None) -> list[tuple[list[int], str]]:
        """Same contract as :meth:`SerialExecutor.generate` (at most ``policy.N`` prompts per call; ``prefixes``:
        resumed sequences, prefilled with their prompt; ``on_tokens(rows, tokens)``: every token committed in a step,
        once per step after all micro-batches; ``stop_rows``: once per step, before ``on_tokens``, over the rows still
        running: those it returns finish with "stop").

        Finished rows keep their slot until the batch ends (their extra tokens are discarded, never reported), so the
        micro-batch shapes stay fixed for the whole batch.
        """
        if len(prompts) > self.policy.N:
            raise ValueError(f"{len(prompts)} prompts exceed the policy's batch N = {self.policy.N}")
        eos = self.spec.eos_token_id if eos_token_id is None else eos_token_id
        pre = check_prefixes(prompts, prefixes, params)
        sd = list(seeds) if (seeds is not None and not params.greedy) else None
        prompts = [list(p) + q for p, q in zip(prompts, pre)]
        self._enter("prefill")
        # every row runs until the batch's last finishes: KV for the longest remaining run (prefix lengths that
        # differ within a batch cost KV positions; the runner batches equal prefix lengths together)
        mbs = self._micro_batches(prompts, params.max_new_tokens - min(len(q) for q in pre), True, self.policy.mu)
        # prefill uses micro-batches of prefill_mu rows; KV lands in the decode micro-batch's cache
        t0 = time.perf_counter()
        logits = self._prefill(prompts, mbs)
        outputs: list[list[int]] = pre
        results: list = [None] * len(prompts)
        step_rows: list[int] = []  # tokens committed in this step, for on_tokens
        step_toks: list[int] = []

        def commit(mb: MicroBatch, lg: torch.Tensor) -> torch.Tensor:
            toks = sample(lg, params, [sd[r] for r in mb.rows] if sd else None,
                          [len(outputs[r]) for r in mb.rows] if sd else None)
            for r, t in zip(mb.rows, toks.tolist()):
                if results[r] is not None:
                    continue
                outputs[r].append(t)
                step_rows.append(r)
                step_toks.append(t)
                self.stats.generated_tokens += 1
                reason = finish_reason(params, eos, t, len(outputs[r]))
                if reason is not None:
                    results[r] = (outputs[r], reason)
                    if on_finish is not None:
                        on_finish(r, outputs[r], reason)
            return toks

        def report_tokens() -> None:
            if stop_rows is not None:
                live = {r: outputs[r] for r in step_rows if results[r] is None}
                for r in sorted(stop_rows(live) if live else ()):
                    results[r] = (outputs[r], "stop")
                    if on_finish is not None:
                        on_finish(r, outputs[r], "stop")
            if on_tokens is not None:
                on_tokens(list(step_rows), list(step_toks))
            step_rows.clear()
            step_toks.clear()

        tokens = [commit(mb, lg) for mb, lg in zip(mbs, logits)]
        del logits  # sampled: each step's logits are the only ones alive during the next (the memory model's rows)
        self._sync()
        if on_step is not None:
            on_step(len(prompts))
        t1 = time.perf_counter()
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.prefill_seconds += t1 - t0
        self.timer.collect()  # prefill waits are not decode stage times
        self._attn_kv_bytes = 0
        native_stats(reset=True)  # the native CPU attention kernel's own time split, for this decode only
        report_tokens()
        self._enter("decode")
        try:
            while any(r is None for r in results):
                alive = sum(r is None for r in results)
                logits = self._decode_step(mbs, tokens)
                tokens = [commit(mb, lg) for mb, lg in zip(mbs, logits)]
                del logits
                self.stats.decode_tokens += alive
                self.stats.decode_steps += 1
                if on_step is not None:
                    on_step(alive)
                report_tokens()
        finally:  # a callback that stops the run still leaves this batch's decode time in the stats
            self._decode_done(t1)
        return results

    def _decode_done(self, t1: float) -> None:
        """Add a batch's decode wall time (since ``t1``) and stage timings to the stats."""
        self._sync()
        dt = time.perf_counter() - t1
        self.stats.decode_seconds += dt
        stages = self.timer.collect()
        stages["decode_wall"] = dt
        for k, v in stages.items():
            self.stats.extra[k] = self.stats.extra.get(k, 0.0) + v
        # bytes, not seconds: with cpu_attention_compute it gives the CPU attention rate the HRM's (H5) assumes
        self.stats.extra["cpu_attention_valid_kv_bytes"] = self.stats.extra.get("cpu_attention_valid_kv_bytes", 0) + self._attn_kv_bytes
        # inside the kernel's parallel regions (kernels.cpu_attention.native_stats): region wall time vs the worker's
        # cpu_attention_compute says how much of the stage is the wrapper / thread hand-off; busy vs team
        # thread-seconds says whether the team worked the whole region (memory-bound) or waited for cores
        for k, v in native_stats().items():
            self.stats.extra[f"cpu_attention_native_{k}"] = self.stats.extra.get(f"cpu_attention_native_{k}", 0) + v

    @torch.inference_mode()
    def prompt_logprobs(self, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Same contract as :meth:`SerialExecutor.prompt_logprobs` (prefill only, no KV cache); the scoring head
        runs per prefill chunk, ``score_chunk_tokens`` rows at a time (no [T, V] logits)."""
        self._enter("scoring")
        t0 = time.perf_counter()
        mbs = self._micro_batches(seqs, 0, False, self.policy.prefill_mu)
        scores = self._prefill(seqs, mbs, score=True)  # per micro-batch (logprob [T_k], greedy [T_k])
        out: list = [None] * len(seqs)
        for mb, (lp, g) in zip(mbs, scores):
            for r, sc in zip(mb.rows, split_scores(lp, g, [len(seqs[r]) for r in mb.rows])):
                out[r] = sc
        self._sync()
        self.timer.collect()
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        self.stats.prefill_seconds += time.perf_counter() - t0
        return out


def expert_ffn_for(job) -> str:
    """The job's ``expert_ffn``: "auto" is "triton" on CUDA when triton imports, else "torch"."""
    if job.expert_ffn != "auto":
        return job.expert_ffn
    if job.device.startswith("cuda"):
        from ..kernels.fused_moe import triton_available

        return "triton" if triton_available() else "torch"
    return "torch"
