"""A job field is declared once (config.job_field): GenerationConfig's fields carry their parser, default, doc line and
vLLM name, and the Python API's SamplingParams keywords, a batch file's body keys, the results' provenance and
docs/REFERENCE.md's generation rows are made from them. A field added to the dataclass shows up in each of them.

No floating point is computed here: every comparison is exact (the values are carried, not transformed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import random
import sys

import pytest

from lightning_moe import config
from lightning_moe.api import SamplingParams
from lightning_moe.app import batch_files
from lightning_moe.config import ConfigError, GenerationConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_field_is_declared_with_parser_doc_and_default():
    for f in dataclasses.fields(GenerationConfig):
        assert callable(f.metadata.get("parse")), f.name
        assert f.metadata["doc"] and f.metadata["type_doc"], f.name
        assert f.default is not dataclasses.MISSING, f.name  # every key has a default
        assert config._GEN_KEYS[f.name] is f.metadata["parse"]  # the schema is the fields' parsers
        # the default passes its own parser (a tuple as YAML would give it: a list)
        d = list(f.default) if isinstance(f.default, tuple) else f.default
        if d is not None:
            assert config.generation_from_dict({f.name: d}) == GenerationConfig()
    assert set(config._GEN_KEYS) == {f.name for f in dataclasses.fields(GenerationConfig)}


def test_reference_table_holds_the_generated_rows():
    with open(os.path.join(ROOT, "docs", "REFERENCE.md"), encoding="utf-8") as f:
        rows = [ln for ln in f.read().splitlines() if ln.startswith("| `generation.")]
    want = config.reference_rows()
    assert rows == want, ("docs/REFERENCE.md's generation.* rows differ from config.reference_rows(); replace them "
                          "with:\n" + "\n".join(want))


def test_sampling_params_keywords_are_the_vllm_names():
    params = list(inspect.signature(SamplingParams).parameters.values())
    fields = config.vllm_fields()
    assert [p.name for p in params] == [f.metadata["vllm"] for f in fields]
    for p, f in zip(params, fields):
        assert p.default == f.metadata["vllm_default"]
    # every field without a vLLM name is one the API sets another way; today every generation key has one
    assert len(fields) == len(dataclasses.fields(GenerationConfig))


def test_sampling_params_carry_every_field_to_the_job():
    """Fresh random values under the vLLM names reach GenerationConfig unchanged (ignore_eos negated)."""
    rng = random.Random()
    for _ in range(20):
        kw = dict(max_tokens=rng.randint(1, 4096), temperature=rng.choice([0.0, rng.uniform(0.01, 3)]),
                  top_p=rng.uniform(0.01, 1.0), seed=rng.randint(0, 2**40), ignore_eos=rng.random() < 0.5,
                  stop=[str(rng.random())], stop_token_ids=[rng.randint(0, 999)], logprobs=rng.randint(0, 20))
        gen = GenerationConfig(**config._section({"generation": SamplingParams(**kw).generation()}, "generation",
                                                 config._Ctx("t", ".")))
        assert (gen.max_new_tokens, gen.temperature, gen.top_p, gen.seed, gen.stop_at_eos, list(gen.stop),
                list(gen.stop_token_ids), gen.logprobs) == \
            (kw["max_tokens"], kw["temperature"], kw["top_p"], kw["seed"], not kw["ignore_eos"], kw["stop"],
             kw["stop_token_ids"], kw["logprobs"])


def test_batch_body_keys_are_the_vllm_names():
    names = {f.metadata["vllm"] for f in config.vllm_fields() if f.name not in batch_files._SPECIAL}
    assert names <= batch_files._USED
    body = {"prompt": "x", "temperature": 0.5, "top_p": 0.25, "seed": 3, "ignore_eos": True, "stop": "##",
            "stop_token_ids": [4]}
    _p, gen, _src = batch_files._body(body, "completion", 16)
    assert gen == {"max_new_tokens": 16, "temperature": 0.5, "top_p": 0.25, "seed": 3, "stop_at_eos": False,
                   "stop": ["##"], "stop_token_ids": [4]}
    # greedy: the sampling-only keys at their defaults (one group whatever they are); unset when_set keys left out
    _p, gen, _src = batch_files._body({"prompt": "x", "temperature": 0, "top_p": 0.5, "seed": 9}, "completion", 16)
    assert gen == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_at_eos": True}


def test_provenance_leaves_out_unset_when_set_fields():
    """meta.json of results written before a when_set key existed still matches: the key is absent at its default."""
    base = config.recorded(dataclasses.asdict(GenerationConfig()))
    assert base == {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_at_eos": True}
    for f in dataclasses.fields(GenerationConfig):
        if f.metadata["when_set"]:
            assert f.name not in base


# ------------------------------------------------------------------------------------------------
# a field added to the dataclass shows up everywhere (a derived GenerationConfig, fresh module copies)
# ------------------------------------------------------------------------------------------------
def _fresh(module: str):
    """A new copy of ``lightning_moe.<module>`` (its module-level tables made again), not registered in sys.modules."""
    spec = importlib.util.find_spec(f"lightning_moe.{module}")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


@pytest.fixture
def extended(monkeypatch):
    """GenerationConfig with one more job_field, ``widget`` (vLLM name ``widget_v``, int in 2..9)."""
    cls = dataclasses.make_dataclass(
        "GenerationConfig",
        [("widget", int, config.job_field(5, config._p_int(lo=2, hi=9), "int in 2..9", "a test-only key",
                                          vllm="widget_v", sampling=True, when_set=True))],
        bases=(GenerationConfig,), frozen=True)
    monkeypatch.setattr(config, "GenerationConfig", cls)
    monkeypatch.setitem(config._SECTIONS, "generation", {f.name: f.metadata["parse"] for f in dataclasses.fields(cls)})
    yield cls
    assert "widget_v" not in inspect.signature(SamplingParams).parameters  # the real module is untouched


def test_an_added_field_reaches_api_batch_provenance_and_docs(extended, tmp_path):
    api = _fresh("api")
    assert list(inspect.signature(api.SamplingParams).parameters)[-1] == "widget_v"
    assert api.SamplingParams(widget_v=7).generation()["widget"] == 7
    with pytest.raises(ConfigError, match=r"^SamplingParams: widget_v \(generation.widget\): must be <= 9, got 10$"):
        api.SamplingParams(widget_v=10)
    bf = _fresh("app.batch_files")
    assert "widget_v" in bf._USED
    _p, gen, _src = bf._body({"prompt": "x", "temperature": 1.0, "widget_v": 3}, "completion", 16)
    assert gen["widget"] == 3
    _p, gen, _src = bf._body({"prompt": "x", "temperature": 1.0}, "completion", 16)
    assert "widget" not in gen  # when_set at its default: groups (and their files) as before the key existed
    with pytest.raises(bf._Bad, match=r"^body.widget_v: must be >= 2, got 1$"):
        bf._body({"prompt": "x", "widget_v": 1}, "completion", 16)
    assert config.recorded({"temperature": 0.5, "widget": 3}) == {"temperature": 0.5, "widget": 3}
    assert config.recorded({"temperature": 0.5, "widget": 5}) == {"temperature": 0.5}
    assert config.reference_rows()[-1] == ("| `generation.widget` | int in 2..9 | 5 | a test-only key "
                                           "(vLLM: `widget_v`) |")
    yml = tmp_path / "job.yaml"
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    yml.write_text("model: tiny-mixtral\ndata: {path: in.jsonl}\noutput: {path: out.jsonl}\ngeneration:\n"
                   "  temperature: 0.5\n  widget: 8\n")
    job = config.load_job(str(yml), notify=False)
    assert job.generation.widget == 8
    from lightning_moe.app.engine import results_provenance
    assert results_provenance(job)["generation"]["widget"] == 8
    yml.write_text(yml.read_text().replace("widget: 8", "widget: 11"))
    with pytest.raises(ConfigError, match=rf"^{yml}:6: generation.widget: must be <= 9, got 11$"):
        config.load_job(str(yml), notify=False)
    assert "lightning_moe.api" in sys.modules and sys.modules["lightning_moe.api"] is not api


# ------------------------------------------------------------------------------------------------
# generation.top_k and generation.min_p (added in config.py only: one job_field each)
# ------------------------------------------------------------------------------------------------
def _job_yaml(tmp_path, gen_lines: str):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    yml = tmp_path / "job.yaml"
    yml.write_text(f"model: tiny-mixtral\ndata: {{path: in.jsonl}}\noutput: {{path: out.jsonl}}\ngeneration:\n"
                   f"  temperature: 0.8\n{gen_lines}")
    return yml


def test_top_k_min_p_from_yaml(tmp_path):
    rng = random.Random()
    for _ in range(10):
        k, p = rng.randint(1, 50000), rng.uniform(0.0, 1.0)
        job = config.load_job(str(_job_yaml(tmp_path, f"  top_k: {k}\n  min_p: {p!r}\n")), notify=False)
        assert (job.generation.top_k, job.generation.min_p) == (k, p)
    job = config.load_job(str(_job_yaml(tmp_path, "  top_k: -1\n  min_p: 1e-2\n")), notify=False)
    assert (job.generation.top_k, job.generation.min_p) == (0, 0.01)  # vLLM's -1 is off; YAML's '1e-2' a number
    job = config.load_job(str(_job_yaml(tmp_path, "")), notify=False)
    assert (job.generation.top_k, job.generation.min_p) == (0, 0.0)


@pytest.mark.parametrize("line, msg", [
    ("top_k: -2", "generation.top_k: must be >= -1, got -2"),
    ("top_k: 1.5", "generation.top_k: expected an integer, got 1.5 (a number)"),
    ("top_k: true", "generation.top_k: expected an integer, got True (a boolean)"),
    ("min_p: 1.5", "generation.min_p: must be <= 1.0, got 1.5"),
    ("min_p: -0.1", "generation.min_p: must be >= 0.0, got -0.1"),
    ("min_p: low", "generation.min_p: expected a number, got 'low' (a string)"),
])
def test_top_k_min_p_bad_values_name_file_line_and_field(tmp_path, line, msg):
    yml = _job_yaml(tmp_path, f"  seed: 1\n  {line}\n")
    with pytest.raises(ConfigError) as e:
        config.load_job(str(yml), notify=False)
    assert str(e.value) == f"{yml}:7: {msg}"
    assert "\n" not in str(e.value)


def test_top_k_min_p_in_the_api():
    gen = SamplingParams(temperature=1.0, top_k=40, min_p=0.05).generation()
    assert (gen["top_k"], gen["min_p"]) == (40, 0.05)
    assert SamplingParams(top_k=-1).generation()["top_k"] == -1  # checked as the job's: -1 is read as 0 there
    gen = SamplingParams(top_k=-1, min_p=0.5).generation()
    job = config.job_from_dict({"model": "tiny-mixtral", "generation": gen}, in_memory=True)
    assert (job.generation.top_k, job.generation.min_p) == (0, 0.5)
    with pytest.raises(ConfigError, match=r"^SamplingParams: top_k \(generation.top_k\): must be >= -1, got -2$"):
        SamplingParams(top_k=-2)
    with pytest.raises(ConfigError, match=r"^SamplingParams: min_p \(generation.min_p\): must be <= 1.0, got 2.0$"):
        SamplingParams(min_p=2)


def test_top_k_min_p_in_a_batch_body():
    body = {"prompt": "x", "temperature": 0.7, "top_k": 40, "min_p": 0.1}
    _p, gen, _src = batch_files._body(body, "completion", 16)
    assert (gen["top_k"], gen["min_p"]) == (40, 0.1)
    _p, gen, _src = batch_files._body(dict(body, temperature=0), "completion", 16)
    assert "top_k" not in gen and "min_p" not in gen  # greedy: they change nothing, the line joins the greedy group
    _p, gen, _src = batch_files._body(dict(body, top_k=-1, min_p=0), "completion", 16)
    assert "top_k" not in gen and "min_p" not in gen  # off: the group of a body without them
    for k, v, msg in (("top_k", "5", "body.top_k: expected an integer, got a string"),
                      ("top_k", -3, "body.top_k: must be >= -1, got -3"),
                      ("min_p", 2, "body.min_p: must be <= 1.0, got 2.0")):
        with pytest.raises(batch_files._Bad, match="^" + msg.replace(".", r"\.") + "$"):
            batch_files._body(dict(body, **{k: v}), "completion", 16)


def test_top_k_min_p_in_the_provenance(tmp_path):
    from lightning_moe.app.engine import results_provenance

    job = config.load_job(str(_job_yaml(tmp_path, "")), notify=False)
    assert "top_k" not in results_provenance(job)["generation"]  # results written before the keys existed match
    assert "min_p" not in results_provenance(job)["generation"]
    job = config.load_job(str(_job_yaml(tmp_path, "  top_k: 7\n  min_p: 0.25\n")), notify=False)
    assert results_provenance(job)["generation"]["top_k"] == 7
    assert results_provenance(job)["generation"]["min_p"] == 0.25


def test_top_k_min_p_reach_the_sampler_against_its_reference(tmp_path):
    """A job's top_k / min_p drive the vectorized sampler (pipeline.sampling.DecodeSampling.from_config reads
    ``job.generation.top_k`` and ``.min_p``): on fresh random logits (B 13, V 333) the drawn tokens equal the float64
    reference race's with the same keys (kernels.sampling.sample_tokens_reference; >= 90% of rows: fp32 near-ties)
    and each has probability > 0 in the reference distribution (outside the top-k / below min_p: 0). Skipped where that sampler is not in the tree yet."""
    sampling = pytest.importorskip("lightning_moe.pipeline.sampling")
    if not hasattr(sampling, "DecodeSampling"):
        pytest.skip("pipeline.sampling.DecodeSampling is not in this tree")
    import torch

    from lightning_moe.kernels.sampling import keys_from_seeds, reference_probs, sample_tokens_reference

    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    for _ in range(5):
        k, p, t = rng.randint(1, 60), rng.choice([0.0, rng.uniform(0.001, 0.3)]), rng.uniform(0.5, 2.0)
        job = config.load_job(str(_job_yaml(tmp_path, f"  temperature: {t!r}\n  top_k: {k}\n  min_p: {p!r}\n")),
                              notify=False)
        params = sampling.DecodeSampling.from_config(job.generation)
        assert (params.top_k, params.min_p, params.temperature) == (k, p, t)
        B, V = 13, 333
        logits = torch.randn(B, V, generator=g) * 3
        seeds = [rng.randint(0, 2**62) for _ in range(B)]
        positions = [rng.randint(0, 100) for _ in range(B)]
        tok = sampling.sample(logits, params, seeds, positions)
        keys = keys_from_seeds([sampling.position_seed(s, q) for s, q in zip(seeds, positions)])
        probs = reference_probs(logits, t, 1.0, k, p)
        ref = sample_tokens_reference(logits, t, 1.0, k, p, keys)  # the same race in float64, row by row
        assert (tok == ref).float().mean() >= 0.9, (k, p, t, tok, ref)  # fp32 vs float64 near-ties aside
        assert (probs.gather(1, tok.view(B, 1)) > 0).all(), "drew a token that top_k / min_p remove"
        assert ((probs > 0).sum(-1) <= k).all()  # the reference keeps at most k tokens
