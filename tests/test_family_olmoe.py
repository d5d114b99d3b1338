"""The olmoe family against transformers' own OlmoeForCausalLM (the oracle), through both executors.

Tiny random checkpoints saved by transformers' ``save_pretrained`` (fp32, sharded): 2 layers, 8 experts, top-3, GQA
4 query heads over 2 KV heads, random q/k norm weights (one norm over the whole q / k projection); ``norm_topk_prob``
true and false, ``clip_qkv`` set (small enough to clamp many q, k and v values) and null, and one with tied
embeddings. Logits equal transformers' on a ragged batch (max abs < 1e-4), greedy tokens equal transformers'
``generate`` for 20 steps in the serial executor and in CGOPipe (CPU, experts paged), loglikelihood scores equal
transformers' log-softmax, the fused expert layout reads alike, every OlmoeConfig field is implemented, refused or
harmless, each refused value's error names its field, and ``quantize`` runs through the family's key map.
"""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from tests.support.hf_checkpoints import assert_scores_match, hf_greedy as _hf_greedy, write_config as _write_config  # noqa: E402

from lightning_moe.model.families import family_for, family_of, read_spec
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.scoring import score_batch
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy

VOCAB = 128
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]
CLIP = 0.7  # |q|, |k| after their norms are ~1 and |v| ~1 here: a clip that clamps a good share of each


def make_hf_olmoe(path, *, norm_topk_prob, clip_qkv, tie=False, layers=2, experts=8, top_k=3, hidden=32, heads=4,
                  kv_heads=2, ffn=24, vocab=VOCAB, seed=0, shard="20KB"):
    """Save a random OlmoeForCausalLM with save_pretrained (sharded safetensors); return (path, model)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts=experts,
                      num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, clip_qkv=clip_qkv,
                      tie_word_embeddings=tie, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default init so routing and tokens are not degenerate; norms not all ones
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "gate" in n and "experts" not in n else p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(str(path), max_shard_size=shard)
    return str(path), model


@pytest.fixture(scope="module", params=[(True, CLIP, False), (False, None, False), (False, CLIP, True)],
                ids=["norm_topk-clip", "no_norm_topk-no_clip", "no_norm_topk-clip-tied"])
def hf_olmoe(request, tmp_path_factory):
    """(checkpoint dir, transformers model) per (norm_topk_prob, clip_qkv, tie_word_embeddings)."""
    norm, clip, tie = request.param
    return make_hf_olmoe(tmp_path_factory.mktemp("hf_olmoe") / "ckpt", norm_topk_prob=norm, clip_qkv=clip, tie=tie,
                         seed=21 + 2 * norm + tie)


def _hf_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in prompts]


def test_spec_and_registry(hf_olmoe):
    path, model = hf_olmoe
    spec = MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    assert fam.name == "olmoe" and family_for({"architectures": ["OlmoeForCausalLM"]}) is fam
    c = model.config
    assert (spec.model_type, spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.num_experts, spec.top_k, spec.rope_theta, spec.rms_norm_eps,
            spec.sliding_window, spec.norm_topk_prob, spec.clip_qkv, spec.tie_word_embeddings) == (
        "olmoe", 32, 24, 2, 4, 2, 8, 8, 3, 10000.0, 1e-5, None, c.norm_topk_prob, c.clip_qkv, c.tie_word_embeddings)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert read_spec(raw, spec.name) == spec  # the raw dict and transformers' AutoConfig read alike
    # a Hub-style config.json (transformers 4 names: top-level rope_theta, rope_scaling null) reads the same
    hub = {k: v for k, v in raw.items() if k != "rope_parameters"}
    hub.update(rope_theta=10000.0, rope_scaling=None, torch_dtype="float32")
    assert read_spec(hub, spec.name) == spec


def test_logits_equal_transformers_fp32_ragged_batch(hf_olmoe):
    """One ragged batch through our prefill: each row's logits within 1e-4 (max abs) of transformers', run alone and
    run as a right-padded batch with an attention mask; with clip_qkv set, the clip changes transformers' logits."""
    path, model = hf_olmoe
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    ours = ex.logits(PROMPTS)
    S = max(map(len, PROMPTS))
    ids = torch.tensor([p + [0] * (S - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (S - len(p)) for p in PROMPTS])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits.float()
    alone = _hf_logits(model, PROMPTS)
    worst = 0.0
    for i, p in enumerate(PROMPTS):
        assert ours[i].shape == (len(p), VOCAB)
        worst = max(worst, (ours[i] - alone[i]).abs().max().item(), (ours[i] - batched[i, :len(p)]).abs().max().item())
    assert worst < 1e-4, worst
    assert max(a.abs().max().item() for a in alone) > 1.0  # not a degenerate model
    if model.config.clip_qkv is not None:  # the clip bites: without it transformers' logits move
        model.config.clip_qkv = None
        try:
            unclipped = _hf_logits(model, PROMPTS)
        finally:
            model.config.clip_qkv = CLIP
        assert max((a - b).abs().max().item() for a, b in zip(alone, unclipped)) > 1e-2


def test_greedy_20_steps_equal_transformers_both_executors(hf_olmoe):
    """A ragged batch: 20 greedy tokens per prompt equal transformers' generate (each prompt alone), in the serial
    executor run as one batch and per prompt, and in CGOPipe on the CPU (experts paged; and with resident experts)."""
    path, model = hf_olmoe
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(w) for w in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    serial = ex.generate(PROMPTS, sp)
    assert [o for o, _ in serial] == want and all(r == "length" for _, r in serial)
    assert [ex.generate([p], sp)[0][0] for p in PROMPTS] == want  # the ragged batch equals each prompt alone
    for resident in (0, 3):
        pol = Policy(mu=2, n=2, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
        pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")
        try:
            assert [o for o, _ in pipe.generate(PROMPTS, sp)] == want
        finally:
            pipe.close()


def test_loglikelihood_equals_transformers_log_softmax_both_executors(hf_olmoe):
    """Loglikelihood records (score_batch over the executors' prompt_logprobs) equal the sum of transformers'
    log-softmax over each continuation (1e-4), greedy flags alike; CGOPipe's scores equal the serial executor's."""
    path, model = hf_olmoe

    class TR:  # the fields score_batch reads for loglikelihood
        truncated, prompt_tokens = 0, 0

        def __init__(self, i, ctx, cont):
            self.id, self.score_inputs, self.ctx, self.cont = str(i), [(ctx + cont, len(ctx))], ctx, cont

    treqs = [TR(i, p, [(7 * i + 3 * j) % VOCAB for j in range(1, 2 + i)]) for i, p in enumerate(PROMPTS)]
    serial = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    recs = score_batch(treqs, "loglikelihood", serial.prompt_logprobs, 256, None)
    for tr, rec in zip(treqs, recs):
        full = tr.ctx + tr.cont
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([full])).logits[0].double(), -1)  # [n, V]
        steps = [(len(tr.ctx) - 1 + i, t) for i, t in enumerate(tr.cont)]
        ref = sum(lp[pos, t].item() for pos, t in steps)
        assert rec["continuation_tokens"] == len(tr.cont)
        assert abs(rec["logprob"] - ref) < 1e-4, (tr.id, rec["logprob"], ref)
        assert rec["is_greedy"] == all(lp[pos].argmax().item() == t for pos, t in steps)
    seqs = [tr.ctx + tr.cont for tr in treqs]
    ref = serial.prompt_logprobs(seqs)
    pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    try:
        out = pipe.prompt_logprobs(seqs)
    finally:
        pipe.close()
    assert_scores_match(out, ref)


def test_fused_expert_layout_reads_alike(hf_olmoe, tmp_path):
    """A checkpoint in transformers-5's in-memory names (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F])
    loads to the same weights as the per-expert layout save_pretrained writes."""
    from safetensors.torch import save_file

    path, model = hf_olmoe
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d / "config.json")
    sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(d / "model.safetensors"))
    a, b = load_checkpoint(str(d), torch.float32), load_checkpoint(path, torch.float32)
    for ea, eb in zip(a.experts, b.experts):
        assert all(torch.equal(getattr(ea, w), getattr(eb, w)) for w in ("w1", "w3", "w2"))
    for la, lb in zip(a.layers, b.layers):
        assert all(torch.equal(getattr(la, k), getattr(lb, k)) for k in la.__dict__)
    assert torch.equal(a.lm_head, b.lm_head)


def test_every_olmoe_config_field_is_implemented_refused_or_harmless(hf_olmoe):
    from transformers import OlmoeConfig

    fam = family_for({"model_type": "olmoe"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys) and not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    fields = set(OlmoeConfig().to_dict()) | set(OlmoeConfig.attribute_map)  # attribute_map: num_local_experts
    with open(os.path.join(hf_olmoe[0], "config.json")) as f:
        fields |= set(json.load(f))
    fields |= set(HUB_OLMOE_1B_7B)
    assert sorted(fields - known) == []


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return make_hf_olmoe(tmp_path_factory.mktemp("hf_olmoe_refuse") / "ckpt", norm_topk_prob=False, clip_qkv=None)[0]


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), r"attention_bias': True"),
    (dict(hidden_act="gelu"), r"hidden_act': 'gelu'"),
    (dict(head_dim=16), r"head_dim': 16"),
    (dict(num_attention_heads=3, num_key_value_heads=3), r"num_attention_heads': 3"),
    (dict(sliding_window=4), r"sliding_window': 4"),
    (dict(clip_qkv=-1.0), r"clip_qkv': -1\.0"),
    (dict(num_experts=0), r"num_experts': 0"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     r"rope_(parameters|scaling)'"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "longrope", "factor": 4.0,
                                                                  "original_max_position_embeddings": 64}),
     r"rope_(parameters|scaling)'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config'"),
])
def test_a_value_that_changes_the_math_is_refused_by_name(olmoe_dir, tmp_path, changes, field):
    d = _write_config(olmoe_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         r"olmoe family"):
        MoESpec.from_pretrained_dir(d)


def test_harmless_values_are_read_alike(olmoe_dir, tmp_path):
    """A head_dim equal to hidden / heads and an integer clip_qkv read as the implied spec."""
    base = MoESpec.from_pretrained_dir(olmoe_dir)
    d = _write_config(olmoe_dir, tmp_path / "m", head_dim=8, clip_qkv=2)
    assert dataclasses.replace(MoESpec.from_pretrained_dir(d), name=base.name) == dataclasses.replace(base, clip_qkv=2.0)


def test_quantized_checkpoint_runs_in_both_executors(hf_olmoe, tmp_path):
    """``moe-batch quantize`` through the family's key map: non-expert weights (q/k norms included) kept bit for bit,
    tied embeddings re-tied, and the packed experts give transformers' logits once transformers' model holds the
    dequantized experts; CGOPipe's tokens equal the serial executor's on the quantized checkpoint."""
    import copy

    from lightning_moe.model.quantize import quantize_checkpoint
    from lightning_moe.model.quantized import QuantExperts

    path, model = hf_olmoe
    dst = quantize_checkpoint(path, str(tmp_path / "q"), experts="int4", group_size=8).dst
    src, w = load_checkpoint(path, torch.float32), load_checkpoint(dst, torch.float32)
    assert MoESpec.from_pretrained_dir(dst).clip_qkv == model.config.clip_qkv
    assert all(isinstance(e, QuantExperts) for e in w.experts)
    assert (w.lm_head is w.embed) == model.config.tie_word_embeddings and torch.equal(w.lm_head, src.lm_head)
    for a, b in zip(w.layers, src.layers):
        assert set(a.__dict__) >= {"q_norm", "k_norm"}
        assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in a.__dict__)
    deq = copy.deepcopy(model)
    with torch.no_grad():
        for layer, qe in zip(deq.model.layers, w.experts):
            ew = qe.dequantize(torch.float32)
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([ew.w1, ew.w3], dim=1))  # [E, 2F, D]
            layer.mlp.experts.down_proj.copy_(ew.w2)  # [E, D, F]
    serial = SerialExecutor(w, "cpu")
    ours = serial.logits(PROMPTS)
    ref, orig = _hf_logits(deq, PROMPTS), _hf_logits(model, PROMPTS)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(ours, orig)) > 1e-3  # the experts really are quantized
    sp = DecodeSampling(max_new_tokens=10, stop_at_eos=False)
    want = serial.generate(PROMPTS, sp)
    pipe = CGOPipeExecutor(load_checkpoint(dst, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="int4"), "cpu")
    try:
        assert pipe.generate(PROMPTS, sp) == want
    finally:
        pipe.close()


# allenai/OLMoE-1B-7B-0924's config.json on the Hub (transformers 4 names)
HUB_OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
}


def test_the_hub_olmoe_1b_7b_config_reads_as_the_planners_registry_spec(tmp_path, capsys):
    """allenai/OLMoE-1B-7B-0924's config.json gives the spec the planner's registry holds (as a dict and through
    transformers' AutoConfig from a config-only directory), that spec has a family the executors run, and
    ``moe-batch plan`` plans the directory."""
    import argparse

    from lightning_moe import plan_cli
    from lightning_moe.policy.registry import resolve_spec

    reg = resolve_spec("allenai/OLMoE-1B-7B-0924")
    assert reg.name == "olmoe-1b-7b"
    assert read_spec(HUB_OLMOE_1B_7B, reg.name) == reg
    assert family_of(reg).name == "olmoe"
    d = tmp_path / "olmoe-1b-7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HUB_OLMOE_1B_7B))
    assert MoESpec.from_pretrained_dir(str(d)) == reg
    parser = argparse.ArgumentParser(prog="moe-batch")
    plan_cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", str(d), "--hardware", "t4", "--gpu-memory", "15GiB", "--cpu-memory",
                              "64GiB", "--prompt-len", "64", "--gen-len", "16"])
    assert args.func(args) == 0
    assert "olmoe-1b-7b" in capsys.readouterr().out
