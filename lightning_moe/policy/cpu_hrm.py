"""The CPU executor's roofline: a job that runs everything on the CPU (``device: cpu``), serial or cgopipe.

Every term is a measured peak rate of the host (:class:`CpuProfile`, measured by ``pipeline.cpu_profile``) times a
count taken from the model's shapes and the executor's op structure; nothing is fitted to a job's run.

Per layer visit of one (micro-)batch of T rows (decode: T rows, one token each; prefill: T packed tokens of R rows
padded to S):

  (C1) t_ops   = n_gemm c_gemm + n_op c_op + n_view c_view + n_attn c_attn: the per-call host cost of the torch ops the executor issues (Python + dispatcher +
                 the GEMM library's thread fork/join); the counts below are the executor's own, counted with a torch
                 dispatch counter (tests/test_cpu_hrm.py checks them against the executors on tiny-mixtral);
                 a = E (1 - (1 - k/E)^T) routed experts receive tokens, each a loop iteration of the torch expert FFN;
                 + (n_gemm + n_op) c_glue: the executor's own Python code around each op it issues (measured on a
                 probe model's decode step, pipeline.cpu_profile.glue_call)
  (C2) t_flops = the layer's FLOPs / P_gemm (P_gemm: the measured fp32/bf16 matmul FLOP/s): q/k/v/o, router,
                 a experts' gate/up/down over their T k rows, shared / dense FFN, attention (decode: T c attended
                 positions; prefill: the padded R S^2 layout the packed SDPA computes, at the larger of its FLOPs /
                 P_gemm and its R Hq S^2 scores / the measured SDPA score rate)
  (C3) t_bytes = the bytes the GEMMs and attention read / B_mem (B_mem: the measured copy bandwidth, read + write):
                 weights read once (attention, router, the a experts hit), the KV read by decode attention
  (C3') t_stream = the element-wise ops' own traffic / B_mem: each one's read + write of one [T, D] row block (and
                 cgopipe's prefill KV scatter / the measured scatter bandwidth); those ops run alone between the
                 GEMMs (a CPU op runs to completion before the next is issued), so no FLOPs hide them
  (C4) layer visit = t_ops + max(t_flops, t_bytes) + t_stream: the fixed call costs are paid in series with the op
                 bodies (a small kernel does not start before its call is issued); a GEMM's body is bound by compute
                 or by the memory it reads; the element-wise bodies are bound by their traffic
  (C5) head per (micro-)batch and step: the lm_head over its rows ((C2)/(C3) with V x D weights; its FLOPs at the
       measured lm_head-shaped GEMM rate of its row count) + its ops + the
                 draw over V per row (greedy's argmax at the measured argmax rate; a sampled job's sampler at the
                 measured sample rate); (C1) also holds each routed expert's token
                 gather (a nonzero: ``nonzero_call``) and one durable result-record write per sequence (``record_write``)
  (C6) decode step: sum over micro-batches and layers of (C4) + (C5); prefill: per prefill chunk the same;
       the batches are the job's: its prompts sorted by length (engine.work_order), cut into batches of
       ``batch_size`` (serial), each batch decoding max_new_tokens - 1 steps; cgopipe refills: the policy's N slots
       decode every step of the refill schedule (policy.refill_schedule.simulate, every request at max_new_tokens),
       each pass prefilled in chunks of at most prefill_mu rows and prefill_tokens padded tokens
  (C7) throughput as hrm (H9): prefill prompt tokens / T_prefill, decode tokens / T_decode, generated / total

The binding stage of a phase is the largest of its summed terms: ``cpu-ops`` (C1), ``cpu-flops`` (C2),
``cpu-memory`` (C3) or ``cpu-stream`` (C3'). For the embedded tiny model (D 64, 8 experts of F 128) every kernel is tiny, so ``cpu-ops`` binds
both phases: a decode step of 16 rows issues ~950 torch ops for ~30 MFLOP of work.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Optional, Sequence

from ..model.spec import MoESpec, dtype_bytes
from . import refill_schedule
from .batching import KV_GROUPS, group_by_length
from .hardware import HardwareError
from .yaml_io import YamlRecord

CPU_STAGES = ("cpu-ops", "cpu-flops", "cpu-memory", "cpu-stream")  # the terms (C1)-(C3') a phase's binding stage
#   names

# Torch ops per layer visit of one (micro-)batch, by executor and phase, counted with a dispatch counter
# (tests/test_cpu_hrm.py::test_op_counts_match_executor). "fixed": per layer visit; "expert": per routed expert that
# receives tokens (its loop iteration: eq, where, div, gather, gate/up/down, silu, mul, weight gather, mul, scatter);
# "row": per prefill row (the KV cache writes); "group": per extra KV length group of a prefill chunk; "head": per (micro-)batch and step outside the layers (embedding,
# final norm, lm_head, argmax, lengths).
OP_COUNTS = {  # (executor, phase) -> {class -> {"fixed", "expert", "row", "group", "head"}}
    ("serial", "decode"): {"op": dict(fixed=46.5, expert=9, row=0, group=0, head=20),
                           "view": dict(fixed=55, expert=3, row=0, group=0, head=10)},
    ("serial", "prefill"): {"op": dict(fixed=56.5, expert=9, row=2.25, group=0, head=20),
                            "view": dict(fixed=59, expert=3, row=11, group=0, head=10)},
    ("cgopipe", "decode"): {"op": dict(fixed=32, expert=9, row=0, group=0, head=20),
                            "view": dict(fixed=38.5, expert=4, row=0, group=0, head=10)},
    ("cgopipe", "prefill"): {"op": dict(fixed=57, expert=9, row=0.5, group=2.5, head=20),
                             "view": dict(fixed=52, expert=4, row=0.5, group=6.5, head=10)},
}  # "group": per KV length group of the chunk's rows beyond the first (the grouped cache's per-group work; its
#   prefill KV write is one row scatter per K and V over all groups since session 42: counted again then)
EXPERT_GEMMS = 3  # gate, up, down per routed expert hit (the torch expert FFN's loop)
HEAD_ROWS = (16, 64, 256)  # rows of the profile's lm_head-shaped GEMMs: a head of <= 16 rows goes at the first's
#   rate, of <= 64 at the second's, a larger one at the third's (pipeline.cpu_profile.HEAD_ROWS measures them)


@dataclass(frozen=True)
class CpuProfile(YamlRecord):
    """One CPU-only host's measured rates for the CPU executor's roofline (units: s, FLOP/s, bytes/s, bytes).

    Measured by ``pipeline.cpu_profile.measure_cpu_profile`` (``moe-batch profile --cpu``, or at first use by a CPU
    job, cached per machine under the package cache directory); unknown keys and wrong types are errors on load."""

    name: str  # profile name ("cpu")
    machine: str  # cache key: CPU model, logical CPUs, torch threads, torch version
    cpu_model: str  # CPU model name
    cpu_cores: int  # logical CPUs the process sees
    threads: int  # torch intra-op threads the rates were measured with
    torch_version: str  # torch version the rates were measured with
    host_memory: int  # bytes of host DRAM
    memory_bandwidth: float  # bytes/s host memory copy bandwidth (bytes read + written / time)
    matmul_flops_fp32: float  # FLOP/s of an fp32 matmul large enough to reach the peak
    matmul_flops_bf16: float  # FLOP/s of a bf16 matmul (0 = not measured: fp32's)
    gemm_call: float  # seconds per small F.linear call (dispatch + the GEMM library's thread fork/join)
    op_call: float  # seconds per small non-GEMM torch op, over the mix a layer issues (norm, SiLU, softmax, top-k,
    #   gather / scatter; dispatch + allocation)
    view_call: float  # seconds per view / metadata op (select, view, unsqueeze)
    attention_call: float  # seconds per CPU decode-attention call at a tiny shape (the native kernel's fixed cost)
    glue_call: float  # seconds the executor's own Python code adds per GEMM or other op it issues, beyond gemm_call /
    #   op_call (frames, argument handling, the expert loop's bookkeeping, cold caches over a long varied op stream):
    #   the serial executor's best decode step on a probe model (pipeline.cpu_profile.PROBE_CONFIG), less its counted
    #   ops at the costs above, per GEMM + op
    nonzero_call: float  # seconds per ``torch.where(mask)`` (nonzero) on a small mask: the expert loop's token gather
    argmax_rate: float  # elements/s of an argmax over fp32 logits rows (greedy sampling over the vocabulary)
    record_write: float  # seconds to append one result record with fsync (the results file, once per sequence)
    scatter_bandwidth: float  # bytes/s written by cgopipe's grouped prefill KV write (kv_cache.scatter_prefill: the
    #   native row scatter into a CPU cache where the kernel is available), per byte of the values written
    sdpa_rate: float = 0.0  # (query, key, head) scores/s of the CPU SDPA with a boolean mask at a small head dim (the
    #   prefill's padded attention: its masked softmax per score, not its FLOPs, binds at small heads; 0 = unmeasured)
    head_matmul_flops: float = 0.0  # FLOP/s of an lm_head-shaped fp32 GEMM (64 rows x 64 -> 32768: a short
    #   reduction into a vocabulary-wide output beyond the L2), timed cold (the calls rotate over 64 MiB of weight
    #   copies: a step's layers run between two heads, so its weight comes from memory); 0 = unmeasured: the matmul peak's
    sample_rate: float = 0.0  # elements/s of the sampler over fp32 logits rows (kernels.sampling.sample_tokens at
    #   temperature 1, no filter: the hashed race over V per row), a sampled job's draw (0 = unmeasured: argmax_rate)
    head_matmul_flops_many: float = 0.0  # the same GEMM over 256 rows (the BLAS changes its blocking above 64 rows:
    #   ~0.6x the 64 rows' rate cold on the development VM), the rate of a head over more than 64 rows (0 = the 64 rows')
    head_matmul_flops_few: float = 0.0  # the same GEMM over 16 rows (a serial decode batch's head: ~0.55x the
    #   64 rows' rate cold on the development VM), the rate of a head of at most 16 rows (0 = the 64 rows')
    load_average: float = 0.0  # the host's 1-minute load average as the measurement started (half the CPUs or more:
    #   other processes shared the cores, the rates understate the machine; a note says so when it is measured)
    source: str = ""  # how it was measured
    date: str = ""  # ISO date of the measurement

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "float") and (isinstance(v, bool) or not isinstance(v, (int, float))
                                               or not math.isfinite(v) or v < 0):
                raise HardwareError(f"{self.name}: {f.name}: expected a non-negative number, got {v!r}")
        for key in ("memory_bandwidth", "matmul_flops_fp32"):
            if getattr(self, key) <= 0:
                raise HardwareError(f"{self.name}: {key}: must be > 0, got {getattr(self, key)!r}")

    def matmul_flops(self, dtype: str) -> float:
        """Measured matmul FLOP/s for a dtype ("fp32"/"float32", "bf16"/"bfloat16", fp16: bf16's); fp32's when
        the other is unmeasured."""
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16", "fp16": "bf16"}.get(dtype, dtype)
        return self.matmul_flops_bf16 if key == "bf16" and self.matmul_flops_bf16 > 0 else self.matmul_flops_fp32

    ERROR, WHAT = HardwareError, "CPU profile fields"  # for YamlRecord (not fields: no annotation)

    def to_dict(self) -> dict:
        """Plain dict in field order (what :meth:`save` writes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "<dict>") -> "CpuProfile":
        """Build from a mapping; unknown or missing keys and wrong types raise HardwareError naming ``where``."""
        known = cls._known_fields(d, where)
        kw: dict = {}
        for name, f in known.items():
            if name not in d:
                if f.default is MISSING:
                    raise HardwareError(f"{where}: {name}: missing")
                continue
            v = d[name]
            want = {"str": str, "int": int, "float": (int, float)}[f.type]
            if isinstance(v, bool) or not isinstance(v, want):
                raise HardwareError(f"{where}: {name}: expected {f.type}, got {v!r}")
            kw[name] = float(v) if f.type == "float" else v
        return cls._build(kw, where)


def is_cpu_profile_dict(d: Any) -> bool:
    """Whether a profile YAML's mapping is a CPU profile (it has the CPU executor's keys, no GPU's)."""
    return isinstance(d, dict) and "gemm_call" in d and "gpu_memory" not in d


# ---- one layer visit ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Terms:
    """Seconds of (C1)-(C3) summed over some layer visits."""

    ops: float = 0.0  # (C1) per-call host cost
    flops: float = 0.0  # (C2) FLOPs / P_gemm
    bytes: float = 0.0  # (C3) bytes the GEMMs and attention read (weights, KV) / B_mem: hidden under their FLOPs
    stream: float = 0.0  # (C3') the element-wise ops' own traffic (a [T, D] read and write each, cgopipe's KV
    #   scatter) / B_mem: those ops run alone, between the GEMMs, so nothing hides it

    @property
    def time(self) -> float:
        """(C4) ops + max(flops, bytes) + stream."""
        return self.ops + max(self.flops, self.bytes) + self.stream

    def __add__(self, o: "Terms") -> "Terms":
        return Terms(self.ops + o.ops, self.flops + o.flops, self.bytes + o.bytes, self.stream + o.stream)

    def scaled(self, w: float) -> "Terms":
        """These terms ``w`` times."""
        return Terms(self.ops * w, self.flops * w, self.bytes * w, self.stream * w)


def active_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens under uniform top-k routing: E (1 - (1 - k/E)^T)."""
    return 0.0 if tokens <= 0 else num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def op_counts(executor: str, phase: str, experts: float, rows: float, groups: float = 1.0) -> dict:
    """Non-GEMM ops and view ops of one layer visit (OP_COUNTS): {"op": n, "view": n}."""
    return {k: v["fixed"] + v["expert"] * experts + v["row"] * rows + v["group"] * max(0.0, groups - 1)
            for k, v in OP_COUNTS[(executor, phase)].items()}


def stream_blocks(executor: str, phase: str, tokens: float, top_k: int, groups: float = 1.0) -> float:
    """(C3') rows of width D the element-wise ops of one layer visit of ``tokens`` rows touch: a "fixed" op all
    ``tokens``, a routed expert's ops its own rows (over the experts hit: tokens x top_k), a prefill row's ops that
    row's tokens (over the rows: tokens), a KV length group's ops its rows (over the groups: tokens)."""
    c = OP_COUNTS[(executor, phase)]["op"]
    return tokens * (c["fixed"] + c["expert"] * top_k + c["row"] + c["group"] * (1.0 if groups > 1 else 0.0))


def _ops_time(prof: CpuProfile, executor: str, phase: str, gemms: float, experts: float, rows: float,
              attn_calls: float, head: bool = False, groups: float = 1.0) -> float:
    """(C1) for the counted ops of one layer visit (``head``: of the head instead)."""
    n = ({k: v["head"] for k, v in OP_COUNTS[(executor, phase)].items()} if head
         else op_counts(executor, phase, experts, rows, groups))
    t = gemms * prof.gemm_call + n["op"] * prof.op_call + n["view"] * prof.view_call + attn_calls * prof.attention_call
    t += (gemms + n["op"]) * prof.glue_call  # (C1') the executor's Python code around each op it issues
    return t  # (cgopipe on the CPU attends inline: no hand-off to a worker thread)


def layer_terms(spec: MoESpec, prof: CpuProfile, layer: int, tokens: float, dtype: str, executor: str, phase: str,
                rows: float = 0.0, padded_len: float = 0.0, context: float = 0.0, attn_calls: float = 1.0,
                groups: float = 1.0) -> Terms:
    """(C1)-(C3) of one layer visit of ``tokens`` rows (decode: one token per row at ``context`` attended positions;
    prefill: ``rows`` prompts padded to ``padded_len``, their KV in ``groups`` length groups)."""
    b = dtype_bytes(dtype)
    P, B = prof.matmul_flops(dtype), prof.memory_bandwidth
    D, k = spec.hidden_size, spec.top_k
    dense = spec.is_dense_layer(layer)
    attn_w = spec.attn_in_params + spec.attn_out_params
    flops = 2 * tokens * attn_w
    wbytes = attn_w * b
    gemms = 4.0  # q, k, v, o (GQA; MLA's projections are counted the same: an approximation)
    a = 0.0
    if dense:
        flops += 2 * tokens * spec.dense_ffn_params
        wbytes += spec.dense_ffn_params * b
        gemms += 3
    else:
        a = active_experts(tokens, spec.num_experts, k)
        flops += 2 * tokens * spec.num_experts * D + 2 * tokens * k * spec.expert_params
        wbytes += spec.num_experts * D * b + a * spec.expert_params * b
        gemms += 1 + EXPERT_GEMMS * a
        if spec.shared_expert_params:
            flops += 2 * tokens * spec.shared_expert_params
            wbytes += spec.shared_expert_params * b
            gemms += 3
    scatter = 0.0
    if phase == "decode":
        flops += tokens * context * spec.attn_flops_per_position
        kv_bytes = tokens * context * spec.kv_elems_per_token * b
    else:  # (C2') the padded R x S^2 attention: its FLOPs or its masked-softmax scores at sdpa_rate, the larger
        pairs = rows * padded_len * padded_len  # the padded squares (sdpa_rate counts them so)
        causal = rows * padded_len * (padded_len + 1) / 2  # the pairs j <= i its causal kernel computes
        attn_s = max(causal * spec.prefill_attn_flops_per_position / P,
                     pairs * spec.num_heads / prof.sdpa_rate if prof.sdpa_rate > 0 else 0.0)
        flops += attn_s * P
        kv_bytes = tokens * spec.kv_elems_per_token * b  # the prompt KV written to the cache
        if executor == "cgopipe" and prof.scatter_bandwidth > 0:  # written by a row scatter, at its measured rate
            scatter = kv_bytes / prof.scatter_bandwidth
            kv_bytes = 0.0
    act_bytes = stream_blocks(executor, phase, tokens, k, groups) * 2 * D * b  # each op reads and writes its rows
    ops = _ops_time(prof, executor, phase, gemms, a, rows, attn_calls, groups=groups)
    ops += a * max(0.0, prof.nonzero_call - prof.op_call)  # each expert's token gather is a nonzero, not a small op
    return Terms(ops=ops, flops=flops / P, bytes=(wbytes + kv_bytes) / B, stream=act_bytes / B + scatter)


def head_terms(spec: MoESpec, prof: CpuProfile, rows: float, dtype: str, executor: str, phase: str,
               sampling: bool = False) -> Terms:
    """(C5) the head of one (micro-)batch: final norm and lm_head over ``rows`` rows, embedding, sampling (greedy's
    argmax, or with ``sampling`` the sampler's race over V per row at the profile's ``sample_rate``)."""
    b = dtype_bytes(dtype)
    D, V = spec.hidden_size, spec.vocab_size
    ops = _ops_time(prof, executor, phase, 1, 0, 0, 0, head=True)
    rate = prof.sample_rate if sampling and prof.sample_rate > 0 else prof.argmax_rate
    ops += rows * V / rate if rate > 0 else 0.0  # the draw: an argmax (greedy) or the sampler over V per row
    P = prof.matmul_flops(dtype)
    head = prof.head_matmul_flops
    if rows > HEAD_ROWS[1] and prof.head_matmul_flops_many > 0:
        head = prof.head_matmul_flops_many
    elif rows <= HEAD_ROWS[0] and prof.head_matmul_flops_few > 0:
        head = prof.head_matmul_flops_few
    if head > 0:  # the lm_head's shape class runs at its own rate, measured at the HEAD_ROWS class of its rows
        P = min(P, head)
    return Terms(ops=ops, flops=2 * rows * D * V / P,
                 bytes=(V * D * b + rows * V * 4 * 2) / prof.memory_bandwidth)


def _sum_layers(spec: MoESpec, prof: CpuProfile, **kw) -> Terms:
    """:func:`layer_terms` summed over the model's layers."""
    out = Terms()
    for layer in range(spec.num_layers):
        out = out + layer_terms(spec, prof, layer, **kw)
    return out


# ---- a job -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuEstimate:
    """Predicted times (s) and throughputs (tokens/s) of a whole CPU job (C6, C7); the fields the run report and
    ``moe-batch plan`` read, as :class:`hrm.Estimate` has them."""

    N: int  # sequences per batch (serial: batch_size; cgopipe: the policy's N)
    prompt_tokens: int  # prompt tokens of the job
    generated_tokens: int  # tokens the job generates (max_new_tokens per sequence)
    decode_tokens: int  # tokens generated by decode steps (the first of each sequence comes from prefill)
    prefill_time: float  # seconds
    decode_time: float  # seconds
    prefill_stages: dict  # CPU_STAGES -> seconds summed over the phase (ops, flops, bytes, stream)
    decode_stages: dict  # the same for decode
    prefill_binding: str  # the largest of prefill_stages
    decode_binding: str  # the largest of decode_stages ("-" without decode)
    profile: str  # the CPU profile's name and machine
    memory: Any = None  # hrm.MemoryEstimate of a cgopipe policy (None for serial)
    notes: tuple = ()  # lines on what the estimate stands on

    @property
    def total_time(self) -> float:
        """prefill + decode seconds."""
        return self.prefill_time + self.decode_time

    @property
    def prefill_tok_s(self) -> float:
        """prompt tokens / s during prefill."""
        return self.prompt_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """decode-step tokens / s."""
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def e2e_tok_s(self) -> float:
        """generated tokens / (prefill + decode seconds)."""
        return self.generated_tokens / self.total_time if self.total_time > 0 else 0.0


def job_lengths(workload) -> list:
    """The job's prompt lengths, sorted as the engine takes them (engine.work_order): the workload's, else
    ``num_requests`` (default 1) prompts of the mean length."""
    if workload.prompt_lens is not None:
        return sorted(workload.prompt_lens)
    return [max(1, round(workload.prompt_len))] * (workload.num_requests or 1)


def prefill_chunks(lens: Sequence[int], rows: int, tokens: int) -> list:
    """cgopipe's prefill chunks of one micro-batch (its lengths in row order): at most ``rows`` rows and ``tokens``
    padded tokens, a longer prompt alone (CGOPipeExecutor._prefill_chunks)."""
    out, cur, longest = [], [], 0
    for n in lens:
        if cur and (len(cur) + 1 > rows or (len(cur) + 1) * max(longest, n) > tokens):
            out.append(cur)
            cur, longest = [], 0
        cur.append(n)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


def _batch_terms(spec, prof, lens, dtype, executor, gen_len, mu, prefill_mu, prefill_tokens, sampling=False) -> tuple:
    """(prefill Terms, decode Terms) of one batch of prompts ``lens`` (sorted)."""
    if executor == "serial":
        groups, chunks = [list(lens)], [[list(lens)]]
    else:
        groups = [[lens[i] for i in g] for g in group_by_length(lens, mu, -(-len(lens) // mu)) if g]
        chunks = [prefill_chunks(g, prefill_mu, prefill_tokens) for g in groups]
    pre = Terms()
    for ch in (c for cs in chunks for c in cs):
        pre = pre + _sum_layers(spec, prof, tokens=sum(ch), dtype=dtype, executor=executor, phase="prefill",
                                rows=len(ch), padded_len=max(ch), groups=min(KV_GROUPS, len(set(ch))))
        pre = pre + head_terms(spec, prof, len(ch), dtype, executor, "prefill", sampling)
    dec = Terms()
    for g in groups:
        mean = sum(g) / len(g)
        for j in range(1, gen_len):
            dec = dec + _sum_layers(spec, prof, tokens=len(g), dtype=dtype, executor=executor, phase="decode",
                                    context=mean + j)
            dec = dec + head_terms(spec, prof, len(g), dtype, executor, "decode", sampling)
    return pre, dec


def _cgopipe_terms(spec, prof, lens, dtype, gen_len, N, mu, prefill_mu, prefill_tokens, sampling=False) -> tuple:
    """(prefill Terms, decode Terms) of a cgopipe job with continuous refill (pipeline/refill.py): min(N, P) slots in
    micro-batches of ``mu`` decode every step (a free slot decodes a throwaway token: the shapes stay fixed), the
    passes and steps those of :func:`refill_schedule.simulate` with every request at max_new_tokens (the executor's
    default threshold); each pass's requests (the next in the engine's order) prefilled in chunks. A step's terms are
    linear in the positions its rows attend, so the steps are summed at 0 positions plus their attended total."""
    S = min(N, len(lens))
    sched = refill_schedule.simulate([n + gen_len for n in lens], list(lens), [gen_len] * len(lens), S,
                                     refill_schedule.default_min_free(S))
    pre, i = Terms(), 0
    for rows, _ in sched.passes:
        for ch in prefill_chunks(lens[i:i + rows], prefill_mu, prefill_tokens):
            pre = pre + _sum_layers(spec, prof, tokens=sum(ch), dtype=dtype, executor="cgopipe", phase="prefill",
                                    rows=len(ch), padded_len=max(ch), groups=min(KV_GROUPS, len(set(ch))))
            pre = pre + head_terms(spec, prof, len(ch), dtype, "cgopipe", "prefill", sampling)
        i += rows
    sizes = [len(g) for g in group_by_length([1] * S, mu, -(-S // mu)) if g]  # the slots' micro-batches
    step0 = Terms()
    for m in sizes:
        step0 = step0 + _sum_layers(spec, prof, tokens=m, dtype=dtype, executor="cgopipe", phase="decode", context=0.0)
        step0 = step0 + head_terms(spec, prof, m, dtype, "cgopipe", "decode", sampling)
    one = [_sum_layers(spec, prof, tokens=1, dtype=dtype, executor="cgopipe", phase="decode", context=c) for c in (0, 1)]
    per_pos = Terms(ops=0.0, flops=one[1].flops - one[0].flops, bytes=one[1].bytes - one[0].bytes)  # a row's position
    attended = sum(pos for _, pos in sched.steps)  # positions attended by the live rows over the job
    return pre, step0.scaled(sched.decode_steps) + per_pos.scaled(attended)


def _stages(t: Terms) -> dict:
    return dict(zip(CPU_STAGES, (t.ops, t.flops, t.bytes, t.stream)))


def estimate_cpu(spec: MoESpec, prof: CpuProfile, workload, dtype: str, executor: str, batch_size: int,
                 mu: Optional[int] = None, prefill_mu: Optional[int] = None, prefill_tokens: int = 1 << 62) -> CpuEstimate:
    """(C1)-(C7) of a generation job on the CPU: ``executor`` "serial" (batches of ``batch_size``) or "cgopipe"
    (``batch_size`` = the policy's N slots refilled as rows finish (:func:`_cgopipe_terms`), micro-batches of ``mu``
    rows, prefill chunks of ``prefill_mu`` rows and ``prefill_tokens`` padded tokens)."""
    if executor not in ("serial", "cgopipe"):
        raise ValueError(f"estimate_cpu: executor must be serial or cgopipe, got {executor!r}")
    lens = job_lengths(workload)
    G = workload.gen_len
    mu = mu or batch_size
    pre, dec = Terms(), Terms(ops=len(lens) * prof.record_write)  # each sequence's record is written (fsync) as it
    #   finishes, during decode
    if executor == "cgopipe" and G > 1:  # one refilling call over every request (app.engine)
        p, d = _cgopipe_terms(spec, prof, lens, dtype, G, batch_size, mu, prefill_mu or mu, prefill_tokens,
                              workload.sampling)
        pre, dec = pre + p, dec + d
    else:
        for i in range(0, len(lens), batch_size):
            p, d = _batch_terms(spec, prof, lens[i:i + batch_size], dtype, executor, G, mu, prefill_mu or mu,
                                prefill_tokens, workload.sampling)
            pre, dec = pre + p, dec + d
    ps, ds = _stages(pre), _stages(dec)
    return CpuEstimate(
        N=min(batch_size, len(lens)), prompt_tokens=sum(lens), generated_tokens=len(lens) * G,
        decode_tokens=len(lens) * (G - 1), prefill_time=pre.time, decode_time=dec.time, prefill_stages=ps,
        decode_stages=ds, prefill_binding=max(ps, key=ps.__getitem__),
        decode_binding=max(ds, key=ds.__getitem__) if G > 1 else "-", profile=f"{prof.name} ({prof.machine})")


def plan_cpu(spec: MoESpec, prof: CpuProfile, workload, dtype: str, host_memory: int, weight_quant: Optional[str] = None,
             candidates: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)):
    """The cgopipe policy for a CPU job: micro-batch rows mu and count n (N = mu n, no more than the job's prompts)
    with the best predicted end-to-end tokens/s (:func:`estimate_cpu`) whose memory (hrm.memory_estimate: its GPU
    parts live in host memory on the CPU, plus its host parts) fits ``host_memory``. All experts resident, every
    micro-batch's attention on the CPU. Returns (Policy, CpuEstimate with its memory). Raises PlanInfeasible."""
    from .hrm import memory_estimate
    from .policy import PlanInfeasible, Policy

    lens = job_lengths(workload)
    wq = weight_quant or dtype
    best = None
    for mu in sorted({m for m in candidates if m <= len(lens)} | {len(lens)}):
        for n in (1, 2, 4, 8):
            N = mu * n
            if N > len(lens) and n > 1:
                break
            pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=spec.num_experts, n_gpu_attn=0,
                         weight_quant=wq, dtype=dtype)
            mem = memory_estimate(pol, spec, workload)
            if mem.gpu_peak + mem.cpu_peak > host_memory:
                continue
            est = estimate_cpu(spec, prof, workload, dtype, "cgopipe", N, mu, mu, pol.prefill_tokens)
            if best is None or est.e2e_tok_s > best[1].e2e_tok_s:
                best = (pol, est, mem)
    if best is None:
        raise PlanInfeasible(f"infeasible: no cgopipe policy of {spec.name} fits {host_memory / 2**30:.1f} GiB of host "
                             f"memory on the CPU")
    pol, est, mem = best
    from dataclasses import replace

    return pol, replace(est, memory=mem)


def format_cpu_table(spec: MoESpec, prof: CpuProfile, est: CpuEstimate, executor: str, policy=None) -> str:
    """A CPU job's plan as text: the profile's rates, the batch shape, each phase's (C1)-(C3) sums with the binding
    one marked, and the predicted tokens/s."""
    lines = [f"model     {spec.name}: {spec.num_layers} layers, {spec.num_experts} experts (top-{spec.top_k})",
             f"hardware  CPU profile {prof.name} ({prof.machine}): matmul {prof.matmul_flops_fp32 / 1e9:.1f} GFLOP/s "
             f"fp32, memory {prof.memory_bandwidth / 1e9:.1f} GB/s, per call: GEMM {prof.gemm_call * 1e6:.1f} us, "
             f"op {prof.op_call * 1e6:.2f} us, view {prof.view_call * 1e6:.2f} us, attention "
             f"{prof.attention_call * 1e6:.1f} us",
             f"workload  {est.prompt_tokens} prompt tokens, {est.generated_tokens} generated", "",
             f"executor  {executor} on the CPU, " + (f"batches of {est.N}" if policy is None else
                                                     f"mu {policy.mu} x n {policy.n} (N {policy.N}), prefill chunks of "
                                                     f"<= {policy.prefill_mu} rows, <= {policy.prefill_tokens} padded "
                                                     "tokens, all experts resident, attention on the CPU")]
    for phase, stages, bind, t in (("prefill", est.prefill_stages, est.prefill_binding, est.prefill_time),
                                   ("decode", est.decode_stages, est.decode_binding, est.decode_time)):
        parts = ", ".join(f"{k} {v:.3f}" + (" *" if k == bind else "") for k, v in stages.items())
        lines.append(f"  {phase:8s} {t:.3f} s = ops + max(flops, memory) + stream: {parts}")
    lines += ["", f"predicted tokens/s: prefill {est.prefill_tok_s:,.1f}, decode {est.decode_tok_s:,.1f}, "
              f"end-to-end {est.e2e_tok_s:,.1f}; binding: prefill {est.prefill_binding}, decode {est.decode_binding}"]
    return "\n".join(lines)
