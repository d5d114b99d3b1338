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
