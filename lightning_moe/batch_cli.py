"""``moe-batch run-batch -i in.jsonl -o out.jsonl --model DIR``: run an OpenAI / vLLM batch file.

The CLI (``lightning_moe/cli.py``) calls :func:`add_subcommand` on its subparsers object; the handler calls
:func:`lightning_moe.app.batch_files.run_batch` (the formats, grouping and resume are described there). Its input
errors are ValueErrors that ``moe-batch`` prints as one line with exit status 2; a stop signal exits 75 (resumable).
"""

from __future__ import annotations

import argparse


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Handler of ``moe-batch run-batch``: runs the file, prints one summary line per group and one for the output."""
    from .app.batch_files import run_batch

    s = run_batch(args.input, args.output, args.model, device=args.device, dtype=args.dtype,
                  gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory, hardware=args.hardware, policy=args.policy,
                  executor=args.executor, expert_ffn=args.expert_ffn, batch_size=args.batch_size,
                  max_tokens=args.max_tokens, checkpoint_seconds=args.checkpoint_seconds,
                  progress=not args.no_progress)
    for g in s["groups"]:
        if g["report"] is not None:
            tps = g.get("end_to_end_tokens_per_s")
            ran = f"{g['ran']} of {g['requests']}" if g["ran"] != g["requests"] else f"{g['requests']}"
            print(f"  {g['group']} ({g['settings']}): {ran} request" + ("s" if g["requests"] != 1 else "")
                  + f", {g['generated_tokens']} tokens"
                  + (f", {tps:,.1f} tok/s" if tps else "") + f"; report: {g['report']}")
    print(f"{args.output}: {s['completed']} completed and {s['errors']} error records for {s['lines']} lines of "
          f"{args.input} ({s['written']} written by this run, {s['skipped_already_done']} already there); "
          f"state: {s['state']}")
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Register ``run-batch`` on an argparse subparsers object (sets ``func``)."""
    b = subparsers.add_parser(
        "run-batch", help="run an OpenAI / vLLM batch file (/v1/chat/completions, /v1/completions); resumable",
        description="Read the OpenAI Batch API request format (custom_id, method, url, body) and write its output "
                    "format, one line per request (a bad line becomes an error record naming it). Requests are grouped "
                    "by their sampling settings, each group run as a `moe-batch run` job; re-running with the same -o "
                    "writes only the missing custom_ids.")
    b.add_argument("-i", "--input", required=True, help="batch file (.jsonl, one request a line)")
    b.add_argument("-o", "--output", required=True, help="output file (.jsonl); its state goes to <stem>.batch/")
    b.add_argument("--model", required=True, help="checkpoint directory, or tiny-mixtral")
    b.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    b.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (default bfloat16)")
    b.add_argument("--gpu-memory", help="GPU budget, e.g. 24GiB (default: the GPU's)")
    b.add_argument("--cpu-memory", help="host budget for the planner, e.g. 192GiB")
    b.add_argument("--hardware", help="hardware preset (h200, l4, ...) or profile YAML (default: the CUDA device's preset, else h200)")
    b.add_argument("--policy", default="auto", help="auto (the planner, per group) or a policy YAML")
    b.add_argument("--executor", help="cgopipe or serial (default: cgopipe on cuda, serial on cpu)")
    b.add_argument("--expert-ffn", default="auto", help="cgopipe's expert FFN: auto, torch, triton or grouped_mm")
    b.add_argument("--batch-size", type=int, default=16, help="sequences per batch of the serial executor")
    b.add_argument("--max-tokens", type=int, default=128,
                   help="max_tokens of requests whose body gives none (default 128)")
    b.add_argument("--checkpoint-seconds", type=float, default=60.0,
                   help="save the partial generations of the sequences in flight this often (0: only on a stop "
                        "signal; default 60)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors (also MOE_BATCH_DEBUG=1)")
    b.set_defaults(func=cmd_run_batch)
