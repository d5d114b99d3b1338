"""GPU benchmarks of CGOPipe against the HRM prediction, the serial executor and accelerate offload.

Run on a CUDA host (not a test):

    python benchmarks/bench_cgopipe.py --profile lightning_moe/policy/profiles/h200-host.yaml \
        --cases full32-24g-g32,l8-6g-g128 --out /tmp/bench

Every (case, executor) runs in its own subprocess (pinned pools and GPU caps do not leak between
them) and prints one JSON line; the driver writes ``bench.jsonl`` and a Markdown block
for benchmarks/RESULTS.md (``results_block.md``) into ``--out``.

Model: the Mixtral-8x7B config (policy/registry.py) with deterministic dummy bf16 weights. To keep set-up
within the device budget, every layer shares ONE set of random expert tensors (the host pool still
holds a separate copy per layer and every page crosses PCIe; routing differs per layer because the
hidden states do). Prompts: the 80 MT-Bench first-turn questions, chat template applied, tokenized with
the Mixtral v1 tokenizer (the tiny-mixtral tokenizer is that vocabulary), repeated to fill the batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GiB = 1 << 30


@dataclass(frozen=True)
class Case:
    """One benchmark setting."""

    name: str  # case id used on the command line
    layers: Optional[int] = None  # decoder layers (None = the full 32 of Mixtral-8x7B); scaled runs say so
    gpu_cap: int = 24 * GiB  # GPU memory cap in bytes (set_per_process_memory_fraction + planner budget)
    cpu_cap: int = 104 * GiB  # host memory budget in bytes for the planner (126 GiB host: leaves room for the process)
    gen_len: int = 32  # tokens generated per sequence
    quant: str = "bf16"  # expert page format
    executors: tuple = ("cgopipe",)  # which executors to run: cgopipe, serial, accelerate
    baseline_steps: int = 3  # decode steps timed for the serial / accelerate baselines
    baseline_batches: tuple = (16, 64)  # batch sizes tried for the baselines (best is reported)
    accel_gpu_fracs: tuple = (0.65, 0.45)  # accelerate: share of the cap for weights (max_memory), tried until one fits
    ffn: str = "triton"  # CGOPipe expert FFN: "triton" (fused grouped kernel, sync-free) or "torch" (reference loop)
    requests: Optional[int] = None  # prompts in the job (caps the planner's N; None = as many as the plan wants)
    cpu_threads: Optional[int] = None  # CGOPipe's cpu_threads (None: torch's default intra-op threads)
    variants: tuple = ()  # A/B settings re-run on the same executor after the main run (parse_variants)


CASES = {c.name: c for c in [
    Case("full32-24g-g32", None, 24 * GiB, gen_len=32),
    Case("full32-16g-g32", None, 16 * GiB, gen_len=32),
    Case("full32-24g-g128", None, 24 * GiB, gen_len=128),
    # scaled: 8 of 32 layers; a 10 GiB cap keeps ~88% of the experts off the GPU, as 24 GiB does for 32 layers
    Case("l8-10g-g128", 8, 10 * GiB, cpu_cap=40 * GiB, gen_len=128, executors=("cgopipe", "serial", "accelerate")),
    Case("l8-10g-g32", 8, 10 * GiB, cpu_cap=40 * GiB, gen_len=32, executors=("cgopipe", "serial", "accelerate")),
    Case("l4-8g-g16", 4, 8 * GiB, cpu_cap=24 * GiB, gen_len=16, executors=("cgopipe", "serial", "accelerate"),
         baseline_steps=2, baseline_batches=(16,)),
    # the baseline users would pick at full size: accelerate offload, 24 GiB cap (each step streams ~70 GB of offloaded
    # weights through pageable memory). Run 19: 0.8 of the cap for weights ran out of memory in batch 64's prefill.
    Case("full32-24g-accel", None, 24 * GiB, gen_len=32, executors=("accelerate",), baseline_steps=2,
         baseline_batches=(64, 128)),
    # issue 6: the same settings with int4 expert pages (group 128), against the bf16 case of the same run
    Case("full32-24g-g128-int4", None, 24 * GiB, gen_len=128, quant="int4"),
    # the same with a job of 512 prompts (N <= 512): gen 128 at full size fits one 10-minute device call
    Case("full32-24g-g128-r512", None, 24 * GiB, gen_len=128, requests=512),
    Case("full32-24g-g128-r512-int4", None, 24 * GiB, gen_len=128, quant="int4", requests=512),
    # a ~2-minute full-size bf16 case for A/B runs (e.g. --variants) inside one device call
    Case("full32-24g-g32-r512", None, 24 * GiB, gen_len=32, requests=512),
    Case("full32-24g-g32-int4", None, 24 * GiB, gen_len=32, quant="int4"),
    # ~1-minute int4 run (CPU attention binds): A/B of --variants on one executor
    Case("full32-24g-g32-r512-int4", None, 24 * GiB, gen_len=32, quant="int4", requests=512),
    Case("full32-16g-g32-int4", None, 16 * GiB, gen_len=32, quant="int4"),
    Case("l8-10g-g32-int4", 8, 10 * GiB, cpu_cap=40 * GiB, gen_len=32, quant="int4"),
]}


# ---------------------------------------------------------------------------------------------------
def spec_for(case: Case):
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("mixtral-8x7b")
    return spec.with_layers(case.layers) if case.layers else spec


def mtbench_prompts() -> list[list[int]]:
    """MT-Bench first turns, chat template, Mixtral v1 tokenizer."""
    from lightning_moe.data.sources import mtbench_question_file
    from lightning_moe.data.tokenize import load_tokenizer
    from lightning_moe.model.tiny import ensure_tiny_mixtral

    path = os.environ.get("MTBENCH_QUESTIONS") or mtbench_question_file()
    tok = load_tokenizer(ensure_tiny_mixtral())
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)["turns"][0]
                ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                out.append(tok(ids, add_special_tokens=False).input_ids)
    return out


def fill(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Repeat the prompt list to exactly n prompts."""
    return [prompts[i % len(prompts)] for i in range(n)]


def shared_dummy_weights(spec, dtype=torch.bfloat16, seed=0, quant: str = "bf16"):
    """Non-expert weights random per layer; one random expert set shared by every layer (see module doc).

    ``quant`` "int4" / "int2-up" / ...: the shared experts are packed into uniform pages
    (kernels.quant.pack_expert_pages, group 128, fp16 scales; on the GPU when there is one, which takes
    seconds instead of minutes) and every layer gets the same :class:`QuantExperts` (host tensors).
    """
    from lightning_moe.model.families import family_of
    from lightning_moe.model.layers import ExpertWeights
    from lightning_moe.model.quantized import QuantExperts
    from lightning_moe.model.weights import ModelWeights

    LayerWeights = family_of(spec).layer_weights  # the Mixtral family's (attn_norm, wq, wk, wv, wo, ffn_norm, router)

    g = torch.Generator().manual_seed(seed)
    block = torch.randn(1 << 24, generator=g, dtype=torch.float32)  # 16 Mi random values, tiled (randn of
    # tens of G values would take minutes); each tensor starts at a different offset of the block

    def tiled(*shape, std=0.02):
        n = 1
        for d in shape:
            n *= d
        off = int(torch.randint(0, block.numel(), (1,), generator=g))
        reps = -(-(n + off) // block.numel())
        return (block.repeat(reps)[off : off + n] * std).to(dtype).view(*shape)

    rnd = tiled
    D, F, E = spec.hidden_size, spec.intermediate_size, spec.num_experts
    layers = [LayerWeights(torch.ones(D, dtype=dtype), rnd(spec.q_size, D), rnd(spec.kv_size, D), rnd(spec.kv_size, D),
                           rnd(D, spec.q_size), torch.ones(D, dtype=dtype), rnd(E, D, std=1.0)) for _ in range(spec.num_layers)]
    shared = ExpertWeights(tiled(E, F, D), tiled(E, F, D), tiled(E, D, F))
    if quant not in ("bf16", "fp16", "fp32"):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        shared = QuantExperts.quantize(ExpertWeights(*(t.to(dev) for t in (shared.w1, shared.w3, shared.w2))), quant)
        shared = QuantExperts(shared.pages.cpu(), shared.layout)
        if dev == "cuda":
            torch.cuda.empty_cache()  # the packing temporaries must not count against the cap's budget
    experts = [shared for _ in range(spec.num_layers)]
    return ModelWeights(spec, rnd(spec.vocab_size, D, std=1.0), torch.ones(D, dtype=dtype), rnd(spec.vocab_size, D), layers, experts)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress to stderr with seconds since start (shows where a timed-out case was)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def cap_gpu(cap: int) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)


# ---------------------------------------------------------------------------------------------------
def _log_decode_progress(ex, every: int) -> None:
    """Log the decode rate every ``every`` steps (wraps the executor's step), so a run cut by its time limit
    still shows how fast it was going (the log is in the timeout's error message)."""
    step, inner = [0, time.perf_counter()], ex._decode_step

    def logged(mbs, tokens):
        out = inner(mbs, tokens)
        step[0] += 1
        if step[0] % every == 0:
            torch.cuda.synchronize()
            rows = sum(len(mb.rows) for mb in mbs)
            now = time.perf_counter()
            log(f"decode step {step[0]}: {every * rows / (now - step[1]):.0f} tok/s over the last {every} steps")
            step[1] = now
        return out

    ex._decode_step = logged


def parse_variants(text: str) -> tuple:
    """``"threads=12;threads=8,gen=16;default"`` -> ({"threads": 12}, {"threads": 8, "gen": 16}, {}).

    Keys: ``threads`` (CGOPipe cpu_threads), ``gen`` (tokens per
    sequence; default the case's), ``attn`` (CPU attention routine: ``native`` kernel, default, or ``sdpa``:
    PyTorch's, through LIGHTNING_MOE_CPU_ATTENTION), ``prefill`` (``ROWSxTOKENS``: the prefill micro-batch's rows
    and padded tokens, Policy.prefill_mu / prefill_tokens; default the plan's), ``switch`` (seconds: Python's thread
    switch interval, ``sys.setswitchinterval``, during the run; default 0.005, Python's own: a shorter one hands the
    GIL to the CPU-attention worker sooner while the host thread issues GPU work), ``h2d`` (``kernel`` or ``dma``:
    CGOPipe's attention_h2d, how CPU attention outputs reach the GPU; default the executor's), ``gattn`` (``torch`` or
    ``triton``: CGOPipe's gpu_attention, the GPU-attention micro-batches' append + attention; default torch), ``pages``
    (``after_attention`` or ``visit_start``: CGOPipe's page_issue, when a decode layer issues the next layer's pages;
    default after_attention), ``ahead`` (``on`` or ``off``: CGOPipe's layer_lookahead, a CPU micro-batch's next-layer
    attention submitted right after its post-attention; default on).
    ``default`` (an empty variant) re-runs the case's own settings, which
    shows the run-to-run spread next to the A/B differences. Raises ValueError on an unknown key.
    """
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        v = {}
        if part != "default":
            for kv in part.split(","):
                key, _, val = kv.partition("=")
                key, val = key.strip(), val.strip()
                if key not in ("threads", "gen", "attn", "prefill", "switch", "h2d", "gattn", "pages", "ahead"):
                    raise ValueError(f"--variants: unknown key {key!r} in {part!r} (threads, gen, attn, prefill, "
                                     f"switch, h2d, gattn, pages, ahead)")
                if key == "ahead" and val not in ("on", "off"):
                    raise ValueError(f"--variants: ahead must be on or off, got {val!r}")
                if key == "pages" and val not in ("after_attention", "visit_start"):
                    raise ValueError(f"--variants: pages must be after_attention or visit_start, got {val!r}")
                if key == "gattn" and val not in ("torch", "triton"):
                    raise ValueError(f"--variants: gattn must be torch or triton, got {val!r}")
                if key == "h2d" and val not in ("kernel", "dma"):
                    raise ValueError(f"--variants: h2d must be kernel or dma, got {val!r}")
                if key == "attn" and val not in ("native", "sdpa"):
                    raise ValueError(f"--variants: attn must be native or sdpa, got {val!r}")
                if key == "prefill":
                    rows, _, tok = val.partition("x")
                    if not (rows.isdigit() and tok.isdigit() and int(rows) > 0 and int(tok) > 0):
                        raise ValueError(f"--variants: prefill must be ROWSxTOKENS (e.g. 128x16384), got {val!r}")
                    v[key] = (int(rows), int(tok))
                elif key == "switch":
                    try:
                        v[key] = float(val)
                    except ValueError:
                        v[key] = -1.0
                    if not 0 < v[key] <= 1:
                        raise ValueError(f"--variants: switch must be seconds in (0, 1], got {val!r}")
                else:
                    v[key] = val if key in ("attn", "h2d", "gattn", "pages", "ahead") else int(val)
        out.append(v)
    return tuple(out)


def _apply_variant(ex, case: Case, v: dict, policy) -> None:
    """Set a variant's knobs on a built executor (anything not named goes back to the case's / the plan's setting)."""
    rows, tok = v.get("prefill", (policy.prefill_mu, policy.prefill_tokens))
    ex.policy = dataclasses.replace(policy, prefill_mu=rows, prefill_tokens=tok)
    n = v.get("threads", case.cpu_threads or _DEFAULT_THREADS)
    torch.set_num_threads(n)  # torch's intra-op setting, here and on the CPU-attention worker thread (CUDA)
    if ex.attention.workers is not None:
        ex.attention.workers.submit(torch.set_num_threads, n).result()
    os.environ["LIGHTNING_MOE_CPU_ATTENTION"] = "sdpa" if v.get("attn") == "sdpa" else "auto"  # read at every call
    sys.setswitchinterval(v.get("switch", _DEFAULT_SWITCH))
    if not hasattr(ex, "_bench_h2d"):
        ex._bench_h2d = ex.attention.attention_h2d  # the executor's own choice ("auto" resolved)
    ex.attention.attention_h2d = v.get("h2d", ex._bench_h2d)
    ex.attention.gpu_attention = v.get("gattn", "torch")
    ex.opts = dataclasses.replace(ex.opts, page_issue=v.get("pages", "after_attention"),
                                  layer_lookahead=v.get("ahead", "on") == "on")


_DEFAULT_THREADS = torch.get_num_threads()
_DEFAULT_SWITCH = sys.getswitchinterval()


def native_split(st: dict) -> Optional[dict]:
    """The native CPU attention kernel's time split over a decode (executor stats ``cpu_attention_native_*``,
    kernels.cpu_attention.native_stats): region wall seconds against the worker's ``cpu_attention_compute`` (the
    rest is the Python wrapper and GIL hand-offs), the team's efficiency (busy / team thread-seconds), the mean
    wake-up lag and tail per call (ms), the mean team size, and GB/s of valid KV over the region time alone."""
    calls = st.get("cpu_attention_native_calls", 0)
    if not calls:
        return None
    region = st["cpu_attention_native_region_s"]
    kv = st.get("cpu_attention_valid_kv_bytes", 0)
    return {"calls": int(calls), "region_s": region, "compute_s": st.get("cpu_attention_compute", 0.0),
            "efficiency": st["cpu_attention_native_busy_thread_s"] / max(st["cpu_attention_native_team_thread_s"], 1e-12),
            "lag_ms": st["cpu_attention_native_lag_s"] / calls * 1e3,
            "tail_ms": st["cpu_attention_native_tail_s"] / calls * 1e3,
            "team": st["cpu_attention_native_threads"] / calls, "region_GBps": kv / max(region, 1e-12) / 1e9}


def native_line(n: Optional[dict]) -> str:
    """One log line of :func:`native_split`."""
    if not n:
        return "native kernel: no calls"
    return (f"native kernel: {n['calls']} calls, region {n['region_s']:.1f} s of {n['compute_s']:.1f} s compute "
            f"({n['region_GBps']:.1f} GB/s over the regions), team {n['team']:.1f} threads at {n['efficiency']:.0%} "
            f"busy, lag {n['lag_ms']:.2f} ms, tail {n['tail_ms']:.2f} ms per call")


def _timed_generate(ex, prompts, gen_len: int) -> dict:
    """One timed generation on a warm executor: rates, stage times (s), CPU attention rate (valid KV bytes/s)."""
    from lightning_moe.pipeline.sampling import DecodeSampling

    ex.stats.__init__()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ex.generate(prompts, DecodeSampling(max_new_tokens=gen_len, stop_at_eos=False))
    wall = time.perf_counter() - t0
    s = ex.stats
    st = dict(s.extra)
    kv = st.get("cpu_attention_valid_kv_bytes", 0)
    return {
        "gen_len": gen_len, "prefill_tok_s": s.prefill_tokens / s.prefill_seconds,
        "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
        "e2e_tok_s": s.generated_tokens / wall, "wall_seconds": wall,
        "decode_seconds": s.decode_seconds, "prefill_seconds": s.prefill_seconds,
        "h2d_GB": s.h2d_bytes / 1e9, "d2h_GB": s.d2h_bytes / 1e9, "stages": st,
        "h2d_busy_frac_decode": st.get("h2d_copy", 0) / s.decode_seconds if s.decode_seconds else None,
        "cpu_attention_GBps": kv / st["cpu_attention_compute"] / 1e9 if st.get("cpu_attention_compute") else None,
        "cpu_attention_native": native_split(st),
        "peak_gpu_GiB": torch.cuda.max_memory_allocated() / GiB if cuda else 0.0,
    }


def run_cgopipe(case: Case, profile: str) -> dict:
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.policy.hardware import resolve_hardware
    from lightning_moe.policy.milp import plan
    from lightning_moe.policy.policy import Budgets, Workload

    spec = spec_for(case)
    hw = resolve_hardware(profile)
    base = mtbench_prompts()
    lens = [len(p) for p in base]
    # the 80 lengths (the batch repeats them, so its grouped-KV padding is theirs); N capped by case.requests
    wl = dataclasses.replace(Workload.from_lengths(lens, case.gen_len, name="mtbench"), num_requests=case.requests)
    budgets = Budgets(gpu_memory=case.gpu_cap, cpu_memory=case.cpu_cap, weight_quant=case.quant, dtype="bf16")
    t0 = time.perf_counter()
    policy, est = plan(spec, hw, wl, budgets)
    t_plan = time.perf_counter() - t0
    log(f"planned in {t_plan:.1f} s: mu={policy.mu} n={policy.n} N={policy.N} prefill_mu={policy.prefill_mu} "
        f"resident={sum(policy.resident_counts(spec))} gpu_attn={policy.n_gpu_attn}; predicted decode {est.decode_tok_s:.0f} tok/s")
    prompts = fill(base, policy.N)
    cap_gpu(case.gpu_cap)
    t0 = time.perf_counter()
    w = shared_dummy_weights(spec, quant=case.quant)
    log(f"dummy weights ready ({case.quant} expert pages)")
    ex = CGOPipeExecutor(w, policy, "cuda", torch.bfloat16, ffn=case.ffn, cpu_threads=case.cpu_threads)
    del w
    t_setup = time.perf_counter() - t0
    log(f"executor ready in {t_setup:.1f} s (pool {ex.weight_stream.pool.nbytes / GiB:.1f} GiB, attention outputs by {ex.attention.attention_h2d})")
    # warm-up: Triton compiles one kernel per tile config (chosen by tokens per expert) on first use; two short
    # runs hit the prefill (large) and decode (small, medium) configs, so the timed run measures steady state
    t0 = time.perf_counter()
    for rows in (8, min(128, policy.mu)):
        ex.generate(prompts[:rows], DecodeSampling(max_new_tokens=2, stop_at_eos=False))
    t_warm = time.perf_counter() - t0
    log(f"warm-up (kernel compilation) {t_warm:.1f} s")
    _log_decode_progress(ex, every=16)
    main = _timed_generate(ex, prompts, case.gen_len)
    log(f"generated: prefill {main['prefill_seconds']:.1f} s, decode {main['decode_seconds']:.1f} s, CPU attention "
        f"{main['cpu_attention_GBps'] or 0:.1f} GB/s of valid KV")
    log(native_line(main["cpu_attention_native"]))
    variants = []
    for v in case.variants:  # A/B on the same executor: no second set-up
        _apply_variant(ex, case, v, policy)
        try:
            r = _timed_generate(ex, prompts, v.get("gen", case.gen_len))
        except torch.OutOfMemoryError as e:  # e.g. a larger prefill micro-batch: keep the main result
            log(f"variant {v}: out of memory: {e}")
            variants.append({"variant": v, "error": "CUDA out of memory"})
            torch.cuda.empty_cache()
            continue
        r["variant"] = v
        variants.append(r)
        log(f"variant {v}: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s, "
            f"CPU attention {r['cpu_attention_GBps'] or 0:.1f} GB/s")
        log(native_line(r["cpu_attention_native"]))
    _apply_variant(ex, case, {}, policy)
    ex.close()
    return {
        "executor": "cgopipe", "ffn": case.ffn, "attention_h2d": getattr(ex, "_bench_h2d", ex.attention.attention_h2d),
        "cpu_threads": case.cpu_threads,
        "torch_threads": _DEFAULT_THREADS, "policy": dataclasses.asdict(policy), "plan_seconds": t_plan,
        "setup_seconds": t_setup, "warmup_seconds": t_warm, "N": policy.N, "prompt_len_mean": wl.prompt_len,
        **main,
        "pred_prefill_tok_s": est.prefill_tok_s, "pred_decode_tok_s": est.decode_tok_s, "pred_e2e_tok_s": est.e2e_tok_s,
        "pred_decode_binding": est.decode_binding, "pred_decode_stages": est.decode_stages, "variants": variants,
    }


def run_serial(case: Case, profile: str) -> dict:
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.pipeline.serial import SerialExecutor

    spec = spec_for(case)
    cap_gpu(case.gpu_cap)
    w = shared_dummy_weights(spec)
    ex = SerialExecutor(w, "cuda", torch.bfloat16)
    best = None
    for b in case.baseline_batches:
        ex.stats.__init__()
        ex.generate(fill(mtbench_prompts(), b), DecodeSampling(max_new_tokens=case.baseline_steps + 1, stop_at_eos=False))
        s = ex.stats
        r = {"batch": b, "decode_tok_s": s.decode_tokens / s.decode_seconds, "step_seconds": s.decode_seconds / s.decode_steps,
             "prefill_tok_s": s.prefill_tokens / s.prefill_seconds}
        best = r if best is None or r["decode_tok_s"] > best["decode_tok_s"] else best
    return {"executor": "serial", **best, "peak_gpu_GiB": torch.cuda.max_memory_allocated() / GiB}


def _accelerate_model(spec, gpu_weight_bytes: int):
    """Mixtral ``spec`` in transformers (eager experts) with deterministic dummy bf16 weights, dispatched by accelerate
    with at most ``gpu_weight_bytes`` of weights on GPU 0 and the rest offloaded to CPU. Returns (model, device map)."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                        num_key_value_heads=spec.num_kv_heads, num_local_experts=spec.num_experts,
                        num_experts_per_tok=spec.top_k, max_position_embeddings=4096, rope_theta=spec.rope_theta)
    cfg._experts_implementation = "eager"  # transformers 5's default batched_mm gathers [T*k, 2F, D] weights: OOM at any cap
    with init_empty_weights():
        model = MixtralForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    block = torch.randn(1 << 24, generator=g, dtype=torch.bfloat16) * 0.02  # tiled, as in shared_dummy_weights
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                flat = p.view(-1)
                for i in range(0, flat.numel(), block.numel()):
                    m = min(block.numel(), flat.numel() - i)
                    flat[i : i + m].copy_(block[:m])
    log("accelerate model materialized on the CPU")
    model.eval()
    dmap = infer_auto_device_map(model, max_memory={0: gpu_weight_bytes, "cpu": 200 * GiB},
                                 no_split_module_classes=["MixtralDecoderLayer"], dtype=torch.bfloat16)
    return dispatch_model(model, device_map=dmap), dmap


def _accelerate_batch(model, base, b: int, steps: int, gen_len: int) -> dict:
    """Time ``model.generate`` (greedy) on ``b`` MT-Bench prompts, left-padded: 1 new token, then ``steps + 1``.
    Decode step = the difference / steps; e2e for ``gen_len`` tokens = b * gen_len / (t(1) + (gen_len - 1) * step)."""
    prompts = fill(base, b)
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts]).cuda()
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts]).cuda()
    times = {}
    for n in (1, steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t0
    step = (times[steps + 1] - times[1]) / steps
    return {"batch": b, "step_seconds": step, "decode_tok_s": b / step, "prefill_seconds": times[1],
            "e2e_tok_s": b * gen_len / (times[1] + (gen_len - 1) * step)}


def run_accelerate(case: Case, profile: str) -> dict:
    """HF transformers + accelerate offload (device_map with max_memory at the same cap), as a user would run it:
    the largest weight share on the GPU (``case.accel_gpu_fracs`` of the cap, tried in order) that leaves room for
    the batch's activations, the best of ``case.baseline_batches``; a batch that runs out of memory is recorded."""
    spec = spec_for(case)
    cap_gpu(case.gpu_cap)
    base = mtbench_prompts()
    tried = []
    for frac in case.accel_gpu_fracs:
        model, dmap = _accelerate_model(spec, int(case.gpu_cap * frac))
        on_gpu = sum(1 for v in dmap.values() if v == 0)
        results = []
        for b in case.baseline_batches:
            try:
                results.append(_accelerate_batch(model, base, b, case.baseline_steps, case.gen_len))
                log(f"accelerate gpu share {frac}: batch {b}: {results[-1]['step_seconds']:.2f} s per decode step")
            except torch.OutOfMemoryError:
                tried.append({"gpu_frac": frac, "batch": b, "error": "CUDA out of memory"})
                log(f"accelerate gpu share {frac}: batch {b}: out of memory")
                torch.cuda.empty_cache()
                break  # larger batches need more
        peak = torch.cuda.max_memory_allocated() / GiB
        del model
        gc.collect()
        torch.cuda.empty_cache()
        if results:
            best = max(results, key=lambda r: r["decode_tok_s"])
            return {"executor": "accelerate", **best, "gpu_frac": frac, "batches": results, "out_of_memory": tried,
                    "modules_on_gpu": on_gpu, "modules": len(dmap), "peak_gpu_GiB": peak}
    raise RuntimeError(f"accelerate ran out of memory at every GPU share and batch: {tried}")


RUNNERS = {"cgopipe": run_cgopipe, "serial": run_serial, "accelerate": run_accelerate}


# ---------------------------------------------------------------------------------------------------
def one(case_name: str, executor: str, profile: str, ffn: Optional[str] = None, cpu_threads: Optional[int] = None,
        variants: str = "") -> None:
    case = CASES[case_name]
    if ffn:
        case = dataclasses.replace(case, ffn=ffn)
    if cpu_threads:
        case = dataclasses.replace(case, cpu_threads=cpu_threads)
    if variants:
        case = dataclasses.replace(case, variants=parse_variants(variants))
    r = RUNNERS[executor](case, profile)
    r.update(case=case_name, layers=case.layers or 32, gpu_cap_GiB=case.gpu_cap / GiB, gen_len=case.gen_len, quant=case.quant)
    print("RESULT " + json.dumps(r, default=str), flush=True)


def commit() -> str:
    """The commit to print: ``--commit`` (the device copy's .git can be stale), else ``git rev-parse``."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def markdown(results: list[dict], device: str, profile: str) -> str:
    day = datetime.date.today().isoformat()
    lines = [f"### {day} commit {commit()} -- {device}, profile {os.path.basename(profile)}", "",
             "| case | layers | cap GiB | gen | executor | policy (mu x n = N, resident, gpu-attn) | measured decode tok/s | "
             "predicted decode tok/s | measured/pred | e2e tok/s | pred e2e | binding (HRM) | H2D busy | peak GPU GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | {r['executor']} | ERROR: {r['error'][:120]} | | | | | | | | |")
            continue
        if r["executor"] == "cgopipe":
            p = r["policy"]
            pol = f"{p['mu']} x {p['n']} = {p['mu'] * p['n']}, r={p['resident_experts']}, g={p['n_gpu_attn']}"
            ratio = r["decode_tok_s"] / r["pred_decode_tok_s"] if r["pred_decode_tok_s"] else float("nan")
            lines.append(f"| {r['case']} | {r['layers']} | {r['gpu_cap_GiB']:.0f} | {r['gen_len']} | cgopipe ({r.get('ffn')}, {r.get('quant', 'bf16')}, attention H2D by {r.get('attention_h2d', 'dma')}) | {pol} | "
                         f"{r['decode_tok_s']:.1f} | {r['pred_decode_tok_s']:.1f} | {ratio:.2f} | {r['e2e_tok_s']:.1f} | "
                         f"{r['pred_e2e_tok_s']:.1f} | {r['pred_decode_binding']} | "
                         f"{(r['h2d_busy_frac_decode'] or 0) * 100:.0f}% | {r['peak_gpu_GiB']:.1f} |")
            lines.append(f"| {r['case']} | | | | prefill | {r['prefill_tok_s']:.0f} tok/s measured, "
                         f"{r['pred_prefill_tok_s']:.0f} predicted (prefill micro-batch {p['prefill_mu']} rows, "
                         f"<= {p['prefill_tokens']} tokens) | | | | | | | | |")
            n = r.get("cpu_attention_native")
            if r.get("cpu_attention_GBps"):
                lines.append(f"| {r['case']} | | | | CPU attention | {r['cpu_attention_GBps']:.1f} GB/s of valid KV in the "
                             f"worker{'; ' + native_line(n) if n else ''} | | | | | | | | |")
            for v in r.get("variants", ()):
                if "error" in v:
                    lines.append(f"| {r['case']} | | | | same executor, variant {v['variant']} | {v['error']} | | | | | | | | |")
                    continue
                lines.append(f"| {r['case']} | | | {v['gen_len']} | same executor, variant {v['variant'] or 'default'} | "
                             f"prefill {v['prefill_tok_s']:.0f} tok/s, CPU attention {v.get('cpu_attention_GBps') or 0:.1f} GB/s "
                             f"(regions {(v.get('cpu_attention_native') or {}).get('region_GBps', 0):.1f}) | "
                             f"{v['decode_tok_s']:.1f} | | {v['decode_tok_s'] / r['pred_decode_tok_s']:.2f} | "
                             f"{v['e2e_tok_s']:.1f} | | | {(v['h2d_busy_frac_decode'] or 0) * 100:.0f}% | {v['peak_gpu_GiB']:.1f} |")
        else:  # a baseline: decode tok/s of its best batch; e2e where it was measured (accelerate)
            share = f", weights <= {r['gpu_frac']:.2f} of the cap" if "gpu_frac" in r else ""
            e2e = f"{r['e2e_tok_s']:.2f}" if "e2e_tok_s" in r else ""
            lines.append(f"| {r['case']} | {r['layers']} | {r['gpu_cap_GiB']:.0f} | {r['gen_len']} | {r['executor']} | "
                         f"batch {r['batch']}{share} | {r['decode_tok_s']:.2f} | | | {e2e} | | | | {r['peak_gpu_GiB']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="l4-4g-g16", help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--executors", default=None, help="run only these of each case's executors (comma-separated)")
    ap.add_argument("--profile", default=os.path.join(REPO, "lightning_moe/policy/profiles/h200-host.yaml"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
    ap.add_argument("--timeout", type=int, default=400, help="seconds per (case, executor) subprocess")
    ap.add_argument("--ffn", default=None, help="override the cases' CGOPipe FFN: torch | triton")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="CGOPipe cpu_threads for every case (torch intra-op threads of CPU attention; default torch's)")
    ap.add_argument("--variants", default="", help="A/B settings re-run on the same CGOPipe executor after the main run, "
                                                   "e.g. 'threads=12;threads=8;gen=16;default' (keys: parse_variants)")
    ap.add_argument("--commit", default=None, help="commit id for the results table (pass it: on the GPU host's copy "
                                                   "of the tree, .git may be stale)")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "EXECUTOR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.path.exists(a.profile):
        a.profile = "h200"
    if a.commit:
        os.environ["BENCH_COMMIT"] = a.commit
    parse_variants(a.variants)  # fail before any subprocess on a bad --variants
    if a.one:
        one(a.one[0], a.one[1], a.profile, a.ffn, a.cpu_threads, a.variants)
        return
    os.makedirs(a.out, exist_ok=True)
    results = []
    for name in a.cases.split(","):
        case = CASES[name]
        # --executors filters each case's own list (it never adds, e.g., a 32-layer accelerate run that takes minutes)
        for ex in [e for e in case.executors if not a.executors or e in a.executors.split(",")]:
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--one", name, ex, "--profile", a.profile]
                                   + (["--ffn", a.ffn] if a.ffn else [])
                                   + (["--cpu-threads", str(a.cpu_threads)] if a.cpu_threads else [])
                                   + (["--variants", a.variants] if a.variants else []),
                                   capture_output=True, text=True, timeout=a.timeout)
                lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
                r = json.loads(lines[-1][7:]) if lines else {"case": name, "executor": ex, "error": (p.stderr or p.stdout)[-2000:]}
                sys.stderr.write(p.stderr[-3000:])
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
                r = {"case": name, "executor": ex, "error": f"timeout after {a.timeout} s: {err[-1500:]}"}
            r["bench_seconds"] = time.perf_counter() - t0
            results.append(r)
            print(json.dumps(r, default=str)[:3000], flush=True)
            with open(os.path.join(a.out, "bench.jsonl"), "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    md = markdown(results, dev, a.profile)
    with open(os.path.join(a.out, "results_block.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
