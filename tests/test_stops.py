"""Stop strings on the embedded model's tokenizer: a stop split across tokens, inside the first token, several at
once, multi-byte text; the watch fires at the step whose token completes the stop, never earlier."""

import pytest

from lightning_moe.data.stops import StopWatch, cut_at_stop, first_stop
from lightning_moe.data.tokenize import load_tokenizer
from lightning_moe.model.tiny import resolve_model_path


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("tiny-mixtral"))


def _decode(tok):
    return lambda rows: tok.batch_decode(rows, skip_special_tokens=True)


def _fires_at(tok, text, stops, margin=8):
    """Feed ``text``'s tokens one at a time; the 1-based step at which the watch reports the row (None: never)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    watch = StopWatch(stops, _decode(tok), margin_tokens=margin)
    for n in range(1, len(ids) + 1):
        if watch.hits({0: ids[:n]}):
            return n, ids
    return None, ids


def _step_completing(tok, ids, stops):
    """Reference: the first prefix length whose full decode contains a stop."""
    for n in range(1, len(ids) + 1):
        if first_stop(tok.decode(ids[:n], skip_special_tokens=True), stops) is not None:
            return n
    return None


@pytest.mark.parametrize("text, stops, cut", [
    ("hello world and more", ["lo wo"], "hel"),  # split across tokens 'hell' 'o' 'world' (and a space)
    ("hello world and more", ["he"], ""),  # inside the first token
    ("hello world and more", ["wor", "llo", "zzz"], "he"),  # several: the earliest wins
    ("The answer is 42.\n\nQuestion: next", ["\n\nQuestion:"], "The answer is 42."),  # across 4 tokens
    ("日本語 text after", ["本語"], "日"),  # multi-byte characters, one token each
    ("no stop here at all", ["xyz", "Question"], "no stop here at all"),
])
def test_watch_fires_when_the_stop_completes_and_the_text_is_cut(tok, text, stops, cut):
    step, ids = _fires_at(tok, text, stops)
    assert step == _step_completing(tok, ids, stops)
    full = tok.decode(ids, skip_special_tokens=True)
    got, found = cut_at_stop(full, stops)
    assert got == cut and found == (cut != full)


def test_long_stop_with_a_small_margin_is_still_found(tok):
    text = "alpha beta gamma delta epsilon zeta eta theta"
    stops = ["gamma delta epsilon"]
    step, ids = _fires_at(tok, text, stops, margin=0)
    assert step is not None and step == _step_completing(tok, ids, stops)


def test_many_rows_one_call_and_no_stops(tok):
    a = tok("one two three stop four", add_special_tokens=False)["input_ids"]
    b = tok("five six seven", add_special_tokens=False)["input_ids"]
    watch = StopWatch([" stop"], _decode(tok))
    assert watch.hits({3: a, 7: b}) == {3}
    assert not StopWatch([], _decode(tok)) and StopWatch([], _decode(tok)).hits({0: a}) == set()
    assert StopWatch(["", "x"], _decode(tok)).stops == ("x",)
