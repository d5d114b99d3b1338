"""The qwen3_moe family against transformers' own Qwen3MoeForCausalLM (the oracle), through both executors.

Tiny random checkpoints saved by transformers' ``save_pretrained`` (fp32, sharded): 2 layers, 8 experts, top-3, GQA
4 query heads over 2 KV heads, head_dim 12 != hidden / heads = 8, random q/k norm weights; ``norm_topk_prob`` true
and false, one with tied embeddings, and dense (MLP-only) layers: one through ``mlp_only_layers`` (3 layers: MoE,
dense, MoE), two through ``decoder_sparse_step=2`` (4 layers: dense, MoE, dense, MoE). Logits equal transformers' on a ragged batch (max abs < 1e-4), greedy
tokens equal transformers' ``generate`` for 20 steps in the serial executor and in CGOPipe (CPU, experts paged),
every Qwen3MoeConfig field is implemented, refused or harmless, and each refused value's error names its field.
"""

import dataclasses
import json
import os

import pytest
import torch
from tests.support.hf_checkpoints import (assert_scores_match, hf_greedy as _hf_greedy, hf_prompt_logprobs, ragged_logit_diff,  # noqa: E402
                            write_config as _write_config)

from lightning_moe.model.families import family_for, family_of, read_spec
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy

VOCAB = 128
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]


def make_hf_qwen3_moe(path, *, norm_topk_prob, tie=False, layers=2, mlp_only_layers=(), decoder_sparse_step=1,
                      experts=8, top_k=3, hidden=32, heads=4, kv_heads=2, head_dim=12, moe_ffn=24, ffn=64, vocab=VOCAB,
                      seed=0, shard="20KB"):
    """Save a random Qwen3MoeForCausalLM with save_pretrained (sharded safetensors); return (path, model)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=moe_ffn,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie, max_position_embeddings=256,
                         mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=decoder_sparse_step,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
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


CASES = {  # id -> (make_hf_qwen3_moe kwargs, dense layers transformers builds)
    "norm_topk": (dict(norm_topk_prob=True), ()),
    "no_norm_topk": (dict(norm_topk_prob=False), ()),
    "no_norm_topk-tied": (dict(norm_topk_prob=False, tie=True), ()),
    "norm_topk-mlp_only": (dict(norm_topk_prob=True, layers=3, mlp_only_layers=(1,)), (1,)),
    "no_norm_topk-sparse_step2": (dict(norm_topk_prob=False, layers=4, decoder_sparse_step=2), (0, 2)),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def hf_qwen3(request, tmp_path_factory):
    """(checkpoint dir, transformers model) per case; the dense layers are checked in test_spec_and_registry."""
    kw, _ = CASES[request.param]
    path, model = make_hf_qwen3_moe(tmp_path_factory.mktemp("hf_qwen3") / "ckpt",
                                    seed=11 + 2 * kw["norm_topk_prob"] + kw.get("tie", False) + 3 * kw.get("layers", 2), **kw)
    model.case = request.param
    return path, model


def test_spec_and_registry(hf_qwen3):
    path, model = hf_qwen3
    spec = MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    assert fam.name == "qwen3_moe" and family_for({"architectures": ["Qwen3MoeForCausalLM"]}) is fam
    c = model.config
    assert (spec.model_type, spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.num_experts, spec.top_k, spec.rope_theta, spec.rms_norm_eps,
            spec.sliding_window, spec.norm_topk_prob, spec.tie_word_embeddings) == (
        "qwen3_moe", 32, 24, c.num_hidden_layers, 4, 2, 12, 8, 3, 10000.0, 1e-6, None, c.norm_topk_prob,
        c.tie_word_embeddings)
    assert spec.q_size != spec.hidden_size  # head_dim from the config, not hidden / heads
    # the dense layers are exactly the layers transformers built as Qwen3MoeMLP (width intermediate_size)
    hf_dense = tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == CASES[model.case][1] == hf_dense
    assert spec.dense_intermediate_size == (64 if hf_dense else 0)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert read_spec(raw, spec.name) == spec  # the raw dict and transformers' AutoConfig read alike
    # a Hub-style config.json (num_experts, top-level rope_theta, max_window_layers) reads the same
    hub = {k: v for k, v in raw.items() if k not in ("num_local_experts", "rope_parameters")}
    hub.update(num_experts=8, rope_theta=10000.0, max_window_layers=2, torch_dtype="float32")
    assert read_spec(hub, spec.name) == spec


def test_logits_equal_transformers_fp32_ragged_batch(hf_qwen3):
    """One ragged batch through our prefill: each row's logits within 1e-4 (max abs) of transformers', run alone and
    run as a right-padded batch with an attention mask."""
    path, model = hf_qwen3
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    ours = ex.logits(PROMPTS)
    worst = ragged_logit_diff(ours, model, PROMPTS, VOCAB)
    assert worst < 1e-4, worst


def test_greedy_20_steps_equal_transformers_both_executors(hf_qwen3):
    """A ragged batch: 20 greedy tokens per prompt equal transformers' generate (each prompt alone), in the serial
    executor and in CGOPipe on the CPU (experts paged; and with resident experts)."""
    path, model = hf_qwen3
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(w) for w in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    w = load_checkpoint(path, torch.float32)
    dense = w.spec.dense_layers
    assert [i for i, e in enumerate(w.experts) if e is None] == list(dense)  # a dense layer has no routed experts
    serial = SerialExecutor(w, "cpu").generate(PROMPTS, sp)
    assert [o for o, _ in serial] == want and all(r == "length" for _, r in serial)
    for resident in (0, 3):
        pol = Policy(mu=2, n=2, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
        pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")
        try:
            ws = pipe.weight_stream  # dense layers: no pages in the pool, no resident experts
            assert all(ws.pool.pages_per_layer[i] == 0 and not ws.paging.resident_experts(i) for i in dense)
            assert ws.resident_count() == resident * w.spec.num_moe_layers
            assert [o for o, _ in pipe.generate(PROMPTS, sp)] == want
        finally:
            pipe.close()


def test_cgopipe_prompt_logprobs_equal_serial(hf_qwen3):
    path, _ = hf_qwen3
    seqs = [p + [5, 6] for p in PROMPTS]
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    try:
        out = pipe.prompt_logprobs(seqs)
    finally:
        pipe.close()
    assert_scores_match(out, ref)


def test_prompt_logprobs_equal_transformers_log_softmax_both_executors(hf_qwen3):
    """Scoring (loglikelihood of every next token) equals transformers' log_softmax of its logits, in both executors;
    the greedy flags equal transformers' argmax."""
    path, model = hf_qwen3
    seqs = [p + [5, 6] for p in PROMPTS]
    ref = hf_prompt_logprobs(model, seqs)
    serial = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")
    try:
        piped = pipe.prompt_logprobs(seqs)
    finally:
        pipe.close()
    for out in (serial, piped):
        assert len(out) == len(ref)
        assert_scores_match(out, ref)


def test_ragged_batch_equals_each_prompt_alone(hf_qwen3):
    """Our executor's logits for a ragged batch equal its logits for each prompt run alone (fp32, 1e-5)."""
    path, _ = hf_qwen3
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    batch = ex.logits(PROMPTS)
    for i, p in enumerate(PROMPTS):
        alone = ex.logits([p])[0]
        assert (batch[i] - alone).abs().max().item() < 1e-5


def test_every_qwen3_moe_config_field_is_implemented_refused_or_harmless(hf_qwen3):
    from transformers import Qwen3MoeConfig

    fam = family_for({"model_type": "qwen3_moe"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys) and not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    fields = set(Qwen3MoeConfig().to_dict())
    with open(os.path.join(hf_qwen3[0], "config.json")) as f:
        fields |= set(json.load(f))
    # Qwen/Qwen3-30B-A3B's config.json on the Hub (transformers 4 names)
    fields |= {"architectures", "attention_bias", "attention_dropout", "bos_token_id", "decoder_sparse_step",
               "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
               "max_position_embeddings", "max_window_layers", "mlp_only_layers", "model_type",
               "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "num_experts",
               "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "output_router_logits",
               "rms_norm_eps", "rope_scaling", "rope_theta", "router_aux_loss_coef", "sliding_window",
               "tie_word_embeddings", "torch_dtype", "transformers_version", "use_cache", "use_sliding_window",
               "vocab_size"}
    assert sorted(fields - known) == []


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_hf_qwen3_moe(tmp_path_factory.mktemp("hf_qwen3_refuse") / "ckpt", norm_topk_prob=True)[0]


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), r"attention_bias': True"),
    (dict(use_sliding_window=True, sliding_window=4), r"use_sliding_window': True"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step': 0"),
    (dict(mlp_only_layers=[0, 1]), r"mlp_only_layers': \[0, 1\]"),  # no MoE layer left
    (dict(decoder_sparse_step=3), r"decoder_sparse_step': 3"),  # 2 layers: (i + 1) % 3 != 0 for both
    (dict(num_local_experts=0), r"num_local_experts': 0"),
    (dict(hidden_act="gelu"), r"hidden_act': 'gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     r"rope_(parameters|scaling)'"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 4.0,
                                                                  "original_max_position_embeddings": 64}),
     r"rope_(parameters|scaling)'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config'"),
])
def test_a_value_that_changes_the_math_is_refused_by_name(qwen3_dir, tmp_path, changes, field):
    d = _write_config(qwen3_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         r"qwen3_moe family"):
        MoESpec.from_pretrained_dir(d)


def test_harmless_values_are_read_alike(qwen3_dir, tmp_path):
    """An mlp_only_layers index past the last layer and a sliding_window without use_sliding_window change nothing
    (transformers builds every layer MoE with full attention then): accepted, same spec."""
    base = MoESpec.from_pretrained_dir(qwen3_dir)
    d = _write_config(qwen3_dir, tmp_path / "m", mlp_only_layers=[5], sliding_window=4, use_sliding_window=False)
    assert dataclasses.replace(MoESpec.from_pretrained_dir(d), name=base.name) == base


def test_quantized_checkpoint_runs_in_both_executors(hf_qwen3, tmp_path):
    """``moe-batch quantize`` through the family's key map: non-expert weights (q/k norms included) kept bit for bit,
    tied embeddings re-tied, and the packed experts give transformers' logits once transformers' model holds the
    dequantized experts; CGOPipe's tokens equal the serial executor's on the quantized checkpoint."""
    import copy

    from lightning_moe.model.quantize import quantize_checkpoint
    from lightning_moe.model.quantized import QuantExperts

    path, model = hf_qwen3
    dst = quantize_checkpoint(path, str(tmp_path / "q"), experts="int4", group_size=8).dst
    src, w = load_checkpoint(path, torch.float32), load_checkpoint(dst, torch.float32)
    dense = w.spec.dense_layers
    assert all(isinstance(e, QuantExperts) for i, e in enumerate(w.experts) if i not in dense)
    assert [i for i, e in enumerate(w.experts) if e is None] == list(dense)
    assert (w.lm_head is w.embed) == model.config.tie_word_embeddings and torch.equal(w.lm_head, src.lm_head)
    for i, (a, b) in enumerate(zip(w.layers, src.layers)):
        assert type(a) is type(b) and set(a.__dict__) >= ({"q_norm", "k_norm"} | ({"w1", "w3", "w2"} if i in dense else set()))
        assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in a.__dict__)
    deq = copy.deepcopy(model)
    with torch.no_grad():
        for layer, qe in zip(deq.model.layers, w.experts):
            if qe is None:  # a dense layer: its MLP is not quantized
                continue
            ew = qe.dequantize(torch.float32)
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([ew.w1, ew.w3], dim=1))  # [E, 2F, D]
            layer.mlp.experts.down_proj.copy_(ew.w2)  # [E, D, F]
    serial = SerialExecutor(w, "cpu")
    ours = serial.logits(PROMPTS)
    with torch.no_grad():
        ref = [deq(torch.tensor([p])).logits[0].float() for p in PROMPTS]
        orig = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
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


def test_the_hub_qwen3_30b_a3b_config_reads_as_the_planners_registry_spec():
    """Qwen/Qwen3-30B-A3B's config.json (transformers 4 names) gives the spec the planner's registry holds, and that
    spec now has a family the executors run."""
    from lightning_moe.policy.registry import resolve_spec

    hub = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
           "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
           "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    reg = resolve_spec("qwen3-30b-a3b")
    assert read_spec(hub, reg.name) == reg
    assert family_of(reg).name == "qwen3_moe"
