"""``moe-batch plan`` and ``moe-batch profile``: argparse sub-commands and their handlers.

The CLI (``lightning_moe/cli.py``) calls :func:`add_subcommands` on its subparsers object; each parser sets
``func`` to its handler, which takes the parsed namespace and returns an exit status (0 ok, 2 error;
errors are one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

from .model.spec import PACKED_FORMATS, QUANT_FORMATS
from .policy.hardware import HardwareError, format_bytes, parse_bytes, resolve_hardware
from .policy.policy import (DEFAULT_CPU_RESERVE, Budgets, PlanInfeasible, Workload,
                            check_cpu_budget, check_gpu_budget, format_table, gpu_reserve_for)
from .policy.registry import registry_expert_format, resolve_spec

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


class CommandError(Exception):
    """A user error in a sub-command: printed as one line, exit status 2."""


_PLAN_ERRORS = (CommandError, HardwareError, ValueError, OSError)  # what a plan's inputs raise (PlanInfeasible too)


def _plan_failed(e: Exception) -> int:
    """``moe-batch plan``'s one line on stderr for a plan it cannot make (a PlanInfeasible says what does not fit;
    any other error prints as ``error: ...``); returns the exit status 2."""
    print(f"moe-batch plan: {e}" if isinstance(e, PlanInfeasible) else f"moe-batch plan: error: {e}", file=sys.stderr)
    return 2


def _bytes_arg(s: str) -> int:
    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints_arg(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``plan`` and ``profile`` on an argparse subparsers object (each sets ``func``)."""
    p = subparsers.add_parser(
        "plan", help="choose a CGOPipe policy with the HRM + MILP and print predicted throughput",
        description="Plan micro-batching, expert residency and the CPU/GPU attention split for a model on a host "
                    "(MoE-Lightning's HRM + MILP). Give a job YAML, or --model/--hardware and the workload shape.")
    p.add_argument("job", nargs="?", help="job YAML: use its model, hardware, budgets and real tokenized prompt lengths")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="with a job YAML: override a job key, as `moe-batch run --set` does")
    p.add_argument("--model", help="registry name (mixtral-8x7b, ...), tiny-mixtral, or a checkpoint directory")
    p.add_argument("--hardware", help="preset (t4, l4, a100-40g, h100, h200) or a profile .yaml from `moe-batch profile` "
                   "(required with --model; with a job YAML: the job's, else h200)")
    p.add_argument("--gpu-memory", type=_bytes_arg, help="GPU memory budget, e.g. 24GiB (default: the hardware's)")
    p.add_argument("--gpus", type=int, help="GPUs of one host, expert parallel (default 1, or the job's gpus): "
                   "--gpu-memory is per GPU")
    p.add_argument("--cpu-memory", type=_bytes_arg, help="host memory budget, e.g. 192GiB (default: the hardware's)")
    p.add_argument("--prompt-len", type=float, help="mean prompt length in tokens")
    p.add_argument("--max-prompt-len", type=int, help="longest prompt in tokens (sizes the KV cache; default: prompt length)")
    p.add_argument("--gen-len", type=int, help="tokens generated per sequence")
    p.add_argument("--num-prompts", type=int, help="sequences in the job (caps N = mu * n)")
    p.add_argument("--quant", default=None, choices=["bf16", "fp16", "fp32", *QUANT_FORMATS, *PACKED_FORMATS],
                   help="expert page format (default: the checkpoint's packed format, e.g. gpt-oss's mxfp4, else the "
                        "model dtype)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPE_NAMES), help="model dtype (default bf16, or the job's)")
    p.add_argument("--gpu-reserve", type=_bytes_arg, help="GPU bytes kept free (default 1GiB, or the profile's "
                   "measured gpu_context_bytes where larger)")
    p.add_argument("--cpu-reserve", type=_bytes_arg, help="host bytes kept free (default 2GiB)")
    p.add_argument("--mu-candidates", type=_ints_arg, help="comma-separated micro-batch sizes to choose from")
    p.add_argument("--time-limit", type=float, default=20.0, help="seconds per HiGHS solve (default 20)")
    p.add_argument("--output", "-o", help="write the chosen policy as YAML")
    p.add_argument("--plot", metavar="FILE.png", help="draw the hierarchical roofline and the predicted stage times "
                   "(needs matplotlib: pip install 'lightning-moe[plot]')")
    p.set_defaults(func=cmd_plan)

    q = subparsers.add_parser(
        "profile", help="measure this host (PCIe, GEMM, HBM, host memory, CPU attention) into a hardware YAML",
        description="Measure pinned host<->device copies, a bf16 GEMM, a device copy, host memory bandwidth and "
                    "the CPU decode-attention routine. Without CUDA only the CPU side is measured.")
    q.add_argument("--output", "-o", default="profile.yaml", help="YAML to write (default profile.yaml)")
    q.add_argument("--name", default="measured", help="profile name recorded in the YAML")
    q.add_argument("--gpu-preset", default="h200", help="preset for the GPU fields when there is no CUDA device (default h200)")
    q.add_argument("--gpu-memory", type=_bytes_arg, help="record this GPU memory instead of the device total")
    q.add_argument("--quick", action="store_true", help="small sizes: seconds, noisier")
    q.add_argument("--cpu", action="store_true", help="measure the CPU profile that jobs on device: cpu are predicted "
                   "with (policy.cpu_hrm) and write it to this machine's cache, where those jobs read it (they "
                   "measure it on first use otherwise)")
    q.add_argument("--expert-shapes", type=lambda v: [x for x in v.split(",") if x], default=None, metavar="MODEL[,MODEL]",
                   help="models (registry names or checkpoint directories) whose expert shape the expert-FFN kernel "
                        "probe rates on CUDA, Triton vs grouped_mm per tokens-per-call bucket, and for an MXFP4 model "
                        "(gpt-oss) the MXFP4 kernel too (default mixtral-8x7b)")
    q.set_defaults(func=cmd_profile)


def build_parser(prog: str = "moe-batch") -> argparse.ArgumentParser:
    """A parser with just these sub-commands (tests; the real CLI adds ``run`` too)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` with :func:`build_parser` and run the handler (for tests and ``python -m``)."""
    args = build_parser().parse_args(argv)
    return args.func(args)


def _job_inputs(args: argparse.Namespace):
    """(Workload, job or None) for ``moe-batch plan JOB.yaml`` via app.plan.job_workload (lazy import)."""
    try:  # lazy, as the job path's other imports below: app.plan reads a checkpoint with torch
        from .app.plan import job_workload
    except ImportError as e:
        raise CommandError(f"{args.job}: planning from a job needs lightning_moe.app.plan.job_workload, "
                           f"which is not available yet ({e}); use --model/--hardware/--prompt-len/--gen-len") from None
    ov: dict = {}
    try:
        if getattr(args, "set", None):
            from .config import parse_override

            ov = dict(parse_override(x) for x in args.set)
        workload = job_workload(args.job, **({"overrides": ov} if ov else {}))
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    job = None
    try:
        from .config import load_job

        job = load_job(args.job, ov) if ov else load_job(args.job)
    except ImportError:
        pass
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    return workload, job


def cmd_plan(args: argparse.Namespace) -> int:
    """Handler of ``moe-batch plan``: prints the policy table, predicted tok/s and solve time; 0 ok, 2 error."""
    from .policy.milp import default_solve_cache, plan  # lazy: pulp and HiGHS only for this command

    try:
        workload, job = _plan_workload(args)
        if job is not None and not args.hardware and str(getattr(job, "device", "")).startswith("cpu"):
            return _plan_cpu_job(job, workload, args.output)  # everything on the CPU: the CPU executor's roofline
        model, hw, notes = _plan_model_and_hardware(args, job)
        spec = resolve_spec(model)
        if job is not None and not (args.hardware or getattr(job, "hardware", None)):  # as `moe-batch run` plans it
            hw = _with_model_expert_rates(job, model, spec, hw)
        budgets = _plan_budgets(args, job, model, spec, hw)
        t0 = time.perf_counter()
        policy, est = plan(spec, hw, workload, budgets, candidates=args.mu_candidates, time_limit=args.time_limit,
                            job_fit=True, solve_cache=default_solve_cache())
        elapsed = time.perf_counter() - t0
    except _PLAN_ERRORS as e:
        return _plan_failed(e)
    print(format_table(policy, est, spec, hw))
    for note in (*est.notes, *notes):
        print(note)
    print(f"solved in {elapsed:.2f} s")
    if getattr(args, "plot", None):
        from .plot import PlotError, save_plan_plot  # lazy: matplotlib

        try:
            print(f"roofline drawn to {save_plan_plot(args.plot, spec, hw, policy, workload, est)}")
        except PlotError as e:
            return _plan_failed(e)
    return _save_policy(args, policy, est, spec, hw, budgets, workload) if args.output else 0


def _plan_workload(args: argparse.Namespace):
    """(Workload, job or None): a job YAML's real lengths (``--prompt-len`` / ``--gen-len`` override them), else the
    shape the flags give."""
    if getattr(args, "set", None) and not args.job:
        raise CommandError("--set overrides a job's keys: give a job YAML")
    if args.job:
        workload, job = _job_inputs(args)
        if args.gen_len is not None or args.prompt_len is not None:
            workload = Workload(prompt_len=args.prompt_len or workload.prompt_len, gen_len=args.gen_len or workload.gen_len,
                                max_prompt_len=workload.max_prompt_len if args.prompt_len is None else args.max_prompt_len,
                                num_requests=workload.num_requests, name=workload.name,
                                prompt_lens=workload.prompt_lens if args.prompt_len is None else None)
        return workload, job
    if args.prompt_len is None or args.gen_len is None:
        raise CommandError("give a job YAML, or --prompt-len and --gen-len")
    return Workload(prompt_len=args.prompt_len, gen_len=args.gen_len, max_prompt_len=args.max_prompt_len,
                    num_requests=args.num_prompts, name=f"prompt {args.prompt_len:g} / gen {args.gen_len}"), None


def _plan_model_and_hardware(args: argparse.Namespace, job):
    """(model path or name, hardware profile, notes): ``--model`` / ``--hardware``, else the job's; a job that names no
    hardware gets the profile ``moe-batch run`` would (app.plan.job_hardware, resolved once here) and a note."""
    model = args.model or (job.model if job is not None else None)
    hardware = args.hardware or (getattr(job, "hardware", None) if job is not None else None)
    if not model:
        raise CommandError("--model is required (or a job YAML naming the model)")
    notes = []  # what the user should know about which job this plan is for
    job_hw = None
    if job is not None and not hardware:  # as `moe-batch run`: this host's measured profile (no CUDA here: h200)
        from .app.plan import hardware_note, job_hardware  # lazy: torch (the device's name)

        job_hw = job_hardware(job)
        notes.append(hardware_note(job, job_hw))
    if job is not None and getattr(job, "executor", "cgopipe") != "cgopipe":
        notes.append(f"note: the job runs executor: {job.executor} (device {getattr(job, 'device', '?')}), which "
                     "takes no policy: this is the policy executor: cgopipe would run")
    if not hardware and job_hw is None:
        raise CommandError("--hardware is required (a preset: t4, l4, a100-40g, h100, h200; or a profile .yaml)")
    if model == "tiny-mixtral":  # the embedded model: its directory (created on first use)
        from .model.tiny import resolve_model_path  # lazy: torch

        model = resolve_model_path(model)
    return model, job_hw or resolve_hardware(hardware), notes


def _with_model_expert_rates(job, model: str, spec, hw):
    """``hw`` with the expert FFN rates and the host issue probe of the job's model (app.plan.with_model_measurements,
    as ``moe-batch run``'s plan_job adds them: measured once on this CUDA host where its measured profile lacks them)."""
    from types import SimpleNamespace

    from .app.plan import with_model_measurements  # lazy: torch

    return with_model_measurements(job, SimpleNamespace(spec=spec, model_path=model), hw)  # what it reads of Prepared


def _plan_budgets(args: argparse.Namespace, job, model: str, spec, hw) -> Budgets:
    """The planner's budgets: memory (the flags, else as ``moe-batch run`` plans the job, else the profile's), dtype,
    expert page format (the checkpoint's, else ``--quant``, else the dtype) and GPUs; a page format or GPU count
    the model cannot run, or memory the hardware does not have, is a CommandError / ValueError."""
    if args.gpu_memory or job is None:
        gpu_mem = args.gpu_memory or hw.gpu_memory
    else:  # as `moe-batch run` plans the job: its cap, else its card (when this machine has it), else the profile's
        from .app.plan import job_gpu_budget  # lazy: torch

        gpu_mem = job_gpu_budget(job, hw)
    cpu_mem = args.cpu_memory or (getattr(job, "cpu_memory", None) if job is not None else None) or hw.host_memory
    dtype = _DTYPE_NAMES[args.dtype] if args.dtype else _DTYPE_NAMES.get(getattr(job, "dtype", "bf16") if job is not None else "bf16", "bf16")
    fam = _family(spec)
    ckpt_q = _page_format(args, model, fam)
    check_gpu_budget(int(gpu_mem), hw)  # a plan for memory the card does not have would fail at run time
    check_cpu_budget(int(cpu_mem), hw)  # nor one for host memory the machine does not have
    gpus = args.gpus if args.gpus is not None else (getattr(job, "gpus", 1) if job is not None else 1)
    if gpus > 1 and fam is not None:
        from .pipeline.expert_parallel import expert_parallel_refusal  # lazy: torch

        why = expert_parallel_refusal(spec)
        if why is not None:
            raise CommandError(f"--gpus {gpus}: {why}")
    return Budgets(gpu_memory=int(gpu_mem), cpu_memory=int(cpu_mem), weight_quant=args.quant or ckpt_q or dtype, dtype=dtype,
                   gpu_reserve=gpu_reserve_for(hw) if args.gpu_reserve is None else args.gpu_reserve,
                   cpu_reserve=DEFAULT_CPU_RESERVE if args.cpu_reserve is None else args.cpu_reserve, gpus=gpus)


def _family(spec):
    """The model family that runs ``spec``; None for a registry model no family runs (planned only)."""
    from .model.families import family_of  # lazy: the families' modules import torch

    try:
        return family_of(spec)
    except ValueError:  # a registry model no family runs (planned only): nothing of run's to refuse
        return None


def _page_format(args: argparse.Namespace, model: str, fam) -> Optional[str]:
    """The expert page format the checkpoint declares (gpt-oss's MXFP4: "mxfp4"; a quantized checkpoint's), or a
    registry name's Hub checkpoint holds (gpt-oss-20b / -120b; --quant overrides it for a name, not for a
    directory); ``--quant`` checked against it and against what ``moe-batch quantize`` can write for the family."""
    from .model.quantized import checkpoint_expert_scheme  # lazy: torch

    ckpt_q = checkpoint_expert_scheme(model) if os.path.isdir(model) else None
    if not args.quant and ckpt_q is None:
        ckpt_q = registry_expert_format(model)
    if args.quant and ckpt_q and args.quant != ckpt_q:
        raise CommandError(f"--quant {args.quant} but {model} holds {ckpt_q} expert pages")
    if args.quant in QUANT_FORMATS and fam is not None:  # a plan for pages quantize cannot write is refused
        from .model.quantize import packed_pages_refusal  # lazy: torch

        why = packed_pages_refusal(fam)
        if why is not None:
            raise CommandError(f"--quant {args.quant}: {why}")
    return ckpt_q


def _save_policy(args: argparse.Namespace, policy, est, spec, hw, budgets, workload) -> int:
    """Write the policy to ``--output`` with a header naming the plan; 0 ok, 2 error."""
    per = f" x {budgets.gpus} GPUs" if budgets.gpus > 1 else ""
    header = (f"moe-batch plan: {spec.name} on {hw.name}, GPU {format_bytes(budgets.gpu_memory)}{per}, host {format_bytes(budgets.cpu_memory)}, "
              f"{workload.name or 'workload'}\npredicted end-to-end {est.e2e_tok_s:.1f} tok/s (prefill {est.prefill_tok_s:.0f}, "
              f"decode {est.decode_tok_s:.1f}); binding: prefill {est.prefill_binding}, decode {est.decode_binding}"
              + (f"\njob: {sum(est.job_rows)} requests through {est.N} slots in {len(est.job_rows)} prefill pass(es), "
                 f"predicted end-to-end {est.job_e2e_tok_s:.1f} tok/s (the whole schedule)" if est.job_rows else ""))
    try:
        policy.save(args.output, header=header)
    except OSError as e:
        print(f"moe-batch plan: error: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    print(f"policy written to {args.output}")
    return 0


def _plan_cpu_job(job, workload, output: Optional[str] = None) -> int:
    """``moe-batch plan JOB.yaml`` for a job on ``device: cpu``: this machine's CPU profile (app.cpu_plan, cached),
    the cgopipe policy plan_cpu picks (or the serial executor's batches) and the prediction; with ``output``, the
    cgopipe policy written there (a serial job has none: an error); 0 ok, 2 error."""
    from .app.cpu_plan import cpu_estimate, cpu_profile, plan_cpu_job
    from .model.quantized import checkpoint_expert_scheme
    from .model.spec import MoESpec
    from .model.tiny import resolve_model_path
    from .policy.cpu_hrm import format_cpu_table

    try:
        path = resolve_model_path(job.model)
        spec = MoESpec.from_pretrained_dir(path)
        if workload.scoring:
            raise CommandError("a scoring job on the CPU is not modelled by the CPU roofline (generation only)")
        prof = cpu_profile()
        policy = None
        if job.executor == "cgopipe":
            wq = checkpoint_expert_scheme(path) or {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[job.dtype]
            policy, est = plan_cpu_job(job, spec, workload, wq)
        else:
            if output:
                raise CommandError("--output: the serial executor takes no policy (it runs batches of batch_size); "
                                   "plan the job with executor: cgopipe to write one")
            est = cpu_estimate(job, spec, workload)
    except _PLAN_ERRORS as e:
        return _plan_failed(e)
    print(format_cpu_table(spec, prof, est, job.executor, policy))
    if output:
        try:
            policy.save(output, header=f"moe-batch plan: {spec.name} on this CPU ({job.executor})")
        except OSError as e:
            print(f"moe-batch plan: error: cannot write {output}: {e}", file=sys.stderr)
            return 2
        print(f"policy written to {output}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Handler of ``moe-batch profile``: measures, prints one line per measurement, writes the YAML; 0 ok, 2 error."""
    from .pipeline.profiler import profile_host  # lazy: torch, only for this command

    if getattr(args, "cpu", False):
        from .app.cpu_plan import cpu_profile_path, measure_and_cache

        try:
            prof = measure_and_cache()
        except (HardwareError, ValueError, OSError) as e:
            print(f"moe-batch profile: error: {e}", file=sys.stderr)
            return 2
        print(f"CPU profile of {prof.machine}: matmul {prof.matmul_flops_fp32 / 1e9:.1f} GFLOP/s fp32, memory "
              f"{prof.memory_bandwidth / 1e9:.1f} GB/s, GEMM call {prof.gemm_call * 1e6:.1f} us, op {prof.op_call * 1e6:.2f} us")
        print(f"profile written to {cpu_profile_path()}")
        return 0
    try:
        kw = {} if args.expert_shapes is None else {"expert_shapes": args.expert_shapes}
        prof = profile_host(name=args.name, gpu_preset=args.gpu_preset, gpu_memory=args.gpu_memory, quick=args.quick,
                            **kw)
        header = f"moe-batch profile, {prof.date}\nhost: {prof.host}\n{prof.source}"
        prof.save(args.output, header=header)
        cached = _cache_gpu_profile(prof, header)
    except (HardwareError, ValueError, OSError) as e:
        print(f"moe-batch profile: error: {e}", file=sys.stderr)
        return 2
    print(f"profile written to {args.output}" + (f" and cached as {cached}: jobs on this host that name no hardware "
                                                  "plan with it" if cached else ""))
    return 0


def _cache_gpu_profile(prof, header: str) -> Optional[str]:
    """Copy a profile measured on CUDA to this host's cache (app.plan.save_gpu_profile), where jobs that name no
    hardware find it; returns the path, or None without CUDA (then the GPU fields are a preset's, not measured)."""
    from .app.gpu import device_name
    from .app.plan import save_gpu_profile

    name = device_name("cuda")
    return None if name is None else save_gpu_profile(prof, name, header)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
