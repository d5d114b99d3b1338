"""Sharding requests over independent runs (``--shard I/N``) and merging their result files.

A request belongs to shard ``sha256(id) mod N`` (first 8 bytes of the digest, big-endian): stable across
processes, machines and Python versions (unlike ``hash()``), and independent of file order, so shards
stay disjoint and complete even if the input file is reordered.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Optional, Sequence

from lightning_moe.data.writer import _dumps, atomic_write, iter_jsonl_records


class MergeError(ValueError):
    """Shard results that do not merge into exactly one record per expected id."""


def shard_of(req_id: str, count: int) -> int:
    """Shard index (0..count-1) of a request id: ``int(sha256(id)[:8]) % count``.

    Raises:
        ValueError: ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    h = hashlib.sha256(str(req_id).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % count


def select_shard(requests: Sequence, index: int, count: int) -> list:
    """The requests (objects with ``.id``, or id strings) of shard ``index`` of ``count`` (0-based), in input order.

    Raises:
        ValueError: ``count < 1`` or ``index`` outside ``0..count-1``.
    """
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index is 0-based and must be in 0..{count - 1}, got {index}")
    return [r for r in requests if shard_of(r if isinstance(r, str) else r.id, count) == index]


def merge_results(shard_paths: Sequence[str], out_path: str, expected_ids: Optional[Iterable[str]] = None) -> dict:
    """Join shard result files into one results file (written atomically).

    Args:
        shard_paths: results.jsonl of each shard.
        out_path: merged file (must not be one of the inputs).
        expected_ids: the ids of the whole job in input order; when given, every id must appear exactly once
            and the output follows this order. Otherwise the output is the shards' records in the order given.

    Returns:
        ``{"records": n, "errors": number of error records, "shards": len(shard_paths)}``.

    Raises:
        MergeError: an id in two places (names both file:line), a missing id (count and the first few), an
            unexpected id (names file:line), or ``out_path`` among the inputs.
        WriterError: a shard file with a corrupt or torn line (names file:line).
        FileNotFoundError: a shard file is missing.
    """
    out_abs = os.path.abspath(out_path)
    if any(os.path.abspath(p) == out_abs for p in shard_paths):
        raise MergeError(f"{out_path}: the merged output cannot be one of the shard files")
    expected = list(expected_ids) if expected_ids is not None else None
    expected_set = set(expected) if expected is not None else None
    by_id: dict[str, dict] = {}
    where: dict[str, str] = {}
    order: list[str] = []
    for p in shard_paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: shard results file not found")
        for lineno, rec in iter_jsonl_records(p):
            rid = rec.get("id")
            loc = f"{p}:{lineno}"
            if not isinstance(rid, str):
                raise MergeError(f"{loc}: id: missing or not a string")
            if rid in by_id:
                raise MergeError(f"{loc}: id: duplicate id {rid!r} (also at {where[rid]})")
            if expected_set is not None and rid not in expected_set:
                raise MergeError(f"{loc}: id: unexpected id {rid!r} (not in the job's requests)")
            by_id[rid] = rec
            where[rid] = loc
            order.append(rid)
    if expected is not None:
        missing = [i for i in expected if i not in by_id]
        if missing:
            shown = ", ".join(repr(i) for i in missing[:10])
            raise MergeError(f"{out_path}: {len(missing)} expected id(s) have no record in the shards: {shown}"
                             + (" ..." if len(missing) > 10 else ""))
        order = expected
    def write(f) -> None:
        for rid in order:
            f.write(_dumps(by_id[rid]))

    atomic_write(out_abs, write)
    return {"records": len(order), "errors": sum(1 for i in order if "error" in by_id[i]), "shards": len(shard_paths)}
