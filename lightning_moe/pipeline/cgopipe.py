"""CGOPipe: the pipelined executor (MoE-Lightning, arXiv 2411.11217, Sec. 4.1 and Alg. 1).

Per decode step, for each layer l and micro-batch k:

    gpu:  pre_attention(l, k)         norm, q/k/v, RoPE                       (compute stream)
    d2h:  q, k, v of (l, k) -> pinned staging                                  (d2h stream)
    cpu:  attention(l, k) over the CPU KV cache, appending the new k/v         (worker thread)
    h2d:  attention output of (l, k) -> GPU                                    (act stream, or zero-copy)
    h2d:  one slot of layer l+1's expert pages into the other page buffer      (weight stream)
    gpu:  post_attention(l, k)        o_proj, residual, norm, router, experts  (compute stream)

The host thread issues GPU work for micro-batch k+1 while the worker runs the CPU attention of k, and
the weight stream copies layer l+1's pages the whole time, so per layer the time approaches
max(T_io, T_cpu, T_gpu), which is what the HRM (policy/hrm.py) predicts. Across a layer boundary the worker does
not wait: micro-batch k's pre_attention(l+1, k) and its CPU attention are issued right after post_attention(l, k)
(the look-ahead, ``CGOPipeOptions.layer_lookahead``), so they queue behind layer l's other CPU attentions.
Micro-batches whose KV the policy puts on the GPU run attention on the GPU instead. Prefill runs per prefill chunk with GPU
attention, writing KV to the micro-batch's home (CPU or GPU), with experts paged the same way.

This module is the loop: :meth:`CGOPipeExecutor._decode` (called by :meth:`.executor.Executor.generate`: prefill,
then decode steps until every row finished, refilling freed slots),
:meth:`~CGOPipeExecutor._decode_step` (embed, every layer, the logits) and :meth:`~CGOPipeExecutor._decode_layer` (the
schedule above). The parts: the options (:mod:`.cgopipe_options`, checked once), prefill chunks, warm-up and scoring
passes (:mod:`.prefill`), the micro-batches and where their attention runs with the host transfers around it
(:mod:`.attention_placement`: CPU worker or GPU), the weight stream (:mod:`.weight_stream`: resident experts, the host
pool, the two GPU page buffers, a layer visit's pages), the expert FFN strategy (:mod:`.expert_ffn`), the stage timer
and counters (:mod:`.stage_stats`), and the sampling seam shared with the serial executor (:class:`.sampling.DecodeRows`:
logits to tokens, finished rows).

The small activation transfers (attention outputs) do not queue between pages on the weight stream: they go by
zero-copy kernel reads of pinned memory, or by DMA on their own stream, so a page never waits behind a
CPU-attention result (or the reverse) in one FIFO.

On ``device: cpu`` the same loop runs with synchronous copies (CI checks its tokens equal the serial
executor's).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future
from typing import Optional, Sequence

import torch

from ..kernels.cpu_attention import native_stats
from ..model.families import family_of
from ..model.weights import ModelWeights
from ..policy.policy import Policy
from ..policy.refill_schedule import RefillCall, default_min_free
from .attention_placement import AttentionPlacement, MicroBatch, micro_batches
from .cgopipe_options import CGOPipeOptions, cgopipe_refusal, check_model
from .executor import Executor, RunStats, StepCallback
from .expert_ffn import expert_ffn, expert_ffn_for
from .prefill import CGOPipePrefill, PrefillChunk
from .refill import SlotTable, commit_live, reset_slots
from .sampling import DecodeRows
from .stage_stats import StageTimer, add_counts
from .weight_stream import WeightStream, packed_layout

# re-exported where callers have always found them (the engine's refusals, the FFN choice, the batch pieces)
__all__ = ["CGOPipeExecutor", "MicroBatch", "PrefillChunk", "cgopipe_refusal", "expert_ffn_for"]


class CGOPipeExecutor(CGOPipePrefill, Executor):
    """Pipelined executor driven by a :class:`Policy`; the contract of :class:`.executor.Executor`.

    Args:
        weights: host weights. Their experts go to the weight stream (:class:`~.weight_stream.WeightStream`:
            resident on the device, or one exact-size pinned page pool; the per-layer expert tensors are released
            from ``weights`` as they are copied, so host memory holds each expert once). Quantized checkpoints
            (:class:`~lightning_moe.model.quantized.QuantExperts`, and gpt-oss's ``MXFP4Experts``) stay packed: pages
            cross PCIe as packed bytes and are dequantized on the device (MXFP4: in the kernel's registers).
        policy: mu, n, prefill micro-batch, resident experts, GPU-attention micro-batches.
        device: "cuda[:i]" (or "cpu": same loop, synchronous copies; for tests).
        dtype: compute dtype (default: the weights').
        **options: the fields of :class:`.cgopipe_options.CGOPipeOptions` (``ffn``, ``kv_groups``, ``cpu_threads``,
            ``attention_h2d``, ``gpu_attention``, ``score_chunk_tokens``, ``hardware``, ``warmup``), checked once;
            ValueError naming a bad or unknown one, or what the model cannot run (``cgopipe_options.check_model``).
    """

    refills = True  # generate takes any number of prompts: N decode at once, freed slots refilled (pipeline/refill.py)

    def __init__(self, weights: ModelWeights, policy: Policy, device: str | torch.device = "cuda",
                 dtype: Optional[torch.dtype] = None, **options):
        self.opts = opts = CGOPipeOptions.from_kwargs(options)
        self.spec = spec = weights.spec
        self.family = fam = family_of(spec)  # the model family's layer math (model/families/)
        self.device = dev = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dt = dtype or weights.dtype
        lay = packed_layout(weights.experts)  # packed pages' layout (MXFP4 pages: the MXFP4 kernel), or None
        check_model(spec, fam, opts, self.cuda, lay.scheme if lay is not None else None)
        self.mla = fam.attention == "mla"  # decode attention over a CPU latent cache, absorbed on the device
        self.sinks = fam.attention == "gqa_sinks"  # per-head sinks (gpt-oss): CPU attention with each layer's sinks
        self.policy, self.batch_size, self.ffn = policy, policy.N, opts.ffn
        self.layers = [lw.to(dev, dt) for lw in weights.layers]
        self.embed = weights.embed.to(dev, dt)
        self.norm = weights.norm.to(dev, dt)
        self.lm_head = weights.lm_head.to(dev, dt)
        if self.cuda:  # the device holds them now: their host copies go before the page pool fills (the host peak)
            weights.release_non_expert()
        self.inv_freq = fam.rope_inv_freq(spec, dev)
        self.stats = RunStats()
        # a warm-up at the first layer of each kind in the first prefill (prefill._warm_up); default: on CUDA (its
        # kernels compile, load and plan on first use), off on the CPU (nothing to warm)
        self.warmup = self.cuda if opts.warmup is None else bool(opts.warmup)
        self._warm_s = 0.0  # seconds of the warm-up inside the running prefill (its callers take them out of its wall)
        self._warmed: set = set()  # (layer kind (prefill._layer_kind), decode kernels too) warmed up
        self.timer = StageTimer(self.cuda)
        self.compute = torch.cuda.current_stream(dev) if self.cuda else None
        self.weight_stream = ws = WeightStream(weights.experts, spec, policy, dev, dt, self.compute, self.timer,
                                               self._count_h2d)
        ffn_from = fam.experts_ffn_from
        if spec.swiglu_limit > 0:  # the clamped SwiGLU's numbers (gpt-oss; the family's experts_ffn_from takes them)
            ffn_from = functools.partial(ffn_from, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
        self.expert_ffn = expert_ffn(opts.ffn_kind(self.cuda), ffn_from, ws.paging, ws.page_layout, spec.num_experts,
                                     dt, dev, hardware=opts.hardware, swiglu=(spec.swiglu_limit, spec.swiglu_alpha),
                                     shape=(spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k))
        self.attention = AttentionPlacement(spec, fam, self.layers, dev, dt, policy, opts, self.timer, self.compute,
                                            lambda: self.stats)
        self.phase: Optional[str] = None  # the phase running now (:meth:`_enter`)
        self.phase_hook = None  # called with each phase's name as it starts (the runner's per-phase memory peaks)
        self.estimate = None  # the job plan's hrm.Estimate (set by app.engine): its refill_min_free, when planned
        self.calls: list[RefillCall] = []  # per finished generate call, its lengths and slots (refill_schedule)

    # ---- generate (:meth:`.executor.Executor.generate`): prefill, then decode steps, refilling freed slots ----
    def _decode(self, seqs: list[list[int]], caps: list[int], rows: DecodeRows,
                on_step: Optional[StepCallback]) -> list[tuple[list[int], str]]:
        """The loop of :meth:`.executor.Executor.generate` (its contract), any number of prompts: at most ``policy.N``
        decode at once, the others wait in the caller's order for a freed slot (:mod:`.refill`: continuous refill; a
        refill's prefill runs between decode steps). ``on_logprobs`` is called per micro-batch as its tokens are
        chosen; ``on_finish``, ``stop_rows`` and ``on_tokens`` once per step (a decode step, or a prefill), after every
        micro-batch (:class:`.sampling.DecodeRows`); rows are indices into the prompts.

        The micro-batch shapes stay fixed: a free slot decodes a throwaway token (never sampled, its KV length reset)
        until a waiting request takes it.
        """
        plan = getattr(self.estimate, "refill_min_free", 0)  # the job plan's (jobplan.job_min_free)
        min_free = self.opts.refill_min_free or plan or default_min_free(self.policy.N)
        table = SlotTable(caps, self.policy.N, min_free)
        # slot s holds table.caps[s] positions; micro-batches of slots grouped by capacity, mb.rows their slots
        t0 = time.perf_counter()
        mbs = self._micro_batches([range(c) for c in table.caps], 0, True, self.policy.mu)
        # outside the phases (the report's other, run): the caches of every slot, allocated once per call
        add_counts(self.stats.extra, {"kv_cache_alloc": time.perf_counter() - t0})
        table.place([mb.rows for mb in mbs])
        tokens = []  # per micro-batch, the token each row feeds the next decode step
        for mb in mbs:
            mb.kv.lengths.zero_()
            tokens.append(torch.zeros(len(mb.rows), dtype=torch.int64))
        t1 = self._refill(seqs, mbs, table, rows, tokens, on_step)
        try:
            while table.live or table.waiting:
                if table.due():
                    self._decode_done(t1)  # the decode so far, apart from the refill's prefill
                    t1 = self._refill(seqs, mbs, table, rows, tokens, on_step)
                    if not table.live:
                        continue
                self._one_step(mbs, table, rows, tokens, on_step)
        finally:  # a callback that stops the run still leaves this batch's decode time in the stats
            self._decode_done(t1)
        # what the call ran, for the report's schedule from measured lengths (app.report.refill_report)
        new = rows.params.max_new_tokens  # a cap is prompt + new, a seq prompt + prefix: tokens made by this call
        made = [len(o) - len(s) + c - new for (o, _), s, c in zip(rows.results, seqs, caps)]
        self.calls.append(RefillCall(table.needs, [len(s) for s in seqs], made, len(table.caps), min_free))
        return rows.results

    def _one_step(self, mbs: list[MicroBatch], table: SlotTable, rows: DecodeRows, tokens: list, on_step) -> None:
        """One decode step of every slot; its tokens committed for the slots that hold a request (``tokens`` replaced
        in place: the next step's inputs), finished requests' slots freed and reset (:func:`.refill.reset_slots`)."""
        alive = table.live
        ts = time.perf_counter() if self.timer.spans_on else 0.0
        logits = self._decode_step(mbs, tokens)
        tokens[:] = [commit_live(table.requests(mb.rows), lg, rows) for mb, lg in zip(mbs, logits)]
        del logits  # sampled: each step's logits are the only ones alive during the next (the memory model's rows)
        if self.timer.spans_on:
            self.timer.span("step", ts, time.perf_counter())  # host issue of one decode step
        self.stats.decode_tokens += alive
        self.stats.decode_steps += 1
        self.stats.slot_steps += len(table.caps)
        if on_step is not None:
            on_step(alive)
        table.release(rows.end_step())
        reset_slots(mbs, table)

    def _refill(self, seqs: list[list[int]], mbs: list[MicroBatch], table: SlotTable, rows: DecodeRows,
                tokens: list, on_step) -> float:
        """Prefill waiting requests into free slots (:meth:`SlotTable.assign`) in one pass over the layers; their first
        tokens committed (a step of their own: ``on_step``, then :meth:`DecodeRows.end_step`), repeated while a refill
        is due and no slot decodes (every request finished at its first token). Returns when the decode resumes."""
        for mb in mbs:  # the last step's hidden states are not needed (the next step embeds its tokens): the refill's
            mb.x = None  #   prefill has the device memory the planner gave the prefill phase
        while True:
            self._enter("prefill")
            t0 = time.perf_counter()
            pairs = table.assign()
            self.stats.prefill_passes += 1
            fill: list[tuple[list[int], list[int]]] = [([], []) for _ in mbs]
            for s, r in pairs:
                k, j = table.where[s]
                fill[k][0].append(j)
                fill[k][1].append(r)
            logits = self._prefill(seqs, mbs, fill=fill)  # prefill chunks of prefill_mu rows into the slots' KV rows
            for k, (mb, (js, rs), lg) in enumerate(zip(mbs, fill, logits)):
                if not js:
                    continue
                tokens[k][js] = rows.commit(rs, lg)
                mb.kv.lengths[js] = torch.tensor([len(seqs[r]) for r in rs])
                mb.pos = mb.rope = None  # rebuilt from the cache lengths in the next step
            del logits
            self._sync()
            if on_step is not None:
                on_step(len(pairs))
            t1 = time.perf_counter()
            self.stats.prefill_tokens += sum(len(seqs[r]) for _, r in pairs)
            self.stats.prefill_seconds += t1 - t0 - self._warm_s  # a warm-up (prefill._warm_up) is not prefill time
            self.timer.span("phase", t0, t1, "prefill")
            self._prefill_done(t1 - t0 - self._warm_s)  # the prefill's stage times, apart from the decode's
            self._warm_s = 0.0
            table.release(rows.end_step())
            reset_slots(mbs, table)
            if table.live or not table.due():
                break
        self.attention.attn_kv_bytes = 0
        native_stats(reset=True)  # the native CPU attention kernel's own time split, for this decode only
        self._enter("decode")
        return t1

    def _decode_step(self, mbs: list[MicroBatch], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed one token per row of every micro-batch; returns fp32 logits [mu_k, V] per micro-batch."""
        for mb, t in zip(mbs, tokens):
            mb.x = self.embed[t.to(self.device, non_blocking=True)]  # [mu_k, D]
            if mb.pos is None:  # first step, or a slot refilled / reset: from the host lengths, no stream sync (a
                #   pageable source is staged before the call returns; the host changes the lengths only after)
                mb.pos = mb.kv.lengths.to(self.device, copy=True, non_blocking=True)  # [mu_k]
        ahead: dict = {}  # micro-batch index -> its CPU attention of the next layer, already submitted (look-ahead)
        for l in range(self.spec.num_layers):
            ahead = self._decode_layer(l, mbs, ahead)
        for mb in mbs:
            mb.kv.lengths += 1
            mb.pos += 1
            mb.rope = None  # positions moved: the next step recomputes its RoPE tables
        return [self.family.final_logits(mb.x, self.norm, self.lm_head, self.spec.rms_norm_eps) for mb in mbs]

    def _decode_layer(self, l: int, mbs: list[MicroBatch], ahead: dict) -> dict:
        """One layer of one decode step over all micro-batches (the CGOPipe schedule); returns the look-ahead of layer
        l+1 (micro-batch index -> its CPU attention, submitted).

        Micro-batch k's slot of layer l+1's pages is issued right after k's attention result is on its way
        to the GPU (CPU attention) or computed (GPU attention), never before: copies of one direction queue on
        the copy engine in issue order, so a slot issued earlier would hold the attention output behind
        megabytes of pages while the GPU waits for it. A CPU micro-batch is finished after the next micro-batch's
        attention is under way, so the worker and the GPU overlap. With ``layer_lookahead`` (the default) a CPU
        micro-batch's layer l+1 pre-attention and CPU attention are issued as soon as its layer l post-attention is
        (:meth:`_finish_cpu`), so ``ahead`` already holds layer l's CPU attentions: the worker goes from the last
        micro-batch of layer l to the first of layer l+1 without waiting for the host to finish layer l and the GPU
        to run its last post-attention and the next layer's first pre-attention (the layer boundary's bubble). With
        the option ``page_issue="visit_start"`` every page of layer l+1 is issued as the visit starts instead (for
        attention outputs that do not cross on the copy engine: zero-copy, or GPU attention).
        """
        visit, ffn = self._begin_visit()
        if self.opts.page_issue == "visit_start":  # the next visit's pages now, behind this visit's on the weight stream
            self.weight_stream.prefetch_slot(visit + 1, 0, 1)
        at, nxt = self.attention, {}
        cpu_pending = None  # (k, micro-batch, Future) whose CPU attention runs on the worker
        for k, mb in enumerate(mbs):
            attn = ahead.get(k)  # submitted by the previous layer's look-ahead
            if attn is None:
                q, kk, v = self._pre_attention(l, mb)
                attn = (self.timer.timed("gpu_attention", self.compute, lambda: at.gpu(l, mb, q, kk, v))
                        if mb.on_gpu else at.submit_cpu(l, mb, q, kk, v))
            if cpu_pending is not None:  # finish the previous CPU micro-batch while this one's attention runs
                self._finish_cpu(l, visit, len(mbs), cpu_pending, ffn, nxt)
                cpu_pending = None
            if mb.on_gpu:
                self._finish_micro_batch(l, visit, len(mbs), k, mb, attn, ffn)
            else:
                cpu_pending = (k, mb, attn)
        if cpu_pending is not None:
            self._finish_cpu(l, visit, len(mbs), cpu_pending, ffn, nxt)
        self.weight_stream.end_visit(visit)
        return nxt

    def _finish_cpu(self, l: int, visit: int, slots: int, pending: tuple, ffn, nxt: dict) -> None:
        """Finish CPU micro-batch ``pending`` = (k, mb, Future) at layer l; then, with ``layer_lookahead`` and a next
        layer, enqueue its layer l+1 pre-attention (it needs only this post-attention's output and resident weights)
        and submit its CPU attention into ``nxt[k]``, behind the worker's queue of layer l."""
        k, mb, attn = pending
        self._finish_micro_batch(l, visit, slots, k, mb, attn, ffn)
        if self.opts.layer_lookahead and l + 1 < self.spec.num_layers:
            q, kk, v = self._pre_attention(l + 1, mb)
            nxt[k] = self.attention.submit_cpu(l + 1, mb, q, kk, v)

    def _pre_attention(self, l: int, mb: MicroBatch):
        """Norm, q/k/v, RoPE of micro-batch ``mb`` on the device: q [mu, Hq, hd], k / v [mu, Hkv, hd]. MLA: the query
        absorbed (q_nope W_UK per head, so the CPU worker attends over the latent cache) q_lat [mu, Hq, kv_lora + rope],
        the latent c [mu, kv_lora] and the rope key k_pe [mu, rope] in their place."""
        lw = self.layers[l]
        if self.mla:
            q, c, k_pe = self.family.pre_attention(lw, mb.x, mb.pos, self.spec, self.inv_freq)  # [mu,Hq,hd] [mu,Dl] [mu,rd]
            return self.family.mla_absorb(lw, q, self.spec), c, k_pe
        if mb.rope is None:  # once per decode step: the same positions in every layer
            mb.rope = self.family.rope_cos_sin(self.spec, mb.pos, self.inv_freq.to(self.device), mb.x.dtype)  # [mu, hd] x2
        return self.family.pre_attention(lw, mb.x, mb.pos, self.spec, self.inv_freq, mb.rope)  # [mu,Hq,hd] [mu,Hkv,hd] x2

    def _finish_micro_batch(self, l: int, visit: int, slots: int, k: int, mb: MicroBatch, attn, ffn) -> None:
        """Micro-batch k once its attention is enqueued (a GPU tensor) or running on the worker (a Future): a CPU
        result goes to the GPU first; then slot k of the next visit's pages is issued behind it; then k's
        post-attention (o_proj, residual, norm, router, the visit's expert FFN) is enqueued."""
        if isinstance(attn, Future):
            attn = self.attention.receive(attn)
        if self.opts.page_issue == "after_attention":  # (else issued as the visit started: _decode_layer)
            self.weight_stream.prefetch_slot(visit + 1, k, slots)
        if self.mla:  # the values from the attention-weighted latents (W_UV per head), on the device
            attn = self.family.mla_unabsorb(self.layers[l], attn, self.spec)  # [mu_k, Hq*v_hd]
        mb.x = self.family.post_attention(self.layers[l], None, mb.x, attn, self.spec, ffn)  # [mu_k, D]

    def _begin_visit(self):
        """Start the next layer visit (:meth:`WeightStream.begin_visit`); returns ``(visit, ffn)``, ``ffn`` the visit's
        expert FFN: its first call enqueues the wait for the visit's pages and builds the strategy's FFN over them
        (pre-attention and attention before it need no expert weights, so they overlap the page copies). A dense
        layer's visit (``spec.dense_layers``) has no pages and no expert FFN: ``ffn`` is None, its MLP is resident."""
        visit, built = self.weight_stream.begin_visit(), []
        if self.spec.is_dense_layer(visit % self.spec.num_layers):
            return visit, None

        def ffn(h, ew, w, ids):
            if not built:
                built.append(self.expert_ffn.for_visit(self.weight_stream.wait_pages(visit)))
            if self.timer.spans_on:  # the timeline's GPU expert FFN lane (moe-batch run --timeline)
                return self.timer.timed("expert_ffn", self.compute, lambda: built[0](h, ew, w, ids))
            return built[0](h, ew, w, ids)

        return visit, ffn

    def _micro_batches(self, prompts: Sequence[Sequence[int]], extra: int, with_kv: bool, mu: int,
                       kv_groups: Optional[int] = None) -> list[MicroBatch]:
        """:func:`.attention_placement.micro_batches` of this executor (``kv_groups`` default: the option's)."""
        return micro_batches(prompts, mu, self.spec, self.family, self.policy, self.device, self.cuda, self.dtype,
                             extra, with_kv, kv_groups or self.opts.kv_groups)

    # ---- setup, phases, report ----------------------------------------------------------------
    def _count_h2d(self, nbytes: int) -> None:
        self.stats.h2d_bytes += nbytes

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Release the worker thread and unregister the pinned pool."""
        self.attention.close()
        self._sync()
        self.weight_stream.close()

    def _enter(self, phase: str) -> None:
        """Start a phase ("prefill", "decode", "scoring"): ``self.phase`` names it (out-of-memory messages) and
        ``phase_hook`` (set by the runner: per-phase peak memory) is told."""
        self.phase = phase
        self.timer.phase = phase
        if self.phase_hook is not None:
            self.phase_hook(phase)

    def policy_summary(self) -> dict:
        """The policy as a dict (for the run report)."""
        p, ws = self.policy, self.weight_stream
        return {"expert_ffn": self.ffn, "mu": p.mu, "n": p.n, "N": p.N, "prefill_mu": p.prefill_mu,
                "prefill_tokens": p.prefill_tokens, "resident_experts": ws.resident_count(),
                "n_gpu_attn": p.n_gpu_attn if self.cuda else 0,  # on the CPU every micro-batch attends on the CPU
                "expert_pages": ws.page_layout.scheme if ws.page_layout is not None else str(self.dtype).replace("torch.", ""),
                "host_pool_bytes": ws.pool.nbytes, "page_buffer_bytes": ws.buffers.nbytes, "resident_bytes": ws.resident.nbytes}
