"""HRM (policy/hrm.py), MoESpec byte/FLOP properties, Policy and Workload.

The two-layer case is computed by hand below from the formulas in hrm.py's docstring (H1-H9), with every
intermediate number written out, not by calling hrm.
"""

import math

import pytest

from lightning_moe.model.spec import MoESpec
from lightning_moe.policy import hrm
from lightning_moe.policy.hardware import HardwareProfile
from lightning_moe.policy.policy import PlanInfeasible, Policy, PolicyError, Workload
from lightning_moe.policy.registry import REGISTRY, resolve_spec


def two_layer_spec(**kw) -> MoESpec:
    # D=8, F=16, E=4 (top-2), Hq=2, Hkv=1, hd=4, V=32
    base = dict(name="two", model_type="mixtral", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=4, num_experts=4, top_k=2, rope_theta=1e4, rms_norm_eps=1e-5,
                max_position_embeddings=64)
    base.update(kw)
    return MoESpec(**base)


def toy_hw(**kw) -> HardwareProfile:
    base = dict(name="toy", gpu_memory=10**6, gpu_hbm_bandwidth=1e5, gpu_flops_bf16=1e6, gpu_flops_fp16=1e6, gpu_flops_fp32=1e5,
                pcie_h2d=1e4, pcie_d2h=2e4, host_memory=10**6, host_memory_bandwidth=1e5, cpu_attention_bandwidth=700.0,
                cpu_attention_flops=1e4, cpu_cores=1)
    base.update(kw)
    return HardwareProfile(**base)


def rel(a, b):
    return abs(a - b) / abs(b)


def test_two_layer_hand_computed(monkeypatch):
    # the sampler's temporaries apart (test_sampler.py::test_micro_batch_workspace_covers_the_sampler): at this
    # toy vocabulary they would be the largest decode stage and hide the sums checked here
    monkeypatch.setattr(hrm, "SAMPLER_BYTES_PER_ELEM", 0)
    spec, hw = two_layer_spec(), toy_hw()
    pol = Policy(mu=2, n=3, prefill_mu=2, resident_experts=(1, 3), n_gpu_attn=1, gpu_reserve=0, cpu_reserve=0)
    wl = Workload(prompt_len=4, gen_len=3)
    est = hrm.evaluate(pol, spec, hw, wl)

    # sizes: attn_in = 8*(8+4+4) = 128, attn_out = 8*8 = 64, router 4*8 = 32, expert 3*8*16 = 384 elems = 768 B -> one 4096 B page
    We = 4096
    # ---- decode, one micro-batch of 2 tokens, per layer (H1 each: max(F/1e6, bytes/1e5)) ----
    qkv = max(2 * 2 * 128 / 1e6, (128 * 2 + 2 * (8 + 8 + 8) * 2) / 1e5)  # 3.52e-3
    o = max(2 * 2 * 64 / 1e6, (64 * 2 + 2 * (8 + 8) * 2) / 1e5)  # 1.92e-3
    router = max(2 * 2 * 4 * 8 / 1e6, (4 * 8 * 2 + 2 * 8 * 2 + 2 * 4 * 4) / 1e5)  # 1.28e-3
    active2 = 4 * (1 - (1 - 2 / 4) ** 2)  # 3 distinct experts for 2 tokens
    experts = max(2 * 2 * 2 * 384 / 1e6, (active2 * We + 2 * 2 * 2 * 8 * 2) / 1e5)  # 0.12416
    mb = qkv + o + router + experts
    assert mb == pytest.approx(0.13088, rel=1e-12)

    def attn_gpu(c):  # mu=2 sequences: F = 2 c 32, bytes = 2 (8 c + 8 + 8 + 8) 2
        return max(2 * c * 32 / 1e6, 2 * (8 * c + 24) * 2 / 1e5)

    cpu_seqs = (3 - 1) * 2
    d2h = cpu_seqs * (8 + 8) * 2 / 2e4  # 0.0064
    act_h2d = cpu_seqs * 8 * 2 / 1e4  # 0.0064
    h2d = [3 * We / 1e4 + act_h2d, 1 * We / 1e4 + act_h2d]  # layer 0 pages 3 experts, layer 1 pages 1

    def cpu(c):
        return max(cpu_seqs * c * 32 / 1e4, cpu_seqs * c * 8 * 2 / 700.0)

    head_dec = 3 * max(2 * 2 * 8 * 32 / 1e6, (32 * 8 * 2 + 2 * 32 * 4 + 2 * 2 * 8 * 2) / 1e5)  # n * 8.32e-3
    def cpu_mb(c):  # one CPU micro-batch (2 sequences); the toy profile has no fixed per-call cost
        return max(2 * c * 32 / 1e4, 2 * c * 8 * 2 / 700.0)

    t_dec = 0.0
    stages_l1_c5 = None
    for c in (5, 6):  # decode steps j = 1, 2: context 4 + j
        # some attention on the CPU: the CPU stage is at least one CPU micro-batch's round trip, its attention and
        # its GPU layer (cpu_mb + mb)
        gpu = 3 * mb + 1 * attn_gpu(c)
        cpu_c = max(cpu(c), cpu_mb(c) + mb)
        t_dec += sum(max(h, d2h, cpu_c, gpu) for h in h2d) + head_dec
        if c == 5:
            stages_l1_c5 = {"h2d": h2d[1], "d2h": d2h, "cpu": cpu_c, "gpu": gpu}
    # layer 0 is h2d-bound (1.2352 s); layer 1 is bound by the CPU's 2 micro-batches (4 sequences), cpu(5) = 0.45714 s
    # and cpu(6) = 0.54857 s, above the round trip (0.35945, 0.40517) and the GPU (0.39520, 0.39552)
    assert t_dec == pytest.approx(1.2352 * 2 + 0.02496 * 2 + 4 * 5 * 16 / 700 + 4 * 6 * 16 / 700, rel=1e-12)

    # ---- prefill: 3 prefill micro-batches of 2 prompts x 4 tokens (8 tokens each) ----
    qkv8 = max(2 * 8 * 128 / 1e6, (256 + 8 * 24 * 2) / 1e5)
    o8 = max(2 * 8 * 64 / 1e6, (128 + 8 * 16 * 2) / 1e5)
    router8 = max(2 * 8 * 32 / 1e6, (64 + 8 * 8 * 2 + 8 * 4 * 4) / 1e5)
    experts8 = max(2 * 8 * 2 * 384 / 1e6, (4 * (1 - 0.5 ** 8) * We + 8 * 2 * 2 * 8 * 2) / 1e5)
    attn8 = max(2 * (4 * 5 / 2) * 32 / 1e6, 2 * 4 * (8 + 8 + 8) * 2 / 1e5)  # causal: s (s+1) / 2 pairs
    chunk = qkv8 + o8 + router8 + experts8 + attn8
    gpu_p = 3 * chunk
    d2h_p = cpu_seqs * 4 * 8 * 2 / 2e4
    head_p = 3 * max(2 * 2 * 8 * 32 / 1e6, (512 + 2 * 32 * 4 + 2 * 8 * 8 * 2) / 1e5)
    t_pre = max(3 * We / 1e4, d2h_p, gpu_p) + max(1 * We / 1e4, d2h_p, gpu_p) + head_p
    assert t_pre == pytest.approx(1.2288 + 0.5568 + 0.03072, rel=1e-12)

    assert rel(est.prefill_time, t_pre) < 1e-9
    assert rel(est.decode_time, t_dec) < 1e-9
    assert rel(est.e2e_tok_s, 6 * 3 / (t_pre + t_dec)) < 1e-9
    assert rel(est.decode_tok_s, 6 * 2 / t_dec) < 1e-9
    assert rel(est.prefill_tok_s, 6 * 4 / t_pre) < 1e-9
    assert est.prefill_binding == "h2d" and est.decode_binding == "h2d"
    assert est.decode_first_layers[1].binding == max(stages_l1_c5, key=stages_l1_c5.get) == "cpu"
    # one CPU micro-batch beside the GPU one: its round trip (attention + its GPU layer) is the CPU stage
    one = Policy(mu=2, n=2, prefill_mu=2, resident_experts=(1, 3), n_gpu_attn=1)
    st = hrm.decode_layer_times(spec, hw, one, 1, 1, 5.0)
    assert st.cpu == pytest.approx(cpu_mb(5) + mb, rel=1e-12) and st.gpu == pytest.approx(2 * mb + attn_gpu(5), rel=1e-12)
    assert est.prefill_layers[1].binding == "gpu"

    # ---- memory (bytes) ----
    m = est.memory
    ne = 2 * (32 * 8 + 32 * 8 + 8 + 2 * (128 + 64 + 16 + 32))  # embed + lm_head + norm + 2 layers
    kv = 2 * 7 * 2 * 8 * 2  # 2 GPU-KV sequences x (4 + 3) positions x 2 layers x 8 elems x 2 B
    common = ne + 4 * We + 2 * 3 * We
    # decode rows: 6 rows x (hidden D 8 + RoPE 2 x hd 4) x 2 B + int64 position 8 B + fp32 logits V 32 x 4 B = 168 B
    rows_dec = 6 * ((8 + 8) * 2 + 8 + 32 * 4)
    # one decode micro-batch of T = 2 rows (P = T k = 4 pairs): q/k/v 2 x (8 + 8) x 2 B = 64, then the largest stage:
    # attention 2 x (8 + 8) x 2 = 64; FFN at the grouped kernel: attn out 2 x 8 x 2 = 32, residual + norm
    # 2 x 2 x 8 x 2 = 64, router logits + probs 2 x 2 x 4 x 4 = 64, top-k 2 x 2 x 12 = 48, pair indexes 4 x 48 = 192,
    # gate|up 4 x 16 x 2 = 128, slot outputs 4 x 8 x 4 = 128, fp32 sum 2 x 8 x 4 = 64, cast + second group
    # 2 x 2 x 8 x 2 = 64, the per-expert GEMM loop's 32 spare rows 32 x (8 + 16) x 2 = 1536, the Triton kernels'
    # pair-index padding 4 experts x MAX_BLOCK_M 128 x 4 B = 2048 -> 4368; head 2 x (8 + 32) x 2 = 160
    ws_mb = 64 + max(64, 32 + 64 + 64 + 48 + 192 + 128 + 128 + 64 + 64 + 1536 + 2048, 160)
    assert ws_mb == 4432
    attn_ws = 2 * 2 * 7 * (3 * 4 + 2)  # the GPU micro-batch's scores: mu 2 x Hq 2 x context 7 x (3 fp32 + 1 bf16)
    frag = math.ceil(0.5 * (2 * ws_mb + attn_ws))  # fragmentation allowance: half the transient workspaces (budgeted)
    assert sum(m.gpu_decode.values()) == common + kv + rows_dec + 2 * ws_mb + attn_ws + frag
    assert m.phase_allocated("decode") == common + kv + rows_dec + 2 * ws_mb + attn_ws + 64 * 2**20  # + library
    # prefill: 6 x 4 prompt tokens x ((8 + 8) x 2 + 34 B of position / indexes); one chunk of 2 prompts = 8 tokens
    # (P = 16): q/k/v 8 x 16 x 2 = 256; attention 5 x 8 x 8 x 2 + 8 x 8 x 2 + mask 8 x 4 = 800; FFN 128 + 256 + 256
    # + 192 + 768 + 512 + 512 + 256 + 256 + 1536 spare rows + 2048 pair-index padding = 6720; + k/v of two chunks to
    # the CPU 2 x 8 x 8 x 2 = 256
    chunk = 256 + max(800, 128 + 256 + 256 + 192 + 768 + 512 + 512 + 256 + 256 + 1536 + 2048) + 256
    head = 6 * 32 * 4 + 2 * (8 + 32) * 2  # last-token logits of 6 sequences + the head of one chunk: 928
    assert sum(m.gpu_prefill.values()) == common + kv + 6 * 4 * ((8 + 8) * 2 + 34) + chunk + head + chunk // 2
    # reserve 0; allocated leaves out the fragmentation allowance and adds the library workspaces
    pre_alloc = sum(m.gpu_prefill.values()) - chunk // 2 + 64 * 2**20
    assert m.gpu_peak_allocated == max(pre_alloc, common + kv + rows_dec + 2 * ws_mb + attn_ws + 64 * 2**20)
    assert set(m.gpu_phases) == {"prefill", "decode"}
    run = 4 * We + 4 * 7 * 2 * 8 * 2 + 2 * 4 * 24 * 2 + 2 * 2 * 4 * 8 * 2  # pinned 4 experts + CPU KV + staging
    assert sum(m.cpu.values()) == run
    # reading the checkpoint: the pool of the 4 paged experts as filled + one layer's 4 experts as read (the other
    # weights are on the GPU by then)
    assert m.cpu_load == {"page pool (filled layer by layer)": 4 * We, "one layer's experts (host, as read)": 4 * We,
                          "host reserve": 0}
    assert m.cpu_peak == max(run, 8 * We) and m.cpu_peak_phase == ("load" if 8 * We > run else "run")
    assert est.gpu_peak == max(sum(m.gpu_decode.values()), sum(m.gpu_prefill.values()))


def test_scoring_memory_hand_computed():
    """A scoring workload: one phase, no KV, the chunk or the scoring head, whichever is larger."""
    spec = two_layer_spec()
    pol = Policy(mu=6, n=1, prefill_mu=2, resident_experts=(1, 3), n_gpu_attn=1, gpu_reserve=1000, cpu_reserve=0)
    m = hrm.memory_estimate(pol, spec, Workload(prompt_len=4, gen_len=1, scoring=True))
    We = 4096
    ne = 2 * (32 * 8 + 32 * 8 + 8 + 2 * (128 + 64 + 16 + 32))
    chunk = 256 + 6720  # as in test_two_layer_hand_computed, without k/v on their way to a CPU cache (no KV)
    head = 8 * (8 * 2 + 32 * (2 + 8)) + 8 * (4 + 1 + 8)  # 8 rows: norm, lm_head, fp32 copy, log-softmax; per-token out
    assert head == 2792
    assert set(m.gpu_phases) == {"scoring"}
    frag = max(chunk, head) // 2
    assert m.phase_total("scoring") == ne + 4 * We + 2 * 3 * We + 24 * 66 + max(chunk, head) + frag + 1000
    assert m.gpu_peak_allocated == m.gpu_peak - 1000 - frag + 64 * 2**20
    assert hrm.kv_cache_bytes(pol, spec, Workload(prompt_len=4, gen_len=1, scoring=True)) == (0, 0)


def test_hrm_monotone_in_residency_and_bandwidth():
    spec, hw = two_layer_spec(), toy_hw()
    wl = Workload(prompt_len=4, gen_len=5)
    prev = None
    for R in range(0, 9):
        r, x = divmod(R, 2)
        pol = Policy(mu=2, n=3, prefill_mu=2, resident_experts=(r + (x > 0), r), n_gpu_attn=1)
        t = hrm.evaluate(pol, spec, hw, wl).total_time
        assert prev is None or t <= prev + 1e-15
        prev = t
    pol = Policy(mu=2, n=3, prefill_mu=2, resident_experts=1, n_gpu_attn=1)
    times = [hrm.evaluate(pol, spec, toy_hw(pcie_h2d=b), wl).total_time for b in (1e3, 1e4, 1e5, 1e6)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_roofline_and_active_experts():
    assert hrm.roofline(10, 4, 5, 1) == 4.0
    assert hrm.roofline(10, 4, 1, 1) == 10.0
    assert hrm.roofline(1, 1, 1, 1, link_bytes=30, link_bandwidth=10) == 3.0
    assert hrm.active_experts(1, 8, 2) == pytest.approx(2)
    assert hrm.active_experts(10_000, 8, 2) == pytest.approx(8)
    assert hrm.active_experts(0, 8, 2) == 0.0


def test_check_memory_one_line():
    spec = two_layer_spec()
    pol = Policy(mu=2, n=3, prefill_mu=2, resident_experts=4, n_gpu_attn=1, gpu_budget=10_000, cpu_budget=10**6)
    with pytest.raises(PlanInfeasible) as e:
        hrm.check_memory(pol, spec, Workload(prompt_len=4, gen_len=3))
    msg = str(e.value)
    assert msg.startswith("infeasible: GPU memory") and "\n" not in msg and "resident experts" in msg
    ok = Policy(mu=2, n=3, prefill_mu=2, gpu_budget=10**6, cpu_budget=10**6, gpu_reserve=0, cpu_reserve=0)
    assert hrm.check_memory(ok, spec, Workload(prompt_len=4, gen_len=3)).gpu_peak < 10**6


def test_mixtral_bytes_by_hand():
    s = REGISTRY["mixtral-8x7b"]
    assert s.total_params == 46_702_792_704
    assert s.expert_bytes("bf16") == 3 * 4096 * 14336 * 2 == 352_321_536
    assert s.expert_bytes("fp32") == 2 * 352_321_536
    # int4, group 128 along the input dim, fp16 scale + zero per group:
    gate = 14336 * 4096 // 2 + 14336 * (4096 // 128) * 4  # 29,360,128 packed + 1,835,008 meta
    down = 4096 * 14336 // 2 + 4096 * (14336 // 128) * 4
    assert s.expert_bytes("int4") == 2 * gate + down == 93_585_408  # already a multiple of 4096
    up2 = 14336 * 4096 // 4 + 14336 * 32 * 4
    assert s.expert_bytes("int2-up") == gate + up2 + down == 78_905_344
    assert s.kv_bytes_per_token("bf16") == 32 * 2 * 8 * 128 * 2
    assert s.non_expert_bytes() == 2 * (2 * 32000 * 4096 + 4096 + 32 * (4096 * (4096 + 2048) + 4096 * 4096 + 2 * 4096 + 8 * 4096))
    assert s.flops_per_token(0) == 2 * (32 * (4096 * 6144 + 4096 * 4096 + 8 * 4096 + 2 * 3 * 4096 * 14336) + 32000 * 4096)
    # padding: a 768-byte expert takes one 4096-byte page
    assert two_layer_spec().expert_bytes() == 4096
    with pytest.raises(ValueError):
        s.expert_bytes("int3")


@pytest.mark.parametrize("name,total_b,tol", [
    ("mixtral-8x7b", 46.7, 0.01), ("mixtral-8x22b", 141, 0.01), ("dbrx", 132, 0.01), ("qwen1.5-moe-a2.7b", 14.3, 0.01),
    ("qwen3-30b-a3b", 30.5, 0.01), ("qwen3-235b-a22b", 235.1, 0.01), ("deepseek-v2-lite", 15.7, 0.01),
    ("olmoe-1b-7b", 6.9, 0.01),
])
def test_registry_totals_match_published(name, total_b, tol):
    s = resolve_spec(name)
    assert abs(s.total_params / 1e9 - total_b) / total_b < tol


def test_deepseek_mla_kv_and_dense_layer():
    s = resolve_spec("deepseek-v2-lite")
    assert s.kv_bytes_per_token("bf16") == 27 * (512 + 64) * 2
    assert s.num_moe_layers == 26 and s.layer_bytes(0) < s.layer_bytes(1)
    pol = Policy(mu=4, n=2, prefill_mu=4, resident_experts=1)
    assert pol.resident_counts(s) == (0,) + (1,) * 26
    est = hrm.evaluate(pol, s, toy_hw(gpu_memory=10**12), Workload(prompt_len=16, gen_len=3))
    assert est.prefill_layers[0].h2d == 0.0 and est.prefill_layers[1].h2d > 0


def test_mla_cpu_attention_uses_the_latent_kernel_rate_by_hand():
    """(H5) of an MLA model: S c attn_flops_per_position / cpu_latent_attention_flops when the profile measured it (the
    GQA probe's cpu_attention_flops is a memory-bound shape's rate), cpu_attention_flops when not; a GQA model never
    uses the latent rate."""
    mla, gqa = resolve_spec("deepseek-v2-lite"), resolve_spec("mixtral-8x7b")
    hw = toy_hw(cpu_attention_flops=1e11, cpu_attention_bandwidth=1e14)  # the FLOP term binds
    S, c = 80, 215
    assert hrm.cpu_decode_attention_time(mla, hw, S, c) == pytest.approx(S * c * 16 * (2 * 576 + 2 * 512) / 1e11)
    fast = toy_hw(cpu_attention_flops=1e11, cpu_attention_bandwidth=1e14, cpu_latent_attention_flops=4e11)
    assert hrm.cpu_decode_attention_time(mla, fast, S, c) == pytest.approx(S * c * mla.attn_flops_per_position / 4e11)
    assert hrm.cpu_decode_attention_time(gqa, fast, S, c) == hrm.cpu_decode_attention_time(gqa, hw, S, c)


def test_cpu_attention_kv_rate_is_the_bandwidth_or_the_flop_rate_per_kv_byte():
    """The valid-KV rate (H5) allows a model: its KV bandwidth where that binds, else the FLOP rate over its FLOPs per
    KV byte (Mixtral: 2 * 32 * 256 FLOPs on 2 * 8 * 128 * 2 bytes per position = 4 FLOP per byte)."""
    gqa = resolve_spec("mixtral-8x7b")
    assert hrm.cpu_attention_kv_rate(gqa, toy_hw(cpu_attention_flops=1e14, cpu_attention_bandwidth=5e10)) == pytest.approx(5e10)
    assert hrm.cpu_attention_kv_rate(gqa, toy_hw(cpu_attention_flops=1e11, cpu_attention_bandwidth=5e10)) == pytest.approx(1e11 / 4)


def test_resolve_spec_aliases_and_errors(tmp_path):
    assert resolve_spec("mistralai/Mixtral-8x7B-v0.1").name == "mixtral-8x7b"
    with pytest.raises(ValueError, match="registry"):
        resolve_spec("no-such-model")


def test_policy_yaml_round_trip_and_errors(tmp_path):
    spec = two_layer_spec()
    for res in (3, (1, 4), ((0, 1), (1, 2), (1, 3))):
        p = Policy(mu=4, n=2, prefill_mu=2, resident_experts=res, n_gpu_attn=1, weight_quant="int4", gpu_budget=123, cpu_budget=456)
        path = tmp_path / "p.yaml"
        p.save(str(path), header="hello")
        q = Policy.load(str(path))
        assert q == p and q.N == 8 and q.resident_counts(spec) == p.resident_counts(spec)
    (tmp_path / "bad.yaml").write_text("mu: 4\nn: 2\nprefill_mu: 2\nsurprise: 1\n")
    with pytest.raises(PolicyError, match="bad.yaml: unknown key.*surprise"):
        Policy.load(str(tmp_path / "bad.yaml"))
    (tmp_path / "bad2.yaml").write_text("mu: four\nn: 2\nprefill_mu: 2\n")
    with pytest.raises(PolicyError, match="bad2.yaml: mu"):
        Policy.load(str(tmp_path / "bad2.yaml"))
    with pytest.raises(PolicyError):
        Policy(mu=2, n=2, prefill_mu=2, n_gpu_attn=3)
    with pytest.raises(PolicyError):
        Policy(mu=2, n=2, prefill_mu=2, resident_experts=(5, 0)).resident_counts(spec)
    with pytest.raises(PolicyError):
        Policy(mu=2, n=2, prefill_mu=2, resident_experts=((0, 1), (0, 1))).resident_counts(spec)


def test_workload_from_lengths():
    w = Workload.from_lengths([10, 20, 33], gen_len=8, name="j")
    assert w.prompt_len == pytest.approx(21.0) and w.max_prompt == 33 and w.num_requests == 3 and w.kv_len == 41
    assert Workload(prompt_len=76.5, gen_len=2).max_prompt == 77
    with pytest.raises(ValueError):
        Workload.from_lengths([], gen_len=8)
    with pytest.raises(ValueError):
        Workload(prompt_len=10, gen_len=0)
    assert math.isfinite(Workload(prompt_len=1, gen_len=1).kv_len)


# ---- quantized pages: dequantization scratch and time (CGOPipe's large-M Triton path) ----------------------
def test_dequant_time_and_scratch_by_hand(monkeypatch):
    # the sampler's temporaries apart (test_sampler.py::test_micro_batch_workspace_covers_the_sampler): at this
    # toy vocabulary they would be the largest decode stage and hide the sums checked here
    monkeypatch.setattr(hrm, "SAMPLER_BYTES_PER_ELEM", 0)
    """int4 pages of the two-layer toy (one 4096-byte page each, packed or dense bf16): T_deq per layer visit =
    E * (4096 + 4096) / 1e5 s on the GPU stage (all E = 4 experts, paged and resident, are dequantized); the
    scratch is E * 4096 bytes in both phases; bf16 pages add neither."""
    spec, hw = two_layer_spec(), toy_hw()
    assert spec.num_experts == 4 and spec.top_k == 2
    assert spec.expert_bytes("int4") == spec.expert_bytes("bf16") == 4096
    assert hrm.gpu_dequant_time(spec, hw, 3, "int4", "bf16") == pytest.approx(3 * 8192 / 1e5, rel=1e-15)
    assert hrm.gpu_dequant_time(spec, hw, 3, "bf16", "bf16") == 0.0
    mu = 8
    kw = dict(mu=mu, n=2, prefill_mu=mu, resident_experts=(1, 3), n_gpu_attn=2, gpu_reserve=0, cpu_reserve=0)
    q4, b16 = Policy(weight_quant="int4", **kw), Policy(**kw)
    for layer, nonres in ((0, 3), (1, 1)):
        d = hrm.decode_layer_times(spec, hw, q4, layer, nonres, 10.0)
        ref = hrm.decode_layer_times(spec, hw, b16, layer, nonres, 10.0)
        # the experts kernel reads the same 4096-byte pages either way, so only T_deq differs
        assert d.gpu - ref.gpu == pytest.approx(4 * 8192 / 1e5, abs=1e-12)
        assert (d.h2d, d.d2h, d.cpu) == (ref.h2d, ref.d2h, ref.cpu)
        # prefill: the same T_deq once per layer visit
        p = hrm.prefill_layer_times(spec, hw, q4, layer, nonres, 4.0)
        pref = hrm.prefill_layer_times(spec, hw, b16, layer, nonres, 4.0)
        assert p.gpu - pref.gpu == pytest.approx(4 * 8192 / 1e5, abs=1e-12)
    wl = Workload(prompt_len=4, gen_len=3)
    m4, m16 = hrm.memory_estimate(q4, spec, wl), hrm.memory_estimate(b16, spec, wl)
    # bf16 with 1 and 3 of 4 experts resident runs two grouped-kernel calls per layer (paged, resident), whose
    # first result is alive beside the second; int4 dequantizes every expert into one scratch: one call
    assert hrm.expert_groups("bf16") == 2 and hrm.expert_groups("int4") == 1
    T, D = hrm.prefill_chunk_shape(b16, wl)[0], spec.hidden_size
    extra = {"gpu_prefill": ("prefill chunk workspace", T * D * 2), "gpu_decode": ("decode workspaces (2 micro-batches)",
                                                                                  2 * mu * D * 2)}
    for phase, (ws, second_group) in extra.items():
        a, b = getattr(m4, phase), getattr(m16, phase)
        assert a["dequantized expert scratch"] == 4 * 4096  # one layer's E = 4 experts
        assert b["dequantized expert scratch"] == 0
        assert b[ws] - a[ws] == second_group
        assert {k: v for k, v in a.items() if k not in (ws, "dequantized expert scratch", "fragmentation allowance")} \
            == {k: v for k, v in b.items() if k not in (ws, "dequantized expert scratch", "fragmentation allowance")}


def test_expert_flops_cap_the_routed_expert_term_by_hand():
    """gpu_expert_flops replaces the GEMM peak in the routed-expert roofline only when it is lower (0: unmeasured)."""
    spec = two_layer_spec()
    T, k, D, F, E, b = 1024, 2, 8, 16, 4, 2
    flops = 2 * T * k * 3 * D * F
    nbytes = hrm.active_experts(T, E, k) * spec.expert_bytes("bf16") + T * k * 2 * D * b
    assert flops / 1e6 > nbytes / 1e5 and flops / 4e6 < nbytes / 1e5  # compute-bound at the peak, not above it
    for ef, rate in ((0.0, 1e6), (2.5e5, 2.5e5), (4e6, 1e6)):
        hw = toy_hw(gpu_expert_flops=ef)
        assert hrm.gpu_experts_time(spec, hw, T) == pytest.approx(max(flops / rate, nbytes / 1e5)), ef
    # the other GPU terms keep the peak
    assert hrm.gpu_qkv_time(spec, toy_hw(gpu_expert_flops=1.0), T) == hrm.gpu_qkv_time(spec, toy_hw(), T)
    with pytest.raises(Exception, match="gpu_expert_flops"):
        toy_hw(gpu_expert_flops=-1.0)


def test_prefill_elementwise_traffic_by_hand():
    """prefill_elementwise_rows adds T * rows * D * b / HBM to each prefill MoE layer's GPU stage for every prefill
    micro-batch (a dense layer and decode unchanged; 0, older profiles: nothing)."""
    spec = two_layer_spec(dense_layers=(0,), dense_intermediate_size=16)  # layer 0 dense, layer 1 MoE
    pol = Policy(mu=6, n=2, prefill_mu=5, resident_experts=0)  # N 12: prefill micro-batches 5, 5, 2
    s, rows, D, b = 7, 3.5, 8, 2
    base, meas = toy_hw(), toy_hw(prefill_elementwise_rows=rows)
    assert hrm.gpu_prefill_elementwise_time(spec, base, 100) == 0.0
    assert hrm.gpu_prefill_elementwise_time(spec, meas, 100) == pytest.approx(100 * rows * D * b / 1e5)
    for layer, extra in ((0, 0.0), (1, 12 * s * rows * D * b / 1e5)):
        a = hrm.prefill_layer_times(spec, base, pol, layer, 4, s)
        m = hrm.prefill_layer_times(spec, meas, pol, layer, 4, s)
        assert m.gpu - a.gpu == pytest.approx(extra, abs=1e-12), layer
        assert (m.h2d, m.d2h, m.cpu) == (a.h2d, a.d2h, a.cpu)
    d0, d1 = (hrm.decode_layer_times(spec, h, pol, 1, 4, s + 1) for h in (base, meas))
    assert d0 == d1
    with pytest.raises(Exception, match="prefill_elementwise_rows"):
        toy_hw(prefill_elementwise_rows=-1.0)


def test_expert_kernel_probe_argument_errors():
    torch = pytest.importorskip("torch")  # the probe runs a torch kernel (skipped in the torch-free 3.12 planner venv)

    from lightning_moe.pipeline.profiler import measure_expert_kernel_flops

    with pytest.raises(ValueError, match="top_k"):
        measure_expert_kernel_flops(tokens=4, hidden=8, intermediate=8, experts=2, top_k=3)
    with pytest.raises(ValueError):
        measure_expert_kernel_flops(tokens=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            measure_expert_kernel_flops(tokens=4, hidden=8, intermediate=8)


def test_sinks_attention_counts_its_materialized_scores():
    """gpt-oss's prefill attention (sinks: no fused kernel) materializes [rows, Hq, S, S] scores: the memory model's
    attention stage grows by (3 b + 12) bytes per score, and by its mask (1 + b bytes per (query, key) pair: full causal
    attention passes none)."""
    import dataclasses

    spec = two_layer_spec()
    sinks = dataclasses.replace(spec, attention_sinks=True)
    rows, S = 3, 40
    base = hrm._packed_attention_stage_bytes(spec, 100, rows * S, S, "bf16")
    assert hrm._packed_attention_stage_bytes(sinks, 100, rows * S, S, "bf16") - base == \
        rows * S * S * spec.num_heads * 18 + rows * S * S * 3


def test_mla_gpu_attention_prices_the_torch_paths_bytes():
    """An MLA GPU-attention micro-batch runs the torch latent_attention: the HRM's HBM term counts what it moves per
    position (the latents read and copied to fp32 for the scores, their kv_lora part again for the values, six passes
    over the fp32 scores), not only one read of the cache: ~4.8x the bf16 cache bytes at DeepSeek-V2-Lite's shape."""
    import dataclasses

    from lightning_moe.policy.hardware import get_preset
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("deepseek-v2-lite")
    hw = dataclasses.replace(get_preset("h100"), gpu_flops_bf16=1e30)  # memory-bound: time = bytes / HBM rate
    S, c = 64, 4096
    kv, Dl, Hq = spec.kv_elems_per_token, spec.kv_lora_rank, spec.num_heads
    per_pos = kv * 10 + Dl * 10 + 24 * Hq
    other = (spec.attn_query_elems + spec.attn_output_elems + kv) * 2
    want = S * (c * per_pos + other) / hw.gpu_hbm_bandwidth
    assert hrm.gpu_decode_attention_time(spec, hw, S, c, "bf16") == pytest.approx(want, rel=1e-9)
    assert per_pos > 4.5 * kv * 2
