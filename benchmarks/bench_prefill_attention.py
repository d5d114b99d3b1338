#!/usr/bin/env python3
"""Packed prefill attention over a dataset of many lengths: what a new chunk shape costs (a GPU benchmark, not a test).

A job's prompts are taken in length order (``app.engine.work_order``) and cut into prefill chunks of at most
``--rows`` rows and ``--tokens`` padded tokens (``pipeline.prefill.prefill_chunks``'s rule), so with many lengths
nearly every chunk is a (rows, longest) shape the process has not seen. Per variant, one pass over every chunk (the
first layer of the job: each shape new) and a second pass (the later layers: each shape seen), each chunk timed on
the host around a synchronized call (a plan build or a compilation is host time), Mixtral-8x7B attention shapes
(Hq 32, Hkv 8, hd 128, bf16):

* ``sdpa``: ``model.layers.prefill_attention_packed`` as the executor calls it (padded to the chunk's longest row,
  a boolean mask, torch's SDPA picking its backend);
* ``sdpa-efficient`` / ``sdpa-cudnn``: the same call with SDPA held to one backend (``torch.nn.attention.sdpa_kernel``);
* ``varlen``: ``kernels.prefill_attention.attention_varlen`` (torch's varlen flash attention) on the packed rows
  (no padding), when this torch has it;
* ``packed-auto``: ``prefill_attention_packed`` with ``LIGHTNING_MOE_PREFILL_ATTENTION`` unset (what the executor runs).

Each output against ``sdpa``'s (max |diff| over max |ref|). The first pass is split into its first chunk (one-time
loads) and the rest (per-shape costs).

Prints a markdown table (first pass s, second pass s, chunks, distinct shapes), written to ``--out``.

    python3 benchmarks/bench_prefill_attention.py [--lengths 64:1024] [--n 1000] [--rows 100] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_moe.kernels import prefill_attention as PA  # noqa: E402
from lightning_moe.model.layers import prefill_attention_packed, prefill_packed_layout  # noqa: E402

HQ, HKV, HD = 32, 8, 128


def chunks_of(lengths: list[int], rows: int, tokens: int) -> list[list[int]]:
    """The executor's prefill chunks of prompts of these lengths, taken in length order (see the module doc)."""
    out, cur, longest = [], [], 0
    for n in sorted(lengths):
        if cur and (len(cur) + 1 > rows or (len(cur) + 1) * max(longest, n) > tokens):
            out.append(cur)
            cur, longest = [], 0
        cur.append(n)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64:1024", help="lo:hi, each prompt's length uniform in [lo, hi]")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=100, help="the policy's prefill_mu")
    ap.add_argument("--tokens", type=int, default=16384, help="the policy's prefill_tokens (padded)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (sdpa only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.lengths.split(":"))
    rng = random.Random(0)
    chunks = chunks_of([rng.randint(lo, hi) for _ in range(a.n)], a.rows, a.tokens)
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    data = []
    for lens in chunks:
        T = sum(lens)
        ends = torch.tensor(lens).cumsum(0).tolist()
        spans = [(e - n, e) for e, n in zip(ends, lens)]
        q = torch.randn(T, HQ, HD, device=dev, generator=g, dtype=dt)
        k = torch.randn(T, HKV, HD, device=dev, generator=g, dtype=dt)
        v = torch.randn(T, HKV, HD, device=dev, generator=g, dtype=dt)
        cu = torch.tensor([0] + ends, dtype=torch.int32, device=dev)
        data.append((q, k, v, spans, cu, max(lens), prefill_packed_layout(spans, T, dev)))  # layout: once per chunk
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v, spans, cu, m, layout):
        os.environ["LIGHTNING_MOE_PREFILL_ATTENTION"] = "sdpa"
        return prefill_attention_packed(q, k, v, spans, None, layout)

    def packed_auto(q, k, v, spans, cu, m, layout):
        os.environ["LIGHTNING_MOE_PREFILL_ATTENTION"] = "auto"
        return prefill_attention_packed(q, k, v, spans, None, layout)

    def held(backend):
        def run(*args):
            with sdpa_kernel([backend]):
                return sdpa(*args)
        return run

    why = PA.varlen_unsupported(*data[0][:3], None, None)
    variants = [("sdpa-efficient", held(SDPBackend.EFFICIENT_ATTENTION))]
    if why is None:
        variants.append(("varlen", lambda q, k, v, spans, cu, m, layout: PA.attention_varlen(q, k, v, cu, m)
                         .reshape(q.shape[0], -1)))
    variants.append(("packed-auto", packed_auto))
    variants += [("sdpa", sdpa)] + ([("sdpa-cudnn", held(SDPBackend.CUDNN_ATTENTION))] if dev.type == "cuda" else [])
    shapes = len({(len(d[3]), d[5]) for d in data})
    toks = sum(q.shape[0] for q, *_ in data)
    lines = [f"{a.n} prompts of {lo}-{hi} tokens ({toks} tokens), chunks of <= {a.rows} rows and <= {a.tokens} padded "
             f"tokens: {len(data)} chunks, {shapes} distinct (rows, longest) shapes; torch {torch.__version__}; varlen: "
             f"{why or 'yes'}", "",
             "| variant | first pass s: first chunk + the rest (new shapes) | second pass s | rest of first - second "
             "| max abs diff / max abs (vs sdpa) |",
             "|---|---|---|---|---|"]
    ref = [sdpa(*d) for d in data[:3]]
    sync()
    for name, fn in variants:
        passes = []
        try:
            for _ in range(2):
                times = []
                for d in data:
                    sync()
                    t0 = time.perf_counter()
                    fn(*d)
                    sync()
                    times.append(time.perf_counter() - t0)
                passes.append(times)
            err = max(float((fn(*d) - r).abs().max() / r.abs().max()) for d, r in zip(data[:3], ref))
            first, rest, second = passes[0][0], sum(passes[0][1:]), sum(passes[1])
            lines.append(f"| {name} | {first:.3f} + {rest:.3f} | {second:.3f} | {rest - sum(passes[1][1:]):.3f} "
                         f"| {err:.2e} |")
        except Exception as e:  # noqa: BLE001 (a backend this GPU / torch refuses: say so and go on)
            lines.append(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | | |")
        print(lines[-1], flush=True)
    print("\n".join(lines[:4]))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
