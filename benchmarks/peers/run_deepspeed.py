#!/usr/bin/env python3
"""Peer: DeepSpeed ZeRO-Inference (ZeRO stage 3, parameters offloaded to the host), greedy ``generate`` of the
MT-Bench first turns (chat template), the largest batch that fits under the GPU cap; one result row.

The model is loaded under ``transformers.integrations.HfDeepSpeedConfig`` (``zero.Init``: each parameter is
partitioned to the host as it is created; without it, the model is loaded to the host first), then
``deepspeed.initialize(model, config)`` with ``zero_optimization: {stage: 3, offload_param: {device: cpu,
pin_memory: true}}`` and bf16: every forward fetches each layer's parameters to the GPU and releases them after
(one process, world size 1; ``torch.distributed`` over NCCL on ``127.0.0.1``). The batch search and the timing are
``run_accelerate.run_batches``'s (the same prompts, ``min_new_tokens = max_new_tokens = --gen``); the CUDA
allocator is capped at ``--cap``.

DeepSpeed is not on the GPU host's image: install it first from the carried wheels (fetches nothing):
  python3 -m pip install --no-index --find-links .carry/peers/wheels deepspeed
(``deepspeed-0.19.8-py3-none-any.whl`` was built from PyPI's sdist with ``DS_BUILD_OPS=0 DS_ACCELERATOR=cuda``:
no precompiled ops; ZeRO-3 parameter offload to the CPU uses none). If the import or the engine fails, the row is
written with ``status: failed`` and the reason.

Examples:
  python3 benchmarks/peers/run_deepspeed.py CKPT --gen 128 --cap 12GiB --max-batch 256 --out OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import run_accelerate  # noqa: E402


def ds_config(pin: bool, device: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": device != "cpu"},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin},
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 2e8,
            "stage3_max_live_parameters": 1e9,
        },
        "wall_clock_breakdown": False,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--cap", default="12GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=240.0)
    ap.add_argument("--no-pin", action="store_true", help="offload_param.pin_memory false")
    ap.add_argument("--no-zero-init", action="store_true", help="load to the host, then partition")
    ap.add_argument("--mtbench", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    name = f"deepspeed-bf16-g{a.gen}"
    row = {"peer": "deepspeed", "weights": "bf16", "model": common.model_label(a.ckpt), "model_dir": a.ckpt,
           "gen_len": a.gen, "cap": a.cap if a.device != "cpu" else None, "device": common.device_name(),
           "command": " ".join(sys.argv)}
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    if a.device == "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    try:
        import torch

        try:
            import deepspeed
        except Exception as e:  # noqa: BLE001
            row.update(status="skipped", reason=f"deepspeed does not import: {type(e).__name__}: {e} (install: "
                       "pip install --no-index --find-links .carry/peers/wheels deepspeed)"[:600])
            common.write_row(a.out, name, row)
            return 1
        import transformers
        from transformers import AutoModelForCausalLM

        row["versions"] = {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__}
        if a.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            cap = common.parse_bytes(a.cap) or total
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        deepspeed.init_distributed(dist_backend="nccl" if a.device == "cuda" else "gloo")
        cfg = ds_config(not a.no_pin and a.device == "cuda", a.device)
        dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
        t0 = time.perf_counter()
        keep = None
        if not a.no_zero_init:
            try:
                from transformers.integrations import HfDeepSpeedConfig

                keep = HfDeepSpeedConfig(cfg)  # must stay alive while the model loads  # noqa: F841
            except ImportError:
                keep = None
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, **kw)
        engine = deepspeed.initialize(model=model, config=cfg)[0]
        engine.module.eval()
        row["load_s"] = round(time.perf_counter() - t0, 2)
        row["extra"] = {"zero_init": keep is not None, "ds_config": cfg}
        tok = run_accelerate.load_tokenizer(a.ckpt)
        device = "cuda:0" if a.device == "cuda" else "cpu"
        records = common.prompt_records(max(a.max_batch * a.batches, 80), a.mtbench)

        def generate(ids, mask, n_new):
            with torch.inference_mode():
                return engine.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                              min_new_tokens=n_new, do_sample=False, synced_gpus=False,
                                              pad_token_id=tok.pad_token_id)

        with common.GpuMemPoller() as mem:
            res = run_accelerate.run_batches(generate, tok, device, records, a.gen, a.max_batch, a.batches,
                                             a.time_budget)
        row["gpu_peak_gib"] = mem.peak_gib
        if torch.cuda.is_available():
            row["torch_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["extra"].update(tried=res["tried"], batch_seconds=res.get("batch_seconds"))
        if res["N"] is None:
            row.update(status="failed", reason=f"no batch fits down to 1 ({res['tried']})")
        else:
            nb = len(res["batch_seconds"])
            row.update(N=res["N"], requests=nb * res["N"], gen_tokens=res["gen_tokens"],
                       prompt_tokens=res["prompt_tokens"], seconds=round(res["seconds"], 3),
                       prompt_len=round(res["prompt_tokens"] / (nb * res["N"]), 1),
                       tok_s=res["gen_tokens"] / res["seconds"])
    except Exception as e:  # noqa: BLE001 - the row records any failure
        import traceback

        traceback.print_exc()
        row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:600])
    common.write_row(a.out, name, row)
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
