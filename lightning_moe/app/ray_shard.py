"""One shard of a Ray job, run inside a Ray task (:func:`shard_messages`; ``app.ray_jobs`` submits it).

No shared filesystem is assumed: the task gets the job, the bytes of the files the job reads besides the checkpoint (the
input, a policy or hardware YAML), the ids of its shard that the driver already holds and its partial generations. It
writes them into a task-local temp directory, runs the shard there with :func:`app.engine.run_job` (the ids the driver
holds are stub records of the local results file: the run resumes past them; the partials are the local sidecar), and
sends back, as messages, every complete line the run appends to its results file and partial-generation sidecar (both
fsync'd, whole lines only), so the driver keeps them on its own disk. The temp directory is removed at the end.

Messages (dicts), in order: ``{"kind": "start", "pid", "host"}``; any number of ``{"kind": "lines", "records": [bytes],
"partials": [bytes]}``; ``{"kind": "end", "report": {...}}`` or ``{"kind": "error", "message"}`` for an error a retry
cannot fix (bad input, a checkpoint missing on the node, out of GPU memory). Any other failure raises, and the driver
submits the shard again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import tempfile
import threading
import time
from typing import Iterator, Optional

from ..config import TINY_MODEL, ConfigError, Job
from ..data.writer import _dumps, atomic_write

POLL_S = 0.2  # how often the task looks for new lines in its files
TMP_PREFIX = "moe-batch-shard-"  # the task-local directories: moe-batch-shard-I-of-N-pidP-XXXX in the temp directory


def remove_orphans() -> None:
    """Remove the task-local directories of shard tasks whose worker process is gone (killed: no cleanup ran)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = re.match(re.escape(TMP_PREFIX) + r"\d+-of-\d+-pid(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}") and os.path.isdir("/proc/self"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


class Tail:
    """The complete lines appended to a file since the last :meth:`read` (a file replaced by another, as the partials
    sidecar is on load, or removed, is read again from its start)."""

    def __init__(self, path: str, offset: int = 0):
        self.path = path
        self.offset = offset
        self.inode: Optional[int] = os.stat(path).st_ino if os.path.exists(path) else None

    def read(self) -> list[bytes]:
        """New complete lines (each ending in ``\\n``)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.inode, self.offset = None, 0
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset = st.st_ino, 0
        if st.st_size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].splitlines(keepends=True)


def local_job(job: Job, index: int, count: int, files: dict, root: str) -> tuple[Job, dict]:
    """``job`` as shard ``index`` of ``count`` in the task-local directory ``root``: the shipped ``files`` (original
    path -> bytes) written under ``root/input`` and named in place of the originals, the results in ``root/out``,
    device ``cuda`` for any CUDA device (Ray sets CUDA_VISIBLE_DEVICES to the task's GPUs), no ``ray`` section; and
    the map original path -> local path."""
    os.makedirs(os.path.join(root, "input"))
    local = {}
    for k, (orig, data) in enumerate(files.items()):
        p = os.path.join(root, "input", f"{k}-{os.path.basename(orig)}")
        with open(p, "wb") as f:
            f.write(data)
        local[orig] = p
    if job.model != TINY_MODEL and not os.path.isfile(os.path.join(job.model, "config.json")):
        raise ConfigError(f"{job.label}: model: checkpoint directory not found on Ray node {platform.node()}: "
                          f"{job.model} (every node needs the checkpoint at this path; see docs/RAY.md)")
    out = dataclasses.replace(job.output, path=os.path.join(root, "out", os.path.basename(job.output.path)))
    return dataclasses.replace(
        job, shard=(index, count), ray=None, output=out,
        data=dataclasses.replace(job.data, path=local.get(job.data.path, job.data.path)),
        policy=local.get(job.policy, job.policy) if isinstance(job.policy, str) else job.policy,
        hardware=local.get(job.hardware, job.hardware),
        device="cuda" if job.device.startswith("cuda") else job.device), local


def named_as_driver(line: bytes, back: dict) -> bytes:
    """A results line with the task-local paths of an error record's message (``file:line: field: problem``) put back
    to the driver's (``back``: local path -> original), so the record reads as a single-process run's."""
    if b'"error"' not in line:
        return line
    rec = json.loads(line)
    if not isinstance(rec.get("error"), str):
        return line
    for lp, orig in back.items():
        rec["error"] = rec["error"].replace(lp, orig)
    return _dumps(rec)


def seed_files(job: Job, done_ids: list, partials: bytes) -> int:
    """Write the task's results file with a stub record per id the driver holds (the run skips them) and its
    partial-generation sidecar with the driver's partials; returns the results file's size (new records follow)."""
    os.makedirs(os.path.dirname(job.output.path), exist_ok=True)
    stubs = b"".join(_dumps({"id": i, "held_by_driver": True}) for i in done_ids)
    atomic_write(job.output.path, lambda f: f.write(stubs))
    if partials:
        atomic_write(job.output.partial_path, lambda f: f.write(partials))
    return len(stubs)


def _end_report(report: dict) -> dict:
    """What the driver keeps of the shard run's report."""
    st = report.get("stats") or {}
    parts = report.get("partials") or {}
    return {k: report.get(k) for k in ("status", "skipped_already_done", "records_written_this_run", "policy",
                                        "host")} | {
        "resumed_sequences": parts.get("resumed_sequences", 0), "resumed_tokens": parts.get("resumed_tokens", 0),
        "prompt_tokens": st.get("prefill_tokens", 0), "generated_tokens": st.get("generated_tokens", 0),
        "wall_seconds": (report.get("wall_seconds") or {}).get("total")}


NO_RETRY = (ConfigError, ValueError, FileNotFoundError)  # errors a retry cannot fix (GpuOutOfMemory: by name below)


def shard_messages(job: Job, index: int, count: int, files: dict, done_ids: list, partials: bytes) -> Iterator[dict]:
    """Run shard ``index`` of ``count`` of ``job`` here and yield its messages (the module docstring)."""
    from .engine import run_job

    yield {"kind": "start", "pid": os.getpid(), "host": platform.node()}
    remove_orphans()
    root = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{index}-of-{count}-pid{os.getpid()}-")
    try:
        try:
            sjob, local = local_job(job, index, count, files, root)
        except NO_RETRY as e:
            yield {"kind": "error", "message": str(e)}
            return
        back = {lp: orig for orig, lp in local.items()}
        results = Tail(sjob.output.path, seed_files(sjob, done_ids, partials))
        sidecar = Tail(sjob.output.partial_path)
        box: dict = {}

        def run() -> None:
            try:
                box["report"] = run_job(sjob, progress=False)
            except BaseException as e:  # noqa: B036 -- handed to the generator, which raises or reports it
                box["error"] = e

        th = threading.Thread(target=run, name=f"moe-batch-shard-{index}", daemon=True)
        th.start()
        while True:
            alive = th.is_alive()
            recs, parts = [named_as_driver(b, back) for b in results.read()], sidecar.read()
            if recs or parts:
                yield {"kind": "lines", "records": recs, "partials": parts}
            if not alive:
                break
            time.sleep(POLL_S)
        err = box.get("error")
        if err is None:
            yield {"kind": "end", "report": _end_report(box["report"])}
        elif isinstance(err, NO_RETRY) or type(err).__name__ == "GpuOutOfMemory":
            yield {"kind": "error", "message": f"{platform.node()}: {err}"}
        else:
            raise RuntimeError(f"shard {index}/{count} on {platform.node()}: {type(err).__name__}: {err}") from err
    finally:
        shutil.rmtree(root, ignore_errors=True)
