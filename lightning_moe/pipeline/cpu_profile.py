"""Measure a CPU-only host for the CPU executor's roofline (policy.cpu_hrm): peak rates and per-call costs.

Each number is a micro-benchmark, the minimum over many repeats of a short timed loop (the machine's best, as a
roofline's peak is; a loop of a few calls, or a single call of a long op, so that a machine shared with other
processes still shows its peak between their time slices: a long loop almost always holds a preemption): a large fp32 (and bf16) matmul's FLOP/s, a 64 MiB copy's bandwidth (bytes read + written), the per-call cost of a
small ``F.linear``, a small element-wise op, a view op, a nonzero, a tiny CPU decode-attention call, a hand-off to a
worker thread and an fsync'd record append, an argmax's rate over logits rows, and the write rate of an advanced-index scatter into a KV-cache-shaped tensor. A few seconds in all, run
with the process's torch thread count (which the executors use).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..policy.cpu_hrm import CpuProfile
from ..policy.hardware import MiB


def _per_call(fn: Callable[[], object], calls: int, repeats: int = 40) -> float:
    """Seconds per call of ``fn``: the best over ``repeats`` loops of ``calls`` calls, after one warm-up loop (short
    loops, many repeats: the peak of a shared machine)."""
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 256) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` (2 n^3 FLOP per call)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _per_call(lambda: torch.mm(a, b), 1, 60)


HEAD_ROWS = (16, 64, 256)  # rows of the lm_head-shaped GEMMs measured (cpu_hrm.HEAD_ROWS: which one a head uses)


COLD_BYTES = 64 * MiB  # weights a cold timing rotates through: more than the last-level cache of the hosts we meet


def head_matmul_flops(rows: int = 64, hidden: int = 64, vocab: int = 32768, rounds: int = 4) -> float:
    """FLOP/s of an lm_head-shaped fp32 ``F.linear``: ``rows`` x ``hidden`` times a ``vocab`` x ``hidden`` weight, a
    short reduction into a vocabulary-wide output (8 MiB: beyond the L2), which runs far below a square matmul's
    peak (its output's stores, not its multiply-adds, set its time). Timed cold: the calls rotate over copies of the
    weight that together exceed the caches (COLD_BYTES), so each call reads its weight from memory, as a decode step's
    head does after the layers (on the development VM the 16-row call reads 0.55-0.6 ms warm, 1.4-1.5 ms cold,
    1.3-1.8 ms inside the README job's serial steps). The best call of ``rounds`` rounds after one warm-up round."""
    x = torch.randn(rows, hidden)
    ws = [torch.randn(vocab, hidden) for _ in range(max(2, COLD_BYTES // (vocab * hidden * 4)))]
    best = float("inf")
    for r in range(rounds + 1):
        for w in ws:
            t0 = time.perf_counter()
            F.linear(x, w)
            if r:
                best = min(best, time.perf_counter() - t0)
    return 2 * rows * hidden * vocab / best


def memory_bandwidth(nbytes: int = 64 * MiB) -> float:
    """Copy bandwidth in bytes/s: 2 nbytes / time of ``dst.copy_(src)`` (read + write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _per_call(lambda: dst.copy_(src), 1, 25)


def call_costs(calls: int = 40) -> dict:
    """Per-call seconds of the small ops the executors issue at decode shapes: ``gemm_call`` (F.linear of 16 rows
    64 -> 128), ``op_call`` (:func:`op_mix_call`), ``view_call`` (a select), ``attention_call`` (the CPU
    decode-attention routine on 4 rows of 16 positions), ``argmax_rate`` and ``sample_rate`` (elements/s of greedy's
    argmax and of the sampler at temperature 1, over 16 rows of 32,000 logits)."""
    from ..kernels.sampling import keys_from_seeds, sample_tokens
    from .cpu_attention import cpu_decode_attention

    x, w = torch.randn(16, 64), torch.randn(128, 64)
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16, 16), torch.randn(4, 2, 16, 16)
    lengths = torch.full((4,), 16, dtype=torch.int64)
    out = {"gemm_call": _per_call(lambda: F.linear(x, w), calls), "op_call": op_mix_call(calls // 4),
           "view_call": _per_call(lambda: x.select(0, 3), calls),
           "attention_call": _per_call(lambda: cpu_decode_attention(q, k, v, lengths), calls // 4)}
    ids = torch.randint(0, 8, (32,))
    out["nonzero_call"] = _per_call(lambda: torch.where(ids == 3), calls // 2)
    logits = torch.randn(16, 32000)
    out["argmax_rate"] = logits.numel() / _per_call(lambda: logits.argmax(dim=-1), 1, 30)
    seeds = [(s * 0x9E3779B97F4A7C15) & ((1 << 63) - 1) for s in range(1, 17)]  # a sampled step's per-row keys
    out["sample_rate"] = logits.numel() / _per_call(
        lambda: sample_tokens(logits, 1.0, keys=keys_from_seeds(seeds)), 1, 10)
    return out


def sdpa_rate(rows: int = 4, heads: int = 4, seq: int = 256, head_dim: int = 16) -> float:
    """(query, key, head) pairs per second of torch's CPU ``scaled_dot_product_attention`` with ``is_causal`` over a
    padded [rows, heads, seq, head_dim] layout, every pair of the seq x seq square counted (the causal half the kernel
    skips too): the prefill's packed attention on the CPU. At a small head dim the per-score work of the softmax
    (exp, max, sum), not the QK^T / PV FLOPs, sets its time."""
    q, k, v = (torch.randn(rows, heads, seq, head_dim) for _ in range(3))
    with torch.inference_mode():
        t = _per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 1, 15)
    return rows * heads * seq * seq / t


def record_write(directory: str, calls: int = 20) -> float:
    """Seconds to append one ~1 KB line to a file in ``directory`` and fsync it (the results writer's per-record
    cost)."""
    import tempfile

    line = b"x" * 1023 + b"\n"
    fd, path = tempfile.mkstemp(dir=directory, prefix=".record-probe-")
    try:
        def write():
            os.write(fd, line)
            os.fsync(fd)

        return _per_call(write, 1, calls)
    finally:
        os.close(fd)
        os.unlink(path)


MIX_OPS = 16  # non-GEMM ops of one :func:`op_mix_call` iteration


def op_mix_call(calls: int = 10) -> float:
    """Seconds per non-GEMM op of the mix a decoder layer issues at decode shapes (16 rows, hidden 64): an RMSNorm
    (pow, mean, add, rsqrt, mul, mul), SiLU and a product, a router's softmax, top-k and renormalization (sum, div), an
    expert's id match, a zeroed buffer and a gather / scatter pair: MIX_OPS ops, each on fresh outputs as a layer's
    are (a single op repeated on the same tensors is faster than the mix the executors run)."""
    x, wn = torch.randn(16, 64), torch.randn(64)
    idx = torch.arange(0, 16, 2)

    def mix():
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = x * r * wn
        m = F.silu(h) * h
        p = torch.softmax(m[:, :8], dim=-1)
        wt, ids = torch.topk(p, 2, dim=-1)
        wt = wt / wt.sum(-1, keepdim=True)
        hit = ids == 3
        z = torch.zeros(16, 64)
        z[idx] = h[idx]
        return wt, hit, z

    return _per_call(mix, calls) / MIX_OPS


def scatter_bandwidth(rows: int = 64, positions: int = 256, heads: int = 2, head_dim: int = 16) -> float:
    """Bytes/s of values written by the grouped KV cache's prefill write (``kv_cache.scatter_prefill``, what
    ``GroupedKVCache.write_prefill_index`` runs: on a CPU cache the native row scatter where the kernel is available,
    else one index_put) of a packed chunk holding every position of ``rows`` rows of a [rows, heads, positions,
    head_dim] fp32 cache, in the chunk's order."""
    from .kv_cache import PrefillIndex, scatter_prefill

    K = torch.zeros(rows * heads * positions, head_dim)  # the layer's flat array: [row, head, position] blocks
    tok = torch.arange(rows * positions)  # packed token i: row i // positions, position i % positions
    base = (tok // positions) * heads * positions + tok % positions  # [n] its head-0 row of the flat array
    index = PrefillIndex(None, base[:, None] + torch.arange(heads)[None, :] * positions)  # [n, heads]
    x = torch.randn(rows * positions, heads, head_dim)

    def write():
        scatter_prefill(K, x, index)

    bw = x.numel() * x.element_size() / _per_call(write, 1, 10)
    if not torch.equal(K.view(rows, heads, positions, head_dim), x.view(rows, positions, heads, head_dim).transpose(1, 2)):
        raise RuntimeError("scatter_bandwidth: the prefill write did not store the chunk where the cache layout puts it")
    return bw


# The glue probe: a small Mixtral-architecture model that is not any job's (its own sizes, random weights) decoded by
# the serial executor at PROBE_ROWS rows, to measure what the executor's own Python code adds to each torch op it
# issues (function frames, argument handling, the expert loop's bookkeeping, cold instruction caches over a long
# and varied op stream) beyond the call costs the tight loops above measure.
PROBE_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 512,
                "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 24, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": None,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
PROBE_ROWS, PROBE_PROMPT, PROBE_STEPS = 16, 24, 12  # decode rows, prompt tokens per row, decode steps per run


def _count_ops(fn: Callable[[], object]) -> dict:
    """Torch ops ``fn`` issues, by class: {"gemm", "op", "view"} (a dispatch counter; the classes of cpu_hrm's
    OP_COUNTS)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemm = {"aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul"}
    view = {"aten.view", "aten.select", "aten.slice", "aten.unsqueeze", "aten.alias", "aten.reshape", "aten.expand",
            "aten.permute", "aten.transpose", "aten.t", "aten.detach", "aten.detach_", "aten.lift_fresh",
            "aten.resolve_conj", "aten.resolve_neg", "aten.promote_types", "aten.to", "aten.squeeze",
            "aten._unsafe_view", "aten.as_strided", "aten.item", "aten._local_scalar_dense", "aten.split",
            "aten.chunk", "aten.unbind"}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            out[("gemm" if name in gemm else "view" if name in view else "op")] += 1
            return func(*args, **(kwargs or {}))

    out = {"gemm": 0, "op": 0, "view": 0}
    with Counter():
        fn()
    return out


def glue_call(costs: dict, repeats: int = 6) -> float:
    """Seconds the serial executor's Python code adds per torch op it issues (GEMMs and other ops; views are
    ``view_call``'s), beyond ``costs`` (``call_costs``'s gemm_call, op_call, view_call, attention_call, argmax_rate):
    the best decode step of the probe model (PROBE_CONFIG, PROBE_ROWS rows; its matmuls and attention bodies are
    microseconds), less its counted ops at those costs and its argmax, over its GEMMs + ops. >= 0."""
    from ..model.spec import MoESpec
    from ..model.weights import dummy_weights
    from .sampling import DecodeSampling
    from .serial import SerialExecutor

    spec = MoESpec.from_hf_config(dict(PROBE_CONFIG), name="cpu-profile-probe")
    ex = SerialExecutor(dummy_weights(spec, torch.float32, seed=7), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec.vocab_size, (PROBE_PROMPT,), generator=g).tolist() for _ in range(PROBE_ROWS)]

    def run(steps: int, marks: list) -> None:
        ex.generate(prompts, DecodeSampling(steps + 1, stop_at_eos=False), on_step=lambda n: marks.append(
            time.perf_counter()))

    c1, c2 = _count_ops(lambda: run(1, [])), _count_ops(lambda: run(2, []))
    n = {k: c2[k] - c1[k] for k in c1}  # one decode step's ops
    best = float("inf")
    for _ in range(repeats):
        marks: list = []
        run(PROBE_STEPS, marks)
        best = min([best] + [b - a for a, b in zip(marks, marks[1:])])
    known = (n["gemm"] * costs["gemm_call"] + n["op"] * costs["op_call"] + n["view"] * costs["view_call"]
             + spec.num_layers * costs["attention_call"] + PROBE_ROWS * spec.vocab_size / costs["argmax_rate"])
    return max(0.0, (best - known) / (n["gemm"] + n["op"]))


def machine_key() -> str:
    """What a cached CPU profile is valid for: CPU model, logical CPUs, torch threads, torch version."""
    return f"{cpu_model()} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_memory_bytes() -> int:
    """Physical memory in bytes (sysconf), 0 when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_cpu_profile(name: str = "cpu", directory: str = "") -> CpuProfile:
    """This host's :class:`CpuProfile` (a few seconds); the record write is timed in ``directory`` (default: the
    system's temporary directory)."""
    import tempfile

    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0
    bf16 = matmul_flops(torch.bfloat16, 256) if hasattr(torch, "bfloat16") else 0.0
    costs = call_costs()
    costs["glue_call"] = glue_call(costs)
    return CpuProfile(
        name=name, machine=machine_key(), cpu_model=cpu_model(), cpu_cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(), torch_version=str(torch.__version__), host_memory=host_memory_bytes(),
        memory_bandwidth=memory_bandwidth(), matmul_flops_fp32=matmul_flops(torch.float32), matmul_flops_bf16=bf16,
        head_matmul_flops_few=head_matmul_flops(HEAD_ROWS[0]), head_matmul_flops=head_matmul_flops(HEAD_ROWS[1]),
        head_matmul_flops_many=head_matmul_flops(HEAD_ROWS[2]),
        scatter_bandwidth=scatter_bandwidth(), sdpa_rate=sdpa_rate(), record_write=record_write(directory or tempfile.gettempdir()),
        load_average=load, source="measured by lightning_moe.pipeline.cpu_profile "
        "(best of repeated micro-benchmarks)", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **costs)
