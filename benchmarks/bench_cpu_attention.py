"""CPU decode attention under the executor's conditions vs the profile's probe (a diagnostic, not a test).

Why: on the H200 host the CPU attention stage of CGOPipe ran at ~13 GB/s of valid KV (RESULTS-archive.md 6: 94.9 s for
512 rows x 127 steps x 32 layers of Mixtral-8x7B at gen 128) while `moe-batch profile`'s probe measured 54.9 GB/s
(one call, 512 rows x 128 positions, contiguous cache, main thread, idle machine). This script times the same
work step by step adding one executor condition at a time, so one run on the GPU host says which condition
costs the factor of ~4:

1. ``probe``: the profiler's measurement (pipeline/profiler.measure_cpu_attention) at the same rows and the
   mean attended context;
2. ``grouped``: the executor's path -- GroupedKVCache (MT-Bench prompt lengths + gen positions, at most 8 length
   groups, strided views of caches sized for prompt + gen) with append + attend per layer, several layers
   so the KV is not in the CPU caches, on the main thread;
3. ``grouped-worker``: the same on a one-thread ThreadPoolExecutor, as CGOPipe runs it, with the output
   copied into pinned memory (``.pin_memory()``, CUDA only) as the executor does;
3b. the same with one native call per length group (session 5's executor) instead of one call over all groups
   (``decode_attention_append_groups``, session 6): the same-run A/B of that change;
4. ``grouped-worker+h2d`` (CUDA only): the same while another thread streams pinned host memory to the GPU
   at full rate (the expert pages of a bf16 run: ~55 GB/s of DMA reads of host DRAM);
5. ``grouped-worker+host`` (CUDA only): the same while a Python thread plays CGOPipe's host thread: it
   launches small CUDA kernels in a loop and synchronizes every 64 launches (one core busy, GIL traffic);
6. ``4k`` (with ``--only``'s keys: probe, main, worker, per-group, 4k, h2d, host, both, sharing): condition 3 with
   the KV caches on plain 4 KiB pages (pipeline.huge_pages' advice skipped: the A/B of huge pages; run it with many
   ``--layers``, e.g. 128 layers of 500 rows ~ 40 GB, where page tables outgrow the CPU caches); ``both``: conditions
   4 and 5 at once; ``sharing`` (CUDA): the profile's (H5') probe at these lengths (pipeline.dram_sharing), the CPU
   attention's rate beside pinned copies, the copies' rate in its label;
7. with ``--threads 12 8``: conditions 3 and 5 again at each intra-op thread count (``torch.set_num_threads``),
   to see whether leaving cores free for the host thread pays.

``--mla``: instead, MLA decode over the latent cache (DeepSeek-V2-Lite shapes: 16 heads, kv_lora_rank 512, rope 64,
bf16): CGOPipe's path ``GroupedLatentKVCache.append_attend`` with the native kernel (one fused append + attention call
over the length groups) vs the torch path (``LIGHTNING_MOE_CPU_ATTENTION=sdpa``: append + the family's einsum latent
attention per group), at ``--rows`` rows of ~``--mla-len`` positions; GB/s of valid latent bytes read ((L + 1) x 576 x
2 per row), best of --repeats.

Run: ``python benchmarks/bench_cpu_attention.py --rows 256 512 --layers 8``. Prints one markdown table
(GB/s of valid KV = 2 Hkv hd itemsize bytes per attended position; ms per layer; best of --repeats). Runs
without CUDA (conditions 1-3b, no pinning).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _beside_copies(fn):
    """``fn()`` while pinned host memory streams to the GPU at full rate (DMA reads of DRAM: the expert pages of a
    bf16 run, ~55 GB/s): the profile's own copy thread, pipeline.dram_sharing.PinnedCopyLoad."""
    from lightning_moe.pipeline.dram_sharing import PinnedCopyLoad

    with PinnedCopyLoad(1 << 30):
        return fn()


def _busy_host(stop: threading.Event) -> None:
    """CGOPipe's host thread, roughly: small CUDA kernels launched from Python, a sync every 64 launches."""
    x = torch.ones(1 << 16, device="cuda")
    i = 0
    while not stop.is_set():
        x.mul_(1.0)
        i += 1
        if i % 64 == 0:
            torch.cuda.synchronize()


def _with_thread(target, args, fn):
    """fn() while ``target(stop, *args)`` runs on a daemon thread."""
    stop = threading.Event()
    th = threading.Thread(target=target, args=(stop,) + args, daemon=True)
    th.start()
    time.sleep(0.5)
    try:
        return fn()
    finally:
        stop.set()
        th.join()


def _per_group_calls(fn):
    """``fn()`` with GroupedKVCache.append_attend making one native call per length group (session 5's way) instead of
    one call over all groups: the same-run A/B of decode_attention_append_groups."""
    from lightning_moe.kernels import cpu_attention as CA

    one_call = CA.decode_attention_append_groups

    def per_group(q, k_new, v_new, rows, k_caches, v_caches, lengths, out, sliding_window=None, **kw):
        for r, kc, vc, n in zip(rows, k_caches, v_caches, lengths):
            one_call(q, k_new, v_new, [r], [kc], [vc], [n], out, sliding_window)
        return out

    CA.decode_attention_append_groups = per_group
    try:
        return fn()
    finally:
        CA.decode_attention_append_groups = one_call


CONDITIONS = ("probe", "main", "worker", "per-group", "h2d", "host", "both", "4k", "sharing")  # --only's keys


def _without_huge_pages(fn):
    """``fn()`` with the KV caches on plain pages (pipeline.huge_pages' advice skipped): the A/B of huge pages."""
    from lightning_moe.pipeline import huge_pages

    zeros = huge_pages.zeros
    huge_pages.zeros = lambda numel, dtype: torch.zeros(numel, dtype=dtype)
    try:
        return fn()
    finally:
        huge_pages.zeros = zeros


def _sharing_point(lens: list, gen: int, layers: int):
    """The profile's (H5') probe at these lengths: a pipeline.dram_sharing.SharingPoint (CUDA)."""
    from lightning_moe.pipeline.dram_sharing import measure_cpu_attention_under_h2d
    from lightning_moe.pipeline.profiler import executor_attention_layer

    layer, layer_bytes = executor_attention_layer(lengths=lens, gen=gen, layers=layers)
    return measure_cpu_attention_under_h2d(layer, layer_bytes, layers)


def run(rows: int, layers: int, step: int, gen: int, repeats: int, threads=(), only=CONDITIONS) -> list[tuple[str, float, float]]:
    """[(condition, GB/s of valid KV, ms per layer)] for ``rows`` MT-Bench-length sequences at decode step
    ``step`` (conditions 2-4 are pipeline/profiler.measure_cpu_attention_executor with these lengths); ``only``:
    the :data:`CONDITIONS` to run (CUDA ones are skipped without CUDA)."""
    import bench_cgopipe as B
    from lightning_moe.pipeline.profiler import measure_cpu_attention, measure_cpu_attention_executor

    base = [len(p) for p in B.mtbench_prompts()]
    lens = [base[i % len(base)] + step for i in range(rows)]  # positions already cached
    per_layer = (sum(lens) + rows) * 2 * 8 * 128 * 2  # valid K and V bytes of one layer (Mixtral: 8 KV heads, hd 128, bf16)
    cuda = torch.cuda.is_available()

    def grouped(worker: bool = True) -> float:
        return measure_cpu_attention_executor(lengths=lens, gen=gen - step, layers=layers, repeats=repeats, worker=worker)

    pin = " + pin_memory" if cuda else ""
    conds = [
        ("probe", "probe (profiler, contiguous, one call)",
         lambda: measure_cpu_attention(batch=rows, seq=max(1, per_layer // (rows * 4096)))[0]),
        ("main", "grouped (<= 8 groups), main thread" + pin, lambda: grouped(False)),
        ("worker", "grouped, worker thread" + pin, grouped),
        ("per-group", "grouped, worker thread, one native call per group (session 5)" + pin, lambda: _per_group_calls(grouped)),
        ("4k", "grouped, worker thread, KV on 4 KiB pages (no huge-page advice)" + pin, lambda: _without_huge_pages(grouped)),
    ]
    if cuda:
        conds += [
            ("h2d", "grouped, worker thread + pin_memory + full-rate pinned H2D", lambda: _beside_copies(grouped)),
            ("host", "grouped, worker thread + pin_memory + busy host thread (CUDA launches)",
             lambda: _with_thread(_busy_host, (), grouped)),
            ("both", "grouped, worker thread + pin_memory + full-rate pinned H2D + busy host thread",
             lambda: _beside_copies(lambda: _with_thread(_busy_host, (), grouped))),
        ]
    out = [(label, fn()) for key, label, fn in conds if key in only]
    if cuda and "sharing" in only:
        pt = _sharing_point(lens, gen - step, layers)
        out.append(("the profile's sharing probe: CPU attention alone", pt.cpu_alone))
        out.append((f"the profile's sharing probe: CPU attention beside pinned H2D ({pt.fractions[0]:.2f}; the copies "
                    f"{pt.h2d_together / 1e9:.1f} of {pt.h2d_alone / 1e9:.1f} GB/s alone, {pt.fractions[1]:.2f})",
                    pt.cpu_together))
    default = torch.get_num_threads()
    for n in threads:
        torch.set_num_threads(n)
        try:
            out.append((f"{n} threads: grouped, worker thread" + pin, grouped(True)))
            if cuda:
                out.append((f"{n} threads: grouped, worker thread + pin_memory + busy host thread",
                            _with_thread(_busy_host, (), lambda: grouped(True))))
        finally:
            torch.set_num_threads(default)
    return [(name, b / 1e9, per_layer / b * 1e3) for name, b in out]


def run_mla(rows: int, length: int, layers: int, repeats: int, heads: int = 16) -> list[tuple[str, float, float]]:
    """[(path, GB/s of valid latent bytes, ms per layer)]: native kernel vs torch path through GroupedLatentKVCache."""
    from lightning_moe.model.families import deepseek_v2
    from lightning_moe.model.spec import MoESpec
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache

    spec = MoESpec(name="v2-lite-mla", model_type="deepseek_v2", vocab_size=64, hidden_size=2048, intermediate_size=64,
                   num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=192, num_experts=2, top_k=1,
                   rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=4096, kv_lora_rank=512, qk_rope_head_dim=64)
    g = torch.Generator().manual_seed(0)
    lens = (length + torch.randint(-length // 10, length // 10 + 1, (rows,), generator=g)).tolist()
    kv = GroupedLatentKVCache(spec, [n + 8 for n in lens], torch.bfloat16)
    for layer in range(layers):
        for t in kv.lat[layer]:
            t.normal_(generator=g)
    kv.lengths[:] = torch.tensor(lens)
    E = 576
    q = torch.randn(rows, heads, E, generator=g).bfloat16()
    c, k = torch.randn(rows, 512, generator=g).bfloat16(), torch.randn(rows, 64, generator=g).bfloat16()
    out = torch.empty(rows, heads, 512, dtype=torch.bfloat16)
    fn = lambda qg, x, n: deepseek_v2.latent_attention(qg, x, n, spec)  # noqa: E731
    per_layer = (sum(lens) + rows) * E * 2
    res = []
    for name, mode in (("native kernel (one fused call)", "native"), ("torch (append + einsum per group)", "sdpa")):
        os.environ["LIGHTNING_MOE_CPU_ATTENTION"] = mode
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for layer in range(layers):
                kv.append_attend(layer, q, c, k, fn, out)
            best = min(best, (time.perf_counter() - t0) / layers)
        res.append((name, per_layer / best / 1e9, best * 1e3))
    os.environ.pop("LIGHTNING_MOE_CPU_ATTENTION")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--layers", type=int, default=8, help="layers of KV cycled through (more: colder caches)")
    ap.add_argument("--step", type=int, default=64, help="decode step (positions generated so far)")
    ap.add_argument("--gen", type=int, default=128, help="generation length the caches are sized for")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="*", default=[], help="also run at these intra-op thread counts")
    ap.add_argument("--only", default=",".join(CONDITIONS),
                    help=f"comma-separated conditions to run, of {', '.join(CONDITIONS)} (default: all)")
    ap.add_argument("--mla", action="store_true", help="MLA latent attention: native kernel vs the torch path")
    ap.add_argument("--mla-len", type=int, default=500, help="--mla: mean cached positions per row")
    a = ap.parse_args()
    if a.mla:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MLA 16 heads, 512 + 64, bf16")
        print("| rows | path | GB/s of valid latents | ms per layer |")
        print("|---|---|---|---|")
        for rows in a.rows:
            res = run_mla(rows, a.mla_len, a.layers, a.repeats)
            for name, gbs, ms in res:
                print(f"| {rows} | {name} | {gbs:.2f} | {ms:.2f} |", flush=True)
            print(f"| {rows} | native / torch speed | {res[1][2] / res[0][2]:.2f}x | |", flush=True)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}")
    print("| rows | condition | GB/s of valid KV | ms per layer |")
    print("|---|---|---|---|")
    for rows in a.rows:
        only = a.only.split(",")
        if set(only) - set(CONDITIONS):
            ap.error(f"--only: unknown {', '.join(sorted(set(only) - set(CONDITIONS)))}; known: {', '.join(CONDITIONS)}")
        for name, gbs, ms in run(rows, a.layers, a.step, a.gen, a.repeats, a.threads, only):
            print(f"| {rows} | {name} | {gbs:.1f} | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
