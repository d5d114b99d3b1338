"""lightning_moe.data.shard: stable id hashing, disjoint/complete shards, merge checks."""

import json
import subprocess
import sys

import pytest

from lightning_moe.data.shard import MergeError, merge_results, select_shard, shard_of
from lightning_moe.data.sources import Request
from lightning_moe.data.writer import ResultsWriter, WriterError, read_results

IDS = [f"q{i}" for i in range(200)]


def test_shard_of_is_stable_across_processes():
    here = [shard_of(i, 7) for i in IDS[:20]]
    code = "from lightning_moe.data.shard import shard_of; print([shard_of(f'q{i}', 7) for i in range(20)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert str(here) == other.strip()
    assert shard_of("q0", 1) == 0
    with pytest.raises(ValueError):
        shard_of("q0", 0)


def test_select_shard_disjoint_complete_ordered():
    reqs = [Request(id=i, source="f", line=n + 1, prompt="p") for n, i in enumerate(IDS)]
    parts = [select_shard(reqs, k, 4) for k in range(4)]
    got = [r.id for p in parts for r in p]
    assert sorted(got) == sorted(IDS) and len(got) == len(set(got))
    assert all(len(p) > 20 for p in parts)  # roughly balanced
    for p in parts:  # input order kept
        assert [r.line for r in p] == sorted(r.line for r in p)
    assert select_shard(IDS, 1, 4) == [r.id for r in parts[1]]  # plain id strings work too
    assert select_shard(reqs, 0, 4) == parts[0]  # deterministic
    for bad in ((4, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            select_shard(reqs, *bad)


def _write_shards(tmp_path, ids, count=3):
    paths = []
    for k in range(count):
        p = tmp_path / f"shard{k}.jsonl"
        with ResultsWriter(str(p)) as w:
            for i in reversed(select_shard(ids, k, count)):  # any order inside a shard
                w.write({"id": i, "text": i.upper()})
        paths.append(str(p))
    return paths


def test_merge_in_expected_order(tmp_path):
    ids = IDS[:30]
    paths = _write_shards(tmp_path, ids)
    out = tmp_path / "merged.jsonl"
    s = merge_results(paths, str(out), expected_ids=ids)
    assert s == {"records": 30, "errors": 0, "shards": 3}
    assert [r["id"] for r in read_results(str(out))] == ids
    assert read_results(str(out))[3] == {"id": "q3", "text": "Q3"}
    s = merge_results(paths, str(out))  # no expected ids: shard order
    assert s["records"] == 30 and sorted(r["id"] for r in read_results(str(out))) == sorted(ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.jsonl", "shard0.jsonl", "shard1.jsonl", "shard2.jsonl"]


def test_merge_detects_duplicate(tmp_path):
    ids = IDS[:30]
    paths = _write_shards(tmp_path, ids)
    out = str(tmp_path / "merged.jsonl")
    dup = select_shard(ids, 0, 3)[0]
    with open(paths[1], "a") as f:
        f.write(json.dumps({"id": dup, "text": "again"}) + "\n")
    with pytest.raises(MergeError, match=rf"shard1\.jsonl:\d+: id: duplicate id '{dup}' \(also at .*shard0\.jsonl:\d+\)"):
        merge_results(paths, out, expected_ids=ids)
    assert not (tmp_path / "merged.jsonl").exists()  # nothing written on error


def test_merge_missing_and_unexpected(tmp_path):
    ids = IDS[:30]
    paths = _write_shards(tmp_path, ids[:-1])  # last id never ran
    out = str(tmp_path / "merged.jsonl")
    with pytest.raises(MergeError, match=r"1 expected id\(s\) have no record in the shards: 'q29'"):
        merge_results(paths, out, expected_ids=ids)
    with pytest.raises(MergeError, match=r"shard\d\.jsonl:\d+: id: unexpected id"):
        merge_results(paths, out, expected_ids=ids[:10])
    with pytest.raises(MergeError, match="cannot be one of the shard files"):
        merge_results(paths, paths[0])


def test_merge_refuses_torn_shard(tmp_path):
    paths = _write_shards(tmp_path, IDS[:9])
    with open(paths[2], "a") as f:
        f.write('{"id": "q100", "te')
    with pytest.raises(WriterError, match=r"shard2\.jsonl:\d+: torn last line"):
        merge_results(paths, str(tmp_path / "m.jsonl"))
