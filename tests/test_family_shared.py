"""The families' shared parts (families/base.py, model/layers.py): the GQA attention set-up, ``.to`` of every
family's layer weights, and the one seam ``module_fields`` through which a module's functions become its Family's."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.model import layers as L
from lightning_moe.model.families import families, read_spec

GQA = {"vocab_size": 32, "hidden_size": 60, "num_hidden_layers": 2, "num_attention_heads": 6,
       "num_key_value_heads": 2, "num_experts_per_tok": 2, "rope_theta": 1000.0}
CONFIGS = {  # tiny configs with awkward sizes: hd 10, 6 query heads over 2 KV heads, 5 experts
    "mixtral": {**GQA, "model_type": "mixtral", "intermediate_size": 14, "num_local_experts": 5},
    "olmoe": {**GQA, "model_type": "olmoe", "intermediate_size": 14, "num_experts": 5},
    "qwen2_moe": {**GQA, "model_type": "qwen2_moe", "intermediate_size": 22, "moe_intermediate_size": 14,
                  "shared_expert_intermediate_size": 18, "num_experts": 5, "mlp_only_layers": [0]},
    "qwen3_moe": {**GQA, "model_type": "qwen3_moe", "head_dim": 8, "intermediate_size": 22,
                  "moe_intermediate_size": 14, "num_experts": 5, "mlp_only_layers": [1]},
    "gpt_oss": {**GQA, "model_type": "gpt_oss", "intermediate_size": 14, "num_local_experts": 5, "head_dim": 10,
                "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v2": {**GQA, "model_type": "deepseek_v2", "num_key_value_heads": 6, "intermediate_size": 22,
                    "moe_intermediate_size": 14, "n_routed_experts": 6, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 12, "q_lora_rank": None, "qk_nope_head_dim": 6,
                    "qk_rope_head_dim": 4, "v_head_dim": 6, "topk_method": "greedy", "norm_topk_prob": False},
    "deepseek_v3": {**GQA, "model_type": "deepseek_v3", "num_key_value_heads": 6, "intermediate_size": 22,
                    "moe_intermediate_size": 14, "n_routed_experts": 6, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 12, "q_lora_rank": 10, "qk_nope_head_dim": 6,
                    "qk_rope_head_dim": 4, "v_head_dim": 6, "n_group": 2, "topk_group": 1},
}
FP32_KEPT = {"gpt_oss": {"attn_norm", "ffn_norm"}, "deepseek_v2": {"router", "e_bias"},
             "deepseek_v3": {"router", "e_bias"}}


def test_every_family_has_a_config_here():
    assert {f.name for f in families()} == set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_weights_to(name):
    """``.to(device, dtype)`` of every layer kind of every family: each tensor cast exactly as ``t.to(dtype)`` (the
    fp32-kept fields to fp32), fields and their order kept, None fields None."""
    spec = read_spec(CONFIGS[name])
    fam = [f for f in families() if f.name == name][0]
    g = torch.Generator().manual_seed(7)
    for layer in range(spec.num_layers):
        lw = fam.dummy_layer(spec, lambda *s: torch.randn(*s, generator=g), torch.float32, layer)
        out = lw.to("cpu", torch.bfloat16)
        assert type(out) is type(lw)
        assert [f.name for f in dataclasses.fields(out)] == [f.name for f in dataclasses.fields(lw)]
        for f in dataclasses.fields(lw):
            a, b = getattr(lw, f.name), getattr(out, f.name)
            if a is None:
                assert b is None
                continue
            want = torch.float32 if f.name in FP32_KEPT.get(name, ()) else torch.bfloat16
            assert b.dtype == want, (name, layer, f.name)
            torch.testing.assert_close(b, a.to(want), rtol=0, atol=0)
        kept = lw.to("cpu")  # no dtype: each tensor keeps its own
        assert all(getattr(kept, f.name) is None or getattr(kept, f.name).dtype == getattr(lw, f.name).dtype
                   for f in dataclasses.fields(lw))


def _rotate_half_reference(x, positions, inv_freq):
    """RoPE written out: x [T, H, hd]; pair (i, i + hd/2) rotated by angle pos * inv_freq[i]."""
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, hd/2]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_tables", [False, True])
def test_qkv_heads_and_rope_qk(bias, with_tables):
    """qkv_heads + rope_qk against the projections and the rotation written out, fp32 1e-4, on fresh random inputs
    (T 7, 6 query heads over 2 KV heads of 10 dims), with the caller's tables or tables made inside."""
    spec = read_spec(CONFIGS["mixtral"])
    T, D, hd = 7, spec.hidden_size, spec.head_dim
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    h = torch.randn(T, D, generator=g)
    w = [torch.randn(n * hd, D, generator=g) / D ** 0.5 for n in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)]
    b = [torch.randn(t.shape[0], generator=g) if bias else None for t in w]
    q, k, v = L.qkv_heads(h, spec, *w, *b)
    ref = [F.linear(h, wi, bi).reshape(T, -1, hd) for wi, bi in zip(w, b)]
    assert q.shape == (T, 6, hd) and k.shape == v.shape == (T, 2, hd)
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    positions = torch.tensor([0, 1, 2, 0, 5, 9, 3])
    inv_freq = L.rope_inv_freq(spec)
    rope = L.rope_cos_sin(spec, positions, inv_freq, q.dtype) if with_tables else None
    qr, kr = L.rope_qk(q, k, positions, spec, inv_freq, rope)
    torch.testing.assert_close(qr.double(), _rotate_half_reference(ref[0], positions, inv_freq), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kr.double(), _rotate_half_reference(ref[1], positions, inv_freq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_module_fields_take_the_modules_functions(name):
    """Every function field of a family is the module's own function of that name when the module defines one,
    else Family's default from model/layers.py; NAME, KEYS and the key sets are the module's."""
    mod = importlib.import_module(f"lightning_moe.model.families.{name}")
    fam = mod.FAMILY
    defaults = {f.name: f.default for f in dataclasses.fields(type(fam)) if f.default is not dataclasses.MISSING}
    assert fam.name == mod.NAME == name and fam.keys is mod.KEYS
    assert fam.implemented_keys is mod.IMPLEMENTED_KEYS and fam.harmless_keys is mod.HARMLESS_KEYS
    assert fam.layer_weights is getattr(mod, "LayerWeights", fam.layer_weights)  # V3 holds none of its own
    assert fam.dense_layer_weights is getattr(mod, "DenseLayerWeights", fam.dense_layer_weights)
    for f in dataclasses.fields(type(fam)):
        own = vars(mod).get(f.name)
        if callable(own) and not isinstance(own, type):
            assert getattr(fam, f.name) is own, (name, f.name)
        elif callable(defaults.get(f.name)) and name != "deepseek_v3":  # V3 is V2's FAMILY replaced
            assert getattr(fam, f.name) == defaults[f.name], (name, f.name)
