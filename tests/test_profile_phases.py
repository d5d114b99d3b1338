"""benchmarks/profile_prefill.py's phase analysis (``phase_table``) on a synthetic Chrome trace: per phase the wall,
the device-busy time as the union of overlapping kernel / copy intervals, the idle gaps over 50 us and the host
events inside the largest gap."""

import json

from benchmarks import profile_prefill as pp


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_phase_table_busy_union_gaps_and_host_events(tmp_path):
    ev = [_k("spin_kernel", 0, 1),
          _k("gemm_a", 10, 100), _k("gemm_b", 50, 100), _k("Memcpy HtoD", 60, 200, "gpu_memcpy"),  # union [10, 260)
          _k("silu", 1260, 40),  # a 1000 us gap before it
          _k("Lazy Function Loading", 700, 5, "overhead"), _k("cudaMalloc", 300, 400, "cuda_runtime"),
          _k("cudaLaunchKernel", 1290, 3, "cuda_runtime"),  # outside the gap, too short to list
          _k("spin_kernel", 2000, 1), _k("decode_k", 2010, 30), _k("decode_k", 2070, 30)]  # 30 us gap: not counted
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    out = pp.phase_table(str(path), ["prefill", "decode"], 5).splitlines()
    head = [ln for ln in out if ln.startswith("phase")]
    assert head[0].startswith("phase 0 prefill: wall 1.3 ms, device busy 0.3 ms")  # busy: [10, 260) + 40 us
    assert "1 gaps > 50 us = 1.0 ms" in head[0]
    gap = next(ln for ln in out if ln.startswith("  gap"))
    assert "after Memcpy HtoD / before silu" in gap and "cudaMalloc 0.40" in gap and "Lazy Function Loading" in gap
    assert head[1].startswith("phase 1 decode: wall 0.1 ms, device busy 0.1 ms, 0 gaps")


def test_read_trace_gz(tmp_path):
    import gzip

    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": [_k("x", 0, 1)]}, f)
    assert pp.read_trace(str(p))[0]["name"] == "x"
