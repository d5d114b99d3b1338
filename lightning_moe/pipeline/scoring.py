"""Dataset scoring on the prefill path: loglikelihood, multiple choice, perplexity (no decode).

Every mode reduces to "log-probability of tokens seq[first:] given seq[:first]" computed by an executor's
``prompt_logprobs`` (packed ragged prefill). Definitions follow lm-evaluation-harness (Gao et al. 2021):
``loglikelihood`` sums the continuation's token log-probs and reports whether every continuation token
is the argmax (``is_greedy``); ``multiple_choice`` picks the choice with the largest summed log-prob
(``acc``) and, length-normalized, the largest log-prob per UTF-8 byte of the choice text (``acc_norm``);
``perplexity`` is ``exp(-mean log p)`` over every token after the first, with a rolling window of the
model context and ``stride`` new tokens per window for texts longer than the context (the Hugging Face
"perplexity of fixed-length models" procedure).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

ScoreFn = Callable[[Sequence[Sequence[int]]], list[tuple[torch.Tensor, torch.Tensor]]]


def windows(n_tokens: int, max_len: int, stride: Optional[int]) -> list[tuple[int, int, int]]:
    """Rolling windows for perplexity: [(begin, end, first_scored)] over token indices 0..n_tokens-1.

    Each window feeds ids[begin:end] (end - begin <= max_len) and scores tokens first_scored..end-1
    (token 0 of the text is never scored; every other token is scored exactly once, with as much left
    context as the window allows). ``stride=None`` means one window, which must fit.
    Raises ValueError when stride is None and the text is longer than max_len, or stride < 1.
    """
    if stride is None:
        if n_tokens > max_len:
            raise ValueError(f"{n_tokens} tokens exceed the context of {max_len}; set score.stride")
        return [(0, n_tokens, 1)]
    if stride < 1 or stride >= max_len:  # a window must overlap the previous one by >= 1 token of context
        raise ValueError(f"score.stride must be in 1..{max_len - 1} (the context minus one), got {stride}")
    out, prev_end = [], 1
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_len, n_tokens)
        if end > prev_end:
            out.append((begin, end, max(prev_end, begin + 1)))
            prev_end = end
        if end == n_tokens:
            break
    return out


def sequence_lengths(tr, mode: str, max_len: int, stride: Optional[int]) -> list[int]:
    """Token lengths of the sequences :func:`score_batch` feeds for one tokenized request: each perplexity window,
    or each (context + continuation / choice) sequence."""
    if mode == "perplexity":
        return [e - b for b, e, _ in windows(len(tr.text_ids), max_len, stride)]
    return [len(seq) for seq, _ in tr.score_inputs]


def score_batch(treqs: Sequence, mode: str, score_fn: ScoreFn, max_len: int, stride: Optional[int]) -> list[dict]:
    """Score a batch of tokenized requests (``TokenizedRequest`` without errors) with one packed prefill.

    Args:
        treqs: requests whose ``score_inputs`` give (sequence ids, first scored index).
        mode: "loglikelihood" | "multiple_choice" | "perplexity".
        score_fn: the executor's ``prompt_logprobs``.
        max_len: model context in tokens (perplexity windows).
        stride: perplexity window stride in tokens (None = one window).
    Returns:
        one result record (dict) per request, in order.
    """
    seqs: list[list[int]] = []
    plan: list[list[tuple[int, int, int]]] = []  # per request: (seq index, offset of first scored logprob, count)
    for tr in treqs:
        items = []
        if mode == "perplexity":
            ids = list(tr.text_ids)
            for b, e, f in windows(len(ids), max_len, stride):
                items.append((len(seqs), f - b - 1, e - f))
                seqs.append(ids[b:e])
        else:
            for seq, first in tr.score_inputs:
                items.append((len(seqs), first - 1, len(seq) - first))
                seqs.append(list(seq))
        plan.append(items)
    scored = score_fn(seqs) if seqs else []

    def part(item):
        si, off, n = item
        lp, gr = scored[si]
        return lp[off : off + n].double(), gr[off : off + n]

    out = []
    for tr, items in zip(treqs, plan):
        rec: dict = {"id": tr.id, "prompt_tokens": tr.prompt_tokens}
        if tr.truncated:
            rec["truncated_tokens"] = tr.truncated
        if mode == "loglikelihood":
            lp, gr = part(items[0])
            rec.update(continuation_tokens=int(lp.numel()), logprob=float(lp.sum()),
                       logprob_mean=float(lp.mean()) if lp.numel() else 0.0, is_greedy=bool(gr.all()))
        elif mode == "multiple_choice":
            sums = [float(part(it)[0].sum()) for it in items]
            nbytes = [max(1, len(c.encode("utf-8"))) for c in tr.request.choices]
            norm = [s / b for s, b in zip(sums, nbytes)]
            pick, pick_norm = max(range(len(sums)), key=sums.__getitem__), max(range(len(norm)), key=norm.__getitem__)
            rec.update(choice_logprobs=sums, choice_logprobs_per_byte=norm, pick=pick, pick_norm=pick_norm)
            if tr.request.answer is not None:
                rec.update(answer=tr.request.answer, correct=pick == tr.request.answer,
                           correct_norm=pick_norm == tr.request.answer)
        elif mode == "perplexity":
            parts = [part(it)[0] for it in items]
            lp = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
            nll = -float(lp.sum())
            rec.update(tokens=len(tr.text_ids), scored_tokens=int(lp.numel()), nll=nll, windows=len(items),
                       perplexity=math.exp(nll / lp.numel()) if lp.numel() else float("nan"))
        else:  # pragma: no cover - config validation forbids it
            raise ValueError(f"unknown score mode {mode!r}")
        out.append(rec)
    return out


def summarize(records: Sequence[dict], mode: str) -> dict:
    """Aggregate metrics for the run report: accuracy (multiple choice), corpus perplexity, mean logprob."""
    ok = [r for r in records if "error" not in r]
    if mode == "multiple_choice":
        graded = [r for r in ok if "correct" in r]
        if not graded:
            return {"scored": len(ok)}
        return {"scored": len(ok), "graded": len(graded), "accuracy": sum(r["correct"] for r in graded) / len(graded),
                "accuracy_norm": sum(r["correct_norm"] for r in graded) / len(graded)}
    if mode == "perplexity":
        n = sum(r["scored_tokens"] for r in ok)
        return {"scored": len(ok), "tokens": n, "perplexity": math.exp(sum(r["nll"] for r in ok) / n) if n else None}
    if mode == "loglikelihood":
        return {"scored": len(ok), "mean_logprob": sum(r["logprob"] for r in ok) / len(ok) if ok else None,
                "greedy_fraction": sum(r["is_greedy"] for r in ok) / len(ok) if ok else None}
    return {}
