"""Requests given as token ids (``prompt_token_ids``, with ``continuation_token_ids`` for loglikelihood), in a JSONL
file and through the Python API: fed as given (nothing added or re-tokenized), the same records as the text they
encode, and their errors named (file:line or prompts[i] / requests[i], field)."""

import json

import pytest

from lightning_moe import LLM, SamplingParams
from lightning_moe.config import job_from_dict
from lightning_moe.data.sources import DataError, load_requests
from lightning_moe.data.tokenize import encode_requests, load_tokenizer


def _job(tmp_path, lines, task="generate", mode=None):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    d = {"model": "tiny-mixtral", "task": task, "device": "cpu", "data": {"path": "d.jsonl"},
         "output": {"path": "r.jsonl"}}
    if mode:
        d["score"] = {"mode": mode}
    return job_from_dict(d, "t", base_dir=str(tmp_path))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, device="cpu", dtype="float32")


def test_jsonl_token_ids_are_fed_as_given(tmp_path, tiny_dir):
    tok = load_tokenizer(tiny_dir)
    gen = _job(tmp_path, [{"id": "a", "prompt_token_ids": [5, 6, 7]}, {"id": "b", "prompt": "Hi"}])
    ta, tb = encode_requests(load_requests(gen), tok, gen, 4096)
    assert ta.prompt_ids == [5, 6, 7]  # no BOS added
    assert tb.prompt_ids == tok("Hi").input_ids
    ll = _job(tmp_path, [{"id": "a", "prompt_token_ids": [1, 9], "continuation_token_ids": [4, 2]}], "score",
              "loglikelihood")
    (t,) = encode_requests(load_requests(ll), tok, ll, 4096)
    assert (t.prompt_ids, t.continuation_ids, t.score_inputs) == ([1, 9], [4, 2], [([1, 9, 4, 2], 2)])


@pytest.mark.parametrize("task, mode, rec, pattern", [
    ("generate", None, {"prompt_token_ids": []}, r"d\.jsonl:1: prompt_token_ids: expected a non-empty list of token ids, got an empty list"),
    ("generate", None, {"prompt_token_ids": "1 2"}, r"d\.jsonl:1: prompt_token_ids: expected a non-empty list of token ids, got a string"),
    ("generate", None, {"prompt_token_ids": [1, -2]}, r"d\.jsonl:1: prompt_token_ids\[1\]: expected a token id \(an integer >= 0\), got -2"),
    ("generate", None, {"prompt_token_ids": [1, True]}, r"d\.jsonl:1: prompt_token_ids\[1\]: expected a token id"),
    ("generate", None, {"prompt_token_ids": [1, 2.0]}, r"d\.jsonl:1: prompt_token_ids\[1\]: expected a token id"),
    ("generate", None, {"prompt_token_ids": [1], "prompt": "x"}, r"d\.jsonl:1: prompt_token_ids: give either 'prompt' or 'prompt_token_ids', not both"),
    ("score", "loglikelihood", {"prompt_token_ids": [1]}, r"d\.jsonl:1: continuation_token_ids: missing \(required with prompt_token_ids"),
    ("score", "loglikelihood", {"prompt_token_ids": [1], "continuation": " x"}, r"d\.jsonl:1: continuation: give continuation_token_ids with prompt_token_ids"),
    ("score", "loglikelihood", {"prompt": "x", "continuation_token_ids": [3]}, r"d\.jsonl:1: continuation_token_ids: needs prompt_token_ids"),
    ("score", "loglikelihood", {"prompt_token_ids": [1], "continuation_token_ids": []}, r"d\.jsonl:1: continuation_token_ids: expected a non-empty list"),
    ("score", "multiple_choice", {"prompt_token_ids": [1], "choices": [" a"]}, r"d\.jsonl:1: prompt_token_ids: not taken by score\.mode: multiple_choice"),
    ("score", "perplexity", {"prompt_token_ids": [1], "text": "a"}, r"d\.jsonl:1: prompt_token_ids: not taken by score\.mode: perplexity"),
])
def test_bad_token_ids_are_named(tmp_path, task, mode, rec, pattern):
    with pytest.raises(DataError, match=pattern):
        load_requests(_job(tmp_path, [{"id": "a", **rec}], task, mode))


def test_token_ids_outside_the_vocabulary_are_named(tmp_path, tiny_dir):
    tok = load_tokenizer(tiny_dir)
    job = _job(tmp_path, [{"id": "a", "prompt_token_ids": [1], "continuation_token_ids": [3, 32000]}], "score",
               "loglikelihood")
    with pytest.raises(DataError, match=r"d\.jsonl:1: continuation_token_ids\[1\]: 32000 is not a token id of the "
                                        r"model's tokenizer \(vocabulary of 32000\)"):
        encode_requests(load_requests(job), tok, job, 4096)


def test_api_token_prompts_generate_what_their_text_does(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=6)
    texts = ["Once upon a time", "1, 2, 3,"]
    by_text = llm.generate(texts, params, use_tqdm=False)
    by_ids = llm.generate([{"prompt_token_ids": tok(texts[0]).input_ids}, texts[1]], params, use_tqdm=False)
    assert [o.token_ids for o in by_ids] == [o.token_ids for o in by_text]
    assert [o.text for o in by_ids] == [o.text for o in by_text]
    assert by_ids[0].prompt == {"prompt_token_ids": tok(texts[0]).input_ids}
    one = llm.generate({"prompt_token_ids": (5, 6, 7)}, params, use_tqdm=False)  # one TokensPrompt, a tuple
    assert one[0].prompt_token_ids == [5, 6, 7]
    with pytest.raises(DataError, match=r"^prompts\[0\]: prompt_token_ids\[1\]: 99999 is not a token id"):
        llm.generate([{"prompt_token_ids": [1, 99999]}], params, use_tqdm=False)


def test_api_token_id_loglikelihood_equals_the_text_split(llm):
    tok = llm.get_tokenizer()
    ctx, cont = "The capital of France is", " Paris"
    ctx_ids = tok(ctx).input_ids
    cont_ids = tok(ctx + cont).input_ids[len(ctx_ids):]
    by_text, by_ids = llm.score([(ctx, cont), {"prompt_token_ids": ctx_ids, "continuation_token_ids": cont_ids}],
                                "loglikelihood", use_tqdm=False)
    assert (by_ids.prompt_tokens, by_ids.continuation_tokens) == (len(ctx_ids), len(cont_ids))
    assert by_ids.logprob == pytest.approx(by_text.logprob, abs=1e-5) and by_ids.is_greedy == by_text.is_greedy
    # a split the text API would not make (BOS twice): fed as given, scored differently
    other = llm.score([{"prompt_token_ids": [1] + ctx_ids, "continuation_token_ids": cont_ids}],
                      "loglikelihood", use_tqdm=False)[0]
    assert other.prompt_tokens == len(ctx_ids) + 1 and other.logprob != pytest.approx(by_text.logprob, abs=1e-3)
