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
max(T_io, T_cpu, T_gpu), which is what the HRM (policy/hrm.py) predicts. Micro-batches whose KV the
policy puts on the GPU run attention on the GPU instead. Prefill runs per prefill chunk with GPU
attention, writing KV to the micro-batch's home (CPU or GPU), with experts paged the same way.

The parts: the weight stream (:mod:`.weight_stream`: resident experts, the host pool, the two GPU page buffers,
a layer visit's pages), the expert FFN strategy (:mod:`.expert_ffn`: torch reference loop, Triton over dense or
packed pages), the stage timer and counters (:mod:`.stage_stats`); here: the micro-batches and their attention
(CPU worker or GPU), prefill chunks (:class:`PrefillChunk`), and the loops over layers and micro-batches.

The small activation transfers (attention outputs) do not queue between pages on the weight stream: they go by
zero-copy kernel reads of pinned memory, or by DMA on their own stream, so a page never waits behind a
CPU-attention result (or the reverse) in one FIFO.

On ``device: cpu`` the same loop runs with synchronous copies (CI checks its tokens equal the serial
executor's).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from ..kernels.cpu_attention import native_stats
import functools

from ..kernels.host_read import copy_from_host_triton, host_read_available
from ..model.families import family_of
from ..model.weights import ModelWeights
from ..policy.batching import group_by_length
from ..policy.policy import Policy
from .expert_ffn import expert_ffn, expert_ffn_for, grouped_kernels_refusal
from .kv_cache import KV_GROUPS, GroupedKVCache, GroupedLatentKVCache
from .serial import (FinishCallback, LogprobsCallback, RunStats, SamplingParams, StepCallback, StopRowsCallback,
                     TokensCallback, check_prefixes, finish_reason, sample, token_logprobs)
from .stage_stats import StageTimer, add_counts
from .token_scores import SCORE_CHUNK_TOKENS, next_token_targets, split_scores, token_scores
from .weight_stream import WeightStream, packed_layout

__all__ = ["CGOPipeExecutor", "MicroBatch", "PrefillChunk", "expert_ffn_for"]


WARMUP_SHAPES = 4  # distinct prefill chunk shapes the warm-up runs (later new shapes pay their own first call)


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


@dataclass
class PrefillChunk:
    """One prefill micro-batch: consecutive rows of a micro-batch, packed token-wise (T tokens in all), carried
    through every layer."""

    mb: int  # index of its micro-batch
    rows: list[int]  # its rows (indices into the batch's prompt list), in the micro-batch's order
    kv_index: Optional[list]  # scatter index into the micro-batch's cache rows (GroupedKVCache.prefill_index); None: no KV
    x: Optional[torch.Tensor]  # [T, D] hidden states, replaced layer by layer; None once scored
    pos: torch.Tensor  # int64 [T] position of each token in its row
    spans: list[tuple[int, int]]  # (start, end) of each row in the packed tokens
    ends: torch.Tensor  # int64 [rows] packed end of each row (host)
    rope: Optional[tuple]  # RoPE (cos, sin) [T, hd], for every layer (MLA: None, as MicroBatch.rope)
    layout: Any  # the family's packed-attention layout (prefill_packed_layout), for every layer


class _Outputs:
    """A batch's generation state: every row's output so far, the finished rows' ``(output, reason)``, and the
    tokens committed in the running step (reported once per step, after every micro-batch)."""

    def __init__(self, outputs: list[list[int]], params: SamplingParams, eos: Optional[int], seeds: Optional[list],
                 stats: RunStats, on_finish: Optional[FinishCallback], on_tokens: Optional[TokensCallback],
                 stop_rows: Optional[StopRowsCallback], on_logprobs: Optional[LogprobsCallback] = None):
        self.outputs, self.params, self.eos, self.seeds, self.stats = outputs, params, eos, seeds, stats
        self.on_finish, self.on_tokens, self.stop_rows = on_finish, on_tokens, stop_rows
        self.on_logprobs = on_logprobs if params.logprobs is not None else None  # nothing computed unless asked
        self.results: list = [None] * len(outputs)
        self.step_rows: list[int] = []  # tokens committed in this step, for on_tokens
        self.step_toks: list[int] = []

    @property
    def running(self) -> int:
        """Rows not finished."""
        return sum(r is None for r in self.results)

    def _finish(self, r: int, reason: str) -> None:
        self.results[r] = (self.outputs[r], reason)
        if self.on_finish is not None:
            self.on_finish(r, self.outputs[r], reason)

    def commit(self, mb: MicroBatch, lg: torch.Tensor) -> torch.Tensor:
        """Sample micro-batch ``mb``'s next tokens from its logits ``lg`` [mu_k, V] and append them to the rows still
        running; returns the tokens (int64 [mu_k], every row: finished rows keep their slot)."""
        outputs, sd = self.outputs, self.seeds
        toks = sample(lg, self.params, [sd[r] for r in mb.rows] if sd else None,
                      [len(outputs[r]) for r in mb.rows] if sd else None)
        if self.on_logprobs is not None:  # the running rows' entries, before any of them finishes
            live = [j for j, r in enumerate(mb.rows) if self.results[r] is None]
            if live:
                ent = token_logprobs(lg[live] if len(live) < len(mb.rows) else lg, toks[live], self.params.logprobs)
                self.on_logprobs([mb.rows[j] for j in live], ent)
        for r, t in zip(mb.rows, toks.tolist()):
            if self.results[r] is not None:
                continue
            outputs[r].append(t)
            self.step_rows.append(r)
            self.step_toks.append(t)
            self.stats.generated_tokens += 1
            reason = finish_reason(self.params, self.eos, t, len(outputs[r]))
            if reason is not None:
                self._finish(r, reason)
        return toks

    def end_step(self) -> None:
        """After a step's commits: rows whose text now holds a stop string finish ("stop"), then ``on_tokens``."""
        if self.stop_rows is not None:
            live = {r: self.outputs[r] for r in self.step_rows if self.results[r] is None}
            for r in sorted(self.stop_rows(live) if live else ()):
                self._finish(r, "stop")
        if self.on_tokens is not None:
            self.on_tokens(list(self.step_rows), list(self.step_toks))
        self.step_rows.clear()
        self.step_toks.clear()


MLA_GPU_ATTENTION_REFUSAL = "n_gpu_attn > 0 with multi-head latent attention is not implemented"
SINKS_GPU_ATTENTION_REFUSAL = "n_gpu_attn > 0 with attention sinks is not implemented"


def gpu_attention_refusal(spec) -> Optional[str]:
    """Why GPU-attention micro-batches (``policy.n_gpu_attn > 0`` keeping KV on the GPU) cannot run ``spec``:
    :data:`MLA_GPU_ATTENTION_REFUSAL` (multi-head latent attention), :data:`SINKS_GPU_ATTENTION_REFUSAL` (gpt-oss's
    per-head sinks); None when they can. Checked where the micro-batches are built and, before any weight is read,
    by the engine."""
    if spec.is_mla:
        return MLA_GPU_ATTENTION_REFUSAL
    if spec.attention_sinks:
        return SINKS_GPU_ATTENTION_REFUSAL
    return None


def cgopipe_refusal(spec) -> Optional[str]:
    """Why CGOPipe cannot run ``spec`` although the serial executor can (the family's math its caches, CPU kernel and
    expert kernels do not compute), naming the family; None when it can (every family today). What CGOPipe runs only
    in part is refused where it is asked for, by name: GPU-attention micro-batches of multi-head latent attention or
    with attention sinks (:func:`gpu_attention_refusal`), and the grouped expert kernels for experts they do not
    compute (``expert_ffn.grouped_kernels_refusal``: dense gpt-oss experts run ``expert_ffn: torch``, which ``auto``
    picks; its MXFP4 pages also run the MXFP4 kernel, grouped_mm refused).
    Checked by the executor and, before any weight is read, by the engine."""
    return None


class CGOPipeExecutor:
    """Pipelined executor driven by a :class:`Policy`.

    Args:
        weights: host weights. Their experts go to the weight stream (:class:`~.weight_stream.WeightStream`:
            resident on the device, or one exact-size pinned page pool; the per-layer expert tensors are released
            from ``weights`` as they are copied, so host memory holds each expert once). Quantized checkpoints
            (:class:`~lightning_moe.model.quantized.QuantExperts`, and gpt-oss's ``MXFP4Experts``) stay packed: pages
            cross PCIe as packed bytes and are dequantized on the device (MXFP4: in the kernel's registers).
        policy: mu, n, prefill micro-batch, resident experts, GPU-attention micro-batches.
        device: "cuda[:i]" (or "cpu": same loop, synchronous copies; for tests).
        dtype: compute dtype (default: the weights').
        ffn: the expert FFN (:mod:`~.expert_ffn`): "torch" (the reference expert loop, bit-identical to the serial
            executor), or grouped calls over dense pages, or over packed pages dequantized once per layer visit (MXFP4
            pages: two MXFP4 kernel calls per visit, ``expert_ffn.GroupedMXFP4ExpertFFN``),
            with the kernel "triton" (CUDA only: on the CPU "triton" runs the torch loop), "grouped_mm" (torch's
            grouped GEMM; CUDA bf16, or the CPU), "mm_loop" (one library GEMM per expert, one host sync per call;
            CUDA or the CPU), or "auto" (per call by ``hardware``'s measured rates, mm_loop in prefill passes only,
            Triton where the profile has none; CUDA only: on the CPU "auto" runs the torch loop). Raises ValueError
            on another.
        hardware: the hardware profile whose ``expert_ffn_rates`` drive ``ffn="auto"`` (None: Triton everywhere).
        kv_groups: length groups per micro-batch KV cache (:class:`GroupedKVCache`; default KV_GROUPS = 8,
            the number the planner's memory model assumes).
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
                 cpu_threads: Optional[int] = None, attention_h2d: str = "auto", gpu_attention: str = "torch",
                 score_chunk_tokens: int = SCORE_CHUNK_TOKENS, hardware=None, warmup: Optional[bool] = None):
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
        self.spec = spec = weights.spec
        self.family = fam = family_of(spec)  # the model family's layer math (model/families/)
        why = cgopipe_refusal(spec)
        if why is not None:
            raise ValueError(f"CGOPipeExecutor: {fam.name}: {why}; use executor: serial")
        if fam.attention not in ("gqa", "gqa_sinks", "mla"):
            raise ValueError(f"CGOPipeExecutor: {fam.name}: attention {fam.attention!r} is not implemented "
                             f"(gqa, gqa_sinks, mla)")
        self.mla = fam.attention == "mla"  # decode attention over a CPU latent cache, absorbed on the device
        # per-head sinks (gpt-oss): CPU decode attention with each layer's sinks (the native kernel counts them) and
        # window (spec.layer_sliding_window)
        self.sinks = fam.attention == "gqa_sinks"
        self.policy = policy
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype or weights.dtype
        if ffn not in ("torch", "auto", "triton", "grouped_mm", "mm_loop"):
            raise ValueError(f"CGOPipeExecutor: ffn must be torch, auto, triton, grouped_mm or mm_loop, got {ffn!r}")
        self.ffn = ffn
        # the strategy: "triton" and "auto" need CUDA (the CPU runs the torch loop); grouped_mm, mm_loop run on both
        kind = ffn if (ffn in ("torch", "grouped_mm", "mm_loop") or self.cuda) else "torch"
        lay = packed_layout(weights.experts)  # packed pages' layout (MXFP4 pages: the MXFP4 kernel), or None
        why = grouped_kernels_refusal(spec, kind, lay.scheme if lay is not None else None) if kind != "torch" else None
        if why is not None:
            raise ValueError(f"CGOPipeExecutor: expert_ffn {ffn}: {why}")
        self.kv_groups = kv_groups
        self.batch_size = policy.N
        dev, dt = self.device, self.dtype
        self.layers = [lw.to(dev, dt) for lw in weights.layers]
        self.embed = weights.embed.to(dev, dt)
        self.norm = weights.norm.to(dev, dt)
        self.lm_head = weights.lm_head.to(dev, dt)
        if self.cuda:  # the device holds them now: their host copies go before the page pool fills (the host peak)
            weights.release_non_expert()
        self.inv_freq = fam.rope_inv_freq(spec, dev)
        self.stats = RunStats()
        # one warm-up pass before the first prefill (:meth:`_warm_up`); default: on CUDA (its kernels compile, load
        # and plan on first use), off on the CPU (nothing to warm)
        self.warmup = self.cuda if warmup is None else bool(warmup)
        self._warm_s = 0.0  # seconds of the warm-up inside the running prefill (its callers take them out of its wall)
        self.timer = StageTimer(self.cuda)
        self.compute = torch.cuda.current_stream(dev) if self.cuda else None
        self.weight_stream = WeightStream(weights.experts, spec, policy, dev, dt, self.compute, self.timer,
                                          self._count_h2d)
        ws = self.weight_stream
        ffn_from = fam.experts_ffn_from
        if spec.swiglu_limit > 0:  # the clamped SwiGLU's numbers (gpt-oss; the family's experts_ffn_from takes them)
            ffn_from = functools.partial(ffn_from, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
        self.expert_ffn = expert_ffn(kind, ffn_from, ws.paging, ws.page_layout, spec.num_experts, dt, dev,
                                     hardware=hardware, swiglu=(spec.swiglu_limit, spec.swiglu_alpha),
                                     shape=(spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k))
        if self.cuda:
            self.h2d_a = torch.cuda.Stream(dev)  # attention outputs
            self.d2h = torch.cuda.Stream(dev)  # q/k/v to the CPU
        else:
            self.h2d_a = self.d2h = None
        # the layers' sinks on the host (fp32 [Hq]), for the worker's CPU attention (no device read per layer and step)
        self._cpu_sinks = [lw.sinks.to("cpu", torch.float32).contiguous() for lw in self.layers] \
            if self.sinks else None  # (from the device copies: on CUDA the host layers were released above)
        if not self.mla and (not self.cuda or policy.n_gpu_attn < max(1, policy.n)):  # some micro-batch attends on the CPU
            from ..kernels.cpu_attention import native_available

            native_available()  # builds the native CPU attention kernel now (once; cached), not in the first decode step
        init = (torch.set_num_threads, (cpu_threads,)) if cpu_threads else (None, ())
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-attn", initializer=init[0], initargs=init[1])
        self.cpu_threads = cpu_threads
        if self.cuda and attention_h2d == "auto":
            attention_h2d = "kernel" if host_read_available(self.device) else "dma"
        self.attention_h2d = attention_h2d if self.cuda else "dma"
        self.phase: Optional[str] = None  # the phase running now (:meth:`_enter`)
        self.phase_hook = None  # called with each phase's name as it starts (the runner's per-phase memory peaks)
        # K and V (MLA: the latent and the rope key) of one position and layer
        self._kv_bytes_per_position = spec.kv_elems_per_token * torch.empty((), dtype=self.dtype).element_size()
        self._attn_kv_bytes = 0  # valid K and V bytes read by CPU attention in this decode (worker thread)

    # ---- setup, phases, report -----------------------------------------------------------------
    def _count_h2d(self, nbytes: int) -> None:
        self.stats.h2d_bytes += nbytes

    def close(self) -> None:
        """Release the worker thread and unregister the pinned pool."""
        self.workers.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
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

    def _prefill_pass(self):
        """The context of a prefill pass for the expert FFN's kernel choice (``KernelChoice.prefill_pass``: kernels
        with a host sync may run); a no-op for a strategy without one."""
        choice = getattr(self.expert_ffn, "choice", None)
        return choice.prefill_pass() if choice is not None else contextlib.nullcontext()

    def _count_kernel_calls(self, phase: str) -> None:
        """Move the grouped expert calls per kernel since the last count into ``stats.extra``
        (``expert_ffn_<phase>_calls_<kernel>``: which kernel the profile picked, per phase)."""
        choice = getattr(self.expert_ffn, "choice", None)
        if choice is None:
            return
        add_counts(self.stats.extra, {k: v for k, v in choice.calls.items() if v}, prefix=f"expert_ffn_{phase}_calls_")
        choice.calls = dict.fromkeys(choice.calls, 0)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- a layer visit: its pages and its expert FFN -----------------------------------------------
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

    def _prefill_chunk(self, prompts: Sequence[Sequence[int]], i: int, mb: MicroBatch, off: int,
                       rows: list[int]) -> PrefillChunk:
        """Rows ``off..`` of micro-batch ``i`` packed as one chunk: embedded tokens, positions, RoPE tables and the
        attention layout (once, for every layer), and the scatter index of its KV (:meth:`_prefill_kv_index`)."""
        lens = [len(prompts[r]) for r in rows]
        ids = torch.tensor([t for r in rows for t in prompts[r]], dtype=torch.int64)
        ends = torch.tensor(lens).cumsum(0)
        spans = [(int(e) - n, int(e)) for e, n in zip(ends, lens)]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device, non_blocking=True)
        x = self.embed[ids.to(self.device, non_blocking=True)]  # [T, D]
        rope = None if self.mla else self.family.rope_cos_sin(self.spec, pos, self.inv_freq.to(self.device), x.dtype)  # [T, hd] x2
        layout = self.family.prefill_packed_layout(spans, x.shape[0], self.device)  # for every layer
        return PrefillChunk(i, rows, self._prefill_kv_index(mb, off, spans), x, pos, spans, ends, rope, layout)

    def _prefill_kv_index(self, mb: MicroBatch, off: int, spans) -> Optional[list]:
        """The chunk's scatter index into its micro-batch's cache rows off.. (GroupedKVCache.prefill_index), on
        the device its k / v are written from (the GPU for GPU caches, the host for CPU caches); None without KV."""
        if mb.kv is None:
            return None
        src = self.device if (mb.on_gpu or not self.cuda) else torch.device("cpu")
        return mb.kv.prefill_index(range(off, off + len(spans)), spans, src)

    def _store_prefill_kv(self, l: int, mb: MicroBatch, index: list, k: torch.Tensor, v: torch.Tensor, pending: list) -> None:
        """Write a prefill chunk's k, v [T, Hkv, hd] (MLA: the latent c [T, kv_lora] and the rope key k_pe [T, rope])
        into its micro-batch's cache (one scatter per length group, by ``index`` from :meth:`_prefill_kv_index`, not a
        copy per sequence).

        GPU caches are written in place. For CPU caches on CUDA the copy is asynchronous: k/v go to pinned
        host buffers on the D2H stream and the worker thread writes them into the cache once they landed,
        so the host keeps issuing GPU work (a pageable ``.cpu()`` blocked it on every chunk and layer).
        At most two chunks are in flight (bounded pinned staging, as the planner counts).
        """
        if mb.on_gpu or not self.cuda:
            t0 = time.perf_counter()
            mb.kv.write_prefill_index(l, index, k, v)
            if not mb.on_gpu:  # the CPU cache's scatter (host seconds; a GPU cache's write is enqueued, not timed)
                self._host_stage("kv_write", t0)
            return
        (kh, vh), ready = self._to_host(k, v)

        def write():
            ready.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():  # thread-local: the caches are inference tensors
                mb.kv.write_prefill_index(l, index, kh, vh)
            self._host_stage("kv_write", t0)  # the worker's scatter into the CPU cache

        while len(pending) >= 2:
            t0 = time.perf_counter()
            pending.pop(0).result()
            self._host_stage("host_wait_kv_write", t0)  # the host thread held back by the bounded staging
        pending.append(self.workers.submit(write))

    def _host_stage(self, name: str, t0: float) -> None:
        """Host seconds since ``t0`` into stage ``name`` (and the timeline's lane while spans are kept)."""
        t1 = time.perf_counter()
        self.timer.add_host(name, t1 - t0)
        self.timer.span(name, t0, t1)

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

    def _prefill(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], score: bool = False) -> list:
        """Prefill every micro-batch layer by layer (weights streamed once per layer for the whole batch).

        Each micro-batch is computed in prefill chunks (:meth:`_prefill_chunks`: at most ``policy.prefill_mu`` rows
        and ``policy.prefill_tokens`` padded tokens), writing each chunk's KV into its micro-batch's cache rows
        (:meth:`_store_prefill_kv`); a layer's next pages are issued at once, at the start of the layer.
        Returns per micro-batch: fp32 logits of the last token of each row [mu_k, V]; with ``score``, (fp32 logprob
        [T_k], bool greedy [T_k]) of every packed row's next token instead (:func:`token_scores.token_scores`, run
        per prefill chunk, ``score_chunk_tokens`` rows at a time: no chunk's [T, V] logits exist).
        """
        chunks = [self._prefill_chunk(prompts, i, mb, off, rows)
                  for i, mb in enumerate(mbs) for off, rows in self._prefill_chunks(prompts, mb)]
        pending: list[Future] = []  # KV writes of CPU-cache chunks in flight (worker thread)
        self._warm_s = 0.0
        with self._prefill_pass():
            for l in range(self.spec.num_layers):
                visit, ffn = self._begin_visit()
                self.weight_stream.prefetch_slot(visit + 1, 0, 1)
                if self.warmup and (ffn is not None or l == self.spec.num_layers - 1):
                    self._warm_up(l, chunks, ffn)
                for ch in chunks:
                    self._prefill_layer(l, ch, mbs[ch.mb], ffn, pending)
                self.weight_stream.end_visit(visit)
        for f in pending:  # every KV row is in its cache before decode reads it
            f.result()
        self._count_kernel_calls("prefill")
        if score:
            return self._score_chunks(prompts, mbs, chunks)
        per_mb: list[list[torch.Tensor]] = [[] for _ in mbs]
        for ch in chunks:
            x = ch.x[(ch.ends - 1).to(self.device)]
            per_mb[ch.mb].append(self.family.final_logits(x, self.norm, self.lm_head, self.spec.rms_norm_eps))
        return [torch.cat(parts) for parts in per_mb]

    def _warm_up(self, l: int, chunks: list[PrefillChunk], ffn) -> None:
        """Once per executor, inside its first prefill's first MoE layer visit (the last layer if none is MoE): layer
        ``l`` over a throwaway copy of each distinct chunk shape (rows, tokens, longest row; at most
        ``WARMUP_SHAPES``), no KV written, outputs dropped, kernel-call counts restored. The kernels' one-time costs
        (Triton compilation or cache load, the attention library's plans, cuBLAS heuristics, lazy module loads) land
        in ``stats.warmup_seconds`` and ``self._warm_s`` (the callers take them out of the prefill's wall), not in
        prefill tokens/s; the run's end-to-end time keeps them."""
        self.warmup = False
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
        self._sync()
        if choice is not None:
            choice.calls = calls
        self._warm_s = time.perf_counter() - t0
        self.stats.warmup_seconds += self._warm_s

    def _score_chunks(self, prompts: Sequence[Sequence[int]], mbs: list[MicroBatch], chunks: list[PrefillChunk]) -> list:
        """The scoring head over each prefill chunk's final hidden states (in :meth:`_prefill`'s chunk order, which
        follows each micro-batch's rows); a chunk's hidden states are released once scored. Returns per micro-batch
        (fp32 logprob [T_k], bool greedy [T_k]) on the device, rows packed in ``mb.rows`` order."""
        per_mb: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in mbs]
        eps = self.spec.rms_norm_eps
        for ch in chunks:
            targets = next_token_targets([prompts[r] for r in ch.rows], self.device)  # [T_c]
            per_mb[ch.mb].append(token_scores(ch.x, self.norm, self.lm_head, eps, targets, self.score_chunk_tokens,
                                              self.family.final_logits))  # [T_c] x2
            ch.x = None  # this chunk's hidden states are no longer needed
        return [(torch.cat([lp for lp, _ in parts]), torch.cat([g for _, g in parts])) for parts in per_mb]

    # ---- decode: one micro-batch's attention ----------------------------------------------------
    def _pre_attention(self, l: int, mb: MicroBatch):
        """Norm, q/k/v, RoPE of micro-batch ``mb`` on the device: q [mu, Hq, hd], k / v [mu, Hkv, hd]. MLA: the
        absorbed query q_lat [mu, Hq, kv_lora + rope] (:meth:`_mla_query`), the latent c [mu, kv_lora] and the rope
        key k_pe [mu, rope] in their place."""
        if self.mla:
            return self._mla_query(l, mb)
        if mb.rope is None:  # once per decode step: the same positions in every layer
            mb.rope = self.family.rope_cos_sin(self.spec, mb.pos, self.inv_freq.to(self.device), mb.x.dtype)  # [mu, hd] x2
        return self.family.pre_attention(self.layers[l], mb.x, mb.pos, self.spec, self.inv_freq, mb.rope)  # [mu,Hq,hd] [mu,Hkv,hd] x2

    def _mla_query(self, l: int, mb: MicroBatch):
        """MLA pre-attention on the device, the query absorbed (q_nope W_UK per head) so the CPU worker attends over
        the latent cache: q_lat [mu, Hq, kv_lora + rope], c [mu, kv_lora], k_pe [mu, rope]."""
        lw = self.layers[l]
        q, c, k_pe = self.family.pre_attention(lw, mb.x, mb.pos, self.spec, self.inv_freq)  # [mu,Hq,hd] [mu,Dl] [mu,rd]
        return self.family.mla_absorb(lw, q, self.spec), c, k_pe

    def _gpu_attention(self, l: int, mb: MicroBatch, q, k, v) -> torch.Tensor:
        """Append k/v to the micro-batch's GPU cache and attend, one family ``decode_attention`` per length group.
        q [mu, Hq, hd], k/v [mu, Hkv, hd] on the GPU; returns [mu, Hq*hd] on the GPU. With gpu_attention="triton" one
        kernel appends and attends over every group (positions from ``mb.pos``, no host-to-device copy)."""
        sw = self.spec.layer_sliding_window(l)
        if self.gpu_attention == "triton":
            return mb.kv.append_attend_triton(l, q, k, v, mb.pos, sliding_window=sw)
        rows = torch.arange(len(mb.rows))
        mb.kv.append(l, rows, k, v)
        attend = self.family.decode_attention
        return mb.kv.attend(l, q, mb.kv.lengths + 1, lambda qg, K, V, n: attend(qg, K, V, n, sw))

    def _submit_cpu_attention(self, l: int, mb: MicroBatch, q, k, v) -> Future:
        """D2H of q/k/v (after the compute stream produced them; on the CPU they are used as they are), then the
        micro-batch's CPU attention on the worker thread (:meth:`_cpu_attention`)."""
        qkv, ready = ((q, k, v), None) if not self.cuda else self._to_host(q, k, v)
        return self.workers.submit(self._cpu_attention, l, mb, qkv, ready)

    def _cpu_attention(self, l: int, mb: MicroBatch, qkv, ready) -> torch.Tensor:
        """Worker thread: wait for q/k/v to land, append k/v to the CPU cache, attend. Returns [mu, Hq*hd] (MLA:
        q_lat, c, k_pe in, the family's torch latent attention, the attention-weighted latents [mu, Hq, kv_lora])."""
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
            if self.mla:  # the native kernel is GQA-only: torch latent attention per length group
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
        self._attn_kv_bytes += int(n.sum()) * self._kv_bytes_per_position  # worker thread only
        return out

    def _latent_attention(self, q_lat: torch.Tensor, lat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The family's latent attention of one length group (worker thread): [B_g, Hq, kv_lora]."""
        return self.family.latent_attention(q_lat, lat, lengths, self.spec)

    def _recv_attention(self, fut: Future) -> torch.Tensor:
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
            self.stats.h2d_bytes += nbytes
            add_counts(self.stats.extra, {"attention_zero_copy_bytes": nbytes})
            return dev
        with torch.cuda.stream(self.h2d_a):
            dev = attn.to(self.device, non_blocking=True)
        self.stats.h2d_bytes += nbytes
        ev = torch.cuda.Event()
        ev.record(self.h2d_a)
        self.timer.around("wait_attention", self.compute, lambda: self.compute.wait_event(ev))
        dev.record_stream(self.compute)
        return dev

    def _finish_micro_batch(self, l: int, visit: int, slots: int, k: int, mb: MicroBatch, attn, ffn) -> None:
        """Micro-batch k once its attention is enqueued (a GPU tensor) or running on the worker (a Future): a CPU
        result goes to the GPU first; then slot k of the next visit's pages is issued behind it; then k's
        post-attention (o_proj, residual, norm, router, the visit's expert FFN) is enqueued."""
        if isinstance(attn, Future):
            attn = self._recv_attention(attn)
        self.weight_stream.prefetch_slot(visit + 1, k, slots)
        if self.mla:  # the values from the attention-weighted latents (W_UV per head), on the device
            attn = self.family.mla_unabsorb(self.layers[l], attn, self.spec)  # [mu_k, Hq*v_hd]
        mb.x = self.family.post_attention(self.layers[l], None, mb.x, attn, self.spec, ffn)  # [mu_k, D]

    # ---- decode: the CGOPipe schedule -----------------------------------------------------------
    def _decode_layer(self, l: int, mbs: list[MicroBatch]) -> None:
        """One layer of one decode step over all micro-batches (the CGOPipe schedule).

        Micro-batch k's slot of layer l+1's pages is issued right after k's attention result is on its way
        to the GPU (CPU attention) or computed (GPU attention), never before: copies of one direction queue on
        the copy engine in issue order, so a slot issued earlier would hold the attention output behind
        megabytes of pages while the GPU waits for it. A CPU micro-batch is finished after the next micro-batch's
        attention is under way, so the worker and the GPU overlap. (Submitting every CPU micro-batch's attention
        before the GPU micro-batches' work gains nothing: the GPU then waits for the CPU micro-batch instead.)
        """
        visit, ffn = self._begin_visit()
        cpu_pending = None  # (k, micro-batch, Future) whose CPU attention runs on the worker
        for k, mb in enumerate(mbs):
            q, kk, v = self._pre_attention(l, mb)
            attn = (self.timer.timed("gpu_attention", self.compute, lambda: self._gpu_attention(l, mb, q, kk, v))
                    if mb.on_gpu else self._submit_cpu_attention(l, mb, q, kk, v))
            if cpu_pending is not None:  # finish the previous CPU micro-batch while this one's attention runs
                self._finish_micro_batch(l, visit, len(mbs), *cpu_pending, ffn)
                cpu_pending = None
            if mb.on_gpu:
                self._finish_micro_batch(l, visit, len(mbs), k, mb, attn, ffn)
            else:
                cpu_pending = (k, mb, attn)
        if cpu_pending is not None:
            self._finish_micro_batch(l, visit, len(mbs), *cpu_pending, ffn)
        self.weight_stream.end_visit(visit)

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
        cache = GroupedLatentKVCache if self.mla else GroupedKVCache
        for k, rows in enumerate(groups):
            on_gpu = self.cuda and k < self.policy.n_gpu_attn
            kv = None
            if with_kv:
                if on_gpu and gpu_attention_refusal(self.spec) is not None:
                    raise ValueError(f"CGOPipeExecutor: {self.family.name}: {gpu_attention_refusal(self.spec)} (policy "
                                     f"n_gpu_attn={self.policy.n_gpu_attn}; set it to 0)")
                kv = cache(self.spec, [lens[r] + extra for r in rows], self.dtype,
                           self.device if on_gpu else "cpu", max_groups=kv_groups or self.kv_groups)
                kv.lengths[:] = torch.tensor([lens[r] for r in rows])
            mbs.append(MicroBatch(rows, kv, on_gpu))
        return mbs

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, on_finish: Optional[FinishCallback] = None,
                 seeds: Optional[Sequence[int]] = None, eos_token_id: Optional[int] = None,
                 on_step: Optional[StepCallback] = None, prefixes: Optional[Sequence[Sequence[int]]] = None,
                 on_tokens: Optional[TokensCallback] = None,
                 stop_rows: Optional[StopRowsCallback] = None,
                 on_logprobs: Optional[LogprobsCallback] = None) -> list[tuple[list[int], str]]:
        """Same contract as :meth:`SerialExecutor.generate` (at most ``policy.N`` prompts per call; ``prefixes``:
        resumed sequences, prefilled with their prompt; ``on_tokens(rows, tokens)``: every token committed in a step,
        once per step after all micro-batches; ``stop_rows``: once per step, before ``on_tokens``, over the rows still
        running: those it returns finish with "stop"; ``on_logprobs``: per micro-batch as its tokens are committed,
        before their ``on_finish`` calls).

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
        rows = _Outputs(pre, params, eos, sd, self.stats, on_finish, on_tokens, stop_rows, on_logprobs)
        tokens = [rows.commit(mb, lg) for mb, lg in zip(mbs, logits)]
        del logits  # sampled: each step's logits are the only ones alive during the next (the memory model's rows)
        self._sync()
        if on_step is not None:
            on_step(len(prompts))
        t1 = time.perf_counter()
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.prefill_seconds += t1 - t0 - self._warm_s  # a warm-up (_warm_up) is not prefill time
        self.timer.span("phase", t0, t1, "prefill")
        self._prefill_done(t1 - t0 - self._warm_s)  # the prefill's stage times, apart from the decode's
        self._attn_kv_bytes = 0
        native_stats(reset=True)  # the native CPU attention kernel's own time split, for this decode only
        rows.end_step()
        self._enter("decode")
        try:
            while rows.running:
                alive = rows.running
                ts = time.perf_counter() if self.timer.spans_on else 0.0
                logits = self._decode_step(mbs, tokens)
                tokens = [rows.commit(mb, lg) for mb, lg in zip(mbs, logits)]
                del logits
                if self.timer.spans_on:
                    self.timer.span("step", ts, time.perf_counter())  # host issue of one decode step
                self.stats.decode_tokens += alive
                self.stats.decode_steps += 1
                if on_step is not None:
                    on_step(alive)
                rows.end_step()
        finally:  # a callback that stops the run still leaves this batch's decode time in the stats
            self._decode_done(t1)
        return rows.results

    def _prefill_done(self, wall: float) -> None:
        """Add a prefill's (or a scoring pass's) stage times to the stats as ``prefill_<stage>`` with its wall time
        ``prefill_wall``: the page copies and the waits for them, the KV scatter into CPU caches (``kv_write``) and
        the host thread's waits for it (``host_wait_kv_write``)."""
        stages = {f"prefill_{k}": v for k, v in self.timer.collect().items()}
        stages["prefill_wall"] = wall
        add_counts(self.stats.extra, stages)

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
        add_counts(self.stats.extra, {"cpu_attention_valid_kv_bytes": self._attn_kv_bytes})
        # inside the kernel's parallel regions (kernels.cpu_attention.native_stats): region wall time vs the worker's
        # cpu_attention_compute says how much of the stage is the wrapper / thread hand-off; busy vs team
        # thread-seconds says whether the team worked the whole region (memory-bound) or waited for cores
        add_counts(self.stats.extra, native_stats(), prefix="cpu_attention_native_")

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
