"""``moe-batch``: the command line (thin: every subcommand calls into the package).

    moe-batch run JOB.yaml [--shard I/N] [--set key=value ...] [--no-progress]
    moe-batch run JOB.yaml --ray ADDRESS|local [--shards N]   the shards as Ray tasks, retried, merged (docs/RAY.md)
    moe-batch merge JOB.yaml --shards N           join shard outputs, check every id exactly once
    moe-batch plan ... / moe-batch profile ...    the planner (see ``moe-batch plan -h``)
    moe-batch quantize SRC DST --experts int4 [--up int2] [--group-size 128]   int4/int2 expert pages
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys


def _shard_output(path: str, index: int, count: int) -> str:
    """results.jsonl -> results.shard-I-of-N.jsonl (each shard of a job array writes its own file)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.shard-{index}-of-{count}{ext or '.jsonl'}"


def _load(args) -> "object":
    from .config import load_job, parse_override

    overrides = dict(parse_override(s) for s in (args.set or []))
    if getattr(args, "shard", None):
        overrides["shard"] = args.shard
    if getattr(args, "ray", None):
        overrides["ray.address"] = args.ray
    if getattr(args, "shards_ray", None):
        overrides["ray.shards"] = args.shards_ray
    job = load_job(args.job, overrides)
    if job.shard is not None:
        job = dataclasses.replace(job, output=dataclasses.replace(job.output, path=_shard_output(job.output.path, *job.shard)))
    return job


def cmd_run(args) -> int:
    from .app.engine import run_job
    from .app.report import format_report
    from .config import ConfigError

    job = _load(args)
    if job.ray is not None:
        return _run_on_ray(job, args)
    spans = None
    if args.timeline:  # checked before the run: a missing matplotlib must not cost the run
        from .plot import PlotError, check_matplotlib

        try:
            check_matplotlib("--timeline")
        except PlotError as e:
            raise ConfigError(str(e)) from None
        spans = []
    report = run_job(job, progress=not args.no_progress, spans=spans)
    if report.get("nothing_to_do"):
        print("nothing to do; the earlier run that finished this job reported:")
        _say_settings_differ(report, job)
    print(format_report(report))
    print(f"  report: {job.output.report_path}")
    if spans:
        from .plot import PlotError, save_timeline

        pol = report.get("policy") or {}
        title = (f"{job.name}: measured stage timeline, {os.path.basename(str(report.get('model_path') or job.model))} "
                 f"on {job.device} ({job.dtype}), cgopipe mu {pol.get('mu')} x n {pol.get('n')}, "
                 f"{pol.get('resident_experts')} resident experts"
                 + (" -- on the CPU the GPU lanes run on the CPU, synchronously" if job.device == "cpu" else ""))
        try:
            print(f"  timeline: {save_timeline(args.timeline, spans, title)}")
        except PlotError as e:
            raise ConfigError(str(e)) from None
    elif spans is not None:
        print("  timeline: nothing ran (no batch), nothing drawn")
    return 0


def _say_settings_differ(report: dict, job) -> None:
    """A finished job re-run with another executor or device reads the earlier run's report: say so (those settings
    change speed, not records, so the finished file stands)."""
    for key in ("executor", "device"):
        was, now = report.get(key), getattr(job, key)
        if was is not None and was != now:
            print(f"note: this job asks for {key} {now}, the earlier run used {was}; the records are done, so nothing "
                  f"ran (set output.path to a new file to run it with {key} {now})")


def _run_on_ray(job, args) -> int:
    """``moe-batch run`` of a job with a ``ray`` section (or --ray / --shards): its shards as Ray tasks."""
    from .app.ray_jobs import format_ray_report, run_ray_job
    from .app.report import format_report
    from .config import ConfigError

    if args.timeline:
        raise ConfigError(f"{job.label}: --timeline draws one process's stages; a Ray job runs its shards elsewhere")
    report = run_ray_job(job, progress=not args.no_progress)
    if report.get("nothing_to_do"):
        print("nothing to do; the earlier run that finished this job reported:")
    print(format_ray_report(report) if "ray" in report else format_report(report))
    print(f"  report: {job.output.report_path}")
    return 0


def cmd_merge(args) -> int:
    from .data.shard import merge_results
    from .data.sources import load_requests

    job = _load(args)
    if args.shards:
        paths = [_shard_output(job.output.path, i, args.shards) for i in range(args.shards)]
    else:
        stem, ext = os.path.splitext(job.output.path)
        paths = sorted(glob.glob(f"{glob.escape(stem)}.shard-*-of-*{ext}"))
        counts = {re.search(r"shard-\d+-of-(\d+)", p).group(1) for p in paths}
        if not paths or len(counts) != 1:
            raise SystemExit(f"moe-batch merge: found shard files {paths or 'none'} for {job.output.path}; pass --shards N")
    expected = [r.id for r in load_requests(job)]
    # --output is a command-line path: relative to the current directory (as JOB.yaml is); the default, the job's
    # output.path, resolved against the YAML's directory like every path inside the YAML
    out = os.path.abspath(args.output) if args.output else job.output.path
    info = merge_results(paths, out, expected)
    print(f"merged {info['records']} records ({info['errors']} error records) from {len(paths)} shards into "
          f"{args.output or out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-batch", description="Offline batch inference for MoE LLMs on a small GPU.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job YAML (generate or score); resumes where a previous run stopped")
    r.add_argument("job", help="job YAML file")
    r.add_argument("--shard", help="I/N: run only shard I (0-based) of N, split by id hash")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a job key, e.g. generation.max_new_tokens=8")
    r.add_argument("--ray", metavar="ADDRESS|local", help="run the job's shards as Ray tasks on the cluster at ADDRESS "
                   "(host:port, ray://host:port, auto) or on a Ray runtime started here (local); retried, merged into "
                   "one results file; needs pip install 'lightning-moe[ray]' (docs/RAY.md)")
    r.add_argument("--shards", dest="shards_ray", type=int, metavar="N", help="number of Ray shards (with --ray, or "
                   "alone: the job's ray.address, default local)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors (also MOE_BATCH_DEBUG=1)")
    r.add_argument("--timeline", metavar="FILE.png", help="draw the run's measured stage timeline (cgopipe executor: "
                   "H2D pages, GPU attention, expert FFN, CPU attention per lane over wall time; needs matplotlib: "
                   "pip install 'lightning-moe[plot]')")
    r.set_defaults(func=cmd_run)

    m = sub.add_parser("merge", help="join the shard outputs of a job; every input id must appear exactly once")
    m.add_argument("job", help="job YAML file (the one the shards ran)")
    m.add_argument("--shards", type=int, help="number of shards N (default: discovered from the files)")
    m.add_argument("--output", help="merged results file; a relative path is relative to the current directory "
                   "(default: the job's output.path, which resolves against the YAML's directory)")
    m.add_argument("--set", action="append", metavar="KEY=VALUE", help="the same overrides the shards ran with")
    m.set_defaults(func=cmd_merge)

    try:
        from .plan_cli import add_subcommands
    except ImportError:  # planner not installed in this build
        pass
    else:
        add_subcommands(sub)
    from .quantize_cli import add_subcommand as add_quantize

    add_quantize(sub)
    from .batch_cli import add_subcommand as add_run_batch

    add_run_batch(sub)
    return p


# module -> pip name of pyproject's runtime dependencies a command imports lazily (a missing one: one line, exit 2)
DECLARED_PACKAGES = {"highspy": "highspy", "pulp": "pulp", "mistral_common": "mistral-common", "yaml": "pyyaml",
                     "safetensors": "safetensors", "transformers": "transformers", "pandas": "pandas", "tqdm": "tqdm",
                     "sentencepiece": "sentencepiece", "psutil": "psutil", "google.protobuf": "protobuf"}


def split_set_argument(argv: list) -> str:
    """The message for a ``--set KEY VALUE`` written as two arguments (argparse would say only "unrecognized
    arguments: VALUE"), or ''."""
    for a, b in zip(argv, argv[1:] + [""]):
        if a == "--set" and b and "=" not in b and not b.startswith("-"):
            return f"--set takes KEY=VALUE as one argument, got '--set {b}': write --set {b}=VALUE"
    return ""


def main(argv=None) -> int:
    """Entry point of the ``moe-batch`` console script. Input errors (the job, its data, a policy that does not fit, a
    missing dependency: DECLARED_PACKAGES) print one line and exit 2; running out of GPU memory prints one line and exits 3 (finished records kept); a
    SIGTERM / SIGINT stops a run after its current decode step with one "resumable" line and exit 75 (records and
    partial generations saved); an interrupt outside a run exits 130; a Ray shard that failed past its retries prints one
    line and exits 1 (the records that came back kept); stdout's reader leaving early (``| head``) is not an error."""
    from .config import ConfigError

    bad_set = split_set_argument(sys.argv[1:] if argv is None else list(argv))
    if bad_set:
        print(f"moe-batch: error: {bad_set}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if getattr(args, "debug", False):
        os.environ["MOE_BATCH_DEBUG"] = "1"
    try:
        return args.func(args) or 0
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if os.environ.get("MOE_BATCH_DEBUG"):
            raise
        print(f"moe-batch: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in DECLARED_PACKAGES or os.environ.get("MOE_BATCH_DEBUG"):
            raise
        pkg = DECLARED_PACKAGES[e.name]
        print(f"moe-batch: error: the package '{pkg}' (a dependency of lightning-moe) is not installed: pip install "
              f"'{pkg}' (a host without network: docs/GPU.md, 'A host without network')", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .app.engine import GpuOutOfMemory
        from .app.ray_jobs import ShardFailed
        from .model.tiny import MissingPackage

        if not isinstance(e, (GpuOutOfMemory, ShardFailed, MissingPackage)):
            raise
        print(f"moe-batch: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, GpuOutOfMemory) else 2 if isinstance(e, MissingPackage) else 1
    except BrokenPipeError:  # stdout's reader left (`moe-batch run JOB | head`); a run prints after its files are written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 0
    except KeyboardInterrupt:
        print("moe-batch: interrupted; finished records are saved, re-run the same command to resume", file=sys.stderr)
        return 130
    except BaseException as e:  # JobStopped (imported here: plan and profile need no torch)
        from .app.engine import EXIT_STOPPED, JobStopped

        if not isinstance(e, JobStopped):
            raise
        print(f"moe-batch: {e}", file=sys.stderr)
        return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
