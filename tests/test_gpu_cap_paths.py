"""The load-time GPU cap check (app.plan.fit_plan_to_cap / check_gpu_cap) on every path that runs a plan: the Python
API's calls (its LLM applies the cap once, in the constructor) and an executor a ModelRunner keeps for a later job."""

import pytest

from lightning_moe import LLM, SamplingParams
from lightning_moe.policy.policy import PolicyError

MiB = 1 << 20


def _tight_cap(cap_bytes: int, limit: int) -> dict:
    """apply_gpu_cap's result for a process holding all but ``limit`` bytes of ``cap_bytes`` outside torch."""
    return {"cap_bytes": cap_bytes, "outside_torch_bytes": cap_bytes - limit, "other_processes_bytes": 0,
            "torch_limit_bytes": limit, "fraction": 0.0, "device_total_bytes": cap_bytes}


def test_the_api_checks_its_plans_against_the_cap_it_applied(tiny_dir):
    """An LLM whose cap left torch less than its policy's largest phase needs is refused before running (one line,
    as `moe-batch run` refuses it), by generate, score and plan alike; without the check it ran into the cap (the
    session-41 out-of-memory on a GPU)."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32", executor="cgopipe", gpu_memory="2GiB",
              policy={"mu": 3, "n": 1})
    llm.gpu_cap = _tight_cap(2 << 30, 8 * MiB)  # what apply_gpu_cap gives on a CUDA device with a large context
    with pytest.raises(PolicyError, match="do not fit"):
        llm.generate(["alpha beta"] * 3, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    with pytest.raises(PolicyError, match="do not fit"):
        llm.score([("alpha beta", " gamma")], "loglikelihood", use_tqdm=False)
    with pytest.raises(PolicyError, match="do not fit"):
        llm.plan(["alpha beta"] * 3, SamplingParams(max_tokens=3))
    llm.gpu_cap = _tight_cap(2 << 30, 1 << 30)  # room enough: runs
    assert len(llm.generate(["alpha beta"] * 3, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)) == 3


def test_a_kept_executor_whose_policy_does_not_fit_the_cap_is_replaced(tiny_dir, tmp_path, monkeypatch):
    """ModelRunner.executor keeps a held executor whose policy differs from the new plan's when check_plan says it fits
    the job's budgets; it must also fit what this job's cap leaves torch (check_gpu_cap), else a later job of `moe-batch
    run-batch` or the API runs the kept policy into the cap. Here the held policy attends one micro-batch on the GPU
    (a larger decode phase): it fits gpu_memory, not what this cap leaves torch, which the new plan fits: rebuilt."""
    import dataclasses

    from lightning_moe.app import engine
    from lightning_moe.app.plan import ModelFiles, Prepared, _cap_need
    from lightning_moe.config import job_from_dict
    from lightning_moe.pipeline.cgopipe import expert_ffn_for

    (tmp_path / "p.jsonl").write_text("".join(f'{{"id": "{i}", "prompt": "alpha beta {i}"}}\n' for i in range(4)))
    job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": str(tmp_path / "p.jsonl")},
                         "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cpu", "dtype": "float32",
                         "executor": "cgopipe", "gpu_memory": "2GiB"}, "t.yaml")
    prep = Prepared(job)
    jplan = engine.plan_for_job(job, prep)
    old = dataclasses.replace(jplan.policy, n_gpu_attn=1)
    assert _cap_need(engine.check_plan(job, prep, old, hw=jplan.hardware))[1] > _cap_need(jplan)[1] + 100_000

    class Held:
        policy, estimate, stats = old, None, None

        def close(self):
            pass

    runner = engine.ModelRunner(ModelFiles(job.model), job.dtype)
    runner._executor = Held()
    runner._key = (job.executor, job.device, expert_ffn_for(job, prep.spec, engine._expert_scheme(prep)))
    built = object()
    monkeypatch.setattr(engine, "make_executor", lambda *a, **k: built)
    monkeypatch.setattr(runner, "load_weights", lambda **k: None)
    cap = _tight_cap(2 << 30, _cap_need(jplan)[1] + 100_000)  # the new plan fits, the held one does not
    assert runner.executor(job, prep, jplan, cap) is built
    runner._executor, runner._key = Held(), (job.executor, job.device,
                                             expert_ffn_for(job, prep.spec, engine._expert_scheme(prep)))
    assert runner.executor(job, prep, jplan, _tight_cap(2 << 30, 1 << 30)) is not built  # room: kept
