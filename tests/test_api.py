"""The Python API (lightning_moe.api) on the embedded tiny model, fp32 on the CPU: the same records as `moe-batch run`
for the same job (generation, chat, scoring), its errors, and one weight read for many calls."""

import json
import os
import subprocess
import sys

import pytest

from lightning_moe import LLM, SamplingParams
from lightning_moe.app import engine
from lightning_moe.config import ConfigError, job_from_dict, load_job
from lightning_moe.data.sources import DataError
from lightning_moe.data.writer import read_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
PROMPTS = [" ".join(WORDS[: 1 + (i * 3) % 8]) + f" number {i}" for i in range(10)]


def _cli_run(tmp_path, tiny_dir, lines, data_keys=None, **keys) -> tuple[dict, str]:
    """Write ``lines`` as a JSONL file and a job YAML over it (``data_keys`` added to its data section), run
    ``python3 -m lightning_moe.cli run`` in a subprocess, and return (the records by id, the YAML's path)."""
    import yaml

    name = "job"
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    job = {"model": tiny_dir, "data": {"source": "jsonl", "path": str(data), **(data_keys or {})},
           "output": {"path": str(tmp_path / f"{name}.out.jsonl")}, "device": "cpu", "dtype": "float32", **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lightning_moe.cli", "run", str(path), "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in read_results(job["output"]["path"])}, str(path)


def _same_generation_record(rec: dict, out) -> None:
    """Every field of a generate record of `moe-batch run` equals the RequestOutput's (a field the API does not
    carry fails here)."""
    as_api = {"id": out.request_id, "prompt_tokens": len(out.prompt_token_ids), "output_ids": out.token_ids,
              "output_tokens": len(out.token_ids)}
    for k, v in rec.items():
        assert k in as_api or hasattr(out, k), f"record field {k!r} missing from RequestOutput"
        assert as_api.get(k, getattr(out, k, None)) == v, k


@pytest.fixture
def load_count(monkeypatch):
    """Counts the checkpoint reads of the engine (the one loader both the CLI and the API go through)."""
    calls = {"n": 0}
    real = engine.load_checkpoint

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(engine, "load_checkpoint", counting)
    return calls


@pytest.mark.parametrize("executor,generation", [
    ("serial", {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 5}),  # sampled: seeded by the ids
    ("cgopipe", {"max_new_tokens": 5, "temperature": 0.0, "stop_at_eos": False}),
    ("cgopipe", {"max_new_tokens": 8, "temperature": 0.0, "stop_at_eos": False, "stop": ["e", "an"],
                 "stop_token_ids": [13]}),  # stop strings and a stop id: the same cut records
])
def test_generate_returns_the_records_of_the_cli(tmp_path, tiny_dir, executor, generation):
    ids = [f"q{i}" for i in range(len(PROMPTS))]
    recs, _ = _cli_run(tmp_path, tiny_dir, [{"id": i, "prompt": p} for i, p in zip(ids, PROMPTS)],
                       executor=executor, batch_size=4, generation=generation)
    sp = SamplingParams(max_tokens=generation["max_new_tokens"], temperature=generation["temperature"],
                        top_p=generation.get("top_p", 1.0), seed=generation.get("seed", 0),
                        ignore_eos=not generation.get("stop_at_eos", True), stop=generation.get("stop"),
                        stop_token_ids=generation.get("stop_token_ids"))
    with LLM(tiny_dir, device="cpu", dtype="float32", executor=executor, batch_size=4) as llm:
        outs = llm.generate(PROMPTS, sp, request_ids=ids, use_tqdm=False)
    assert [o.request_id for o in outs] == ids and [o.prompt for o in outs] == PROMPTS  # input order
    assert len({tuple(o.token_ids) for o in outs}) > 1
    if generation.get("stop"):  # the stops fire (and cut) in this case
        assert any(o.finish_reason == "stop" and len(o.token_ids) < generation["max_new_tokens"] for o in outs)
    for o in outs:
        _same_generation_record(recs[o.request_id], o)
    assert outs[0].prompt_token_ids == llm.get_tokenizer()(PROMPTS[0])["input_ids"]


def test_chat_messages_are_rendered_as_the_jobs_chat_template(tmp_path, tiny_dir):
    convs = [[{"role": "user", "content": "What is two plus two?"}],
             [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Count to three."}]]
    lines = [{"id": str(i), "messages": m} for i, m in enumerate(convs)]
    recs, job_path = _cli_run(tmp_path, tiny_dir, lines, data_keys={"chat_template": True, "system_prompt": "Be brief."},
                              executor="serial", generation={"max_new_tokens": 4})
    llm = LLM(tiny_dir, device="cpu", dtype="float32", system_prompt="Be brief.")
    outs = llm.generate(convs, SamplingParams(max_tokens=4), use_tqdm=False)
    job = load_job(job_path)
    from lightning_moe.app.plan import Prepared

    prep = Prepared(job)  # the job's own tokenization (data.chat_template: true, data.system_prompt)
    tok = llm.get_tokenizer()
    for o, tr, conv in zip(outs, prep.treqs, convs):
        assert o.prompt == conv and o.prompt_token_ids == tr.prompt_ids
        _same_generation_record(recs[o.request_id], o)
        with_system = conv if conv[0]["role"] == "system" else [{"role": "system", "content": "Be brief."}] + conv
        assert o.prompt_token_ids == list(tok.apply_chat_template(with_system, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False))
    one = llm.generate(convs[0], SamplingParams(max_tokens=4), use_tqdm=False)  # a single conversation as it is
    assert len(one) == 1 and one[0].token_ids == outs[0].token_ids


def test_chat_template_kwargs_keyword(tiny_dir):
    """``chat_template_kwargs`` is data.chat_template_kwargs of every call's job; a bad one is named."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32", chat_template_kwargs={"enable_thinking": False})
    assert llm.job.data.chat_template_kwargs == {"enable_thinking": False}
    llm.close()
    with pytest.raises(ConfigError, match=r"LLM: data\.chat_template_kwargs\.tokenize: an argument of apply_chat"):
        LLM(tiny_dir, device="cpu", chat_template_kwargs={"tokenize": True})


def test_score_loglikelihood_matches_the_cli(tmp_path, tiny_dir):
    pairs = [(f"{a} + {b} =", f" {a + b}") for a, b in [(2, 2), (3, 5), (10, 7), (1, 1), (12, 30), (6, 6)]]
    recs, _ = _cli_run(tmp_path, tiny_dir, [{"id": str(i), "prompt": c, "continuation": x}
                                            for i, (c, x) in enumerate(pairs)],
                       task="score", score={"mode": "loglikelihood"}, batch_size=4)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", batch_size=4)
    outs = llm.score(pairs, "loglikelihood", use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(pairs))]
    for o in outs:
        rec = recs[o.request_id]
        assert set(rec) - {"id"} <= {f for f in vars(o)}, "a score record field is missing from the output"
        for k, v in rec.items():
            got = o.request_id if k == "id" else getattr(o, k)
            assert got == pytest.approx(v, abs=1e-6) if isinstance(v, float) else got == v, k
    mc = llm.score([{"id": "m", "prompt": "2 + 2 =", "choices": [" 4", " 5"], "answer": 0}], "multiple_choice",
                   use_tqdm=False)[0]
    assert mc.request_id == "m" and len(mc.choice_logprobs) == 2 and mc.correct == (mc.pick == 0)
    ppl = llm.score(["alpha beta gamma delta"], "perplexity", use_tqdm=False)[0]
    assert ppl.scored_tokens == ppl.tokens - 1 and ppl.perplexity > 1


def test_plan_is_the_jobs_plan(tmp_path, tiny_dir):
    """llm.plan: the policy `moe-batch run` plans for the same job (no weights read beyond the constructor's)."""
    from lightning_moe.app.plan import Prepared, plan_job

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": str(data)},
                         "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cpu", "dtype": "float32",
                         "executor": "cgopipe", "gpu_memory": "2GiB", "generation": {"max_new_tokens": 7}}, "t.yaml")
    want = plan_job(job, Prepared(job))
    llm = LLM(tiny_dir, device="cpu", dtype="float32", executor="cgopipe", gpu_memory="2GiB")
    got = llm.plan(PROMPTS, SamplingParams(max_tokens=7))
    assert got.policy == want.policy and got.estimate.e2e_tok_s == want.estimate.e2e_tok_s
    assert got.gpu_budget == 2 * 2**30
    scoring = llm.plan([("a b", " c")] * 5, mode="loglikelihood")
    assert scoring.policy.n_gpu_attn == scoring.policy.n  # a prefill-only plan


def test_unknown_keyword_and_unsupported_sampling_fields_are_named(tiny_dir, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(engine, "load_checkpoint", boom)  # every refusal comes before any weight is read
    with pytest.raises(ConfigError, match=r"LLM: gpu_memroy: unknown keyword \(did you mean 'gpu_memory'\?\)"):
        LLM(tiny_dir, device="cpu", gpu_memroy="1GiB")
    with pytest.raises(ConfigError, match=r"LLM: task: not an LLM keyword: generate\(\) and score\(\)"):
        LLM(tiny_dir, device="cpu", task="score")
    with pytest.raises(ConfigError, match=r"LLM: dtype: expected one of"):
        LLM(tiny_dir, device="cpu", dtype="fp32")
    with pytest.raises(ConfigError, match=r"LLM: model: checkpoint directory not found"):
        LLM(os.path.join(tiny_dir, "nope"), device="cpu")
    with pytest.raises(ConfigError, match=r"SamplingParams: logprobs \(generation.logprobs\): must be <= 20"):
        SamplingParams(logprobs=21)
    assert SamplingParams(logprobs=0).generation()["logprobs"] == 0
    SamplingParams(stop=None, stop_token_ids=[], logprobs=None)  # nothing asked for: fine
    assert SamplingParams(stop="###").generation()["stop"] == ["###"]
    with pytest.raises(ConfigError, match=r"generation.stop_token_ids\[0\]: must be >= 0"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ConfigError, match=r"SamplingParams: max_tokens \(generation.max_new_tokens\): must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match=r"SamplingParams: temperature \(generation.temperature\): expected a number"):
        SamplingParams(temperature="hot")
    with pytest.raises(ConfigError, match=r"SamplingParams: ignore_eos \(generation.stop_at_eos\): expected true or false"):
        SamplingParams(ignore_eos=1)


def test_in_memory_jobs_take_no_files():
    """config.job_from_dict(in_memory=True), the API's jobs: no output, and data holds only the prompt formatting."""
    job = job_from_dict({"model": "tiny-mixtral", "data": {"truncate": "left"}}, "LLM", in_memory=True)
    assert job.output is None and job.data.source == "memory" and job.data.truncate == "left"
    with pytest.raises(ConfigError, match=r"LLM: data.path: unknown key; allowed keys: chat_template, system_prompt"):
        job_from_dict({"model": "tiny-mixtral", "data": {"path": "x.jsonl"}}, "LLM", in_memory=True)
    with pytest.raises(ConfigError, match=r"LLM: output: not used when the requests are given in memory"):
        job_from_dict({"model": "tiny-mixtral", "output": {"path": "o.jsonl"}}, "LLM", in_memory=True)
    with pytest.raises(ConfigError, match=r"t.yaml: data: required key is missing"):  # a YAML job still needs both
        job_from_dict({"model": "tiny-mixtral"}, "t.yaml")


def test_bad_prompts_are_named(tiny_dir):
    llm = LLM(tiny_dir, device="cpu", dtype="float32")
    with pytest.raises(DataError, match=r"^prompts\[1\]: prompt: empty string"):
        llm.generate(["fine", "  "], use_tqdm=False)
    with pytest.raises(DataError, match=r"^prompts\[0\]: messages\[0\].role: 'robot' is not a chat role"):
        llm.generate([[{"role": "robot", "content": "beep"}]], use_tqdm=False)
    with pytest.raises(ValueError, match="strings and chat conversations mix"):
        llm.generate(["a", [{"role": "user", "content": "b"}]], use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[0\]: expected a string"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(DataError, match=r"prompts\[1\]: id: duplicate id 'a'"):
        llm.generate(["x", "y"], request_ids=["a", "a"], use_tqdm=False)
    with pytest.raises(DataError, match=r"^requests\[0\]: continuation: missing"):
        llm.score([{"prompt": "a"}], "loglikelihood", use_tqdm=False)
    with pytest.raises(ConfigError, match="mode: expected one of"):
        llm.score(["a"], "accuracy", use_tqdm=False)


@pytest.mark.parametrize("executor", ["serial", "cgopipe"])
def test_weights_are_read_once_for_many_calls(tiny_dir, load_count, executor):
    """Two generate calls of different workloads and a scoring call read the checkpoint once (the constructor's);
    the reused executor gives what a fresh one does."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32", executor=executor, batch_size=4)
    assert load_count["n"] == 1
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    first = llm.generate(PROMPTS, sp, use_tqdm=False)
    second = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    scores = llm.score([("alpha beta", " gamma")], "loglikelihood", use_tqdm=False)
    again = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert load_count["n"] == 1
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    llm.close()
    fresh = LLM(tiny_dir, device="cpu", dtype="float32", executor="serial", batch_size=4)  # the reference
    assert [o.token_ids for o in fresh.generate(PROMPTS[:3], SamplingParams(max_tokens=8, ignore_eos=True),
                                                use_tqdm=False)] == [o.token_ids for o in second]
    ref = fresh.score([("alpha beta", " gamma")], "loglikelihood", use_tqdm=False)
    assert scores[0].logprob == pytest.approx(ref[0].logprob, abs=1e-5)


def test_a_kept_policy_too_slow_for_a_later_call_is_replaced(tiny_dir, load_count, capsys):
    """cgopipe planned for 3 prompts, then 40: the kept policy (N 3) is predicted far below the planner's for 40, so
    the executor is rebuilt with the planner's policy, reading the weights again (said on stderr); tokens as serial."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32", executor="cgopipe")
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate(PROMPTS[:3], sp, use_tqdm=False)
    many = PROMPTS * 4
    outs = llm.generate(many, sp, use_tqdm=False)
    assert load_count["n"] == 2
    assert "rebuilding with the planner's" in capsys.readouterr().err
    ref = LLM(tiny_dir, device="cpu", dtype="float32", executor="serial", batch_size=40).generate(many, sp,
                                                                                               use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_import_stays_light():
    """`import lightning_moe` imports neither torch nor the API; `from lightning_moe import LLM` works."""
    code = ("import sys, lightning_moe; assert 'torch' not in sys.modules and 'lightning_moe.api' not in sys.modules; "
            "from lightning_moe import LLM, SamplingParams; assert LLM.__module__ == 'lightning_moe.api'; "
            "lightning_moe.nothing")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                          text=True, timeout=120)
    assert "AttributeError: module 'lightning_moe' has no attribute 'nothing'" in proc.stderr, proc.stderr


def test_library_messages_are_named_for_the_library_and_cgopipe_reads_lazily(tiny_dir, capfd, monkeypatch):
    """The engine's messages from the API start with ``lightning_moe:`` (not the command's name), and an LLM for cgopipe
    leaves the experts in the files until its page pool takes them (the host peak the planner budgets)."""
    from lightning_moe.app import engine
    from lightning_moe.model.weights import ExpertsOnDisk

    monkeypatch.setattr(engine, "LOUD_LOAD_BYTES", 1)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", executor="cgopipe", policy={"mu": 2, "n": 2})
    assert all(isinstance(e, ExpertsOnDisk) for e in llm._runner._weights.experts)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3))
    assert len(out[0].token_ids) == 3
    err = capfd.readouterr().err
    assert "lightning_moe: reading " in err and "lightning_moe: executor ready in " in err, err
    assert "moe-batch:" not in err
    serial = LLM(tiny_dir, device="cpu", dtype="float32")
    assert not any(isinstance(e, ExpertsOnDisk) for e in serial._runner._weights.experts)
