"""Timeline of CGOPipe decode (torch.profiler, every thread): where the GPU, the copy engines and the CPU worker spend time.

Run on a CUDA host, e.g. the per-layer shape of the full-size bf16 policy on 4 layers:

    python benchmarks/profile_ops.py --quant bf16 --layers 4 --mu 512 --n 1 --resident 5 --gen 4 --trace /tmp/out/trace.json.gz

Prints (a diagnostic, not a benchmark; profiling slows the host thread a little):
  * the executor's stage times (s) and its CPU attention rate (valid KV bytes / append+attend seconds);
  * CPU operators per thread (the worker's SDPA calls: count, ms, GB/s of K/V read incl. group padding);
  * CUDA synchronisation calls per thread (host time blocked);
  * copies per direction and size class: count, bytes, busy ms, GB/s while copying, and the queue delay from
    the host's cudaMemcpyAsync to the copy's start on the GPU (attention outputs behind expert pages show here);
  * GPU busy (union of kernels and copies per engine kind) over the profiled window.
Writes the Chrome trace (gzip) to ``--trace`` when given (open in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = 16 << 20  # copies below this many bytes are activations (q/k/v, attention outputs), above: expert pages
SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length in ms of the union of [start, end) intervals given in microseconds."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def _sdpa_bytes(e: dict) -> int:
    """K and V bytes an SDPA call reads, from its recorded input shapes ([B, H, S, hd] for k and v; bf16/fp16)."""
    dims = (e.get("args") or {}).get("Input Dims") or []
    types = (e.get("args") or {}).get("Input type") or []
    if len(dims) < 3 or not dims[1] or len(dims[1]) != 4:
        return 0
    n = 1
    for d in dims[1]:
        n *= d
    item = 4 if types and "float" == str(types[1]).lower() else 2
    return 2 * n * item


def summarize_trace(trace: dict, main_tid=None) -> str:
    """Markdown-ish summary of a torch.profiler Chrome trace (``{"traceEvents": [...]}``); see the module doc."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    out = []
    if not evs:
        return "(empty trace)"
    t_lo = min(e["ts"] for e in evs)
    t_hi = max(e["ts"] + e["dur"] for e in evs)
    out.append(f"window {(t_hi - t_lo) / 1e3:.1f} ms")

    # CPU operators per thread (top-level-ish: the ones we care about by name)
    per = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0]))
    for e in evs:
        if e.get("cat") == "cpu_op":
            c = per[e.get("tid")][e["name"]]
            c[0] += 1
            c[1] += e["dur"] / 1e3
            if e["name"] == SDPA:
                c[2] += _sdpa_bytes(e)
    for tid, ops in per.items():
        top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:8]
        out.append(f"cpu ops, thread {tid}{' (main)' if tid == main_tid else ''}:")
        for name, (n, ms, b) in top:
            extra = f", {b / (ms / 1e3) / 1e9:.1f} GB/s of K/V (incl. group padding)" if b and ms else ""
            out.append(f"  {name}: {n} calls, {ms:.1f} ms, {ms / n:.3f} ms/call{extra}")

    # CUDA runtime: synchronisations (host blocked) per thread, and the launch time of each correlation id
    launch = {}
    sync = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in evs:
        if e.get("cat") == "cuda_runtime":
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch[corr] = e["ts"]
            if "ynchronize" in e["name"]:
                s = sync[e.get("tid")][e["name"]]
                s[0] += 1
                s[1] += e["dur"] / 1e3
    for tid, calls in sync.items():
        out.append(f"cuda syncs, thread {tid}: " + ", ".join(f"{n} x{c} {ms:.1f} ms" for n, (c, ms) in calls.items()))
    # CUDA runtime / driver calls per thread by host time (launches, copies, event records, host allocations)
    rt = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in evs:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = rt[e.get("tid")][e["name"]]
            r[0] += 1
            r[1] += e["dur"] / 1e3
    for tid, calls in rt.items():
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]
        out.append(f"cuda api, thread {tid}{' (main)' if tid == main_tid else ''}: "
                   + ", ".join(f"{n} x{c} {ms:.1f} ms" for n, (c, ms) in top))

    # copies: direction x size class
    cp = defaultdict(lambda: [0, 0, 0.0, []])
    intervals = defaultdict(list)
    for e in evs:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            intervals["kernels" if cat == "kernel" else e["name"].split(" ")[1] if cat == "gpu_memcpy" else "memset"].append(
                (e["ts"], e["ts"] + e["dur"]))
        if cat != "gpu_memcpy":
            continue
        a = e.get("args") or {}
        nbytes = int(a.get("bytes", 0))
        key = (e["name"].split(" ")[1] if " " in e["name"] else e["name"], "activations (< 16 MiB)" if nbytes < SMALL else "pages (>= 16 MiB)")
        c = cp[key]
        c[0] += 1
        c[1] += nbytes
        c[2] += e["dur"] / 1e3
        if a.get("correlation") in launch:
            c[3].append((e["ts"] - launch[a["correlation"]]) / 1e3)
    for (kind, size), (n, b, ms, q) in sorted(cp.items()):
        qs = sorted(q)
        qtxt = (f"; queue delay from cudaMemcpyAsync: mean {sum(qs) / len(qs):.2f} ms, median {qs[len(qs) // 2]:.2f}, "
                f"max {qs[-1]:.2f}") if qs else ""
        out.append(f"copies {kind} {size}: {n}, {b / 1e9:.2f} GB, busy {ms:.1f} ms, {b / (ms / 1e3) / 1e9 if ms else 0:.1f} GB/s{qtxt}")
    for k, iv in sorted(intervals.items()):
        out.append(f"GPU {k} busy (union): {_union_ms(iv):.1f} ms of {(t_hi - t_lo) / 1e3:.1f}")
    return "\n".join(out)


def _profiler(trace_only_cpu: bool = False):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([] if trace_only_cpu else [torch.profiler.ProfilerActivity.CUDA])
    try:  # every thread (the CPU attention worker too) and CUDA sync events, where this torch has them
        cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
        return torch.profiler.profile(activities=acts, record_shapes=True, experimental_config=cfg)
    except TypeError:
        return torch.profiler.profile(activities=acts, record_shapes=True)


def _print_cprofile(fn, top: int, ex) -> None:
    """Run ``fn`` under cProfile (the calling thread only: CGOPipe's host thread) and print the top functions by
    cumulative and by own time, with the decode wall time and steps so they read per layer."""
    import cProfile
    import io
    import pstats

    ex.stats.__init__()
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = ex.stats
    print(f"cProfile run: decode {s.decode_seconds:.2f} s, {s.decode_steps} steps, "
          f"{s.decode_tokens / max(s.decode_seconds, 1e-9):.0f} tok/s (profiled host thread)")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        print(f"--- host thread by {key} ---")
        print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip()))


def main() -> None:
    import threading

    import bench_cgopipe as B
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.pipeline.sampling import DecodeSampling
    from lightning_moe.policy.policy import Policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mu", type=int, default=256, help="rows per micro-batch")
    ap.add_argument("--n", type=int, default=1, help="micro-batches")
    ap.add_argument("--resident", type=int, default=0, help="resident experts per layer")
    ap.add_argument("--gpu-attn", type=int, default=0)
    ap.add_argument("--gen", type=int, default=4, help="tokens generated in the profiled run")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--gpu-cap", type=float, default=24, help="GiB")
    ap.add_argument("--trace", default=None, help="write the Chrome trace here (.json.gz)")
    ap.add_argument("--gpu-attention", default="torch", choices=("torch", "triton"),
                    help="CGOPipe's gpu_attention (GPU-attention micro-batches' append + attention)")
    ap.add_argument("--cprofile", type=int, default=0, help="also print the host thread's top N Python functions "
                    "(cProfile of one more generate, without torch.profiler)")
    a = ap.parse_args()
    spec = B.spec_for(B.Case("p", a.layers))
    B.cap_gpu(int(a.gpu_cap * B.GiB))
    w = B.shared_dummy_weights(spec, quant=a.quant)
    pol = Policy(mu=a.mu, n=a.n, prefill_mu=32, resident_experts=a.resident, n_gpu_attn=a.gpu_attn,
                 weight_quant=a.quant, dtype="bf16")
    ex = CGOPipeExecutor(w, pol, "cuda", torch.bfloat16, ffn="triton", cpu_threads=a.cpu_threads,
                         gpu_attention=a.gpu_attention)
    del w
    prompts = B.fill(B.mtbench_prompts(), a.mu * a.n)
    sp = DecodeSampling(max_new_tokens=a.gen, stop_at_eos=False)
    ex.generate(prompts[:8], DecodeSampling(max_new_tokens=2, stop_at_eos=False))  # warm-up: Triton compilation
    ex.generate(prompts, sp)
    if a.cprofile:
        _print_cprofile(lambda: ex.generate(prompts, sp), a.cprofile, ex)
    ex.stats.__init__()
    with _profiler() as prof:
        ex.generate(prompts, sp)
    s = ex.stats
    st = s.extra
    kv = st.get("cpu_attention_valid_kv_bytes", 0)
    print(f"{a.quant} layers={a.layers} mu={a.mu} n={a.n} resident={a.resident} threads={torch.get_num_threads()}"
          f"{' cpu_threads=' + str(a.cpu_threads) if a.cpu_threads else ''}: prefill {s.prefill_seconds:.2f} s, decode "
          f"{s.decode_seconds:.2f} s for {s.decode_steps} steps ({s.decode_tokens / s.decode_seconds:.0f} tok/s, profiled)")
    counts = ("_calls", "_threads")  # native_stats counters, not seconds
    print("stages (s): " + ", ".join(f"{k}={v:.3f}" for k, v in st.items() if isinstance(v, float) and not k.endswith(counts)))
    print("counts: " + ", ".join(f"{k}={int(v)}" for k, v in st.items() if isinstance(v, (int, float)) and k.endswith(counts)))
    if st.get("cpu_attention_compute"):
        print(f"CPU attention (append + attend): {kv / st['cpu_attention_compute'] / 1e9:.1f} GB/s of valid KV")
    path = a.trace or "/tmp/cgopipe_trace.json"
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    print(summarize_trace(trace, main_tid=threading.get_native_id()))
    if path.endswith(".gz"):
        with open(raw, "rb") as f, gzip.open(path, "wb") as g:
            g.write(f.read())
        os.remove(raw)
    ex.close()


if __name__ == "__main__":
    main()
