"""Scoring head of packed sequences: the log-probability of each next token, chunk by chunk of rows.

Scoring (pipeline/scoring.py) needs, for every token of a packed prefill, log p(next token) and whether the
next token is the argmax. The head (final RMSNorm, lm_head, log_softmax) runs over ``chunk_tokens`` rows at a
time and keeps two numbers per row, so no ``[T, V]`` tensor of the whole (micro-)batch exists: the extra memory
is at most one chunk's fp32 logits and log_softmax output, ``chunk_tokens * V * 4 * 2`` bytes, whatever T is
(``SCORE_CHUNK_TOKENS`` is the default the planner counts).

Two paths, the same numbers: on CUDA with triton, when the family's head is a model-dtype GEMM cast to fp32 and
nothing more (``layers.model_dtype_head``) and the kernel takes the operands, one Triton launch per chunk
(``kernels.score_head``) reads the GEMM's model-dtype logits once and writes the two numbers (no fp32 copy, no
log_softmax output: one chunk's model-dtype logits, ``chunk_tokens * V * b`` bytes); else the torch path (fp32 logits,
log_softmax, gather, argmax).

Dimension key: T tokens in a packed batch, D hidden size, V vocabulary, c rows of one chunk.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..kernels import score_head as _sh
from ..model.layers import final_logits as _final_logits
from ..model.layers import model_dtype_head
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
    Per chunk of c <= chunk_tokens rows, the torch path: ``final_logits`` (RMSNorm, lm_head GEMM in the model dtype,
    then fp32), fp32 log_softmax, gather of the target, argmax of the log-probabilities (lowest id on ties) compared
    with the target; rows are independent, so the values equal the full ``[T, V]`` computation's. Peak extra memory:
    one chunk's fp32 logits [c, V] and log_softmax output [c, V] (``chunk_tokens * V * 8`` bytes; the model-dtype GEMM
    output is freed inside ``final_logits`` before log_softmax), plus O(T) outputs.
    The kernel path (:func:`_chunk_on_kernel`: CUDA, triton, a ``final_logits`` with a model-dtype head): the
    head's model-dtype logits [c, V] and one ``kernels.score_head.score_head_triton`` launch writing into the outputs;
    the same log-probabilities to ~1e-6 relative (fp32 sums in another order) and the argmax of the logits themselves
    (the torch path's argmax of the log-probabilities agrees but where fp32 rounding of ``x - logsumexp`` ties two
    near-maximal logits; on NaN rows: greedy False there, target 0 on the torch path; on rows holding +inf: the first
    +inf index there, target 0 on the torch path, whose log-probabilities are then all NaN). Peak extra memory
    ``chunk_tokens * V * b``.
    Returns (fp32 logprob [T], bool greedy [T]) on x's device; entries of rows without a target are arbitrary.
    """
    if chunk_tokens < 1:
        raise ValueError(f"token_scores: chunk_tokens must be >= 1, got {chunk_tokens}")
    T = x.shape[0]
    logp = torch.empty(T, dtype=torch.float32, device=x.device)  # [T]
    greedy = torch.empty(T, dtype=torch.bool, device=x.device)  # [T]
    tgt = targets.clamp(min=0)  # [T]: rows without a target gather token 0 (their entries are arbitrary)
    head = model_dtype_head(final_logits) if _sh.use_triton(x) else None
    for s in range(0, T, chunk_tokens):
        e = min(s + chunk_tokens, T)
        t = tgt[s:e]  # [c]
        if head is None:
            lf = final_logits(x[s:e], norm_w, lm_head, eps)  # [c, V] fp32
        else:
            lf = _chunk_on_kernel(head(x[s:e], norm_w, lm_head, eps), t, logp[s:e], greedy[s:e])
            if lf is None:
                continue  # written by the kernel
        lp = torch.log_softmax(lf, dim=-1)  # [c, V] fp32
        del lf
        logp[s:e] = lp.gather(1, t[:, None])[:, 0]
        greedy[s:e] = lp.argmax(dim=-1) == t
        del lp  # freed before the next chunk's logits exist
    return logp, greedy


def _chunk_on_kernel(logits: torch.Tensor, t: torch.Tensor, logp: torch.Tensor, greedy: torch.Tensor,
                     ) -> Optional[torch.Tensor]:
    """One chunk on the kernel: logits [c, V] in the model dtype (the family head's GEMM output, never cast to fp32
    here), t int64 [c] >= 0, written into logp fp32 [c] / greedy bool [c] (views of the batch's outputs); returns
    None. When ``kernels.score_head`` cannot take the operands, nothing is written and the fp32 logits [c, V] are
    returned for the torch path: ``logits.float()``, which is ``final_logits``' own value (its head's output cast to
    fp32: ``layers.model_dtype_head``), with the model-dtype tensor freed."""
    if _sh.score_head_triton_unsupported(logits, t, (logp, greedy)) is not None:
        return logits.float()
    _sh.score_head_triton(logits, t, out=(logp, greedy))
    return None


def split_scores(logp: torch.Tensor, greedy: torch.Tensor, lens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence of length n (packed in order), its n-1 scored rows of (logp, greedy) [T] as CPU tensors
    (fp32 [n-1], bool [n-1]); the row of each sequence's last token (no target) is dropped."""
    logp, greedy = logp.cpu(), greedy.cpu()  # one copy of 5 bytes per token, not one per sequence
    out, start = [], 0
    for n in lens:
        out.append((logp[start : start + n - 1], greedy[start : start + n - 1]))
        start += n
    return out
