"""Scoring head of packed sequences: the log-probability of each next token, chunk by chunk of rows.

Scoring (pipeline/scoring.py) needs, for every token of a packed prefill, log p(next token) and whether the
next token is the argmax. The head (final RMSNorm, lm_head, log_softmax) runs over ``chunk_tokens`` rows at a
time and keeps two numbers per row, so no ``[T, V]`` tensor of the whole (micro-)batch exists: the extra memory
is one chunk's fp32 logits and log_softmax output, ``chunk_tokens * V * 4 * 2`` bytes, whatever T is
(``SCORE_CHUNK_TOKENS`` is the default the planner counts).

Dimension key: T tokens in a packed batch, D hidden size, V vocabulary, c rows of one chunk.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..model.layers import final_logits as _final_logits
from ..policy.batching import SCORE_CHUNK_TOKENS

__all__ = ["SCORE_CHUNK_TOKENS", "next_token_targets", "token_scores", "split_scores"]


def next_token_targets(seqs: Sequence[Sequence[int]], device: str | torch.device = "cpu") -> torch.Tensor:
    """Target of every packed row: int64 [T], ``seq[i + 1]`` at row i of a sequence and -1 at its last token."""
    tgt = [t for s in seqs for t in (*s[1:], -1)]
    return torch.tensor(tgt, dtype=torch.int64).to(device, non_blocking=True)  # [T]


def token_scores(x: torch.Tensor, norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float, targets: torch.Tensor,
                 chunk_tokens: int = SCORE_CHUNK_TOKENS, final_logits: Callable = _final_logits,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each row's target and whether it is the argmax, ``chunk_tokens`` rows at a time.

    x: [T, D] final hidden states (packed sequences, model dtype); norm_w: [D]; lm_head: [V, D]; targets: int64
    [T] on x's device, < 0 for rows without a target (the last token of each sequence); ``final_logits``: the model
    family's head (``Family.final_logits``; default the shared RMSNorm + lm_head of model/layers.py).
    Per chunk of c <= chunk_tokens rows: ``final_logits`` (RMSNorm, lm_head GEMM in the model dtype, then fp32),
    fp32 log_softmax, gather of the target, argmax of the log-probabilities (lowest id on ties) compared with
    the target; rows are independent, so the values equal the full ``[T, V]`` computation's.
    Peak extra memory: one chunk's fp32 logits [c, V] and log_softmax output [c, V] (``chunk_tokens * V * 8``
    bytes; the model-dtype GEMM output is freed inside ``final_logits`` before log_softmax), plus O(T) outputs.
    Returns (fp32 logprob [T], bool greedy [T]) on x's device; entries of rows without a target are arbitrary.
    """
    if chunk_tokens < 1:
        raise ValueError(f"token_scores: chunk_tokens must be >= 1, got {chunk_tokens}")
    T = x.shape[0]
    logp = torch.empty(T, dtype=torch.float32, device=x.device)  # [T]
    greedy = torch.empty(T, dtype=torch.bool, device=x.device)  # [T]
    tgt = targets.clamp(min=0)  # [T]: rows without a target gather token 0 (their entries are arbitrary)
    for s in range(0, T, chunk_tokens):
        e = min(s + chunk_tokens, T)
        lp = torch.log_softmax(final_logits(x[s:e], norm_w, lm_head, eps), dim=-1)  # [c, V] fp32
        t = tgt[s:e]  # [c]
        logp[s:e] = lp.gather(1, t[:, None])[:, 0]
        greedy[s:e] = lp.argmax(dim=-1) == t
        del lp  # freed before the next chunk's logits exist
    return logp, greedy


def split_scores(logp: torch.Tensor, greedy: torch.Tensor, lens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence of length n (packed in order), its n-1 scored rows of (logp, greedy) [T] as CPU tensors
    (fp32 [n-1], bool [n-1]); the row of each sequence's last token (no target) is dropped."""
    logp, greedy = logp.cpu(), greedy.cpu()  # one copy of 5 bytes per token, not one per sequence
    out, start = [], 0
    for n in lens:
        out.append((logp[start : start + n - 1], greedy[start : start + n - 1]))
        start += n
    return out
