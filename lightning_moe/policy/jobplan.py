"""The job, planned: what the whole job costs (its refill schedule, the last fill and the drain too), the refill
threshold, and the policy shape that runs it fastest (:func:`fit_job`).

The MILP (milp.py) maximises one batch's throughput N G / T(N). A job of P requests runs as one refilling call
(app.engine; pipeline/refill.py): N slots, a prefill pass per fill. With every request at max_new_tokens (what a plan
knows) the slots free together, so P not a multiple of N ends with a fill of P mod N rows that decodes as many steps
as a full one (2000 requests at N = 1920: 1920 + 80, the 80-row fill as long as the 1920-row one, since a PCIe-bound
decode step of N slots costs the same whatever rows are live). :func:`job_time` prices the schedule
(policy.refill_schedule.simulate) with the HRM's per-pass and per-step times. :func:`fit_job` re-shapes the MILP's
policy for the job: for every fill count k from 1 to ceil(P / N), the even N' = ceil(P / k) (one fill of P wherever
memory allows P), as n' micro-batches of mu' = ceil(N' / n') rows, with the most resident experts that fit, and keeps
the shape whose job time is least. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..model.spec import MoESpec
from . import hrm, refill_schedule
from .hardware import HardwareProfile
from .policy import DEFAULT_PREFILL_TOKENS, Policy, Workload

MAX_BATCH_COUNTS = 8  # batch counts k fit_job tries below ceil(P / N) (k = 1 and the ones nearest ceil(P / N))


# policy shapes the MILP and the job plan share (milp imports them from here)
def prefill_micro_batch(mu: int, prompt_len: float, prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> int:
    """Prefill micro-batch (rows) for decode micro-batch ``mu``: at most c = min(mu, ``prefill_tokens`` //
    ceil(prompt_len)) rows (>= 1), ``prompt_len`` the MEAN prompt length; the largest divisor d of mu with d <= c when
    2 d >= c (every chunk of a micro-batch the same size), else c (the executor's ``prefill_chunks`` cuts each
    micro-batch into chunks of c rows and one of the remainder; the HRM's ``pass_prefill_chunks`` counts them so).

    A divisor only when it is near c: a divisor far below it (mu = 334 = 2 x 167 with c = 97 gave 2-row chunks, 167
    per micro-batch and layer, each paying its launches) makes prefill host-bound. The executor also caps each
    prefill micro-batch at ``Policy.prefill_tokens`` padded tokens (rows x longest row, length-sorted rows), so a
    micro-batch of the longest prompts is split further and the workspace bound holds for any length mix; sizing the
    row count by the mean keeps the typical micro-batch near PREFILL_TOKENS tokens (with the max, one 425-token
    outlier of MT-Bench made every prefill micro-batch 8 rows, ~900 tokens).
    """
    s = max(1, int(-(-prompt_len // 1)))
    cap = max(1, min(mu, prefill_tokens // s))
    best = max(d for d in range(1, cap + 1) if mu % d == 0)
    return best if 2 * best >= cap else cap


def _spread_resident(spec: MoESpec, total: int) -> tuple[int, ...]:
    """``total`` resident experts spread evenly over the MoE layers (dense layers none): the per-layer counts of
    :func:`policy_from_decisions`. The x = total mod L_moe extra experts go to the sliding-window MoE layers first,
    then to the others, each in layer order (without windows: the first x MoE layers). A windowed layer's CPU
    attention is never slower than a full layer's (hrm.cpu_attended), so its pages more often bind and an extra
    expert there saves at least as much (exactly so without (H5')'s DRAM sharing rows); milp models this rule."""
    L_moe, E = spec.num_moe_layers, spec.num_experts
    r, x = divmod(total, L_moe)
    if r > E or (r == E and x):
        raise ValueError(f"{total} resident experts exceed {L_moe} x {E}")
    order = sorted(spec.moe_layers, key=lambda i: spec.layer_sliding_window(i) is None)  # stable: windowed first
    extra = set(order[:x])
    return tuple(r + (1 if i in extra else 0) if not spec.is_dense_layer(i) else 0 for i in range(spec.num_layers))


def job_schedule(policy: Policy, workload: Workload, min_free: int | None = None) -> refill_schedule.Schedule:
    """The refill schedule the executor runs for the job (one ``generate`` call: app.engine passes the whole work list
    to a refilling executor), planned with every request at max_new_tokens (``workload.gen_len``): what a plan knows.
    A job that stops on EOS / stop ids / stop strings ends rows earlier; the run report recomputes the schedule from
    the measured lengths (app.report.refill_report). Requests in the engine's order (ascending prompt length; without
    ``prompt_lens`` every prompt at the mean)."""
    P, G = workload.num_requests or policy.N, workload.gen_len
    lens = (sorted(workload.prompt_lens) if workload.prompt_lens and len(workload.prompt_lens) == P
            else [workload.prompt_len] * P)
    needs = [math.ceil(x) + G for x in lens]
    return refill_schedule.simulate(needs, lens, [G] * P, policy.N,
                                    min_free or refill_schedule.default_min_free(policy.N))


def schedule_seconds(sched: refill_schedule.Schedule, policy: Policy, spec: MoESpec, hw: HardwareProfile,
                     workload: Workload) -> tuple[float, float]:
    """(prefill, decode) seconds of ``sched`` by the HRM: each pass at hrm.prefill_pass_time of its rows and mean
    prompt, each step at hrm.decode_step_time of all N slots at its mean attended positions per slot."""
    return refill_schedule.schedule_seconds(
        sched, lambda c: hrm.decode_step_time(policy, spec, hw, workload, c),
        lambda rows, s: hrm.prefill_pass_time(policy, spec, hw, rows, s))


def job_min_free(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload,
                 mean_out: float | None = None) -> int:
    """The refill threshold for the job (refill_schedule.hrm_min_free): a pass's fixed cost is the HRM's pass of one
    row (the page pass), a step's the HRM's step at the mean prompt + half the output; ``mean_out`` the expected
    output tokens (default max_new_tokens, the plan's assumption)."""
    G = mean_out or workload.gen_len
    step = hrm.decode_step_time(policy, spec, hw, workload, workload.prompt_len + G / 2)
    return refill_schedule.hrm_min_free(policy.N, hrm.prefill_pass_time(policy, spec, hw, 1, workload.prompt_len),
                                        step, G)


def job_time(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload,
             est: "hrm.Estimate | None" = None) -> tuple[tuple[int, ...], float]:
    """(rows of each prefill pass, seconds of the whole job): the job's refill schedule (:func:`job_schedule`) priced
    by the HRM (:func:`schedule_seconds`): every pass (the first fill, each refill) and every decode step of the N
    slots, the drain included. With every request at max_new_tokens the passes are N, N, ..., P mod N (all slots free
    together); the tail's steps cost a step of N slots. ``est``: unused (kept for callers). Without a request count
    the job is one batch of N."""
    if workload.num_requests is None:
        e = est or hrm.evaluate(policy, spec, hw, workload)
        return (policy.N,), e.total_time
    sched = job_schedule(policy, workload)
    pre, dec = schedule_seconds(sched, policy, spec, hw, workload)
    return tuple(r for r, _ in sched.passes if r), pre + dec


def with_job(est: "hrm.Estimate", rows: tuple[int, ...], seconds: float, min_free: int = 0) -> "hrm.Estimate":
    """``est`` with the job's passes, time and refill threshold (Estimate.job_rows, job_time, refill_min_free)."""
    return replace(est, job_rows=tuple(rows), job_time=seconds, refill_min_free=min_free)


def _most_resident(policy: Policy, spec: MoESpec, workload: Workload):
    """The policy with the most resident experts (spread evenly) that fits its budgets, or None. GPU memory grows
    with the resident count (up to one expert's bytes where a layer's page buffers shrink) and host memory falls, so
    the counts that fit are those between the fewest the host allows and the most the GPU allows (binary searches);
    the result is re-checked with the exact memory model."""
    top = spec.num_moe_layers * spec.num_experts

    def mem(r: int):
        return hrm.memory_estimate(replace(policy, resident_experts=_spread_resident(spec, r)), spec, workload)

    def gpu_ok(r: int) -> bool:
        return not policy.gpu_budget or mem(r).gpu_peak <= policy.gpu_budget

    def cpu_ok(r: int) -> bool:
        return not policy.cpu_budget or mem(r).cpu_peak <= policy.cpu_budget

    if not gpu_ok(0) or not cpu_ok(top):
        return None
    lo, hi = 0, top  # the most the GPU holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if gpu_ok(mid) else (lo, mid - 1)
    most = lo
    lo, hi = 0, top  # the fewest the host allows
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cpu_ok(mid) else (mid + 1, hi)
    if most < lo:
        return None
    fit = replace(policy, resident_experts=_spread_resident(spec, most))
    return None if hrm.memory_violations(fit, spec, workload) else fit


def _shapes(policy: Policy, B: int) -> list[tuple[int, int, int]]:
    """(mu, n, n_gpu_attn) shapes of N >= B rows (N - B < n) to try for a batch of ``B``: the policy's n, n scaled
    to B, the n of the policy's mu, twice the policy's n and 2, 4, 8 micro-batches; each without GPU attention and,
    when the policy has any (GPU attention is allowed for the model), with the policy's share and one more."""
    out = []
    ns = {policy.n, max(1, round(policy.n * B / policy.N)), -(-B // policy.mu), 2 * policy.n, 2, 4, 8}
    for n in sorted(ns):
        n = min(n, B)
        mu = -(-B // n)
        n = -(-B // mu)  # no empty micro-batch
        share = min(n, max(1, round(policy.n_gpu_attn * n / policy.n))) if policy.n_gpu_attn else 0
        for g in sorted({0, share, min(n, share + 1)} if policy.n_gpu_attn else {0}):
            out.append((mu, n, g))  # g > 0: those micro-batches' KV leaves the host
    return list(dict.fromkeys(out))


def fit_job(policy: Policy, est: "hrm.Estimate", spec: MoESpec, hw: HardwareProfile,
            workload: Workload) -> tuple[Policy, "hrm.Estimate"]:
    """The policy re-shaped for the job's request count (module docstring): returns the policy (the MILP's, or an
    even-batch or one-batch shape) whose job time is least, with its estimate carrying ``job_rows`` and ``job_time``.
    Every candidate fits its budgets by hrm's memory model (memory_violations); the MILP's policy is kept on ties."""
    P = workload.num_requests
    if P is None:  # a distribution, not a job: nothing to cut
        return policy, est
    rows, seconds = job_time(policy, spec, hw, workload, est)
    best = (seconds, policy, with_job(est, rows, seconds))
    if P % policy.N == 0 or P < policy.N:  # whole batches only (or one batch of every request)
        return best[1], with_min_free(best[1], best[2], spec, hw, workload)
    k0 = -(-P // policy.N)
    counts = sorted({1, *range(max(1, k0 - MAX_BATCH_COUNTS + 2), k0 + 1)})
    for k in counts:
        B = -(-P // k)
        for mu, n, g in _shapes(policy, B):
            cand = replace(policy, mu=mu, n=n, n_gpu_attn=g,
                           prefill_mu=_prefill_rows(policy, mu, workload))
            fit = _most_resident(cand, spec, workload)
            if fit is None:
                continue
            e = hrm.evaluate(fit, spec, hw, workload)
            r, s = job_time(fit, spec, hw, workload, e)
            if s < best[0] * (1 - 1e-9):
                best = (s, fit, with_job(e, r, s))
    return best[1], with_min_free(best[1], best[2], spec, hw, workload)


def with_min_free(policy: Policy, est: "hrm.Estimate", spec: MoESpec, hw: HardwareProfile,
                  workload: Workload) -> "hrm.Estimate":
    """``est`` with the job's refill threshold (:func:`job_min_free`), which the engine gives the executor."""
    return replace(est, refill_min_free=job_min_free(policy, spec, hw, workload))


def _prefill_rows(policy: Policy, mu: int, workload: Workload) -> int:
    """Prefill micro-batch rows for decode micro-batch ``mu`` at the policy's prefill tokens (:func:`prefill_micro_batch`)."""
    return prefill_micro_batch(mu, workload.prompt_len, policy.prefill_tokens)
