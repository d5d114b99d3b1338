"""Every family reads transformers-5's fused expert layout as it reads the per-expert one.

transformers 5 holds a layer's experts fused in memory (``mlp.experts.gate_up_proj [E, 2F, D]``, gate rows first, and
``mlp.experts.down_proj [E, D, F]``) while ``save_pretrained`` writes one tensor per expert and projection; a
checkpoint written from the state dict (other tools do) has the fused names. Per family, a tiny random model of
transformers' own class (fp32, 8 experts, a dense layer where the family has them) saved both ways loads to the same
weights, bit for bit.
"""

import os

import pytest
import torch

from lightning_moe.model.weights import load_checkpoint

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _model(family: str):
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=8, **COMMON)
        return transformers.MixtralForCausalLM(cfg)
    if family == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(intermediate_size=24, num_experts=8, **COMMON))
    if family == "qwen3_moe":  # layer 1 dense
        cfg = transformers.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=8, head_dim=16,
                                          mlp_only_layers=[1], **COMMON)
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=8,
                                      shared_expert_intermediate_size=20, mlp_only_layers=[1], **COMMON)
    return transformers.Qwen2MoeForCausalLM(cfg)


@pytest.mark.parametrize("map_limit", [None, 1])
@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe", "qwen2_moe"])
def test_fused_and_per_expert_layouts_read_alike(family, map_limit, tmp_path, monkeypatch):
    """``map_limit`` 1: the reader closes its files after every tensor and reads fused experts one at a time."""
    from safetensors.torch import save_file

    from lightning_moe.model import checkpoint_io

    if map_limit is not None:
        monkeypatch.setattr(checkpoint_io, "MAP_LIMIT", map_limit)

    torch.manual_seed(0)
    model = _model(family).eval()
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    model.save_pretrained(str(per_expert), max_shard_size="20KB")
    sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # the fused in-memory names
    fused.mkdir()
    model.config.save_pretrained(str(fused))
    save_file(sd, str(fused / "model.safetensors"))
    with open(os.path.join(per_expert, "model.safetensors.index.json")) as f:
        assert "gate_up_proj" not in f.read()  # save_pretrained wrote one tensor per expert
    a, b = load_checkpoint(str(fused), torch.float32), load_checkpoint(str(per_expert), torch.float32)
    assert len(a.experts) == len(b.experts) == 3
    for ea, eb in zip(a.experts, b.experts):
        assert (ea is None) == (eb is None)  # a dense layer has no experts
        if ea is not None:
            assert all(torch.equal(getattr(ea, w), getattr(eb, w)) for w in ("w1", "w3", "w2"))
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb) and all(torch.equal(getattr(la, k), getattr(lb, k)) for k in la.__dict__)
    assert torch.equal(a.lm_head, b.lm_head) and torch.equal(a.embed, b.embed)
