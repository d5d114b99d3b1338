"""``moe-batch run-batch``: OpenAI / vLLM batch files on the embedded tiny model (CPU, fp32, serial executor).

* chat and completion requests (greedy and sampled, several groups of settings) give the records of the same prompts
  through ``LLM.generate`` with the same settings and request ids (= custom_ids): text, finish_reason, usage; the
  weights are read once for all groups;
* bad lines become error records naming their line and field; a duplicate custom_id refuses the file, naming both
  lines, with nothing written;
* a re-run writes nothing new; another dtype, a changed finished line, or a changed line whose record is in the
  state directory is refused;
* a run killed with SIGKILL mid-file and run again has every custom_id exactly once, with the records of an
  uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time

from lightning_moe import LLM, SamplingParams, cli
from lightning_moe.app import batch_files
from tests.support.prompt_files import count_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = ["--device", "cpu", "--dtype", "float32", "--no-progress"]


def _line(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _chat(cid, messages, **kw):
    return _line(cid, "/v1/chat/completions", {"model": "tiny", "messages": messages, **kw})


def _cmpl(cid, prompt, **kw):
    return _line(cid, "/v1/completions", {"model": "tiny", "prompt": prompt, **kw})


def _write(path, lines):
    with open(path, "w") as f:
        for x in lines:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")
    return str(path)


def _run(inp, out, tiny_dir, *extra):
    return cli.main(["run-batch", "-i", str(inp), "-o", str(out), "--model", tiny_dir, *CPU, *extra])


def _records(path):
    return [json.loads(x) for x in open(path)]


def _by_cid(path):
    recs = _records(path)
    out = {r["custom_id"]: r for r in recs}
    assert len(out) == len(recs), "a custom_id has more than one record"
    return out


def test_chat_and_completions_equal_llm_generate(tmp_path, tiny_dir, monkeypatch):
    from lightning_moe.app import engine

    loads = []
    real = engine.load_checkpoint
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a, **k: loads.append(1) or real(*a, **k))
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    lines = [
        _chat("c0", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
              max_tokens=10, temperature=0),
        _cmpl("p0", "1, 2, 3,", max_tokens=8, temperature=0),
        _chat("c1", [{"role": "user", "content": parts}], max_completion_tokens=10, temperature=0.0, seed=9),
        _cmpl("p1", "The capital of France is", max_tokens=8, temperature=0.9, top_p=0.9, seed=11),
        _cmpl("p2", "Once upon a time", max_tokens=8, temperature=0.9, top_p=0.9, seed=11, n=1, stream=False),
        _chat("c2", [{"role": "user", "content": "Tell me a story"}], seed=4),  # default temperature 1, --max-tokens
        _cmpl("p3", "A B C D", max_tokens=8, temperature=0, stop=["\u2603never"], logprobs=None, user="u1"),
    ]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, tiny_dir, "--batch-size", "3", "--max-tokens", "6") == 0
    got = _by_cid(out)
    assert list(got) == ["c0", "c1", "p0", "p1", "p2", "c2", "p3"]  # group by group, in input order within
    assert len(loads) == 1  # one weight read for every group
    groups = sorted(p for p in os.listdir(tmp_path / "out.batch") if p.endswith(".requests.jsonl"))
    assert len(groups) == 5  # c0+c1 (greedy chat), p0 (greedy), p1+p2, c2, p3 (its stop)

    llm = LLM(tiny_dir, device="cpu", dtype="float32")
    text_parts = "Name a colour.\nOne word."
    want = {}
    for cids, prompts, sp in (
            (["c0", "c1"], [lines[0]["body"]["messages"], [{"role": "user", "content": text_parts}]],
             SamplingParams(max_tokens=10, temperature=0)),
            (["p0"], ["1, 2, 3,"], SamplingParams(max_tokens=8, temperature=0)),
            (["p1", "p2"], ["The capital of France is", "Once upon a time"],
             SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11)),
            (["c2"], [lines[5]["body"]["messages"]], SamplingParams(max_tokens=6, temperature=1.0, seed=4)),
            (["p3"], ["A B C D"], SamplingParams(max_tokens=8, temperature=0, stop=["\u2603never"]))):
        for cid, o in zip(cids, llm.generate(prompts, sp, request_ids=cids, use_tqdm=False)):
            want[cid] = o
    for cid, rec in got.items():
        o = want[cid]
        chat = cid.startswith("c")
        assert rec["id"].startswith("batch_req_") and rec["error"] is None
        resp = rec["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat else "cmpl-") and isinstance(body["created"], int)
        assert body["model"] == os.path.basename(tiny_dir)
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == o.finish_reason, cid
        if chat:
            assert choice["message"] == {"role": "assistant", "content": o.text}, cid
        else:
            assert choice["text"] == o.text, cid
        assert body["usage"] == {"prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.token_ids),
                                 "total_tokens": len(o.prompt_token_ids) + len(o.token_ids)}, cid
    assert len(want["c2"].token_ids) == 6 or want["c2"].finish_reason == "stop"
    assert got["p1"]["response"]["body"]["choices"][0]["text"] != got["p2"]["response"]["body"]["choices"][0]["text"]


def test_bad_lines_become_error_records(tmp_path, tiny_dir):
    ok = _cmpl("ok", "1, 2, 3,", max_tokens=4, temperature=0)
    lines = [
        ok,                                                                        # 1
        "{not json",                                                               # 2
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},     # 3 no custom_id
        _line("e4", "/v1/embeddings", {"input": "x"}),                             # 4 unknown url
        _cmpl("e5", "x", max_tokens=4, frobnicate=1),                              # 5 unknown body field
        _cmpl("e6", "x", max_tokens=4, n=2),                                       # 6 n must be 1
        _chat("e7", [{"role": "user", "content": "x"}], logprobs=1),               # 7 chat's logprobs is a bool
        _cmpl("e8", "x", max_tokens="ten"),                                        # 8 bad type
        _cmpl("e9", "x", temperature=-1),                                          # 9 bad value
        _chat("e10", [{"role": "user", "content": "x"}], prompt="y"),              # 10 a completions field
        _cmpl("e11", "word " * 5000, max_tokens=8),                                # 11 too long for the context
        _cmpl("e12", "x", max_tokens=5000),                                        # 12 no room for a prompt
        {"custom_id": "e13", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},  # 13
        _chat("e14", [{"role": "robot", "content": "x"}]),                         # 14 bad role
        "",                                                                        # 15 blank: skipped
        _cmpl("e16", ["a", "b"]),                                                  # 16 several prompts
    ]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, tiny_dir) == 0
    recs = _records(out)
    assert len(recs) == 15
    errs = {r["error"]["message"].split(": ", 1)[0]: r for r in recs if r["error"] is not None}
    expect = {2: (None, "malformed JSON"), 3: (None, "custom_id: missing"), 4: ("e4", 'url: "/v1/embeddings"'),
              5: ("e5", "body.frobnicate: unknown field"), 6: ("e6", "body.n: 2 is not supported"),
              7: ("e7", "body.logprobs: expected true or false, got an integer"), 8: ("e8", "body.max_tokens: expected an integer"),
              9: ("e9", "body.temperature: must be >= 0"),
              10: ("e10", "body.prompt: unknown field for /v1/chat/completions (a field of /v1/completions)"),
              11: ("e11", "body.prompt: "), 12: ("e12", "body.max_tokens: 5000 leaves no room for a prompt"),
              13: ("e13", 'method: expected "POST", got "GET"'), 14: ("e14", "body.messages[0].role: 'robot'"),
              16: ("e16", "body.prompt: a list")}
    assert sorted(errs) == sorted(f"{inp}:{n}" for n in expect)
    for n, (cid, text) in expect.items():
        r = errs[f"{inp}:{n}"]
        assert r["custom_id"] == cid and r["response"] is None and r["error"]["code"] == "invalid_request", n
        assert r["error"]["message"].startswith(f"{inp}:{n}: {text}"), (n, r["error"]["message"])
        assert r["id"].startswith("batch_req_")
    assert "exceed the prompt budget" in errs[f"{inp}:11"]["error"]["message"]
    assert len({r["id"] for r in recs}) == len(recs)
    (good,) = [r for r in recs if r["error"] is None]
    assert good["custom_id"] == "ok" and good["response"]["body"]["usage"]["completion_tokens"] == 4


def test_duplicate_custom_id_refuses_the_file(tmp_path, tiny_dir, capsys):
    lines = [_cmpl("a", "x", max_tokens=2), _cmpl("b", "y", max_tokens=2), "{broken", _cmpl("a", "z", max_tokens=2)]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, tiny_dir) == 2
    err = capsys.readouterr().err
    assert f"{inp}:4: custom_id: duplicate 'a' (first at line 1)" in err, err
    assert not out.exists() and not (tmp_path / "out.batch").exists()


def test_rerun_writes_nothing_and_refuses_changes(tmp_path, tiny_dir, capsys):
    lines = [_cmpl("a", "1, 2, 3,", max_tokens=4, temperature=0), _chat("b", [{"role": "user", "content": "Hi"}],
                                                                          max_tokens=4, temperature=0), "oops"]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, tiny_dir) == 0
    first = out.read_bytes()
    assert len(first.splitlines()) == 3
    capsys.readouterr()
    assert _run(inp, out, tiny_dir) == 0
    assert out.read_bytes() == first
    assert "(0 written by this run, 3 already there)" in capsys.readouterr().out
    # another setting for the same output, or a finished line changed: refused, nothing written
    assert cli.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_dir, "--device", "cpu", "--dtype",
                     "bfloat16", "--no-progress"]) == 2
    assert "dtype: 'float32' then, 'bfloat16' now" in capsys.readouterr().err
    lines[1]["body"]["max_tokens"] = 5
    lines.append(_cmpl("c", "new", max_tokens=2, temperature=0))
    _write(tmp_path / "in.jsonl", lines)
    assert _run(inp, out, tiny_dir) == 2
    assert f"{inp}:2: custom_id 'b' changed since its line in" in capsys.readouterr().err
    assert out.read_bytes() == first
    # b's line gone from the output but its record still in out.batch/: a changed prompt must not reuse it
    out.write_bytes(b"".join(x + b"\n" for x in first.splitlines() if b'"custom_id": "b"' not in x))
    lines[1]["body"].update(max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    _write(tmp_path / "in.jsonl", lines)
    assert _run(inp, out, tiny_dir) == 2
    assert f"{inp}:2: custom_id 'b' changed since an earlier run started it" in capsys.readouterr().err




def test_resume_after_sigkill(tmp_path, tiny_dir):
    quick = [_cmpl(f"q{i}", f"{i} + {i} =", max_tokens=3, temperature=0) for i in range(3)]
    slow = [_chat(f"s{i:02d}", [{"role": "user", "content": f"Count to {i}, slowly " + "and " * (i % 5)}],
                  max_tokens=48, temperature=0.8, seed=5) for i in range(24)]
    inp = _write(tmp_path / "in.jsonl", quick + slow)
    slow_group = batch_files.parse_line(json.dumps(slow[0]), 4, inp, 128).group
    out = tmp_path / "out.jsonl"
    slow_results = tmp_path / "out.batch" / f"g-{slow_group}.jsonl"
    args = ["run-batch", "-i", inp, "-o", str(out), "--model", tiny_dir, *CPU, "--batch-size", "2",
            "--checkpoint-seconds", "0.05"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_moe.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while count_lines(out) < len(quick) or count_lines(slow_results) < 2:
            assert proc.poll() is None, "the run ended before it could be killed: " + proc.stdout.read().decode()
            assert time.time() < deadline, "no records after 300 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    before = _records(out)
    assert len(quick) <= len(before) < len(quick) + len(slow)  # killed with the slow group unfinished
    assert cli.main(args) == 0
    after = _records(out)
    assert after[: len(before)] == before  # finished lines kept as they were, the rest appended
    ref_out = tmp_path / "ref.jsonl"
    assert cli.main(["run-batch", "-i", inp, "-o", str(ref_out), "--model", tiny_dir, *CPU, "--batch-size", "2"]) == 0

    def strip(r):
        r = json.loads(json.dumps(r))
        if r["response"] is not None:
            del r["response"]["body"]["created"]
        return r

    got, ref = _by_cid(out), _by_cid(ref_out)
    assert sorted(got) == sorted(ref) == sorted(x["custom_id"] for x in quick + slow)
    for cid in ref:
        assert strip(got[cid]) == strip(ref[cid]), cid
