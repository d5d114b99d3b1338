"""CGOPipe's prefill passes: prefill chunks, their KV written to the micro-batches' caches, the one-time warm-up, and
the scoring passes (``prompt_logprobs``).

A batch is prefilled layer by layer (the expert pages of a layer cross once for the whole batch): every micro-batch is
cut into prefill chunks (:func:`prefill_chunks`: at most ``policy.prefill_mu`` rows and ``policy.prefill_tokens``
padded tokens, the workspace the planner counted), each chunk packed token-wise (:class:`PrefillChunk`) and carried
through every layer with attention on the device; its k/v go to its micro-batch's cache (a GPU cache in place, a CPU
cache by pinned D2H and a scatter on the worker thread, at most two chunks in flight).

:class:`CGOPipePrefill` is the prefill half of :class:`~.cgopipe.CGOPipeExecutor` (a mixin over the executor's model
weights, weight stream, expert FFN, timer and attention placement); the decode half is in :mod:`.cgopipe`.
It also holds the phases' bookkeeping both halves use (``_count_kernel_calls``, ``_decode_done``, ``_prefill_done``:
stage times and counters into the executor's stats).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from ..kernels.cpu_attention import native_stats
from .attention_placement import MicroBatch
from .kv_cache import PrefillIndex
from .stage_stats import add_counts
from .token_scores import next_token_targets, split_scores, token_scores

WARMUP_SHAPES = 4  # distinct prefill chunk shapes the warm-up runs (later new shapes pay their own first call)


@dataclass
class PrefillChunk:
    """One prefill micro-batch: consecutive rows of a micro-batch, packed token-wise (T tokens in all), carried
    through every layer."""

    mb: int  # index of its micro-batch
    rows: list[int]  # its rows (indices into the batch's prompt list), in the micro-batch's order
    kv_index: Optional[PrefillIndex]  # scatter index into the micro-batch's cache rows (GroupedKVCache.prefill_index);
    #   None: no KV
    x: Optional[torch.Tensor]  # [T, D] hidden states, replaced layer by layer; None once scored
    pos: torch.Tensor  # int64 [T] position of each token in its row
    spans: list[tuple[int, int]]  # (start, end) of each row in the packed tokens
    ends: torch.Tensor  # int64 [rows] packed end of each row (host)
    rope: Optional[tuple]  # RoPE (cos, sin) [T, hd], for every layer (MLA: None, as MicroBatch.rope)
    layout: Any  # the family's packed-attention layout (prefill_packed_layout), for every layer


def prefill_chunks(prompts: Sequence[Sequence[int]], rows: Sequence[int], policy) -> list[tuple[int, list[int]]]:
    """Split a micro-batch's ``rows`` (in order) into prefill micro-batches: (offset of the first row, rows).

    A chunk takes rows while it has at most ``policy.prefill_mu`` rows and at most ``policy.prefill_tokens`` padded
    tokens (rows x longest row), so its workspace stays within what the planner counted for any mix of lengths; a
    single longer prompt forms a chunk alone.
    """
    rows = list(rows)
    cap_rows, cap_tok = max(1, policy.prefill_mu), policy.prefill_tokens
    out, start, longest = [], 0, 0
    for j, r in enumerate(rows):
        n = len(prompts[r])
        if j > start and (j - start + 1 > cap_rows or (j - start + 1) * max(longest, n) > cap_tok):
            out.append((start, rows[start:j]))
            start, longest = j, 0
        longest = max(longest, n)
    if rows:
        out.append((start, rows[start:]))
    return out


class CGOPipePrefill:
    """Prefill, warm-up and scoring passes of :class:`~.cgopipe.CGOPipeExecutor` (a mixin: it reads the executor's
    ``spec``, ``family``, ``layers``, ``embed``, ``norm``, ``lm_head``, ``inv_freq``, ``device``, ``policy``,
    ``opts``, ``timer``, ``compute``, ``attention``, ``weight_stream``, ``expert_ffn`` and ``stats``)."""

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
        t1 = time.perf_counter()
        self.timer.span("phase", t0, t1, "scoring")
        self._prefill_done(t1 - t0 - self._warm_s)  # a warm-up (_warm_up) is not prefill time
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        self.stats.prefill_seconds += t1 - t0 - self._warm_s
        return out

    def _prefill(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], score: bool = False,
                 fill: Optional[list[tuple[list[int], list[int]]]] = None) -> list:
        """Prefill every micro-batch layer by layer (weights streamed once per layer for the whole batch).

        Each micro-batch is computed in prefill chunks (:func:`prefill_chunks`), writing each chunk's KV into its
        micro-batch's cache rows (:meth:`_store_prefill_kv`); a layer's next pages are issued at once, at the start of
        the layer. Returns per micro-batch: fp32 logits of the last token of each row [mu_k, V]; with ``score``, (fp32
        logprob [T_k], bool greedy [T_k]) of every packed row's next token instead (:func:`token_scores.token_scores`,
        run per prefill chunk, ``score_chunk_tokens`` rows at a time: no chunk's [T, V] logits exist).

        ``fill`` (a refill, :mod:`.refill`): per micro-batch ``(cache rows, prompt indices)``, the prompts to prefill into
        those rows of its cache (none: every row j of ``mb.rows`` takes prompt ``mb.rows[j]``); the logits of a
        micro-batch with nothing to fill are None.
        """
        fill = fill if fill is not None else [(list(range(len(mb.rows))), list(mb.rows)) for mb in mbs]
        chunks = [self._prefill_chunk(prompts, i, mb, cache_rows[off: off + len(rows)], rows)
                  for i, (mb, (cache_rows, reqs)) in enumerate(zip(mbs, fill))
                  for off, rows in prefill_chunks(prompts, reqs, self.policy)]
        pending: list[Future] = []  # KV writes of CPU-cache chunks in flight (worker thread)
        self._warm_s = 0.0
        with self._prefill_pass():
            for l in range(self.spec.num_layers):
                visit, ffn = self._begin_visit()
                self.weight_stream.prefetch_slot(visit + 1, 0, 1)
                kind = self._layer_kind(l, ffn)
                if self.warmup and (kind, True) not in self._warmed and (kind, not score) not in self._warmed:
                    self._warm_up(l, chunks, ffn, [] if score else mbs)
                for ch in chunks:
                    self._prefill_layer(l, ch, mbs[ch.mb], ffn, pending)
                self.weight_stream.end_visit(visit)
        if not score:  # the first generation pass warmed every kind of layer, decode included (a scoring pass
            self.warmup = False  # warms the prefill kernels only: a later generation still warms its decode)
        for f in pending:  # every KV row is in its cache before decode reads it
            f.result()
        self._count_kernel_calls("prefill")
        if score:
            return self._score_chunks(prompts, mbs, chunks)
        per_mb: list[list[torch.Tensor]] = [[] for _ in mbs]
        for ch in chunks:
            x = ch.x[(ch.ends - 1).to(self.device)]
            per_mb[ch.mb].append(self.family.final_logits(x, self.norm, self.lm_head, self.spec.rms_norm_eps))
        return [torch.cat(parts) if parts else None for parts in per_mb]

    def _prefill_pass(self):
        """The context of a prefill pass for the expert FFN's kernel choice (``KernelChoice.prefill_pass``: kernels
        with a host sync may run); a no-op for a strategy without one."""
        choice = getattr(self.expert_ffn, "choice", None)
        return choice.prefill_pass() if choice is not None else contextlib.nullcontext()

    def _prefill_chunk(self, prompts: Sequence[Sequence[int]], i: int, mb: MicroBatch, cache_rows: list[int],
                       rows: list[int]) -> PrefillChunk:
        """Prompts ``rows`` into cache rows ``cache_rows`` of micro-batch ``i``, packed as one chunk: embedded tokens,
        positions, RoPE tables and the attention layout (once, for every layer), and the scatter index of its KV
        (:meth:`_prefill_kv_index`)."""
        lens = [len(prompts[r]) for r in rows]
        ids = torch.tensor([t for r in rows for t in prompts[r]], dtype=torch.int64)
        ends = torch.tensor(lens).cumsum(0)
        spans = [(int(e) - n, int(e)) for e, n in zip(ends, lens)]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device, non_blocking=True)
        x = self.embed[ids.to(self.device, non_blocking=True)]  # [T, D]
        rope = None if self.mla else self.family.rope_cos_sin(self.spec, pos, self.inv_freq.to(self.device), x.dtype)  # [T, hd] x2
        layout = self.family.prefill_packed_layout(spans, x.shape[0], self.device)  # for every layer
        return PrefillChunk(i, rows, self._prefill_kv_index(mb, cache_rows, spans), x, pos, spans, ends, rope, layout)

    def _prefill_kv_index(self, mb: MicroBatch, cache_rows: list[int], spans) -> Optional[PrefillIndex]:
        """The chunk's scatter index into its micro-batch's ``cache_rows`` (GroupedKVCache.prefill_index), on
        the device its k / v are written from (the GPU for GPU caches, the host for CPU caches); None without KV."""
        if mb.kv is None:
            return None
        src = self.device if (mb.on_gpu or not self.cuda) else torch.device("cpu")
        return mb.kv.prefill_index(cache_rows, spans, src)

    def _prefill_layer(self, l: int, ch: PrefillChunk, mb: MicroBatch, ffn, pending: list) -> None:
        """Layer ``l`` over one chunk: attention on the device, its KV to the micro-batch's cache, then o_proj,
        router and the visit's expert FFN (``ffn``); replaces ``ch.x``."""
        fam, lw = self.family, self.layers[l]
        q, k, v = fam.pre_attention(lw, ch.x, ch.pos, self.spec, self.inv_freq, ch.rope)  # [T,Hq,hd] [T,Hkv,hd] x2
        #   (MLA: q [T, Hq, hd], the latent c [T, kv_lora] and the rope key k_pe [T, rope] as k and v)
        window = self.spec.layer_sliding_window(l)
        if self.mla:  # the latent expanded per head, as the serial executor
            attn = self.timer.timed("gpu_attention", self.compute, lambda: fam.prefill_attention_packed(
                lw, q, k, v, ch.spans, self.spec, ch.layout))  # [T, Hq*v_hd]
        elif self.sinks:  # the layer's sinks, as the serial executor
            attn = self.timer.timed("gpu_attention", self.compute, lambda: fam.prefill_attention_packed(
                lw, q, k, v, ch.spans, window, ch.layout))  # [T, Hq*hd]
        else:
            attn = self.timer.timed("gpu_attention", self.compute, lambda: fam.prefill_attention_packed(
                q, k, v, ch.spans, window, ch.layout))  # [T, Hq*hd]
        if mb.kv is not None:
            self._store_prefill_kv(l, mb, ch.kv_index, k, v, pending)
        ch.x = fam.post_attention(lw, None, ch.x, attn, self.spec, ffn)  # [T, D]

    def _store_prefill_kv(self, l: int, mb: MicroBatch, index: PrefillIndex, k: torch.Tensor, v: torch.Tensor, pending: list) -> None:
        """Write a prefill chunk's k, v [T, Hkv, hd] (MLA: the latent c [T, kv_lora] and the rope key k_pe [T, rope])
        into its micro-batch's cache (one row scatter per K and V over every length group, by ``index`` from
        :meth:`_prefill_kv_index`, not a copy per sequence; a CPU cache's is native, all of torch's threads).

        GPU caches are written in place. For CPU caches on CUDA the copy is asynchronous: k/v go to pinned
        host buffers on the D2H stream and the worker thread writes them into the cache once they landed,
        so the host keeps issuing GPU work (a pageable ``.cpu()`` blocked it on every chunk and layer).
        At most two chunks are in flight (bounded pinned staging, as the planner counts).
        """
        at = self.attention
        if mb.on_gpu or not self.cuda:
            t0 = time.perf_counter()
            mb.kv.write_prefill_index(l, index, k, v)
            if not mb.on_gpu:  # the CPU cache's scatter (host seconds; a GPU cache's write is enqueued, not timed)
                at.host_stage("kv_write", t0)
            return
        (kh, vh), ready = at.to_host(k, v)

        def write():
            ready.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():  # thread-local: the caches are inference tensors
                mb.kv.write_prefill_index(l, index, kh, vh)
            at.host_stage("kv_write", t0)  # the worker's scatter into the CPU cache

        while len(pending) >= 2:
            t0 = time.perf_counter()
            pending.pop(0).result()
            at.host_stage("host_wait_kv_write", t0)  # the host thread held back by the bounded staging
        pending.append(at.workers.submit(write))

    def _layer_kind(self, l: int, ffn) -> tuple:
        """What sets layer ``l``'s kernels apart from another layer's: a dense FFN or the experts (``ffn`` None: a dense
        layer), and its attention window (gpt-oss alternates sliding and full layers)."""
        return ffn is None, self.spec.layer_sliding_window(l)

    def _warm_up(self, l: int, chunks: list[PrefillChunk], ffn, mbs: list[MicroBatch]) -> None:
        """Inside the executor's first prefill, at the first layer of each kind (:meth:`_layer_kind`: DeepSeek's dense
        first layer and its MoE layers, gpt-oss's sliding and full layers): layer ``l`` over a throwaway copy of each
        distinct chunk shape (rows, tokens, longest row; at most ``WARMUP_SHAPES``), no KV written, outputs dropped,
        then at the decode micro-batches' sizes (:meth:`_warm_up_decode`; ``mbs`` empty: a scoring pass, no decode),
        kernel-call counts restored. The kernels' one-time costs (Triton compilation or cache load, the attention
        library's plans, cuBLAS heuristics, lazy module loads) land in ``stats.warmup_seconds`` and ``self._warm_s``
        (the callers take them out of the prefill's wall), not in prefill or decode tokens/s; the run's end-to-end time
        keeps them."""
        self._warmed.add((self._layer_kind(l, ffn), bool(mbs)))  # (kind, decode kernels warmed too)
        t0 = time.perf_counter()
        choice = getattr(self.expert_ffn, "choice", None)
        calls = dict(choice.calls) if choice is not None else None
        seen: set = set()
        for ch in chunks:
            key = (len(ch.rows), ch.x.shape[0], max(e - s for s, e in ch.spans))
            if key in seen:
                continue
            if len(seen) == WARMUP_SHAPES:
                break
            seen.add(key)
            self._prefill_layer(l, replace(ch), MicroBatch(ch.rows, None, False), ffn, [])
        if chunks and mbs:
            self._warm_up_decode(l, mbs, chunks[0].x, ffn, choice)
        self._sync()
        if choice is not None:
            choice.calls = calls
        dt = time.perf_counter() - t0
        self._warm_s += dt
        self.stats.warmup_seconds += dt

    def _warm_up_decode(self, l: int, mbs: list[MicroBatch], x: torch.Tensor, ffn, choice) -> None:
        """Layer ``l``'s decode-step kernels at each distinct (micro-batch size, attention place) of ``mbs`` (at most
        ``WARMUP_SHAPES``): pre-attention, the attention (a GPU micro-batch's Triton decode kernel over its own cache,
        writing position 0 of layer ``l``, which this prefill then overwrites; elsewhere attention compiles nothing
        and zeros stand in, a CPU micro-batch's brought to the device as its output is), post-attention with the
        expert FFN's decode kernel choice. Rows are throwaway copies of the chunk's hidden states ``x`` [T, D];
        outputs are dropped."""
        seen: set = set()
        for mb in mbs:
            key = (len(mb.rows), mb.on_gpu)
            if key in seen or len(seen) == WARMUP_SHAPES or not mb.rows:
                continue
            seen.add(key)
            m = len(mb.rows)
            rows = torch.arange(m, device=x.device) % x.shape[0]
            tmp = MicroBatch(mb.rows, mb.kv, mb.on_gpu, x=x[rows], pos=torch.zeros(m, dtype=torch.int64, device=x.device))
            q, k, v = self._pre_attention(l, tmp)
            if mb.on_gpu and self.attention.gpu_attention == "triton" and not self.mla:  # torch's attention (MLA's
                #   too, whatever gpu_attention says) compiles nothing
                attn = self.attention.gpu(l, tmp, q, k, v)
            else:  # zeros stand in for the attention (CPU attention compiles nothing), brought over as receive() does
                shape = (m, q.shape[1], self.spec.kv_lora_rank) if self.mla else (m, q.shape[1] * q.shape[2])
                attn = (self.attention.warm_up_receive(shape, q.dtype) if not mb.on_gpu
                        else torch.zeros(shape, dtype=q.dtype, device=q.device))
            if self.mla:
                attn = self.family.mla_unabsorb(self.layers[l], attn, self.spec)
            if choice is not None:
                choice.prefill = False  # the decode step's kernel choice (KernelChoice.prefill_pass: set again below)
            try:
                self.family.post_attention(self.layers[l], None, tmp.x, attn, self.spec, ffn)
            finally:
                if choice is not None:
                    choice.prefill = True

    def _score_chunks(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], chunks: list[PrefillChunk]) -> list:
        """The scoring head over each prefill chunk's final hidden states (in :meth:`_prefill`'s chunk order, which
        follows each micro-batch's rows); a chunk's hidden states are released once scored. Returns per micro-batch
        (fp32 logprob [T_k], bool greedy [T_k]) on the device, rows packed in ``mb.rows`` order."""
        per_mb: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in mbs]
        eps = self.spec.rms_norm_eps
        for ch in chunks:
            targets = next_token_targets([prompts[r] for r in ch.rows], self.device)  # [T_c]
            per_mb[ch.mb].append(token_scores(ch.x, self.norm, self.lm_head, eps, targets, self.opts.score_chunk_tokens,
                                              self.family.final_logits))  # [T_c] x2
            ch.x = None  # this chunk's hidden states are no longer needed
        return [(torch.cat([lp for lp, _ in parts]), torch.cat([g for _, g in parts])) for parts in per_mb]

    def _count_kernel_calls(self, phase: str) -> None:
        """Move the grouped expert calls per kernel since the last count into ``stats.extra``
        (``expert_ffn_<phase>_calls_<kernel>``: which kernel the profile picked, per phase)."""
        choice = getattr(self.expert_ffn, "choice", None)
        if choice is None:
            return
        add_counts(self.stats.extra, {k: v for k, v in choice.calls.items() if v}, prefix=f"expert_ffn_{phase}_calls_")
        choice.calls = dict.fromkeys(choice.calls, 0)

    def _decode_done(self, t1: float) -> None:
        """Add a batch's decode wall time (since ``t1``) and stage timings to the stats."""
        self._sync()
        dt = time.perf_counter() - t1
        self.timer.span("phase", t1, t1 + dt, "decode")
        self.stats.decode_seconds += dt
        stages = self.timer.collect()
        stages["decode_wall"] = dt
        add_counts(self.stats.extra, stages)
        self._count_kernel_calls("decode")
        # bytes, not seconds: with cpu_attention_compute it gives the CPU attention rate the HRM's (H5) assumes
        add_counts(self.stats.extra, {"cpu_attention_valid_kv_bytes": self.attention.attn_kv_bytes})
        # inside the kernel's parallel regions (kernels.cpu_attention.native_stats): region wall time vs the worker's
        # cpu_attention_compute says how much of the stage is the wrapper / thread hand-off; busy vs team
        # thread-seconds says whether the team worked the whole region (memory-bound) or waited for cores
        add_counts(self.stats.extra, native_stats(), prefix="cpu_attention_native_")

    def _prefill_done(self, wall: float) -> None:
        """Add a prefill's (or a scoring pass's) stage times to the stats as ``prefill_<stage>`` with its wall time
        ``prefill_wall``: the page copies and the waits for them, the KV scatter into CPU caches (``kv_write``) and
        the host thread's waits for it (``host_wait_kv_write``)."""
        stages = {f"prefill_{k}": v for k, v in self.timer.collect().items()}
        stages["prefill_wall"] = wall
        add_counts(self.stats.extra, stages)
