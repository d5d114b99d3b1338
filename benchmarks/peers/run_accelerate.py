#!/usr/bin/env python3
"""Peer: transformers + accelerate (``device_map="auto"``, ``max_memory`` at the GPU cap), greedy ``generate`` of
the MT-Bench first turns (chat template), the largest batch that fits; one result row.

The model: ``AutoModelForCausalLM.from_pretrained(CKPT, dtype=bfloat16, device_map="auto", max_memory={0: cap -
headroom, "cpu": ...})``: accelerate puts as many layers on GPU 0 as fit in ``cap - headroom`` and offloads the
rest to the host (their weights move to the GPU in every forward). The process's CUDA allocator is capped at
``--cap`` (``torch.cuda.set_per_process_memory_fraction``), as ``moe-batch`` caps itself, so "fits" means fits
in the cap. ``--device cpu`` (smoke tests) keeps everything on the host.

Batches: prompts are the MT-Bench first turns (repeated) in the checkpoint's chat template, left-padded. From
``--max-batch`` down (halving), a batch of B prompts is generated with ``max_new_tokens = min_new_tokens = --gen``
(every sequence makes exactly ``--gen`` tokens, as in the other rows); an out-of-memory error halves B. The first
B that fits is the row's ``N``; further batches of the same B run while ``--time-budget`` allows (``--batches``
at most). ``tok_s`` = generated tokens / generate() wall time over the timed batches (tokenizing and load
outside, prefill inside). A 1-prompt, 2-token warm-up runs first (not timed).

Examples:
  python3 benchmarks/peers/run_accelerate.py CKPT --gen 128 --cap 12GiB --max-batch 256 --out OUT
  python3 benchmarks/peers/run_accelerate.py CKPT --device cpu --gen 8 --max-batch 16 --out OUT   # smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


DEFAULT_HEADROOM = "3GiB"  # the cap minus this is max_memory for accelerate's GPU layers; another value names its row
#   accelerate-bf16-gG-hH (run_all.sh HEADROOMS="3GiB 6GiB" tries several: the larger batch may win)


def load_tokenizer(ckpt: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.unk_token if tok.unk_token is not None else tok.eos_token
    return tok


def batch_tensors(tok, prompts: list[str], device):
    """Left-padded input_ids / attention_mask of the templated prompts."""
    import torch

    ids = [common.templated_ids(tok, p) for p in prompts]
    n = max(len(x) for x in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (n - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in ids], device=device)
    return input_ids, mask, sum(len(x) for x in ids)


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_batches(generate, tok, device, records: list[dict], gen: int, max_batch: int, batches: int,
                budget: float, min_batch: int = 1) -> dict:
    """Largest-batch search and timed batches; ``generate(input_ids, attention_mask, n_new)`` runs one batch.
    Returns N, gen_tokens, prompt_tokens, seconds, tried (B -> ok / oom), per-batch seconds."""
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    ids, mask, _ = batch_tensors(tok, [records[0]["prompt"]], device)
    generate(ids, mask, 2)  # warm-up
    sync()
    t_start = time.perf_counter()
    tried: dict[int, str] = {}
    b = max_batch
    while b >= min_batch:
        ids, mask, ptoks = batch_tensors(tok, [r["prompt"] for r in records[:b]], device)
        out = None
        try:
            sync()
            t0 = time.perf_counter()
            out = generate(ids, mask, gen)
            sync()
            dt = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - OOM shows up as several exception types
            if not is_oom(e):
                raise
        if out is None:  # out of memory: outside the except, so the failed call's frames (its tensors) are gone
            tried[b] = "oom"
            del ids, mask
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            b //= 2
            continue
        new = int(out.shape[1] - ids.shape[1]) * b
        tried[b] = "ok"
        times, gen_tokens, prompt_tokens = [dt], new, ptoks
        k = 1
        while k < batches and time.perf_counter() - t_start + dt < budget:
            lo = (k * b) % max(1, len(records) - b + 1)
            ids, mask, ptoks = batch_tensors(tok, [r["prompt"] for r in records[lo:lo + b]], device)
            sync()
            t0 = time.perf_counter()
            out = generate(ids, mask, gen)
            sync()
            times.append(time.perf_counter() - t0)
            gen_tokens += int(out.shape[1] - ids.shape[1]) * b
            prompt_tokens += ptoks
            k += 1
        return {"N": b, "gen_tokens": gen_tokens, "prompt_tokens": prompt_tokens, "seconds": sum(times),
                "batch_seconds": [round(t, 3) for t in times], "tried": tried}
    return {"N": None, "tried": tried}


def load_model(ckpt: str, device: str, cap: int | None, headroom: int, cpu_memory: str, enforce_cap: bool):
    import torch
    from transformers import AutoModelForCausalLM

    import transformers

    info: dict = {}
    # transformers < 4.56 names the argument torch_dtype
    kw = {"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.bfloat16}
    if device == "cpu":
        model = AutoModelForCausalLM.from_pretrained(ckpt, device_map="cpu", **kw)
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = cap or total
        if enforce_cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        max_memory = {0: f"{max(cap - headroom, 2**28) / 2**30:.2f}GiB", "cpu": cpu_memory}
        model = AutoModelForCausalLM.from_pretrained(ckpt, device_map="auto", max_memory=max_memory, **kw)
        info.update(max_memory=max_memory, cap_bytes=cap, enforce_cap=enforce_cap)
    model.eval()
    places = [str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()]
    info["device_map_counts"] = {p: places.count(p) for p in sorted(set(places))}
    return model, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--cap", default="12GiB", help="GPU memory cap (default 12GiB)")
    ap.add_argument("--headroom", default=DEFAULT_HEADROOM, help="cap minus this is accelerate's max_memory for weights "
                    "(the rest: KV cache and activations; default 3GiB)")
    ap.add_argument("--cpu-memory", default="100GiB")
    ap.add_argument("--no-enforce-cap", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=3, help="timed batches at most (default 3)")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for the timed batches (default 240)")
    ap.add_argument("--mtbench", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import torch

    name = f"accelerate-bf16-g{a.gen}" + ("" if a.headroom == DEFAULT_HEADROOM else f"-h{a.headroom}")
    row = {"peer": "accelerate", "weights": "bf16", "model": common.model_label(a.ckpt), "model_dir": a.ckpt,
           "gen_len": a.gen, "cap": a.cap if a.device != "cpu" else None, "device": common.device_name(),
           "headroom": a.headroom,
           "command": " ".join(sys.argv)}
    try:
        import accelerate
        import transformers

        row["versions"] = {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
                           "torch": torch.__version__}
        t0 = time.perf_counter()
        model, info = load_model(a.ckpt, a.device, common.parse_bytes(a.cap), common.parse_bytes(a.headroom),
                                 a.cpu_memory, not a.no_enforce_cap)
        row["load_s"] = round(time.perf_counter() - t0, 2)
        tok = load_tokenizer(a.ckpt)
        device = "cpu" if a.device == "cpu" else "cuda:0"
        records = common.prompt_records(max(a.max_batch * a.batches, 80), a.mtbench)

        def generate(ids, mask, n_new):
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                      min_new_tokens=n_new, do_sample=False, pad_token_id=tok.pad_token_id)

        with common.GpuMemPoller() as mem:
            res = run_batches(generate, tok, device, records, a.gen, a.max_batch, a.batches, a.time_budget)
        row["gpu_peak_gib"] = mem.peak_gib
        if torch.cuda.is_available():
            row["torch_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["extra"] = {"placement": info, "tried": res["tried"], "batch_seconds": res.get("batch_seconds")}
        if res["N"] is None:
            row.update(status="failed", reason=f"no batch fits down to 1 ({res['tried']})")
        else:
            row.update(N=res["N"], requests=len(res["batch_seconds"]) * res["N"], gen_tokens=res["gen_tokens"],
                       prompt_tokens=res["prompt_tokens"], seconds=round(res["seconds"], 3),
                       prompt_len=round(res["prompt_tokens"] / (len(res["batch_seconds"]) * res["N"]), 1),
                       tok_s=res["gen_tokens"] / res["seconds"])
    except Exception as e:  # noqa: BLE001 - the row records any failure
        import traceback

        traceback.print_exc()
        row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:600])
    common.write_row(a.out, name, row)
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
