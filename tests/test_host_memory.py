"""The host side of the per-phase memory peaks (app/gpu.py PhasePeaks): each phase's peak resident set restarts
at the phase's start (Linux clear_refs), so a phase that allocates nothing does not inherit an earlier phase's
peak; the run's overall peak is the largest of them; the engine's report carries them."""

import json
import os

import pytest
import torch

from lightning_moe import cli
from lightning_moe.app.gpu import PhasePeaks, host_memory, reset_host_peak

MiB = 2**20
linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # fault every page in: resident, not just reserved
    return t


@linux
def test_host_memory_fields():
    m = host_memory()
    assert {"rss", "anon", "file", "peak_rss"} <= set(m)
    assert m["peak_rss"] >= m["rss"] > 0 and m["anon"] + m["file"] <= m["rss"] + m.get("shmem", 0) + MiB


@linux
def test_phase_peak_restarts_at_each_phase():
    if not reset_host_peak():
        pytest.skip("/proc/self/clear_refs is not writable here")
    peaks = PhasePeaks("cpu")
    peaks.enter("big")
    t = _touch(256 * MiB)
    big_now = host_memory()["rss"]
    del t  # returned to the OS (a large allocation is its own mapping)
    peaks.enter("small")
    _touch(4 * MiB)
    peaks.close()
    big, small = peaks.host["big"]["peak_rss"], peaks.host["small"]["peak_rss"]
    assert big >= big_now - 4 * MiB  # the kernel batches its rss counters: a few pages of slack
    assert small < big - 200 * MiB  # "small" does not carry "big"'s 256 MiB
    assert peaks.host_overall() == max(big, small, peaks._host_before)
    assert {"anon", "file"} <= set(peaks.host["small"])


@linux
def test_report_has_host_memory_by_phase(tmp_path, tiny_dir):
    import yaml

    from tests.support.prompt_files import jsonl_prompts

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": tiny_dir, "data": {"source": "jsonl", "path": jsonl_prompts(tmp_path / "in.jsonl")},
        "output": {"path": str(tmp_path / "out.jsonl")}, "device": "cpu", "dtype": "float32", "executor": "cgopipe",
        "policy": {"mu": 4, "n": 3}, "generation": {"max_new_tokens": 3, "stop_at_eos": False}}))
    assert cli.main(["run", str(job), "--no-progress"]) == 0
    rep = json.load(open(tmp_path / "out.report.json"))
    by_phase = rep["memory"]["measured_host_by_phase"]
    assert {"load", "prefill", "decode"} <= set(by_phase)
    assert all(h["peak_rss"] >= h["anon"] > 0 for h in by_phase.values())
    assert rep["peak_host_memory_bytes"] >= max(h["peak_rss"] for h in by_phase.values())


@linux
def test_lazy_expert_reads_do_not_keep_the_files_mapped(tmp_path):
    """ExpertsOnDisk.read() of every layer in turn: each layer's mapped file pages leave the resident set with the
    layer (the reader closes its files), so the host holds about one layer, not the checkpoint (a full-size job
    otherwise filled the host with 87 GiB of mapped checkpoint pages beside its page pool)."""
    import gc

    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_moe.model.weights import load_checkpoint

    cfg = MixtralConfig(vocab_size=128, hidden_size=256, intermediate_size=4096, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ck")
    layer = 8 * 3 * 256 * 4096 * 2  # one layer's experts, bytes (24 MiB)
    w = load_checkpoint(str(tmp_path / "ck"), torch.bfloat16, lazy_experts=True)
    gc.collect()
    file0 = host_memory()["file"]
    for e in w.experts:
        x = e.read()
        assert x.w1.shape == (8, 4096, 256) and float(x.w2.float().abs().sum()) > 0  # every page touched
        del x
    gc.collect()
    grown = host_memory()["file"] - file0
    assert grown < layer, f"mapped checkpoint pages still resident: {grown / MiB:.1f} MiB after 4 layers of " \
                          f"{layer / MiB:.0f} MiB"


def _read_layer_peak(w):
    """Layer 0's lazily read experts and the resident set's peak growth (bytes) while they were read."""
    import gc

    from lightning_moe.app.gpu import reset_host_peak

    gc.collect()
    base = host_memory()["rss"]
    if not reset_host_peak():
        pytest.skip("this kernel cannot reset the peak resident set")
    x = w.experts[0].read()
    return x, host_memory()["peak_rss"] - base


@linux
def test_a_lazy_layer_read_peaks_near_one_layer(tmp_path, monkeypatch):
    """ExpertsOnDisk.read() of one layer stored one tensor per expert (Mixtral's layout): the resident set peaks at
    about one layer of experts, what the memory model's load phase counts ("one layer's experts (host, as read)"),
    not ~2.3 layers (the layer's mapped file pages beside its copy, and each projection's per-expert tensors beside
    their stack). The reader closes its files every MAP_LIMIT bytes read; the stacks are filled in place."""

    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_moe.model import checkpoint_io
    from lightning_moe.model.weights import load_checkpoint

    cfg = MixtralConfig(vocab_size=128, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ck")
    layer = 8 * 3 * 1024 * 4096 * 2  # one layer's experts, bytes (192 MiB)
    monkeypatch.setattr(checkpoint_io, "MAP_LIMIT", 8 * MiB)
    w = load_checkpoint(str(tmp_path / "ck"), torch.bfloat16, lazy_experts=True)
    x, peak = _read_layer_peak(w)
    assert float(x.w2.float().abs().sum()) > 0
    assert peak < 1.2 * layer, f"a layer read peaked at {peak / MiB:.0f} MiB for a {layer / MiB:.0f} MiB layer"


@linux
def test_a_packed_mxfp4_layer_read_peaks_near_its_pages(tmp_path, monkeypatch):
    """gpt-oss's MXFP4 experts (one stacked tensor per part, kept packed): a lazy layer read packs a few experts at a
    time, so the read peaks near the layer's pages (it held the layer's mapped source beside its packed copy), and
    the pages equal those packed from the whole tensors at once."""

    from lightning_moe.kernels.mxfp4 import pack_mxfp4_pages
    from lightning_moe.model import checkpoint_io
    from lightning_moe.model.weights import load_checkpoint
    from tests.support.make_checkpoint import Dims, write_checkpoint

    d = Dims(family="gpt_oss", layers=1, hidden=1024, intermediate=1024, heads=8, kv_heads=2, experts=48, top_k=2,
             vocab=256, hd=64, sliding_window=8, mxfp4=True)
    write_checkpoint(str(tmp_path / "ck"), d)
    monkeypatch.setattr(checkpoint_io, "MAP_LIMIT", 3 * MiB)
    w = load_checkpoint(str(tmp_path / "ck"), torch.bfloat16, lazy_experts=True, packed_experts=True)
    x, peak = _read_layer_peak(w)
    pages = x.pages.numel()
    assert peak < 1.5 * pages, f"a layer read peaked at {peak / MiB:.0f} MiB for {pages / MiB:.0f} MiB of pages"
    ex = "model.layers.0.mlp.experts."
    r = checkpoint_io._Reader(str(tmp_path / "ck"), torch.bfloat16)
    whole = [r.get(ex + n) for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                     "down_proj_blocks", "down_proj_scales", "down_proj_bias")]
    assert torch.equal(x.pages, pack_mxfp4_pages(*whole, layout=x.layout)[0])
