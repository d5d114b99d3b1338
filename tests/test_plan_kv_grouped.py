"""The planner's KV sizing with real prompt lengths (Workload.prompt_lens, hrm.kv_cache_bytes, milp.plan's KV
fixed point) against the bytes CGOPipe's grouped KV caches really allocate."""

import random

import pytest
import torch

from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.policy import batching as microbatch
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.kv_cache import KV_GROUPS, GroupedKVCache
from lightning_moe.policy.batching import length_groups, padded_positions
from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import GiB, HardwareProfile, get_preset
from lightning_moe.policy.policy import Budgets, Policy, Workload
from lightning_moe.policy.registry import resolve_spec

MiB = 1 << 20


def _skewed(seed=0, short=570, long=30):
    rng = random.Random(seed)
    return [rng.randint(4, 40) for _ in range(short)] + [rng.randint(150, 400) for _ in range(long)]


def _max_sized(wl: Workload) -> Workload:
    """The same job without its prompt lengths: every sequence sized for the longest prompt."""
    return Workload(prompt_len=wl.prompt_len, gen_len=wl.gen_len, max_prompt_len=wl.max_prompt_len,
                    num_requests=wl.num_requests, name=wl.name)


def test_workload_kv_positions():
    lens = [10, 20, 33, 33, 5]
    w = Workload.from_lengths(lens, gen_len=8, name="j")
    assert w.prompt_lens == tuple(lens) and hash(w) == hash(Workload.from_lengths(lens, gen_len=8, name="j"))
    assert w.kv_len == 41 and w.kv_positions(1) == 41 and w.kv_positions(2) == 41  # the two 33s
    top = sorted(lens, reverse=True)
    for N in range(1, 8):
        t = top[:N]
        assert w.kv_positions(N) == pytest.approx(padded_positions(t, length_groups(t, KV_GROUPS)) / len(t) + 8)
    assert w.kv_positions(5) == pytest.approx(sum(lens) / 5 + 8)  # 5 distinct-or-equal lengths, 8 groups: no padding
    assert w.kv_positions(50) == w.kv_positions(5)  # N >= count: all of them
    assert _max_sized(w).kv_positions(3) == 41.0
    assert microbatch.KV_GROUPS == KV_GROUPS == 8
    big = Workload.from_lengths(_skewed(), gen_len=16)
    seq = [big.kv_positions(N) for N in (1, 2, 8, 32, 64, 128, 256, 600, 5000)]
    assert seq == sorted(seq, reverse=True) and seq[0] == big.kv_len and seq[-1] < big.kv_len / 3  # non-increasing
    assert Workload(prompt_len=4, gen_len=2, max_prompt_len=9, prompt_lens=[1, 9, 2]).prompt_lens == (1, 9, 2)
    for bad in ([], (1, -2), (True, 3), (1, 2.5), (1, 50)):
        with pytest.raises(ValueError, match="prompt_lens"):
            Workload(prompt_len=4, gen_len=2, max_prompt_len=9, prompt_lens=bad)
    with pytest.raises(ValueError, match="kv_positions"):
        w.kv_positions(0)


def test_kv_cache_bytes_split_bounds_the_executor_caches():
    """n_gpu_attn > 0: the CPU holds the longest micro-batches. Each side's estimate bounds the grouped caches
    of the batch of the N longest prompts (GPU: the shortest micro-batches)."""
    spec = resolve_spec("mixtral-8x7b")
    lens = _skewed(1, 200, 20)
    wl = Workload.from_lengths(lens, gen_len=32)
    per_pos = hrm.kv_bytes_per_position(spec, "bf16")
    for mu, n, g in ((16, 4, 1), (16, 4, 0), (16, 4, 4), (32, 5, 2)):
        pol = Policy(mu=mu, n=n, prefill_mu=1, n_gpu_attn=g)
        gpu, cpu = hrm.kv_cache_bytes(pol, spec, wl)
        batch = sorted(lens, reverse=True)[: pol.N]
        mbs = microbatch.group_by_length(batch, mu, n)  # as CGOPipeExecutor._micro_batches: shortest first
        alloc = [padded_positions([batch[r] + 32 for r in rows], length_groups([batch[r] + 32 for r in rows], KV_GROUPS))
                 for rows in mbs]
        assert sum(alloc[:g]) * per_pos <= gpu and sum(alloc[g:]) * per_pos <= cpu
        m = hrm.memory_estimate(pol, spec, wl)
        assert (m.gpu_decode["GPU KV cache"], m.cpu["CPU KV cache"]) == (gpu, cpu)
        if g == 0:
            assert gpu == 0 and cpu == pytest.approx(pol.N * wl.kv_positions(pol.N) * per_pos, abs=1)
        # never more than sizing every sequence for the longest prompt
        old = hrm.kv_cache_bytes(pol, spec, _max_sized(wl))
        assert gpu <= old[0] and cpu <= old[1]


def _toy_hw() -> HardwareProfile:
    """CPU attention cheap, GPU attention expensive: the planner keeps the KV in host memory."""
    return HardwareProfile(name="toy", gpu_memory=1 << 30, gpu_hbm_bandwidth=1e8, gpu_flops_bf16=1e12, gpu_flops_fp16=1e12,
                           gpu_flops_fp32=1e12, pcie_h2d=3e8, pcie_d2h=1e10, host_memory=1 << 30, host_memory_bandwidth=1e10,
                           cpu_attention_bandwidth=1e11, cpu_attention_flops=1e11, cpu_cores=4)


def test_plan_grows_N_and_estimate_matches_grouped_caches(tiny_dir):
    """Tiny spec, skewed lengths, KV-bound host memory: N grows 4x over max-prompt sizing, the final policy passes
    the exact memory check, and the estimated CPU KV equals (bounds) what the executor's caches allocate for
    the batch of the N longest prompts."""
    spec = MoESpec.from_pretrained_dir(tiny_dir)
    lens = _skewed()
    wl = Workload.from_lengths(lens, gen_len=8)
    b = Budgets(gpu_memory=100 * MiB, cpu_memory=24 * MiB, dtype="fp32", weight_quant="fp32", gpu_reserve=0, cpu_reserve=0)  # host-bound
    hw = _toy_hw()
    old, old_est = milp.plan(spec, hw, _max_sized(wl), b)
    pol, est = milp.plan(spec, hw, wl, b)
    assert pol.N >= 2 * old.N, (old, pol)
    assert not hrm.memory_violations(pol, spec, wl) and est.cpu_peak <= b.cpu_memory
    assert "positions/sequence" in est.notes[-1]
    # the max-prompt policy would not fit this many sequences
    assert hrm.memory_violations(pol, spec, _max_sized(wl))

    g = torch.Generator().manual_seed(0)
    batch = sorted(lens, reverse=True)[: pol.N]  # the worst batch the runner forms (length-sorted requests)
    prompts = [torch.randint(3, 32000, (m,), generator=g).tolist() for m in batch]
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu")
    try:
        mbs = ex._micro_batches(prompts, wl.gen_len, True, pol.mu)
        allocated = sum(mb.kv.nbytes for mb in mbs)
    finally:
        ex.close()
    assert all(isinstance(mb.kv, GroupedKVCache) for mb in mbs)
    predicted = est.cpu_breakdown["CPU KV cache"] + est.memory.gpu_decode["GPU KV cache"]
    assert allocated <= predicted <= 1.03 * allocated, (allocated, predicted)
    # the max-prompt sizing of the same policy overestimates by far
    assert hrm.memory_estimate(pol, spec, _max_sized(wl)).cpu["CPU KV cache"] > 2 * allocated


def test_plan_mixtral_skewed_lengths_grows_N():
    """Mixtral-8x7B on an L4-class host with a MT-Bench-like skew (a few long prompts): more sequences in flight."""
    spec, hw = resolve_spec("mixtral-8x7b"), get_preset("l4")
    rng = random.Random(3)
    lens = [rng.randint(20, 130) for _ in range(3800)] + [rng.randint(180, 430) for _ in range(200)]
    wl = Workload.from_lengths(lens, gen_len=32)
    b = Budgets(gpu_memory=24 * GiB, cpu_memory=120 * GiB)
    old, _ = milp.plan(spec, hw, _max_sized(wl), b)
    pol, est = milp.plan(spec, hw, wl, b)
    assert pol.N > old.N and not hrm.memory_violations(pol, spec, wl)
    assert est.cpu_breakdown["CPU KV cache"] + est.memory.gpu_decode["GPU KV cache"] <= sum(
        hrm.kv_cache_bytes(pol, spec, _max_sized(wl)))


def test_kv_fixed_point_never_worse_and_always_fits(tiny_dir):
    """Random skewed jobs: the grouped sizing's plan fits exactly and is never slower than the max-prompt plan
    (pass 1 is that plan)."""
    spec = MoESpec.from_pretrained_dir(tiny_dir)
    for seed in (1, 2, 5, 10, 18, 28, 37):
        rng = random.Random(seed)
        wl = Workload.from_lengths(_skewed(seed, rng.randint(50, 600), rng.randint(1, 60)), gen_len=rng.choice([4, 8, 16]))
        b = Budgets(gpu_memory=rng.randint(40, 120) * MiB, cpu_memory=rng.randint(8, 40) * MiB, dtype="fp32",
                    weight_quant="fp32", gpu_reserve=0, cpu_reserve=0)
        old, old_est = milp.plan(spec, _toy_hw(), _max_sized(wl), b)
        pol, est = milp.plan(spec, _toy_hw(), wl, b)
        assert not hrm.memory_violations(pol, spec, wl)
        assert est.e2e_tok_s >= old_est.e2e_tok_s * (1 - 1e-8) and pol.N >= old.N, (seed, old, pol)


@pytest.mark.parametrize("seed", [0, 3, 28])
def test_kv_guarded_pass_only_yields_policies_that_fit(tiny_dir, seed):
    """A pass at kv_positions(K) with rows N >= K, N_cpu >= K y_cpu: every Dinkelbach iterate fits hrm's exact
    bytes (strict=True raises otherwise) and sizes at least K sequences."""
    spec = MoESpec.from_pretrained_dir(tiny_dir)
    rng = random.Random(seed)
    wl = Workload.from_lengths(_skewed(seed, rng.randint(300, 600), rng.randint(10, 60)), gen_len=8)
    b = Budgets(gpu_memory=rng.randint(60, 120) * MiB, cpu_memory=rng.randint(16, 40) * MiB, dtype="fp32",
                weight_quant="fp32", gpu_reserve=0, cpu_reserve=0)
    cands = [8, 16, 32, 64, 128, 256]
    for K in (16, 64, 128):
        got, fits, *_ = milp._solve_for_kv_len(spec, _toy_hw(), wl, b, cands, None, 20.0, wl.kv_positions(K), K, strict=True)
        assert got is not None and fits
        assert milp._kv_sizing_count(got[0]) >= K and not hrm.memory_violations(got[0], spec, wl)


def test_job_workload_carries_the_prompt_lengths(tmp_path, tiny_dir):
    """app.plan.job_workload_from_prepared: the planner sees every tokenized prompt length (KV sized from them)."""
    import json

    from lightning_moe.config import job_from_dict
    from lightning_moe.app.plan import Prepared, job_workload_from_prepared

    data = tmp_path / "in.jsonl"
    with open(data, "w") as f:
        for i, n in enumerate([1, 2, 3, 40, 2, 1]):
            f.write(json.dumps({"id": f"q{i}", "prompt": " ".join(["alpha"] * n)}) + "\n")
    job = job_from_dict({"model": tiny_dir, "data": {"source": "jsonl", "path": str(data)},
                         "output": {"path": str(tmp_path / "o.jsonl")}, "device": "cpu", "dtype": "float32",
                         "generation": {"max_new_tokens": 6}}, "job.yaml", base_dir=str(tmp_path))
    prep = Prepared(job)
    wl = job_workload_from_prepared(prep)
    assert wl.prompt_lens == tuple(t.prompt_tokens for t in prep.treqs) and wl.num_requests == 6
    assert wl.kv_positions(6) < wl.kv_len  # the 40-word prompt does not size the others


def test_cpu_stage_charges_one_call_per_kv_group():
    """hrm: a CPU micro-batch issues one attention call per KV length group, min(KV_GROUPS, mu) of them."""
    spec = resolve_spec("mixtral-8x7b")
    hw = get_preset("l4").with_overrides(cpu_attention_overhead=1e-3, cpu_attention_bandwidth=1e18, cpu_attention_flops=1e18)
    assert [hrm.cpu_attention_calls(m) for m in (1, 4, 8, 64)] == [1, 4, 8, 8]
    for mu, n in ((4, 3), (64, 2)):
        st = hrm.decode_layer_times(spec, hw, Policy(mu=mu, n=n, prefill_mu=1), 0, 0, 100.0)
        gpu_mb = hrm.gpu_layer_time(spec, hw, mu, False)
        calls = min(8, mu) * 1e-3  # one micro-batch's calls; the stage: all n, or one micro-batch's round trip
        assert st.cpu == pytest.approx(max(n * calls, calls + gpu_mb), rel=1e-6)
