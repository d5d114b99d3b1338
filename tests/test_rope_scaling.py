"""RoPE scaling (linear, yarn) in every family against transformers' own models, through both executors.

Tiny random checkpoints saved by transformers' ``save_pretrained`` (MixtralForCausalLM, Qwen3MoeForCausalLM,
OlmoeForCausalLM and Qwen2MoeForCausalLM, fp32, 2 layers, 8 experts (Qwen2-MoE: plus its shared expert), top-2, GQA
4 query heads over 2 KV heads) with ``rope_parameters`` linear (factor 4) and yarn (factor 4 over an original
context of 32 tokens: transformers' defaults, and non-default beta_fast / beta_slow / mscale / mscale_all_dim /
truncate). Prompts run past the original context: logits equal transformers' (max abs < 1e-4) on a ragged batch,
greedy tokens equal transformers' ``generate`` for 20 steps in the serial executor and in CGOPipe on the CPU
(experts paged; CPU-KV and device-KV micro-batches). The legacy ``rope_scaling`` form of config.json reads to the
same spec; every other rope type and ``partial_rotary_factor`` != 1 are refused by name.
"""

import dataclasses
import json
import os

import pytest
import torch
from tests.support.hf_checkpoints import hf_greedy as _hf_greedy, write_config as _write_config  # noqa: E402

from lightning_moe.model import layers as L
from lightning_moe.model.families import read_spec
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy

VOCAB = 128
ORIG = 32  # the checkpoints' original (pretraining) context for yarn
MAX_POS = 4 * ORIG  # factor 4
_g = torch.Generator().manual_seed(5)
# ragged prompts, three of them longer than the original context
PROMPTS = [[1] + torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (44, 37, 6, 33)]

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "rope_theta": 10000.0},
    "yarn-params": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "rope_theta": 500.0,
                    "beta_fast": 2.0, "beta_slow": 0.1, "mscale": 2.0, "mscale_all_dim": 1.0, "truncate": False},
}


def make_hf(path, family: str, rope: dict, seed: int = 0):
    """Save a random MixtralForCausalLM / Qwen3MoeForCausalLM with ``rope_parameters=rope``; return (path, model)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts_per_tok=2, max_position_embeddings=MAX_POS, rope_parameters=dict(rope),
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen2_moe":  # one shared expert, q/k/v biases, every layer MoE
        cfg = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=24, shared_expert_intermediate_size=20,
                                          num_experts=8, norm_topk_prob=False, **common)
        model_cls = transformers.Qwen2MoeForCausalLM
    elif family == "olmoe":  # head_dim is hidden / heads in OLMoE (q_norm is sized by hidden_size)
        common.update(hidden_size=64)
        del common["head_dim"]
        cfg = transformers.OlmoeConfig(intermediate_size=24, num_experts=8, **common)
        model_cls = transformers.OlmoeForCausalLM
    elif family == "mixtral":  # head_dim given: transformers' yarn reads config.head_dim (MixtralConfig's is None)
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=8, **common)
        model_cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=8,
                                          norm_topk_prob=True, **common)
        model_cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger-than-default init so routing and tokens are not degenerate; norms not all ones
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "gate" in n and "experts" not in n else p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(str(path), max_shard_size="20KB")
    return str(path), model


@pytest.fixture(scope="module", params=[(f, r) for f in FAMILIES for r in ROPES],
                ids=[f"{f}-{r}" for f in FAMILIES for r in ROPES])
def hf_rope(request, tmp_path_factory):
    """(checkpoint dir, transformers model, rope case name) per family and rope scaling."""
    family, rope = request.param
    path, model = make_hf(tmp_path_factory.mktemp(f"hf_{family}_{rope}") / "ckpt", family, ROPES[rope],
                          seed=3 + len(rope))
    return path, model, rope


def test_spec_carries_the_rope_and_transformers_frequencies(hf_rope):
    """The spec holds the rope type and its resolved parameters; its inverse frequencies and attention factor are
    transformers' own (the rotary embedding module of the model)."""
    path, model, rope = hf_rope
    spec = MoESpec.from_pretrained_dir(path)
    want = ROPES[rope]
    assert (spec.rope_type, spec.rope_factor, spec.rope_theta) == (want["rope_type"], 4.0, want["rope_theta"])
    rot = model.model.rotary_emb
    assert torch.equal(L.rope_inv_freq(spec), rot.inv_freq)  # bit for bit
    assert spec.rope_attention_factor == rot.attention_scaling
    if rope == "linear":
        assert spec.rope_attention_factor == 1.0
    else:
        assert spec.rope_original_max_position_embeddings == ORIG and spec.rope_attention_factor > 1.0
    if rope == "yarn-params":
        assert (spec.rope_beta_fast, spec.rope_beta_slow, spec.rope_truncate) == (2.0, 0.1, False)
        lo, hi = L.yarn_correction_range(spec)
        assert 0 < lo < hi < spec.head_dim // 2 and lo != int(lo)  # a real ramp, not truncated
    with open(os.path.join(path, "config.json")) as f:
        assert read_spec(json.load(f), spec.name) == spec  # the raw dict and transformers' AutoConfig read alike


def test_logits_equal_transformers_past_the_original_context(hf_rope):
    """Ragged batch, prompts longer than the original context: each row within 1e-4 of transformers' logits; the same
    weights with default RoPE are far off (the scaling is what is computed)."""
    path, model, _ = hf_rope
    w = load_checkpoint(path, torch.float32)
    ours = SerialExecutor(w, "cpu").logits(PROMPTS)
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert worst < 1e-4, worst
    assert max(r.abs().max().item() for r in ref) > 1.0  # not a degenerate model
    default = dataclasses.replace(w.spec, rope_type="default", rope_attention_factor=1.0)
    plain = SerialExecutor(load_checkpoint(path, torch.float32, default), "cpu")
    assert max((a - b).abs().max().item() for a, b in zip(plain.logits(PROMPTS), ref)) > 1e-2


def test_greedy_20_steps_equal_transformers_both_executors(hf_rope):
    """20 greedy tokens per prompt equal transformers' generate, in the serial executor and in CGOPipe on the CPU
    (experts paged; all micro-batches with CPU KV, and one with device KV)."""
    path, model, _ = hf_rope
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(t) for t in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    serial = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").generate(PROMPTS, sp)
    assert [o for o, _ in serial] == want
    for n_gpu_attn in (0, 1):
        pol = Policy(mu=2, n=2, prefill_mu=2, n_gpu_attn=n_gpu_attn, dtype="fp32", weight_quant="fp32")
        pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")
        try:
            assert [o for o, _ in pipe.generate(PROMPTS, sp)] == want, n_gpu_attn
        finally:
            pipe.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", list(ROPES))
def test_legacy_rope_scaling_reads_to_the_same_spec(family, rope, tmp_path):
    """A Hub-style config.json (``rope_scaling`` with ``type``, top-level ``rope_theta``, no ``rope_parameters``)
    reads, through AutoConfig and as a raw dict, to the spec of its ``rope_parameters`` form."""
    path, _ = make_hf(tmp_path / "ckpt", family, ROPES[rope])
    spec = MoESpec.from_pretrained_dir(path)
    legacy = {k: v for k, v in ROPES[rope].items() if k not in ("rope_type", "rope_theta")}
    for scaling in ({"type": ROPES[rope]["rope_type"], **legacy}, {"rope_type": ROPES[rope]["rope_type"], **legacy}):
        d = _write_config(path, tmp_path / f"legacy-{len(scaling)}-{'type' in scaling}", rope_parameters=None,
                          rope_scaling=scaling, rope_theta=ROPES[rope]["rope_theta"])
        assert dataclasses.replace(MoESpec.from_pretrained_dir(d), name=spec.name) == spec
        with open(os.path.join(d, "config.json")) as f:
            assert read_spec(json.load(f), spec.name) == spec


def test_yarn_defaults_and_attention_factor_forms():
    """What transformers fills in: original_max_position_embeddings from max_position_embeddings (or a top-level
    one), a null factor from their ratio, beta 32 / 1, truncation; attention_factor given, from mscale /
    mscale_all_dim, or 0.1 ln(factor) + 1."""
    import math

    base = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                max_position_embeddings=MAX_POS, rope_theta=10000.0)
    s = read_spec({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert (s.rope_original_max_position_embeddings, s.rope_beta_fast, s.rope_beta_slow, s.rope_truncate) == (
        MAX_POS, 32.0, 1.0, True)
    assert s.rope_attention_factor == 0.1 * math.log(2.0) + 1.0
    s = read_spec({**base, "original_max_position_embeddings": 16,
                   "rope_scaling": {"type": "yarn", "factor": None, "original_max_position_embeddings": 64}})
    assert (s.rope_original_max_position_embeddings, s.rope_factor) == (16, MAX_POS / 16)  # the top level wins
    s = read_spec({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 0.7, "mscale": 2.0,
                                            "mscale_all_dim": 1.0}})
    assert s.rope_attention_factor == 0.7
    s = read_spec({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}})
    assert s.rope_attention_factor == (0.2 * math.log(4.0) + 1.0) / (0.1 * math.log(4.0) + 1.0)
    s = read_spec({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 2.0}})  # both needed
    assert s.rope_attention_factor == 0.1 * math.log(4.0) + 1.0
    # rope_theta: the mapping's, else the top level, else the family's default (transformers' default_theta)
    assert read_spec({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7.0
    no_theta = {k: v for k, v in base.items() if k != "rope_theta"}
    assert read_spec(no_theta).rope_theta == 10000.0
    mixtral = {**no_theta, "model_type": "mixtral", "num_local_experts": 8, "intermediate_size": 24}
    assert read_spec(mixtral).rope_theta == 1e6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     r"config field 'rope_parameters': rope_type 'dynamic' is not implemented by the {family} family "
     r"\(implemented: 'default', 'linear', 'yarn'\)"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 4.0}),
     r"config field 'rope_scaling': rope_type 'dynamic' is not implemented by the {family} family"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
     r"config field 'rope_parameters': rope_type 'llama3' is not implemented by the {family} family"),
    (dict(rope_parameters=None, rope_theta=10000.0,
          rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
     r"config field 'rope_scaling': rope_type 'longrope' is not implemented by the {family} family"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0, "rope_theta": 10000.0}),
     r"config field 'rope_parameters': rope_type 'yarn' key 'low_freq_factor' is not implemented by the {family}"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.5, "rope_theta": 1e4}),
     r"config field 'rope_parameters': partial_rotary_factor 0.5 is not implemented by the {family} family"),
    (dict(partial_rotary_factor=0.5),
     (r"config field 'rope_parameters': partial_rotary_factor 0.5 is not implemented by the {family} family",
      r"config field 'partial_rotary_factor': 0.5 is not implemented by the {family} family")),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
     r"config field 'rope_parameters': rope_type 'linear' needs its 'factor'"),
])
def test_other_rope_types_and_partial_rotary_are_refused_by_name(family, changes, message, tmp_path_factory):
    """Through AutoConfig (which moves a legacy rope_scaling and a top-level partial_rotary_factor into
    rope_parameters: the message names rope_scaling as the file does, and rope_parameters for a moved
    partial_rotary_factor) and as the raw config.json dict (the field it holds)."""
    via_autoconfig, raw_dict = message if isinstance(message, tuple) else (message, message)
    base = tmp_path_factory.getbasetemp() / f"refuse-{family}"
    if not base.exists():
        make_hf(base, family, {"rope_type": "default", "rope_theta": 10000.0})
    d = _write_config(str(base), tmp_path_factory.mktemp("m") / "m", **changes)
    with pytest.raises(ValueError, match=r"m/config\.json: " + via_autoconfig.format(family=family)):
        MoESpec.from_pretrained_dir(d)
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ValueError, match=raw_dict.format(family=family)):
        read_spec(raw)


def test_hub_configs_read_with_and_without_yarn():
    """mistralai/Mixtral-8x7B-v0.1's config.json (top-level rope_theta, no rope mapping) reads as the planner's registry
    spec, raw and through MixtralConfig; Qwen3-30B-A3B with the yarn ``rope_scaling`` its model card gives reads the
    registry spec plus yarn, alike as a raw dict and through Qwen3MoeConfig."""
    import math

    from transformers import MixtralConfig, Qwen3MoeConfig

    from lightning_moe.policy.registry import resolve_spec

    mixtral = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
               "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
               "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
               "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
               "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
               "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
    reg = resolve_spec("mixtral-8x7b")
    assert read_spec(mixtral, reg.name) == reg
    kw = {k: v for k, v in mixtral.items() if k not in ("architectures", "model_type")}
    assert read_spec(MixtralConfig(**kw), reg.name) == reg

    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
            "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 131072, "max_window_layers": 48,
            "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
            "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
    reg = dataclasses.replace(resolve_spec("qwen3-30b-a3b"), max_position_embeddings=131072)
    want = dataclasses.replace(reg, rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=32768,
                               rope_attention_factor=0.1 * math.log(4.0) + 1.0)
    assert read_spec(qwen, reg.name) == want
    kw = {k: v for k, v in qwen.items() if k not in ("architectures", "model_type")}
    assert read_spec(Qwen3MoeConfig(**kw), reg.name) == want
