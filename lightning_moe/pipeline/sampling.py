"""The sampling contract every executor keeps: decoding parameters, how a step's logits become token ids, the finish
rules, generated tokens' log-probs, the per-request seeds, and resumed sequences' prefixes.

:class:`DecodeSampling` is the pipeline's view of a job's decoding (a projection of ``config.GenerationConfig``); the
user-facing, vLLM-compatible ``lightning_moe.api.SamplingParams`` becomes job keys and then this. :class:`DecodeRows`
holds one batch's outputs while it decodes and is the seam both executors share: :meth:`DecodeRows.commit` is the one
place a step's logits become token ids, :meth:`DecodeRows.end_step` the one place finished rows are detected.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..policy.hrm import sampler_rows
from ..kernels.fused_moe import triton_available
from ..kernels.sampling import keys_from_seeds, sample_tokens, sample_tokens_triton

if TYPE_CHECKING:  # the executor contract's types (pipeline.executor imports this module)
    from .executor import FinishCallback, LogprobsCallback, RunStats, StopRowsCallback, TokensCallback

TokenLogprobs = tuple  # (log-prob of the token chosen: float, its top-k alternatives [[id, log-prob], ...] best first,
#   or None when k = 0): one generated token's entry (token_logprobs)


@dataclass(frozen=True)
class DecodeSampling:
    """How a batch decodes, as the executors see it: what :func:`sample` and :func:`finish_reason` need (a projection
    of the job's ``config.GenerationConfig``; not the user-facing ``lightning_moe.api.SamplingParams``, whose
    ``generation()`` becomes that config)."""

    max_new_tokens: int  # generated tokens per sequence at most
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass
    stop_at_eos: bool = True  # finish a sequence when it emits EOS
    stop_token_ids: tuple[int, ...] = ()  # finish a sequence when it emits one of these (kept in its output)
    logprobs: Optional[int] = None  # None: no log-probs; k >= 0: each token's log-prob and its k best alternatives
    top_k: int = 0  # keep the k most likely tokens (<= 0: off)
    min_p: float = 0.0  # keep tokens of probability >= min_p x the most likely one's (0: off)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax."""
        return self.temperature <= 0.0

    @functools.cached_property
    def stop_ids(self) -> frozenset:
        """``stop_token_ids`` as a set: :func:`finish_reason` tests every row of every step against it (a tuple of
        1,040 ids took 6.7 us per miss on the development VM, 27 ms per step at 4,000 rows; the set 0.02 us)."""
        return frozenset(self.stop_token_ids)

    @classmethod
    def from_config(cls, gen) -> "DecodeSampling":
        """From a config.GenerationConfig (or anything with the same attribute names)."""
        return cls(gen.max_new_tokens, float(gen.temperature), float(gen.top_p), bool(gen.stop_at_eos),
                   tuple(getattr(gen, "stop_token_ids", ())), getattr(gen, "logprobs", None),
                   int(getattr(gen, "top_k", 0)), float(getattr(gen, "min_p", 0.0)))


def finish_reason(params: DecodeSampling, eos: Optional[int], token: int, n_out: int) -> Optional[str]:
    """Why a sequence that just emitted ``token`` (its output now ``n_out`` tokens) finishes: "stop" (EOS with
    stop_at_eos, or a stop token id), "length" (max_new_tokens reached), or None (it goes on)."""
    if (params.stop_at_eos and eos is not None and token == eos) or token in params.stop_ids:
        return "stop"
    return "length" if n_out >= params.max_new_tokens else None


def request_seed(seed: int, request_id: str) -> int:
    """A per-request RNG seed from the job seed and the request id (stable across runs and batchings)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{request_id}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1
_TRITON = triton_available()  # CUDA logits are sampled by the Triton kernel


def position_seed(seed: int, position: int) -> int:
    """The RNG seed of the draw at output ``position`` (0-based index among the generated tokens) of a request
    whose seed is ``seed`` (:func:`request_seed`): a splitmix64 mix of both, 63 bits. Each draw has its own seed,
    so a sequence resumed at any position draws the same tokens as an uninterrupted one."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: DecodeSampling, seeds: Optional[Sequence[int]] = None,
           positions: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Next token per row. logits: [B, V] (any float dtype, any device). Returns int64 [B] on the CPU.

    Greedy: argmax (lowest id on ties). Otherwise :func:`kernels.sampling.sample_tokens` on the logits' device:
    temperature, min-p, top-k, top-p (vLLM's order), then an exponential race per row keyed by
    ``position_seed(seeds[b], positions[b])`` (the request's seed and the output position of the token drawn), so a
    request samples the same tokens whatever batch it lands in and wherever a run resumed it, and fp32-level logit
    differences (a resumed prefill against decode steps) almost never change a token. Only B int64 keys go to the
    device and B token ids come back. Without ``seeds`` the keys come from torch's global generator. On CUDA with
    triton: :func:`kernels.sampling.sample_tokens_triton` (one launch over every row); elsewhere the torch path in
    row chunks of ``policy.hrm.sampler_rows(V)`` (the temporaries the memory model counts).
    """
    if params.greedy:
        return sample_tokens(logits, 0.0).cpu()
    if seeds is not None:
        keys = keys_from_seeds([position_seed(s, p) for s, p in zip(seeds, positions)])
    else:
        keys = torch.randint(0, (1 << 63) - 1, (logits.shape[0],), dtype=torch.int64)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64)
    if logits.is_cuda and _TRITON:  # one launch, no [B, V] temporaries, one copy of B ids to the host
        return sample_tokens_triton(logits, params.temperature, params.top_p, params.top_k, params.min_p,
                                    keys.to(logits.device, non_blocking=True)).cpu()
    step = sampler_rows(logits.shape[1])  # rows per call: the temporaries the memory model counts (policy.hrm)
    return torch.cat([sample_tokens(logits[i:i + step], params.temperature, params.top_p, params.top_k, params.min_p,
                                    keys[i:i + step]).cpu() for i in range(0, logits.shape[0], step)])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list:
    """Per row, the :data:`TokenLogprobs` of ``tokens`` [B] under ``logits`` [B, V]: the fp32 log-softmax of the raw
    logits (before temperature and top-p, as vLLM's default ``raw_logprobs``), the chosen token's value and, with
    ``k >= 1``, the k largest ``[id, log-prob]`` pairs, best first. Computed on the logits' device; only B + 2Bk numbers
    cross to the host. Called only when log-probs are asked for."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = lp.gather(-1, tokens.to(lp.device, torch.int64).view(-1, 1)).view(-1).cpu().tolist()
    if not k:
        return [(c, None) for c in chosen]
    vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [B, k] each
    return [(c, [[i, v] for i, v in zip(ii, vv)]) for c, ii, vv in zip(chosen, ids.cpu().tolist(), vals.cpu().tolist())]


def check_prefixes(prompts: Sequence[Sequence[int]], prefixes: Optional[Sequence[Sequence[int]]],
                   params: DecodeSampling) -> list[list[int]]:
    """The already generated tokens of each prompt (``prefixes``, default none), checked: one list per prompt,
    each shorter than ``params.max_new_tokens``. Raises ValueError otherwise."""
    if prefixes is None:
        return [[] for _ in prompts]
    if len(prefixes) != len(prompts):
        raise ValueError(f"prefixes: {len(prefixes)} lists for {len(prompts)} prompts")
    out = [list(p) for p in prefixes]
    for i, p in enumerate(out):
        if len(p) >= params.max_new_tokens:
            raise ValueError(f"prefixes[{i}]: {len(p)} tokens leave nothing to generate "
                             f"(max_new_tokens {params.max_new_tokens})")
    return out


class DecodeRows:
    """One batch's generation state: every row's output so far (starting with its prefix), the finished rows'
    ``(output, reason)``, and the tokens committed in the running step.

    A step is any number of :meth:`commit` calls (one per micro-batch, each row in at most one), then one
    :meth:`end_step`. Callbacks, in order: ``on_logprobs`` as a commit's tokens are chosen (rows still running only);
    at the step's end ``on_finish`` for each row that finished (EOS, a stop token id, max_new_tokens, in commit
    order; then stop strings, by row), then ``on_tokens`` with every token committed in the step.
    """

    def __init__(self, outputs: list[list[int]], params: DecodeSampling, eos: Optional[int],
                 seeds: Optional[Sequence[int]], stats: "RunStats", on_finish: Optional["FinishCallback"] = None,
                 on_tokens: Optional["TokensCallback"] = None, stop_rows: Optional["StopRowsCallback"] = None,
                 on_logprobs: Optional["LogprobsCallback"] = None):
        self.outputs, self.params, self.eos, self.stats = outputs, params, eos, stats
        self.seeds = list(seeds) if (seeds is not None and not params.greedy) else None  # greedy draws need none
        self.on_finish, self.on_tokens, self.stop_rows = on_finish, on_tokens, stop_rows
        self.on_logprobs = on_logprobs if params.logprobs is not None else None  # nothing computed unless asked
        self.results: list[Optional[tuple[list[int], str]]] = [None] * len(outputs)
        self.step_rows: list[int] = []  # rows given a token in this step, in commit order (for on_tokens)
        self.step_toks: list[int] = []  # their tokens

    @property
    def running(self) -> int:
        """Rows not finished."""
        return sum(r is None for r in self.results)

    def alive(self) -> list[int]:
        """The rows not finished, ascending."""
        return [r for r, res in enumerate(self.results) if res is None]

    def commit(self, rows: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The one place a step's logits become token ids: sample ``rows``' next tokens from ``logits`` [len(rows), V]
        and append them to the outputs of the rows still running. Returns the tokens (int64 [len(rows)], on the CPU,
        every row: a finished row keeps its slot and its token is discarded)."""
        outputs, sd = self.outputs, self.seeds
        toks = sample(logits, self.params, [sd[r] for r in rows] if sd else None,
                      [len(outputs[r]) for r in rows] if sd else None)
        live = [j for j, r in enumerate(rows) if self.results[r] is None]
        if self.on_logprobs is not None and live:  # the running rows' entries, before any of them finishes
            ent = token_logprobs(logits[live] if len(live) < len(rows) else logits, toks[live], self.params.logprobs)
            self.on_logprobs([rows[j] for j in live], ent)
        tl = toks.tolist()
        for j in live:
            outputs[rows[j]].append(tl[j])
            self.step_rows.append(rows[j])
            self.step_toks.append(tl[j])
        self.stats.generated_tokens += len(live)
        return toks

    def end_step(self) -> list[int]:
        """The one place finished rows are detected: after a step's commits, each row given a token finishes by
        :func:`finish_reason`, then the rows still running whose text holds a stop string (``stop_rows``) finish with
        "stop"; then ``on_tokens``. Returns the rows that finished in this step."""
        done = []
        for r in self.step_rows:
            reason = finish_reason(self.params, self.eos, self.outputs[r][-1], len(self.outputs[r]))
            if reason is not None:
                self._finish(r, reason)
                done.append(r)
        if self.stop_rows is not None:
            live = {r: self.outputs[r] for r in self.step_rows if self.results[r] is None}
            for r in sorted(r for r in (self.stop_rows(live) if live else ()) if r in live):
                self._finish(r, "stop")
                done.append(r)
        if self.on_tokens is not None:
            self.on_tokens(list(self.step_rows), list(self.step_toks))
        self.step_rows.clear()
        self.step_toks.clear()
        return done

    def _finish(self, r: int, reason: str) -> None:
        self.results[r] = (self.outputs[r], reason)
        if self.on_finish is not None:
            self.on_finish(r, self.outputs[r], reason)
