"""Scoring jobs against transformers' own log-softmax of the same model (fp32, 1e-4)."""

import json
import math

import pytest
import torch

from lightning_moe.config import job_from_dict
from lightning_moe.data.writer import read_results
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.app.engine import run_job
from lightning_moe.pipeline.scoring import score_batch, windows
from lightning_moe.pipeline.serial import SerialExecutor


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoTokenizer, MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def _hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [n, V]


def _job(tmp_path, tiny_dir, rows, mode, **score):
    data = tmp_path / f"{mode}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return job_from_dict({"model": tiny_dir, "task": "score", "score": {"mode": mode, **score},
                          "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / f"{mode}.out.jsonl")},
                          "device": "cpu", "dtype": "float32", "executor": "serial", "batch_size": 3}, "t.yaml")


def test_loglikelihood_equals_transformers(tmp_path, tiny_dir, hf_tiny):
    model, tok = hf_tiny
    rows = [{"id": "a", "prompt": "The capital of France is", "continuation": " Paris"},
            {"id": "b", "prompt": "One two", "continuation": " three four five six"},
            {"id": "c", "prompt": "A much longer context sentence with many more tokens in it, to make the batch ragged:",
             "continuation": " yes"},
            {"id": "d", "prompt": "x", "continuation": " y"}]
    job = _job(tmp_path, tiny_dir, rows, "loglikelihood")
    run_job(job, progress=False)
    recs = {r["id"]: r for r in read_results(job.output.path)}
    for row in rows:
        ctx = tok(row["prompt"]).input_ids
        full = tok(row["prompt"] + row["continuation"]).input_ids
        assert full[: len(ctx)] == ctx
        lp = _hf_logprobs(model, full)
        tgt = full[len(ctx):]
        ref = sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(tgt))
        greedy = all(lp[len(ctx) - 1 + i].argmax().item() == t for i, t in enumerate(tgt))
        r = recs[row["id"]]
        assert r["continuation_tokens"] == len(tgt)
        assert abs(r["logprob"] - ref) < 1e-4, (row["id"], r["logprob"], ref)
        assert r["is_greedy"] == greedy


def test_multiple_choice_equals_transformers(tmp_path, tiny_dir, hf_tiny):
    model, tok = hf_tiny
    rows = [{"id": f"m{i}", "prompt": f"What is {i} + {i + 3}?", "choices": [f" {2 * i + 3}", f" {i}", " seventeen and a half", " 0"],
             "answer": 0} for i in range(5)]
    job = _job(tmp_path, tiny_dir, rows, "multiple_choice")
    rep = run_job(job, progress=False)
    recs = {r["id"]: r for r in read_results(job.output.path)}
    picks = []
    for row in rows:
        ctx = tok(row["prompt"]).input_ids
        ref = []
        for c in row["choices"]:
            full = tok(row["prompt"] + c).input_ids
            lp = _hf_logprobs(model, full)
            ref.append(sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(full[len(ctx):])))
        r = recs[row["id"]]
        assert max(abs(a - b) for a, b in zip(r["choice_logprobs"], ref)) < 1e-4
        assert r["pick"] == max(range(4), key=ref.__getitem__)
        picks.append(r["pick"] == 0)
    assert rep["metrics"]["accuracy"] == pytest.approx(sum(picks) / len(picks))


def test_windows_cover_every_token_once():
    for n, L, s in [(100, 32, 16), (33, 32, 31), (5, 32, 4), (64, 16, 1)]:
        ws = windows(n, L, s)
        scored = [t for b, e, f in ws for t in range(f, e)]
        assert scored == list(range(1, n)) and all(e - b <= L for b, e, _ in ws)
    with pytest.raises(ValueError, match="stride"):
        windows(100, 32, None)
    with pytest.raises(ValueError, match="stride"):
        windows(100, 32, 32)


def test_perplexity_with_stride_equals_direct(hf_mixtral):
    """Rolling-window perplexity over a text 3x longer than the context equals a direct computation."""
    path, model = hf_mixtral
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (100,), generator=g).tolist()
    max_len, stride = 32, 12

    class TR:  # the fields score_batch reads for perplexity
        id, prompt_tokens, truncated, text_ids = "t", 0, 0, ids

    rec = score_batch([TR()], "perplexity", ex.prompt_logprobs, max_len, stride)[0]
    # direct: the Hugging Face "perplexity of fixed-length models" loop
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_len, len(ids))
        trg = end - prev_end
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].double(), -1)
        for pos in range(end - begin - trg, end - begin):
            if begin + pos == 0:
                continue
            nll -= lp[pos - 1, ids[begin + pos]].item()
            count += 1
        prev_end = end
        if end == len(ids):
            break
    assert rec["scored_tokens"] == count == 99
    assert abs(rec["nll"] - nll) < 1e-3 and abs(rec["perplexity"] - math.exp(nll / count)) / math.exp(nll / count) < 1e-5
