"""lightning_moe.data.writer: append + fsync, torn-line repair on open, resumable ids, atomic JSON."""

import json
import os
import threading

import pytest

from lightning_moe.data.writer import ResultsWriter, WriterError, error_record, read_results, write_json_atomic


def rec(i, **kw):
    return {"id": f"r{i}", "prompt_tokens": 3, "text": f"out {i}", "output_ids": [1, 2], "finish_reason": "length", **kw}


def test_write_and_reopen(tmp_path):
    p = tmp_path / "sub" / "results.jsonl"  # parent dirs are created
    with ResultsWriter(str(p)) as w:
        w.write(rec(0))
        w.write(error_record("r1", "d.jsonl:2: prompt: empty string"))
        assert w.done_ids() == {"r0", "r1"} and w.error_ids() == {"r1"} and len(w) == 2
    lines = p.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == rec(0)
    assert json.loads(lines[1]) == {"id": "r1", "error": "d.jsonl:2: prompt: empty string", "finish_reason": "error"}
    with ResultsWriter(str(p)) as w:
        assert w.done_ids() == {"r0", "r1"} and w.error_ids() == {"r1"} and w.repaired_bytes == 0
        w.write(rec(2))
    assert [r["id"] for r in read_results(str(p))] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("tail", [b'{"id": "r2", "text": "hal', b'{"id": "r2"}', b"\x00\x00\x00", b"garbage\n", b"\n"])
def test_torn_last_line_is_truncated(tmp_path, capsys, tail):
    p = tmp_path / "results.jsonl"
    with ResultsWriter(str(p)) as w:
        w.write(rec(0))
        w.write(rec(1))
    good = p.read_bytes()
    p.write_bytes(good + tail)  # a kill mid-write
    with ResultsWriter(str(p)) as w:
        assert w.done_ids() == {"r0", "r1"}  # the torn record is not counted as done
        assert w.repaired_bytes == len(tail)
        assert p.read_bytes() == good
        w.write(rec(2))
    assert "removed a torn last line" in capsys.readouterr().err
    assert [r["id"] for r in read_results(str(p))] == ["r0", "r1", "r2"]


def test_corruption_before_last_line_and_duplicates_raise(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text(json.dumps(rec(0)) + "\nnot json\n" + json.dumps(rec(1)) + "\n")
    with pytest.raises(WriterError, match=r"results\.jsonl:2: not a JSON object record"):
        ResultsWriter(str(p))
    p.write_text(json.dumps(rec(0)) + "\n" + json.dumps(rec(1)) + "\n" + json.dumps(rec(0)) + "\n")
    with pytest.raises(WriterError, match=r"results\.jsonl:3: id: duplicate id 'r0' \(first at line 1\)"):
        ResultsWriter(str(p))
    p.write_text(json.dumps({"text": "no id"}) + "\n")
    with pytest.raises(WriterError, match=r"results\.jsonl:1: id: missing"):
        ResultsWriter(str(p))


def test_write_rejects_bad_records(tmp_path):
    w = ResultsWriter(str(tmp_path / "r.jsonl"))
    w.write(rec(0))
    with pytest.raises(WriterError, match="already has a record"):
        w.write(rec(0))
    with pytest.raises(WriterError, match="non-empty string 'id'"):
        w.write({"text": "x"})
    with pytest.raises(TypeError):
        w.write({"id": "z", "bad": object()})
    w.close()
    w.close()  # idempotent
    with pytest.raises(WriterError, match="write after close"):
        w.write(rec(5))
    assert [r["id"] for r in read_results(str(tmp_path / "r.jsonl"))] == ["r0"]  # failed writes left no bytes


def test_threads_write_whole_lines(tmp_path):
    p = tmp_path / "r.jsonl"
    with ResultsWriter(str(p)) as w:
        ts = [threading.Thread(target=lambda k=k: [w.write(rec(k * 50 + i, text="x" * 500)) for i in range(50)])
              for k in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    recs = read_results(str(p))
    assert len(recs) == 200 and {r["id"] for r in recs} == {f"r{i}" for i in range(200)}


def test_unicode_roundtrip(tmp_path):
    p = tmp_path / "r.jsonl"
    with ResultsWriter(str(p)) as w:
        w.write(rec(0, text="héllo 🤖\nnew line"))
    assert read_results(str(p))[0]["text"] == "héllo 🤖\nnew line"
    assert len(p.read_text(encoding="utf-8").splitlines()) == 1


def test_write_json_atomic(tmp_path):
    p = tmp_path / "rep" / "run.report.json"
    write_json_atomic(str(p), {"tok_s": 12.5, "n": [1, 2]})
    assert json.loads(p.read_text()) == {"tok_s": 12.5, "n": [1, 2]}
    write_json_atomic(str(p), {"tok_s": 13.0})
    assert json.loads(p.read_text()) == {"tok_s": 13.0}
    with pytest.raises(TypeError):
        write_json_atomic(str(p), {"bad": object()})
    assert json.loads(p.read_text()) == {"tok_s": 13.0}  # untouched by the failed write
    assert os.listdir(p.parent) == ["run.report.json"]  # no temp files left


def test_atomic_write_gives_the_mode_open_would(tmp_path):
    """The report written atomically is readable like the results file (mkstemp alone makes it 0600)."""
    import os

    from lightning_moe.data.writer import atomic_write

    mask = os.umask(0o022)
    try:
        atomic_write(str(tmp_path / "r.json"), lambda f: f.write(b"{}"))
        with open(tmp_path / "plain.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "r.json").st_mode & 0o777 == os.stat(tmp_path / "plain.json").st_mode & 0o777 == 0o644
