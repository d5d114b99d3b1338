"""``load_checkpoint(lazy_experts=True)``: the routed experts stay in the files until CGOPipe's page pool takes them,
one layer at a time, so reading a checkpoint never holds every expert on the host (the memory model's load phase:
the pool as filled + one layer as read)."""

import os
import shutil
import weakref

import pytest
import torch

from lightning_moe.model.quantize import quantize_checkpoint
from lightning_moe.model.quantized import QuantExperts
from lightning_moe.model.weights import CheckpointError, ExpertsOnDisk, load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.pipeline.weight_stream import packed_layout
from lightning_moe.policy.policy import Policy


def _prompts(n, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def test_lazy_experts_read_as_the_eager_ones(tiny_dir):
    eager, lazy = load_checkpoint(tiny_dir, torch.float32), load_checkpoint(tiny_dir, torch.float32, lazy_experts=True)
    assert len(lazy.experts) == len(eager.experts) == eager.spec.num_layers
    for l, (e, z) in enumerate(zip(eager.experts, lazy.experts)):
        assert isinstance(z, ExpertsOnDisk) and z.layer == l and z.layout is None
        got = z.read()
        assert all(torch.equal(getattr(got, w), getattr(e, w)) for w in ("w1", "w3", "w2"))
    assert torch.equal(lazy.embed, eager.embed) and torch.equal(lazy.layers[1].wq, eager.layers[1].wq)


def test_lazy_packed_experts_keep_their_layout(tiny_dir, tmp_path):
    q = quantize_checkpoint(tiny_dir, str(tmp_path / "int4"), experts="int4").dst
    eager, lazy = load_checkpoint(q, torch.float32), load_checkpoint(q, torch.float32, lazy_experts=True)
    for e, z in zip(eager.experts, lazy.experts):
        assert isinstance(e, QuantExperts) and z.layout == e.layout
        got = z.read()
        assert isinstance(got, QuantExperts) and torch.equal(got.pages, e.pages)
    assert packed_layout(lazy.experts) == eager.experts[0].layout
    with pytest.raises(ValueError, match="unpacked experts mixed in: True"):
        packed_layout([lazy.experts[0], load_checkpoint(tiny_dir, torch.float32).experts[1]])


def test_lazy_load_checks_every_expert_tensor_up_front(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    files = [f for f in os.listdir(bad) if f.endswith(".safetensors")]
    victim = None
    for f in files:
        sd = load_file(str(bad / f))
        names = [k for k in sd if ".experts.5.w2." in k and ".layers.2." in k]
        if names:
            victim = names[0]
            del sd[victim]
            save_file(sd, str(bad / f), metadata={"format": "pt"})
    assert victim is not None
    with pytest.raises(CheckpointError, match=f"tensor '{victim}' not found"):
        load_checkpoint(str(bad), torch.float32, lazy_experts=True)


def _counted(experts, log):
    """``experts`` (ExpertsOnDisk) wrapped so that every read is logged and the number of layers whose host copy
    is still alive is tracked (``log["live"]``, its maximum ``log["max_live"]``)."""
    def wrap(z):
        def read():
            ew = z.read()
            log["reads"].append(z.layer)
            log["live"] += 1
            log["max_live"] = max(log["max_live"], log["live"])
            weakref.finalize(ew.w1, lambda: log.__setitem__("live", log["live"] - 1))
            return ew
        return ExpertsOnDisk(z.layer, read, z.layout)
    return [wrap(z) for z in experts]


@pytest.mark.parametrize("resident", [0, 5])
def test_cgopipe_takes_lazy_experts_one_layer_at_a_time(tiny_dir, resident):
    """CGOPipe over lazy weights: every layer read once, never two layers' host copies at a time, and the same
    tokens as the serial executor over eager weights (ragged prompts, 4 micro-batches)."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu").generate(prompts, sp)
    w = load_checkpoint(tiny_dir, torch.float32, lazy_experts=True)
    log = {"reads": [], "live": 0, "max_live": 0}
    w.experts = _counted(w.experts, log)
    pol = Policy(mu=3, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(w, pol, "cpu")
    assert log["reads"] == list(range(w.spec.num_layers)) and log["max_live"] == 1 and log["live"] == 0
    assert w.experts == [None] * w.spec.num_layers  # the executor holds them now
    out = ex.generate(prompts, sp)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]


def test_expert_parallel_process_reads_lazy_experts_and_keeps_its_own(tiny_dir):
    """An expert-parallel process cuts each layer to its experts as it reads it: the same tensors as cutting eager
    weights."""
    from lightning_moe.pipeline.expert_parallel import _own_experts

    owned = [1, 4, 6]
    a = _own_experts(load_checkpoint(tiny_dir, torch.float32), owned)
    b = _own_experts(load_checkpoint(tiny_dir, torch.float32, lazy_experts=True), owned)
    for ea, eb in zip(a.experts, b.experts):
        assert all(torch.equal(getattr(ea, w), getattr(eb, w)) for w in ("w1", "w3", "w2")) and ea.w1.shape[0] == 3
