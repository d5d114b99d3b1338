"""Sliding-window layers in the HRM and the MILP: a windowed layer's CPU attention reads at most the window
(hrm.cpu_attended, as the native kernel does), windowed and full layers are priced as separate classes, the extra
resident experts go to the windowed layers first (jobplan._spread_resident), and the MILP, with one layer sum per
window class, still equals brute force over hrm.evaluate and its pinned time equals hrm's."""

import collections
import dataclasses
import random

import pytest

from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import get_preset
from lightning_moe.policy.jobplan import _spread_resident
from lightning_moe.policy.policy import Budgets, Policy, Workload
from lightning_moe.policy.registry import resolve_spec
from tests.test_dram_sharing import shared
from tests.test_milp import _milp_matches_brute_force, pinned_time, random_case, random_decisions, tiny_spec


def windowed(spec, window: int, full: tuple):
    """``spec`` with a sliding window in every layer but ``full``."""
    return dataclasses.replace(spec, sliding_window=window, full_attention_layers=full)


def window_case(seed: int):
    """random_case's spec, hardware and budgets with a window over some layers (at least one windowed and, where
    there are two or more layers, one full), and a workload whose contexts pass the window at some decode step (at
    every step or only at the later ones)."""
    spec, hw, _, budgets = random_case(seed)
    rng = random.Random(1000 + seed)
    L = spec.num_layers
    full = tuple(sorted(rng.sample(range(L), rng.randint(1, L - 1)))) if L > 1 else ()
    wl = Workload(prompt_len=rng.choice([8, 16, 24]), gen_len=rng.choice([4, 6]), max_prompt_len=rng.choice([None, 30]))
    return windowed(spec, rng.randint(3, int(wl.prompt_len) + wl.gen_len - 2), full), hw, wl, budgets


def test_cpu_attended_is_the_window_in_a_windowed_layer_and_the_context_elsewhere():
    spec = windowed(resolve_spec("mixtral-8x7b"), 128, (1, 3))
    assert hrm.cpu_attended(spec, 0, 500.0) == 128.0 and hrm.cpu_attended(spec, 0, 100.0) == 100.0
    assert hrm.cpu_attended(spec, 1, 500.0) == 500.0
    assert hrm.cpu_attended(resolve_spec("mixtral-8x7b"), 0, 500.0) == 500.0


@pytest.mark.parametrize("dense", [False, True])
def test_a_windowed_layer_costs_a_full_layer_at_the_window_on_the_cpu_only(dense):
    """At a context past the window a windowed layer's CPU stage equals a full layer's at the window, (H5')'s KV term
    included (a profile with the sharing point, whose rows bind for a paging MoE layer); the GPU stage (torch GPU
    attention reads the whole cache) keeps the context. A dense layer (its MLP resident) the same. Mixtral's width
    with a window: its CPU attention is bound by KV bytes, so the sharing rows move it."""
    spec = windowed(resolve_spec("mixtral-8x7b").with_layers(4), 128, (1, 3))
    if dense:
        spec = dataclasses.replace(spec, dense_layers=(0, 1), dense_intermediate_size=spec.intermediate_size)
    hw = shared(get_preset("h200"), 0.3, 0.5)
    pol = Policy(mu=256, n=4, prefill_mu=8, resident_experts=0, n_gpu_attn=1)
    paged = 0 if dense else spec.num_experts
    win_far = hrm.decode_layer_times(spec, hw, pol, 0, paged, 900.0)
    full_at_w = hrm.decode_layer_times(spec, hw, pol, 1, paged, 128.0)
    full_far = hrm.decode_layer_times(spec, hw, pol, 1, paged, 900.0)
    alone = hrm.decode_layer_times(spec, get_preset("h200"), pol, 1, paged, 900.0)
    assert dense or full_far.cpu > alone.cpu * 1.5  # the sharing rows bind: the KV term is in the CPU stage
    assert win_far.cpu == pytest.approx(full_at_w.cpu, rel=1e-12) and win_far.cpu < 0.6 * full_far.cpu
    assert win_far.h2d == pytest.approx(full_at_w.h2d, rel=1e-12)  # (H5'): Y + b X, X the window's KV seconds
    assert win_far.gpu == pytest.approx(full_far.gpu, rel=1e-12) and win_far.gpu > full_at_w.gpu


def test_evaluate_prices_windowed_and_full_layers_apart():
    """hrm.evaluate over a model with windowed and full layers equals the weighted sum of the two classes' layer times
    (each at its own CPU context): not the full layers' time everywhere, not the windowed layers' everywhere (a
    CPU-bound policy: every expert resident, no GPU attention, contexts of 1,000)."""
    base = dataclasses.replace(resolve_spec("gpt-oss-120b").with_layers(4), sliding_window=None, full_attention_layers=())
    hw = get_preset("h200")
    wl = Workload(prompt_len=1000, gen_len=3)
    pol = Policy(mu=256, n=4, prefill_mu=8, resident_experts=base.num_experts, n_gpu_attn=0)
    mix = windowed(base, 128, (1, 3))
    mixed, allwin, nowin = (hrm.evaluate(pol, s, hw, wl).decode_time for s in (mix, windowed(base, 128, ()), base))
    assert allwin < 0.9 * mixed and mixed < 0.9 * nowin
    head = hrm.decode_head_time(base, hw, pol)
    want = sum(2 * (hrm.decode_layer_times(mix, hw, pol, 0, 0, c).time + hrm.decode_layer_times(mix, hw, pol, 1, 0, c).time)
               + head for c in (1001, 1002))
    assert mixed == pytest.approx(want, rel=1e-12)


def test_extra_resident_experts_go_to_windowed_layers_first():
    spec = windowed(resolve_spec("gpt-oss-120b").with_layers(6), 128, (1, 3, 5))
    assert _spread_resident(spec, 6 * 2 + 2) == (3, 2, 3, 2, 2, 2)
    assert _spread_resident(spec, 6 * 2 + 4) == (3, 3, 3, 2, 3, 2)
    # no window: the first x MoE layers, as before
    assert _spread_resident(resolve_spec("mixtral-8x7b").with_layers(4), 4 * 3 + 2) == (4, 4, 3, 3)


def test_milp_equals_brute_force_with_windowed_and_full_layers():
    """Random tiny models with a window that the decode contexts pass in some layers (and dense layers in some):
    the MILP's optimum equals the best policy of the grid by hrm.evaluate, CPU attention in some of them."""
    cands, n_max = [2, 4, 8], 3
    seen = collections.Counter()
    for seed in range(30):
        spec, hw, wl, budgets = window_case(seed)
        assert milp.window_binds(spec, [wl.prompt_len + t for t in range(1, wl.gen_len)], 0.0)
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        if got is None:
            continue
        bf = got[2][1]
        seen["solved"] += 1
        seen["cpu-attn"] += bf.n_cpu_attn > 0
    assert seen["solved"] >= 10 and seen["cpu-attn"] >= 2, seen


def test_window_binds_at_the_cpu_rows_context():
    """The window binds when some CPU row's context (mean + the CPU rows' offset) passes it, not only the mean's."""
    spec = windowed(tiny_spec(L=2), 12, (1,))
    assert not milp.window_binds(spec, [9, 10, 11], 0.0)
    assert milp.window_binds(spec, [9, 10, 11], 1.5)
    assert not milp.window_binds(dataclasses.replace(spec, sliding_window=None), [90], 5.0)


def _pinned_case(seed: int, rng: random.Random):
    """A windowed model of 2-6 layers (dense layers, windowed or full, in some), a toy profile with a slow GPU (see
    below) and, by seed, (H5')'s sharing point, skewed prompt lengths (CPU rows longer than the mean) and two GPUs."""
    spec, hw, wl, budgets = window_case(seed)
    L = rng.randint(2, 6)
    dense = rng.choice([0, 0, 1, 2]) if L > 2 else 0
    full = tuple(sorted(rng.sample(range(L), rng.randint(1, L - 1))))
    spec = windowed(tiny_spec(L=L, E=rng.choice([3, 4, 5]), dense=dense, shared=rng.choice([0, 1])),
                    spec.sliding_window, full)
    # a slower GPU, as test_milp's pinned test: a toy head of ~1e-7 s sits inside HiGHS's feasibility tolerance
    hw = dataclasses.replace(hw, gpu_hbm_bandwidth=hw.pcie_h2d * rng.uniform(1, 10))
    if seed % 2:
        hw = shared(hw, rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8))
    if seed % 3 == 0:  # skewed prompts: the CPU rows (the longest micro-batches) attend past the mean
        lens = [max(1, int(wl.prompt_len * rng.uniform(0.1, 3))) for _ in range(rng.randint(8, 30))]
        wl = dataclasses.replace(Workload.from_lengths(lens, wl.gen_len), num_requests=None)
    budgets = dataclasses.replace(budgets, gpu_memory=1 << 40, cpu_memory=1 << 40, gpus=2 if seed % 4 == 1 else 1)
    return spec, hw, wl, budgets


def test_milp_time_equals_hrm_for_fixed_decisions_with_windowed_layers():
    """Every decision pinned (uneven spreads included: the extras' split between the classes follows the windowed-
    first rule), the model built with the policy's own attention-context offsets: the MILP's minimal T equals
    hrm.evaluate's total time on models of 2-6 layers with windowed and full layers, dense layers in some, (H5')'s
    sharing rows, skewed prompts and two GPUs in some. Also where the window binds only at the CPU rows' context."""
    rng = random.Random(11)
    seen = collections.Counter()
    for seed in range(24):
        spec, hw, wl, budgets = _pinned_case(seed, rng)
        cands = [2, 4, 8]
        for mu, n, R, g in random_decisions(spec, rng, cands, count=5):
            pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
            off = wl.attention_context_offsets(pol.N, mu, n, g)
            cmax = wl.prompt_len + wl.gen_len - 1
            if seed % 3 == 0 and off[0] >= 2 and seen["offset only"] < 8:  # the window passed only by the CPU rows
                spec = dataclasses.replace(spec, sliding_window=int(cmax + off[0] / 2))
                pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
                seen["offset only"] += 1
            C = milp._coefficients(spec, hw, wl, budgets, cands, 4, wl.kv_positions(1), off)
            want = hrm.evaluate(pol, spec, hw, wl).total_time
            assert pinned_time(spec, wl, C, mu, n, R, g) == pytest.approx(want, rel=1e-6), (seed, mu, n, R, g)
            seen["checked"] += 1
            seen["two classes"] += len(milp._Model(spec, wl, C).moe_cls) == 2
            seen["sharing"] += hrm.dram_sharing(hw) is not None and pol.n_cpu_attn > 0
    assert seen["checked"] >= 80 and seen["two classes"] >= 30 and seen["sharing"] >= 15, seen
    assert seen["offset only"] >= 3, seen


def test_prefill_attends_within_the_window():
    """hrm.prefill_attended counts the query-key pairs a causal prompt attends, each token over at most the window;
    a windowed layer's prefill GPU stage is the full layer's less the pairs outside the window."""
    for s in (1, 5, 12, 13, 40):
        for W in (None, 1, 12, 64):
            want = sum(i if W is None else min(i, W) for i in range(1, s + 1))
            assert hrm.prefill_attended(s, W) == want, (s, W)
    spec = windowed(resolve_spec("gpt-oss-120b").with_layers(2), 128, (1,))
    hw, pol = get_preset("h200"), Policy(mu=64, n=2, prefill_mu=16, resident_experts=0)
    win, full = (hrm.prefill_layer_times(spec, hw, pol, layer, spec.num_experts, 4000.0) for layer in (0, 1))
    attn = hrm.gpu_prefill_attention_time  # per prefill micro-batch of 16 rows, 8 of them
    assert full.gpu - win.gpu == pytest.approx(8 * (attn(spec, hw, 16, 4000.0) - attn(spec, hw, 16, 4000.0, window=128)),
                                               rel=1e-9)
    assert win.gpu < 0.9 * full.gpu and win.h2d == full.h2d  # long prompts: attention FLOPs bind
    short = [hrm.prefill_layer_times(spec, hw, pol, layer, spec.num_experts, 100.0).gpu for layer in (0, 1)]
    assert short[0] == short[1]  # prompts within the window: no difference


def test_milp_equals_hrm_for_one_new_token_past_the_window():
    """A generation of one new token (no decode step) over prompts longer than the window: the prefill alone makes
    windowed and full layers differ, and the MILP's pinned time and optimum equal hrm.evaluate's."""
    rng = random.Random(5)
    checked = 0
    for seed in range(8):
        spec, hw, _, budgets = window_case(seed)
        wl = Workload(prompt_len=24, gen_len=1)
        spec = dataclasses.replace(spec, sliding_window=rng.randint(3, 20))
        assert milp.window_binds(spec, [], 0.0, wl.prompt_len)
        _milp_matches_brute_force(spec, hw, wl, budgets, [2, 4, 8], 3, seed)
        hw = dataclasses.replace(hw, gpu_hbm_bandwidth=hw.pcie_h2d * rng.uniform(1, 10))
        pinned_budgets = dataclasses.replace(budgets, gpu_memory=1 << 40, cpu_memory=1 << 40)
        C = milp._coefficients(spec, hw, wl, pinned_budgets, [2, 4, 8], 4, wl.kv_positions(1))
        for mu, n, R, g in random_decisions(spec, rng, [2, 4, 8]):
            pol = milp.policy_from_decisions(spec, wl, pinned_budgets, mu, n, R, g)
            want = hrm.evaluate(pol, spec, hw, wl).total_time
            assert pinned_time(spec, wl, C, mu, n, R, g) == pytest.approx(want, rel=1e-6), (seed, mu, n, R, g)
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("gen", [1, 3])
def test_milp_prices_a_windowed_prefill_at_real_width(gen):
    """gpt-oss-120b's width, a windowed and a full layer, prompts of 4,000 tokens (prefill attention FLOP-bound): the
    MILP's pinned time equals hrm.evaluate's, whose prefill is cheaper than with the window ignored."""
    spec = windowed(resolve_spec("gpt-oss-120b").with_layers(2), 128, (1,))
    hw = get_preset("h200")
    wl = Workload(prompt_len=4000, gen_len=gen)
    budgets = Budgets(gpu_memory=1 << 40, cpu_memory=1 << 40, gpu_reserve=0, cpu_reserve=0, weight_quant="mxfp4")
    C = milp._coefficients(spec, hw, wl, budgets, [16, 64], 4, wl.kv_positions(1))
    for mu, n, R, g in ((16, 2, 0, 0), (64, 1, 3, 1), (16, 3, 129, 1)):
        pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
        est = hrm.evaluate(pol, spec, hw, wl)
        full = hrm.evaluate(pol, dataclasses.replace(spec, sliding_window=None, full_attention_layers=()), hw, wl)
        assert est.prefill_time < full.prefill_time * (1 - 1e-3)
        assert pinned_time(spec, wl, C, mu, n, R, g) == pytest.approx(est.total_time, rel=1e-6), (mu, n, R, g)
