"""Results file (JSONL, one record per request, appended and fsync'd) and atomic JSON writes.

Record shapes (the writer checks only that ``id`` is a non-empty string; other keys are the caller's):

* generate: ``{"id", "prompt_tokens", "text", "output_ids", "output_tokens", "finish_reason"}`` (finish_reason:
  "stop"|"length"; ``truncated_tokens`` when the prompt was cut)
* error:    ``{"id", "error": "file:line: field: problem", "finish_reason": "error"}`` (see :func:`error_record`)
* scoring:  made by the scorer; any JSON-serializable dict with an ``id``.

Crash safety: each record is one ``os.write`` of a line ending in ``\\n`` on an ``O_APPEND`` descriptor,
followed by ``fsync``. A kill can leave at most one torn last line (no ``\\n``, or not a JSON object);
opening the file again truncates that line away (reported on stderr), so resuming re-runs that request.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional


class WriterError(ValueError):
    """A results file that cannot be resumed safely (corrupt line before the end, duplicate id), or a bad record."""


def error_record(req_id: str, error: str) -> dict:
    """The record written for a request that failed: ``{"id", "error", "finish_reason": "error"}``."""
    return {"id": req_id, "error": error, "finish_reason": "error"}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _dumps(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(", ", ": ")) + "\n").encode("utf-8")


def _scan(path: str) -> tuple[list[tuple[int, dict]], int, Optional[str]]:
    """Read a results file. Returns (records as (line, dict), byte length of the good prefix, torn tail or None).

    Only the last line may be bad (torn); a bad line before it raises WriterError.
    """
    with open(path, "rb") as f:
        data = f.read()
    records: list[tuple[int, dict]] = []
    pos = 0
    lineno = 0
    while pos < len(data):
        lineno += 1
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        raw = data[pos:end]
        rec = None
        if nl >= 0:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                rec = None
        if not isinstance(rec, dict):
            if end == len(data):  # the last line: torn by a kill mid-write
                return records, pos, raw[:80].decode("utf-8", "replace")
            if raw.strip() == b"":
                raise WriterError(f"{path}:{lineno}: blank line inside the results file (not written by ResultsWriter)")
            raise WriterError(f"{path}:{lineno}: not a JSON object record; the file is corrupt before its last line "
                              f"(move it away or fix that line)")
        records.append((lineno, rec))
        pos = end
    return records, pos, None



def _scan_repairing(path: str, consequence: str) -> tuple[list, int]:
    """:func:`_scan` of ``path``, truncating a torn last line away (fsync'd; one stderr line saying ``consequence``).
    Returns (records, bytes removed)."""
    records, good, torn = _scan(path)
    if torn is None:
        return records, 0
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(good)
        f.flush()
        os.fsync(f.fileno())
    print(f"moe-batch: {path}: removed a torn last line ({size - good} bytes: {torn!r}); {consequence}", file=sys.stderr)
    return records, size - good

def read_results(path: str) -> list[dict]:
    """All complete records of a results file, in file order (a torn last line is ignored, not repaired).

    Raises:
        WriterError: a corrupt line before the last one.
        FileNotFoundError: no such file.
    """
    records, _good, _torn = _scan(path)
    return [r for _line, r in records]


class ResultsWriter:
    """Append-only JSONL results file, resumable by request id.

    On open the file is created if missing (parent directories too). If it exists, its records are
    indexed by id and a torn last line is truncated away (a message goes to stderr). ``write`` appends one
    line with ``os.write`` + ``os.fsync`` under a lock (safe to call from several threads).

    Raises (constructor):
        WriterError: a corrupt line before the last, a record without a string ``id``, or a duplicate id
            (the message names the file and both lines).
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}  # id -> line number in the file
        self._errors: set[str] = set()  # ids whose record is an error record
        self.repaired_bytes = 0  # bytes of a torn last line removed on open (0 = none)
        self.written = 0  # records this writer appended (this run)
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        if os.path.exists(self.path):
            records, self.repaired_bytes = _scan_repairing(self.path, "its request will run again")
            for lineno, rec in records:
                rid = rec.get("id")
                if not isinstance(rid, str) or not rid:
                    raise WriterError(f"{self.path}:{lineno}: id: missing or not a string in a results record")
                if rid in self._ids:
                    raise WriterError(f"{self.path}:{lineno}: id: duplicate id {rid!r} (first at line {self._ids[rid]})")
                self._ids[rid] = lineno
                if "error" in rec:
                    self._errors.add(rid)
            self._lines = len(records)
        else:
            self._lines = 0
        created = not os.path.exists(self.path)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:
            _fsync_dir(parent)

    # ---- queries --------------------------------------------------------------------------------
    def done_ids(self) -> set:
        """Ids that already have a record (including error records) -- skip these when resuming."""
        with self._lock:
            return set(self._ids)

    def error_ids(self) -> set:
        """Ids whose record is an error record."""
        with self._lock:
            return set(self._errors)

    def __len__(self) -> int:
        return len(self._ids)

    # ---- writing --------------------------------------------------------------------------------
    def write(self, record: dict) -> None:
        """Append one record as a JSON line, then flush and fsync.

        Raises:
            WriterError: the record has no non-empty string ``id``, its id was already written, or the writer
                is closed.
            TypeError/ValueError: the record is not JSON-serializable.
        """
        rid = record.get("id") if isinstance(record, dict) else None
        if not isinstance(rid, str) or not rid:
            raise WriterError(f"{self.path}: record needs a non-empty string 'id', got {record!r:.120}")
        line = _dumps(record)
        with self._lock:
            if self._fd is None:
                raise WriterError(f"{self.path}: write after close")
            if rid in self._ids:
                raise WriterError(f"{self.path}: id {rid!r} already has a record (line {self._ids[rid]})")
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
            self._lines += 1
            self.written += 1
            self._ids[rid] = self._lines
            if "error" in record:
                self._errors.add(rid)

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass


def write_json_atomic(path: str, obj: Any, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: temp file in the same directory, fsync, ``os.replace``.

    Readers see the old file or the new one, never a partial one; no temp file is left behind, also on error.

    Raises:
        TypeError/ValueError: ``obj`` is not JSON-serializable (``path`` is left untouched).
    """
    def write(f) -> None:
        f.write(json.dumps(obj, indent=indent, ensure_ascii=False).encode("utf-8") + b"\n")

    atomic_write(path, write)


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Create or replace ``path`` atomically: ``write(binary file)`` into a temp file in the same directory,
    fsync, ``os.replace``, fsync the directory. On any error the temp file is removed and ``path`` is untouched."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(parent)


def iter_jsonl_records(path: str) -> Iterator[tuple[int, dict]]:
    """``(line, record)`` for every complete record of a results file (used by shard merging).

    Raises:
        WriterError: a corrupt line anywhere, including a torn last line (the shard did not finish cleanly).
    """
    records, _good, torn = _scan(path)
    if torn is not None:
        raise WriterError(f"{path}:{len(records) + 1}: torn last line {torn!r} (the run was killed mid-write; "
                          f"re-run that shard to complete it)")
    yield from records


class PartialsFile:
    """The partial-generation sidecar beside a results file (``<stem>.partial.jsonl``): the tokens generated so far by
    sequences that have no record yet, so a killed or stopped run loses at most one checkpoint interval.

    Each line is ``{"id": str, "start": int, "ids": [int, ...]}``: the output tokens of request ``id`` from output
    position ``start`` on; a job that asks for log-probs (``generation.logprobs``) adds ``"logprobs": [...]``, one
    entry per token of ``ids`` (``[logprob, top or null]``, kept as written: :attr:`logprobs`). A sequence's partial is its lines joined in file order (a line whose ``start`` is below the
    length so far replaces the tokens from there). :meth:`append` writes all lines of one checkpoint with one
    ``os.write`` on an ``O_APPEND`` descriptor, then ``fsync``, so a kill leaves at most a torn last line.

    On open the file is read: a torn last line is truncated away (a message goes to stderr); a bad line before the
    last raises WriterError naming the file and line. :meth:`load` returns the partials of the ids still to do.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self.partials: dict[str, list[int]] = {}  # id -> tokens, every id of the file (before load's filtering)
        self.logprobs: dict[str, Optional[list]] = {}  # id -> one log-prob entry per token of its partial; None when a
        #   line of it had none (a job without logprobs wrote it)
        self.repaired_bytes = 0  # bytes of a torn last line removed on open (0 = none)
        self.bytes_written = 0  # bytes this object appended
        if not os.path.exists(self.path):
            return
        records, self.repaired_bytes = _scan_repairing(
            self.path, "the sequence it belonged to resumes from its previous checkpoint")
        for lineno, rec in records:
            rid, start, ids = rec.get("id"), rec.get("start"), rec.get("ids")
            if not isinstance(rid, str) or not rid:
                raise WriterError(f"{self.path}:{lineno}: id: missing or not a string in a partial-generation line")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise WriterError(f"{self.path}:{lineno}: start: expected an integer >= 0, got {start!r}")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise WriterError(f"{self.path}:{lineno}: ids: expected a list of token ids")
            lps = rec.get("logprobs")
            if lps is not None and (not isinstance(lps, list) or len(lps) != len(ids)):
                raise WriterError(f"{self.path}:{lineno}: logprobs: expected a list of {len(ids)} entries (one per "
                                  f"token of ids)")
            cur = self.partials.setdefault(rid, [])
            if start > len(cur):
                raise WriterError(f"{self.path}:{lineno}: start: {start} leaves a gap after the {len(cur)} tokens of "
                                  f"{rid!r} before it (not written by moe-batch; delete the file to start those "
                                  f"sequences over)")
            del cur[start:]
            cur.extend(ids)
            lp = self.logprobs.setdefault(rid, [])
            if lp is not None:
                if lps is None and ids:
                    self.logprobs[rid] = None
                else:
                    del lp[start:]
                    lp.extend(lps or [])

    def load(self, todo_ids, done_ids) -> dict[str, list[int]]:
        """The partials of ``todo_ids`` (ids to generate this run), then rewrite the file atomically with exactly those
        (one line each; the file is removed when none is left). Partials of ``done_ids`` (a record was written: the
        partial is obsolete) are dropped silently; those of ids in neither (no longer in the input) are dropped with a
        message on stderr."""
        todo, done = set(todo_ids), set(done_ids)
        keep = {i: t for i, t in self.partials.items() if i in todo and t}
        stale = sorted(i for i in self.partials if i not in todo and i not in done)
        if stale:
            print(f"moe-batch: {self.path}: ignoring the partial generations of {len(stale)} ids not in the input "
                  f"({', '.join(map(repr, stale[:3]))}{', ...' if len(stale) > 3 else ''})", file=sys.stderr)
        def line(i: str, t: list) -> dict:
            lp = self.logprobs.get(i)
            return {"id": i, "start": 0, "ids": t, **({"logprobs": lp} if lp is not None else {})}

        if keep:
            atomic_write(self.path, lambda f: f.write(b"".join(_dumps(line(i, t)) for i, t in keep.items())))
        elif os.path.exists(self.path):
            self.remove()
        self.partials = dict(keep)
        self.logprobs = {i: self.logprobs.get(i) for i in keep}
        return {i: list(t) for i, t in keep.items()}

    def append(self, lines: list[tuple]) -> int:
        """Append ``(id, start, ids)`` or ``(id, start, ids, logprobs)`` lines with one write, then fsync; returns the
        bytes written (the file and its parent directory are created on the first append)."""
        if not lines:
            return 0

        def line(i, s, t, lp=None) -> dict:
            return {"id": i, "start": s, "ids": list(t), **({"logprobs": list(lp)} if lp is not None else {})}

        data = b"".join(_dumps(line(*ln)) for ln in lines)
        with self._lock:
            if self._fd is None:
                parent = os.path.dirname(self.path)
                os.makedirs(parent, exist_ok=True)
                created = not os.path.exists(self.path)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if created:
                    _fsync_dir(parent)
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
            self.bytes_written += len(data)
        return len(data)

    def remove(self) -> None:
        """Close and delete the file (every sequence it held has a record)."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(self.path))

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_partials(path: str) -> dict[str, list[int]]:
    """The partials of a sidecar file by id, as :class:`PartialsFile` joins them (read only: a torn last line is
    ignored, not repaired). A missing file has none."""
    if not os.path.exists(path):
        return {}
    records, _good, _torn = _scan(path)
    out: dict[str, list[int]] = {}
    for _line, rec in records:
        cur = out.setdefault(rec["id"], [])
        del cur[rec["start"]:]
        cur.extend(rec["ids"])
    return out
