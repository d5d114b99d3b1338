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
