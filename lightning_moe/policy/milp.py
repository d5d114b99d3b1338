"""Policy search: a MILP over the HRM (modelled with PuLP, solved with HiGHS), solved exactly for end-to-end throughput.

Decisions (all MILP variables; MoE-Lightning Sec. 4 policy search, DESIGN.md "The MILP"):
  z_m   binary, one per micro-batch-size candidate m (sum z_m = 1): mu = sum m z_m
  w_m   integer, w_m = z_m n (z_m <= w_m <= nmax_m z_m): the number of micro-batches n = sum w_m
  v_m   integer, v_m = z_m g (v_m <= w_m): micro-batches with GPU attention + GPU KV, g = sum v_m
  r     integer experts resident in every MoE layer; beta_i binary digits of x: x MoE layers hold one more
        (R = L_moe r + x resident experts, spread evenly: jobplan._spread_resident. Without window classes the
        even spread is optimal for a given R (each layer's time max(H_l, C) is convex in its resident count; the
        page buffers follow the most-paged layer, which the even spread minimizes). With windowed and full layers
        an uneven spread can be faster (hrm.evaluate prefers it in some plans); the planner searches even spreads only)
The products mu * n and mu * g are linear through the disaggregated w_m, v_m (N = sum m w_m), no big-M on n.
Objective: max N G / (T_prefill + T_decode), a ratio: Dinkelbach iterations solve
max N G - lambda T exactly (HiGHS, zero gap; PuLP builds the model, _solve_highs hands it to highspy) and update lambda to the ratio of the solution until the
optimum of the parametric problem is 0 (Dinkelbach 1967, "On nonlinear fractional programming").

Per decode step t the layer time is max(H_l, C_t) with H_l the host->device time of layer l (it depends
on its resident count) and C_t = max(d2h, cpu, gpu) (the same for every MoE layer of a window class). With the even
spread there are two layer classes, so the sum over layers is (L - x) max(H_r, C_t) + x max(H_r - wio, C_t);
the product of x with the bounded gap between the two maxima is linearized through x's binary digits
(see _Model._layer_sum), exactly. Sliding-window layers whose window the decode contexts pass (gpt-oss) read less on
the CPU (hrm.cpu_attended): windowed and full MoE layers are then two window classes, each with its own C_t and its
own digits for its share of x (the extras go to the windowed layers first: jobplan._spread_resident), so the sum
has four terms, still exact (window_classes). Every HRM term that multiplies sequences (CPU/GPU attention, small
transfers) is linear in them, so it enters as a per-sequence constant times N_cpu or N_gpu.

After solving, the policy is re-evaluated with hrm.evaluate and every memory constraint re-checked with
hrm's integer byte counts (hrm.check_memory); the solver status is never trusted alone.

Quantized pages: every MoE layer dequantizes all its E experts (paged and resident) once per visit, in both
phases: wdq E sum_m z_m (= wdq E, the z_m sum to 1) on the GPU row of every MoE layer; the scratch adds E dense
expert bytes (a constant) to the GPU memory rows.

KV per sequence: with the job's prompt lengths the KV cache of a batch depends on its size N
(Workload.kv_positions, grouped caches), which is not linear in N; plan() solves with one KV length per
sequence and re-solves with the length of the batch it chose (a short fixed point, see plan).

Attention contexts: the executor gives the shortest micro-batches GPU attention, so CPU rows attend over longer
contexts than the mean (Workload.attention_context_offsets, which depends on mu, n, g and N). The model takes
the two offsets as constants; plan() starts at 0 and re-solves with the offsets of the previous round's optimum
(at most MAX_OFFSET_SOLVES rounds). Every candidate is compared by hrm.evaluate with its exact offsets, so the
answer is the best policy the rounds visited, exact on workloads without prompt lengths (offsets 0).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import highspy
import numpy as np
import pulp

from ..model.spec import MoESpec, dtype_bytes
from . import hrm
from .hardware import HardwareProfile
from .jobplan import _spread_resident, fit_job, prefill_micro_batch
from .policy import DEFAULT_PREFILL_TOKENS, Budgets, PlanInfeasible, Policy, Workload

log = logging.getLogger(__name__)

DEFAULT_MU_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_TOKENS = DEFAULT_PREFILL_TOKENS  # padded prompt tokens per prefill micro-batch (Policy.prefill_tokens)
MEMORY_MARGIN_REL = 2e-7  # fraction of each budget kept free inside the MILP (HiGHS's primal feasibility tolerance is 1e-7 on rows scaled by the budget)
SOLVE_TIME_LIMIT = 20.0  # seconds per HiGHS solve
TIE_SLACK = 1e-9  # relative throughput a tie-broken policy may give up (HRM ties only)
MAX_DINKELBACH = 30  # iterations (converges superlinearly; typically 3-6)
MAX_KV_SOLVES = 3  # passes of the KV-length fixed point (longest prompt, then the chosen batch's grouped mean)
MAX_OFFSET_SOLVES = 3  # rounds of the attention-context offsets fixed point (0, then the chosen policy's offsets)
PREFILL_GROW_TOKENS = (16384, 8192)  # larger prefill micro-batches grow_prefill tries after the MILP (padded tokens)

__all__ = ["plan", "plan_scoring", "default_solve_cache", "PlanInfeasible", "DEFAULT_MU_CANDIDATES", "prefill_micro_batch", "grow_prefill", "policy_from_decisions", "max_micro_batches"]


def grow_prefill(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload,
                 sizes: Sequence[int] = PREFILL_GROW_TOKENS) -> tuple[Policy, "hrm.Estimate"]:
    """The policy with a larger prefill micro-batch of ``sizes`` (padded tokens, rows by :func:`prefill_micro_batch`)
    when the HRM says it is faster end to end, paying for its workspace with resident experts if need be.

    The MILP plans with PREFILL_TOKENS; the decode phase often leaves GPU memory that the prefill workspace can use
    (the GPU peak is the larger of the two phases), and where it does not, fewer resident experts make room (a
    larger prefill chunk runs the expert GEMMs at a higher rate; a resident expert saves its pages' PCIe time every
    decode step). Per size: the most resident experts (spread as the MILP spreads them) with which the policy fits
    its own budgets. Of these, the fastest end to end (ties: the larger size) when it is no slower than the policy
    with its own residents, or faster with fewer. Only ``prefill_mu``, ``prefill_tokens`` and the resident
    experts change. Returns (policy, hrm.evaluate of it).
    """
    best, est = policy, hrm.evaluate(policy, spec, hw, workload)
    base_e2e, R = est.e2e_tok_s, policy.total_resident(spec)

    def at(tok: int, r: int) -> Policy:
        res = policy.resident_experts if r == R else _spread_resident(spec, r)
        return replace(policy, resident_experts=res, prefill_tokens=tok,
                       prefill_mu=prefill_micro_batch(policy.mu, workload.prompt_len, tok))

    for tok in sorted(sizes, reverse=True):
        if tok <= policy.prefill_tokens or at(tok, R).prefill_mu <= policy.prefill_mu:
            continue
        if not hrm.memory_violations(at(tok, R), spec, workload):
            r = R
        elif hrm.memory_violations(at(tok, 0), spec, workload):
            continue
        else:  # the most residents that fit (memory grows with r): binary search over [0, R)
            lo, hi = 0, R - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if not hrm.memory_violations(at(tok, mid), spec, workload) else (lo, mid - 1)
            r = lo
        cand = at(tok, r)
        e = hrm.evaluate(cand, spec, hw, workload)
        ok = e.e2e_tok_s >= base_e2e if r == R else e.e2e_tok_s > base_e2e
        if ok and (best is policy or e.e2e_tok_s > est.e2e_tok_s):
            best, est = cand, e
    return best, est


def prefill_chunk_tokens(prefill_mu: int, max_prompt_len: int, prefill_tokens: int = PREFILL_TOKENS) -> int:
    """Largest padded token count of one prefill micro-batch: min(prefill_mu * s_max, max(prefill_tokens, s_max))."""
    return min(prefill_mu * max_prompt_len, max(prefill_tokens, max_prompt_len))


def policy_from_decisions(spec: MoESpec, workload: Workload, budgets: Budgets, mu: int, n: int, resident_total: int, n_gpu_attn: int) -> Policy:
    """The Policy of one point of the decision space: R resident experts spread evenly (jobplan._spread_resident: the
    extra ones to windowed MoE layers first, then in layer order;
    dense layers none)."""
    counts = _spread_resident(spec, resident_total)
    return Policy(mu=mu, n=n, prefill_mu=prefill_micro_batch(mu, workload.prompt_len), resident_experts=counts,
                  n_gpu_attn=n_gpu_attn, weight_quant=budgets.weight_quant, dtype=budgets.dtype,
                  gpu_budget=budgets.gpu_memory, cpu_budget=budgets.cpu_memory,
                  gpu_reserve=budgets.gpu_reserve, cpu_reserve=budgets.cpu_reserve, gpus=budgets.gpus)


def max_micro_batches(spec: MoESpec, workload: Workload, budgets: Budgets, mu: int, kv_len: Optional[float] = None) -> int:
    """Upper bound on n for micro-batch size ``mu`` (the big-M of the linearization), >= 1.

    n mu sequences need their KV somewhere: n <= (gpu + cpu budget) / (mu kv_seq); and their prefill hidden
    rows on the GPU: n <= gpu budget / (mu (kv_len - gen_len) D b); and N <= num_requests when the job is known.
    ``kv_len``: KV positions per sequence the MILP uses (default ``workload.kv_positions(1)``, the longest
    prompt + gen_len); its prompt part also sizes the prefill hidden rows (as in :func:`_coefficients`).
    """
    b = dtype_bytes(budgets.dtype)
    kv_len = workload.kv_positions(1) if kv_len is None else kv_len
    kv_seq = kv_len * spec.num_layers * spec.kv_elems_per_token * b
    hid_seq = max(1.0, kv_len - workload.gen_len) * hrm.prefill_token_bytes(spec, budgets.dtype)
    n = min((budgets.gpu_memory + budgets.cpu_memory) // (mu * kv_seq), budgets.gpu_memory // (mu * hid_seq))
    if workload.num_requests is not None:
        n = min(n, -(-workload.num_requests // mu))
    return max(1, int(n))


# ---- feasibility diagnosis (one clear line) --------------------------------------------------------
def _cap(budget: int) -> int:
    """Bytes the MILP may fill of ``budget``: budget minus a tolerance margin (hrm re-checks exactly)."""
    return budget - int(budget * MEMORY_MARGIN_REL) - 1


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _least_host(spec: MoESpec, workload: Workload, budgets: Budgets, pol, fitting: list) -> "hrm.MemoryEstimate":
    """Of the n = 1 policies ``pol(R, g)`` that fit the GPU, the least host peak found: ``fitting`` (exact estimates
    that fit, at least one) and, per g, the most experts the GPU can hold by a linear count (R even over layers:
    each GPU grows by We / gpus per expert and shrinks by 2 We / gpus each time every layer gains one, as both page
    buffers shrink), walked down by exact estimates to the first R that fits (the count is approximate where several
    GPUs share a layer's experts)."""
    L_moe, E, gpus, cap = spec.num_moe_layers, spec.num_experts, budgets.gpus, _cap(budgets.gpu_memory)
    We = spec.expert_bytes(budgets.weight_quant) / gpus
    best = min(fitting, key=lambda m: m.cpu_peak)
    for g in (0, 1):
        base = hrm.memory_estimate(pol(0, g), spec, workload)
        R = max((R for R in range(L_moe * E + 1) if base.gpu_peak + R * We - (R // L_moe) * 2 * We <= cap), default=-1)
        for R in range(R, max(-1, R - 2 * L_moe - 1), -1):
            m = hrm.memory_estimate(pol(R, g), spec, workload)
            if m.gpu_peak <= cap:
                best = min(best, m, key=lambda e: e.cpu_peak)
                break
    return best


def diagnose(spec: MoESpec, workload: Workload, budgets: Budgets, mu: int) -> None:
    """Raise PlanInfeasible naming what does not fit, for the smallest policy (mu, n = 1), if even that fails.

    GPU first (non-expert weights + page buffers + activations + reserve, with the best residency), then
    host memory (the experts that cannot stay on the GPU, pinned, + KV + staging + reserve).
    """
    L_moe, E = spec.num_moe_layers, spec.num_experts

    def pol(R: int, g: int) -> Policy:
        return policy_from_decisions(spec, workload, budgets, mu, 1, R, g)

    # GPU: the smallest GPU footprint is no residency (or full residency when L_moe == 1), KV on the CPU (or on the
    # GPU, whose prefill then stages no k/v for a CPU cache: smaller when the KV is)
    gpu_opts = [hrm.memory_estimate(pol(R, g), spec, workload) for R in (0, L_moe * E) for g in (0, 1)]
    best = min(gpu_opts, key=lambda m: m.gpu_peak)
    if best.gpu_peak > _cap(budgets.gpu_memory):
        bd = best.gpu_breakdown
        w = bd["non-expert weights"]
        scratch = bd.get("dequantized expert scratch", 0)
        buf = bd["expert page buffers (2)"] + bd["resident experts"] + scratch
        act = sum(v for k, v in bd.items() if k not in ("non-expert weights", "expert page buffers (2)", "resident experts",
                                                        "dequantized expert scratch", "allocator reserve", "GPU KV cache"))
        what = "2 expert page buffers" if bd["expert page buffers (2)"] else "all experts"
        if scratch:
            what += " + dequantization scratch"
        raise PlanInfeasible(
            f"infeasible: GPU memory {_gib(budgets.gpu_memory)} < {_gib(best.gpu_peak)} needed for non-expert weights ({_gib(w)}) "
            f"+ {what} ({_gib(buf)}) + activations for {mu} sequence(s) ({_gib(act)}) + reserve ({_gib(bd['allocator reserve'])})")
    best_cpu = _least_host(spec, workload, budgets, pol, [m for m in gpu_opts if m.gpu_peak <= _cap(budgets.gpu_memory)])
    if best_cpu.cpu_peak > _cap(budgets.cpu_memory) and best_cpu.cpu_peak_phase == "load":
        c = best_cpu.cpu_load
        layer = c["one layer's experts (host, as read)"]
        raise PlanInfeasible(
            f"infeasible: host memory {_gib(budgets.cpu_memory)} < {_gib(best_cpu.cpu_peak)} needed to read the checkpoint: "
            f"the page pool of the experts that do not fit on the GPU ({_gib(c['page pool (filled layer by layer)'])}) + "
            f"one layer's experts as read ({_gib(layer)}) + reserve ({_gib(c['host reserve'])})")
    if best_cpu.cpu_peak > _cap(budgets.cpu_memory):
        c = best_cpu.cpu
        rest = c["CPU KV cache"] + c["pinned staging"]
        raise PlanInfeasible(
            f"infeasible: host memory {_gib(budgets.cpu_memory)} < {_gib(best_cpu.cpu_peak)} needed for the experts that do not fit "
            f"on the GPU ({_gib(c['pinned experts (not resident)'])}, pinned) + KV cache and staging for {mu} sequence(s) ({_gib(rest)}) "
            f"+ reserve ({_gib(c['host reserve'])})")


# ---- the MILP ----------------------------------------------------------------------------------------
@dataclass
class _Coeffs:
    """Constants of the MILP, computed with hrm's own functions (so the MILP is the HRM).

    Per-sequence constants rely on the HRM being linear in the number of sequences for CPU attention,
    GPU attention and the small transfers (checked in _coefficients); GPU layer kernels are not (weights
    are read once per micro-batch, active experts grow with mu), so they are per candidate m.
    """

    cands: list  # micro-batch sizes m
    pmu: dict  # m -> prefill micro-batch
    nmax: dict  # m -> upper bound on n
    mb_moe: dict  # m -> GPU seconds of one MoE layer for one micro-batch, attention excluded
    mb_dense: dict  # m -> same for a dense layer
    head: dict  # m -> decode head seconds of one micro-batch
    pre_moe: dict  # m -> prefill GPU seconds per MoE layer per decode micro-batch (m / pmu prefill micro-batches)
    pre_dense: dict  # m -> same for a dense layer
    pre_moe_w: dict  # m -> pre_moe of a sliding-window layer (its prefill attention over the window: hrm.prefill_attended)
    pre_dense_w: dict  # m -> same for a dense sliding-window layer
    pre_head: dict  # m -> prefill head seconds per decode micro-batch
    attn_g: dict  # c -> GPU decode attention seconds per sequence at context c
    cpu_rate: float  # CPU decode attention seconds per sequence per attended position
    kv_rate: float  # (H5') seconds of CPU attention KV bytes alone per sequence per attended position (x gpus)
    dram: Optional[tuple]  # (H5') (a, b) of hrm.dram_sharing; None: the profile measured no sharing (no rows)
    cpu_call: float  # CPU decode attention fixed seconds per call (hrm.cpu_attention_calls(m) calls per CPU micro-batch per layer)
    host_c: float  # host-thread seconds per CPU-attention micro-batch per decode layer (hrm.host_issue_times: the job's
    #   host probe; 0: none)
    host_g: float  # the same per GPU-attention micro-batch
    calls: dict  # m -> CPU attention calls per CPU micro-batch of m rows and layer (one per KV length group)
    d2h_seq: float  # decode d2h seconds per layer per CPU-attention sequence
    h2d_seq: float  # decode h2d seconds per layer per CPU-attention sequence (attention output)
    pre_d2h_seq: float  # prefill d2h seconds per layer per CPU-KV sequence
    wio: float  # seconds to page one expert
    wdq: float  # GPU seconds to dequantize one expert (hrm.gpu_dequant_time; 0 for unquantized pages)
    contexts: list  # decode contexts c_t = prompt_len + t, t = 1..G-1
    cpu_off: float  # positions added to c_t for CPU-attention rows (Workload.attention_context_offsets)
    # memory in bytes per unit of the variable that multiplies it (rows are divided by their budget)
    mem_fixed_gpu: float  # non-expert weights + reserve
    mem_expert: float  # one expert
    mem_load_host: float  # host bytes of the weight load besides the pool: one layer's experts as read
    mem_scratch: float  # dense scratch of one layer's E experts (hrm.dequant_scratch_bytes; 0 unquantized)
    mem_kv_seq: float  # one sequence's KV (kv_len positions, all layers)
    mem_hidden_dec: float  # one sequence's decode row (hidden, RoPE, position, fp32 logits)
    mem_attn_gpu_seq: float  # one GPU-attention sequence's decode attention scores (bounds its micro-batch's workspace)
    mem_hidden_pre: float  # one sequence's prefill hidden rows + its last-token logits
    mem_ws_dec: dict  # m -> decode workspaces
    mem_ws_pre: dict  # m -> prefill workspace
    mem_ws_pre_cpu: dict  # m -> its k/v on their way to CPU caches (only with CPU attention: times q_m)
    mem_stage_seq: float  # pinned staging per CPU-attention sequence
    mem_stage_pre: dict  # m -> pinned prefill KV staging
    gpu_cap: float  # GPU bytes the MILP may fill (budget minus margin)
    cpu_cap: float  # host bytes the MILP may fill (budget minus margin, minus the reserve of every process)
    gpus: int = 1  # expert-parallel GPUs (hrm H10): per-GPU paging and memory rows, the CPU stage and host KV x gpus


def _coefficients(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets, cands: Sequence[int],
                  n_cap: Optional[int], kv_len: float, offsets: tuple[float, float] = (0.0, 0.0)) -> _Coeffs:
    """MILP coefficients; ``kv_len`` is the KV positions per sequence (every sequence, CPU or GPU KV); its prompt
    part ``kv_len - gen_len`` (>= the mean of the batch's prompts, Workload.kv_positions) also sizes each sequence's
    packed prefill hidden rows, which hrm.memory_estimate counts exactly (Workload.prompt_tokens);
    ``offsets`` (cpu, gpu) shift the decode context of the CPU / GPU attention rows (constants per solve: plan()
    iterates them to a fixed point, since the true offsets depend on the policy)."""
    dt, q, g = budgets.dtype, budgets.weight_quant, budgets.gpus
    b = dtype_bytes(dt)
    s, s_max, G = workload.prompt_len, workload.max_prompt, workload.gen_len
    contexts = [s + t for t in range(1, G)]
    kv_seq = kv_len * hrm.kv_bytes_per_position(spec, dt)
    host = hrm.host_issue_times(hw, spec, q)  # (h_c, h_g) of the job's host probe (its family and expert format)
    C = _Coeffs(cands=list(cands), calls={m: hrm.cpu_attention_calls(m) for m in cands}, pmu={}, nmax={}, mb_moe={}, mb_dense={}, head={}, pre_moe={}, pre_dense={}, pre_moe_w={}, pre_dense_w={}, pre_head={},
                attn_g={c: hrm.gpu_decode_attention_time(spec, hw, 1, c + offsets[1], dt) for c in contexts},
                cpu_off=offsets[0],
                cpu_rate=hrm.cpu_decode_attention_time(spec, hw, 1, 1, dt) * g, cpu_call=hw.cpu_attention_overhead * g,
                kv_rate=hrm.cpu_attention_kv_time(spec, hw, 1, 1, dt) * g, dram=hrm.dram_sharing(hw),
                host_c=host[0], host_g=host[1],
                d2h_seq=hrm.decode_d2h_time(spec, hw, 1, dt), h2d_seq=hrm.decode_h2d_act_time(spec, hw, 1, dt),
                pre_d2h_seq=hrm.prefill_d2h_time(spec, hw, 1, s, dt), wio=hrm.expert_h2d_time(spec, hw, 1, q), contexts=contexts,
                wdq=hrm.gpu_dequant_time(spec, hw, 1, q, dt),
                mem_fixed_gpu=spec.non_expert_bytes(dt) + budgets.gpu_reserve, mem_expert=spec.expert_bytes(q),
                mem_load_host=spec.num_experts * spec.expert_bytes(q) * g,
                mem_scratch=hrm.dequant_scratch_bytes(spec, q, dt, g),
                mem_kv_seq=kv_seq, mem_hidden_dec=hrm.decode_row_bytes(spec, dt),
                mem_attn_gpu_seq=(1 + hrm.FRAGMENTATION) * hrm.gpu_decode_attention_workspace(spec, 1, s_max + G, dt),
                mem_hidden_pre=max(1.0, kv_len - G) * hrm.prefill_token_bytes(spec, dt) + hrm.prefill_logit_bytes(spec, dt),
                mem_ws_dec={}, mem_ws_pre={}, mem_ws_pre_cpu={},
                mem_stage_seq=2 * (spec.attn_query_elems + spec.kv_elems_per_token + spec.attn_output_elems) * b * g,
                mem_stage_pre={}, gpu_cap=_cap(budgets.gpu_memory), cpu_cap=_cap(budgets.cpu_memory) - budgets.cpu_reserve * g,
                gpus=g)
    for m in cands:
        p = prefill_micro_batch(m, s)
        C.pmu[m] = p
        tp = prefill_chunk_tokens(p, s_max)  # padded tokens of the largest prefill micro-batch
        nmax = max_micro_batches(spec, workload, budgets, m, kv_len)
        C.nmax[m] = nmax if n_cap is None else min(n_cap, nmax)
        C.mb_moe[m] = hrm.gpu_layer_time(spec, hw, m, False, dt, q, g)
        C.mb_dense[m] = hrm.gpu_layer_time(spec, hw, m, True, dt, q, g)
        C.head[m] = hrm.gpu_head_time(spec, hw, m, m, dt)
        chunks = hrm.prefill_micro_batches(m, p)  # prefill micro-batches per decode micro-batch: (count, rows)
        for dense, full, windowed in ((False, C.pre_moe, C.pre_moe_w), (True, C.pre_dense, C.pre_dense_w)):
            layer = sum(k * hrm.gpu_layer_time(spec, hw, r * s, dense, dt, q, g, prefill=True) for k, r in chunks)
            full[m], windowed[m] = (layer + sum(k * hrm.gpu_prefill_attention_time(spec, hw, r, s, dt, w) for k, r in chunks)
                                    for w in (None, spec.sliding_window))
        C.pre_head[m] = sum(k * hrm.gpu_head_time(spec, hw, r, r * s, dt) for k, r in chunks)
        slack = 1 + hrm.FRAGMENTATION  # transient workspaces are budgeted with their fragmentation allowance
        C.mem_ws_dec[m] = slack * 2 * hrm.micro_batch_workspace(spec, m, m, dt, hrm.expert_groups(q), workload.sampling)
        # the exact model takes max(chunk temporaries, head); the MILP charges their sum (linear, never smaller)
        C.mem_ws_pre_cpu[m] = slack * 2 * tp * spec.kv_elems_per_token * b
        C.mem_ws_pre[m] = (slack * hrm.prefill_chunk_workspace(spec, tp, tp, min(s_max, tp), dt, cpu_kv=False,
                                                          groups=hrm.expert_groups(q))
                           + p * (spec.hidden_size + spec.vocab_size) * b)
        C.mem_stage_pre[m] = 2 * tp * spec.kv_elems_per_token * b * g
        # the per-sequence constants above are exact only if these HRM terms are linear in sequences (and CPU attention in context)
        c = contexts[-1] if contexts else s + 1
        for got, want in ((hrm.cpu_decode_attention_time(spec, hw, m, c, dt) * g, m * c * C.cpu_rate),
                          (hrm.cpu_attention_kv_time(spec, hw, m, c, dt) * g, m * c * C.kv_rate),
                          (hrm.gpu_decode_attention_time(spec, hw, m, c, dt), m * hrm.gpu_decode_attention_time(spec, hw, 1, c, dt)),
                          (hrm.decode_d2h_time(spec, hw, m, dt), m * C.d2h_seq), (hrm.prefill_d2h_time(spec, hw, m, s, dt), m * C.pre_d2h_seq),
                          (hrm.gpu_dequant_time(spec, hw, m, q, dt), m * C.wdq)):
            assert abs(got - want) <= 1e-9 * abs(want) + 1e-300, "HRM term not linear in sequences; the MILP would not be exact"
    return C


def window_binds(spec: MoESpec, contexts: Sequence[float], cpu_off: float, prompt_len: float = 0.0) -> bool:
    """Whether a sliding window shortens some CPU row's attention (hrm.cpu_attended) at the decode contexts
    ``contexts`` shifted by ``cpu_off``, or the prefill attention of a ``prompt_len``-token prompt
    (hrm.prefill_attended; a job of one new token has no decode step): only then do windowed and full layers cost
    differently."""
    W = spec.sliding_window
    return W is not None and (prompt_len > W or any(c + cpu_off > W for c in contexts))


def window_classes(spec: MoESpec, layers: Sequence[int], binds: bool) -> list:
    """[(window, count)] of ``layers``: [(window, n)] for windowed layers first, [(None, n)] for the others; one
    class (window None) where ``binds`` is False or the layers do not mix; [] for no layers."""
    if not layers:
        return []
    windowed = sum(1 for i in layers if spec.layer_sliding_window(i) is not None)
    if not binds or windowed == 0:
        return [(None, len(layers))]
    if windowed == len(layers):
        return [(spec.sliding_window, windowed)]
    return [(spec.sliding_window, windowed), (None, len(layers) - windowed)]


def _tag(k: int) -> str:
    """Row-name suffix of window class ``k``: "" for the first, "f" (full attention) for the second."""
    return "f" if k else ""


def _bits(limit: int) -> int:
    """Binary digits needed for integers 0..limit."""
    return max(0, int(limit).bit_length())


class _Model:
    """The MILP of one planning problem; the objective is re-set for each Dinkelbach lambda.

    Rows per decode step are few and sparse: the step's C_t = max(gpu, cpu, d2h) (3 rows), the two layer
    classes' max(H, C_t) (4 rows), and the exact count of layers per class via the binary digits of x
    (2 rows per digit), so the model stays small for long generations and many layers.
    """

    def __init__(self, spec: MoESpec, workload: Workload, C: _Coeffs, min_kv_count: int = 0,
                 cache: Optional[str] = None):
        """``min_kv_count`` > 0: only policies whose KV sizing count (N_cpu, or N without CPU attention) is at
        least that many sequences (the KV fixed point's safety rows, see :func:`plan`). ``cache``: the solve cache
        its solves read and fill (:func:`_solve_highs`; None: none)."""
        self.spec, self.workload, self.C, self.cache = spec, workload, C, cache
        self.cache_hits = 0  # solves the cache answered
        self.min_kv_count = min_kv_count
        self.L_moe, self.L_d, self.E = spec.num_moe_layers, spec.num_dense_layers, spec.num_experts
        # (window or None, layers) of the MoE / dense layers: two classes where a sliding window covers some layers
        # and binds at some decode context (hrm.cpu_attended), windowed first (jobplan._spread_resident's order)
        binds = window_binds(spec, C.contexts, C.cpu_off, workload.prompt_len)
        self.moe_cls = window_classes(spec, spec.moe_layers, binds)
        self.dense_cls = window_classes(spec, [i for i in range(spec.num_layers) if spec.is_dense_layer(i)], binds)
        self.prob = pulp.LpProblem("moe_lightning_policy", pulp.LpMaximize)
        self._variables()
        self._mu_choice()
        self._products()
        self._attention_split()
        self._residency()
        self._aggregates()
        self._request_cap()
        self._kv_count()
        self._gpu_memory_decode()
        self._gpu_memory_prefill()
        self._cpu_memory()
        self._dequant()
        self._prefill_time()
        self.T_decode = pulp.LpAffineExpression()
        for t, c in enumerate(C.contexts):
            self._decode_step(t, c)

    # -- variables --
    def _var(self, name: str, lowBound=None, upBound=None, cat: str = "Continuous") -> pulp.LpVariable:
        """A variable attached to the problem (prob.add_variable on PuLP >= 3.3)."""
        if hasattr(self.prob, "add_variable"):
            return self.prob.add_variable(name, lowBound, upBound, cat)
        return pulp.LpVariable(name, lowBound, upBound, cat=cat)  # pragma: no cover (older PuLP)

    def _variables(self) -> None:
        C, P = self.C, self._var
        self.z = {m: P(f"z_{m}", cat="Binary") for m in C.cands}  # z_m = 1 iff mu = m
        # disaggregated products (no big-M on n): w_m = z_m n, v_m = z_m g, integer
        self.w = {m: P(f"w_{m}", lowBound=0, upBound=C.nmax[m], cat="Integer") for m in C.cands}
        self.v = {m: P(f"v_{m}", lowBound=0, upBound=C.nmax[m], cat="Integer") for m in C.cands}
        self.r = P("r", lowBound=0, upBound=self.E, cat="Integer")  # experts resident in every MoE layer
        if len(self.moe_cls) == 1:  # binary digits of x
            self.digits = [[P(f"beta_{i}", cat="Binary") for i in range(_bits(self.L_moe - 1))]]
        else:  # x = x_w + x_f, the extras of the windowed and of the full layers, each by its own digits
            (_, L_w), (_, L_f) = self.moe_cls
            self.digits = [[P(f"beta_w_{i}", cat="Binary") for i in range(_bits(L_w))],
                           [P(f"beta_f_{i}", cat="Binary") for i in range(_bits(L_f - 1))]]
        self.some_extra = P("x_pos", cat="Binary")  # 1 if x > 0
        self.y_cpu = P("y_cpu", cat="Binary")  # 1 if any micro-batch attends on the CPU (n - g >= 1)
        # q_m = z_m AND y_cpu (continuous; pushed to its lower bound max(0, z_m + y_cpu - 1) by the objective)
        self.q = {m: P(f"q_{m}", lowBound=0, upBound=1) for m in C.cands}
        # aggregates (continuous, fixed by equality rows in _aggregates)
        self.N_cpu = P("N_cpu", lowBound=0)  # sequences with CPU KV and CPU attention
        self.N_gpu = P("N_gpu", lowBound=0)  # sequences with GPU KV and GPU attention
        self.A = P("A", lowBound=0)  # per-layer h2d seconds of attention outputs
        self.D2H = P("D2H", lowBound=0)  # per-layer d2h seconds of q/k/v
        self.K = P("K", lowBound=0)  # CPU attention seconds per attended position per layer
        self.GPU = P("GPU", lowBound=0)  # per MoE layer GPU seconds of all micro-batches, attention excluded
        self.GPU_d = P("GPU_dense", lowBound=0)  # same for a dense layer
        self.HEAD = P("HEAD", lowBound=0)  # per decode step head seconds
        # derived linear expressions
        self.n = pulp.lpSum(self.w.values())  # micro-batches (only the chosen size's w_m is non-zero)
        self.n_cpu = pulp.lpSum(self.w[m] - self.v[m] for m in C.cands)  # CPU-attention micro-batches (n - g)
        self.cpu_calls = pulp.lpSum(C.calls[m] * (self.w[m] - self.v[m]) for m in C.cands)  # CPU attention calls per layer
        self.N = pulp.lpSum(m * self.w[m] for m in C.cands)  # N = mu * n
        self.x_cls = [pulp.lpSum((1 << i) * bt for i, bt in enumerate(d)) for d in self.digits]  # extras per class
        self.x = pulp.lpSum(self.x_cls)  # MoE layers holding r + 1 experts
        self.R = self.L_moe * self.r + self.x  # resident experts in total
        g = C.gpus
        if g == 1:  # one GPU: it pages E - r experts of an r-layer (E - r - 1 of an (r + 1)-layer) and holds all R
            self.paged, self.paged_extra, self.R_gpu = self.E - self.r, self.E - self.r - 1, self.R
        else:  # (H10) the busiest GPU: integers >= (E - r) / g, (E - r - 1) / g, r / g (pushed down to the ceilings)
            self.paged = P("paged", lowBound=0, upBound=self.E, cat="Integer")
            self.paged_extra = P("paged_extra", lowBound=0, upBound=self.E, cat="Integer")
            self.r_gpu = P("r_gpu", lowBound=0, upBound=self.E, cat="Integer")
            self.R_gpu = self.L_moe * self.r_gpu + self.x  # resident on one GPU (an upper bound: hrm re-checks exactly)

    # -- constraint groups --
    def _mu_choice(self) -> None:
        # sum_m z_m = 1: exactly one micro-batch size
        self.prob += pulp.lpSum(self.z.values()) == 1, "one_mu"

    def _products(self) -> None:
        for m in self.C.cands:
            z = self.z[m]
            # z_m <= w_m <= nmax_m z_m: n = w_m >= 1 micro-batch of the chosen size, 0 for the others
            self.prob += self.w[m] >= z, f"w_ge_z_{m}"
            self.prob += self.w[m] <= self.C.nmax[m] * z, f"w_le_z_{m}"

    def _attention_split(self) -> None:
        for m in self.C.cands:
            # v_m <= w_m: GPU-attention micro-batches are a subset of the micro-batches (g <= n)
            self.prob += self.v[m] <= self.w[m], f"v_le_w_{m}"
            # q_m = z_m AND y_cpu: the round-trip row of the chosen size applies when some attention is on the CPU.
            # q_m >= z_m + y_cpu - 1 alone is exact at integer points, but with q only in that row the LP relaxation
            # leaves q free above it and HiGHS could not close the gap (a 4,000-prompt Mixtral plan: 20 s time limits
            # per solve instead of 3 s in all); q_m <= z_m, q_m <= y_cpu make it the AND in the relaxation too
            self.prob += self.q[m] >= self.z[m] + self.y_cpu - 1, f"q_and_{m}"
            self.prob += self.q[m] <= self.z[m], f"q_le_z_{m}"
            self.prob += self.q[m] <= self.y_cpu, f"q_le_y_{m}"
        # n - g <= nmax y_cpu: a CPU-attention micro-batch forces y_cpu = 1;  y_cpu <= n - g
        self.prob += self.n_cpu <= max(self.C.nmax.values()) * self.y_cpu, "y_cpu_def"
        self.prob += self.y_cpu <= self.n_cpu, "y_cpu_le"

    def _residency(self) -> None:
        if self.C.gpus > 1:
            g = self.C.gpus
            # g paged >= E - r, g paged_extra >= E - r - 1, g r_gpu >= r: one GPU's share of a layer (expert e on GPU e % g)
            self.prob += g * self.paged >= self.E - self.r, "paged_per_gpu"
            self.prob += g * self.paged_extra >= self.E - self.r - 1, "paged_extra_per_gpu"
            self.prob += g * self.r_gpu >= self.r, "resident_per_gpu"
        # x <= L_moe - 1: at most L_moe - 1 layers hold the extra expert (all L_moe would be r + 1 everywhere)
        self.prob += self.x <= self.L_moe - 1, "x_le_L"
        # x <= (L_moe - 1) x_pos and r + x_pos <= E: a layer can hold r + 1 only if r + 1 <= E
        self.prob += self.x <= (self.L_moe - 1) * self.some_extra, "x_pos_def"
        self.prob += self.r + self.some_extra <= self.E, "r_plus_one_le_E"
        if len(self.moe_cls) == 2:  # extras fill the windowed layers first: x_f > 0 only when x_w = L_w
            (_, L_w), (_, L_f) = self.moe_cls
            full = self._var("x_full", cat="Binary")  # 1 if a full-attention layer holds an extra expert
            self.prob += self.x_cls[0] <= L_w, "x_w_le_L_w"
            self.prob += self.x_cls[0] >= L_w * full, "x_w_full_first"
            self.prob += self.x_cls[1] <= (L_f - 1) * full, "x_f_def"

    def _aggregates(self) -> None:
        C, cands = self.C, self.C.cands
        # N_cpu = sum_m m (w_m - v_m);  N_gpu = sum_m m v_m
        self.prob += self.N_cpu == pulp.lpSum(m * (self.w[m] - self.v[m]) for m in cands), "def_N_cpu"
        self.prob += self.N_gpu == pulp.lpSum(m * self.v[m] for m in cands), "def_N_gpu"
        # (H3) A = N_cpu out b / B_h2d;  (H4) D2H = N_cpu (q + kv) b / B_d2h;  (H5) K = N_cpu max(F/P_c, kv b/B_c)
        self.prob += self.A == C.h2d_seq * self.N_cpu, "def_A"
        self.prob += self.D2H == C.d2h_seq * self.N_cpu, "def_D2H"
        self.prob += self.K == C.cpu_rate * self.N_cpu, "def_K"
        # (H6) GPU = sum_m w_m gpu_layer(m) (n micro-batches of the chosen size), same for dense layers
        self.prob += self.GPU == pulp.lpSum(C.mb_moe[m] * self.w[m] for m in cands), "def_GPU"
        if self.L_d:
            self.prob += self.GPU_d == pulp.lpSum(C.mb_dense[m] * self.w[m] for m in cands), "def_GPU_dense"
        # (H7) HEAD = sum_m w_m head(m)
        self.prob += self.HEAD == pulp.lpSum(C.head[m] * self.w[m] for m in cands), "def_HEAD"

    def _request_cap(self) -> None:
        if self.workload.num_requests is not None:
            # N = sum m w_m <= num_requests: no more sequences in flight than the job has
            self.prob += self.N <= self.workload.num_requests, "N_le_requests"

    def _kv_count(self) -> None:
        K = self.min_kv_count
        if K > 0:
            # N >= K and N_cpu >= K y_cpu: every sequence's KV length is at most workload.kv_positions(K), the
            # per-sequence length this model was built with (kv_positions is non-increasing in N)
            self.prob += self.N >= K, "kv_count_N"
            self.prob += self.N_cpu >= K * self.y_cpu, "kv_count_N_cpu"

    def _gpu_common(self) -> pulp.LpAffineExpression:
        C = self.C
        # non-expert weights + reserve + E Ws (dense dequantization scratch, quantized pages) + R We (resident)
        # + 2 (E - r) We (page buffers sized for the r-layers) + N_gpu kv_seq
        return (C.mem_fixed_gpu + C.mem_scratch + C.mem_expert * self.R_gpu + 2 * C.mem_expert * self.paged
                + C.mem_kv_seq * self.N_gpu)

    def _gpu_memory_decode(self) -> None:
        C = self.C
        # GPU(decode) = common + N D b (hidden rows) + sum_m z_m 2 ws(m) <= budget   (row divided by the budget)
        self.prob += ((self._gpu_common() + C.mem_hidden_dec * self.N + C.mem_attn_gpu_seq * self.N_gpu
                       + pulp.lpSum(C.mem_ws_dec[m] * self.z[m] for m in C.cands)) * (1 / C.gpu_cap) <= 1), "gpu_mem_decode"

    def _gpu_memory_prefill(self) -> None:
        C = self.C
        # GPU(prefill) = common + N s_max D b (prefill hidden rows) + sum_m z_m ws_prefill(m) <= budget   (scaled)
        self.prob += ((self._gpu_common() + C.mem_hidden_pre * self.N
                       + pulp.lpSum(C.mem_ws_pre[m] * self.z[m] + C.mem_ws_pre_cpu[m] * self.q[m] for m in C.cands))
                      * (1 / C.gpu_cap) <= 1), "gpu_mem_prefill"

    def _cpu_memory(self) -> None:
        C = self.C
        # CPU = (L_moe E - R) We (pinned, not resident) + N_cpu (kv_seq + staging) + sum_m z_m stage_pre(m) <= budget - reserve
        if C.cpu_cap <= 0:
            self.prob += self.z[C.cands[0]] >= 2, "cpu_reserve_exceeds_budget"  # infeasible on purpose
            return
        # (H10) g processes: g CPU KV caches and staging buffers (mem_stage_seq, mem_stage_pre are x g already)
        self.prob += ((C.mem_expert * (self.L_moe * self.E - self.R) + (C.mem_kv_seq * C.gpus + C.mem_stage_seq) * self.N_cpu
                       + pulp.lpSum(C.mem_stage_pre[m] * self.z[m] for m in C.cands)) * (1 / C.cpu_cap) <= 1), "cpu_mem"
        # CPU(load) = (L_moe E - R) We (the pool as filled) + g E We (one layer as read per process) <= budget - reserve
        self.prob += ((C.mem_expert * (self.L_moe * self.E - self.R) + C.mem_load_host) * (1 / C.cpu_cap) <= 1), "cpu_mem_load"

    def _layer_sum(self, name: str, A: pulp.LpAffineExpression, Cvar: pulp.LpVariable,
                   kv: Optional[pulp.LpAffineExpression] = None, k: int = 0) -> pulp.LpVariable:
        """S = sum over the MoE layers of window class ``k`` (``moe_cls``; L of them, x of them holding the extra
        expert, x by ``digits[k]``) of max(H_l, C): L - x layers at H = (E - r) wio + A, x layers at H - wio,
        all with the same non-H2D stage maximum C = ``Cvar``. With host DRAM sharing (``kv``: the layer's CPU
        attention KV seconds X, (H5')), H_l becomes H_l + b X and each class also has V, U >= X + a H_l.

        V >= (E - r) wio + A, V >= C  (layers holding r);  U >= (E - r - 1) wio + A, U >= C  (layers holding r + 1)
        sum = (L - x) V + x U = L V - x (V - U), with 0 <= V - U <= wio; x (V - U) = sum_i 2^i beta_i (V - U) is
        bounded above by q_i <= wio beta_i, q_i <= V - U:  S >= L V - sum_i 2^i q_i.  At the optimum V, U are the
        true maxima (raising V costs L and gains at most x <= L; with x = L, a window class holding the extra in
        every layer, S >= L U, the true sum) so S is exact.
        """
        L, wio = self.moe_cls[k][1], self.C.wio
        P = self._var
        V, U, S = P(f"V_{name}", lowBound=0), P(f"U_{name}", lowBound=0), P(f"S_{name}", lowBound=0)
        for W, paged, cls in ((V, self.paged, "V"), (U, self.paged_extra, "U")):
            for i, row in enumerate(self._h2d_rows(paged * wio + A, kv)):
                self.prob += W >= row, f"{cls}_{name}_h2d" + (f"{i}" if i else "")
            self.prob += W >= Cvar, f"{cls}_{name}_rest"
        q = []
        for i, bt in enumerate(self.digits[k]):
            qi = P(f"q_{name}_{i}", lowBound=0)
            self.prob += qi <= wio * bt, f"q_{name}_{i}_bit"
            self.prob += qi <= V - U, f"q_{name}_{i}_gap"
            q.append((1 << i) * qi)
        self.prob += S >= L * V - pulp.lpSum(q), f"S_{name}"
        return S

    def _dense_sum(self, name: str, A: pulp.LpAffineExpression, Cvar: pulp.LpVariable,
                   kv: Optional[pulp.LpAffineExpression] = None, layers: Optional[int] = None) -> pulp.LpVariable:
        """Sd >= L max(A, Cd) over ``layers`` dense layers (default all L_d): dense layers page nothing (with ``kv``:
        the (H5') rows of :meth:`_h2d_rows`)."""
        L = self.L_d if layers is None else layers
        Sd = self._var(f"Sd_{name}", lowBound=0)
        for i, row in enumerate(self._h2d_rows(A, kv)):
            self.prob += Sd >= L * row, f"Sd_{name}_h2d" + (f"{i}" if i else "")
        self.prob += Sd >= L * Cvar, f"Sd_{name}_rest"
        return Sd

    def _h2d_rows(self, H, kv: Optional[pulp.LpAffineExpression]) -> list:
        """A layer's H2D rows: [H] (its h2d seconds), or with (H5') host DRAM sharing (``kv``: its CPU attention KV
        seconds X; hrm.decode_layer_times) [H + b X, X + a H]."""
        if kv is None or self.C.dram is None:
            return [H]
        a, b = self.C.dram
        return [H + b * kv, kv + a * H]

    def _dequant(self) -> None:
        """Per-layer dequantization seconds of quantized pages (see the module docstring): wdq E sum_m z_m (every
        MoE layer dequantizes all its E experts once per visit, whatever it holds resident, in both phases). None
        for unquantized pages (wdq = 0)."""
        C = self.C
        E = hrm.paged_per_gpu(self.E, C.gpus)  # (H10) one GPU's share of the layer's experts
        self.deq = C.wdq * E * pulp.lpSum(self.z[m] for m in C.cands) if C.wdq > 0 else None

    def _stage_max(self, name: str, gpu: pulp.LpAffineExpression, rest: list) -> pulp.LpVariable:
        """C >= the GPU row ``gpu`` (+ the dequantization time) and >= every row of ``rest``: the non-H2D stage
        maximum of a MoE layer."""
        Cr = self._var(f"C_{name}", lowBound=0)
        deq = self.deq
        self.prob += Cr >= (gpu if deq is None else gpu + deq), f"C_{name}_gpu"
        for i, row in enumerate(rest):
            self.prob += Cr >= row, f"C_{name}_rest{i}"
        return Cr

    def _prefill_time(self) -> None:
        C, cands = self.C, self.C.cands
        d2h = C.pre_d2h_seq * self.N_cpu  # prompt KV of CPU-KV sequences, per layer
        # (H8) per window class: C_p >= gpu = sum_m w_m pre_moe(m) (+ dequantization; a windowed class's attention
        #   over its window: pre_moe_w);  C_p >= d2h  (no CPU stage in prefill)
        terms = []
        for k, (window, _) in enumerate(self.moe_cls):
            pre = C.pre_moe if window is None else C.pre_moe_w
            Cp = self._stage_max("prefill" + _tag(k), pulp.lpSum(pre[m] * self.w[m] for m in cands), [d2h])
            terms.append(self._layer_sum("prefill" + _tag(k), pulp.LpAffineExpression(), Cp, k=k))
        for k, (window, count) in enumerate(self.dense_cls):
            pre = C.pre_dense if window is None else C.pre_dense_w
            Cdp = self._var("Cd_prefill" + _tag(k), lowBound=0)
            self.prob += Cdp >= pulp.lpSum(pre[m] * self.w[m] for m in cands), "Cdp_gpu" + _tag(k)
            self.prob += Cdp >= d2h, "Cdp_d2h" + _tag(k)
            terms.append(self._dense_sum("prefill" + _tag(k), pulp.LpAffineExpression(), Cdp, None, count))
        # T_prefill = sum over layers + head (not overlapped)
        self.T_prefill = pulp.lpSum(terms) + pulp.lpSum(C.pre_head[m] * self.w[m] for m in cands)

    def _decode_step(self, t: int, c: float) -> None:
        """Decode step t at mean context ``c``: per window class of the MoE layers (``moe_cls``) its stage maximum
        and layer sum, per class of the dense layers the same; + the head. The CPU rows of a class attend over
        hrm.cpu_attended positions (the window, if the class has one); the GPU rows over the whole context."""
        C = self.C
        cc = c + C.cpu_off  # context of the CPU-attention rows (the longest micro-batches)
        terms, moe, dense = [], {}, {}  # CPU-row context -> its stage maximum: classes that the window does not
        #   shorten at this step (cc <= window) share one
        for k, (window, _) in enumerate(self.moe_cls):
            ccw = cc if window is None else min(cc, window)
            if ccw not in moe:
                moe[ccw] = self._decode_stage(f"{t}{_tag(k)}", c, ccw, C.mb_moe, self.GPU)
            terms.append(self._layer_sum(f"{t}{_tag(k)}", self.A, moe[ccw], ccw * C.kv_rate * self.N_cpu, k=k))
        for k, (window, count) in enumerate(self.dense_cls):
            ccw = cc if window is None else min(cc, window)
            if ccw not in dense:
                dense[ccw] = self._decode_stage(f"d{t}{_tag(k)}", c, ccw, C.mb_dense, self.GPU_d, dense=True)
            terms.append(self._dense_sum(f"{t}{_tag(k)}", self.A, dense[ccw], ccw * C.kv_rate * self.N_cpu, count))
        # (H7) step time = layers + head
        self.T_decode += pulp.lpSum(terms) + self.HEAD

    def _decode_stage(self, name: str, c: float, cc: float, mb: dict, gpu_layer, dense: bool = False):
        """The non-H2D stage maximum of one decode layer class at mean context ``c``, its CPU rows at ``cc``:
        (H6) >= gpu_layer + N_gpu attn_g(c) (+ dequantization for MoE layers);  (H5) >= cc K + (n - g) calls(mu)
        cpu_call;  one CPU micro-batch's round trip when y_cpu = 1 (hrm.decode_layer_times): >= c_1(m) + g_1(m),
        c_1(m) = calls(m) cpu_call + m cc cpu_rate, g_1(m) = ``mb[m]`` (one micro-batch's GPU layer);  (H4) >= D2H;
        (H6') >= the host row."""
        C = self.C
        gpu = gpu_layer + C.attn_g[c] * self.N_gpu
        cpu = cc * self.K + C.cpu_call * self.cpu_calls
        chain = self._cpu_micro_batch(cc) + pulp.lpSum(mb[m] * self.q[m] for m in C.cands)
        rest = [cpu, chain, self.D2H] + self._host_row()
        if not dense:
            return self._stage_max(name, gpu, rest)
        Cd = self._var(f"Cd_{name}", lowBound=0)
        for i, row in enumerate([gpu] + rest):
            self.prob += Cd >= row, f"Cd_{name}_{i}"
        return Cd

    def _cpu_micro_batch(self, cc: float) -> pulp.LpAffineExpression:
        """One CPU micro-batch's attention seconds at CPU-row context ``cc`` when some attention is on the CPU
        (q_m), else 0: calls(m) cpu_call + m cc cpu_rate; the CPU half of a micro-batch's round trip
        (hrm.decode_layer_times' cpu_mb)."""
        C = self.C
        return pulp.lpSum((C.cpu_call * C.calls[m] + m * cc * C.cpu_rate) * self.q[m] for m in C.cands)

    def _host_row(self) -> list:
        """(H6') the host stage of a decode layer, as a list of 0 or 1 rows: h_c (n - g) + h_g g; none when the
        profile has no host measurement (hrm.decode_layer_times then has none either)."""
        C = self.C
        if C.host_c <= 0 and C.host_g <= 0:
            return []
        return [C.host_c * self.n_cpu + C.host_g * pulp.lpSum(self.v.values())]

    # -- solving --
    @property
    def T(self) -> pulp.LpAffineExpression:
        return self.T_prefill + self.T_decode

    def solve(self, lam: float, time_limit: float) -> tuple[dict, float, bool]:
        """max G N - lam T. Returns (decisions, objective value, proven optimal). Raises PlanInfeasible."""
        G = self.workload.gen_len
        self.prob.setObjective(G * self.N - lam * self.T)
        found, optimal, status = _solve_highs(self.prob, time_limit, self.cache)
        self.cache_hits += status == CACHED_STATUS
        if not found:
            raise PlanInfeasible(f"infeasible: the MILP has no solution (HiGHS: {status})")
        mu = max(self.C.cands, key=lambda m: self.z[m].varValue or 0.0)
        x = sum((1 << i) * int(round(bt.varValue)) for d in self.digits for i, bt in enumerate(d))
        d = {
            "mu": mu,
            "n": int(round(self.w[mu].varValue)),
            "g": int(round(self.v[mu].varValue)),
            "R": self.L_moe * int(round(self.r.varValue)) + x,
        }
        return d, float(pulp.value(self.prob.objective)), optimal


def _highs_rows(prob: pulp.LpProblem, col: dict) -> tuple[list, list, list, list, list]:
    """The rows of ``prob`` in HiGHS's compressed form: (lower, upper, starts, indices, values).

    PuLP keeps a row as ``expression + constant (sense) 0``, so its right-hand side is -constant."""
    lower, upper, starts, index, value = [], [], [], [], []
    # PuLP >= 3.3 lists them through prob.constraints() (its mapping form is deprecated); older PuLP has a dict
    for con in prob.constraints() if callable(prob.constraints) else prob.constraints.values():
        rhs = -con.constant
        lower.append(rhs if con.sense != pulp.LpConstraintLE else -highspy.kHighsInf)
        upper.append(rhs if con.sense != pulp.LpConstraintGE else highspy.kHighsInf)
        starts.append(len(index))
        for var, a in con.items():
            if a != 0:
                index.append(col[var.name])
                value.append(a)
    return lower, upper, starts, index, value


_HIGHS_BANNER = {"shown": False}  # HiGHS prints a banner to fd 1 when a process makes its first instance


def _new_highs() -> highspy.Highs:
    """A HiGHS instance; the process's first one is made with fd 1 on /dev/null (its banner would land in the
    output of `moe-batch plan`, before any option can silence it)."""
    if _HIGHS_BANNER["shown"]:
        return highspy.Highs()
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        h = highspy.Highs()
        _HIGHS_BANNER["shown"] = True
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return h


def _highs_input(prob: pulp.LpProblem) -> tuple[list, dict]:
    """(the variables of ``prob`` in column order, HiGHS's input for it: numpy arrays of the column bounds, costs
    (minimised: a maximisation's are negated), integer columns and the rows in compressed form)."""
    vs = prob.variables()
    col = {v.name: i for i, v in enumerate(vs)}
    inf, sense = highspy.kHighsInf, -1.0 if prob.sense == pulp.LpMaximize else 1.0
    obj = prob.objective
    lo, up, starts, index, value = _highs_rows(prob, col)
    f64, i32 = np.float64, np.int32
    return vs, {"col_lower": np.array([-inf if v.lowBound is None else v.lowBound for v in vs], dtype=f64),
                "col_upper": np.array([inf if v.upBound is None else v.upBound for v in vs], dtype=f64),
                "cost": np.array([sense * obj.get(v, 0.0) for v in vs], dtype=f64),
                "ints": np.array([i for i, v in enumerate(vs) if v.cat == pulp.LpInteger], dtype=i32),
                "row_lower": np.array(lo, dtype=f64), "row_upper": np.array(up, dtype=f64),
                "starts": np.array(starts, dtype=i32), "index": np.array(index, dtype=i32),
                "value": np.array(value, dtype=f64)}


def _run_highs(a: dict, time_limit: float, presolve: bool = True) -> tuple[bool, bool, str, Optional[np.ndarray]]:
    """HiGHS on the input ``a`` (:func:`_highs_input`), to zero gap, silently, within ``time_limit`` seconds.
    HiGHS's presolve has called a badly scaled feasible model (tiny-mixtral, 2 GiB GPU) infeasible: "no solution"
    from a presolved run is only believed after a run without presolve. Returns (a feasible solution was found, it
    is proven optimal, HiGHS's model status in words, the solution's column values or None)."""
    h = _new_highs()
    for key, val in (("output_flag", False), ("time_limit", float(time_limit)), ("mip_rel_gap", 0.0),
                     ("mip_abs_gap", 0.0), ("presolve", "on" if presolve else "off")):
        h.setOptionValue(key, val)
    n, ints = len(a["cost"]), a["ints"]
    h.addVars(n, a["col_lower"], a["col_upper"])
    h.changeColsCost(n, np.arange(n, dtype=np.int32), a["cost"])
    if len(ints):
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    h.addRows(len(a["row_lower"]), a["row_lower"], a["row_upper"], len(a["index"]), a["starts"], a["index"],
              a["value"])
    h.run()
    status = h.getModelStatus()
    found = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible: a feasible point is held
    if not found and presolve:
        return _run_highs(a, time_limit, presolve=False)
    x = np.array(h.getSolution().col_value, dtype=np.float64) if found else None
    return found, status == highspy.HighsModelStatus.kOptimal, h.modelStatusToString(status), x


def _solve_highs(prob: pulp.LpProblem, time_limit: float, cache: Optional[str] = None) -> tuple[bool, bool, str]:
    """Solve the PuLP model ``prob`` with HiGHS (highspy, called directly: PuLP is only the modelling layer;
    :func:`_run_highs`) and write the solution into its variables' varValue.

    ``cache``: a directory of earlier answers (:func:`_cached_solution`): a model solved before to proven optimality
    is answered from it, with the column values HiGHS gave then (status CACHED_STATUS), and a new one so solved is
    added to it. Returns (a feasible solution was found, it is proven optimal, HiGHS's model status in words)."""
    vs, a = _highs_input(prob)
    path = _cache_path(cache, [v.name for v in vs], a, time_limit) if cache else None
    x = _cached_solution(path, len(vs)) if path else None
    if x is not None:
        found, optimal, status = True, True, CACHED_STATUS
    else:
        found, optimal, status, x = _run_highs(a, time_limit)
        if path and found and optimal:
            _save_solution(path, x)
    if found:
        for v, xi in zip(vs, x.tolist()):
            v.varValue = xi
    return found, optimal, status


def default_solve_cache() -> Optional[str]:
    """The solve cache ``moe-batch run`` / ``plan`` and the Python API plan with (:func:`plan`'s ``solve_cache``):
    ``$LIGHTNING_MOE_SOLVE_CACHE`` (a directory; ``off`` for none), else ``milp-solves`` in the package cache
    directory (``$LIGHTNING_MOE_CACHE``, else ``$XDG_CACHE_HOME/lightning-moe``, default ``~/.cache/lightning-moe``:
    model.tiny.default_cache_dir's rule, repeated here because the policy layer imports no torch)."""
    env = os.environ.get("LIGHTNING_MOE_SOLVE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else env
    root = os.environ.get("LIGHTNING_MOE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightning-moe")
    return os.path.join(root, "milp-solves")


CACHED_STATUS = "Optimal (solve cache)"  # _solve_highs' status of a solve the cache answered
SOLVE_CACHE_VERSION = 2  # in every key of the solve cache: bumped when what an entry holds changes
SOLVE_CACHE_FILES = 4096  # entries a solve cache keeps (~8 bytes per column each); the oldest go first
SOLVE_CACHE_SUFFIX = ".sol"  # an entry's file: <key>.sol
_ENTRY_MAGIC = b"LMOESOL2"  # an entry: this, a SHA-256 of (its key, its values), the float64 values (little-endian)


def _cache_path(cache: str, names: Sequence[str], a: dict, time_limit: float) -> str:
    """The file of the solve cache ``cache`` for HiGHS input ``a`` of columns ``names``: named by a SHA-256 of the
    column names (what each column means: the solution is read back by name), every array's bytes, the options
    :func:`_run_highs` sets (``time_limit`` the only variable one), the HiGHS version and this machine's CPU count
    (HiGHS's MIP workers; its answers are deterministic for one input, options, build and thread count)."""
    import hashlib

    h = hashlib.sha256(repr((SOLVE_CACHE_VERSION, _highs_version(), float(time_limit), os.cpu_count())).encode())
    h.update(f"columns:{len(names)}:".encode() + "\0".join(names).encode())
    for k in sorted(a):
        h.update(f"{k}:{a[k].dtype.str}:{a[k].shape}".encode())
        h.update(np.ascontiguousarray(a[k]).tobytes())
    return os.path.join(cache, f"{h.hexdigest()}{SOLVE_CACHE_SUFFIX}")


@functools.lru_cache(maxsize=1)
def _highs_version() -> str:
    """The installed highspy's version (its distribution's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("highspy")
    except PackageNotFoundError:  # pragma: no cover (a build without metadata)
        return "unknown"


def _entry_digest(path: str, data: bytes) -> bytes:
    """The SHA-256 an entry at ``path`` carries: of its key (the file name) and its values' bytes, so an entry
    damaged anywhere, cut short, or copied under another key does not match."""
    import hashlib

    return hashlib.sha256(os.path.basename(path).encode() + b"\0" + data).digest()


def _cached_solution(path: str, n: int) -> Optional[np.ndarray]:
    """The ``n`` column values stored at ``path`` (:func:`_save_solution`), or None: absent, unreadable, another
    length, or not matching its digest (a damaged entry is solved again, never believed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(len(_ENTRY_MAGIC) + 32 + 8 * n + 1)
    except (OSError, ValueError):
        return None
    m = len(_ENTRY_MAGIC)
    head, digest, data = raw[:m], raw[m:m + 32], raw[m + 32:]
    if head != _ENTRY_MAGIC or len(data) != 8 * n or digest != _entry_digest(path, data):
        return None
    return np.frombuffer(data, dtype="<f8").astype(np.float64)


def _save_solution(path: str, x: np.ndarray) -> None:
    """Store ``x`` at ``path``: written whole to a temporary file of this writer's own (mkstemp) in the cache, then
    renamed over ``path`` (atomic: a concurrent reader or writer sees the old entry, none, or this one whole; a
    failed write leaves no file behind), then keep the cache's newest SOLVE_CACHE_FILES entries. A cache that
    cannot be written (no permission, not a directory, disk full) is left alone: the plan goes on without it."""
    import tempfile

    folder = os.path.dirname(path)
    data = np.ascontiguousarray(x, dtype="<f8").tobytes()
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=folder)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes it 0600: readable by others as a plain open() file would be
        with os.fdopen(fd, "wb") as f:
            f.write(_ENTRY_MAGIC + _entry_digest(path, data) + data)
        os.replace(tmp, path)
        tmp = None
        _evict(folder)
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass


def _evict(folder: str) -> None:
    """Remove the oldest entries of the solve cache ``folder`` beyond SOLVE_CACHE_FILES (by modification time)."""
    entries = [e for e in os.scandir(folder) if e.name.endswith(SOLVE_CACHE_SUFFIX)]
    if len(entries) > SOLVE_CACHE_FILES:
        entries.sort(key=lambda e: e.stat().st_mtime)
        for e in entries[:len(entries) - SOLVE_CACHE_FILES]:
            os.remove(e.path)


def _tie_break(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets, cands: Sequence[int],
               pol: Policy, est: "hrm.Estimate") -> tuple[Policy, "hrm.Estimate"]:
    """Among HRM ties of the optimum (within TIE_SLACK of its throughput, same memory budgets), prefer fewer
    micro-batches, then fewer GPU-attention micro-batches, then fewer resident experts.

    The HRM has no per-micro-batch overhead and a PCIe-bound layer hides any GPU/CPU split, so the optimum
    is often one of many ties; the executor prefers the simplest. Local search with hrm.evaluate only.
    """
    floor = est.e2e_tok_s * (1 - TIE_SLACK)
    R = pol.total_resident(spec)

    def try_(mu: int, n: int, R_: int, g: int):
        if not (1 <= n and 0 <= g <= n and mu in cands):
            return None
        p = policy_from_decisions(spec, workload, budgets, mu, n, R_, g)
        if hrm.memory_violations(p, spec, workload):
            return None
        e = hrm.evaluate(p, spec, hw, workload)
        return (p, e) if e.e2e_tok_s >= floor else None

    best = (pol, est)
    N, gseq = pol.N, pol.n_gpu_attn * pol.mu
    for m in sorted((m for m in cands if m > pol.mu and N % m == 0), reverse=True):  # same N, fewer micro-batches
        got = next((x for g in sorted({gseq // m, -(-gseq // m)}) if (x := try_(m, N // m, R, g))), None)
        if got:
            best = got
            break
    p0 = best[0]
    for g in range(p0.n_gpu_attn):  # fewest GPU-attention micro-batches
        got = try_(p0.mu, p0.n, R, g)
        if got:
            best = got
            break
    p0 = best[0]
    lo, hi = 0, R  # fewest resident experts (throughput is monotone in R); keep hi as the known-good value
    while lo < hi:
        mid = (lo + hi) // 2
        got = try_(p0.mu, p0.n, mid, p0.n_gpu_attn)
        if got:
            hi, best = mid, got
        else:
            lo = mid + 1
    return best


def _kv_sizing_count(pol: Policy) -> int:
    """The sequence count whose workload.kv_positions sizes every sequence of ``pol`` safely: N_cpu (the CPU
    holds the batch's longest rows, hrm.kv_cache_bytes), or N when no micro-batch attends on the CPU."""
    return pol.n_cpu_attn * pol.mu or pol.N


def _solve_for_kv_len(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets, cands: Sequence[int],
                      n_max: Optional[int], time_limit: float, kv_len: float, min_kv_count: int, strict: bool,
                      offsets: tuple[float, float] = (0.0, 0.0), cache: Optional[str] = None):
    """Dinkelbach iterations of the MILP with ``kv_len`` KV positions per sequence, over policies whose KV sizing
    count (:func:`_kv_sizing_count`) is at least ``min_kv_count`` (0: all); ``cache``: the solve cache (:func:`plan`).

    Returns (best (Policy, Estimate) among the iterates that fit hrm's exact memory model, or None; whether
    the last iterate (the optimum) fits; proven optimal; iterations; coefficients; model; build seconds; the
    last iterate's Policy, i.e. the optimum of this model).
    ``strict``: an iterate that does not fit raises PlanInfeasible (``kv_len`` is then the longest prompt's,
    an upper bound, so a misfit is a solver fault).
    """
    t0 = time.perf_counter()
    C = _coefficients(spec, hw, workload, budgets, cands, n_max, kv_len, offsets)
    model = _Model(spec, workload, C, min_kv_count, cache)
    t_build = time.perf_counter() - t0
    lam, best, proven, iters, bad = 0.0, None, True, 0, []
    for iters in range(1, MAX_DINKELBACH + 1):
        d, F, opt = model.solve(lam, time_limit)
        proven &= opt
        pol = policy_from_decisions(spec, workload, budgets, d["mu"], d["n"], d["R"], d["g"])
        bad = hrm.memory_violations(pol, spec, workload)  # never trust the status: re-check with integer bytes
        if bad and strict:
            raise PlanInfeasible("infeasible: the solver's policy does not fit on re-check: " + "; ".join(bad))
        est = hrm.evaluate(pol, spec, hw, workload)
        ratio = est.e2e_tok_s
        if not bad and (best is None or ratio > best[1].e2e_tok_s):
            best = (pol, est)
        # F(lam) = max G N - lam T >= 0; at the optimal ratio it is 0 (relative tolerance on G N)
        if ratio <= lam * (1 + 1e-12) or F <= 1e-9 * workload.gen_len * pol.N:
            break
        lam = ratio
    return best, not bad, proven, iters, C, model, t_build, pol


def _round_offsets(workload: Workload, optimum: Policy) -> tuple[float, float]:
    """The attention-context offsets (CPU rows, GPU rows) of an offsets round's optimum: the next round's constants."""
    return workload.attention_context_offsets(optimum.N, optimum.mu, optimum.n, optimum.n_gpu_attn)


def _fixed_points(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets, cands: Sequence[int],
                  n_max: Optional[int], time_limit: float, solved: Optional[dict] = None, cache: Optional[str] = None):
    """:func:`plan`'s MILP passes: the KV-length fixed point inside the attention-context offsets fixed point (below).

    A pass met again (same KV length, count rows, offsets and strictness: an offsets round that comes back to an
    earlier round's offsets) is the same model, which HiGHS answers the same (deterministic; only a solve that stops
    at ``time_limit`` could answer otherwise): its first answer is reused, not solved again (``solved``: the passes
    answered so far, by key; default a new dict). ``cache``: the solve cache (:func:`plan`'s ``solve_cache``).
    Returns (best (Policy, Estimate), proven optimal, (Dinkelbach solves run, those the cache answered), pass
    labels, build seconds, the last pass's coefficients and model)."""
    # KV fixed point: the MILP is linear in N, so it takes one KV length per sequence. Pass 1 uses the longest
    # prompt's (safe for every N); each next pass uses workload.kv_positions(K) of the batch the previous pass
    # chose (K = its N_cpu, or N without CPU attention). kv_positions is non-increasing in N, so that model is
    # exact or conservative for policies of >= K sequences and a relaxation for smaller ones; when its optimum
    # is one of those and does not fit hrm's exact bytes, the pass is solved again with rows N >= K,
    # N_cpu >= K y_cpu, where every solution fits and the previous answer is still feasible.
    best, proven, iters, hits, passes, t_build = None, True, 0, 0, [], 0.0
    solved = {} if solved is None else solved
    offsets = (0.0, 0.0)
    for _ in range(MAX_OFFSET_SOLVES):
        kv_len, count = workload.kv_positions(1), 0
        for k in range(MAX_KV_SOLVES):
            for min_count in ((0, count) if k else (0,)):
                key = (kv_len, min_count, offsets, k == 0)  # every input of the pass that plan() does not fix
                again = key in solved
                if not again:
                    solved[key] = _solve_for_kv_len(spec, hw, workload, budgets, cands, n_max, time_limit, kv_len,
                                                    min_count, strict=k == 0, offsets=offsets, cache=cache)
                got, fits, opt, it, C, model, tb, optimum = solved[key]
                proven = proven and opt
                if not again:
                    iters, hits, t_build = iters + it, hits + model.cache_hits, t_build + tb
                passes.append(f"{kv_len:.1f}" + (f" (N >= {min_count})" if min_count else "")
                              + (f" [CPU rows +{offsets[0]:.1f}]" if offsets[0] else "") + (" (again)" if again else ""))
                if got is not None and (best is None or got[1].e2e_tok_s > best[1].e2e_tok_s):
                    best = got  # compared with hrm.evaluate, i.e. with the policy's own exact offsets
                if fits:
                    break
            assert best is not None  # the first pass raises rather than return nothing
            count = _kv_sizing_count(best[0])
            nxt = workload.kv_positions(count)
            if nxt >= kv_len * (1 - 1e-12):  # fixed point: done
                break
            kv_len = nxt
        # attention-context offsets: the MILP takes them as constants; solve again with the offsets of this round's
        # optimum until they repeat (the best policy is always chosen by hrm.evaluate, with its exact offsets)
        nxt_off = _round_offsets(workload, optimum)
        if all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for x, y in zip(nxt_off, offsets)):
            break
        offsets = nxt_off
    return best, proven, (iters, hits), passes, t_build, C, model


def plan(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets,
         candidates: Optional[Sequence[int]] = None, *, n_max: Optional[int] = None,
         time_limit: float = SOLVE_TIME_LIMIT, tie_break: bool = True,
         prefill_growth: bool = True, job_fit: bool = False,
         solve_cache: Optional[str] = None) -> tuple[Policy, "hrm.Estimate"]:
    """Best CGOPipe policy for end-to-end throughput N G / (T_prefill + T_decode) under the budgets, re-shaped for
    the job's request count (``job_fit``).

    Args:
        spec, hw, workload, budgets: the model, host, job shape and memory budgets (budgets.weight_quant
            and budgets.dtype fix the formats).
        candidates: micro-batch sizes mu to choose from (default DEFAULT_MU_CANDIDATES, capped at
            workload.num_requests, which is itself added).
        n_max: optional cap on the number of micro-batches (for small search grids).
        time_limit: seconds per HiGHS solve.
        tie_break: among HRM ties of the optimum (within TIE_SLACK), prefer fewer micro-batches, then fewer
            GPU-attention micro-batches, then fewer resident experts (local search with hrm.evaluate).
        prefill_growth: after the MILP, enlarge the prefill micro-batch into the GPU memory the decode policy leaves
            (:func:`grow_prefill`; the decode decisions do not change).
        job_fit: with ``workload.num_requests``, re-shape the policy for the whole job (jobplan.fit_job: one batch of
            every request where memory allows, else even batches; the least job time, every batch counted).
        solve_cache: a directory where each HiGHS solve proven optimal is kept, keyed by a hash of its whole input
            (model, objective, options, HiGHS version, CPU count); a solve met again (the same job planned again:
            ``moe-batch plan`` then ``moe-batch run``, a second run) is answered from it with the same column values,
            so the policy and estimate are those of solving it. None (default): every solve runs.
    Returns (Policy, Estimate): the estimate is hrm.evaluate of the policy, with solver notes.
    Raises PlanInfeasible (one line) when nothing fits; ValueError for a model without MoE layers.
    """
    if spec.num_moe_layers < 1:
        raise ValueError(f"{spec.name}: no MoE layers to plan for")
    if workload.scoring:
        return plan_scoring(spec, hw, workload, budgets)
    cands = sorted(set(candidates if candidates is not None else DEFAULT_MU_CANDIDATES))
    if workload.num_requests is not None:
        if candidates is None and workload.num_requests < max(cands):
            cands.append(workload.num_requests)
        cands = sorted({m for m in cands if m <= workload.num_requests})
    if not cands or any(not isinstance(m, int) or m < 1 for m in cands):
        raise PlanInfeasible(f"infeasible: no usable micro-batch size among the candidates {list(candidates or [])} "
                             f"(must be ints >= 1 and <= {workload.num_requests} requests)")
    diagnose(spec, workload, budgets, cands[0])

    t0 = time.perf_counter()
    best, proven, (iters, hits), passes, t_build, C, model = _fixed_points(spec, hw, workload, budgets, cands, n_max, time_limit,
                                                                   cache=solve_cache)
    pol, est = best
    if tie_break:
        pol, est = _tie_break(spec, hw, workload, budgets, cands, pol, est)
    if prefill_growth:
        pol, est = grow_prefill(pol, spec, hw, workload)
    if job_fit:
        pol, est = fit_job(pol, est, spec, hw, workload)
    hrm.check_memory(pol, spec, workload)  # raises PlanInfeasible if any budget is exceeded
    kv_note = (f", KV {workload.kv_positions(_kv_sizing_count(pol)):.1f} positions/sequence "
               f"(MILP pass(es) at {', '.join(passes)})" if workload.prompt_lens is not None else "")
    note = (f"MILP: {len(cands)} micro-batch sizes, n <= {max(C.nmax.values())}, {model.prob.numConstraints()} constraints, "
            f"{iters} Dinkelbach solve(s){f' ({hits} from the solve cache)' if hits else ''}{kv_note}, {time.perf_counter() - t0:.2f} s (build {t_build:.2f} s), "
            + ("proven optimal" if proven else f"NOT proven optimal (HiGHS time limit {time_limit:g} s)"))
    log.info(note)
    return pol, replace(est, notes=est.notes + (note,))


SCORING_PREFILL_TOKENS = (4096, 8192, 16384, 32768)  # padded tokens per prefill micro-batch plan_scoring tries
SCORING_TIE = 0.02  # estimates this close to plan_scoring's best count as tied: the larger batch wins (the HRM prices
# no per-batch fixed cost -- a pass's pipeline fill, the host loop -- which favour fewer, larger batches)


def scoring_policy(spec: MoESpec, workload: Workload, budgets: Budgets, N: int, resident: int, prefill_tokens: int) -> Policy:
    """The prefill-only Policy of a scoring batch of ``N`` sequences: one micro-batch (mu = N, n = 1, "GPU attention":
    no KV leaves the GPU), ``resident`` experts in every MoE layer, prefill micro-batches of ``prefill_tokens`` padded
    tokens (rows sized by the mean length, then evened out as the executor cuts a batch: ceil(B / ceil(B / rows))
    rows for a batch of B = min(N, the job's sequences), so the memory model counts the rows a chunk really has)."""
    s = max(1, int(-(-workload.prompt_len // 1)))
    rows = max(1, min(N, prefill_tokens // s))
    B = N if workload.num_requests is None else min(N, workload.num_requests)
    rows = min(rows, -(-B // -(-B // rows)))  # pipeline.cgopipe scores a batch in ceil(B / rows) even micro-batches
    return Policy(mu=N, n=1, prefill_mu=rows, prefill_tokens=prefill_tokens,
                  resident_experts=resident, n_gpu_attn=1, weight_quant=budgets.weight_quant, dtype=budgets.dtype,
                  gpu_budget=budgets.gpu_memory, cpu_budget=budgets.cpu_memory,
                  gpu_reserve=budgets.gpu_reserve, cpu_reserve=budgets.cpu_reserve, gpus=budgets.gpus)


def plan_scoring(spec: MoESpec, hw: HardwareProfile, workload: Workload, budgets: Budgets) -> tuple[Policy, "hrm.Estimate"]:
    """Best prefill-only policy for a scoring workload (``workload.scoring``): the largest prefill tokens / s.

    A scoring batch of N sequences streams every non-resident expert page across PCIe once per layer, so N is as
    large as GPU memory allows (its packed rows stay on the GPU for the whole pass; capped at the job's sequences).
    Searched over resident experts per layer (0..E, in steps of E / 16) and prefill micro-batch sizes
    (SCORING_PREFILL_TOKENS); for each, N is the largest that fits (memory grows with N: binary search), and the
    policy is scored with hrm.evaluate; of the policies within SCORING_TIE of the best estimate, the largest N. Raises PlanInfeasible (one line) when not even N = 1 fits.
    """
    if not workload.scoring:
        raise ValueError("plan_scoring: the workload is not a scoring workload")
    t0 = time.perf_counter()
    count = workload.num_requests or 1 << 20
    E = spec.num_experts
    found, tried, smallest = [], 0, None

    def fits(p: Policy) -> bool:
        return not hrm.memory_violations(p, spec, workload)

    for r in sorted(set(range(0, E + 1, max(1, E // 16))) | {E}):
        for tok in SCORING_PREFILL_TOKENS:
            if not fits(scoring_policy(spec, workload, budgets, 1, r, tok)):
                if smallest is None:
                    smallest = scoring_policy(spec, workload, budgets, 1, r, tok)
                continue
            lo, hi = 1, count  # lo fits; find the largest N <= count that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(scoring_policy(spec, workload, budgets, mid, r, tok)) else (lo, mid - 1)
            pol = scoring_policy(spec, workload, budgets, lo, r, tok)
            found.append((pol, hrm.evaluate(pol, spec, hw, workload)))
            tried += 1
    if not found:
        hrm.check_memory(smallest, spec, workload)  # raises PlanInfeasible naming what does not fit
        raise PlanInfeasible("infeasible: no scoring policy fits the budgets")  # pragma: no cover
    top = max(e.prefill_tok_s for _, e in found)
    # within SCORING_TIE of the best estimate: the largest batch (fewest page passes), then the faster estimate
    pol, est = max((pe for pe in found if pe[1].prefill_tok_s >= top * (1 - SCORING_TIE)),
                   key=lambda pe: (pe[0].N, pe[1].prefill_tok_s))
    note = (f"scoring plan: {tried} (resident, prefill tokens) pairs at their largest N, "
            f"{time.perf_counter() - t0:.2f} s")
    log.info(note)
    return pol, replace(est, notes=est.notes + (note,))
