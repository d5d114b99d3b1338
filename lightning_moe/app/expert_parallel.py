"""`moe-batch run` with ``gpus: G > 1``: G processes of one host (torch.multiprocessing spawn, a torch.distributed
group over localhost: gloo on the CPU, nccl on CUDA with process r on cuda:r), each running the job's batches with
the expert-parallel executor (pipeline/expert_parallel.py). Process 0 runs :func:`engine.run_job` as one process
would (resume state, the crash-safe results writer, partials, report); it sends the others the work it found to do
(request ids in order and the partial generations), and they run the same batches writing nothing."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys

import torch

from ..config import Job
from .gpu import use_device


def in_group() -> bool:
    """True inside a process of an expert-parallel group (torch.distributed initialized)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def group_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a group."""
    if not in_group():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def share_work(work_ids: list, partials: dict) -> tuple[list, dict]:
    """Process 0 sends (request ids of the work in order, partial generations) to the others, which receive them;
    outside a group it returns them as they are."""
    if not in_group():
        return work_ids, partials
    box = [work_ids, partials] if torch.distributed.get_rank() == 0 else [None, None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0], box[1]


class NoWriter:
    """The results writer of processes 1..G-1: counts, writes nothing (process 0 writes every record)."""

    def __init__(self) -> None:
        self.written = 0  # records that process 0 writes

    def write(self, record: dict) -> None:
        self.written += 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_expert_parallel(job: Job, lead, follow, progress: bool = True, log=None) -> dict:
    """Start ``job.gpus`` processes for ``job`` and wait for them; returns process 0's report (as saved). Process 0
    calls ``lead(job, progress=...)`` (engine.run_job), the others ``follow(job)`` (engine.follow_job). A process
    that fails ends the others (torch.multiprocessing.spawn) and its exception is raised here."""
    log = sys.stderr if log is None else log
    import torch.multiprocessing as mp

    from ..model.tiny import resolve_model_path

    resolve_model_path(job.model)  # the embedded model is created once, before the processes read it
    print(f"moe-batch: {job.gpus} expert-parallel processes ({_backend(job)} over localhost)", file=log)
    mp.spawn(_process, args=(job, lead, follow, _free_port(), progress, torch.get_num_threads()), nprocs=job.gpus, join=True)
    with open(job.output.report_path) as f:
        return json.load(f)


def _backend(job: Job) -> str:
    return "nccl" if job.device.startswith("cuda") else "gloo"


def _process(rank: int, job: Job, lead, follow, port: int, progress: bool, threads: int) -> None:
    """One process of the group: process 0 runs the job (``lead``), the others follow it (``follow``)."""
    torch.set_num_threads(threads)  # the launcher's (the processes share its cores; a GEMM's rounding may follow it)
    if job.device.startswith("cuda"):
        job = dataclasses.replace(job, device=f"cuda:{rank}")
        use_device(job.device)  # before NCCL starts: its communicator and every kernel on cuda:rank
    torch.distributed.init_process_group(_backend(job), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=job.gpus)
    try:
        if rank == 0:
            lead(job, progress=progress)
        else:
            follow(job)
    finally:
        torch.distributed.destroy_process_group()
