"""The planner's MILP (policy/milp.py): exact against brute force over the HRM, monotone, clear refusals."""

import collections
import random

import pytest

from lightning_moe.model.spec import MoESpec
from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import GiB, HardwareProfile, get_preset
from lightning_moe.policy.policy import Budgets, PlanInfeasible, Workload
from lightning_moe.policy.registry import resolve_spec


def tiny_spec(L=2, E=4, dense=0, shared=0, mla=False) -> MoESpec:
    """A tiny Mixtral-like spec; ``mla``: DeepSeek-V2's attention (latent cache 32 + rope 8, 4 heads of 16 + 8)."""
    attn = (dict(model_type="deepseek_v2", num_kv_heads=4, head_dim=24, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16)
            if mla else dict(model_type="mixtral", num_kv_heads=2, head_dim=16))
    return MoESpec(name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=L, num_heads=4,
                   num_experts=E, top_k=2, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=512,
                   dense_layers=tuple(range(dense)), dense_intermediate_size=256 if dense else 0,
                   num_shared_experts=shared, shared_intermediate_size=64 if shared else 0, **attn)


def random_case(seed: int, mla: bool = False):
    rng = random.Random(seed)
    spec = tiny_spec(L=rng.choice([2, 3]), E=rng.choice([3, 4]), dense=rng.choice([0, 0, 1]), shared=rng.choice([0, 1]),
                     mla=mla)
    hw = HardwareProfile(
        name="toy", gpu_memory=1 << 30, gpu_hbm_bandwidth=10 ** rng.uniform(9.5, 11.5), gpu_flops_bf16=10 ** rng.uniform(10.5, 12.5),
        gpu_flops_fp16=1e12, gpu_flops_fp32=1e11, pcie_h2d=10 ** rng.uniform(6.5, 8.5), pcie_d2h=10 ** rng.uniform(6.5, 8.5),
        host_memory=1 << 30, host_memory_bandwidth=1e10, cpu_attention_bandwidth=10 ** rng.uniform(6, 8),
        cpu_attention_flops=10 ** rng.uniform(7.5, 9.5), cpu_cores=4,
        # fixed per-micro-batch costs (GPU issue, CPU attention call): absent in half the cases
        microbatch_overhead=rng.choice([0.0, 10 ** rng.uniform(-6, -3)]),
        cpu_attention_overhead=rng.choice([0.0, 10 ** rng.uniform(-6, -3)]))
    wl = Workload(prompt_len=rng.choice([8, 16, 24]), gen_len=rng.choice([2, 4, 6]), max_prompt_len=rng.choice([None, 30]))
    ne, We = spec.non_expert_bytes(), spec.expert_bytes()
    budgets = Budgets(gpu_memory=int(ne + rng.uniform(4, 14) * We + rng.uniform(0, 4e5)),
                      cpu_memory=int(rng.uniform(3, 14) * We + rng.uniform(1e5, 6e5)), gpu_reserve=0, cpu_reserve=0)
    return spec, hw, wl, budgets


def brute_force(spec, hw, wl, budgets, cands, n_max):
    """Every (mu, n, resident count R, GPU-attention micro-batches) on the grid, evaluated with hrm."""
    best = None
    for mu in cands:
        for n in range(1, n_max + 1):
            for R in range(spec.num_moe_layers * spec.num_experts + 1):
                for g in range(n + 1):
                    pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
                    if hrm.memory_violations(pol, spec, wl):
                        continue
                    tps = hrm.evaluate(pol, spec, hw, wl).e2e_tok_s
                    if best is None or tps > best[0]:
                        best = (tps, pol)
    return best


def _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed):
    """Plan without tie-break and check it against brute force over hrm.py: both infeasible, or the same
    throughput (1e-7) with a policy that fits. Returns (policy, estimate, brute-force result) or None."""
    bf = brute_force(spec, hw, wl, budgets, cands, n_max)
    if bf is None:
        with pytest.raises(PlanInfeasible):
            milp.plan(spec, hw, wl, budgets, candidates=cands, n_max=n_max, tie_break=False, prefill_growth=False)
        return None
    pol, est = milp.plan(spec, hw, wl, budgets, candidates=cands, n_max=n_max, tie_break=False, prefill_growth=False)
    assert est.e2e_tok_s == pytest.approx(bf[0], rel=1e-7), (seed, pol, bf[1])
    assert not hrm.memory_violations(pol, spec, wl)
    return pol, est, bf


def test_milp_equals_brute_force_on_small_grids():
    cands, n_max = [2, 4, 8], 4  # 3 micro-batch sizes x 4 counts x all placements x all attention splits
    seen = collections.Counter()
    solved = 0
    for seed in range(60):  # 60 seeds: CPU attention wins in only a few of them (seeds 45, 50, 52)
        spec, hw, wl, budgets = random_case(seed)
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        if got is None:
            continue
        pol, est, bf = got
        # the tie-break keeps the optimum
        pol2, est2 = milp.plan(spec, hw, wl, budgets, candidates=cands, n_max=n_max)
        assert est2.e2e_tok_s >= bf[0] * (1 - 1e-8) and pol2.n <= pol.n
        solved += 1
        seen[est.decode_binding] += 1
        R = bf[1].total_resident(spec)
        seen["some resident"] += R > 0
        seen["some paged"] += R < spec.num_moe_layers * spec.num_experts
        seen["gpu-attn" if bf[1].n_gpu_attn else "cpu-attn"] += 1
    # the grid exercises every decision: several binding stages, residency and the attention split both ways
    assert solved >= 15
    assert len({k for k in seen if k in hrm.STAGES}) >= 2, seen
    assert min(seen["some resident"], seen["some paged"], seen["gpu-attn"], seen["cpu-attn"]) >= 1, seen


def test_milp_equals_brute_force_for_mla_with_gpu_attention():
    """Multi-head latent attention (DeepSeek): the planner weighs GPU-attention micro-batches as for GQA (the latent
    cache on the GPU, its workspace by hrm.gpu_decode_attention_workspace); the MILP matches brute force over every
    attention split, and some seeds put a micro-batch's attention on the GPU."""
    cands, n_max = [2, 4, 8], 3
    seen = collections.Counter()
    for seed in range(25):
        spec, hw, wl, budgets = random_case(seed, mla=True)
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        if got is not None:
            seen["gpu-attn" if got[2][1].n_gpu_attn else "cpu-attn"] += 1
    assert min(seen["gpu-attn"], seen["cpu-attn"]) >= 1, seen


def _plan_tps(spec, hw, wl, budgets, **kw):
    try:
        return milp.plan(spec, hw, wl, budgets, **kw)[1].e2e_tok_s
    except PlanInfeasible:
        return 0.0


def test_throughput_monotone_in_gpu_memory_pcie_and_host_memory():
    spec, hw, wl = resolve_spec("mixtral-8x7b"), get_preset("l4"), Workload(prompt_len=77, gen_len=8)
    gpu = [_plan_tps(spec, hw, wl, Budgets(gpu_memory=g * GiB, cpu_memory=192 * GiB)) for g in (8, 12, 16, 24, 40, 80)]
    assert gpu[0] == 0.0 and gpu[-1] > gpu[1] > 0  # 8 GiB cannot hold the weights + page buffers
    assert all(b >= a * (1 - 1e-9) for a, b in zip(gpu, gpu[1:])), gpu
    pcie = [_plan_tps(spec, hw.with_overrides(pcie_h2d=bw * 1e9, pcie_d2h=bw * 1e9), wl, Budgets(gpu_memory=24 * GiB, cpu_memory=192 * GiB))
            for bw in (4, 8, 16, 32, 64)]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(pcie, pcie[1:])) and pcie[-1] > pcie[0], pcie
    host = [_plan_tps(spec, hw, wl, Budgets(gpu_memory=24 * GiB, cpu_memory=c * GiB)) for c in (48, 76, 96, 192, 384)]
    assert host[0] == 0.0 and host[-1] > host[1] > 0  # 72 GiB: the pool + one layer as read need 73.5 GiB to load
    assert all(b >= a * (1 - 1e-9) for a, b in zip(host, host[1:])), host


def test_throughput_monotone_small_random():
    for seed in (3, 11, 19):
        spec, hw, wl, budgets = random_case(seed)
        for field in ("gpu_memory", "cpu_memory"):
            vals = []
            for f in (0.8, 1.0, 1.3, 2.0):
                b = Budgets(**{**budgets.__dict__, field: int(getattr(budgets, field) * f)})
                vals.append(_plan_tps(spec, hw, wl, b, candidates=[2, 4, 8], n_max=4))
            assert all(b >= a * (1 - 1e-9) for a, b in zip(vals, vals[1:])), (seed, field, vals)


def test_infeasible_gpu_budget_message():
    spec, hw, wl = resolve_spec("mixtral-8x7b"), get_preset("l4"), Workload(prompt_len=77, gen_len=32)
    with pytest.raises(PlanInfeasible) as e:
        milp.plan(spec, hw, wl, Budgets(gpu_memory=6 * GiB, cpu_memory=192 * GiB))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("infeasible: GPU memory 6.00 GiB < 9.26 GiB needed for non-expert weights (2.99 GiB) + 2 expert page buffers (5.25 GiB)"), msg


def test_infeasible_host_budget_message():
    spec, hw, wl = resolve_spec("mixtral-8x7b"), get_preset("l4"), Workload(prompt_len=77, gen_len=32)
    with pytest.raises(PlanInfeasible) as e:
        milp.plan(spec, hw, wl, Budgets(gpu_memory=24 * GiB, cpu_memory=32 * GiB))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("infeasible: host memory 32.00 GiB < ") and "experts that do not fit on the GPU" in msg, msg
    # the named shortfall is real: with that much host memory a plan exists
    need = float(msg.split("< ")[1].split(" GiB")[0])
    milp.plan(spec, hw, wl, Budgets(gpu_memory=24 * GiB, cpu_memory=int((need + 0.2) * GiB)))


def test_plan_respects_budgets_requests_and_quantization():
    spec, hw = resolve_spec("mixtral-8x7b"), get_preset("l4")
    wl = Workload(prompt_len=77, gen_len=32)
    b = Budgets(gpu_memory=24 * GiB, cpu_memory=192 * GiB)
    pol, est = milp.plan(spec, hw, wl, b)
    assert est.gpu_peak <= b.gpu_memory and est.cpu_peak <= b.cpu_memory
    assert pol.mu % pol.prefill_mu == 0 and pol.prefill_mu * 77 <= milp.PREFILL_TOKENS
    assert est.e2e_tok_s == pytest.approx(hrm.evaluate(pol, spec, hw, wl).e2e_tok_s, rel=1e-12)
    assert "proven optimal" in est.notes[-1]
    # 80 prompts (MT-Bench): never more sequences in flight than the job has
    pol80, _ = milp.plan(spec, hw, Workload(prompt_len=77, gen_len=32, num_requests=80), b)
    assert pol80.N <= 80
    # int4 experts move 3.8x fewer bytes over PCIe: a PCIe-bound plan gets faster
    _, est4 = milp.plan(spec, hw, wl, Budgets(gpu_memory=24 * GiB, cpu_memory=192 * GiB, weight_quant="int4"))
    assert est.decode_binding == "h2d" and est4.decode_tok_s > est.decode_tok_s


@pytest.mark.parametrize("name,preset,gpu,cpu", [("deepseek-v2-lite", "t4", 15, 64), ("qwen1.5-moe-a2.7b", "l4", 12, 64)])
def test_plan_other_families(name, preset, gpu, cpu):
    spec, hw = resolve_spec(name), get_preset(preset)
    wl = Workload(prompt_len=128, gen_len=16)
    pol, est = milp.plan(spec, hw, wl, Budgets(gpu_memory=gpu * GiB, cpu_memory=cpu * GiB))
    assert est.e2e_tok_s > 0 and not hrm.memory_violations(pol, spec, wl)
    assert pol.resident_counts(spec)[: spec.num_dense_layers] == (0,) * spec.num_dense_layers


def test_plan_dense_layers_anywhere():
    """Dense layers that are not the leading ones (Qwen2/3-MoE decoder_sparse_step=2: layers 0, 2, 4, ...) keep no
    resident experts, page nothing, and the resident experts spread over the MoE layers only."""
    import dataclasses

    spec = dataclasses.replace(resolve_spec("qwen1.5-moe-a2.7b"), dense_layers=tuple(range(0, 24, 2)),
                               dense_intermediate_size=5632)
    hw, wl = get_preset("l4"), Workload(prompt_len=128, gen_len=16)
    budgets = Budgets(gpu_memory=12 * GiB, cpu_memory=64 * GiB)
    pol = milp.policy_from_decisions(spec, wl, budgets, 8, 2, 12 * 3 + 5, 0)
    assert pol.resident_counts(spec) == tuple(0 if i % 2 == 0 else 3 + (i < 11) for i in range(24))
    pol, est = milp.plan(spec, hw, wl, budgets)
    assert est.e2e_tok_s > 0 and not hrm.memory_violations(pol, spec, wl)
    counts = pol.resident_counts(spec)
    assert all(counts[i] == 0 for i in spec.dense_layers)
    assert hrm.memory_estimate(pol, spec, wl).cpu["pinned experts (not resident)"] == (
        (12 * spec.num_experts - sum(counts)) * spec.expert_bytes(pol.weight_quant))


@pytest.mark.parametrize("field", ["cpu_attention_overhead", "microbatch_overhead"])
def test_milp_equals_brute_force_with_large_fixed_costs(field):
    """Fixed per-micro-batch costs large enough to decide the policy: the MILP still matches brute force."""
    import dataclasses

    cands, n_max = [2, 4, 8], 4
    checked = 0
    for seed in range(12):
        spec, hw, wl, budgets = random_case(seed)
        hw = dataclasses.replace(hw, **{field: 10 ** random.Random(seed).uniform(-2, 0)})
        bf = brute_force(spec, hw, wl, budgets, cands, n_max)
        if bf is None:
            continue
        pol, est = milp.plan(spec, hw, wl, budgets, candidates=cands, n_max=n_max, tie_break=False, prefill_growth=False)
        assert est.e2e_tok_s == pytest.approx(bf[0], rel=1e-7), (seed, pol, bf[1])
        checked += 1
    assert checked >= 6


def test_milp_equals_brute_force_with_quantized_pages():
    """int4 pages: the dequantization scratch (memory, E dense experts) and time (GPU stage, all E experts per
    layer visit) shape the optimum; the MILP still matches brute force over hrm. The GPU bandwidth is lowered to
    1-10x PCIe so the dequantization time matters."""
    import dataclasses

    cands, n_max = [2, 4, 8], 4
    checked, deq_binding = 0, 0
    for seed in range(24):
        spec, hw, wl, budgets = random_case(seed)
        rng = random.Random(1000 + seed)
        hw = dataclasses.replace(hw, gpu_hbm_bandwidth=hw.pcie_h2d * rng.uniform(1, 10))
        budgets = dataclasses.replace(budgets, weight_quant="int4")
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        if got is None:
            continue
        pol, est, bf = got
        assert est.memory.gpu_decode["dequantized expert scratch"] == spec.num_experts * spec.expert_bytes("bf16")
        checked += 1
        # the optimum has a GPU-bound layer that dequantizes (so the new term shaped it)
        layers = list(est.prefill_layers) + list(est.decode_first_layers)
        deq = (any(st.binding == "gpu" for st in est.decode_first_layers)
               or any(st.binding == "gpu" for st in est.prefill_layers))
        deq_binding += bool(deq and layers)
    assert checked >= 10
    assert deq_binding >= 3, deq_binding


def random_decisions(spec, rng: random.Random, cands, count: int = 3, n_max: int = 4):
    """Up to ``count`` random (mu, n, R, g) of the grid (an R the even spread cannot place is skipped)."""
    for _ in range(count):
        mu, n = rng.choice(cands), rng.randint(1, n_max)
        g, R = rng.randint(0, n), rng.randint(0, spec.num_moe_layers * spec.num_experts)
        r, x = divmod(R, spec.num_moe_layers)
        if not (r == spec.num_experts and x):
            yield mu, n, R, g


def pinned_time(spec, wl, C, mu: int, n: int, R: int, g: int) -> float:
    """The MILP's minimal T with every decision pinned (mu, n, R = L r + x, g), coefficients ``C``."""
    import pulp

    r, x = divmod(R, spec.num_moe_layers)
    model = milp._Model(spec, wl, C)
    for m in C.cands:
        model.prob += model.z[m] == int(m == mu)
        model.prob += model.w[m] == (n if m == mu else 0)
        model.prob += model.v[m] == (g if m == mu else 0)
    model.prob += model.r == r
    model.prob += model.x == x  # (with window classes the extras' split follows: windowed layers first)
    model.solve(1.0, 20.0)
    return float(pulp.value(model.T))


@pytest.mark.parametrize("quant", ["int4", "bf16"])
def test_milp_time_equals_hrm_for_fixed_decisions(quant):
    """With every decision pinned (mu, n, R -- uneven spreads included, so both layer classes exist -- and g), the
    MILP's minimal T equals hrm.evaluate's total time: the dequantization terms (wdq E Z for every MoE layer)
    are exact, not just good enough to pick the same optimum."""
    import dataclasses


    rng = random.Random(7)
    checked = 0
    for seed in range(10):
        spec, hw, wl, budgets = random_case(seed)
        hw = dataclasses.replace(hw, gpu_hbm_bandwidth=hw.pcie_h2d * rng.uniform(1, 10))
        budgets = dataclasses.replace(budgets, weight_quant=quant, gpu_memory=1 << 40, cpu_memory=1 << 40)
        cands = [2, 4, 8]
        C = milp._coefficients(spec, hw, wl, budgets, cands, 4, wl.kv_positions(1))
        for mu, n, R, g in random_decisions(spec, rng, cands):
            pol = milp.policy_from_decisions(spec, wl, budgets, mu, n, R, g)
            want = hrm.evaluate(pol, spec, hw, wl).total_time
            assert pinned_time(spec, wl, C, mu, n, R, g) == pytest.approx(want, rel=1e-6), (seed, mu, n, R, g)
            checked += 1
    assert checked >= 20


def test_two_gpus_in_tight_memory_plan_what_brute_force_finds():
    """Two GPUs (expert parallelism), budgets of a few experts: where brute force over hrm finds a policy, the plan
    equals it, and where it finds none, the plan refuses in one line. The pre-check (`diagnose`) once counted the
    GPU's growth per resident expert for one GPU: it asserted (no residency fitting by its count) or refused a plan
    that fits."""
    cands, n_max = [2, 4, 8], 3
    seen = collections.Counter()
    for seed in range(40):
        rng = random.Random(500 + seed)
        spec = tiny_spec(L=rng.choice([3, 4, 5]), E=rng.choice([4, 5]), dense=rng.choice([0, 1]))
        _, hw, wl, _ = random_case(seed)
        quant = rng.choice(["int4", "bf16"])
        ne, We = spec.non_expert_bytes(), spec.expert_bytes(quant)
        budgets = Budgets(gpu_memory=int(ne + rng.uniform(4, 3 * spec.num_layers + 6) * We + rng.uniform(0, 4e5)),
                          cpu_memory=int(rng.uniform(3, 3 * spec.num_layers + 6) * We + rng.uniform(1e5, 6e5)),
                          gpu_reserve=0, cpu_reserve=0, gpus=2, weight_quant=quant)
        got = _milp_matches_brute_force(spec, hw, wl, budgets, cands, n_max, seed)
        seen["planned" if got else "refused"] += 1
    assert seen["planned"] >= 10 and seen["refused"] >= 1, seen
