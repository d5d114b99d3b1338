"""The reference executor: the model math with no overlap, already shaped like offloading.

Expert weights stay in host memory and are copied to the compute device layer by layer (every
prefill and every decode step; a dense layer has none), non-expert weights (shared experts and dense layers' MLPs
among them) live on the device, the KV cache lives in CPU
memory and decode attention runs on the CPU. Batched and ragged: prompts of different lengths are
packed token-wise (no padding) for prefill, every row carries its own positions, and each decode step
masks every row's keys beyond its own length. Runs on ``cpu`` and ``cuda``; CI exercises it on CPU, and
the pipelined executor (cgopipe.py) must produce exactly its tokens. It keeps the executor contract
(:mod:`.executor`); a batch's outputs, sampling and finish rules are :class:`.sampling.DecodeRows`'s, as in CGOPipe.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Sequence

import torch

from ..model.families import family_of
from ..model.layers import ExpertWeights
from ..model.quantized import QuantExperts
from ..model.weights import ModelWeights
from .cpu_attention import bucket_len, cpu_decode_attention, cpu_latent_attention
from .executor import Executor, RunStats, StepCallback
from .kv_cache import KVCache, LatentKVCache, make_kv_cache
from .refill import SlotTable
from .sampling import DecodeRows
from .token_scores import SCORE_CHUNK_TOKENS, next_token_targets, split_scores, token_scores

class SerialExecutor(Executor):
    """Reference executor over :class:`ModelWeights` on ``device`` (no overlap, same math as CGOPipe).

    Args:
        weights: host weights (experts stacked per layer).
        device: "cpu" or "cuda[:i]"; non-expert weights are copied there once, experts every layer visit.
        dtype: compute dtype (default: the weights' dtype).
        score_chunk_tokens: rows per chunk of the scoring head in :meth:`prompt_logprobs` (default
            SCORE_CHUNK_TOKENS; its fp32 logits + log_softmax take ``score_chunk_tokens * V * 8`` bytes).
        slots: the most sequences a generate call decodes at once (None: all its prompts); more prompts wait for a
            freed slot (continuous refill, :mod:`.refill`).
    """

    def __init__(self, weights: ModelWeights, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
                 score_chunk_tokens: int = SCORE_CHUNK_TOKENS, slots: Optional[int] = None):
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise ValueError(f"SerialExecutor: slots must be None or an int >= 1, got {slots!r}")
        self.slots = slots  # sequences decoding at once (None: every prompt of a generate call)
        self.refills = slots is not None  # whether a caller may pass more prompts than it should decode at once
        if isinstance(score_chunk_tokens, bool) or not isinstance(score_chunk_tokens, int) or score_chunk_tokens < 1:
            raise ValueError(f"SerialExecutor: score_chunk_tokens must be an int >= 1, got {score_chunk_tokens!r}")
        self.score_chunk_tokens = score_chunk_tokens
        self.w = weights
        self.spec = weights.spec
        self.family = fam = family_of(self.spec)  # the model family's layer math (model/families/)
        self.experts_ffn = fam.experts_ffn  # the routed expert FFN post_attention calls (expert parallelism sets its own)
        ffn_from = fam.experts_ffn_from  # over packed pages, expert by expert (:meth:`_experts_and_ffn`)
        if self.spec.swiglu_limit > 0:  # the clamped SwiGLU's numbers (gpt-oss)
            ffn_from = functools.partial(ffn_from, limit=self.spec.swiglu_limit, alpha=self.spec.swiglu_alpha)
        self._ffn_from = ffn_from
        if fam.attention not in ("gqa", "gqa_sinks", "mla"):
            raise ValueError(f"SerialExecutor: {fam.name}: attention {fam.attention!r} is not implemented "
                             f"(gqa, gqa_sinks, mla)")
        self.mla = fam.attention == "mla"
        self.sinks = fam.attention == "gqa_sinks"  # the family's attention functions take the layer's weights
        self.device = torch.device(device)
        self.dtype = dtype or weights.dtype
        self.on_host = self.device.type == "cpu"
        dev, dt = self.device, self.dtype
        self.layers = [lw.to(dev, dt) for lw in weights.layers]
        self.embed = weights.embed.to(dev, dt)
        self.norm = weights.norm.to(dev, dt)
        self.lm_head = weights.lm_head.to(dev, dt)
        self.inv_freq = fam.rope_inv_freq(self.spec, dev)
        self.stats = RunStats()
        self.phase: Optional[str] = None  # the phase running now ("prefill", "decode", "scoring")
        self.phase_hook = None  # called with each phase's name as it starts (the runner's per-phase memory peaks)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if self.phase_hook is not None:
            self.phase_hook(phase)

    # ---- helpers ----------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _experts_and_ffn(self, layer: int) -> tuple[Optional[ExpertWeights | QuantExperts], Callable]:
        """Layer ``layer``'s experts on the compute device (a host->device copy unless on CPU) and the expert FFN
        its ``post_attention`` calls over them; experts None for a dense layer (``spec.dense_layers``: its MLP is
        resident with its other weights, nothing is copied).

        Packed pages (:class:`QuantExperts`: int4 or MXFP4) are copied as they are; the FFN is the family's
        ``experts_ffn_from`` over them, each expert the tokens route to dequantized on the device as the loop
        reaches it (:meth:`QuantExperts.expert`: the values of a whole-layer dequantization, bit for bit), so a
        step never dequantizes the experts no token chose.
        """
        if self.spec.is_dense_layer(layer):
            return None, self.experts_ffn
        ew = self.w.experts[layer]
        if isinstance(ew, QuantExperts):
            if not self.on_host:
                self.stats.h2d_bytes += ew.nbytes
                ew = ew.to(self.device)
            dt, ffn_from = self.dtype, self._ffn_from
            return ew, lambda h, pages, w, ids: ffn_from(h, lambda e: pages.expert(e, dt), pages.num_experts, w, ids)
        if ew.w1.dtype != self.dtype:
            ew = ew.cast(self.dtype)
        if self.on_host:
            return ew, self.experts_ffn
        self.stats.h2d_bytes += ew.nbytes
        return ew.to(self.device, non_blocking=False), self.experts_ffn

    def _prefill_layer(self, layer: int, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]],
                       kv: Optional[KVCache | LatentKVCache], kv_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """One decoder layer over a packed ragged batch. x: [T, D]; spans: (start, end) per sequence, its KV into row
        ``kv_rows[j]`` of ``kv`` (default row j)."""
        lw, fam = self.layers[layer], self.family
        q, k, v = fam.pre_attention(lw, x, positions, self.spec, self.inv_freq)  # [T,Hq,hd], [T,Hkv,hd] x2
        #   (MLA: q [T, Hq, hd], the latent c [T, kv_lora] and the rope key k_pe [T, rope] as k and v)
        window = self.spec.layer_sliding_window(layer)
        if self.mla:
            attn = fam.prefill_attention_packed(lw, q, k, v, spans, self.spec)  # [T, Hq*v_hd]
        elif self.sinks:
            attn = fam.prefill_attention_packed(lw, q, k, v, spans, window)  # [T, Hq*hd] (the layer's sinks)
        else:
            attn = fam.prefill_attention_packed(q, k, v, spans, window)  # [T, Hq*hd], one fused call
        if kv is not None:
            for j, (s, e) in enumerate(spans):
                kv.write_prefill(layer, j if kv_rows is None else kv_rows[j], k[s:e], v[s:e])
        ew, ffn = self._experts_and_ffn(layer)
        return fam.post_attention(lw, ew, x, attn, self.spec, ffn)

    def _forward_prefill(self, prompts: Sequence[Sequence[int]], kv: Optional[KVCache | LatentKVCache],
                         kv_rows: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill a ragged batch (prompt j's KV into row ``kv_rows[j]`` of ``kv``, default row j); returns the final
        hidden states [T, D] (before the final norm) and the packed end of each prompt (int64 [B], on the host)."""
        lens = [len(p) for p in prompts]
        if min(lens) < 1:
            raise ValueError("prefill: every prompt needs at least one token")
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)  # [T]
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)  # [T]
        ends = torch.tensor(lens).cumsum(0)
        spans = [(int(e) - n, int(e)) for e, n in zip(ends, lens)]
        x = self.embed[ids]  # [T, D]
        for layer in range(self.spec.num_layers):
            x = self._prefill_layer(layer, x, positions, spans, kv, kv_rows)
        return x, ends

    def _decode_step(self, tokens: torch.Tensor, rows: torch.Tensor, kv: KVCache, all_rows: bool) -> torch.Tensor:
        """One decode step for ``rows`` (int64 [B']) fed ``tokens`` (int64 [B']). Returns fp32 logits [B', V]."""
        positions = kv.lengths[rows]  # [B'] position of the new token = current length
        new_len = positions + 1  # [B']
        upto = bucket_len(int(new_len.max()), kv.max_len)
        x = self.embed[tokens.to(self.device)]  # [B', D]
        pos_dev = positions.to(self.device)
        fam = self.family
        for layer in range(self.spec.num_layers):
            lw = self.layers[layer]
            if self.mla:
                x = self._decode_layer_mla(layer, x, pos_dev, rows, kv, all_rows, upto, new_len)
                continue
            q, k, v = fam.pre_attention(lw, x, pos_dev, self.spec, self.inv_freq)  # [B',Hq,hd], [B',Hkv,hd]
            q, k, v = q.cpu(), k.cpu(), v.cpu()  # D2H: attention runs on the CPU cache
            if not self.on_host:
                self.stats.d2h_bytes += (q.numel() + k.numel() + v.numel()) * q.element_size()
            kv.append(layer, rows, k, v)
            K, V = kv.view(layer, None if all_rows else rows, upto)  # [B', Hkv, upto, hd]
            window = self.spec.layer_sliding_window(layer)
            if self.sinks:  # the family's torch attention over the CPU cache, with the layer's sinks
                attn = fam.decode_attention(lw, q, K, V, new_len, window)  # [B', Hq*hd]
            else:
                attn = cpu_decode_attention(q, K, V, new_len, window)  # [B', Hq*hd]
            if not self.on_host:
                self.stats.h2d_bytes += attn.numel() * attn.element_size()
            ew, ffn = self._experts_and_ffn(layer)
            x = fam.post_attention(lw, ew, x, attn.to(self.device), self.spec, ffn)  # [B', D]
        kv.lengths[rows] += 1
        return fam.final_logits(x, self.norm, self.lm_head, self.spec.rms_norm_eps)

    def _decode_layer_mla(self, layer: int, x: torch.Tensor, pos_dev: torch.Tensor, rows: torch.Tensor,
                          kv: LatentKVCache, all_rows: bool, upto: int, new_len: torch.Tensor) -> torch.Tensor:
        """One MLA decode layer: the absorbed query on the compute device, attention over the CPU latent cache (the
        native kernel when available, else the family's torch ``latent_attention``), the values (W_UV) back on the
        device. x: [B', D] -> [B', D]."""
        lw, fam, spec = self.layers[layer], self.family, self.spec
        q, c, k_pe = fam.pre_attention(lw, x, pos_dev, spec, self.inv_freq)  # [B', Hq, hd], [B', Dl], [B', rope]
        q_lat = fam.mla_absorb(lw, q, spec)  # [B', Hq, Dl + rope]
        q_lat, c, k_pe = q_lat.cpu(), c.cpu(), k_pe.cpu()  # D2H: attention runs on the CPU cache
        if not self.on_host:
            self.stats.d2h_bytes += (q_lat.numel() + c.numel() + k_pe.numel()) * q_lat.element_size()
        kv.append(layer, rows, c, k_pe)
        lat = kv.view(layer, None if all_rows else rows, upto)  # [B', upto, Dl + rope]
        o_lat = cpu_latent_attention(q_lat, lat, new_len, spec.kv_lora_rank, spec.softmax_scale,
                                     lambda qg, x, n: fam.latent_attention(qg, x, n, spec))  # [B', Hq, Dl]
        if not self.on_host:
            self.stats.h2d_bytes += o_lat.numel() * o_lat.element_size()
        attn = fam.mla_unabsorb(lw, o_lat.to(self.device), spec)  # [B', Hq*v_hd]
        ew, ffn = self._experts_and_ffn(layer)
        return fam.post_attention(lw, ew, x, attn, spec, ffn)  # [B', D]

    # ---- public API: generate (:meth:`.executor.Executor.generate`) runs _decode ------------------
    def _decode(self, seqs: list[list[int]], caps: list[int], rows: DecodeRows,
                on_step: Optional[StepCallback]) -> list[tuple[list[int], str]]:
        """The serial loop of :meth:`.executor.Executor.generate` (its contract: arguments, callbacks and their order,
        the result).

        At most ``slots`` sequences decode at once (all of them when ``slots`` is None); the others wait in the
        caller's order and take a slot as soon as one is freed (:mod:`.refill`; the serial executor refills at every
        freed slot, before the next decode step). A prefill packs the prompts it fills (with their prefixes)
        token-wise; each decode step then runs the rows still running, one token each, and
        :class:`.sampling.DecodeRows` turns the step's logits into tokens and finishes rows.
        """
        table = SlotTable(caps, self.slots or len(seqs), 1)
        kv = make_kv_cache(self.spec, len(table.caps), max(table.caps), self.dtype, "cpu")  # MLA: the latent cache
        self._refill(seqs, table, rows, kv, on_step)
        t2 = time.perf_counter()
        try:
            while table.live or table.waiting:
                if table.due():
                    self.stats.decode_seconds += time.perf_counter() - t2
                    self._refill(seqs, table, rows, kv, on_step)
                    t2 = time.perf_counter()
                    continue
                live = sorted((r, s) for s, r in enumerate(table.req) if r >= 0)  # in request order, as without refill
                reqs, slots = [r for r, _ in live], [s for _, s in live]
                toks = torch.tensor([rows.outputs[r][-1] for r in reqs], dtype=torch.int64)
                logits = self._decode_step(toks, torch.tensor(slots, dtype=torch.int64), kv,
                                           all_rows=slots == list(range(len(table.caps))))  # KV rows in order
                rows.commit(reqs, logits)
                self.stats.decode_tokens += len(slots)
                self.stats.decode_steps += 1
                self.stats.slot_steps += len(table.caps)
                if on_step is not None:
                    on_step(len(slots))
                table.release(rows.end_step())
            self._sync()
        finally:  # a callback that stops the run still leaves this batch's decode time in the stats
            self.stats.decode_seconds += time.perf_counter() - t2
        return rows.results  # type: ignore[return-value]

    def _refill(self, seqs: list[list[int]], table: SlotTable, rows: DecodeRows, kv, on_step) -> None:
        """Prefill waiting requests into free slots (:meth:`SlotTable.assign`; slot s is KV row s), their first tokens
        committed (``on_step``, then :meth:`DecodeRows.end_step`); the finished requests' slots freed."""
        self._enter("prefill")
        t0 = time.perf_counter()
        pairs = table.assign()
        slots, reqs = [s for s, _ in pairs], [r for _, r in pairs]
        rows.commit(reqs, self._prefill_logits([seqs[r] for r in reqs], kv, slots))  # [B', V] -> the first tokens
        self._sync()
        self.stats.prefill_tokens += sum(len(seqs[r]) for r in reqs)
        self.stats.prefill_seconds += time.perf_counter() - t0
        if on_step is not None:
            on_step(len(reqs))
        table.release(rows.end_step())
        self._enter("decode")

    def _prefill_logits(self, prompts: Sequence[Sequence[int]], kv: KVCache | LatentKVCache,
                        kv_rows: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompts`` into rows ``kv_rows`` of ``kv`` (their lengths set to the prompts'); fp32 logits [B, V]
        of each last token."""
        x, ends = self._forward_prefill(prompts, kv, kv_rows)  # [T, D]
        kv.lengths[list(kv_rows)] = torch.tensor([len(p) for p in prompts])
        return self.family.final_logits(x[(ends - 1).to(self.device)], self.norm, self.lm_head, self.spec.rms_norm_eps)

    @torch.inference_mode()
    def prompt_logprobs(self, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Log-probabilities of every token given its prefix, by prefill alone (no KV cache, no decode).

        seqs: B lists of token ids (each >= 2 tokens to score anything).
        Returns B pairs of CPU tensors of length len-1: ``logp[t] = log p(seq[t+1] | seq[:t+1])`` (fp32)
        and ``greedy[t]`` (bool) = seq[t+1] is the argmax of that distribution. The scoring head runs
        ``score_chunk_tokens`` packed rows at a time (:func:`token_scores.token_scores`): no [T, V] logits.
        """
        self._enter("scoring")
        t0 = time.perf_counter()
        x, _ = self._forward_prefill(seqs, None)  # [T, D]
        targets = next_token_targets(seqs, self.device)  # [T]
        logp, greedy = token_scores(x, self.norm, self.lm_head, self.spec.rms_norm_eps, targets,
                                    self.score_chunk_tokens, self.family.final_logits)  # [T] each: no [T, V] logits
        out = split_scores(logp, greedy, [len(s) for s in seqs])
        self._sync()
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        self.stats.prefill_seconds += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def logits(self, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """fp32 logits [len, V] of every position of each sequence (prefill only; for tests and scoring)."""
        x, _ = self._forward_prefill(seqs, None)  # [T, D]
        logits = self.family.final_logits(x, self.norm, self.lm_head, self.spec.rms_norm_eps)  # [T, V]
        out, start = [], 0
        for s in seqs:
            out.append(logits[start : start + len(s)].cpu())
            start += len(s)
        return out

