"""Log-probs of generated tokens (generation.logprobs, SamplingParams(logprobs=k), run-batch's logprobs /
top_logprobs): transformers' log-softmax of its own logits, the same in both executors, sampled or greedy, through
the engine, the API, a resumed partial and the OpenAI output formats; nothing computed when not asked."""

import json

import pytest
import torch

from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline import sampling as sampling_mod
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy


def _run(ex, prompts, sp, **kw):
    got: dict[int, list] = {i: [] for i in range(len(prompts))}

    def on_logprobs(rows, entries):
        for r, e in zip(rows, entries):
            got[r].append(e)

    out = ex.generate(prompts, sp, on_logprobs=on_logprobs, **kw)
    return out, got


def _hf_logprobs(model, prompt, out):
    """transformers' fp32 log-softmax of its own logits at every generated position of prompt + out."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) + len(out) - 1]  # [len(out), V]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_transformers_both_executors(hf_mixtral, temperature):
    """Greedy and sampled (raw logits: temperature does not change the values): the chosen token's log-prob and the
    top-3 equal transformers' log-softmax (1e-4, as the logits test), and serial == cgopipe (1e-5, same ids)."""
    path, model = hf_mixtral
    prompts = [[1, 17, 33, 5, 90, 41], [1, 7], [1, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    sp = DecodeSampling(max_new_tokens=10, temperature=temperature, stop_at_eos=False, logprobs=3)
    seeds = [11, 12, 13]
    ref, ref_lp = _run(SerialExecutor(load_checkpoint(path, torch.float32), "cpu"), prompts, sp, seeds=seeds)
    pol = Policy(mu=2, n=2, prefill_mu=1, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")
    try:
        out, lp = _run(ex, prompts, sp, seeds=seeds)
    finally:
        ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
    for r, prompt in enumerate(prompts):
        toks = ref[r][0]
        assert len(ref_lp[r]) == len(lp[r]) == len(toks) == 10
        hf = _hf_logprobs(model, prompt, toks)
        for i, t in enumerate(toks):
            (c, top), (c2, top2) = ref_lp[r][i], lp[r][i]
            assert abs(c - hf[i, t].item()) < 1e-4
            assert abs(c - c2) < 1e-5
            vals, ids = hf[i].topk(3)
            assert [j for j, _ in top] == ids.tolist() == [j for j, _ in top2]
            assert max(abs(v - w) for (_, v), w in zip(top, vals.tolist())) < 1e-4
            assert max(abs(v - w) for (_, v), (_, w) in zip(top, top2)) < 1e-5
            if temperature == 0.0:
                assert top[0][0] == t and top[0][1] == c  # greedy: the chosen token is the best


def test_no_logprobs_costs_nothing(hf_mixtral, monkeypatch):
    """logprobs unset: token_logprobs is never called (and no callback), in either executor."""
    path, _ = hf_mixtral
    calls = []
    real = sampling_mod.token_logprobs
    # the one place both executors turn logits into tokens (sampling.DecodeRows.commit) calls it
    monkeypatch.setattr(sampling_mod, "token_logprobs", lambda *a: calls.append(1) or real(*a))
    sp = DecodeSampling(max_new_tokens=4, stop_at_eos=False)
    for ex in (SerialExecutor(load_checkpoint(path, torch.float32), "cpu"),
               CGOPipeExecutor(load_checkpoint(path, torch.float32), Policy(mu=2, n=1, prefill_mu=2, dtype="fp32",
                                                                          weight_quant="fp32"), "cpu")):
        _, got = _run(ex, [[1, 5, 6], [1, 9]], sp)
        if hasattr(ex, "close"):
            ex.close()
        assert calls == [] and got == {0: [], 1: []}
    sp = DecodeSampling(max_new_tokens=4, stop_at_eos=False, logprobs=0)
    _, got = _run(SerialExecutor(load_checkpoint(path, torch.float32), "cpu"), [[1, 5, 6]], sp)
    assert len(calls) == 4 and all(top is None for _, top in got[0])  # k = 0: the chosen token's only


def test_api_and_records_logprobs(tiny_dir, tmp_path):
    """The API: vLLM's per-token dicts (chosen token first, then the top-k), cumulative_logprob; the job's record
    fields; a list of DecodeSampling with and without logprobs; the CLI record equals the API's."""
    from lightning_moe import LLM
    from lightning_moe import SamplingParams as SP
    from lightning_moe.app.engine import run_job
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.writer import read_results

    prompts = ["alpha beta gamma", "delta"]
    with LLM(tiny_dir, device="cpu", dtype="float32") as llm:
        outs = llm.generate(prompts, [SP(max_tokens=5, logprobs=2), SP(max_tokens=5)], use_tqdm=False)
        alone = llm.generate(prompts[1:], SP(max_tokens=5), use_tqdm=False, request_ids=["1"])
    a, b = outs
    assert b.logprobs is None and b.cumulative_logprob is None and b.token_ids == alone[0].token_ids
    assert len(a.logprobs) == len(a.token_ids) == 5
    for t, d in zip(a.token_ids, a.logprobs):
        assert next(iter(d)) == t and 2 <= len(d) <= 3 and all(v <= 0 for v in d.values())
    assert a.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(a.token_ids, a.logprobs)))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "0", "prompt": prompts[0]}) + "\n")
    job = job_from_dict({"model": tiny_dir, "device": "cpu", "dtype": "float32", "executor": "cgopipe",
                         "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / "o.jsonl")},
                         "generation": {"max_new_tokens": 5, "logprobs": 2},
                         "policy": {"mu": 1, "n": 1}}, "job")
    run_job(job, progress=False)
    rec = read_results(str(tmp_path / "o.jsonl"))[0]
    assert rec["output_ids"] == a.token_ids
    assert len(rec["logprobs"]) == 5 and len(rec["top_logprobs"]) == 5 and all(len(t) == 2 for t in rec["top_logprobs"])
    for t, lp, top, d in zip(rec["output_ids"], rec["logprobs"], rec["top_logprobs"], a.logprobs):
        assert abs(lp - d[t]) < 1e-5 and all(abs(v - d[i]) < 1e-5 for i, v in top)


def test_resumed_partial_keeps_its_logprobs(tiny_dir, tmp_path):
    """A run stopped mid-decode resumes from the sidecar, whose lines carry the log-probs: the record equals an
    uninterrupted run's, log-probs included: the partial's exactly (the values written), the rest within 1e-5 (they
    come after a prefill of prompt + partial instead of decode steps: another summation order)."""
    from lightning_moe.app import engine
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.writer import read_partials, read_results

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                            for i, p in enumerate(["alpha beta", "gamma delta epsilon"])))

    def job(out, **gen):
        return job_from_dict({"model": tiny_dir, "device": "cpu", "dtype": "float32",
                              "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(out)},
                              "generation": {"max_new_tokens": 8, "stop_at_eos": False, "logprobs": 1, **gen},
                              "checkpoint": {"every_steps": 1, "every_seconds": None}}, "job")

    engine.run_job(job(tmp_path / "full.jsonl"), progress=False)
    full = {r["id"]: r for r in read_results(str(tmp_path / "full.jsonl"))}
    stopped = job(tmp_path / "cut.jsonl")
    real = engine.PartialsFile.append
    count = {"n": 0}

    def append_then_stop(self, lines):
        n = real(self, lines)
        count["n"] += 1
        if count["n"] == 3:
            raise engine.JobStopped("test stop")
        return n

    engine.PartialsFile.append = append_then_stop
    try:
        with pytest.raises(engine.JobStopped):
            engine.run_job(stopped, progress=False)
    finally:
        engine.PartialsFile.append = real
    side = stopped.output.partial_path
    parts = read_partials(side)
    assert parts and all(0 < len(v) < 8 for v in parts.values())
    with open(side) as f:
        assert all("logprobs" in json.loads(line) for line in f)
    engine.run_job(stopped, progress=False)
    cut = {r["id"]: r for r in read_results(str(tmp_path / "cut.jsonl"))}
    assert cut.keys() == full.keys()
    for i, rec in cut.items():
        n = len(parts.get(i, []))
        assert {k: v for k, v in rec.items() if "logprobs" not in k} == \
            {k: v for k, v in full[i].items() if "logprobs" not in k}
        assert rec["logprobs"][:n] == full[i]["logprobs"][:n] and rec["top_logprobs"][:n] == full[i]["top_logprobs"][:n]
        assert max(abs(a - b) for a, b in zip(rec["logprobs"], full[i]["logprobs"])) < 1e-5


def test_run_batch_logprobs(tiny_dir, tmp_path):
    """run-batch: chat logprobs + top_logprobs and completions logprobs in OpenAI's formats; bad values are error
    records naming the field."""
    from lightning_moe.app.batch_files import run_batch
    from lightning_moe.data.writer import read_results

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "p", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 1}},
        {"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "bad1", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "top_logprobs": 2}},
        {"custom_id": "bad2", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "logprobs": 21}},
        {"custom_id": "bad3", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "stop_token_ids": [5, 10 ** 7]}},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(str(inp), str(tmp_path / "out.jsonl"), tiny_dir, device="cpu", dtype="float32", progress=False)
    out = {r["custom_id"]: r for r in read_results(str(tmp_path / "out.jsonl"))}
    c = out["c"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(c["content"]) == 4 and c["refusal"] is None
    for e in c["content"]:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["bytes"] == list(e["token"].encode()) and e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy
    p = out["p"]["response"]["body"]["choices"][0]["logprobs"]
    assert set(p) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(p["tokens"]) == 4
    assert p["text_offset"][0] == 0 and all(len(d) >= 1 for d in p["top_logprobs"])
    assert out["n"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert "body.top_logprobs: needs" in out["bad1"]["error"]["message"]
    assert "in.jsonl:5: body.logprobs: expected an integer in 0..20" in out["bad2"]["error"]["message"]
    assert "in.jsonl:6: body.stop_token_ids[1]: 10000000 is outside the model's vocabulary" in \
        out["bad3"]["error"]["message"]


def test_rows_that_finish_early_get_no_more_entries(hf_mixtral):
    """A row that ends at a stop token while its micro-batch goes on: one entry per output token, equal to the
    serial executor's (cgopipe keeps the finished row's slot and discards what it computes)."""
    path, _ = hf_mixtral
    prompts = [[1, 17, 33, 5], [1, 7, 8], [1, 99, 3], [1, 4]]
    free = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").generate(
        prompts, DecodeSampling(max_new_tokens=8, stop_at_eos=False))
    stop = free[0][0][2]  # row 0 emits it at step 3
    sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False, stop_token_ids=(stop,), logprobs=2)
    ref, ref_lp = _run(SerialExecutor(load_checkpoint(path, torch.float32), "cpu"), prompts, sp)
    ex = CGOPipeExecutor(load_checkpoint(path, torch.float32), Policy(mu=2, n=2, prefill_mu=2, dtype="fp32",
                                                                      weight_quant="fp32"), "cpu")
    try:
        out, lp = _run(ex, prompts, sp)
    finally:
        ex.close()
    assert out == ref and len(ref[0][0]) <= 3 and ref[0][1] == "stop"
    for r in range(len(prompts)):
        assert len(lp[r]) == len(ref_lp[r]) == len(out[r][0])
        assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(lp[r], ref_lp[r]))
