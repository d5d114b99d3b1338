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
    with pytest.raises(ValueError, match="glm4_moe"):
        mk.Dims.from_registry("glm-4.5-air", layers=2)


# DeepSeek-V2 / V3 (MLA) and gpt-oss: the tiny width of each registry preset (Dims.tiny: the same kinds of choice:
# q_lora_rank null (V2-Lite) or set (V3), shared experts, a dense first layer, grouped routing (V3), yarn;
# gpt-oss's sliding / full layers, biases, sinks, the fused interleaved experts), 2 layers, 8 experts
NEW_PRESETS = ("deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b")
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module", params=NEW_PRESETS[:3])
def written_new(request, tmp_path_factory):
    """(preset, dims, checkpoint dir) at the preset's tiny width, weights std 0.125 (not degenerate), sharded."""
    dims = mk.Dims.from_registry(request.param, layers=4).tiny()
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    mk.write_checkpoint(out, dims, shard_gib=0.5 / 1024, std=0.125, log=open(os.devnull, "w"))
    return request.param, dims, out


def test_new_families_load_in_transformers_and_give_our_serial_logits(written_new):
    """transformers loads every key (no missing, no unexpected), holds the tensors our loader reads, and its fp32
    logits equal the serial executor's (max abs < 1e-4): the written layout is the real one."""
    import transformers

    from lightning_moe.pipeline.serial import SamplingParams, SerialExecutor

    name, dims, path = written_new
    kw = {"attn_implementation": "eager"} if dims.family == "gpt_oss" else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    spec = MoESpec.from_pretrained_dir(path)
    assert spec.model_type == dims.family and spec.num_layers == 2 and spec.num_experts == 8
    w = load_checkpoint(path, torch.float32)
    moe = 1  # layer 0 is dense for DeepSeek
    hf = model.model.layers[moe].mlp.experts
    e, F = w.experts[moe], spec.intermediate_size
    if dims.family == "gpt_oss":  # [E, D, 2F], gate = columns 0::2
        assert torch.equal(e.w1, hf.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(e.w3, hf.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(e.w2, hf.down_proj.transpose(1, 2)) and torch.equal(e.b2, hf.down_proj_bias)
        assert spec.full_attention_layers == (1,) and spec.sliding_window == 4 and spec.attention_sinks
    else:  # transformers 5 holds them fused: gate_up_proj [E, 2F, D], gate rows first
        assert torch.equal(e.w1[3], hf.gate_up_proj[3, :F]) and torch.equal(e.w3[3], hf.gate_up_proj[3, F:])
        assert torch.equal(e.w2[3], hf.down_proj[3])
        assert spec.dense_layers == (0,) and spec.kv_lora_rank == 32 and spec.q_lora_rank == (24 if name == "deepseek-v3" else 0)
    ex = SerialExecutor(w, "cpu")
    ours = ex.logits(PROMPTS)
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = model(torch.tensor([p])).logits[0].float()
            worst = max(worst, (ours[i] - ref).abs().max().item())
    assert worst < 1e-4, worst
    assert max(o.abs().max().item() for o in ours) > 0.5  # not a degenerate model
    out = ex.generate(PROMPTS, SamplingParams(max_new_tokens=3, stop_at_eos=False))
    assert [len(ids) for ids, _ in out] == [3, 3, 3]
    print(name, "max abs logit diff", worst)


def test_new_presets_read_as_the_registry_specs():
    """config.json of each registry preset (4 layers) reads as the registry's spec with those layers: every
    MLA / gpt-oss number the family reads (DeepSeek-V3's MTP layer is not written: never run)."""
    import dataclasses as dc

    from lightning_moe.model.families import read_spec
    from lightning_moe.policy.registry import resolve_spec

    for name in NEW_PRESETS:
        d = mk.Dims.from_registry(name, layers=4)
        got, want = read_spec(mk.config_dict(d), name), resolve_spec(name)
        want = dc.replace(want, num_layers=4, num_mtp_layers=0, dense_layers=tuple(i for i in want.dense_layers if i < 3),
                          full_attention_layers=tuple(i for i in want.full_attention_layers if i < 4),
                          bos_token_id=1, eos_token_id=2)
        diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dc.fields(want)
                if getattr(got, f.name) != getattr(want, f.name) and f.name not in ("vocab_size",)}
        assert not diff, (name, diff)


def test_new_presets_zero_experts_and_shapes(tmp_path):
    """--zero-experts: gpt-oss's fused experts and DeepSeek's per-expert tensors are holes that read as zeros."""
    for name in ("deepseek-v2-lite", "gpt-oss-20b"):
        dims = mk.Dims.from_registry(name, layers=4).tiny()
        res = mk.write_checkpoint(str(tmp_path / name), dims, log=open(os.devnull, "w"), zero_experts=True)
        assert res["zero_bytes"] > 0
        w = load_checkpoint(res["path"], torch.bfloat16)
        assert int(torch.count_nonzero(w.experts[1].w1)) == 0 and int(torch.count_nonzero(w.embed)) > 0
    shapes = dict(mk.tensor_shapes(mk.Dims.from_registry("gpt-oss-120b", layers=2)))
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (128, 2880, 2880)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    v2 = dict(mk.tensor_shapes(mk.Dims.from_registry("deepseek-v2-lite", layers=2)))
    assert v2["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048) and "model.layers.1.self_attn.q_a_proj.weight" not in v2
    assert v2["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert v2["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (2816, 2048)
    v3 = dict(mk.tensor_shapes(mk.Dims.from_registry("deepseek-v3", layers=4)))
    assert v3["model.layers.3.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert v3["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
