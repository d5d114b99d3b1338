"""Stop strings and stop token ids through ``moe-batch run`` on the embedded model (fp32, greedy, serial and cgopipe):
a stop split across two generated tokens, one inside the first generated token, several at once, a stop token id.
Each is derived from the unstopped run's output; the stopped record must hold exactly the output ids up to the token
that completes the stop, the text cut exactly before it, and finish_reason "stop"."""

import json
import os

import pytest

from lightning_moe import cli
from lightning_moe.data.tokenize import load_tokenizer

G = 24
N = 6


def _write(tmp_path, tiny_dir, name, executor, extra=""):
    data = tmp_path / "in.jsonl"
    if not data.exists():
        with open(data, "w") as f:
            for i in range(N):
                f.write(json.dumps({"id": f"r{i}", "prompt": f"Tell me about number {i} and {'x ' * i}"}) + "\n")
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"model: {tiny_dir}\ndata: {{source: jsonl, path: {data}}}\noutput: {{path: {tmp_path / name}.jsonl}}\n"
                 f"device: cpu\ndtype: float32\nexecutor: {executor}\nbatch_size: 4\npolicy: {{mu: 2, n: 2}}\n"
                 f"expert_ffn: torch\ngeneration: {{max_new_tokens: {G}, temperature: 0.0, stop_at_eos: false{extra}}}\n")
    return p


def _job(tmp_path, tiny_dir, name, executor, extra=""):
    assert cli.main(["run", str(_write(tmp_path, tiny_dir, name, executor, extra)), "--no-progress"]) == 0
    return {r["id"]: r for r in map(json.loads, open(tmp_path / f"{name}.jsonl"))}


def _expected(tok, ids, stops):
    """(ids up to the token completing the earliest stop, the text cut before it) by brute force over prefixes."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:n], text[: min(hits)]
    return ids, tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.mark.parametrize("executor", ["serial", "cgopipe"])
def test_stop_strings_and_ids(tmp_path, tiny_dir, tok, executor, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ref = _job(tmp_path, tiny_dir, "ref", executor)
    r0 = ref["r0"]["output_ids"]
    pieces = [tok.decode(r0[: n + 1], skip_special_tokens=True) for n in range(len(r0))]
    # a stop spanning generated tokens k-1 and k of r0: the last char of the first k tokens' text + the next char
    k = next(n for n in range(3, G - 1) if len(pieces[n]) > len(pieces[n - 1]) >= 1 and pieces[n - 1].strip())
    split = pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1]
    first = pieces[0][:2] if len(pieces[0]) >= 2 else pieces[0]
    cases = {"split": [split], "first": [first], "several": [split, pieces[-1][-3:], "\u2603never"]}
    for name, stops in cases.items():
        got = _job(tmp_path, tiny_dir, name, executor, f", stop: {json.dumps(stops)}")
        for rid, rec in ref.items():
            ids, text = _expected(tok, rec["output_ids"], stops)
            g = got[rid]
            assert g["output_ids"] == ids, (name, rid)
            assert g["text"] == text, (name, rid, g["text"], text)
            assert g["finish_reason"] == ("stop" if len(ids) < len(rec["output_ids"]) or
                                          any(s in tok.decode(ids, skip_special_tokens=True) for s in stops)
                                          else "length"), (name, rid)
        assert got["r0"]["finish_reason"] == "stop" and len(got["r0"]["output_ids"]) <= k + 1
    third = r0[2]
    got = _job(tmp_path, tiny_dir, "ids", executor, f", stop_token_ids: [{third}]")
    for rid, rec in ref.items():
        out = rec["output_ids"]
        cut = out[: out.index(third) + 1] if third in out else out
        assert got[rid]["output_ids"] == cut and got[rid]["finish_reason"] == ("stop" if third in out else "length")


def test_bad_stop_values_are_refused(tmp_path, tiny_dir, capsys):
    for extra, key in ((", stop: ['']", "generation.stop[0]"), (", stop_token_ids: [-3]", "generation.stop_token_ids[0]")):
        assert cli.main(["run", str(_write(tmp_path, tiny_dir, "bad", "serial", extra)), "--no-progress"]) == 2
        assert key in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad.jsonl")
