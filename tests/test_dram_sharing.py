"""(H5') host DRAM shared by CPU attention and page DMA: the profile's one measured point of both running at once
(cpu_attention_bandwidth_under_h2d, pcie_h2d_under_cpu_attention) makes two rows per decode layer, T_cpu >= X + a Y
and T_h2d >= Y + b X (hrm.dram_sharing, hrm.decode_layer_times); the MILP carries the same rows (exact against brute
force and for pinned decisions); absent without the measurement. The planner's tests run torch-free too
(scripts/ci_py312.sh): the probe's tests skip there."""

import dataclasses
import threading
import time
import random

import pytest

from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import HardwareError, HardwareProfile, get_preset
from lightning_moe.policy.hardware import GiB
from lightning_moe.policy.policy import Budgets, Policy, Workload
from lightning_moe.policy.registry import resolve_spec

from tests.test_milp import _milp_matches_brute_force, pinned_time, random_case, random_decisions


def shared(hw: HardwareProfile, rc: float, rh: float) -> HardwareProfile:
    """``hw`` with the concurrent point at fractions rc of its CPU attention rate and rh of its H2D rate."""
    return dataclasses.replace(hw, cpu_attention_bandwidth_under_h2d=rc * hw.cpu_attention_bandwidth,
                               pcie_h2d_under_cpu_attention=rh * hw.pcie_h2d)


def test_sharing_coefficients_from_the_measured_point():
    hw = get_preset("h200")
    assert hrm.dram_sharing(hw) is None  # not measured: no rows
    assert hrm.dram_sharing(dataclasses.replace(hw, cpu_attention_bandwidth_under_h2d=1e9)) is None  # half a point
    assert hrm.dram_sharing(shared(hw, 1.0, 1.0)) == (0.0, 0.0)  # no contention: free overlap
    a, b = hrm.dram_sharing(shared(hw, 0.6, 0.9))
    assert a == pytest.approx(0.4 / 0.9, rel=1e-12) and b == pytest.approx(0.1 / 0.6, rel=1e-12)
    assert hrm.dram_sharing(shared(hw, 0.5, 0.5)) == pytest.approx((1.0, 1.0))  # on the triangle: no gain from overlap
    assert hrm.dram_sharing(shared(hw, 0.3, 0.2)) == (1.0, 1.0)  # inside it: time-sharing is better, never above 1
    assert hrm.dram_sharing(shared(hw, 1.2, 1.1)) == (0.0, 0.0)  # a noisy point above the rates alone: no contention
    with pytest.raises(HardwareError, match="pcie_h2d_under_cpu_attention"):
        dataclasses.replace(hw, pcie_h2d_under_cpu_attention=-1.0)


def test_decode_layer_stages_with_sharing():
    spec = resolve_spec("mixtral-8x7b")
    base_hw = get_preset("h200")
    hw = shared(base_hw, 0.6, 0.8)
    a, b = hrm.dram_sharing(hw)
    pol = Policy(mu=256, n=3, prefill_mu=16, n_gpu_attn=1)
    ctx = 300.0
    base = hrm.decode_layer_times(spec, base_hw, pol, 0, 6, ctx)
    st = hrm.decode_layer_times(spec, hw, pol, 0, 6, ctx)
    X = 2 * 256 * ctx * spec.kv_elems_per_token * 2 / base_hw.cpu_attention_bandwidth  # 2 CPU micro-batches' KV bytes
    assert X == pytest.approx(hrm.cpu_attention_kv_time(spec, hw, 512, ctx), rel=1e-12)
    assert st.h2d == pytest.approx(base.h2d + b * X, rel=1e-12)
    assert st.cpu == pytest.approx(max(base.cpu, X + a * base.h2d), rel=1e-12)
    assert X + a * base.h2d > base.cpu  # this case's contention row binds the CPU stage ...
    assert st.cpu > base.cpu and (st.d2h, st.gpu, st.host) == (base.d2h, base.gpu, base.host)
    # ... and the case is chosen so that it does: without the rows the layer would be faster
    assert st.time > base.time
    # every micro-batch on the GPU: no CPU attention, nothing shared
    allg = dataclasses.replace(pol, n_gpu_attn=3)
    assert hrm.decode_layer_times(spec, hw, allg, 0, 6, ctx) == hrm.decode_layer_times(spec, base_hw, allg, 0, 6, ctx)
    # a measured point without contention changes nothing
    free = hrm.decode_layer_times(spec, shared(base_hw, 1.0, 1.0), pol, 0, 6, ctx)
    assert (free.h2d, free.cpu) == pytest.approx((base.h2d, base.cpu), rel=1e-12)


def test_sharing_lowers_the_estimate_where_pages_and_cpu_attention_overlap():
    spec = resolve_spec("mixtral-8x7b")
    wl = Workload(prompt_len=150, gen_len=16)
    pol = Policy(mu=256, n=2, prefill_mu=16, resident_experts=1)
    base = hrm.evaluate(pol, spec, get_preset("h200"), wl)
    slow = hrm.evaluate(pol, spec, shared(get_preset("h200"), 0.5, 0.7), wl)
    assert slow.decode_tok_s < base.decode_tok_s and slow.prefill_tok_s == base.prefill_tok_s


def _with_random_sharing(hw: HardwareProfile, rng: random.Random) -> HardwareProfile:
    return shared(hw, rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0))


@pytest.mark.parametrize("prompt_len", [100, 300])
def test_milp_with_sharing_equals_brute_force(prompt_len):
    """Mixtral's width, 4 layers, 12 GiB, where the optimum pages experts beside CPU attention: with the sharing rows
    (CPU attention at half its rate under page DMA) the MILP's optimum equals brute force over hrm.evaluate, and is
    slower than without them (the rows bind)."""
    spec = resolve_spec("mixtral-8x7b").with_layers(4)
    wl = Workload(prompt_len=prompt_len, gen_len=16)
    budgets = Budgets(gpu_memory=12 * GiB, cpu_memory=100 * GiB, gpu_reserve=0, cpu_reserve=0)
    cands, n_max = [64, 256, 1024], 4
    plain, plain_est, _ = _milp_matches_brute_force(spec, get_preset("h200"), wl, budgets, cands, n_max, prompt_len)
    pol, est, _ = _milp_matches_brute_force(spec, shared(get_preset("h200"), 0.5, 0.9), wl, budgets, cands, n_max,
                                            prompt_len)
    assert plain.n_cpu_attn >= 1 and pol.n_cpu_attn >= 1 and plain.total_resident(spec) < 32
    assert est.e2e_tok_s < 0.9 * plain_est.e2e_tok_s and est.decode_binding == "cpu"


def test_milp_time_with_sharing_equals_hrm_for_fixed_decisions():
    """Every decision pinned (both layer classes, dense layers, CPU and GPU attention): the MILP's minimal T equals
    hrm.evaluate's total time with the sharing rows, so they are exact, not just good enough for one optimum."""
    rng = random.Random(7)
    checked = binds = 0  # binds: decisions whose time the sharing rows raise
    for seed in range(12):
        spec, hw, wl, budgets = random_case(seed)
        # as test_milp's fixed-decisions test (times well above HiGHS's 1e-7 feasibility tolerance), with sharing
        hw = _with_random_sharing(dataclasses.replace(hw, gpu_hbm_bandwidth=hw.pcie_h2d * rng.uniform(1, 10)), rng)
        budgets = dataclasses.replace(budgets, gpu_memory=1 << 40, cpu_memory=1 << 40)
        cands = [2, 4, 8]
        C = milp._coefficients(spec, hw, wl, budgets, cands, 4, wl.kv_positions(1))
        assert C.dram == hrm.dram_sharing(hw)
        for mu, n, R, g in random_decisions(spec, rng, cands):
            pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
            want = hrm.evaluate(pol, spec, hw, wl).total_time
            assert pinned_time(spec, wl, C, mu, n, R, g) == pytest.approx(want, rel=1e-6), (seed, mu, n, R, g)
            checked += 1
            plain = hrm.evaluate(pol, spec, dataclasses.replace(hw, cpu_attention_bandwidth_under_h2d=0.0), wl)
            binds += want > plain.total_time * (1 + 1e-6)
    assert checked >= 20 and binds >= 5, (checked, binds)


CPU_ROW_CASES = [  # (decisions mu, n, R, g; a dense first layer; ragged prompts; rc, rh; GPUs)
    ((1024, 2, 0, 0), False, False, 0.5, 0.9, 1),
    ((1024, 4, 8, 0), False, False, 0.5, 0.9, 1),
    ((256, 3, 13, 1), False, True, 0.5, 0.9, 1),  # CPU rows longer than the mean (attention-context offsets)
    ((64, 4, 31, 2), False, True, 0.5, 0.9, 1),
    ((1024, 4, 8, 0), True, False, 0.3, 0.3, 1),  # the dense layer's CPU row binds too (a = b = 1)
    ((1024, 2, 8, 0), False, False, 0.5, 0.9, 2),  # (H10) two processes attend on one host: X x 2
]


@pytest.mark.parametrize("decisions, dense, ragged, rc, rh, gpus", CPU_ROW_CASES)
def test_milp_time_with_sharing_equals_hrm_where_the_cpu_row_binds(decisions, dense, ragged, rc, rh, gpus):
    """Mixtral's width, 4 layers, pinned decisions whose CPU stage is X + a Y (the attention slowed by the pages
    beside it; uneven residency, a dense layer, CPU rows at an offset too): the MILP's T equals hrm.evaluate's."""
    spec = resolve_spec("mixtral-8x7b").with_layers(4)
    if dense:
        spec = dataclasses.replace(spec, dense_layers=(0,), dense_intermediate_size=spec.intermediate_size)
    lens = tuple(100 + (37 * i) % 400 for i in range(2048)) if ragged else None
    wl = Workload(prompt_len=300, gen_len=8, max_prompt_len=500 if ragged else None, prompt_lens=lens)
    budgets = Budgets(gpu_memory=1 << 40, cpu_memory=1 << 40, gpu_reserve=0, cpu_reserve=0, gpus=gpus)
    hw = shared(get_preset("h200"), rc, rh)
    pol = milp.policy_from_decisions(spec, wl, budgets, *decisions)
    offsets = wl.attention_context_offsets(pol.N, pol.mu, pol.n, pol.n_gpu_attn)
    assert (offsets[0] > 1) == ragged
    C = milp._coefficients(spec, hw, wl, budgets, [64, 256, 1024], 4, wl.kv_positions(pol.N), offsets)
    est = hrm.evaluate(pol, spec, hw, wl)
    plain = hrm.evaluate(pol, spec, get_preset("h200"), wl)
    assert est.decode_stages["cpu"] > plain.decode_stages["cpu"] * 1.0001  # the CPU row binds
    assert pinned_time(spec, wl, C, *decisions) == pytest.approx(est.total_time, rel=1e-6)


def test_window_rate_counts_only_copies_inside_the_window():
    pytest.importorskip("torch")  # (the planner's torch-free 3.12 venv runs this file too)
    from lightning_moe.pipeline.dram_sharing import window_rate

    done = [(1.0, 10), (2.0, 10), (3.0, 10), (4.5, 30)]  # (finished at, bytes), back to back
    assert window_rate(done, 0.5, 4.0) == pytest.approx(20 / 2.0)  # finished at 1, 2, 3: the last two over [1, 3]
    assert window_rate(done, 0.0, 5.0) == pytest.approx(50 / 3.5)
    assert window_rate(done, 1.5, 2.5) == 0.0  # one copy finished inside: no rate


def test_sharing_probe_needs_cuda_and_a_cpu_profile_has_no_point():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: tests/gpu/test_profiler_gpu.py measures the point")
    from lightning_moe.pipeline.dram_sharing import measure_cpu_attention_under_h2d

    with pytest.raises(RuntimeError, match="needs CUDA"):
        measure_cpu_attention_under_h2d(lambda l: None, 1, 1)


class _HostCopies:
    """PinnedCopyLoad's stand-in on a CPU host: a thread "copying" 1 MiB per >= 2 ms (<= 0.5 GB/s), or failing."""

    fail = False

    def __init__(self, nbytes, device="cpu"):
        self.nbytes, self.done, self._stop = nbytes, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        if self.fail:
            return
        while not self._stop.is_set():
            time.sleep(0.002)
            self.done.append((time.perf_counter(), self.nbytes))

    def __enter__(self):
        self._thread.start()
        time.sleep(0.01)
        if not self.done:
            raise RuntimeError("pinned copy thread finished no copy")
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_the_probe_times_whole_passes_alone_and_beside_a_copy_thread(monkeypatch):
    """measure_cpu_attention_under_h2d on this CPU, its pinned copies stood in for: the CPU rate counts every layer of
    every pass, alone and together (a fake layer sleeping a known time per call gives a known rate: the fractions are
    ~1, nothing shared), the copy rate is the stand-in's bytes over its copies' span; a copy thread that fails raises
    (profile_host then leaves the point unmeasured, tests/test_hardware.py)."""
    pytest.importorskip("torch")
    import torch

    from lightning_moe.pipeline import dram_sharing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dram_sharing, "PinnedCopyLoad", _HostCopies)
    calls = []

    def layer(l):  # 4 MB of "KV" per call, >= 5 ms each: at most 0.8 GB/s
        calls.append(l)
        time.sleep(0.005)

    pt = dram_sharing.measure_cpu_attention_under_h2d(layer, 4_000_000, 3, windows=2, window_s=0.1,
                                                      copy_bytes=1 << 20)
    assert 0.4e9 < pt.cpu_alone <= 0.8e9 and 0.4e9 < pt.cpu_together <= 0.8e9, pt
    assert 0.1e9 < pt.h2d_alone <= 0.53e9 and 0.1e9 < pt.h2d_together <= 0.53e9, pt
    assert min(pt.fractions) > 0.5 and max(pt.fractions) <= 1.0
    assert len(calls) % 3 == 0 and len(calls) >= 3 * (1 + 4 * 6)  # whole passes: a warm-up, then 4 windows >= 0.1 s
    monkeypatch.setattr(_HostCopies, "fail", True)
    with pytest.raises(RuntimeError, match="no copy"):
        dram_sharing.measure_cpu_attention_under_h2d(layer, 4_000_000, 3, windows=1, window_s=0.02)


def test_a_measured_profile_without_the_point_says_so_where_the_decode_attends_on_the_cpu():
    spec = resolve_spec("mixtral-8x7b")
    wl = Workload(prompt_len=150, gen_len=16)
    measured = dataclasses.replace(get_preset("h200"), host_issue_cpu_attn=0.002, host_issue_gpu_attn=0.003)
    cpu_pol, gpu_pol = Policy(mu=128, n=2, prefill_mu=16), Policy(mu=128, n=2, prefill_mu=16, n_gpu_attn=2)

    def notes(hw, pol):
        return [n for n in hrm.evaluate(pol, spec, hw, wl).notes if "beside pinned H2D copies" in n]

    (note,) = notes(measured, cpu_pol)
    assert note.startswith("note: hardware h200 has no measured point of CPU attention beside pinned H2D copies")
    assert not notes(measured, gpu_pol)  # no CPU attention: nothing to share
    assert not notes(shared(measured, 0.6, 0.9), cpu_pol)  # measured: no note
    assert not notes(get_preset("h200"), cpu_pol)  # a preset: its no-host-stage note says enough


def test_a_copy_thread_that_fails_raises_instead_of_hanging():
    """PinnedCopyLoad whose thread dies before its first copy (here: no CUDA stream on a CPU tensor) raises its error
    at once on entry (helper-63's review: the wait for the first copy spun forever)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("needs a copy that fails: a CPU host")
    from lightning_moe.pipeline.dram_sharing import PinnedCopyLoad

    load = PinnedCopyLoad.__new__(PinnedCopyLoad)  # its __init__ pins memory, which needs CUDA
    load.host, load.dev, load.done, load.error = torch.empty(4), torch.empty(4), [], None
    load._stop, load._thread = threading.Event(), threading.Thread(target=load._run, daemon=True)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="pinned copy thread failed"):
        with load:
            pass
    assert time.perf_counter() - t0 < 10
