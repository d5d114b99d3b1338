"""The qwen2_moe family (Qwen1.5-MoE) against transformers' own Qwen2MoeForCausalLM (the oracle), through both executors.

Tiny random checkpoints saved by transformers' ``save_pretrained`` (fp32, sharded): 8 experts, top-3, GQA 4 query heads
over 2 KV heads, q/k/v biases, one shared expert (its own width) behind its sigmoid gate, random norm weights and
biases; ``norm_topk_prob`` true and false; a dense layer through ``mlp_only_layers`` (3 layers: MoE, dense, MoE), two
through ``decoder_sparse_step=2`` (4 layers: dense, MoE, dense, MoE), one checkpoint with tied embeddings. Logits equal
transformers' on a ragged batch (max abs < 1e-4), greedy tokens equal transformers' ``generate`` for 20 steps in the
serial executor and in CGOPipe (CPU, experts paged; dense layers page nothing), prompt log-probs equal transformers'
log-softmax, every Qwen2MoeConfig field is implemented, refused or harmless, each refused value's error names its
field, ``quantize`` packs only the routed experts, and the planner's memory model counts the resident shared experts
and dense MLPs.
"""

import copy
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


def make_hf_qwen2_moe(path, *, norm_topk_prob, tie=False, layers=3, mlp_only_layers=(), decoder_sparse_step=1,
                      experts=8, top_k=3, hidden=32, heads=4, kv_heads=2, moe_ffn=16, shared_ffn=24, ffn=40,
                      vocab=VOCAB, seed=0, shard="20KB"):
    """Save a random Qwen2MoeForCausalLM with save_pretrained (sharded safetensors); return (path, model)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=moe_ffn,
                         shared_expert_intermediate_size=shared_ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie,
                         mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=decoder_sparse_step,
                         max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default init so routing, the shared gate and tokens are not degenerate
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "gate" in n and "experts" not in n and "gate_proj" not in n else p.shape[-1] ** -0.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.3)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(str(path), max_shard_size=shard)
    return str(path), model


CASES = {  # id -> (make_hf_qwen2_moe kwargs, dense layers transformers builds)
    "norm_topk-mlp_only": (dict(norm_topk_prob=True, layers=3, mlp_only_layers=(1,)), (1,)),
    "no_norm_topk-sparse_step2": (dict(norm_topk_prob=False, layers=4, decoder_sparse_step=2), (0, 2)),
    "no_norm_topk-tied": (dict(norm_topk_prob=False, tie=True, layers=2), ()),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def hf_qwen2(request, tmp_path_factory):
    """(checkpoint dir, transformers model, dense layers) per case."""
    kw, dense = CASES[request.param]
    path, model = make_hf_qwen2_moe(tmp_path_factory.mktemp("hf_qwen2") / "ckpt", seed=5 + len(request.param), **kw)
    return path, model, dense


def test_spec_and_registry(hf_qwen2):
    path, model, dense = hf_qwen2
    spec = MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    assert fam.name == "qwen2_moe" and family_for({"architectures": ["Qwen2MoeForCausalLM"]}) is fam
    c = model.config
    assert (spec.model_type, spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.num_experts, spec.top_k, spec.rope_theta, spec.rms_norm_eps,
            spec.sliding_window, spec.norm_topk_prob, spec.tie_word_embeddings, spec.num_shared_experts,
            spec.shared_intermediate_size) == (
        "qwen2_moe", 32, 16, c.num_hidden_layers, 4, 2, 8, 8, 3, 10000.0, 1e-6, None, c.norm_topk_prob,
        c.tie_word_embeddings, 1, 24)
    # the dense layers are exactly the layers transformers built as Qwen2MoeMLP
    hf_dense = tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == dense == hf_dense
    assert spec.dense_intermediate_size == (40 if dense else 0)
    assert spec.moe_layers == tuple(i for i in range(spec.num_layers) if i not in dense)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert read_spec(raw, spec.name) == spec  # the raw dict and transformers' AutoConfig read alike
    # a Hub-style config.json (transformers 4: top-level rope_theta, no layer_types / qkv_bias) reads the same
    hub = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types", "qkv_bias", "dtype")}
    hub.update(rope_theta=10000.0, max_window_layers=21, sliding_window=32768, torch_dtype="float32")
    assert read_spec(hub, spec.name) == spec


def test_logits_equal_transformers_fp32_ragged_batch(hf_qwen2):
    """One ragged batch through our prefill: each row's logits within 1e-4 (max abs) of transformers', run alone and
    run as a right-padded batch with an attention mask."""
    path, model, _ = hf_qwen2
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    ours = ex.logits(PROMPTS)
    worst = ragged_logit_diff(ours, model, PROMPTS, VOCAB)
    assert worst < 1e-4, worst


def test_greedy_20_steps_equal_transformers_both_executors(hf_qwen2):
    """A ragged batch: 20 greedy tokens per prompt equal transformers' generate (each prompt alone), in the serial
    executor and in CGOPipe on the CPU (experts paged; and with resident experts). The dense layers have no routed
    experts anywhere: no pages in the pool, none resident, none in the serial executor's weights."""
    path, model, dense = hf_qwen2
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(w) for w in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    w = load_checkpoint(path, torch.float32)
    assert [i for i, e in enumerate(w.experts) if e is None] == list(dense)
    serial = SerialExecutor(w, "cpu")
    assert all(serial._experts_and_ffn(i)[0] is None for i in dense)
    out = serial.generate(PROMPTS, sp)
    assert [o for o, _ in out] == want and all(r == "length" for _, r in out)
    # each prompt alone gives the tokens it gives in the ragged batch
    assert [serial.generate([p], sp)[0][0] for p in PROMPTS] == want
    spec = w.spec
    for resident in (0, 3):
        pol = Policy(mu=2, n=2, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
        pipe = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")
        try:
            ws = pipe.weight_stream
            assert all(ws.pool.pages_per_layer[i] == 0 and not ws.paging.resident_experts(i) for i in dense)
            assert ws.resident_count() == resident * spec.num_moe_layers
            assert ws.pool.nbytes >= spec.num_moe_layers * (spec.num_experts - resident) * spec.expert_params * 4
            assert [o for o, _ in pipe.generate(PROMPTS, sp)] == want
        finally:
            pipe.close()


def test_prompt_logprobs_equal_transformers_log_softmax_both_executors(hf_qwen2):
    """Scoring (loglikelihood of every next token) equals transformers' log_softmax of its logits, in both executors;
    the greedy flags equal transformers' argmax."""
    path, model, _ = hf_qwen2
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
        assert_scores_match(out, ref)


# Qwen/Qwen1.5-MoE-A2.7B's config.json on the Hub (transformers 4.39 names)
HUB_QWEN15 = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
}


def test_every_qwen2_moe_config_field_is_implemented_refused_or_harmless(hf_qwen2):
    from transformers import Qwen2MoeConfig

    fam = family_for({"model_type": "qwen2_moe"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys) and not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    fields = set(Qwen2MoeConfig().to_dict())
    with open(os.path.join(hf_qwen2[0], "config.json")) as f:
        fields |= set(json.load(f))
    fields |= set(HUB_QWEN15)
    assert sorted(fields - known) == []


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_hf_qwen2_moe(tmp_path_factory.mktemp("hf_qwen2_refuse") / "ckpt", norm_topk_prob=True)[0]


@pytest.mark.parametrize("changes, field", [
    (dict(qkv_bias=False), r"qkv_bias': False"),
    (dict(use_sliding_window=True, sliding_window=4), r"use_sliding_window': True"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"]), r"layer_types'"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step': 0"),
    (dict(mlp_only_layers=[0, 1, 2]), r"mlp_only_layers': \[0, 1, 2\]"),
    (dict(num_experts=0), r"num_experts': 0"),
    (dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size': 0"),
    (dict(hidden_act="gelu"), r"hidden_act': 'gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}),
     r"rope_(parameters|scaling)'"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "longrope", "factor": 4.0,
                                                                  "original_max_position_embeddings": 64}),
     r"rope_(parameters|scaling)'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config'"),
])
def test_a_value_that_changes_the_math_is_refused_by_name(qwen2_dir, tmp_path, changes, field):
    d = _write_config(qwen2_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         r"qwen2_moe family"):
        MoESpec.from_pretrained_dir(d)


def test_harmless_values_are_read_alike(qwen2_dir, tmp_path):
    """An mlp_only_layers index past the last layer, a sliding_window and max_window_layers without
    use_sliding_window change nothing (transformers builds every layer MoE with full attention then): same spec."""
    base = MoESpec.from_pretrained_dir(qwen2_dir)
    d = _write_config(qwen2_dir, tmp_path / "m", mlp_only_layers=[5], sliding_window=4, use_sliding_window=False,
                      max_window_layers=1)
    assert dataclasses.replace(MoESpec.from_pretrained_dir(d), name=base.name) == base


def test_quantized_checkpoint_runs_in_both_executors(hf_qwen2, tmp_path):
    """``moe-batch quantize`` through the family's key map: only the routed experts are packed; every non-expert weight
    (q/k/v biases, the shared expert and its gate, the dense layers' MLPs) is kept bit for bit in the source dtype,
    tied embeddings re-tied, and the packed experts give transformers' logits once transformers' model holds the
    dequantized experts; CGOPipe's tokens equal the serial executor's on the quantized checkpoint."""
    from lightning_moe.model.quantize import quantize_checkpoint
    from lightning_moe.model.quantized import QuantExperts

    path, model, dense = hf_qwen2
    res = quantize_checkpoint(path, str(tmp_path / "q"), experts="int4", group_size=8)
    src, w = load_checkpoint(path, torch.float32), load_checkpoint(res.dst, torch.float32)
    spec = w.spec
    assert spec == dataclasses.replace(src.spec, name=spec.name)
    assert res.packed_expert_bytes == spec.num_moe_layers * spec.num_experts * res.page_bytes
    assert [i for i, e in enumerate(w.experts) if e is None] == list(dense)
    assert all(isinstance(e, QuantExperts) for i, e in enumerate(w.experts) if i not in dense)
    assert (w.lm_head is w.embed) == model.config.tie_word_embeddings and torch.equal(w.lm_head, src.lm_head)
    for i, (a, b) in enumerate(zip(w.layers, src.layers)):
        assert type(a) is type(b) and set(a.__dict__) >= ({"w1", "w3", "w2"} if i in dense else
                                                         {"bq", "shared_w1", "shared_gate"})
        assert all(getattr(a, k).dtype == torch.float32 and torch.equal(getattr(a, k), getattr(b, k)) for k in a.__dict__)
    deq = copy.deepcopy(model)
    with torch.no_grad():
        for i, (layer, qe) in enumerate(zip(deq.model.layers, w.experts)):
            if qe is None:
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
    pipe = CGOPipeExecutor(load_checkpoint(res.dst, torch.float32),
                           Policy(mu=2, n=2, prefill_mu=2, resident_experts=1, dtype="fp32", weight_quant="int4"), "cpu")
    try:
        assert pipe.generate(PROMPTS, sp) == want
    finally:
        pipe.close()


def test_the_hub_qwen15_moe_config_reads_as_the_planners_registry_spec():
    """Qwen/Qwen1.5-MoE-A2.7B's config.json gives the spec the planner's registry holds, and that spec now has a
    family the executors run."""
    from lightning_moe.policy.registry import resolve_spec

    reg = resolve_spec("qwen1.5-moe-a2.7b")
    spec = read_spec(HUB_QWEN15, reg.name)
    assert spec == reg
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.num_experts, spec.top_k,
            spec.intermediate_size, spec.shared_intermediate_size, spec.num_shared_experts, spec.vocab_size,
            spec.rope_theta, spec.norm_topk_prob, spec.dense_layers, spec.tie_word_embeddings) == (
        2048, 24, 16, 16, 60, 4, 1408, 5632, 1, 151936, 1e6, False, (), False)
    assert family_of(reg).name == "qwen2_moe"


def test_the_memory_model_counts_the_resident_shared_experts_and_dense_mlps():
    """The planner's GPU memory model holds the shared experts (every MoE layer) and the dense layers' MLPs as resident
    non-expert weights, and its FLOPs count them: Qwen1.5-MoE-A2.7B by hand, then with two dense layers (0 and 5)."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Workload
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("qwen1.5-moe-a2.7b")
    D, V, E, F, Fs, k = 2048, 151936, 60, 1408, 5632, 4
    attn = D * (16 * 128 + 2 * 16 * 128) + D * 16 * 128  # q, k, v + o_proj
    moe_layer = attn + 2 * D + E * D + 3 * D * Fs  # + 2 norms + router + the shared expert (gate, up, down)
    head = 2 * V * D + D  # embed_tokens + lm_head (not tied) + the final norm
    assert spec.non_expert_params == 24 * moe_layer + head == 1_858_504_704
    pol = Policy(mu=4, n=2, prefill_mu=4, resident_experts=1, dtype="bf16", weight_quant="bf16")
    work = Workload(prompt_len=32, gen_len=8)
    mem = hrm.memory_estimate(pol, spec, work)
    for phase in ("prefill", "decode"):
        assert mem.gpu_phases[phase]["non-expert weights"] == (24 * moe_layer + head) * 2
        assert mem.gpu_phases[phase]["resident experts"] == 24 * 3 * D * F * 2  # one routed expert per MoE layer
    assert spec.flops_per_token(0) == 24 * 2 * (attn + E * D + 3 * D * Fs + k * 3 * D * F) + 2 * V * D

    Fd = 5632
    dense_layer = attn + 2 * D + 3 * D * Fd  # no router, no routed or shared expert
    ds = dataclasses.replace(spec, dense_layers=(5, 0), dense_intermediate_size=Fd)
    assert ds.dense_layers == (0, 5) and ds.num_moe_layers == 22 and ds.moe_layers[:2] == (1, 2)
    mem = hrm.memory_estimate(pol, ds, work)
    assert mem.gpu_phases["decode"]["non-expert weights"] == (22 * moe_layer + 2 * dense_layer + head) * 2
    assert mem.gpu_phases["decode"]["resident experts"] == 22 * 3 * D * F * 2  # dense layers keep none
    assert mem.cpu["pinned experts (not resident)"] == 22 * (E - 1) * 3 * D * F * 2
    assert pol.resident_counts(ds) == tuple(0 if i in (0, 5) else 1 for i in range(24))
    assert ds.flops_per_token(0) == (22 * 2 * (attn + E * D + 3 * D * Fs + k * 3 * D * F)
                                     + 2 * 2 * (attn + 3 * D * Fd) + 2 * V * D)
    # the planner's per-layer stage times: a dense layer pages nothing
    from lightning_moe.policy.hardware import get_preset
    hw = get_preset("l4")
    assert hrm.decode_layer_times(ds, hw, pol, 5, E, 40.0).h2d < hrm.decode_layer_times(ds, hw, pol, 4, E - 1, 40.0).h2d


def test_the_memory_model_holds_the_executors_resident_weights(hf_qwen2):
    """On a real (tiny) checkpoint: the memory model's non-expert bytes are the bytes the executors keep resident
    (embeddings, attention, norms, routers, shared experts, dense MLPs), less only the vectors MoESpec leaves out (q/k/v
    biases, the shared-expert gate: smaller than one hidden row per layer)."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Workload

    path, _, dense = hf_qwen2
    w = load_checkpoint(path, torch.float32)
    spec = w.spec
    small = sum(spec.q_size + 2 * spec.kv_size + (0 if i in dense else spec.hidden_size) for i in range(spec.num_layers))
    mem = hrm.memory_estimate(Policy(mu=2, n=1, prefill_mu=2, dtype="fp32", weight_quant="fp32"), spec,
                              Workload(prompt_len=8, gen_len=4))
    assert mem.gpu_phases["decode"]["non-expert weights"] == w.non_expert_bytes - 4 * small
    assert w.expert_bytes == spec.num_moe_layers * spec.num_experts * spec.expert_params * 4  # the paged remainder
