"""The prefill phase's GPU memory: packed prompt hidden rows (Workload.prompt_tokens), the MILP's per-sequence
coefficient, and grow_prefill (a larger prefill micro-batch into the memory the decode policy leaves).

Run 21 (benchmarks/RESULTS-archive.md 8): the old model charged every sequence the longest prompt (N x 425 tokens x D x 2 B = 5.4 GiB
for 1664 MT-Bench rows) where the executor holds the packed prompts (1.1 GiB); the measured GPU peak was 18.4 GiB
against 23.9 GiB planned.
"""

import dataclasses
import os

import pytest

from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import get_preset, resolve_hardware
from lightning_moe.policy.policy import Budgets, Policy, Workload
from lightning_moe.policy.registry import resolve_spec

H200_PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_moe", "policy",
                            "profiles", "h200-host.yaml")

GiB = 1 << 30


def test_prompt_tokens_by_hand():
    w = Workload.from_lengths([40, 10, 30, 20], gen_len=4)
    assert w.prompt_tokens(1) == 40  # the longest
    assert w.prompt_tokens(3) == 40 + 30 + 20
    assert w.prompt_tokens(4) == 100
    assert w.prompt_tokens(9) == 225  # the distribution: 9 x its mean 25
    assert Workload(prompt_len=30, gen_len=4, max_prompt_len=50).prompt_tokens(3) == 150  # no lengths: N x max
    with pytest.raises(ValueError, match="N an int"):
        w.prompt_tokens(0)


def test_memory_estimate_counts_packed_prompts():
    spec = resolve_spec("mixtral-8x7b")
    w = Workload.from_lengths([425] + [60] * 79, gen_len=32)  # one long outlier
    pol = Policy(mu=64, n=2, prefill_mu=16, resident_experts=0, gpu_reserve=0, cpu_reserve=0)
    m = hrm.memory_estimate(pol, spec, w)
    mean = (425 + 60 * 79) / 80
    per_token = (spec.hidden_size + 2 * spec.head_dim) * 2 + hrm.PREFILL_INDEX_BYTES  # hidden row, RoPE tables, indexes
    assert hrm.prefill_token_bytes(spec, "bf16") == per_token == 8738  # (4096 + 2 x 128) x 2 B + 34
    # N = 128 > the job's 80 prompts: the largest batch holds the 80 (the runner never forms a larger one)
    assert m.gpu_prefill["prefill hidden states (N prompts)"] == (425 + 60 * 79) * per_token
    unbounded = dataclasses.replace(w, num_requests=None)  # a distribution (plan --prompt-len): N x its mean
    assert (hrm.memory_estimate(pol, spec, unbounded).gpu_prefill["prefill hidden states (N prompts)"]
            == (128 * (425 + 60 * 79) // 80) * per_token)
    pol40 = dataclasses.replace(pol, mu=20, n=2)  # 40 of the 80: the 40 longest
    assert hrm.memory_estimate(pol40, spec, w).gpu_prefill["prefill hidden states (N prompts)"] == (425 + 60 * 39) * per_token
    # the MILP's coefficient per sequence: the prompt part of its KV length, >= the exact mean of the N longest
    for kv_len in (w.kv_positions(1), w.kv_positions(128)):
        C = milp._coefficients(spec, get_preset("l4"), w, Budgets(gpu_memory=24 * GiB, cpu_memory=96 * GiB), [64], None, kv_len)
        assert C.mem_hidden_pre == pytest.approx((kv_len - 32) * per_token + spec.vocab_size * 4)  # + last-token logits
    for N in (1, 2, 40, 79, 80, 81, 128, 1000):  # the MILP's charge bounds hrm's, per sequence
        assert w.kv_positions(N) - 32 >= w.prompt_tokens(N) / N - 1e-9
    assert mean > 60


def _mtbench_like():
    return Workload.from_lengths([425, 300] + [70 + (i * 37) % 90 for i in range(78)], gen_len=32)


def test_plan_fits_exact_memory_and_uses_the_freed_memory():
    """The plan fits hrm's exact bytes, and charging packed prompts (not N x the longest) lets the same budget hold
    more: at least as many resident experts or sequences as under the old N x s_max charge."""
    spec, hw = resolve_spec("mixtral-8x7b"), get_preset("l4")
    w = _mtbench_like()
    b = Budgets(gpu_memory=24 * GiB, cpu_memory=160 * GiB)
    pol, est = milp.plan(spec, hw, w, b)
    assert not hrm.memory_violations(pol, spec, w) and est.gpu_peak <= b.gpu_memory
    m = hrm.memory_estimate(pol, spec, w)
    old = m.gpu_peak - m.gpu_prefill["prefill hidden states (N prompts)"] + pol.N * w.max_prompt * spec.hidden_size * 2
    assert m.gpu_prefill["prefill hidden states (N prompts)"] < pol.N * w.max_prompt * spec.hidden_size * 2
    assert old > b.gpu_memory or pol.N * w.max_prompt * spec.hidden_size * 2 < GiB  # the old charge would not fit


def test_grow_prefill_only_touches_the_prefill_micro_batch():
    spec, hw = resolve_spec("mixtral-8x7b"), get_preset("l4")
    w = Workload.from_lengths([80] * 64, gen_len=32)  # a small job
    base = Policy(mu=64, n=1, prefill_mu=milp.prefill_micro_batch(64, 80), resident_experts=1, gpu_budget=40 * GiB,
                  cpu_budget=160 * GiB)  # memory left over on the GPU
    assert base.prefill_mu == 32 and base.prefill_tokens == milp.PREFILL_TOKENS
    est0 = hrm.evaluate(base, spec, hw, w)
    grown, est = milp.grow_prefill(base, spec, hw, w)
    assert grown.prefill_tokens == max(milp.PREFILL_GROW_TOKENS) and grown.prefill_mu > base.prefill_mu
    assert grown.mu % grown.prefill_mu == 0 and grown.prefill_mu * 80 <= grown.prefill_tokens
    assert dataclasses.replace(grown, prefill_mu=base.prefill_mu, prefill_tokens=base.prefill_tokens) == base
    assert not hrm.memory_violations(grown, spec, w) and est.e2e_tok_s >= est0.e2e_tok_s
    assert grown.prefill_mu == 64
    # no room and no resident expert to trade: the policy comes back unchanged
    bare = dataclasses.replace(base, resident_experts=0)
    tight = dataclasses.replace(bare, gpu_budget=hrm.memory_estimate(bare, spec, w).gpu_peak)
    assert milp.grow_prefill(tight, spec, hw, w)[0] == tight


def test_grow_prefill_trades_resident_experts_only_when_faster():
    """With no memory left, a larger prefill micro-batch may take resident experts' memory: the result fits, has
    fewer residents (spread as the MILP spreads them) and is faster end to end by the HRM; where the HRM says the
    residents are worth more, the policy comes back unchanged."""
    # the committed H200 profile: its measured expert FFN rates grow with the tokens per call (the presets have none)
    spec, hw = resolve_spec("mixtral-8x7b"), resolve_hardware(H200_PROFILE)
    w = Workload.from_lengths([100] * 2000, gen_len=16)  # a long prefill, a short decode: prefill chunks matter
    base = Policy(mu=2000, n=1, prefill_mu=milp.prefill_micro_batch(2000, 100), resident_experts=1, n_gpu_attn=1,
                  gpu_budget=40 * GiB, cpu_budget=160 * GiB)
    tight = dataclasses.replace(base, gpu_budget=hrm.memory_estimate(base, spec, w).gpu_peak)
    est0 = hrm.evaluate(tight, spec, hw, w)
    grown, est = milp.grow_prefill(tight, spec, hw, w)
    assert grown != tight and grown.prefill_tokens > tight.prefill_tokens
    assert grown.total_resident(spec) < 32 and not hrm.memory_violations(grown, spec, w)
    counts = [c for i, c in enumerate(grown.resident_counts(spec)) if not spec.is_dense_layer(i)]
    assert max(counts) - min(counts) <= 1
    assert est.e2e_tok_s > est0.e2e_tok_s
    assert dataclasses.replace(grown, prefill_mu=tight.prefill_mu, prefill_tokens=tight.prefill_tokens,
                               resident_experts=tight.resident_experts) == tight
    # a long decode: each resident expert saves PCIe time on every step, so none is traded away
    w_long = Workload.from_lengths([100] * 2000, gen_len=512)
    tight_long = dataclasses.replace(base, gpu_budget=hrm.memory_estimate(base, spec, w_long).gpu_peak)
    got, est_long = milp.grow_prefill(tight_long, spec, hw, w_long)
    assert got == tight_long and est_long.e2e_tok_s == hrm.evaluate(tight_long, spec, hw, w_long).e2e_tok_s


def test_prefill_chunk_is_no_larger_than_the_batch():
    """The largest prefill chunk holds at most the batch's prompt tokens: one prompt of 200 tokens and nine of 5 bound
    the padded chunk at 10 x 200 = 2000 tokens, but the chunk packs only the batch's 245 tokens, and its FFN workspace
    is counted for 245."""
    spec = resolve_spec("mixtral-8x7b")
    w = Workload.from_lengths([200] + [5] * 9, gen_len=4)
    pol = Policy(mu=10, n=1, prefill_mu=10, prefill_tokens=16384, gpu_reserve=0, cpu_reserve=0)
    assert hrm.prefill_chunk_shape(pol, w) == (245, 2000, 200)
    m = hrm.memory_estimate(pol, spec, w)
    assert m.gpu_prefill["prefill chunk workspace"] == hrm.prefill_chunk_workspace(spec, 245, 2000, 200, "bf16")


def test_scoring_chunk_counts_the_packed_tokens_the_lengths_allow():
    """A scoring job of lengths [300, 200, 200, 100, 100, 100] in chunks of <= 4 rows and <= 600 padded tokens: the
    largest chunk packs 500 tokens (hrm.packed_chunk_tokens), not rows x longest = 600, and the scoring phase's
    transient term is the larger of that chunk's layer temporaries (one expert group: int4) and the scoring head."""
    spec = resolve_spec("mixtral-8x7b")
    w = Workload.from_lengths([100, 200, 300, 100, 200, 100], gen_len=1, scoring=True)
    pol = Policy(mu=6, n=1, prefill_mu=4, prefill_tokens=600, weight_quant="int4", gpu_reserve=0, cpu_reserve=0)
    assert hrm.prefill_chunk_shape(pol, w) == (500, 600, 300)
    m = hrm.memory_estimate(pol, spec, w)
    want = max(hrm.prefill_chunk_workspace(spec, 500, 600, 300, "bf16", cpu_kv=False, groups=1),
               hrm.score_head_bytes(spec, 500))
    assert m.gpu_phases["scoring"]["prefill chunk / scoring head"] == want


def test_long_row_attention_counts_the_mask_and_its_copy_by_hand():
    """One 32768-token row (Mixtral widths, bf16): packed attention holds q/k/v (T (4096 + 2 x 1024) x 2 B), then the
    gathered q, repeated k and v, the SDPA output and its packed copy (4 x T x 4096 x 2 B), the selected rows
    (T x 4096 x 2 B); with a sliding window also the boolean mask T^2 and SDPA's bf16 copy of it (2 T^2: full causal
    attention passes no mask); the chunk term is the larger of that and the FFN stage (about equal here)."""
    import dataclasses

    T = 32768
    for window, mask in ((None, 0), (4096, T * T * 3)):
        spec = dataclasses.replace(resolve_spec("mixtral-8x7b"), sliding_window=window)
        want = T * (4096 + 2 * 1024) * 2 + 4 * T * 4096 * 2 + T * 4096 * 2 + mask
        attn_only = want - T * (4096 + 2 * 1024) * 2
        ffn = hrm._ffn_stage_bytes(spec, T, "bf16", 1)
        got = hrm.prefill_chunk_workspace(spec, T, T, T, "bf16", cpu_kv=False, groups=1)
        assert got == want - attn_only + max(attn_only, ffn), window
        qkv = T * (4096 + 2 * 1024) * 2
        attn4 = 4 * (4 * T) * 4096 * 2 + T * 4096 * 2 + 4 * mask  # 4 rows padded to T: 4x the padded terms
        assert hrm.prefill_chunk_workspace(spec, T, 4 * T, T, "bf16", cpu_kv=False) == \
            qkv + max(attn4, hrm._ffn_stage_bytes(spec, T, "bf16", 2)), window


@pytest.mark.parametrize("n_seqs,mean,tokens,rows", [(256, 200, 32768, 128), (256, 200, 16384, 64), (1000, 300, 16384, 53),
                                                     (100, 300, 16384, 50), (7, 10, 4096, 7)])
def test_scoring_policy_rows_are_the_rows_the_executor_puts_in_a_chunk(n_seqs, mean, tokens, rows):
    """plan_scoring's policies give prefill_mu as the executor cuts a batch: 256 sequences of 200 tokens at 32768
    padded tokens fit 163 rows, but CGOPipe scores them in ceil(256 / 163) = 2 even micro-batches of 128
    (policy.batching.group_by_length), so the memory model counts 128 rows, not 163."""
    from lightning_moe.policy.batching import group_by_length

    spec = resolve_spec("mixtral-8x7b")
    w = Workload.from_lengths([mean] * n_seqs, gen_len=1, scoring=True)
    budgets = Budgets(gpu_memory=24 * GiB, cpu_memory=200 * GiB)
    pol = milp.scoring_policy(spec, w, budgets, n_seqs, 0, tokens)
    assert pol.prefill_mu == rows
    assert max(len(g) for g in group_by_length([mean] * n_seqs, pol.prefill_mu)) == rows
    assert hrm.prefill_chunk_shape(pol, w)[0] == rows * mean


def test_plan_scoring_takes_the_largest_batch_among_near_ties(monkeypatch):
    """Of the scoring policies whose estimates lie within SCORING_TIE of the best, plan_scoring takes the largest N
    (fewest page passes); outside the tie the faster estimate wins. The HRM is replaced by one whose prefill time
    makes small batches 1% (tie) or 5% (no tie) faster per token."""
    spec = resolve_spec("mixtral-8x7b")
    w = Workload.from_lengths([300] * 4000, gen_len=1, scoring=True)
    budgets = Budgets(gpu_memory=24 * GiB, cpu_memory=400 * GiB)
    real = hrm.evaluate

    def run(edge: float):
        def fake(pol, spec_, hw_, wl):
            est = real(pol, spec_, hw_, wl)
            faster = 1 + edge if pol.N < 1000 else 1.0  # tokens / s relative to the large batches
            return dataclasses.replace(est, prefill_time=pol.N * wl.prompt_len / (1e5 * faster))
        monkeypatch.setattr(hrm, "evaluate", fake)
        return milp.plan_scoring(spec, get_preset("l4"), w, budgets)[0]

    sizes = {milp.scoring_policy(spec, w, budgets, 1, 0, t).prefill_tokens for t in milp.SCORING_PREFILL_TOKENS}
    assert len(sizes) == 4
    tied, untied = run(0.01), run(0.05)
    assert tied.N >= 1000 and untied.N < 1000
