"""Stop strings: finish a generated sequence when its text contains one, and cut the text before it.

A stop string is text, found in the decoded output whatever the tokens it spans (one token holding several stops,
a stop split across two or more tokens). Two parts:

* :class:`StopWatch`, while decoding: after each step, one ``batch_decode`` of the last ``window`` tokens of each
  live row (every token is at least one byte of text, so a stop that ends in the new token lies inside the last
  ``window`` = its bytes + a margin); a row whose tail holds a stop is confirmed on its full text and finished.
  Cost: one tokenizer call per step over short tails, only for jobs that have stop strings.
* :func:`cut_at_stop`, at the end: the full text is decoded once and cut before the earliest stop; the record's
  finish_reason is ``stop``. This is what the record holds, so the watch only decides when to stop generating.

Output ids keep the token that completed the stop (as vLLM does); the text does not include the stop string.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

BatchDecode = Callable[[list[list[int]]], list[str]]  # token ids per row -> text per row


def first_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    """Index in ``text`` where the earliest of ``stops`` begins (ties: any), or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(``text`` cut before its earliest stop string, whether one was found)."""
    i = first_stop(text, stops)
    return (text, False) if i is None else (text[:i], True)


class StopWatch:
    """Which rows' generated text now contains a stop string (checked on a tail of tokens, after each step)."""

    def __init__(self, stops: Sequence[str], batch_decode: BatchDecode, margin_tokens: int = 8):
        self.stops = tuple(s for s in stops if s)
        # every token decodes to >= 1 byte of UTF-8 (byte-level BPE and byte fallback alike), so a stop of B bytes
        # that ends in the newest token starts within its last B tokens; the margin covers a tail's first token,
        # which may decode differently (a dropped leading space, a partial character)
        self.window = (max((len(s.encode()) for s in self.stops), default=0) + margin_tokens) if self.stops else 0
        self._decode = batch_decode

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hits(self, outputs: dict[int, Sequence[int]]) -> set[int]:
        """Rows of ``outputs`` (row -> generated ids so far) whose text contains a stop string."""
        if not self.stops or not outputs:
            return set()
        rows = list(outputs)
        tails = self._decode([list(outputs[r][-self.window:]) for r in rows])
        cand = [r for r, t in zip(rows, tails) if first_stop(t, self.stops) is not None]
        if not cand:
            return set()
        # a tail decodes like the full text except at its first token: confirm on the full text (once per row)
        full = self._decode([list(outputs[r]) for r in cand])
        return {r for r, t in zip(cand, full) if first_stop(t, self.stops) is not None}
