"""benchmarks/make_checkpoint.py: the checkpoints the GPU runs read, for every family it writes.

Each tiny checkpoint (2 layers, 8 experts, random bf16) must load in transformers' own class with no missing and
no unexpected key and hold the same tensors our loader reads; ``--zero-experts`` leaves the routed experts as holes
of a sparse file that read as zeros; ``--preset`` takes a registry model's numbers.
"""

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import make_checkpoint as mk  # noqa: E402

from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402

TINY = dict(layers=2, hidden=64, intermediate=48, heads=4, kv_heads=2, experts=8, top_k=2, vocab=32000, max_pos=256)
FAMILIES = {
    "mixtral": mk.Dims(**TINY),
    "qwen3_moe": mk.Dims(family="qwen3_moe", hd=32, **TINY),
    "olmoe": mk.Dims(family="olmoe", norm_topk_prob=False, **TINY),
    "qwen2_moe": mk.Dims(family="qwen2_moe", shared=40, norm_topk_prob=False, **TINY),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def written(request, tmp_path_factory):
    """(family, checkpoint dir) written with a shard size that splits it into several files."""
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    mk.write_checkpoint(out, FAMILIES[request.param], shard_gib=1.5 / 1024, log=open(os.devnull, "w"))
    return request.param, out


def test_transformers_loads_every_key_and_our_loader_reads_the_same(written):
    import transformers

    family, path = written
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    spec = MoESpec.from_pretrained_dir(path)
    assert spec.model_type == family and spec.num_experts == 8 and spec.num_layers == 2
    w = load_checkpoint(path, torch.bfloat16)
    sd = model.state_dict()
    assert torch.equal(w.embed, sd["model.embed_tokens.weight"])
    assert torch.equal(w.lm_head, sd["lm_head.weight"])
    e = w.experts[1]
    hf = model.model.layers[1].mlp.experts
    # transformers 5 holds the experts fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
    F = spec.intermediate_size
    assert torch.equal(e.w1[3], hf.gate_up_proj[3, :F]) and torch.equal(e.w3[3], hf.gate_up_proj[3, F:])
    assert torch.equal(e.w2[3], hf.down_proj[3])
    assert int(torch.count_nonzero(e.w1)) > 0


def test_zero_experts_are_holes_that_read_as_zeros(tmp_path):
    dims = dataclasses.replace(FAMILIES["mixtral"], vocab=512, intermediate=256)  # experts: most of the bytes
    dense = mk.write_checkpoint(str(tmp_path / "dense"), dims, log=open(os.devnull, "w"))
    sparse = mk.write_checkpoint(str(tmp_path / "sparse"), dims, log=open(os.devnull, "w"), zero_experts=True)
    assert sparse["bytes"] == dense["bytes"] and sparse["zero_bytes"] > 0.8 * sparse["bytes"]

    def blocks(d):
        return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d) if n.endswith(".safetensors"))

    assert blocks(sparse["path"]) < dense["bytes"] - sparse["zero_bytes"] + 2**20  # the holes take no disk
    a, b = load_checkpoint(sparse["path"], torch.bfloat16), load_checkpoint(dense["path"], torch.bfloat16)
    assert all(int(torch.count_nonzero(getattr(a.experts[i], f))) == 0 for i in range(2) for f in ("w1", "w2", "w3"))
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[1].wq, b.layers[1].wq)
    assert torch.equal(a.layers[0].router, b.layers[0].router)


def test_preset_takes_the_registry_numbers():
    d = mk.Dims.from_registry("qwen3-30b-a3b", layers=3)
    assert (d.family, d.layers, d.hidden, d.intermediate, d.experts, d.top_k, d.head_dim, d.kv_heads) == (
        "qwen3_moe", 3, 2048, 768, 128, 8, 128, 4)
    spec = mk.tensor_shapes(d)
    assert ("model.layers.2.mlp.experts.127.down_proj.weight", (2048, 768)) in spec
    q = mk.Dims.from_registry("qwen1.5-moe-a2.7b", layers=2)
    assert (q.family, q.shared, q.experts, q.norm_topk_prob) == ("qwen2_moe", 5632, 60, False)
    with pytest.raises(ValueError, match="deepseek_v2"):
        mk.Dims.from_registry("deepseek-v2-lite", layers=2)
