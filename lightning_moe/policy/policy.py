"""Policy (what the planner decides), Workload and Budgets (what it is given), and the table it prints.

A policy runs a batch of N = mu * n sequences as n micro-batches of mu (CGOPipe, MoE-Lightning Sec. 4.1):
``n_gpu_attn`` of them keep their KV cache on the GPU and run attention there, the others keep it in
host memory and run decode attention on the CPU; ``resident_experts`` stay on the GPU, every other
expert is paged from pinned host memory layer by layer through two GPU page buffers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union


from .yaml_io import YamlRecord

from ..model.spec import DTYPE_BYTES, PACKED_FORMATS, QUANT_FORMATS, MoESpec
from .hardware import GiB, HardwareProfile, format_bytes, host_probe_line, parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .hrm import Estimate

DEFAULT_GPU_RESERVE = 1 * GiB  # bytes: CUDA context, cuBLAS/Triton workspaces, caching-allocator fragmentation
LIBRARY_WORKSPACE = 64 * 2**20  # bytes: cuBLAS / cuBLASLt workspaces the GEMMs allocate once (inside the allocator reserve)
DEFAULT_PREFILL_TOKENS = 4096  # padded prompt tokens per prefill micro-batch (bounds its GPU workspace)
DEFAULT_CPU_RESERVE = 2 * GiB  # bytes: Python/torch process, tokenizer, load-time temporaries


class PlanInfeasible(ValueError):
    """No policy fits the budgets. ``str(e)`` is one line naming what does not fit and by how much."""


class PolicyError(ValueError):
    """A policy YAML or Policy value that is malformed (the message names the file and key)."""


@dataclass(frozen=True)
class Workload:
    """What a batch job asks for, in tokens (the planner's view of the prompts).

    Build it from real tokenized prompts with :meth:`from_lengths` (``app.plan.job_workload`` does that); then
    ``prompt_lens`` holds every prompt length and the KV cache is sized as the executor's grouped caches
    allocate it (:meth:`kv_positions`), not for the longest prompt.
    """

    prompt_len: float  # mean prompt length in tokens (prefill and attention cost use it)
    gen_len: int  # tokens generated per sequence (max_new_tokens)
    max_prompt_len: Optional[int] = None  # longest prompt in tokens (sizes the KV cache); None = ceil(prompt_len)
    num_requests: Optional[int] = None  # sequences in the job; caps N = mu * n (None = no cap)
    name: str = ""  # label for tables ("mtbench", "synthetic 77/128")
    prompt_lens: Optional[tuple[int, ...]] = None  # every tokenized prompt length of the job (None: unknown)
    scoring: bool = False  # prefill-only scoring (no KV cache, no decode; gen_len is 1): the sequences are scored texts
    sampling: bool = False  # sampled decoding (temperature > 0): the sampler's temporaries count in the GPU decode
    #   workspace, its draw in the CPU roofline's head (C5)

    def __post_init__(self) -> None:
        if isinstance(self.prompt_len, bool) or not isinstance(self.prompt_len, (int, float)) or not self.prompt_len >= 1:
            raise ValueError(f"workload: prompt_len must be a number >= 1, got {self.prompt_len!r}")
        if isinstance(self.gen_len, bool) or not isinstance(self.gen_len, int) or self.gen_len < 1:
            raise ValueError(f"workload: gen_len must be an int >= 1, got {self.gen_len!r}")
        if self.max_prompt_len is not None and (not isinstance(self.max_prompt_len, int) or self.max_prompt_len < self.prompt_len):
            raise ValueError(f"workload: max_prompt_len must be an int >= prompt_len ({self.prompt_len}), got {self.max_prompt_len!r}")
        if self.num_requests is not None and (not isinstance(self.num_requests, int) or self.num_requests < 1):
            raise ValueError(f"workload: num_requests must be an int >= 1, got {self.num_requests!r}")
        if self.scoring and self.gen_len != 1:
            raise ValueError(f"workload: a scoring workload generates nothing (gen_len 1), got gen_len {self.gen_len}")
        if self.prompt_lens is not None:
            lens = self.prompt_lens
            if isinstance(lens, list):
                object.__setattr__(self, "prompt_lens", lens := tuple(lens))
            if (not isinstance(lens, tuple) or not lens
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lens)):
                raise ValueError(f"workload: prompt_lens must be a non-empty tuple of ints >= 0, got {_short(lens)}")
            if max(lens) > self.max_prompt:
                raise ValueError(f"workload: prompt_lens has a prompt of {max(lens)} tokens, longer than "
                                 f"max_prompt_len ({self.max_prompt})")

    @property
    def max_prompt(self) -> int:
        """Longest prompt in tokens: max_prompt_len, or ceil(prompt_len)."""
        if self.max_prompt_len is not None:
            return self.max_prompt_len
        return int(-(-self.prompt_len // 1))

    @property
    def kv_len(self) -> int:
        """Positions per sequence of an ungrouped KV cache: longest prompt + gen_len (pipeline/kv_cache.KVCache's
        S_max). The planner sizes the KV cache with :meth:`kv_positions`, which is at most this."""
        return self.max_prompt + self.gen_len

    def kv_positions(self, N: int) -> float:
        """KV positions per sequence (a mean, prompt + generated) of a batch of ``N`` sequences, worst case.

        Without ``prompt_lens``: :attr:`kv_len` (every sequence sized for the longest prompt). With them:
        the padded mean of the optimal KV_GROUPS-grouping (policy/batching.length_groups, the grouped
        KV cache's own partition, default 8 groups) of the N longest prompt lengths (all of them if
        N >= their count), + gen_len. Why this bounds what the executor allocates for any batch of N:
        the runner forms batches from length-sorted requests, so the batch holding the N longest prompts
        dominates every other batch rank by rank; and each micro-batch's GroupedKVCache pads no more than
        the batch-wide grouping restricted to its rows (a restriction of a partition into G groups is a
        partition of the subset into at most G groups, each group's longest row no longer), so the sum
        over micro-batches is at most the batch-wide padded total. Non-increasing in N (each added,
        shorter row pads to at most the smallest padded length so far), which keeps the planner's
        fixed point safe.

        Args:
            N: sequences in the batch (>= 1).
        Returns:
            Positions per sequence (float; an int value without ``prompt_lens``).
        Raises:
            ValueError: N not an int >= 1.
        """
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise ValueError(f"workload: kv_positions needs N an int >= 1, got {N!r}")
        if self.prompt_lens is None:
            return float(self.kv_len)
        from .batching import KV_GROUPS  # torch-free

        return _grouped_prompt_mean(self.prompt_lens, N, KV_GROUPS) + self.gen_len

    def prompt_tokens(self, N: int) -> int:
        """Prompt tokens of a batch of ``N`` sequences, worst case, by :meth:`kv_positions`' convention: the sum of
        the N longest prompt lengths, or, when N reaches the number of prompts, N x their mean (the batch then holds
        the whole distribution); N x max_prompt without ``prompt_lens``. CGOPipe's prefill keeps the batch's packed
        prompt hidden rows on the GPU, this many. Per sequence it is non-increasing in N and at most
        ``kv_positions(N) - gen_len`` (a padded mean of the same prompts), which the MILP charges.
        Raises ValueError for N not an int >= 1."""
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise ValueError(f"workload: prompt_tokens needs N an int >= 1, got {N!r}")
        if self.prompt_lens is None:
            return N * self.max_prompt
        lens = self.prompt_lens
        if N >= len(lens):
            return N * sum(lens) // len(lens)  # floor: within one token of the mean
        return _longest_prefix_sums(lens)[N - 1]

    def attention_context_offsets(self, N: int, mu: int, n: int, g: int) -> tuple[float, float]:
        """(cpu, gpu): how much longer (tokens; negative: shorter) the prompts of the rows that attend on the CPU /
        on the GPU are than the mean prompt, for a policy of ``n`` micro-batches of ``mu`` rows, ``g`` of them with
        GPU attention, in batches of ``N``.

        CGOPipe puts the ``g`` SHORTEST micro-batches of a batch on the GPU (its micro-batches are grouped by
        length), so with 0 < g < n the CPU rows attend over longer contexts than the mean. The runner's batches are
        consecutive runs of the length-sorted prompts; with N >= the number of prompts one batch holds the
        whole distribution (repeated), and its shortest fraction g mu / N goes to the GPU. Offsets are means
        over all CPU (GPU) rows of the job of (prompt length - its batch's mean prompt length).
        (0.0, 0.0) without ``prompt_lens``, or when every micro-batch attends on one side (g = 0 or g >= n).
        Raises ValueError for N, mu, n not ints >= 1 or g < 0.
        """
        for name, v, lo in (("N", N, 1), ("mu", mu, 1), ("n", n, 1), ("g", g, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"workload: attention_context_offsets needs {name} an int >= {lo}, got {v!r}")
        if self.prompt_lens is None or g == 0 or g >= n:
            return 0.0, 0.0
        lens = sorted(self.prompt_lens)
        if N >= len(lens):  # one batch: the distribution repeated to N rows
            batches = [(lens, round(len(lens) * min(1.0, g * mu / N)))]
        else:  # the executor's first g micro-batches of mu rows (the shortest) attend on the GPU
            batches = [(b, min(len(b), g * mu)) for b in (lens[i : i + N] for i in range(0, len(lens), N))]
        dc = dg = 0.0
        nc = ng = 0
        for b, k in batches:
            mean = sum(b) / len(b)
            dg += sum(b[:k]) - k * mean
            dc += sum(b[k:]) - (len(b) - k) * mean
            ng, nc = ng + k, nc + len(b) - k
        return (dc / nc if nc else 0.0), (dg / ng if ng else 0.0)

    @classmethod
    def from_lengths(cls, prompt_lens: Sequence[int], gen_len: int, name: str = "", scoring: bool = False,
                     sampling: bool = False) -> "Workload":
        """From the tokenized prompt lengths of a job: mean, max, count and the lengths themselves (``scoring``: the
        lengths are the sequences a scoring job feeds, gen_len must be 1).

        Raises ValueError if empty."""
        lens = [int(x) for x in prompt_lens]
        if not lens:
            raise ValueError("workload: no prompts")
        return cls(prompt_len=max(1.0, sum(lens) / len(lens)), gen_len=gen_len, max_prompt_len=max(1, max(lens)),
                   num_requests=len(lens), name=name, prompt_lens=tuple(lens), scoring=scoring, sampling=sampling)


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


@lru_cache(maxsize=16)
def _longest_prefix_sums(prompt_lens: tuple) -> tuple:
    """Prefix sums of ``prompt_lens`` sorted longest first: element i is the sum of the i + 1 longest."""
    out, acc = [], 0
    for x in sorted(prompt_lens, reverse=True):
        acc += x
        out.append(acc)
    return tuple(out)


@lru_cache(maxsize=256)
def _grouped_prompt_mean(prompt_lens: tuple, N: int, groups: int) -> float:
    """Padded mean prompt length of the optimal ``groups``-grouping of the N longest of ``prompt_lens``."""
    from .batching import length_groups, padded_positions  # torch-free

    top = sorted(prompt_lens, reverse=True)[:N]
    return padded_positions(top, length_groups(top, groups)) / len(top)


@dataclass(frozen=True)
class Budgets:
    """Memory the planner may use, and the formats it plans for."""

    gpu_memory: int  # bytes of GPU memory for this process (the reserve below is part of it)
    cpu_memory: int  # bytes of host memory for this process (pinned pool + KV + staging + reserve)
    weight_quant: str = "bf16"  # expert page format: bf16 | fp16 | fp32 | int4 | int2 | int2-up | mxfp4
    dtype: str = "bf16"  # model dtype: non-expert weights, activations, KV cache
    gpu_reserve: int = DEFAULT_GPU_RESERVE  # bytes kept free on the GPU (context, workspaces, fragmentation)
    cpu_reserve: int = DEFAULT_CPU_RESERVE  # bytes kept free on the host (process, temporaries)
    gpus: int = 1  # GPUs of one host (expert parallelism): gpu_memory and gpu_reserve are per GPU, cpu_reserve per process

    def __post_init__(self) -> None:
        _check_formats(self.weight_quant, self.dtype, "budgets")
        _check_gpus(self.gpus, "budgets", ValueError)
        for k in ("gpu_memory", "cpu_memory", "gpu_reserve", "cpu_reserve"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"budgets: {k} must be a non-negative int of bytes, got {v!r}")

    @classmethod
    def for_hardware(cls, hw: HardwareProfile, **kw: Any) -> "Budgets":
        """The whole GPU and host memory of ``hw``, its allocator reserve :func:`gpu_reserve_for` (override any field by
        keyword)."""
        kw.setdefault("gpu_memory", hw.gpu_memory)
        kw.setdefault("cpu_memory", hw.host_memory)
        kw.setdefault("gpu_reserve", gpu_reserve_for(hw))
        return cls(**kw)


def gpu_reserve_for(hw: HardwareProfile) -> int:
    """The GPU bytes a plan for ``hw`` keeps outside its tensors (the memory model's "allocator reserve", which also
    covers LIBRARY_WORKSPACE): DEFAULT_GPU_RESERVE, or the profile's measured ``gpu_context_bytes`` plus the
    library workspaces where larger (a capped job's torch allocator gets gpu_memory minus what its process holds
    outside it; on the H100 host with torch 2.11 / CUDA 13 that was 1.12-1.34 GiB, more than the 1 GiB default)."""
    return max(DEFAULT_GPU_RESERVE, int(hw.gpu_context_bytes) + LIBRARY_WORKSPACE)  # 0 (unmeasured): the default


def _check_fits(key: str, budget: int, capacity: int, what: str, hw: HardwareProfile) -> None:
    if budget > capacity:
        raise ValueError(f"{key} {format_bytes(budget)} exceeds the {format_bytes(capacity)} of {what} of hardware "
                         f"{hw.name!r}: give a {key} that fits, or the hardware it is for")


def check_gpu_budget(gpu_memory: int, hw: HardwareProfile) -> None:
    """Raises ValueError when a GPU memory budget (bytes) is larger than the card of the hardware profile ``hw``:
    a plan for memory the GPU does not have would run out of memory at run time."""
    _check_fits("gpu_memory", gpu_memory, hw.gpu_memory, "GPU memory", hw)


def check_cpu_budget(cpu_memory: int, hw: HardwareProfile) -> None:
    """Raises ValueError when a host memory budget (bytes) is larger than the DRAM of the hardware profile ``hw``
    (``host_memory``): the pinned expert pool and the CPU KV cache of such a plan would not fit the machine."""
    _check_fits("cpu_memory", cpu_memory, hw.host_memory, "host memory", hw)


def _check_gpus(gpus: Any, where: str, error: type) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise error(f"{where}: gpus must be an int >= 1, got {gpus!r}")


def _check_formats(weight_quant: str, dtype: str, where: str) -> None:
    if weight_quant not in DTYPE_BYTES and weight_quant not in QUANT_FORMATS and weight_quant not in PACKED_FORMATS:
        raise ValueError(f"{where}: weight_quant {weight_quant!r} unknown (known: bf16, fp16, fp32, "
                         f"{', '.join((*QUANT_FORMATS, *PACKED_FORMATS))})")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"{where}: dtype {dtype!r} unknown (known: bf16, fp16, fp32)")


Resident = Union[int, tuple]  # an int (same count in every MoE layer), per-layer counts, or (layer, expert) pairs


@dataclass(frozen=True)
class Policy(YamlRecord):
    """A CGOPipe execution policy (MoE-Lightning Sec. 4): batch shape, expert placement, attention split.

    ``resident_experts`` is one of: an int r (r experts resident in every MoE layer); a tuple of
    per-layer counts of length num_layers (dense layers 0); a tuple of (layer, expert) pairs. With
    counts, the executor keeps experts 0..count-1 of each layer (all experts weigh the same).
    """

    mu: int  # sequences per decode micro-batch
    n: int  # micro-batches per batch (N = mu * n sequences in flight)
    prefill_mu: int  # at most this many sequences per prefill micro-batch (its GEMMs see ~prefill_mu * prompt_len tokens)
    resident_experts: Resident = 0  # experts kept on the GPU (see class docstring for the three forms)
    n_gpu_attn: int = 0  # micro-batches whose KV cache and attention live on the GPU (0..n); the rest on the CPU
    weight_quant: str = "bf16"  # expert page format: bf16 | fp16 | fp32 | int4 | int2 | int2-up | mxfp4
    dtype: str = "bf16"  # model dtype: non-expert weights, activations, KV cache
    gpu_budget: int = 0  # bytes of GPU memory this policy was planned for (0 = unchecked)
    cpu_budget: int = 0  # bytes of host memory this policy was planned for (0 = unchecked)
    gpu_reserve: int = DEFAULT_GPU_RESERVE  # bytes of the GPU budget kept free (counted in the GPU peak)
    cpu_reserve: int = DEFAULT_CPU_RESERVE  # bytes of the host budget kept free (counted in the CPU peak)
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS  # at most this many padded tokens (rows x longest row) per prefill
    # micro-batch; a single longer prompt runs alone. Bounds the prefill workspace whatever the length mix.
    gpus: int = 1  # GPUs of one host the policy runs on (expert parallelism: expert e of each layer on GPU e % gpus,
    #   attention and dense parts replicated); gpu_budget and gpu_reserve are per GPU

    def __post_init__(self) -> None:
        _check_gpus(self.gpus, "policy", PolicyError)
        for k in ("mu", "n", "prefill_mu", "prefill_tokens"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PolicyError(f"policy: {k} must be an int >= 1, got {v!r}")
        if isinstance(self.n_gpu_attn, bool) or not isinstance(self.n_gpu_attn, int) or not 0 <= self.n_gpu_attn <= self.n:
            raise PolicyError(f"policy: n_gpu_attn must be an int in 0..n={self.n}, got {self.n_gpu_attn!r}")
        for k in ("gpu_budget", "cpu_budget", "gpu_reserve", "cpu_reserve"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PolicyError(f"policy: {k} must be a non-negative int of bytes, got {v!r}")
        try:
            _check_formats(self.weight_quant, self.dtype, "policy")
        except ValueError as e:
            raise PolicyError(str(e)) from None
        r = self.resident_experts
        if isinstance(r, list):
            object.__setattr__(self, "resident_experts", r := tuple(tuple(x) if isinstance(x, list) else x for x in r))
        ok = (isinstance(r, int) and not isinstance(r, bool) and r >= 0) or (
            isinstance(r, tuple)
            and (all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
                 or all(isinstance(x, tuple) and len(x) == 2 and all(isinstance(y, int) and y >= 0 for y in x) for x in r))
        )
        if not ok:
            raise PolicyError(f"policy: resident_experts must be an int, a list of per-layer counts or a list of [layer, expert] pairs, got {r!r}")

    @property
    def N(self) -> int:
        """Sequences in flight: mu * n."""
        return self.mu * self.n

    @property
    def n_cpu_attn(self) -> int:
        """Micro-batches whose KV cache and attention live on the CPU: n - n_gpu_attn."""
        return self.n - self.n_gpu_attn

    def resident_counts(self, spec: MoESpec) -> tuple[int, ...]:
        """Resident experts per decoder layer (length num_layers; dense layers 0).

        Raises PolicyError if a count exceeds num_experts, the length is wrong, a pair is out of range
        or repeated, or a dense layer is named.
        """
        L, E, dense = spec.num_layers, spec.num_experts, spec.is_dense_layer
        r = self.resident_experts
        if isinstance(r, int):
            if r > E:
                raise PolicyError(f"policy: resident_experts={r} > num_experts={E}")
            return tuple(0 if dense(i) else r for i in range(L))
        if not r:
            return (0,) * L
        if isinstance(r[0], int):
            if len(r) != L:
                raise PolicyError(f"policy: resident_experts has {len(r)} per-layer counts, the model has {L} layers")
            for i, c in enumerate(r):
                if c > E or (dense(i) and c):
                    raise PolicyError(f"policy: resident_experts[{i}]={c} out of range (0..{0 if dense(i) else E})")
            return tuple(r)
        counts = [0] * L
        seen = set()
        for layer, e in r:
            if layer >= L or dense(layer) or e >= E or (layer, e) in seen:
                raise PolicyError(f"policy: resident expert ({layer}, {e}) out of range or repeated")
            seen.add((layer, e))
            counts[layer] += 1
        return tuple(counts)

    def total_resident(self, spec: MoESpec) -> int:
        """Number of resident experts over all layers."""
        return sum(self.resident_counts(spec))

    # ---- YAML ------------------------------------------------------------------------------------
    ERROR, WHAT = PolicyError, "policy fields"  # for YamlRecord (not fields: no annotation)

    def to_dict(self) -> dict:
        """Plain dict (lists instead of tuples) in field order."""
        d = asdict(self)
        r = self.resident_experts
        d["resident_experts"] = r if isinstance(r, int) else [list(x) if isinstance(x, tuple) else x for x in r]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "<policy>") -> "Policy":
        """Build from a mapping; unknown keys, missing required keys and wrong types raise PolicyError naming ``where``."""
        cls._known_fields(d, where)
        for k in ("mu", "n", "prefill_mu"):
            if k not in d:
                raise PolicyError(f"{where}: {k}: missing")
        kw = dict(d)
        for k in ("gpu_budget", "cpu_budget", "gpu_reserve", "cpu_reserve"):
            if k in kw and isinstance(kw[k], str):
                try:
                    kw[k] = parse_bytes(kw[k], f"{where}: {k}")
                except ValueError as e:
                    raise PolicyError(str(e)) from None
        return cls._build(kw, where, strip="policy: ")


def _fmt_time(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms"


def format_table(policy: Policy, estimate: "Estimate", spec: MoESpec, hw: HardwareProfile) -> str:
    """The plan as a text table: batch shape, placement, memory vs budget, bytes per layer, stage times.

    Lists mu, n, N, prefill micro-batch, resident experts, the attention split, GPU and CPU peak bytes
    against the budgets (with their breakdown), bytes per layer, and for prefill and decode each stage's
    summed time with the binding stage marked, then predicted tokens/s.
    """
    counts = policy.resident_counts(spec)
    R = sum(counts)
    moe = [c for i, c in enumerate(counts) if not spec.is_dense_layer(i)]
    We = spec.expert_bytes(policy.weight_quant)
    lines = []
    add = lines.append
    add(f"model     {spec.name}: {spec.num_layers} layers, {spec.num_experts} experts (top-{spec.top_k}), "
        f"{format_bytes(spec.total_bytes(policy.dtype, policy.weight_quant))} ({policy.dtype} + {policy.weight_quant} experts)")
    add(f"hardware  {hw.name}: GPU {format_bytes(hw.gpu_memory)}, HBM {hw.gpu_hbm_bandwidth / 1e9:.0f} GB/s, "
        f"{hw.gpu_flops(policy.dtype) / 1e12:.0f} TFLOP/s, PCIe h2d {hw.pcie_h2d / 1e9:.1f} GB/s d2h {hw.pcie_d2h / 1e9:.1f} GB/s, "
        f"CPU attention {hw.cpu_attention_bandwidth / 1e9:.0f} GB/s"
        + (f" ({hw.cpu_attention_bandwidth_under_h2d / 1e9:.0f} beside h2d {hw.pcie_h2d_under_cpu_attention / 1e9:.1f})"
           if hw.cpu_attention_bandwidth_under_h2d > 0 and hw.pcie_h2d_under_cpu_attention > 0 else ""))
    scoring = "scoring" in estimate.memory.gpu_phases
    add(f"workload  {'sequence' if scoring else 'prompt'} {estimate.prompt_len:.1f} tokens mean (max {estimate.max_prompt_len}), "
        + ("scoring (prefill only)" if scoring else f"generate {estimate.gen_len}"))
    add("")
    add("policy")
    add(f"  mu (sequences / micro-batch)     {policy.mu}")
    add(f"  n  (micro-batches)               {policy.n}")
    add(f"  N  (sequences in flight)         {policy.N}")
    add(f"  prefill micro-batch              {policy.prefill_mu} sequences, <= {policy.prefill_tokens} padded tokens")
    res = f"{R} of {spec.num_moe_layers * spec.num_experts}"
    if moe:
        res += f" ({min(moe)}..{max(moe)} per MoE layer)" if min(moe) != max(moe) else f" ({moe[0]} per MoE layer)"
    add(f"  resident experts                 {res}, {format_bytes(R * We)}")
    add(f"  attention split                  {policy.n_gpu_attn} micro-batch(es) on GPU, {policy.n_cpu_attn} on CPU")
    Wd = spec.expert_bytes(policy.dtype)  # an expert's bytes before quantization (the model dtype)
    before = (lambda n: f" ({format_bytes(n * Wd)} in {policy.dtype})") if We != Wd else (lambda n: "")
    add(f"  expert pages                     {policy.weight_quant}, {format_bytes(We)} per expert{before(1)}")
    if policy.gpus > 1:
        add(f"  GPUs (expert parallel)           {policy.gpus}: expert e on GPU e % {policy.gpus}, each its own PCIe link; "
            f"memory below is per GPU; GPU-to-GPU link {hw.gpu_link_bandwidth / 1e9:.1f} GB/s")
    add("")
    add("memory (peak)")
    gb = f" / budget {format_bytes(policy.gpu_budget)}" if policy.gpu_budget else ""
    cb = f" / budget {format_bytes(policy.cpu_budget)}" if policy.cpu_budget else ""
    m = estimate.memory
    add(f"  GPU  {format_bytes(estimate.gpu_peak)}{gb}   ({estimate.gpu_peak_phase} peak, allocator reserve included)")
    for phase in m.gpu_phases:
        add(f"    {phase:<8} {format_bytes(m.phase_total(phase))}   (tensors {format_bytes(m.phase_allocated(phase))})")
        for k, v in m.gpu_phases[phase].items():
            add(f"         {k:<38} {format_bytes(v)}")
    add(f"  CPU  {format_bytes(estimate.cpu_peak)}{cb}   ({'weight load' if m.cpu_peak_phase == 'load' else 'run'} peak)")
    for phase, comps in (("run", m.cpu), ("load", m.cpu_load)):
        if comps:
            add(f"    {phase:<8} {format_bytes(sum(comps.values()))}")
        for k, v in comps.items():
            add(f"         {k:<46} {format_bytes(v)}")
    add("")
    ne_layer = spec.layer_non_expert_params(spec.moe_layers[0]) * DTYPE_BYTES[policy.dtype]
    paged = spec.num_experts - (min(moe) if moe else 0)
    g = policy.gpus
    per_gpu = f", {format_bytes(-(-paged // g) * We)} per GPU over its own link" if g > 1 else ""
    add(f"bytes per MoE layer: non-expert {format_bytes(ne_layer)}, experts {format_bytes(spec.num_experts * We)}"
        f"{before(spec.num_experts)}, paged per layer {format_bytes(paged * We)}{before(paged)} (max){per_gpu}")
    add("")
    add(f"stage times (summed over layers{', and decode steps' if estimate.gen_len > 1 else ''}; * = binds; a layer "
        f"takes the longest of its overlapped stages)")
    add("  h2d: expert pages to the GPU, d2h: q/k/v (prefill: KV) to the host, cpu: CPU attention, gpu: GPU kernels, "
        "host: the host thread's issue time, head: embedding and lm_head (not overlapped)")
    add(f"  {'':8} {'h2d':>10} {'d2h':>10} {'cpu':>10} {'gpu':>10} {'host':>10} {'head':>10} {'total':>10}")
    for phase, st, total, bind in (
        ("prefill", estimate.prefill_stages, estimate.prefill_time, estimate.prefill_binding),
        ("decode", estimate.decode_stages, estimate.decode_time, estimate.decode_binding),
    )[: 1 if scoring else 2]:
        cells = [(_fmt_time(st.get(k, 0.0)) + ("*" if k == bind else " ")) for k in ("h2d", "d2h", "cpu", "gpu", "host", "head")]
        add(f"  {phase:8} " + " ".join(f"{c:>10}" for c in cells) + f" {_fmt_time(total):>10}")
    if estimate.host_probe and not scoring:
        add(f"  {host_probe_line(estimate.host_probe)}")
    add("")
    if scoring:
        add(f"predicted: prefill {estimate.prefill_tok_s:,.0f} tok/s ({estimate.N} sequences per batch in "
            f"{_fmt_time(estimate.prefill_time)}); binding: {estimate.prefill_binding}")
        return "\n".join(lines)
    add(f"predicted: prefill {estimate.prefill_tok_s:,.0f} tok/s, decode {estimate.decode_tok_s:,.1f} tok/s, "
        f"end-to-end {estimate.e2e_tok_s:,.1f} tok/s ({estimate.N} x {estimate.gen_len} tokens in {_fmt_time(estimate.total_time)}); "
        f"binding: prefill {estimate.prefill_binding}, decode {estimate.decode_binding}")
    if estimate.job_rows:
        add(job_line(estimate))
    return "\n".join(lines)


def job_line(estimate: "Estimate") -> str:
    """The job's prediction in one line: its requests through N slots refilled as rows finish, the refill schedule's
    prefill passes (rows each), and end-to-end tokens/s over the whole schedule (every pass and step, the drain too)."""
    rows = estimate.job_rows
    sizes: dict = {}
    for r in rows:
        sizes[r] = sizes.get(r, 0) + 1
    shape = " + ".join(f"{c} x {r}" if c > 1 else f"{r}" for r, c in sizes.items())
    return (f"job: {sum(rows)} requests through {estimate.N} slots in {len(rows)} prefill pass(es) ({shape} rows), "
            f"predicted end-to-end {estimate.job_e2e_tok_s:,.1f} tok/s ({sum(rows)} x {estimate.gen_len} tokens in "
            f"{_fmt_time(estimate.job_time)}, every pass and decode step counted, the drain too)")
