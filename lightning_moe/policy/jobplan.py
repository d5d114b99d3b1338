"""The job, planned: how a job of P requests is cut into batches of the policy's N, what the whole job costs (every
batch, the last one too), and the policy shape that runs it fastest (:func:`fit_job`).

The MILP (milp.py) maximises one batch's throughput N G / T(N). A job of P requests with P not a multiple of N then
ends with a tail batch of P mod N rows that decodes as many steps as a full one (2000 requests at N = 1920: 1920 + 80,
the 80-row batch nearly as long as the 1920-row one, since a PCIe-bound decode step costs the same whatever its rows).
:func:`fit_job` re-shapes the MILP's policy for the job: for every batch count k from 1 to ceil(P / N), the even
batch ceil(P / k) (one batch of P wherever memory allows P), as n' micro-batches of mu' = ceil(B / n') rows, with the
most resident experts that fit, and keeps the shape whose job time (the sum over its batches) is least.

Batches as the runner and executor form them (app.engine._generation_batches, pipeline.attention_placement): the job's
rows cut into consecutive batches of N; a batch of B rows runs as ceil(B / mu) micro-batches of near-equal size, the
first min(n_gpu_attn, that count) of them with GPU attention; every batch decodes max_new_tokens steps (a fixed-length
job; a batch runs until its longest row is done). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.spec import MoESpec
from . import hrm
from .hardware import HardwareProfile
from .policy import DEFAULT_PREFILL_TOKENS, Policy, Workload

MAX_BATCH_COUNTS = 8  # batch counts k fit_job tries below ceil(P / N) (k = 1 and the ones nearest ceil(P / N))


# policy shapes the MILP and the job plan share (milp imports them from here)
def prefill_micro_batch(mu: int, prompt_len: float, prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> int:
    """Prefill micro-batch (rows) for decode micro-batch ``mu``: the largest divisor d of mu with
    d * ceil(prompt_len) <= ``prefill_tokens`` (>= 1), ``prompt_len`` the MEAN prompt length.

    A divisor, so N = mu * n splits into whole prefill micro-batches. The executor also caps each prefill
    micro-batch at ``Policy.prefill_tokens`` padded tokens (rows x longest row, length-sorted rows), so a
    micro-batch of the longest prompts is split further and the workspace bound holds for any length mix;
    sizing the row count by the mean keeps the typical micro-batch near PREFILL_TOKENS tokens (with the
    max, one 425-token outlier of MT-Bench made every prefill micro-batch 8 rows, ~900 tokens).
    """
    s = max(1, int(-(-prompt_len // 1)))
    best = 1
    for d in range(1, mu + 1):
        if mu % d == 0 and d * s <= prefill_tokens:
            best = d
    return best


def _spread_resident(spec: MoESpec, total: int) -> tuple[int, ...]:
    """``total`` resident experts spread evenly over the MoE layers (the first MoE layers get the extra; dense layers
    none): the per-layer counts of :func:`policy_from_decisions`."""
    L_moe, E = spec.num_moe_layers, spec.num_experts
    r, x = divmod(total, L_moe)
    if r > E or (r == E and x):
        raise ValueError(f"{total} resident experts exceed {L_moe} x {E}")
    rank = {layer: j for j, layer in enumerate(spec.moe_layers)}  # MoE layer -> its rank among the MoE layers
    return tuple(r + (1 if rank[i] < x else 0) if i in rank else 0 for i in range(spec.num_layers))


def batch_rows(num_requests: int, N: int) -> tuple[int, ...]:
    """Rows of each batch of a job of ``num_requests`` rows cut into consecutive batches of ``N`` (the last shorter)."""
    if num_requests < 1 or N < 1:
        raise ValueError(f"batch_rows: need num_requests >= 1 and N >= 1, got {num_requests}, {N}")
    full, rest = divmod(num_requests, N)
    return (N,) * full + ((rest,) if rest else ())


def batch_policy(policy: Policy, rows: int) -> Policy:
    """The shape a batch of ``rows`` (<= policy.N) runs with: ceil(rows / mu) micro-batches of ceil(rows / that)
    rows, the first min(n_gpu_attn, that) with GPU attention (attention_placement.micro_batches)."""
    if rows >= policy.N:
        return policy
    n = -(-rows // policy.mu)
    return replace(policy, mu=-(-rows // n), n=n, n_gpu_attn=min(policy.n_gpu_attn, n))


def job_time(policy: Policy, spec: MoESpec, hw: HardwareProfile, workload: Workload,
             est: "hrm.Estimate | None" = None) -> tuple[tuple[int, ...], float]:
    """(rows of each batch, seconds of the whole job): the sum over the job's batches of each batch's prefill and
    decode time (hrm.evaluate of :func:`batch_policy`); ``est``: the full batch's estimate when known. Without a
    request count the job is one batch of N."""
    if workload.num_requests is None:
        e = est or hrm.evaluate(policy, spec, hw, workload)
        return (policy.N,), e.total_time
    rows = batch_rows(workload.num_requests, policy.N)
    seconds, cache = 0.0, {}
    for r in rows:
        if r not in cache:
            p = batch_policy(policy, r)
            cache[r] = (est if (est is not None and p == policy) else hrm.evaluate(p, spec, hw, workload)).total_time
        seconds += cache[r]
    return rows, seconds


def with_job(est: "hrm.Estimate", rows: tuple[int, ...], seconds: float) -> "hrm.Estimate":
    """``est`` with the job's batches and time (Estimate.job_rows, job_time)."""
    return replace(est, job_rows=tuple(rows), job_time=seconds)


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
        return best[1], best[2]
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
    return best[1], best[2]


def _prefill_rows(policy: Policy, mu: int, workload: Workload) -> int:
    """Prefill micro-batch rows for decode micro-batch ``mu`` at the policy's prefill tokens (:func:`prefill_micro_batch`)."""
    return prefill_micro_batch(mu, workload.prompt_len, policy.prefill_tokens)
