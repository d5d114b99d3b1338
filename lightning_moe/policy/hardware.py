"""HardwareProfile: the numbers of one host that the Hierarchical Roofline Model needs.

Levels (DESIGN.md "hierarchical roofline model"; MoE-Lightning, arXiv 2411.11217, Sec. 3): GPU HBM
(``gpu_hbm_bandwidth``, ``gpu_flops_*``), host DRAM (``host_memory_bandwidth``, and the CPU attention
routine's own throughput ``cpu_attention_*``), and the PCIe link between them (``pcie_h2d``,
``pcie_d2h``, measured with pinned buffers). Units: bytes, bytes/s, FLOP/s.

Presets: ``t4`` and ``l4`` carry the MoE-Lightning artifact's numbers (its ``HardwareConfig.init``,
where ``GB = 2**30`` and ``T = 1e12``); ``a100-40g``, ``h100``, ``h200`` carry datasheet numbers. Every
number not taken from a source is marked "assumption" in its comment. ``moe-batch profile`` measures a
host and writes the same YAML (see ``profiler.py``).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Sequence


from ..model.spec import PACKED_FORMATS, QUANT_FORMATS
from .yaml_io import YamlRecord

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
GB = 1e9
T = 1e12

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}


class HardwareError(ValueError):
    """A hardware profile YAML or preset name that cannot be used (the message names file and key)."""


def parse_bytes(value: Any, what: str = "", positive: bool = False) -> int:
    """Parse a byte count: an int, or a string such as "24GiB", "24 GB", "512MiB", "1.5TiB", "1000000".

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024 (case-insensitive;
    no unit = bytes); fractions round to the nearest byte. ``positive``: 0 is an error too (a job's memory sizes).
    Raises ValueError, its message prefixed by ``what`` when given, for anything else (bools, negative numbers,
    unknown units, non-integral floats).
    """
    pre = f"{what}: " if what else ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{pre}expected a size in bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = (m.group(2).lower() or "b") if m else None
        if unit not in _UNITS:
            raise ValueError(f"{pre}expected a size like '24GiB', '16GB' or '512MiB' (units: B, KB, MB, GB, TB, "
                             f"KiB, MiB, GiB, TiB), got {value!r}")
        n = int(round(float(m.group(1)) * _UNITS[unit]))
    if n < 0 or (positive and n == 0):
        raise ValueError(f"{pre}must be a {'positive' if positive else 'non-negative'} size, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """Human-readable binary size: 25769803776 -> '24.0 GiB'."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


EXPERT_FFN_KERNELS = ("triton", "grouped_mm", "mm_loop")  # the grouped expert-FFN kernels a profile can rate and CGOPipe
#   can pick (a tie goes to the earlier one)
EXPERT_WEIGHTS = ("dense", "mxfp4")  # ExpertFFNRate.weights: how a measured call's experts were stored
GENERIC_HOST_PROBE = "generic"  # the host probe of host_issue_cpu_attn / _gpu_attn (not a host_issue_by_family key)
MLA_HOST_PROBE = "mla"  # host_issue_by_family's key of the MLA probe (an MLA model's fallback)
LEGACY_MLA_FIELD = "host_issue_cpu_attn_mla"  # profiles before host_issue_by_family: read as its "mla" entry
NO_SYNC_KERNELS = ("triton", "grouped_mm")  # the kernels with no host sync: the ones a decode step may run (mm_loop
#   waits for the host to read each call's per-expert row counts, so only prefill passes run it)


def _dtype_key(dtype: str) -> str:
    """"bfloat16" / "bf16" -> "bf16" (also fp16, fp32)."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


@dataclass(frozen=True)
class ExpertFFNRate:
    """One measurement of the grouped expert FFN: a call of ``tokens`` tokens routed top-``top_k`` over ``experts``
    experts of width ``intermediate`` (hidden ``hidden``), in ``dtype``; FLOP/s (2 T k 3 D F per call, the whole call)
    of each kernel, 0 = not measured (the kernel failed or does not run here). ``moe-batch profile`` measures them on
    CUDA (``pipeline.profiler.measure_expert_ffn_rates``)."""

    hidden: int  # D
    intermediate: int  # F, one expert's width
    experts: int  # E routed experts of the layer
    top_k: int  # k
    dtype: str  # compute dtype: "bf16" | "fp16" | "fp32"
    tokens: int  # T, tokens per call (the bucket)
    triton: float = 0.0  # FLOP/s of kernels.fused_moe.fused_experts_triton; 0 = not measured
    grouped_mm: float = 0.0  # FLOP/s of kernels.fused_moe.fused_experts_grouped_mm; 0 = not measured
    mm_loop: float = 0.0  # FLOP/s of kernels.fused_moe.fused_experts_mm_loop (one host sync per call); 0 = not measured
    weights: str = "dense"  # how the experts are stored: "dense" (in dtype) | "mxfp4" (MXFP4 pages: ``triton`` is then
    #   kernels.mxfp4.fused_experts_mxfp4_triton's rate, the only kernel over them; grouped_mm and mm_loop 0)

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k", "tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HardwareError(f"expert_ffn_rates: {name}: expected an integer >= 1, got {v!r}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise HardwareError(f"expert_ffn_rates: dtype: expected bf16, fp16 or fp32, got {self.dtype!r}")
        if self.weights not in EXPERT_WEIGHTS:
            raise HardwareError(f"expert_ffn_rates: weights: expected one of {', '.join(EXPERT_WEIGHTS)}, got "
                                f"{self.weights!r}")
        for name in EXPERT_FFN_KERNELS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise HardwareError(f"expert_ffn_rates: {name}: expected a non-negative number (FLOP/s), got {v!r}")

    @property
    def shape(self) -> tuple:
        """(hidden, intermediate, experts, top_k, dtype)."""
        return (self.hidden, self.intermediate, self.experts, self.top_k, self.dtype)

    def best_of(self, kernels: Sequence[str] = EXPERT_FFN_KERNELS) -> str:
        """The fastest measured kernel of ``kernels``; on a tie (none measured: all 0) the first of them."""
        return max(kernels, key=lambda k: (getattr(self, k), -kernels.index(k)))

    def best_rate_of(self, kernels: Sequence[str] = EXPERT_FFN_KERNELS) -> float:
        """FLOP/s of :meth:`best_of` (0 when none of ``kernels`` is measured)."""
        return max(getattr(self, k) for k in kernels)

    @property
    def best(self) -> str:
        """The fastest measured kernel of all; "triton" when none is measured or on a tie with it (today's kernel)."""
        return self.best_of()

    @property
    def best_rate(self) -> float:
        """FLOP/s of :attr:`best` (0 when none is measured)."""
        return self.best_rate_of()


@dataclass(frozen=True)
class HardwareProfile(YamlRecord):
    """One host: GPU, PCIe link, host DRAM, CPU attention throughput. Units: bytes, bytes/s, FLOP/s.

    Load with :meth:`load` (YAML; unknown keys and wrong types are errors), or :func:`get_preset`.
    """

    name: str  # preset name or profile name ("l4", "h200", "h200-host")
    gpu_memory: int  # bytes of GPU memory (device total; the planner subtracts its allocator reserve)
    gpu_hbm_bandwidth: float  # bytes/s GPU memory bandwidth (device-to-device copy: bytes read + written / time)
    gpu_flops_bf16: float  # FLOP/s dense bf16 matmul
    gpu_flops_fp16: float  # FLOP/s dense fp16 matmul
    gpu_flops_fp32: float  # FLOP/s fp32 matmul (no TF32)
    pcie_h2d: float  # bytes/s host-to-device copy from pinned memory
    pcie_d2h: float  # bytes/s device-to-host copy into pinned memory
    host_memory: int  # bytes of host DRAM
    host_memory_bandwidth: float  # bytes/s host memory copy bandwidth (bytes read + written / time)
    cpu_attention_bandwidth: float  # bytes/s of KV cache the CPU decode-attention routine streams
    cpu_attention_flops: float  # FLOP/s the CPU decode-attention routine sustains
    cpu_cores: int  # physical CPU cores available to the attention workers
    microbatch_overhead: float = 0.0  # seconds of host-side issue cost per micro-batch per layer (Python + kernel launches of
    #   pre/post-attention and the expert FFN); measured by `moe-batch profile` on CUDA, 0 for presets (the artifact has none)
    cpu_latent_attention_flops: float = 0.0  # FLOP/s of the native MLA decode-attention kernel (DeepSeek's latent
    #   cache: every query head reads one shared row, ~Hq FLOP per byte) at a compute-bound shape; the (H5) FLOP term of
    #   MLA models uses it (the GQA probe's cpu_attention_flops is a memory-bound shape's rate, ~4x below this kernel's
    #   on the H200 host); `moe-batch profile` measures it (profiler.measure_cpu_latent_attention); 0 = unmeasured:
    #   cpu_attention_flops
    cpu_attention_overhead: float = 0.0  # seconds of fixed cost per CPU decode-attention call (one micro-batch, one layer):
    #   thread wake-ups and op dispatch, which dominate at decode shapes; `moe-batch profile` fits it, 0 for presets
    cpu_attention_bandwidth_under_h2d: float = 0.0  # bytes/s of valid KV the CPU decode-attention routine streams
    #   WHILE pinned host-to-device copies run at full rate on another thread: CGOPipe pages experts during CPU
    #   attention, and both read host DRAM; with pcie_h2d_under_cpu_attention it is the one measured point where both
    #   run at once, which makes the HRM's host-DRAM sharing rows (hrm.dram_sharing). `moe-batch profile` measures it
    #   on CUDA as a fraction of the rate alone in one harness (pipeline.dram_sharing), times cpu_attention_bandwidth;
    #   0 = unmeasured: no rows
    pcie_h2d_under_cpu_attention: float = 0.0  # the copies' rate over the same windows: their fraction x pcie_h2d
    host_issue_cpu_attn: float = 0.0  # seconds of host-thread time per CPU-attention micro-batch per decode layer as
    #   CGOPipe runs it on the generic probe (Mixtral-shaped, dense experts): pre-attention, q/k/v copy, hand-offs with
    #   the CPU-attention worker, the output's transfer, a page slot, post-attention with the expert FFN; a family
    #   measured on its own probe takes host_issue_by_family's entry instead; `moe-batch profile` measures it on CUDA
    #   (profiler.measure_host_issue); 0 = unmeasured: the HRM has no host stage
    host_issue_gpu_attn: float = 0.0  # the same for a GPU-attention micro-batch (KV append + attention per length group)
    host_issue_by_family: tuple = ()  # host probe key -> (host_issue_cpu_attn, host_issue_gpu_attn) of that probe,
    #   as sorted (key, (cpu_attn_s, gpu_attn_s)) items (YAML: a mapping of key to [cpu_attn_s, gpu_attn_s]): CGOPipe's
    #   host issue on a tiny model of one family (its decode math: q/k norms, shared experts, sinks, MLA; its flagship's
    #   expert count and top-k) with its experts in one format; the key names both: "qwen3_moe" (dense), "mixtral/int4"
    #   (quantize's group-wise pages, int2 too), "gpt_oss/mxfp4"; "mla" is the DeepSeek-V2-shaped MLA probe (older
    #   profiles' host_issue_cpu_attn_mla, read as {"mla": [it, 0]}). The HRM takes a job's own key, else its family's
    #   dense key, else "mla" for an MLA model, else the generic (Mixtral-shaped) fields above (host_issue_for);
    #   a gpu_attn_s of 0: the generic host_issue_gpu_attn. `moe-batch profile` measures them (profiler.host_probe_keys)
    gpu_expert_flops: float = 0.0  # FLOP/s CGOPipe's grouped expert kernel (kernels.fused_moe.fused_experts_triton) reaches
    #   at prefill sizes in the compute dtype; the HRM's routed-expert term uses min(this, the GEMM peak). `moe-batch
    #   profile` measures it on CUDA (profiler.measure_expert_kernel_flops); 0 = unmeasured: the GEMM peak
    expert_ffn_rates: tuple = ()  # ExpertFFNRate per (expert shape, dtype, tokens-per-call bucket): the measured FLOP/s
    #   of the Triton, grouped_mm and mm_loop expert FFNs; CGOPipe's expert_ffn "auto" picks the fastest at the bucket
    #   nearest a call's T (decode: of NO_SYNC_KERNELS), and the HRM's routed-expert term uses that kernel's rate
    #   (log-T interpolated) for the shape. Empty
    #   (presets, older profiles): the Triton kernel everywhere, gpu_expert_flops in the HRM
    gpu_link: float = 0.0  # bytes/s one GPU sends to the others during an all-reduce (NVLink, or PCIe peer-to-peer) with
    #   several GPUs of the host (expert parallelism, Budgets.gpus); 0 = unmeasured: pcie_h2d (peer copies over PCIe,
    #   the link of hosts without NVLink; pessimistic for NVLink hosts)
    prefill_elementwise_rows: float = 0.0  # element-wise traffic of one prefill token through one MoE layer, in hidden
    #   rows (hidden_size x dtype bytes) at gpu_hbm_bandwidth: the kernels around the GEMMs (norms, RoPE, routing's
    #   top-k / sort / scatter, the expert path's slot buffers, residual adds, packed-attention indexing) that the HRM's
    #   roofline terms do not count; from a prefill trace's kernel times (benchmarks/prefill_elementwise.py);
    #   0 = unmeasured: folded into the GEMMs' activation bytes
    gpu_context_bytes: int = 0  # bytes a job's process holds on the GPU outside torch's caching allocator (CUDA
    #   context, library handles, loaded kernel modules): what a gpu_memory cap loses before any tensor
    #   (app.gpu.apply_gpu_cap nets it out); the planner's allocator reserve is at least this plus the library
    #   workspaces (policy.gpu_reserve_for). `moe-batch profile` measures it after its probes (a job's first
    #   profile: in a child process, capped by the child's own bytes by NVML's count, app.measure_child)
    #   (profiler.measure_gpu_context_bytes: 0.74 GiB on the H100 host); a job's process can hold more (1.1-1.34 GiB
    #   there: the kernels of its own model's shapes and on-demand measurements), so a capped `policy: auto` job whose
    #   plan does not fit re-plans with its own measurement and records it here (app.plan.fit_plan_to_cap);
    #   0 = unmeasured: DEFAULT_GPU_RESERVE alone
    source: str = ""  # where the numbers came from (free text)
    gpu_name: str = ""  # device name, e.g. "NVIDIA H200"
    host: str = ""  # host description (CPU model, cores, memory) for measured profiles
    date: str = ""  # ISO date of the measurement (measured profiles)

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_ffn_rates", _read_rates(self.expert_ffn_rates, self.name))  # a hashable tuple
        object.__setattr__(self, "host_issue_by_family", _read_host_issue(self.host_issue_by_family, self.name))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "float") and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0):
                raise HardwareError(f"{self.name}: {f.name}: expected a non-negative number, got {v!r}")
        for key in ("gpu_hbm_bandwidth", "gpu_flops_bf16", "pcie_h2d", "pcie_d2h", "cpu_attention_bandwidth", "cpu_attention_flops"):
            if getattr(self, key) <= 0:
                raise HardwareError(f"{self.name}: {key}: must be > 0, got {getattr(self, key)!r}")

    def host_issue_for(self, model_type: str, weight_quant: str, is_mla: bool) -> tuple[str, float, float]:
        """(probe, h_c, h_g) of (H6') for a job of ``model_type`` whose experts are ``weight_quant`` pages: the entry of
        host_issue_by_family under the job's own key (:func:`host_probe_key`), else under its family's dense key, else
        "mla" for an MLA model (``is_mla``), else the generic probe's host_issue_cpu_attn / _gpu_attn; an entry's
        gpu_attn_s of 0 (not measured) is the generic host_issue_gpu_attn. ``probe`` names the one that priced it."""
        entries = dict(self.host_issue_by_family)
        order = (host_probe_key(model_type, weight_quant), model_type) + ((MLA_HOST_PROBE,) if is_mla else ())
        for key in dict.fromkeys(order):
            if key in entries:
                h_c, h_g = entries[key]
                return key, h_c, h_g or self.host_issue_gpu_attn
        return GENERIC_HOST_PROBE, self.host_issue_cpu_attn, self.host_issue_gpu_attn

    @property
    def gpu_link_bandwidth(self) -> float:
        """bytes/s of the GPU-to-GPU link the HRM's token exchange uses: ``gpu_link``, or ``pcie_h2d`` when 0."""
        return self.gpu_link if self.gpu_link > 0 else self.pcie_h2d

    def expert_ffn_table(self, hidden: int, intermediate: int, experts: int, top_k: int, dtype: str,
                         kernels: Sequence[str] = EXPERT_FFN_KERNELS, weights: str = "dense") -> tuple:
        """The profile's :class:`ExpertFFNRate` entries of one expert shape, dtype and weight storage that measure one
        of ``kernels``, by increasing ``tokens`` (from :attr:`_expert_ffn_index`, made once per profile)."""
        key = (hidden, intermediate, experts, top_k, _dtype_key(dtype))
        return tuple(r for r in self._expert_ffn_index.get((key, weights), ()) if r.best_rate_of(kernels) > 0)

    @functools.cached_property
    def _expert_ffn_index(self) -> dict:
        """(shape, weights) -> the ``expert_ffn_rates`` entries of that shape and weight storage, by increasing
        ``tokens`` (a stable sort: entries of equal tokens in file order), for :meth:`expert_ffn_table`, which the HRM
        asks thousands of times a plan. A profile is frozen, so the index never goes stale (``replace`` makes a new
        profile, with its own)."""
        index: dict = {}
        for r in sorted(self.expert_ffn_rates, key=lambda r: r.tokens):
            index.setdefault((r.shape, r.weights), []).append(r)
        return {k: tuple(v) for k, v in index.items()}

    def has_expert_ffn_rates(self, hidden: int, intermediate: int, experts: int, top_k: int, dtype: str,
                             weights: str = "dense") -> bool:
        """Whether the profile holds any :class:`ExpertFFNRate` entry of this expert shape, dtype and weight storage
        (one whose kernels all measured 0 included: the probe ran and found none that runs there)."""
        key = (hidden, intermediate, experts, top_k, _dtype_key(dtype))
        return any(r.shape == key and r.weights == weights for r in self.expert_ffn_rates)

    def expert_ffn_kernel(self, hidden: int, intermediate: int, experts: int, top_k: int, dtype: str,
                          tokens: int, kernels: Sequence[str] = EXPERT_FFN_KERNELS) -> "str | None":
        """The fastest of ``kernels`` (default: all of :data:`EXPERT_FFN_KERNELS`; a decode step: NO_SYNC_KERNELS)
        measured at the bucket nearest ``tokens`` (in log T; a tie goes to the smaller bucket) for this shape; None
        when the profile has no measurement of the shape."""
        table = self.expert_ffn_table(hidden, intermediate, experts, top_k, dtype, kernels)
        if not table:
            return None
        lt = math.log(max(tokens, 1))
        return min(table, key=lambda r: (abs(math.log(r.tokens) - lt), r.tokens)).best_of(kernels)

    def expert_ffn_rate(self, hidden: int, intermediate: int, experts: int, top_k: int, dtype: str,
                        tokens: float, kernels: Sequence[str] = EXPERT_FFN_KERNELS, weights: str = "dense") -> float:
        """FLOP/s of the fastest measured of ``kernels`` at ``tokens`` tokens per call for this shape (and expert
        ``weights`` storage): piecewise linear in log T between the measured buckets, the end buckets' rates outside
        them; 0.0 when the profile has no measurement of the shape."""
        table = self.expert_ffn_table(hidden, intermediate, experts, top_k, dtype, kernels, weights)
        if not table:
            return 0.0
        rate = [r.best_rate_of(kernels) for r in table]
        t = max(float(tokens), 1.0)
        if t <= table[0].tokens:
            return rate[0]
        for i in range(1, len(table)):
            if t <= table[i].tokens:
                lo, hi = table[i - 1].tokens, table[i].tokens
                a = (math.log(t) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return rate[i - 1] + a * (rate[i] - rate[i - 1])
        return rate[-1]

    def gpu_flops(self, dtype: str) -> float:
        """Peak dense matmul FLOP/s for a dtype name ("bf16"/"bfloat16", "fp16"/"float16", "fp32"/"float32")."""
        key = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        if key not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"no GPU FLOP/s for dtype {dtype!r}")
        return getattr(self, f"gpu_flops_{key}")

    # ---- YAML ------------------------------------------------------------------------------------
    ERROR, WHAT = HardwareError, "hardware fields"  # for YamlRecord (not fields: no annotation)

    def to_dict(self) -> dict:
        """Plain dict in field order (what :meth:`save` writes)."""
        d = asdict(self)
        d["host_issue_by_family"] = {k: list(v) for k, v in self.host_issue_by_family}  # YAML: key: [cpu, gpu]
        d["expert_ffn_rates"] = [{k: v for k, v in asdict(r).items() if (k, v) != ("weights", "dense")}  # the default
                                 for r in self.expert_ffn_rates]  # YAML has no tuples
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "<dict>") -> "HardwareProfile":
        """Build from a mapping, checking keys and types.

        Byte fields (gpu_memory, host_memory) also accept "24GiB"-style strings; float fields accept
        numeric strings (YAML 1.1 reads ``1.6e12`` without a dot as a string).
        Raises HardwareError naming ``where`` and the key.
        """
        d = _migrate_host_issue(d, where)  # an older profile's host_issue_cpu_attn_mla: host_issue_by_family's "mla"
        known = cls._known_fields(d, where)
        kw: dict[str, Any] = {}
        for name, f in known.items():
            if name not in d:
                if f.default is not MISSING:
                    continue
                raise HardwareError(f"{where}: {name}: missing")
            v = d[name]
            if name == "expert_ffn_rates":
                kw[name] = _read_rates(v, where)
                continue
            if name == "host_issue_by_family":
                kw[name] = _read_host_issue(v, where)
                continue
            if f.type == "str":
                if not isinstance(v, str):
                    raise HardwareError(f"{where}: {name}: expected a string, got {v!r} ({type(v).__name__})")
            elif f.type == "int":
                if name in ("gpu_memory", "host_memory"):
                    try:
                        v = parse_bytes(v, f"{where}: {name}")
                    except ValueError as e:
                        raise HardwareError(str(e)) from None
                elif isinstance(v, bool) or not isinstance(v, int):
                    raise HardwareError(f"{where}: {name}: expected an integer, got {v!r} ({type(v).__name__})")
            elif f.type == "float":
                if isinstance(v, str):
                    try:
                        v = float(v)
                    except ValueError:
                        raise HardwareError(f"{where}: {name}: expected a number, got {v!r} (a string)") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise HardwareError(f"{where}: {name}: expected a number, got {v!r} ({type(v).__name__})")
                v = float(v)
            kw[name] = v
        return cls._build(kw, where)

    def with_overrides(self, **kw: Any) -> "HardwareProfile":
        """A copy with some fields replaced (e.g. ``gpu_memory``)."""
        return replace(self, **kw)


def host_probe_key(model_type: str, weight_quant: str) -> str:
    """host_issue_by_family's key of a job: its model_type, with "/int4" for quantize's group-wise pages (int4, int2,
    int2-up: one probe, the same ops on other bit widths) and "/mxfp4" for MXFP4 pages; none for dense experts (bf16,
    fp16, fp32)."""
    if weight_quant in QUANT_FORMATS:
        return f"{model_type}/int4"
    return f"{model_type}/{weight_quant}" if weight_quant in PACKED_FORMATS else model_type


def host_probe_line(probe: str) -> str:
    """One line saying which host probe priced a decode's host stage (``Estimate.host_probe``; "" for none)."""
    if not probe:
        return ""
    if probe == GENERIC_HOST_PROBE:
        return ("host term: priced by the profile's generic host issue probe (Mixtral-shaped, dense experts: "
                "host_issue_by_family has no entry for this model's family and expert format)")
    return f"host term: priced by the profile's host issue probe {probe!r} (host_issue_by_family)"


def _migrate_host_issue(d: Any, where: str) -> Any:
    """A profile mapping with an older profile's host_issue_cpu_attn_mla moved into host_issue_by_family as its "mla"
    entry ((value, 0): the GPU-attention micro-batch at the generic probe's; 0 = unmeasured: no entry); ``d`` as is
    without it. Both fields naming "mla" is an error."""
    if not isinstance(d, dict) or LEGACY_MLA_FIELD not in d:
        return d
    d = dict(d)
    raw = d.pop(LEGACY_MLA_FIELD)
    try:
        v = float(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else -1.0
    except ValueError:
        v = -1.0
    if not (math.isfinite(v) and v >= 0):
        raise HardwareError(f"{where}: {LEGACY_MLA_FIELD}: expected a non-negative number, got {raw!r}")
    entries = dict(_read_host_issue(d.get("host_issue_by_family"), where))
    if MLA_HOST_PROBE in entries:
        raise HardwareError(f"{where}: {LEGACY_MLA_FIELD} and host_issue_by_family's {MLA_HOST_PROBE!r} both given "
                            f"(the first is the older name of the second: keep one)")
    if v > 0:
        entries[MLA_HOST_PROBE] = (v, 0.0)
    d["host_issue_by_family"] = entries
    return d


def _read_host_issue(v: Any, where: str) -> tuple:
    """``host_issue_by_family`` of a profile: a mapping (or its items) of probe key -> [cpu_attn_s, gpu_attn_s],
    as sorted (key, (cpu, gpu)) tuples (null: none). A key is a non-empty string other than "generic"; cpu_attn_s
    > 0, gpu_attn_s >= 0 (0: the generic host_issue_gpu_attn), finite numbers (numeric strings accepted)."""
    what = f"{where}: host_issue_by_family"
    if v is None:
        return ()
    items = v.items() if isinstance(v, dict) else v
    if not isinstance(items, (list, tuple)) and not isinstance(v, dict):
        raise HardwareError(f"{what}: expected a mapping of probe key to [cpu_attn_s, gpu_attn_s], got {type(v).__name__}")
    out = {}
    for item in items:
        key, pair = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
        if not isinstance(key, str) or not key or key == GENERIC_HOST_PROBE or key in out:
            raise HardwareError(f"{what}: bad or repeated key {key!r} (a probe key such as 'qwen3_moe', 'mixtral/int4')")
        try:  # a pair is a list (a string's characters are no pair)
            c, g = (float(x) if isinstance(x, (str, int, float)) and not isinstance(x, bool) else None
                    for x in (pair if isinstance(pair, (list, tuple)) else None))
        except (TypeError, ValueError):
            c = g = None
        if c is None or g is None or not (math.isfinite(c) and math.isfinite(g) and c > 0 and g >= 0):
            raise HardwareError(f"{what}: {key}: expected [cpu_attn_s > 0, gpu_attn_s >= 0] (seconds), got {pair!r}")
        out[key] = (c, g)
    return tuple(sorted(out.items()))


def _read_rates(v: Any, where: str) -> tuple:
    """``expert_ffn_rates`` of a profile mapping: a list of mappings of :class:`ExpertFFNRate` fields (null: none)."""
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        raise HardwareError(f"{where}: expert_ffn_rates: expected a list of mappings, got {type(v).__name__}")
    known = [f.name for f in fields(ExpertFFNRate)]
    out = []
    for i, r in enumerate(v):
        if isinstance(r, ExpertFFNRate):
            out.append(r)
            continue
        if not isinstance(r, dict):
            raise HardwareError(f"{where}: expert_ffn_rates[{i}]: expected a mapping, got {type(r).__name__}")
        unknown = sorted(set(r) - set(known))
        missing = [k for k in ("hidden", "intermediate", "experts", "top_k", "dtype", "tokens") if k not in r]
        if unknown or missing:
            raise HardwareError(f"{where}: expert_ffn_rates[{i}]: " + (f"unknown key(s) {', '.join(map(str, unknown))}"
                                if unknown else f"missing {', '.join(missing)}") + f" (known: {', '.join(known)})")
        r = dict(r)
        for k in EXPERT_FFN_KERNELS:
            if isinstance(r.get(k), str):
                try:
                    r[k] = float(r[k])
                except ValueError:
                    raise HardwareError(f"{where}: expert_ffn_rates[{i}]: {k}: expected a number, got {r[k]!r}") from None
        try:
            out.append(ExpertFFNRate(**r))
        except HardwareError as e:
            raise HardwareError(f"{where}: expert_ffn_rates[{i}]: {str(e).split(': ', 1)[1]}") from None
    return tuple(out)


# ---- presets ------------------------------------------------------------------------------------
# ART = the MoE-Lightning ASPLOS'25 artifact, fastmoe/backend/utils.py HardwareConfig.init (GB = 2**30,
# T = 1e12) and its README's launch line (--cpu-mem-bdw 100, i.e. c_bdw = 100 GB). Datasheet numbers
# are dense (no 2:4 sparsity).

PRESETS: dict[str, HardwareProfile] = {
    "t4": HardwareProfile(
        name="t4",
        gpu_memory=15 * GiB,  # ART gmem = 15 * GB
        gpu_hbm_bandwidth=300 * GiB,  # ART g_bdw = 300 * GB (datasheet: 320 GB/s GDDR6)
        gpu_flops_bf16=65 * T,  # ART gpu_flops = 65 T (fp16 tensor cores; Turing has no native bf16 -- assumption: same as fp16)
        gpu_flops_fp16=65 * T,  # ART gpu_flops = 65 T (datasheet: 65 TFLOPS mixed precision)
        gpu_flops_fp32=8.1 * T,  # datasheet: 8.1 TFLOPS fp32
        pcie_h2d=16 * GiB,  # ART ctog_bdw = 16 * GB
        pcie_d2h=16 * GiB,  # assumption: same as ART's ctog_bdw (the artifact models one direction only)
        host_memory=192 * GiB,  # ART default cmem = 192 * GB (assumption: the T4 instance's usable DRAM)
        host_memory_bandwidth=100 * GiB,  # ART c_bdw = 100 * GB (README: --cpu-mem-bdw 100)
        cpu_attention_bandwidth=100 * GiB,  # ART: CPU attention bytes / c_bdw (same 100 * GB)
        cpu_attention_flops=0.8 * T,  # ART cpu_flops = 0.8 T for T4
        cpu_cores=32,  # assumption: not in the artifact (a 32-vCPU GCP n1 host)
        source="MoE-Lightning artifact HardwareConfig 'T4' (GB = 2**30, T = 1e12); fp32 from NVIDIA T4 datasheet; cpu_cores assumed",
        gpu_name="NVIDIA T4",
    ),
    "l4": HardwareProfile(
        name="l4",
        gpu_memory=24 * GiB,  # ART gmem = 24 * GB
        gpu_hbm_bandwidth=285 * GiB,  # ART g_bdw = 285 * GB (datasheet: 300 GB/s GDDR6)
        gpu_flops_bf16=104 * T,  # ART gpu_flops = 104 T (datasheet: 121 TFLOPS dense bf16)
        gpu_flops_fp16=104 * T,  # ART gpu_flops = 104 T
        gpu_flops_fp32=30.3 * T,  # datasheet: 30.3 TFLOPS fp32
        pcie_h2d=16 * GiB,  # ART ctog_bdw = 16 * GB (PCIe 4 x16)
        pcie_d2h=16 * GiB,  # assumption: same as ART's ctog_bdw
        host_memory=192 * GiB,  # ART default cmem = 192 * GB (GCP g2-standard-48: 192 GB)
        host_memory_bandwidth=100 * GiB,  # ART c_bdw = 100 * GB (README: --cpu-mem-bdw 100)
        cpu_attention_bandwidth=100 * GiB,  # ART: CPU attention bytes / c_bdw
        cpu_attention_flops=1.6 * T,  # ART cpu_flops = 1.6 T for L4
        cpu_cores=24,  # assumption: g2-standard-48 has 48 vCPUs = 24 physical cores
        source="MoE-Lightning artifact HardwareConfig 'L4' (GB = 2**30, T = 1e12); fp32 from NVIDIA L4 datasheet; cpu_cores assumed",
        gpu_name="NVIDIA L4",
    ),
    "a100-40g": HardwareProfile(
        name="a100-40g",
        gpu_memory=40 * GiB,  # datasheet 40 GB HBM2 (nvidia-smi: 40960 MiB)
        gpu_hbm_bandwidth=1555 * GB,  # datasheet: 1,555 GB/s
        gpu_flops_bf16=312 * T,  # datasheet: 312 TFLOPS dense bf16
        gpu_flops_fp16=312 * T,  # datasheet: 312 TFLOPS dense fp16
        gpu_flops_fp32=19.5 * T,  # datasheet: 19.5 TFLOPS fp32 (no TF32)
        pcie_h2d=25 * GB,  # assumption: PCIe 4 x16 (32 GB/s raw), ~25 GB/s pinned in practice
        pcie_d2h=25 * GB,  # assumption: as h2d
        host_memory=256 * GiB,  # assumption: typical A100 host slice
        host_memory_bandwidth=150 * GB,  # assumption: 8-channel DDR4-3200 (204.8 GB/s peak), ~75 % achievable
        cpu_attention_bandwidth=100 * GB,  # assumption: CPU attention streams KV at ~2/3 of copy bandwidth
        cpu_attention_flops=2 * T,  # assumption: 32 cores x AVX-512 fp32 FMA at ~2 GHz, ~50 % achievable
        cpu_cores=32,  # assumption
        source="NVIDIA A100 40GB datasheet; PCIe and host side assumed (measure with moe-batch profile)",
        gpu_name="NVIDIA A100-SXM4-40GB",
    ),
    "h100": HardwareProfile(
        name="h100",
        gpu_memory=80 * GiB,  # datasheet 80 GB HBM3 (nvidia-smi: 81559 MiB)
        gpu_hbm_bandwidth=3.35e12,  # datasheet H100 SXM: 3.35 TB/s
        gpu_flops_bf16=989 * T,  # datasheet H100 SXM: 989 TFLOPS dense bf16
        gpu_flops_fp16=989 * T,  # datasheet H100 SXM: 989 TFLOPS dense fp16
        gpu_flops_fp32=67 * T,  # datasheet H100 SXM: 67 TFLOPS fp32
        pcie_h2d=55 * GB,  # assumption: PCIe 5 x16 (64 GB/s raw), same measured figure as our H200 host
        pcie_d2h=50 * GB,  # assumption: slightly below h2d
        host_memory=512 * GiB,  # assumption
        host_memory_bandwidth=250 * GB,  # assumption: DDR5 server socket, ~70 % of peak
        cpu_attention_bandwidth=150 * GB,  # assumption
        cpu_attention_flops=3 * T,  # assumption
        cpu_cores=48,  # assumption
        source="NVIDIA H100 SXM5 datasheet; PCIe and host side assumed (measure with moe-batch profile)",
        gpu_name="NVIDIA H100 80GB HBM3",
    ),
    "h200": HardwareProfile(
        name="h200",
        gpu_memory=143771 * MiB,  # datasheet 141 GB HBM3e; nvidia-smi reports 143771 MiB total
        gpu_hbm_bandwidth=4.8e12,  # datasheet: 4.8 TB/s
        gpu_flops_bf16=989 * T,  # datasheet: 989 TFLOPS dense bf16 (1,979 with sparsity)
        gpu_flops_fp16=989 * T,  # datasheet: 989 TFLOPS dense fp16
        gpu_flops_fp32=67 * T,  # datasheet: 67 TFLOPS fp32
        pcie_h2d=55 * GB,  # measured on our H200 host: 55 GB/s h2d for 2.8 GB pages from a cudaHostRegister'ed pool (DESIGN.md)
        pcie_d2h=50 * GB,  # assumption: PCIe 5 x16; a measured profile (moe-batch profile) replaces it
        host_memory=128 * GiB,  # our H200 host: 128 GiB (DESIGN.md)
        host_memory_bandwidth=100 * GB,  # assumption; a measured profile replaces it
        cpu_attention_bandwidth=50 * GB,  # assumption: 16 cores streaming bf16 KV; replace with the measured profile
        cpu_attention_flops=1 * T,  # assumption: 16 cores; replace with the measured profile
        cpu_cores=16,  # our H200 host: 16 cores (DESIGN.md)
        source="NVIDIA H200 datasheet; pcie_h2d, host_memory, cpu_cores from our host (DESIGN.md); CPU throughput assumed",
        gpu_name="NVIDIA H200",
    ),
}
PRESETS["a100"] = replace(PRESETS["a100-40g"], name="a100")  # alias used in DESIGN.md


def get_preset(name: str) -> HardwareProfile:
    """A preset by name (``t4``, ``l4``, ``a100-40g``/``a100``, ``h100``, ``h200``). Raises HardwareError."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown hardware preset {name!r} (presets: {', '.join(PRESETS)}; or a profile .yaml)") from None


def resolve_hardware(name_or_path: str) -> HardwareProfile:
    """A preset name, or the path of a profile YAML (anything ending in .yaml/.yml or naming a file).

    Raises HardwareError / FileNotFoundError.
    """
    import os

    if name_or_path.lower() in PRESETS:
        return get_preset(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or os.path.exists(name_or_path):
        if not os.path.isfile(name_or_path):
            raise HardwareError(f"{name_or_path}: no such hardware profile file")
        return HardwareProfile.load(name_or_path)
    return get_preset(name_or_path)
