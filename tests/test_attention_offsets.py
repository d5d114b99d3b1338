"""CPU rows are the longest: Workload.attention_context_offsets, hrm.evaluate with them, and plan()'s fixed point.

CGOPipe gives the g shortest micro-batches of a batch GPU attention, so with 0 < g < n the CPU attends over
longer contexts than the batch mean (run 17, benchmarks/RESULTS-archive.md 7c: 193.5 attended positions per CPU row, 147 in the old
model). The offsets are hand-computed here.
"""

import dataclasses
import os

import pytest

from lightning_moe.policy import hardware, hrm, milp
from lightning_moe.policy.hardware import get_preset, resolve_hardware
from lightning_moe.policy.policy import Budgets, Policy, Workload
from lightning_moe.policy.registry import resolve_spec

GiB = 1 << 30


def test_offsets_by_hand():
    w = Workload.from_lengths([40, 10, 30, 20], gen_len=4)
    assert w.attention_context_offsets(4, 2, 2, 1) == (10.0, -10.0)  # one batch: GPU [10, 20], CPU [30, 40], mean 25
    assert w.attention_context_offsets(8, 4, 2, 1) == (10.0, -10.0)  # N > prompts: the distribution, half on the GPU
    assert w.attention_context_offsets(4, 2, 2, 0) == (0.0, 0.0)  # all on the CPU
    assert w.attention_context_offsets(4, 2, 2, 2) == (0.0, 0.0)  # all on the GPU
    w8 = Workload.from_lengths(list(range(1, 9)), gen_len=4)
    assert w8.attention_context_offsets(4, 2, 2, 1) == (1.0, -1.0)  # batches [1..4], [5..8]: each +-1 around its mean
    w6 = Workload.from_lengths(list(range(1, 7)), gen_len=4)
    # batches [1..4] (GPU 1,2: -2 in all; CPU 3,4: +2) and [5, 6] (both GPU, 0): CPU +2 / 2 rows, GPU -2 / 4 rows
    assert w6.attention_context_offsets(4, 2, 2, 1) == (1.0, -0.5)
    assert Workload(prompt_len=30, gen_len=4).attention_context_offsets(4, 2, 2, 1) == (0.0, 0.0)  # no lengths
    with pytest.raises(ValueError, match="N an int"):
        w.attention_context_offsets(0, 2, 2, 1)
    with pytest.raises(ValueError, match="g an int"):
        w.attention_context_offsets(4, 2, 2, -1)


def test_evaluate_charges_the_cpu_rows_context():
    """hrm.evaluate of a g = 1 policy on skewed prompts: the CPU stage is the sum of decode_layer_times with the
    workload's offsets, larger than for the same mean without the lengths; the GPU attention term smaller."""
    spec = resolve_spec("mixtral-8x7b").with_layers(2)
    hw = get_preset("h200")
    lens = [10] * 50 + [200] * 50
    skew = Workload.from_lengths(lens, gen_len=5)
    flat = Workload(prompt_len=skew.prompt_len, gen_len=5, max_prompt_len=200, num_requests=100)
    pol = Policy(mu=50, n=2, prefill_mu=10, resident_experts=2, n_gpu_attn=1, dtype="bf16", weight_quant="bf16")
    dc, dg = skew.attention_context_offsets(100, 50, 2, 1)
    assert (dc, dg) == (95.0, -95.0)
    a, b = hrm.evaluate(pol, spec, hw, skew), hrm.evaluate(pol, spec, hw, flat)
    s = skew.prompt_len
    want_cpu = sum(hrm.decode_layer_times(spec, hw, pol, l, 6, s + j, dc, dg).cpu for j in range(1, 5) for l in range(2))
    assert a.decode_stages["cpu"] == pytest.approx(want_cpu, rel=1e-12)
    attn_cpu = lambda c: hrm.cpu_decode_attention_time(spec, hw, 50, c, "bf16")  # noqa: E731 (one CPU micro-batch)
    extra = sum(2 * (attn_cpu(s + j + dc) - attn_cpu(s + j)) for j in range(1, 5))  # 2 layers, steps 1..4
    assert extra > 0 and a.decode_stages["cpu"] - b.decode_stages["cpu"] == pytest.approx(extra, rel=1e-9)
    g_skew = hrm.decode_layer_times(spec, hw, pol, 0, 6, s + 1, dc, dg).gpu
    g_flat = hrm.decode_layer_times(spec, hw, pol, 0, 6, s + 1).gpu
    att = lambda off: hrm.gpu_decode_attention_time(spec, hw, 50, s + 1 + off, "bf16")  # noqa: E731
    assert g_skew - g_flat == pytest.approx(att(dg) - att(0), rel=1e-9)


def test_plan_solves_again_with_the_optimum_offsets():
    """Mixtral-8x7B, int4 pages, 24 GiB, 512 MT-Bench-like skewed prompts: the first round's optimum has a GPU-
    attention micro-batch, so plan() solves a second round with its offsets (named in the notes); the answer
    is at least as fast, by hrm.evaluate with exact offsets, as that first optimum and as the g = 0 policy."""
    spec = resolve_spec("mixtral-8x7b")
    hw = resolve_hardware(os.path.join(os.path.dirname(hardware.__file__), "profiles", "h200-host.yaml"))
    # without the host stage (H6'): with it this case's optimum is one GPU micro-batch, no CPU rows to offset
    hw = dataclasses.replace(hw, host_issue_cpu_attn=0.0, host_issue_gpu_attn=0.0)
    lens = [20 + (i * 37) % 90 for i in range(60)] + [300 + i for i in range(20)]  # 80 prompts, a long tail
    wl = dataclasses.replace(Workload.from_lengths(lens, gen_len=128, name="skew"), num_requests=512)
    b = Budgets(gpu_memory=24 * GiB, cpu_memory=104 * GiB, weight_quant="int4", dtype="bf16")
    pol, est = milp.plan(spec, hw, wl, b)
    assert "CPU rows +" in est.notes[-1]
    assert est.e2e_tok_s == pytest.approx(hrm.evaluate(pol, spec, hw, wl).e2e_tok_s, rel=1e-12)
    first, *_ = milp._solve_for_kv_len(spec, hw, wl, b, sorted({m for m in milp.DEFAULT_MU_CANDIDATES if m <= 512} | {512}),
                                       None, 20.0, wl.kv_positions(1), 0, strict=True)
    assert est.e2e_tok_s >= first[1].e2e_tok_s * (1 - 1e-9)


@pytest.mark.parametrize("mu,n,g", [(8, 2, 1), (8, 4, 1), (4, 4, 3), (8, 3, 2)])
def test_milp_time_equals_hrm_with_the_policy_offsets(mu, n, g):
    """Decisions pinned, the model built with the pinned policy's own offsets: the MILP's T equals hrm.evaluate's
    total time (the CPU terms use c + cpu_off, GPU attention c + gpu_off, as hrm does)."""
    import pulp

    spec = resolve_spec("mixtral-8x7b").with_layers(2)
    hw = get_preset("h200")
    hw = dataclasses.replace(hw, cpu_attention_bandwidth=hw.cpu_attention_bandwidth / 200)  # the CPU stage binds
    lens = [5, 9, 14, 30, 41, 77, 120, 260] * 3
    wl = dataclasses.replace(Workload.from_lengths(lens, gen_len=6), num_requests=None)
    b = Budgets(gpu_memory=1 << 40, cpu_memory=1 << 40, weight_quant="bf16", dtype="bf16")
    R = spec.num_moe_layers * spec.num_experts  # every expert resident: no pages, the CPU stage binds
    pol = milp.policy_from_decisions(spec, wl, b, mu, n, R, g)
    off = wl.attention_context_offsets(pol.N, mu, n, g)
    assert off[0] > 0 > off[1]
    cands = [4, 8]
    C = milp._coefficients(spec, hw, wl, b, cands, 4, wl.kv_positions(1), off)
    model = milp._Model(spec, wl, C)
    for m in cands:
        model.prob += model.z[m] == int(m == mu)
        model.prob += model.w[m] == (n if m == mu else 0)
        model.prob += model.v[m] == (g if m == mu else 0)
    r, x = divmod(R, spec.num_moe_layers)
    model.prob += model.r == r
    model.prob += model.x == x
    model.solve(1.0, 20.0)
    est = hrm.evaluate(pol, spec, hw, wl)
    flat = Workload(prompt_len=wl.prompt_len, gen_len=wl.gen_len, max_prompt_len=wl.max_prompt_len)
    assert est.total_time > 1.01 * hrm.evaluate(pol, spec, hw, flat).total_time  # the offsets matter here
    assert float(pulp.value(model.T)) == pytest.approx(est.total_time, rel=1e-6)


def test_plan_reuses_a_pass_met_again_and_answers_as_without(monkeypatch):
    """An offsets round that comes back to an earlier round's offsets meets passes already solved: plan() reuses
    their answers (named "(again)" in the notes) instead of solving them again, and its policy and estimate are
    those of the same plan solving every pass. The offsets are forced to cycle 0 -> (5, -5) -> 0; the passes
    solved are exactly the distinct ones the plan without reuse solves (a key missing an input would skip one, a key
    with too much would solve one twice)."""
    spec = resolve_spec("mixtral-8x7b").with_layers(2)
    hw = resolve_hardware(os.path.join(os.path.dirname(hardware.__file__), "profiles", "h100-host.yaml"))
    lens = [20 + (i * 37) % 90 for i in range(60)] + [300 + i for i in range(20)]
    wl = dataclasses.replace(Workload.from_lengths(lens, gen_len=8, name="skew"), num_requests=200)
    b = Budgets(gpu_memory=12 * GiB, cpu_memory=100 * GiB, weight_quant="bf16", dtype="bf16")
    solve, fixed_points = milp._solve_for_kv_len, milp._fixed_points

    def run(memo: bool):
        calls, cycle = [], iter([(5.0, -5.0), (0.0, 0.0)] * milp.MAX_OFFSET_SOLVES)
        monkeypatch.setattr(milp, "_round_offsets", lambda w, p: next(cycle))
        monkeypatch.setattr(milp, "_solve_for_kv_len", lambda *a, **k: calls.append((a[7], a[8], k["offsets"], k["strict"]))
                            or solve(*a, **k))

        class NoMemo(dict):  # every pass solved, as before the reuse
            def __contains__(self, key):
                return False

        monkeypatch.setattr(milp, "_fixed_points", fixed_points if memo else
                            (lambda *a, **k: fixed_points(*a, **k, solved=NoMemo())))
        return milp.plan(spec, hw, wl, b), calls

    (pol, est), calls = run(memo=True)
    (ref_pol, ref_est), ref_calls = run(memo=False)
    assert "(again)" in est.notes[-1] and "(again)" not in ref_est.notes[-1]
    assert len(calls) == len(set(calls)) and set(calls) == set(ref_calls) and len(ref_calls) > len(calls)
    assert pol == ref_pol
    assert dataclasses.replace(est, notes=()) == dataclasses.replace(ref_est, notes=())
