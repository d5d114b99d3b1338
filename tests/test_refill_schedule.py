"""The refill schedule, planned and replayed (issue 43, real generation jobs): policy.refill_schedule.simulate against
schedules worked out by hand and against what the cgopipe executor ran (decode steps, prefill passes, slot-steps,
decode tokens: exact integers); the HRM's per-step / per-pass times against hrm.evaluate; the HRM refill threshold;
the report's ``refill`` block (the schedule over the measured lengths and its HRM price)."""

import dataclasses
import math
import os
import random

import pytest
import torch

from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.policy import hrm, jobplan
from lightning_moe.policy.hardware import resolve_hardware
from lightning_moe.policy.policy import Policy, Workload
from lightning_moe.policy.refill_schedule import RefillCall, hrm_min_free, simulate
from lightning_moe.policy.registry import resolve_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_PROFILE = os.path.join(REPO, "lightning_moe", "policy", "profiles", "h200-host.yaml")


def test_simulate_by_hand():
    """5 requests of 3 prompt tokens (needs 10), outputs 4, 1, 2, 5, 3, N = 2, min_free 1. Fill 0, 1 (1 finishes at its
    first token; 0 finishes at step 3); refill 2 (finishes step 1); step 1; refill 3 (finishes step 5); steps 2, 3;
    refill 4 (finishes step 5); steps 4, 5 (the drain: 2 steps after the last pass). Positions attended per step:
    request 0 at steps 1-3: 4, 5, 6; 2 at step 1: 4; 3 at steps 2-5: 4..7; 4 at steps 4-5: 4, 5."""
    s = simulate([10] * 5, [3] * 5, [4, 1, 2, 5, 3], 2, 1)
    assert s.passes == ((2, 6), (1, 3), (1, 3), (1, 3))
    assert s.steps == ((2, 8), (2, 9), (2, 11), (2, 10), (2, 12))
    assert s.drain_steps == 2 and s.decode_tokens == 10 and s.generated_tokens == 15 and s.slot_occupancy == 1.0
    # every request done at its first token: passes repeat with no step (the executor's _refill loop)
    s = simulate([10] * 5, [3, 4, 5, 6, 7], [1] * 5, 2, 2)
    assert s.passes == ((2, 7), (2, 11), (1, 7)) and s.steps == () and s.drain_steps == 0
    # min_free 2: one freed slot waits until a second frees (or until the free slots can take every waiting request)
    s = simulate([10] * 4, [2] * 4, [2, 4, 3, 2], 2, 2)
    # fill 0 (ends step 1), 1 (ends 3); step 1: 0 ends, 1 free < 2 with 2 waiting: steps 2, 3 at one live row; both
    # free: fill 2 (ends step 5), 3 (ends 4); steps 4, 5 (the drain: 3 ended, nothing waits)
    assert s.passes == ((2, 4), (2, 4)) and [live for live, _ in s.steps] == [2, 1, 1, 2, 1]
    assert s.decode_tokens == 7 == sum(o - 1 for o in [2, 4, 3, 2]) and s.slot_occupancy == pytest.approx(7 / 10)
    assert s.drain_steps == 2


def test_simulate_capacities_best_fit():
    """Needs 5, 9, 5, 12, 5 at N = 2: caps [9, 12] (the 2 largest needs); outputs 2, 4, 2, 2, 2, min_free 1. Fill 0
    (cap 9, ends step 1), 1 (cap 12, ends 3); step 1: 2 takes cap 9 (ends 2); step 2: request 3 (need 12) fits no free
    slot and waits, 4 passes it (cap 9, ends 3); step 3: 1 and 4 end, 3 takes cap 12 (ends 4); step 4 (the drain)."""
    s = simulate([5, 9, 5, 12, 5], [1] * 5, [2, 4, 2, 2, 2], 2, 1)
    assert s.passes == ((2, 2), (1, 1), (1, 1), (1, 1))
    assert [live for live, _ in s.steps] == [2, 2, 2, 1] and s.drain_steps == 1
    # a refill whose row finishes at its first token leaves a slot free: the executor runs one step, then refills
    # fill 0 (ends step 3), 1 (ends 1); step 1; refill 2 (done at its first token); step 2 with one row; refill 3
    # (ends 3); step 3: 0 and 3 end
    s = simulate([9] * 4, [1] * 4, [4, 2, 1, 2], 2, 1)
    assert s.passes == ((2, 2), (1, 1), (1, 1)) and [live for live, _ in s.steps] == [2, 1, 2] and s.drain_steps == 1


def _mixtral():
    return resolve_spec("mixtral-8x7b"), resolve_hardware(H200_PROFILE)


@pytest.mark.parametrize("seed", range(3))
def test_hrm_step_and_pass_times_add_up_to_evaluate(seed):
    """hrm.decode_step_time at prompt_len + j summed over j = 1..G-1 is evaluate's decode time, and
    hrm.prefill_pass_time of N rows its prefill time (rel. 1e-12), for random shapes with GPU-attention micro-batches
    and resident experts."""
    spec, hw = _mixtral()
    rng = random.Random(seed)
    mu, n = rng.choice([16, 48, 192]), rng.randint(1, 6)
    pol = Policy(mu=mu, n=n, n_gpu_attn=rng.randint(0, n), prefill_mu=min(mu, 16), resident_experts=rng.randint(0, 7))
    w = Workload(prompt_len=rng.uniform(20, 300), gen_len=rng.randint(2, 40))
    est = hrm.evaluate(pol, spec, hw, w)
    steps = sum(hrm.decode_step_time(pol, spec, hw, w, w.prompt_len + j) for j in range(1, w.gen_len))
    assert steps == pytest.approx(est.decode_time, rel=1e-12)
    assert hrm.prefill_pass_time(pol, spec, hw, pol.N, w.prompt_len) == pytest.approx(est.prefill_time, rel=1e-12)
    assert hrm.prefill_pass_time(pol, spec, hw, 1, w.prompt_len) < est.prefill_time  # fewer rows, same pages
    # where the prefill KV's D2H binds (a slow link), a pass's CPU-KV rows are the policy's share of its rows
    slow = dataclasses.replace(hw, pcie_d2h=hw.pcie_d2h / 1e4)
    half = Policy(mu=48, n=4, n_gpu_attn=2, prefill_mu=16)
    assert hrm.prefill_pass_time(half, spec, slow, half.N, 100.0) == pytest.approx(
        hrm.evaluate(half, spec, slow, Workload(prompt_len=100.0, gen_len=2)).prefill_time, rel=1e-12)


def test_hrm_min_free_is_the_least_cost_threshold():
    """f* = N sqrt(2 pass / (L step)) by hand, and the integer f of least per-step cost pass (N / L) / f + f step / 2N
    within one of it."""
    N, pass_s, step, L = 3072, 0.9, 1.0, 92.0
    f = hrm_min_free(N, pass_s, step, L)
    assert f == round(N * math.sqrt(2 * pass_s / (L * step))) == 430
    cost = {g: pass_s * (N / L) / g + g * step / (2 * N) for g in range(1, N + 1)}
    assert abs(min(cost, key=cost.get) - f) <= 1
    assert hrm_min_free(8, 100.0, 1.0, 2.0) == 8 and hrm_min_free(8, 0.0, 1.0, 2.0) == 1  # clamped to [1, N]


def test_job_plan_carries_the_hrm_threshold():
    spec, hw = _mixtral()
    pol = Policy(mu=96, n=4, prefill_mu=16)
    w = Workload(prompt_len=77, gen_len=200, num_requests=1000)
    _p, est = jobplan.fit_job(pol, hrm.evaluate(pol, spec, hw, w), spec, hw, w)
    assert est.refill_min_free == jobplan.job_min_free(_p, spec, hw, w) >= 1


@pytest.mark.parametrize("N, min_free, seed", [(2, 1, 0), (3, 2, 1), (4, 3, 2)])
def test_executor_runs_the_simulated_schedule(tiny_dir, N, min_free, seed):
    """The cgopipe executor on the CPU (tiny model, fp32, stop ids so outputs are ragged): its decode steps, prefill
    passes, slot-steps and decode tokens equal the schedule simulate gives for the lengths it generated (its recorded
    RefillCall), and the lengths are the records' lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 32000, (int(m),), generator=g).tolist() for m in torch.randint(1, 16, (13,), generator=g)]
    G = 12
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), Policy(mu=1, n=N, prefill_mu=1, dtype="fp32",
                         weight_quant="fp32"), "cpu", refill_min_free=min_free)
    free = ex.generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False))
    stop = sorted({o[k] for k, (o, _) in zip([1, 3, 5, 2, 7, 0], free)})  # early tokens of a few requests
    ex.calls.clear()
    before = (ex.stats.decode_steps, ex.stats.prefill_passes, ex.stats.slot_steps, ex.stats.decode_tokens)
    out = ex.generate(prompts, DecodeSampling(max_new_tokens=G, stop_at_eos=False, stop_token_ids=stop))
    ex.close()
    call = ex.calls[-1]
    assert call.out_lens == [len(o) for o, _ in out] and len(set(call.out_lens)) > 2
    assert call.needs == [len(p) + G for p in prompts] and call.min_free == min_free and call.slots == N
    s = call.schedule()
    ran = (ex.stats.decode_steps, ex.stats.prefill_passes, ex.stats.slot_steps, ex.stats.decode_tokens)
    assert tuple(a - b for a, b in zip(ran, before)) == (s.decode_steps, len(s.passes), s.decode_steps * N,
                                                         s.decode_tokens)


def test_refill_report_prices_the_measured_schedule():
    """report.refill_report on a ragged call: the schedule's counts beside the executor's, and predicted_from_lengths
    = generated tokens / (the schedule's passes + steps by the HRM)."""
    from lightning_moe.app.plan import JobPlan
    from lightning_moe.app.report import _refill_lines, refill_report
    from lightning_moe.pipeline.executor import RunStats

    spec, hw = _mixtral()
    pol = Policy(mu=64, n=2, prefill_mu=16)
    rng = random.Random(3)
    P, G = 600, 64
    lens = [rng.randint(20, 120) for _ in range(P)]
    outs = [min(G, 1 + int(rng.expovariate(1 / 12))) for _ in range(P)]
    call = RefillCall([x + G for x in lens], lens, outs, pol.N, 8)
    s = call.schedule()
    stats = RunStats(decode_steps=s.decode_steps, prefill_passes=len(s.passes), decode_tokens=s.decode_tokens,
                     slot_steps=s.decode_steps * pol.N)
    w = Workload.from_lengths(lens, G)
    rep = refill_report([call], stats, JobPlan(pol, None, 0, 0, hw), spec, w)
    sim = rep["schedule_from_lengths"]
    assert (sim["decode_steps"], sim["prefill_passes"], sim["generated_tokens"]) == (s.decode_steps, len(s.passes),
                                                                                     sum(outs))
    assert sim["slot_occupancy"] == pytest.approx(rep["measured"]["slot_occupancy"], rel=1e-12)
    assert sim["slot_occupancy"] < 0.9  # the drain
    pre = sum(hrm.prefill_pass_time(pol, spec, hw, r, t / r) for r, t in s.passes)
    dec = sum(hrm.decode_step_time(pol, spec, hw, w, c / pol.N) for _, c in s.steps)
    got = rep["predicted_from_lengths"]
    assert (got["prefill_seconds"], got["decode_seconds"]) == (pytest.approx(pre, rel=1e-12), pytest.approx(dec, rel=1e-12))
    assert got["end_to_end_tokens_per_s"] == pytest.approx(sum(outs) / (pre + dec), rel=1e-12)
    lines = _refill_lines(rep, 0.5 * got["end_to_end_tokens_per_s"])
    assert f"{s.decode_steps} decode steps ({s.drain_steps} draining: after the last refill)" in lines[0]
    assert "(measured / predicted 0.50)" in lines[1]
    assert refill_report([], stats) is None
