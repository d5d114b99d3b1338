"""The lm-evaluation-harness backend (``--model lightning-moe``) against lm-eval's own ``hf`` backend (HFLM).

Both run the embedded tiny Mixtral (HF format; HFLM loads it with transformers' MixtralForCausalLM) in fp32 on the
CPU over local tasks (task YAMLs over local JSONL files, no hub): the same per-request loglikelihoods (1e-4), the same
multiple-choice acc, the same rolling loglikelihoods / perplexities, the same generate_until strings with ``until``,
and the same with ``apply_chat_template``. HFLM runs with ``logits_cache=False``: lm-eval 0.4.13's one-token
continuation cache scores a one-token continuation at the wrong position when it shares ``context + continuation[:-1]``
with a longer continuation (here the empty-context request ``("", "Hello world")`` and ``("Hello ", "world")``), see
test_hf_logits_cache_quirk.
"""

import json
import math
import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON files only; never the hub
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

TOL = 1e-4

LL_DOCS = [  # (context, continuation): trailing spaces, an empty context, a BOS-prefixed context, multi-token
    {"context": "The capital of France is", "target": " Paris"},
    {"context": "Hello ", "target": "world"},
    {"context": "", "target": "Hello world"},
    {"context": "Question: 2 + 2 =\nAnswer:", "target": " 4, or so they say"},
    {"context": "a  ", "target": " b c"},
    {"context": "<s> [INST] hi [/INST]", "target": " fine"},
    {"context": "Once upon a time", "target": " sitVert因"},  # the tiny model's greedy tokens: is_greedy true
]
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "2 + 2 =", "choices": [" 4", " 5", " four"], "answer": 2},
    {"question": "Water boils at", "choices": [" 100 degrees", " 0 degrees"], "answer": 1},
    {"question": "Capital of Italy:", "choices": [" Rome", " Milan", " Naples", " Turin"], "answer": 0},
    {"question": "Opposite of hot:", "choices": [" cold", " warm"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " woof", " moo"], "answer": 1},
]
PPL_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Language models assign probabilities to sequences of tokens. " * 6},
    {"text": "Ünïcödé, emojis 🙂 and\nnew lines\n\ttabs."},
]
GEN_DOCS = [{"prompt": p} for p in ("Once upon a time", "Hello", "The meaning of life is", "<s> [INST] hi [/INST]",
                                    "1, 2, 3,", "def f(x):")]
GEN_UNTIL = ["e", "\n\n", "s "]  # one-character and two-character stops (the tiny model's gibberish holds them)
GEN_TOKS = 24


def _metrics(*names):
    agg = {"perplexity": "perplexity", "word_perplexity": "weighted_perplexity",
           "byte_perplexity": "weighted_perplexity", "bits_per_byte": "bits_per_byte"}
    return [{"metric": m, "aggregation": agg.get(m, "mean"),
             "higher_is_better": m in ("acc", "acc_norm", "exact_match")} for m in names]


def _gen(until):
    return {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "x",
            "generation_kwargs": {"until": until, "max_gen_toks": GEN_TOKS, "do_sample": False},
            "metric_list": _metrics("exact_match")}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """lm-eval task YAMLs over local JSONL files (dataset_path: json), one per request kind."""
    import yaml

    d = tmp_path_factory.mktemp("lm_eval_tasks")
    specs = {
        "lme_ll": (LL_DOCS, {"output_type": "loglikelihood", "doc_to_text": "{{context}}",
                             "doc_to_target": "{{target}}", "target_delimiter": "",
                             "metric_list": _metrics("perplexity", "acc")}),
        "lme_mc": (MC_DOCS, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                             "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
                             "metric_list": _metrics("acc", "acc_norm")}),
        "lme_ppl": (PPL_DOCS, {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                               "metric_list": _metrics("word_perplexity", "byte_perplexity", "bits_per_byte")}),
        "lme_gen": (GEN_DOCS, _gen(GEN_UNTIL)),
        "lme_gen_free": (GEN_DOCS, _gen([])),
    }
    for task, (docs, spec) in specs.items():
        data = d / f"{task}.jsonl"
        data.write_text("".join(json.dumps(x) + "\n" for x in docs))
        spec = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **spec}
        (d / f"{task}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(d)


TASKS = ["lme_ll", "lme_mc", "lme_ppl", "lme_gen", "lme_gen_free"]


def _evaluate(lm, task_dir, tasks=TASKS, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=task_dir, include_defaults=False)  # only these tasks (indexing lm-eval's own: ~7 s)
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=tm, log_samples=True, bootstrap_iters=0, random_seed=0,
                          numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **kw)
    samples = {t: sorted(s, key=lambda x: x["doc_id"]) for t, s in out["samples"].items()}
    return out["results"], samples


@pytest.fixture(scope="module")
def hf_lm(tiny_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=tiny_dir, dtype="float32", device="cpu", batch_size=1, logits_cache=False)


@pytest.fixture(scope="module")
def moe_lm(tiny_dir):
    from lightning_moe.lm_eval_backend import LightningMoELM

    return LightningMoELM(pretrained=tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def both(hf_lm, moe_lm, task_dir):
    return _evaluate(hf_lm, task_dir), _evaluate(moe_lm, task_dir)


def _resps(samples, task):
    return [s["resps"] for s in samples[task]]


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=0, abs_tol=TOL), (x, y)


def test_loglikelihoods_equal_the_hf_backend(both):
    (hf_res, hf_s), (me_res, me_s) = both
    hf_r, me_r = _resps(hf_s, "lme_ll"), _resps(me_s, "lme_ll")
    assert len(hf_r) == len(LL_DOCS)
    hf_r, me_r = [r[0][0] for r in hf_r], [r[0][0] for r in me_r]  # per request (logprob, is_greedy)
    _close([r[0] for r in hf_r], [r[0] for r in me_r])
    assert [r[1] for r in hf_r] == [r[1] for r in me_r]
    assert any(r[1] for r in me_r)  # a greedy continuation is among them (is_greedy compared, not only False)
    assert me_res["lme_ll"]["acc,none"] == hf_res["lme_ll"]["acc,none"]
    assert math.isclose(me_res["lme_ll"]["perplexity,none"], hf_res["lme_ll"]["perplexity,none"], rel_tol=1e-5)
    # the multiple-choice requests: every choice's loglikelihood, and acc / acc_norm
    hf_mc = [c[0] for r in _resps(hf_s, "lme_mc") for c in r]
    me_mc = [c[0] for r in _resps(me_s, "lme_mc") for c in r]
    assert len(hf_mc) == sum(len(d["choices"]) for d in MC_DOCS)
    _close([x[0] for x in hf_mc], [x[0] for x in me_mc])
    for metric in ("acc,none", "acc_norm,none"):
        assert me_res["lme_mc"][metric] == hf_res["lme_mc"][metric]
    assert [s["acc"] for s in me_s["lme_mc"]] == [s["acc"] for s in hf_s["lme_mc"]]


def test_rolling_loglikelihoods_equal_the_hf_backend(both):
    (hf_res, hf_s), (me_res, me_s) = both
    hf_r, me_r = _resps(hf_s, "lme_ppl"), _resps(me_s, "lme_ppl")
    assert len(hf_r) == len(PPL_DOCS)
    _close([r[0][0] for r in hf_r], [r[0][0] for r in me_r])  # per text: the summed loglikelihood
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(me_res["lme_ppl"][metric], hf_res["lme_ppl"][metric], rel_tol=1e-5), metric


def test_generate_until_strings_equal_the_hf_backend(both):
    (_, hf_s), (_, me_s) = both
    hf_cut, me_cut = _resps(hf_s, "lme_gen"), _resps(me_s, "lme_gen")
    hf_free, me_free = _resps(hf_s, "lme_gen_free"), _resps(me_s, "lme_gen_free")
    assert me_free == hf_free and me_cut == hf_cut
    free, cut = [r[0][0] for r in me_free], [r[0][0] for r in me_cut]
    assert all(f.startswith(c) for f, c in zip(free, cut))
    assert sum(c != f for c, f in zip(cut, free)) >= 3  # the stops did cut (several, different stops)
    assert not any(s in c for c in cut for s in GEN_UNTIL)


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with a chat template that has a system role and a generation prompt."""
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_dir, d)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    return str(d)


def test_chat_template_equals_the_hf_backend(chat_dir, task_dir):
    from lm_eval.models.huggingface import HFLM

    from lightning_moe.lm_eval_backend import LightningMoELM

    hf_lm = HFLM(pretrained=chat_dir, dtype="float32", device="cpu", batch_size=1, logits_cache=False)
    moe_lm = LightningMoELM(pretrained=chat_dir, device="cpu", dtype="float32")
    assert moe_lm.chat_template(True) == hf_lm.chat_template(True) == CHAT_TEMPLATE
    assert moe_lm.tokenizer_name == hf_lm.tokenizer_name
    kw = dict(apply_chat_template=True, system_instruction="Answer briefly.")
    (hf_res, hf_s), (me_res, me_s) = (_evaluate(lm, task_dir, ["lme_mc", "lme_gen"], limit=3, **kw)
                                      for lm in (hf_lm, moe_lm))
    ctx = me_s["lme_mc"][0]["arguments"][0][0]  # (context, choice) of the first choice
    assert ctx == "<s><|system|>\nAnswer briefly.\n<|user|>\nThe sky is\n<|assistant|>\n"  # rendered by the template
    assert [x["arguments"] for t in ("lme_mc", "lme_gen") for x in hf_s[t]] == \
        [x["arguments"] for t in ("lme_mc", "lme_gen") for x in me_s[t]]
    _close([c[0][0] for r in _resps(hf_s, "lme_mc") for c in r], [c[0][0] for r in _resps(me_s, "lme_mc") for c in r])
    assert me_res["lme_mc"]["acc,none"] == hf_res["lme_mc"]["acc,none"]
    assert _resps(me_s, "lme_gen") == _resps(hf_s, "lme_gen")


def test_one_plan_per_request_kind(tiny_dir, moe_lm, monkeypatch):
    """lm-eval hands over every loglikelihood request of a run at once: one LLM.score call, planned once (cgopipe: one
    prefill-only plan for all the sequences), identical pairs scored once, the same numbers as the serial executor's;
    the rolling windows of all texts: one call and one plan too."""
    from lightning_moe.app import engine
    from lightning_moe.lm_eval_backend import LightningMoELM

    plans = []
    real = engine.plan_for_job

    def plan_for_job(job, prep):
        jplan = real(job, prep)
        plans.append((job.task, job.score.mode, len(prep.treqs), jplan is not None and jplan.policy is not None))
        return jplan

    monkeypatch.setattr(engine, "plan_for_job", plan_for_job)
    lm = LightningMoELM(pretrained=tiny_dir, device="cpu", dtype="float32", executor="cgopipe")
    reqs = [Instance("loglikelihood", {}, (d["question"], c), i) for i, d in enumerate(MC_DOCS) for c in d["choices"]]
    out = lm.loglikelihood(reqs + reqs[:3], disable_tqdm=True)
    assert len(out) == len(reqs) + 3 and out[:3] == out[-3:]
    assert plans == [("score", "loglikelihood", len(reqs), True)]
    _close([x[0] for x in out[: len(reqs)]], [x[0] for x in moe_lm.loglikelihood(reqs, disable_tqdm=True)])
    plans.clear()
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d["text"],), i) for i, d in enumerate(PPL_DOCS)],
                             disable_tqdm=True)
    assert plans == [("score", "loglikelihood", len(PPL_DOCS), True)]
    lm.llm.close()


def test_hf_logits_cache_quirk(hf_lm, tiny_dir):
    """Why HFLM runs with logits_cache=False above: with its default cache, ("Hello ", "world") scored next to
    ("", "Hello world") is not its loglikelihood alone; without the cache it is (and equals ours)."""
    from lm_eval.models.huggingface import HFLM

    cached = HFLM(pretrained=tiny_dir, dtype="float32", device="cpu", batch_size=1)
    pair = [Instance("loglikelihood", {}, ("Hello ", "world"), 0),
            Instance("loglikelihood", {}, ("", "Hello world"), 0)]
    alone = hf_lm.loglikelihood(pair[:1], disable_tqdm=True)[0][0]
    assert abs(hf_lm.loglikelihood(pair, disable_tqdm=True)[0][0] - alone) < TOL
    assert abs(cached.loglikelihood(pair, disable_tqdm=True)[0][0] - alone) > 0.1


def test_the_command_line_finds_the_backend(tiny_dir, task_dir, tmp_path, both):
    """``moe-lm-eval`` (python -m lightning_moe.lm_eval_cli) is lm-eval's CLI with --model lightning-moe; and the
    package's lm_eval.models entry point names the registered class."""
    import tomllib

    from lm_eval.api.registry import get_model

    from lightning_moe.lm_eval_backend import LightningMoELM

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        ep = tomllib.load(f)["project"]["entry-points"]["lm_eval.models"]["lightning-moe"]
    mod, _, attr = ep.partition(":")
    import importlib

    assert getattr(importlib.import_module(mod), attr) is LightningMoELM is get_model("lightning-moe")

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "lightning_moe.lm_eval_cli", "--model", "lightning-moe",
                           "--model_args", f"pretrained={tiny_dir},device=cpu,dtype=float32", "--tasks", "lme_mc",
                           "--include_path", task_dir, "--output_path", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f.startswith("results")]
    assert len(files) == 1
    with open(files[0]) as f:
        res = json.load(f)["results"]["lme_mc"]
    (hf_res, _), _ = both
    assert res["acc,none"] == hf_res["lme_mc"]["acc,none"]


def test_bad_model_args_are_named(tiny_dir):
    from lightning_moe.config import ConfigError
    from lightning_moe.lm_eval_backend import LightningMoELM

    with pytest.raises(ConfigError, match="unknown model_args: trust_remote_code"):
        LightningMoELM.create_from_arg_string(f"pretrained={tiny_dir},device=cpu,trust_remote_code=True")
    with pytest.raises(ConfigError, match="max_length"):
        LightningMoELM.create_from_arg_string(f"pretrained={tiny_dir},device=cpu,max_length=999999")
