"""The HRM's host stage (H6'): host_issue_cpu_attn / host_issue_gpu_attn per micro-batch and decode layer, plus the
wait for the layer's last CPU attention; the MILP's host row agrees with hrm (brute force); absent without a host
measurement; the profiler's probe runs CGOPipe's own decode."""

import dataclasses
import random

import pytest

from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import get_preset
from lightning_moe.policy.policy import Policy
from lightning_moe.policy.registry import resolve_spec

from tests.test_milp import _milp_matches_brute_force, random_case


def test_host_stage_formula():
    spec = resolve_spec("mixtral-8x7b")
    hw = dataclasses.replace(get_preset("h200"), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006)
    pol = Policy(mu=64, n=3, prefill_mu=16, n_gpu_attn=1)
    st = hrm.decode_layer_times(spec, hw, pol, 0, 6, 200.0)
    assert st.host == pytest.approx(2 * 0.004 + 1 * 0.006, rel=1e-12)  # issue only: the look-ahead leaves no wait
    assert st.time == max(st.h2d, st.d2h, st.cpu, st.gpu, st.host)
    # every micro-batch on the GPU: issue only, no wait for CPU attention
    allg = hrm.decode_layer_times(spec, hw, dataclasses.replace(pol, n_gpu_attn=3), 0, 6, 200.0)
    assert allg.host == pytest.approx(3 * 0.006, rel=1e-12)
    # a profile without the measurement: no host stage, the other four unchanged
    base = hrm.decode_layer_times(spec, get_preset("h200"), pol, 0, 6, 200.0)
    assert base.host == 0.0 and (base.h2d, base.d2h, base.cpu, base.gpu) == (st.h2d, st.d2h, st.cpu, st.gpu)


def test_mla_models_take_the_mla_probe_host_issue():
    """An MLA model's h_c is the profile's MLA probe (host_issue_by_family's "mla": the DeepSeek-shaped probe) where
    measured, the generic probe's host_issue_cpu_attn otherwise; a GQA model never takes the MLA number."""
    mla, gqa = resolve_spec("deepseek-v2-lite"), resolve_spec("mixtral-8x7b")
    hw = dataclasses.replace(get_preset("h200"), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006)
    pol = Policy(mu=64, n=2, prefill_mu=16)
    with_mla = dataclasses.replace(hw, host_issue_by_family={"mla": (0.0025, 0.0)})
    assert hrm.decode_layer_times(mla, hw, pol, 1, 6, 200.0).host == pytest.approx(2 * 0.004, rel=1e-12)
    assert hrm.decode_layer_times(mla, with_mla, pol, 1, 6, 200.0).host == pytest.approx(2 * 0.0025, rel=1e-12)
    assert (hrm.decode_layer_times(gqa, with_mla, pol, 0, 6, 200.0).host
            == hrm.decode_layer_times(gqa, hw, pol, 0, 6, 200.0).host)


def test_milp_with_mla_host_issue_equals_brute_force():
    """The MILP's host row takes an MLA model's h_c from the same place as hrm (random small MLA cases)."""
    cands, n_max, solved = [2, 4, 8], 4, 0
    for seed in range(12):
        spec, hw, wl, budgets = random_case(seed, mla=True)
        rng = random.Random(2000 + seed)
        hw = dataclasses.replace(hw, host_issue_cpu_attn=1e-7,  # the GQA number would never bind
                                 host_issue_by_family={"mla": (10 ** rng.uniform(-4, -2), 0.0)})
        solved += _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed) is not None
        C = milp._coefficients(spec, hw, wl, budgets, cands, n_max, wl.kv_positions(1))
        assert C.host_c == dict(hw.host_issue_by_family)["mla"][0]  # the MILP's host row charges the MLA number (time per token
        #   h_c / mu does not depend on n, so the optimum above would not show a wrong h_c)
    assert solved >= 4


def test_host_stage_binds_and_slows_the_estimate():
    spec = resolve_spec("mixtral-8x7b")
    from lightning_moe.policy.policy import Workload

    wl = Workload(prompt_len=150, gen_len=16)
    pol = Policy(mu=128, n=4, prefill_mu=16, resident_experts=1)
    base = hrm.evaluate(pol, spec, get_preset("h200"), wl)
    slow = hrm.evaluate(pol, spec, dataclasses.replace(get_preset("h200"), host_issue_cpu_attn=0.05), wl)
    assert slow.decode_binding == "host" and slow.decode_stages["host"] > 0 and base.decode_stages["host"] == 0
    assert slow.decode_tok_s < base.decode_tok_s


def test_milp_with_host_stage_equals_brute_force():
    """Random small cases with host issue costs: the MILP's optimum equals brute force over hrm.evaluate, and the
    host stage binds in some of them."""
    cands, n_max = [2, 4, 8], 4
    bound, solved = set(), 0
    for seed in range(24):
        spec, hw, wl, budgets = random_case(seed)
        rng = random.Random(1000 + seed)
        hw = dataclasses.replace(hw, host_issue_cpu_attn=10 ** rng.uniform(-6, -2), host_issue_gpu_attn=10 ** rng.uniform(-6, -2))
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        if got is None:
            continue
        solved += 1
        bound.add(got[1].decode_binding)
    assert solved >= 6 and "host" in bound, (solved, bound)


def test_host_issue_probe_runs_the_executor():
    pytest.importorskip("torch")  # the probe runs the executor (skipped in the torch-free 3.12 planner venv)
    from lightning_moe.pipeline.profiler import measure_host_issue

    h_c, h_g = measure_host_issue("cpu", layers=2, mu=3, steps=2)
    assert 0 < h_c < 1 and 0 < h_g < 1
    h_mla, h_mla_g = measure_host_issue("cpu", layers=2, mu=3, steps=2, probe="mla")  # a DeepSeek-shaped decode
    assert 0 < h_mla < 1 and 0 < h_mla_g < 1


def test_estimate_says_when_it_has_no_host_stage():
    """A profile without host issue times (every preset) predicts decode without the host stage: the estimate says so
    in a note naming the hardware and the fields; a measured profile, or a job with no decode, gets no such note."""
    from lightning_moe.policy.policy import Workload

    spec = resolve_spec("mixtral-8x7b")
    pol = Policy(mu=128, n=4, prefill_mu=16, resident_experts=1)
    gen, score = Workload(prompt_len=150, gen_len=16), Workload(prompt_len=150, gen_len=1)
    preset = get_preset("l4")
    (note,) = hrm.evaluate(pol, spec, preset, gen).notes
    assert note.startswith("note: hardware l4 ") and "host_issue_cpu_attn" in note
    assert hrm.evaluate(pol, spec, preset, score).notes == ()
    for field in ("host_issue_cpu_attn", "host_issue_gpu_attn"):  # (the other note: tests/test_dram_sharing.py)
        notes = hrm.evaluate(pol, spec, dataclasses.replace(preset, **{field: 0.004}), gen).notes
        assert not any("host issue times" in n for n in notes), notes
