#!/usr/bin/env python3
"""Baseline for the perplexity acceptance case: transformers + accelerate scoring the same texts at the same cap.

``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16, device_map="auto", max_memory={0: cap - headroom,
"cpu": cpu_memory})`` places as many layers as fit on GPU 0 and offloads the rest to the host (accelerate moves
them in for every forward); the process's CUDA allocator is capped at ``cap`` as ``moe-batch`` does
(``torch.cuda.set_per_process_memory_fraction``; ``--no-enforce-cap`` turns that off). Texts are tokenized with
the checkpoint's tokenizer (BOS added, as ``moe-batch`` does), sorted by length, right-padded into batches of
``--batch-size``; each batch runs one forward, log-softmax in float32, and the log-probability of every next token
is gathered. Per text: ``nll`` (summed over its scored tokens), ``scored_tokens`` (length - 1), ``perplexity``.

It is slow: only the batches that fit in ``--time-budget`` seconds (load time not counted) are run, and the
report says so: ``timed`` (batches, texts, tokens, seconds), prefill tokens/s with and without the first batch
(warm-up), and the extrapolated seconds for all texts at that rate. ``--compare RESULTS.jsonl`` (the records of
``moe-batch``'s perplexity job) gives the largest and mean per-text |nll difference| over the texts both scored.

Examples:
  python3 benchmarks/ppl_accelerate.py CKPT --data texts.jsonl --cap 12GiB --time-budget 240 --out ppl-acc.json
  python3 benchmarks/ppl_accelerate.py CKPT --data texts.jsonl --device cpu --batch-size 4 --time-budget 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_size(s: str) -> int:
    """Bytes of ``"12GiB"`` / ``"16GB"`` / an int (lightning_moe.config.parse_bytes)."""
    from lightning_moe.config import parse_bytes

    return parse_bytes(int(s) if s.isdigit() else s)


def load_texts(path: str, limit: int | None = None) -> list[dict]:
    """``{"id", "text"}`` records of a JSONL file (the perplexity input format), the first ``limit``."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append({"id": str(r["id"]), "text": r["text"]})
                if limit and len(out) >= limit:
                    break
    return out


def load_model(path: str, device: str, cap: int | None, cpu_memory: int, headroom: int, enforce_cap: bool):
    """The model on ``device``: cpu (everything on the host) or cuda (accelerate's device_map="auto" with GPU 0 given
    ``cap - headroom`` bytes for weights). Returns (model, placement summary dict)."""
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.bfloat16} if _tf_major() >= 5 else {"torch_dtype": torch.bfloat16}
    info: dict = {"device": device}
    if device == "cpu":
        model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kw)
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = cap or total
        if enforce_cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        weights_gib = max(cap - headroom, 2**28) / 2**30
        max_memory = {0: f"{weights_gib:.2f}GiB", "cpu": f"{cpu_memory / 2**30:.0f}GiB"}
        model = AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=max_memory, **kw)
        info.update(cap_bytes=cap, max_memory=max_memory, enforce_cap=enforce_cap)
    model.eval()
    dm = getattr(model, "hf_device_map", None) or {}
    places = [str(v) for v in dm.values()]
    info["device_map_counts"] = {p: places.count(p) for p in sorted(set(places))}
    return model, info


def _tf_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def batches(ids: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices into ``ids`` grouped ``batch_size`` at a time after sorting by length (less padding)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def score_batch(model, seqs: list[list[int]], device: str) -> list[float]:
    """Summed next-token NLL of each sequence (positions 1..len-1), one right-padded forward."""
    T = max(len(s) for s in seqs)
    inp = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        inp[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    first = "cuda:0" if device != "cpu" else "cpu"
    logits = model(input_ids=inp.to(first), attention_mask=mask.to(first)).logits
    out = []
    for b, s in enumerate(seqs):
        lp = torch.log_softmax(logits[b, : len(s) - 1].float(), dim=-1)
        tgt = torch.tensor(s[1:], device=lp.device)
        out.append(-lp.gather(1, tgt[:, None]).sum().item())
    return out


def run(args) -> dict:
    """Load, score within the time budget, summarize (see the module docstring)."""
    from lightning_moe.data.tokenize import load_tokenizer

    recs = load_texts(args.data, args.limit)
    tok = load_tokenizer(args.model)
    ids = [tok(r["text"])["input_ids"] for r in recs]
    t0 = time.perf_counter()
    model, info = load_model(args.model, args.device, parse_size(args.cap) if args.cap else None,
                             parse_size(args.cpu_memory), parse_size(args.headroom), not args.no_enforce_cap)
    load_s = time.perf_counter() - t0
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    results, times, tokens = [], [], []
    t_run = time.perf_counter()
    all_batches = batches(ids, args.batch_size)
    for bi in all_batches:
        if times and time.perf_counter() - t_run + (sum(times) / len(times)) > args.time_budget:
            break
        tb = time.perf_counter()
        nll = score_batch(model, [ids[i] for i in bi], args.device)
        if args.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tb)
        tokens.append(sum(len(ids[i]) for i in bi))
        for i, v in zip(bi, nll):
            n = len(ids[i]) - 1
            results.append({"id": recs[i]["id"], "nll": v, "scored_tokens": n, "perplexity": math.exp(v / max(n, 1))})
    all_tokens = sum(len(s) for s in ids)
    secs, toks = sum(times), sum(tokens)
    rate = toks / secs if secs else None
    rate_warm = sum(tokens[1:]) / sum(times[1:]) if len(times) > 1 else None
    scored = sum(r["scored_tokens"] for r in results)
    rep = {
        "model": args.model, "data": args.data, "texts": len(recs), "tokens_all_texts": all_tokens,
        "batch_size": args.batch_size, "load_seconds": load_s, "placement": info,
        "timed": {"batches": len(times), "of_batches": len(all_batches), "texts": len(results), "tokens": toks,
                  "seconds": secs, "what": "forward + log-softmax gather of each batch, synchronized; load excluded"},
        "prefill_tokens_per_s": rate, "prefill_tokens_per_s_after_first_batch": rate_warm,
        "extrapolated_seconds_all_texts": all_tokens / (rate_warm or rate) if (rate_warm or rate) else None,
        "perplexity_of_scored_texts": math.exp(sum(r["nll"] for r in results) / scored) if scored else None,
        "peak_gpu_memory_allocated_bytes": torch.cuda.max_memory_allocated() if args.device != "cpu" else None,
        "peak_gpu_memory_reserved_bytes": torch.cuda.max_memory_reserved() if args.device != "cpu" else None,
    }
    if args.compare:
        rep["compare"] = compare(results, args.compare)
    if args.records:
        with open(args.records, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return rep


def compare(results: list[dict], path: str) -> dict:
    """Per-text |nll difference| against ``moe-batch`` perplexity records (the ids both scored)."""
    theirs = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if "nll" in r:
                    theirs[str(r["id"])] = r
    d = [abs(r["nll"] - theirs[r["id"]]["nll"]) / max(r["scored_tokens"], 1) for r in results if r["id"] in theirs]
    tok_ok = sum(r["scored_tokens"] == theirs[r["id"]]["scored_tokens"] for r in results if r["id"] in theirs)
    return {"file": path, "common_texts": len(d), "same_scored_tokens": tok_ok,
            "max_abs_nll_diff_per_token": max(d) if d else None, "mean_abs_nll_diff_per_token": sum(d) / len(d) if d else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Hugging Face checkpoint directory (bf16; not a moe-batch quantized one)")
    p.add_argument("--data", required=True, help="JSONL of {id, text} records (moe-batch's perplexity input)")
    p.add_argument("--limit", type=int, default=None, help="first N texts only")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (device_map auto) or cpu")
    p.add_argument("--cap", default=None, help="GPU cap, e.g. 12GiB (default: the whole card)")
    p.add_argument("--headroom", default="2GiB", help="part of the cap left for activations, not weights (default 2GiB)")
    p.add_argument("--no-enforce-cap", action="store_true", help="do not cap the CUDA allocator at --cap")
    p.add_argument("--cpu-memory", default="100GiB", help="accelerate's host memory for offloaded weights (default 100GiB)")
    p.add_argument("--batch-size", type=int, default=8, help="texts per forward (default 8)")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds of scoring (load excluded; default 240)")
    p.add_argument("--compare", default=None, help="moe-batch perplexity results .jsonl to compare per-text nll with")
    p.add_argument("--records", default=None, help="write the per-text records here (.jsonl)")
    p.add_argument("--out", default=None, help="write the report JSON here (also printed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rep = run(args)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
