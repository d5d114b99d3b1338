"""``moe-batch quantize SRC DST --experts int4 [--up int2] [--group-size 128]``: write a quantized checkpoint.

The CLI (``lightning_moe/cli.py``) calls :func:`add_subcommand` on its subparsers object; the handler
calls :func:`lightning_moe.model.quantize.quantize_checkpoint`. Its errors are ValueErrors naming the
file or argument, which ``moe-batch`` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import sys


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def cmd_quantize(args: argparse.Namespace) -> int:
    """Handler of ``moe-batch quantize``: quantizes, prints a summary; returns 0 (errors raise ValueError)."""
    import time

    import torch

    from .model.quantize import quantize_checkpoint

    def progress(layer: int, layers: int) -> None:
        if args.quiet:
            return
        tty = sys.stderr.isatty()
        print(f"{chr(13) if tty else ''}quantizing experts: layer {layer}/{layers}",
              end="" if tty and layer < layers else "\n", file=sys.stderr, flush=True)

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    res = quantize_checkpoint(args.src, args.dst, experts=args.experts, up=args.up, group_size=args.group_size,
                              progress=progress, device=device)
    dt = time.perf_counter() - t0
    ratio = res.source_expert_bytes / max(1, res.packed_expert_bytes)
    print(f"wrote {res.dst}: {res.scheme} expert pages (group {res.group_size}, {res.page_bytes} bytes per expert), "
          f"{res.num_layers} layers x {res.num_experts} experts, in {dt:.1f} s "
          f"({_gib(res.source_expert_bytes / max(dt, 1e-9))}/s of source experts; codes on {device})")
    print(f"  experts: {_gib(res.source_expert_bytes)} ({res.source_dtype}) -> {_gib(res.packed_expert_bytes)} packed "
          f"({ratio:.2f}x smaller); other weights kept in {res.source_dtype}")
    print(f"  copied: {', '.join(res.copied_files) or 'no tokenizer files'}")
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register ``quantize`` on an argparse subparsers object (sets ``func``)."""
    q = subparsers.add_parser(
        "quantize", help="write a copy of a checkpoint (any supported family; its routed experts) with int4 / int2 expert pages",
        description="Quantize a Hugging Face Mixtral checkpoint's routed experts group-wise (int4; int4 with an "
                    "int2 up_proj, --up int2; or int2 everywhere, --experts int2, the largest error) into one fixed-size "
                    "page per expert; other weights keep the source dtype. "
                    "The output directory works as `model:` of a job (both executors).")
    q.add_argument("src", help="source checkpoint directory (config.json + safetensors + tokenizer)")
    q.add_argument("dst", help="output directory (must not exist, or be empty)")
    q.add_argument("--experts", default="int4", choices=["int4", "int2"], help="bits of the expert projections (default int4)")
    q.add_argument("--up", default=None, choices=["int2"], help="store up_proj (w3) at 2 bits (scheme int2-up, with --experts int4)")
    q.add_argument("--group-size", type=int, default=128, help="input columns per quantization group (default 128)")
    q.add_argument("--device", default="auto", help="where the codes are computed: auto (cuda when available), cpu, "
                   "cuda or cuda:N; the same bytes on either")
    q.add_argument("--quiet", action="store_true", help="no per-layer progress")
    q.set_defaults(func=cmd_quantize)
