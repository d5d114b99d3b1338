"""The printed run report: measured vs predicted per phase with the ratio and the HRM's binding stage, the policy's
fields by name, GPU memory per phase against the cap, stage seconds without counters."""

from lightning_moe.app.report import format_report

GiB = 2**30


def _report(**kw):
    r = {"job": "j", "status": "done", "task": "generate", "mode": None, "model": "m", "device": "cuda:0",
         "dtype": "bfloat16", "executor": "cgopipe", "requests_in_shard": 10, "shard": None, "skipped_already_done": 0,
         "records_written_this_run": 10, "errors_recorded": 0, "prompt_tokens": 1234, "generated_tokens": 320,
         "prefill_tokens_per_s": 500.0, "decode_tokens_per_s": 30.0, "end_to_end_tokens_per_s": 25.0,
         "wall_seconds": {"total": 12.5, "load": 1.0, "prefill": 2.5, "decode": 9.0},
         "predicted": {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 40.0, "end_to_end_tokens_per_s": 33.3,
                       "decode_binding": "h2d", "prefill_binding": "gpu"},
         "policy": {"mu": 4, "n": 3, "N": 12, "n_gpu_attn": 1, "page_buffer_bytes": 3 * GiB},
         "memory": {"cap_bytes": 12 * GiB, "predicted_by_phase": {"prefill": 10 * GiB, "decode": 9 * GiB},
                    "measured_by_phase": {"prefill": {"allocated": int(9.5 * GiB), "reserved": 10 * GiB}},
                    "predicted_host_bytes": 4 * GiB, "predicted_host_phase": "load"},
         "peak_host_memory_bytes": 3 * GiB, "peak_gpu_memory_bytes": int(9.5 * GiB),
         "stages": {f"s{i}": float(i) for i in range(12)} | {"x_calls": 99.0, "y_bytes": 1e9,
                                                                  "cpu_attention_native_team_thread_s": 99.0},
         "results": "/tmp/r.jsonl"}
    r.update(kw)
    return r


def _row(text, first):
    return next(line.split() for line in text.splitlines() if line.split()[:1] == [first])


def test_phases_measured_predicted_binding():
    text = format_report(_report())
    assert _row(text, "prefill") == ["prefill", "500.0", "1,000.0", "0.50", "2.50", "gpu"]
    assert _row(text, "decode") == ["decode", "30.0", "40.0", "0.75", "9.00", "h2d"]
    # end-to-end: the phase with more predicted seconds (decode: 320 / 40 = 8 s against prefill's 1234 / 1000)
    assert _row(text, "end-to-end") == ["end-to-end", "25.0", "33.3", "0.75", "11.50", "decode:", "h2d"]
    fast_decode = _report(predicted={**_report()["predicted"], "decode_tokens_per_s": 1000.0})
    assert _row(format_report(fast_decode), "end-to-end")[-2:] == ["prefill:", "gpu"]
    no_pred = _report(predicted={})
    assert _row(format_report(no_pred), "end-to-end")[-1] == "-"


def test_end_to_end_wall_is_the_span_its_rate_is_over():
    """The end-to-end row's seconds are warm-up + prefill + decode, what its tokens/s divides by, not the whole run's
    total (load and start-up are in the wall line below the table)."""
    w = {"total": 40.0, "setup": 5.0, "load": 10.0, "warmup": 1.5, "prefill": 2.5, "decode": 9.0, "other": 12.0}
    assert _row(format_report(_report(wall_seconds=w)), "end-to-end")[4] == "13.00"


def test_policy_memory_and_stages():
    text = format_report(_report(), top_stages=3)
    assert "micro-batch rows (mu) 4" in text and "GPU-attention micro-batches 1" in text
    assert "GPU page buffers 3.0 GiB" in text
    assert "peak memory: host 3.00 GiB (predicted 4.00 GiB, load phase), GPU 9.50 GiB" in text
    assert _row(text, "prefill")[:1] == ["prefill"]
    mem = [line.split() for line in text.splitlines() if line.split()[:1] in (["prefill"], ["decode"])]
    assert ["prefill", "10.00", "9.50", "10.00", "12.00"] in mem and ["decode", "9.00", "-", "-", "12.00"] in mem
    assert "largest 3 of 11" in text and "s0 " not in text and "s11 11.000, s10 10.000, s9 9.000" in text
    assert "x_calls" not in text and "y_bytes" not in text and "native" not in text  # counters: in the JSON only


def test_scoring_has_one_phase_and_no_prediction():
    r = _report(task="score", mode="perplexity", predicted=None, decode_tokens_per_s=None, memory=None)
    text = format_report(r)
    assert _row(text, "prefill")[:4] == ["prefill", "500.0", "-", "-"]
    assert not any(line.split()[:1] == ["decode"] for line in text.splitlines())


def test_killed_runs_get_the_records_no_entry_counts():
    from lightning_moe.app.report import reconcile_killed_runs

    runs = [{"records_written": 5, "status": "stopped (resumable)"}, {"records_written": 0, "status": "killed"}]
    got = reconcile_killed_runs(runs, 12)
    assert [r["records_written"] for r in got] == [5, 7] and "results file" in got[1]["counts"]
    assert runs[1]["records_written"] == 0  # the input is not changed
    got = reconcile_killed_runs([{"records_written": 5, "status": "done"}], 9)  # killed before any report save
    assert [r["records_written"] for r in got] == [5, 4] and got[1]["status"] == "killed"
    assert reconcile_killed_runs(runs, 5) == runs  # nothing missing


def test_host_memory_by_phase_line():
    mem = _report()["memory"] | {"measured_host_by_phase": {
        "load": {"peak_rss": 78 * GiB, "anon": 76 * GiB, "file": int(1.5 * GiB)},
        "decode": {"peak_rss": 124 * GiB, "anon": 88 * GiB, "file": 35 * GiB}}}
    text = format_report(_report(memory=mem))
    assert "host GiB by phase: peak rss (anon, mapped files at its end): load 78.00 (anon 76.00, file 1.50), " \
           "decode 124.00 (anon 88.00, file 35.00)" in " ".join(text.split())
    assert "host GiB by phase" not in format_report(_report())  # nothing measured: no line


def test_cpu_device_host_prediction_names_the_device_tensors():
    """On device cpu the GPU memory model's tensors live in host memory: the host line says so (a user read 7.07
    measured vs 2.40 predicted as a 3x miss)."""
    mem = _report()["memory"] | {"predicted_peak_bytes": int(5.5 * GiB)}
    text = format_report(_report(device="cpu", memory=mem))
    assert "peak memory: host 3.00 GiB (predicted 4.00 GiB, load phase; and on top, 5.50 GiB the GPU model counts, " \
           "which device cpu holds in host memory)" in " ".join(text.split())
    assert "device cpu holds" not in format_report(_report(memory=mem))  # cuda: the GPU's own memory


def test_host_reserve_named_and_no_gpu_table_on_cpu():
    """Helper-31: a CPU report printed a GPU memory table of dashes, and host predicted 2.01 GiB against 0.39 measured
    without a word: 2 GiB of it is the planner's host reserve (an allowance). The host line names the reserve of the
    predicted phase; device cpu prints no GPU memory table (its bytes are in the host line); cuda still does."""
    comps = {"load": {"host reserve": 2 * GiB, "page pool": GiB}, "run": {"host reserve": 3 * GiB}}
    mem = _report()["memory"] | {"predicted_host_components": comps}
    text = " ".join(format_report(_report(device="cpu", memory=mem)).split())
    assert "(predicted 4.00 GiB, load phase, of which 2.00 GiB the planner's host reserve (policy cpu_reserve" in text
    assert "GPU memory (GiB)" not in text
    assert "GPU memory (GiB)" in format_report(_report(memory=mem))


def test_timing_counts_the_warmup_in_end_to_end_not_in_prefill():
    """wall_seconds.warmup (the first prefill's warm-up pass) is inside end-to-end and the wall sum, outside prefill
    tokens/s."""
    from lightning_moe.app.report import timing
    from lightning_moe.pipeline.executor import RunStats

    s = RunStats(prefill_tokens=600, prefill_seconds=1.0, decode_tokens=90, generated_tokens=100, decode_seconds=3.0,
                 warmup_seconds=2.0)
    t = timing(s, t_load=4.0, total=11.5, task="generate", t_setup=0.5)
    w = t["wall_seconds"]
    assert w["warmup"] == 2.0 and w["other"] == 11.5 - 0.5 - 4.0 - 2.0 - 1.0 - 3.0
    assert t["prefill_tokens_per_s"] == 600.0 and t["decode_tokens_per_s"] == 30.0
    assert t["end_to_end_tokens_per_s"] == 100 / 6.0
    sc = RunStats(prefill_tokens=600, prefill_seconds=1.0, warmup_seconds=2.0)  # a scoring job: no decode
    assert timing(sc, 4.0, 8.0, "score")["end_to_end_tokens_per_s"] == 600 / 3.0


def test_prediction_notes_print_under_the_throughput_table():
    """The estimate's notes (what the prediction leaves out) print under the table they qualify, before the wall
    line; a report without notes prints none."""
    note = "note: hardware h200 has no host issue times"
    pred = _report()["predicted"] | {"notes": [note]}
    lines = format_report(_report(predicted=pred)).splitlines()
    at = lines.index("  " + note)
    assert lines[at - 1].split()[:1] == ["end-to-end"]
    assert not any("note:" in line for line in format_report(_report()).splitlines())


def test_busy_host_at_start_gets_a_note():
    """A run that started on a busy host (1-minute load >= half its CPUs, as recorded in host_load_at_start) says
    so under the table; a quiet host, or no load average, says nothing."""
    busy = format_report(_report(host_load_at_start=[2.6, 2]))
    assert "note: the host's load average was 2.6 on 2 CPUs as the run started" in busy
    for load in ([0.4, 2], None):
        assert "load average" not in format_report(_report(host_load_at_start=load))


def test_host_probe_prints_under_the_throughput_table():
    """``predicted.host_probe`` (the profile's host probe that priced the decode host term) prints as a "host term"
    line under the table, before the notes; none without it (no host stage), none for a scoring job."""
    pred = _report()["predicted"] | {"host_probe": "qwen3_moe", "notes": ["note: x"]}
    lines = format_report(_report(predicted=pred)).splitlines()
    at = lines.index("  host term: priced by the profile's host issue probe 'qwen3_moe' (host_issue_by_family)")
    assert lines[at - 1].split()[:1] == ["end-to-end"] and lines[at + 1] == "  note: x"
    generic = format_report(_report(predicted=pred | {"host_probe": "generic"}))
    assert "  host term: priced by the profile's generic host issue probe (Mixtral-shaped" in generic
    assert "host term" not in format_report(_report()) + format_report(_report(predicted=pred | {"host_probe": None}))
    assert "host term" not in format_report(_report(task="score", mode="perplexity", predicted=pred))


def test_cpu_attention_rate_as_it_ran_prints_against_the_profiles():
    """Where the decode attended on the CPU, a line gives the KV the worker read per second of its attention
    (stages cpu_attention_valid_kv_bytes / cpu_attention_compute) against ``predicted.cpu_attention_bandwidth``, the
    rate the HRM's cpu term divides by; none without the stages or without the profile's rate."""
    pred = _report()["predicted"] | {"cpu_attention_bandwidth": 80e9}
    stages = {"cpu_attention_valid_kv_bytes": 4.0e12, "cpu_attention_compute": 100.0}
    text = format_report(_report(predicted=pred, stages=stages))
    assert ("  CPU attention as it ran: 4,000.0 GB of KV in 100.00 s, 40.0 GB/s (0.50 of the profile's 80.0 GB/s, "
            "the rate of the HRM's cpu term)") in text.splitlines()
    assert "CPU attention as it ran" not in format_report(_report(predicted=pred))
    assert "CPU attention as it ran" not in format_report(_report(stages=stages))
    assert "CPU attention as it ran" not in format_report(_report(predicted=pred, stages={**stages, "cpu_attention_compute": 0.0}))
    # a model whose FLOPs per KV byte bind (H5) below the bandwidth (gpt-oss: 64 query heads on 8 KV heads): that rate
    flop = format_report(_report(predicted=pred | {"cpu_attention_rate": 50e9}, stages=stages))
    assert ("  CPU attention as it ran: 4,000.0 GB of KV in 100.00 s, 40.0 GB/s (0.80 of 50.0 GB/s, the rate of the "
            "HRM's cpu term: the profile's CPU attention FLOP rate at this model's FLOPs per KV byte; its KV bandwidth "
            "80.0 GB/s)") in flop.splitlines()
    same = format_report(_report(predicted=pred | {"cpu_attention_rate": 80e9}, stages=stages))
    assert "(0.50 of the profile's 80.0 GB/s, the rate of the HRM's cpu term)" in same
    shared = format_report(_report(predicted=pred | {"cpu_attention_bandwidth_under_h2d": 48e9}, stages=stages))
    assert ("  CPU attention as it ran: 4,000.0 GB of KV in 100.00 s, 40.0 GB/s (0.50 of the profile's 80.0 GB/s, "
            "the rate of the HRM's cpu term; 48.0 GB/s beside pinned H2D copies, the HRM's sharing point)"
            ) in shared.splitlines()
