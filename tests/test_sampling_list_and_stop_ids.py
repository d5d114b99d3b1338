"""LLM.generate with one SamplingParams per prompt (vLLM's rule), and stop_token_ids checked against the model's
vocabulary before any weight is read (job key, API, run-batch)."""

import json

import pytest

from lightning_moe import LLM, SamplingParams
from lightning_moe.app import engine
from lightning_moe.config import ConfigError, load_job


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir, device="cpu", dtype="float32") as m:
        yield m


def test_one_sampling_params_per_prompt(llm):
    """Each prompt decodes with its own parameters: the same output as that prompt with those parameters alone
    (same request id), in input order; equal parameters share a run."""
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]
    sps = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=6, temperature=0.9, seed=4),
           SamplingParams(max_tokens=3), SamplingParams(max_tokens=2, ignore_eos=True)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert [len(o.token_ids) <= sp.max_tokens for o, sp in zip(outs, sps)] == [True] * 4
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        alone = llm.generate([p], sp, request_ids=[str(i)], use_tqdm=False)[0]
        assert alone.token_ids == outs[i].token_ids and alone.text == outs[i].text
    same = llm.generate(prompts, [sps[0]] * 4, use_tqdm=False)
    assert [o.token_ids for o in same] == [o.token_ids for o in llm.generate(prompts, sps[0], use_tqdm=False)]


def test_sampling_params_list_errors(llm, monkeypatch):
    monkeypatch.setattr(engine, "_run_work", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    with pytest.raises(ValueError, match=r"sampling_params: 1 SamplingParams for 2 prompts \(prompts\[1\] has none\)"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params: 3 SamplingParams for 2 prompts \(sampling_params\[2\] has "
                                         r"no prompt\)"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\]: expected a SamplingParams, got dict"):
        llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}], use_tqdm=False)
    from lightning_moe.data.sources import DataError

    with pytest.raises(DataError, match=r"prompts\[2\]"):  # a bad prompt of the second group, before anything runs
        llm.generate(["a", "b", ""], [SamplingParams(), SamplingParams(max_tokens=2), SamplingParams(max_tokens=2)],
                     use_tqdm=False)


def test_stop_token_ids_outside_vocab_api(llm, monkeypatch):
    monkeypatch.setattr(engine, "_run_work", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    V = llm.spec.vocab_size
    with pytest.raises(ValueError, match=rf"^sampling_params.stop_token_ids\[1\]: {V} is outside the model's "
                                         rf"vocabulary \[0, {V}\)"):
        llm.generate(["a"], SamplingParams(stop_token_ids=[2, V]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\].stop_token_ids\[0\]: "):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(stop_token_ids=[V + 5])], use_tqdm=False)


def test_stop_token_ids_outside_vocab_job(tiny_dir, tmp_path, monkeypatch):
    """The job's error names the YAML as typed and the field, before any weight is read."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    (tmp_path / "job.yaml").write_text(f"model: {tiny_dir}\ndevice: cpu\ndata: {{path: p.jsonl}}\n"
                                       f"generation: {{stop_token_ids: [3, 99999999]}}\noutput: {{path: o.jsonl}}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    job = load_job("job.yaml")
    with pytest.raises(ConfigError, match=r"^job.yaml: generation.stop_token_ids\[1\]: 99999999 is outside the "
                                          r"model's vocabulary \[0, \d+\)"):
        engine.run_job(job, progress=False)
    assert not (tmp_path / "o.jsonl").exists()
