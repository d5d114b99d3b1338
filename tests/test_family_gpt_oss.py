"""The gpt_oss family against transformers' own GptOssForCausalLM (the oracle), through the serial executor.

A tiny random checkpoint saved by transformers' ``save_pretrained`` (fp32, sharded, eager attention): 3 layers with
``layer_types`` sliding / full / sliding and a ``sliding_window`` of 4 (prompts of up to 13 tokens, 20 generated
tokens), 8 experts top-3, GQA 4 query heads over 2 KV heads, random q/k/v/o biases, sinks, router bias and expert
biases, ``swiglu_limit`` 1.0 (so the clamps bite), GptOssConfig's default yarn RoPE (factor 32, truncate false).
Logits equal transformers' on a ragged batch (max abs < 1e-4), greedy tokens equal transformers' ``generate`` for 20
steps, a ragged batch equals each prompt alone, prompt log-probs equal transformers' log-softmax. MXFP4: our
dequantization equals transformers' bit for bit on random blocks and scales, and an MXFP4 checkpoint (random blocks)
gives the logits of transformers' model holding transformers' dequantization. Every GptOssConfig field (and the Hub
gpt-oss-20b config's) is implemented, refused or harmless, each refused value's error names its field. CGOPipe on the
CPU gives the serial executor's and transformers' greedy tokens and the serial executor's prompt log-probs (experts
paged with their biases, or partly resident), refusing by name what it does not compute (GPU-attention micro-batches
with sinks, the grouped expert kernels); the Hub config reads as the planner's registry spec and ``plan`` plans both.
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
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor

VOCAB = 128
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def make_hf_gpt_oss(path, *, seed=0, shard="50KB", **kw):
    """Save a random GptOssForCausalLM with save_pretrained (sharded safetensors); return (path, model)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3, sliding_window=4,
                layer_types=LAYER_TYPES, swiglu_limit=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                attn_implementation="eager")
    args.update(kw)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**args)).eval()
    honor_swiglu_config(model)
    with torch.no_grad():  # larger-than-default init so routing, sinks, clamps and tokens are not degenerate
        for n, p in model.named_parameters():
            if "experts" in n and p.dim() == 3:  # [E, in, out]
                p.normal_(0, p.shape[-2] ** -0.5)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif "norm" in n:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:  # biases, sinks
                p.normal_(0, 0.5)
    model.save_pretrained(str(path), max_shard_size=shard)
    return str(path), model


def honor_swiglu_config(model) -> None:
    """Make transformers' experts compute the config's clamped SwiGLU: transformers 5.17 (the GPU host's image) sets
    ``GptOssExperts.limit = 7.0`` and ``alpha = 1.702`` whatever ``swiglu_limit`` says (later releases read the
    config), so its reference would ignore the ``swiglu_limit=1.0`` these tests set; a no-op where the config is
    read."""
    c = model.config
    for layer in model.model.layers:
        layer.mlp.experts.limit = c.swiglu_limit
        layer.mlp.experts.alpha = getattr(c, "swiglu_alpha", 1.702)


@pytest.fixture(scope="module")
def hf_oss(tmp_path_factory):
    return make_hf_gpt_oss(tmp_path_factory.mktemp("hf_gpt_oss") / "ckpt")


def test_spec_and_registry(hf_oss):
    path, model = hf_oss
    spec = MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    assert fam.name == "gpt_oss" and family_for({"architectures": ["GptOssForCausalLM"]}) is fam
    assert fam.attention == "gqa_sinks" and fam.expert_activation == "clamped_swiglu"
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.num_experts, spec.top_k, spec.rope_theta, spec.rope_type, spec.rope_factor,
            spec.rope_truncate, spec.sliding_window, spec.full_attention_layers, spec.attention_sinks,
            spec.swiglu_limit, spec.swiglu_alpha, spec.expert_bias) == (
        64, 32, 3, 4, 2, 16, 8, 3, 150000.0, "yarn", 32.0, False, 4, (1,), True, 1.0, 1.702, True)
    # the window of each layer is transformers' own
    assert [spec.layer_sliding_window(i) for i in range(3)] == [a.self_attn.sliding_window
                                                                for a in model.model.layers] == [4, None, 4]
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert read_spec(raw, spec.name) == spec  # the raw dict and transformers' AutoConfig read alike


def test_checkpoint_layout_is_transformers_fused_one(hf_oss):
    """The experts as transformers saves them ([E, D, 2F] interleaved gate/up, [E, F, D] down, biases) load as
    [E, F, D] / [E, D, F] with their biases, gate = columns 0::2 and up = 1::2."""
    path, model = hf_oss
    w = load_checkpoint(path, torch.float32)
    for layer, ew in zip(model.model.layers, w.experts):
        hf = layer.mlp.experts
        assert torch.equal(ew.w1, hf.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(ew.w3, hf.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(ew.w2, hf.down_proj.transpose(1, 2))
        assert torch.equal(ew.b1, hf.gate_up_proj_bias[:, 0::2]) and torch.equal(ew.b3, hf.gate_up_proj_bias[:, 1::2])
        assert torch.equal(ew.b2, hf.down_proj_bias)


def test_logits_equal_transformers_fp32_ragged_batch(hf_oss):
    """One ragged batch through our prefill: each row's logits within 1e-4 (max abs) of transformers', run alone and
    as a right-padded batch with an attention mask."""
    path, model = hf_oss
    ours = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").logits(PROMPTS)
    worst = ragged_logit_diff(ours, model, PROMPTS, VOCAB)
    assert worst < 1e-4, worst


def test_greedy_20_steps_equal_transformers_and_ragged_equals_alone(hf_oss):
    """A ragged batch: 20 greedy tokens per prompt equal transformers' generate (each prompt alone; the decode passes
    the sliding window of 4), and each prompt alone gives the tokens it gives in the batch."""
    path, model = hf_oss
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(w) for w in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    serial = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    out = serial.generate(PROMPTS, sp)
    assert [o for o, _ in out] == want and all(r == "length" for _, r in out)
    assert [serial.generate([p], sp)[0][0] for p in PROMPTS] == want


def test_prompt_logprobs_equal_transformers_log_softmax(hf_oss):
    """Scoring (log-prob of every next token) equals transformers' log_softmax of its logits; the greedy flags equal
    transformers' argmax."""
    path, model = hf_oss
    seqs = [p + [5, 6] for p in PROMPTS]
    ref = hf_prompt_logprobs(model, seqs)
    out = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    assert_scores_match(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequantize_equals_transformers_exactly(dtype):
    """Random blocks and scales (every nibble, every E8M0 exponent 0..255, so overflow to inf and nan alike): our
    dequantization equals transformers' convert_moe_packed_tensors bit for bit, in its layout [E, G*32, R]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lightning_moe.kernels.mxfp4 import mxfp4_dequantize

    g = torch.Generator().manual_seed(0)
    for E, R, G in ((3, 10, 2), (1, 7, 5)):
        blocks = torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(0, 256, (E, R, G), dtype=torch.uint8, generator=g)
        scales[0, 0] = 127  # a block of plain FP4 values
        ours = mxfp4_dequantize(blocks, scales, dtype)
        ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        assert ours.shape == ref.shape == (E, G * 32, R) and ours.dtype == ref.dtype == dtype
        bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
        assert torch.equal(ours.view(bits), ref.view(bits))  # bit for bit: nan, inf and -0.0 included
    assert mxfp4_dequantize(torch.tensor([[[[0x21] + [0] * 15]]], dtype=torch.uint8),
                            torch.tensor([[[128]]], dtype=torch.uint8), torch.float32)[0, :2, 0].tolist() == [1.0, 2.0]


def _mxfp4_checkpoint(src: str, dst, model, seed: int = 1):
    """A copy of checkpoint ``src`` whose experts are random MXFP4 blocks and scales (the Hub's tensor names, one
    model.safetensors, quantization_config mxfp4), and ``model`` with transformers' dequantization of them."""
    import copy

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    deq = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    c = model.config
    E, D, F = c.num_local_experts, c.hidden_size, c.intermediate_size
    for i, layer in enumerate(deq.model.layers):
        for proj, R, C in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            blocks = torch.randint(0, 256, (E, R, C // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(120, 124, (E, R, C // 32), dtype=torch.uint8, generator=g)  # |values| <= 6 * 2^-4
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst), deq


def test_mxfp4_checkpoint_dequantized_on_load_gives_transformers_logits(hf_oss, tmp_path):
    """An MXFP4 checkpoint (the Hub's *_blocks / *_scales) loads dequantized into the compute dtype and gives the
    logits and greedy tokens of transformers' model holding transformers' dequantization of the same blocks."""
    path, model = hf_oss
    qdir, deq = _mxfp4_checkpoint(path, tmp_path / "mxfp4", model)
    w = load_checkpoint(qdir, torch.float32)
    assert w.spec == dataclasses.replace(MoESpec.from_pretrained_dir(path), name=w.spec.name)
    assert all(e.w1.dtype == torch.float32 for e in w.experts)
    ex = SerialExecutor(w, "cpu")
    ours = ex.logits(PROMPTS)
    with torch.no_grad():
        ref = [deq(torch.tensor([p])).logits[0].float() for p in PROMPTS]
        orig = [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(ours, orig)) > 1e-2  # the experts really are the blocks
    sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False)
    assert [o for o, _ in ex.generate(PROMPTS, sp)] == _hf_greedy(deq, PROMPTS, 8)
    # bf16 compute: the blocks dequantize straight into bf16 (exact: FP4 values times a power of two)
    wb = load_checkpoint(qdir, torch.bfloat16)
    assert wb.experts[0].w1.dtype == torch.bfloat16 and torch.equal(wb.experts[0].w1.float(), w.experts[0].w1)


# openai/gpt-oss-20b's config.json on the Hub (transformers 4.55 names)
HUB_GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_every_gpt_oss_config_field_is_implemented_refused_or_harmless(hf_oss):
    from transformers import GptOssConfig

    fam = family_for({"model_type": "gpt_oss"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys) and not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    fields = set(GptOssConfig().to_dict())
    with open(os.path.join(hf_oss[0], "config.json")) as f:
        fields |= set(json.load(f))
    fields |= set(HUB_GPT_OSS_20B)
    assert sorted(fields - known) == []


@pytest.mark.parametrize("changes, field", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), r"layer_types'"),
    (dict(layer_types=["sliding_attention", "full_attention"]), r"layer_types'"),
    (dict(sliding_window=0), r"sliding_window': 0"),
    (dict(swiglu_limit=0.0), r"swiglu_limit': 0.0"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 150000.0}),
     r"rope_(parameters|scaling)'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config'"),
    (dict(quantization={"experts": "int4"}), r"quantization'"),
])
def test_a_value_that_changes_the_math_is_refused_by_name(hf_oss, tmp_path, changes, field):
    d = _write_config(hf_oss[0], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         r"gpt_oss family"):
        MoESpec.from_pretrained_dir(d)


def test_a_raw_config_without_the_defaulted_fields_reads_as_transformers_fills_them(hf_oss):
    """A config.json without layer_types, rope mapping, sliding_window and swiglu_limit reads as GptOssConfig fills
    them in (__post_init__: sliding on even layers, yarn factor 32)."""
    from transformers import GptOssConfig

    with open(os.path.join(hf_oss[0], "config.json")) as f:
        raw = json.load(f)
    for k in ("layer_types", "rope_parameters", "sliding_window", "swiglu_limit", "swiglu_alpha"):
        raw.pop(k, None)
    hf = GptOssConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    assert read_spec(raw, "m") == read_spec(hf, "m")


# a ragged batch of 7 prompts (most longer than the sliding window of 4): with mu=2, 4 micro-batches, several KV
# length groups in some of them
CGO_PROMPTS = PROMPTS + [[1, 5, 9, 13, 17], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 50], [8, 6]]


def _cgopipe(path, resident=0, mu=2, n=4, ffn="torch", **kw):
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    pol = Policy(mu=mu, n=n, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32", **kw)
    return CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu", ffn=ffn)


@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_greedy_20_steps_equal_serial_and_transformers(hf_oss, resident):
    """CGOPipe on the CPU (decode attention with the layer's sinks and window over the grouped CPU cache on the
    worker, experts paged with their biases through the host pool, or partly resident): 20 greedy tokens per row of
    a ragged batch of 4 micro-batches equal the serial executor's and transformers' (each prompt alone)."""
    path, model = hf_oss
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    want = _hf_greedy(model, CGO_PROMPTS, 20)
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").generate(CGO_PROMPTS, sp)
    assert [o for o, _ in ref] == want
    ex = _cgopipe(path, resident)
    assert {e.name for e in ex.weight_stream.pool.layout.entries} == {"w1", "w3", "w2", "b1", "b3", "b2"}
    mbs = ex._micro_batches(CGO_PROMPTS, 20, True, ex.policy.mu)
    assert len(mbs) >= 3
    out = ex.generate(CGO_PROMPTS, sp)
    ex.close()
    assert [o for o, _ in out] == want and all(r == "length" for _, r in out)
    assert ex.weight_stream.resident_count() == 3 * resident and ex.stats.decode_steps == 19
    # the worker read the valid positions of each layer: its window (sliding layers 0, 2) or all of them (layer 1)
    lens = [len(p) for p in CGO_PROMPTS]
    per_pos = 2 * ex.spec.num_kv_heads * ex.spec.head_dim * 4
    full = sum(n + s for n in lens for s in range(1, 20))
    window = sum(min(n + s, 4) for n in lens for s in range(1, 20))
    assert ex.stats.extra["cpu_attention_valid_kv_bytes"] == (full + 2 * window) * per_pos


def test_cgopipe_prompt_logprobs_equal_serial(hf_oss):
    path, _ = hf_oss
    seqs = [p + [5, 6] for p in CGO_PROMPTS]
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    ex = _cgopipe(path, 2)
    out = ex.prompt_logprobs(seqs)
    ex.close()
    assert_scores_match(out, ref)


def test_cgopipe_runs_gpt_oss_and_refuses_what_it_does_not_compute_by_name(hf_oss):
    """CGOPipe runs the family (no refusal); the grouped expert kernels (silu, no biases) are refused by name, and a
    job's expert_ffn auto resolves to the torch loop for it; GPU-attention micro-batches with sinks are built (on the
    CPU every micro-batch attends on the CPU; tests/test_decode_attention.py runs their attention against the CPU's)."""
    from types import SimpleNamespace

    from lightning_moe.pipeline.cgopipe import cgopipe_refusal, expert_ffn_for

    path, _ = hf_oss
    spec = MoESpec.from_pretrained_dir(path)
    assert cgopipe_refusal(spec) is None
    assert expert_ffn_for(SimpleNamespace(expert_ffn="auto", device="cuda"), spec) == "torch"  # even on CUDA
    assert expert_ffn_for(SimpleNamespace(expert_ffn="triton", device="cuda"), spec) == "triton"  # as given: refused
    # grouped_mm runs on the CPU too (triton and auto run the torch loop there): refused by name
    with pytest.raises(ValueError, match=r"expert_ffn grouped_mm: the grouped expert kernels compute silu experts "
                                         r"without biases, not the gpt_oss family's 'clamped_swiglu' gate activation "
                                         r"and expert biases \(use expert_ffn: torch\)"):
        _cgopipe(path, ffn="grouped_mm")
    ex = _cgopipe(path, n_gpu_attn=1)
    ex.cuda = True  # as on a CUDA device: the first micro-batch keeps its KV (on the GPU there) and attends there
    mbs = ex._micro_batches(CGO_PROMPTS, 4, True, 2)
    assert [mb.on_gpu for mb in mbs] == [True, False, False, False]  # sinks: GPU-attention micro-batches run
    ex.cuda = False
    ex.close()


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_gpu_attention_micro_batch_with_sinks_equals_cpu_attention(hf_oss, monkeypatch, kernel):
    """A GPU-attention micro-batch's decode attention (AttentionPlacement.gpu: the family's torch attention with the
    layer's sinks per length group, or the one-launch Triton kernel with the sinks, under Triton's interpreter here)
    equals the CPU attention of the same rows (the native kernel with the layer's sinks), every layer (sliding and
    full), over two steps: fp32 1e-5 relative. Caches filled from random prompt K/V; a control with the sinks zeroed
    differs (the sinks are read)."""
    if kernel == "triton":
        from lightning_moe.kernels import fused_moe as fm

        if not fm.triton_available():
            pytest.skip("triton not installed")
        import triton  # noqa: F401  (compiled-mode import first: tests/test_kernels_ref.py)

        monkeypatch.setenv("TRITON_INTERPRET", "1")
    path, _ = hf_oss
    ex = _cgopipe(path, n_gpu_attn=1)
    from tests.support.placement import gpu_and_cpu_micro_batch

    at, spec = ex.attention, ex.spec
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    Hq, Hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    gpu_mb, cpu_mb = gpu_and_cpu_micro_batch(ex, kernel, ((Hkv, hd), (Hkv, hd)), g)
    B = len(gpu_mb.rows)
    for _ in range(2):
        gpu_mb.pos = gpu_mb.kv.lengths.clone()
        for l in range(spec.num_layers):
            q, k, v = torch.randn(B, Hq, hd, generator=g), torch.randn(B, Hkv, hd, generator=g), \
                torch.randn(B, Hkv, hd, generator=g)
            got = at.gpu(l, gpu_mb, q, k, v).clone()
            want = at.receive(at.submit_cpu(l, cpu_mb, q, k, v)).clone()
            assert float((got - want).norm() / want.norm()) < 1e-5, (l, kernel)
        for mb in (gpu_mb, cpu_mb):
            mb.kv.lengths += 1
    gpu_mb.pos = gpu_mb.kv.lengths.clone()
    at._gpu_sinks = [torch.zeros_like(s) for s in at._gpu_sinks]  # control: no sinks
    at._layers = [dataclasses.replace(lw, sinks=torch.zeros_like(lw.sinks)) for lw in at._layers]
    q, k, v = torch.randn(B, Hq, hd, generator=g), torch.randn(B, Hkv, hd, generator=g), torch.randn(B, Hkv, hd, generator=g)
    got = at.gpu(0, gpu_mb, q, k, v).clone()
    want = at.receive(at.submit_cpu(0, cpu_mb, q, k, v)).clone()
    assert float((got - want).norm() / want.norm()) > 1e-3
    ex.close()


def test_a_cgopipe_job_is_planned_and_what_is_not_implemented_refused_before_any_weight(hf_oss, monkeypatch):
    """plan_for_job plans gpt-oss under executor: cgopipe, with n_gpu_attn > 0 on CUDA as well (the sinks run in the
    GPU decode attention); expert_ffn triton or grouped_mm are refused by name before any weight is read."""
    import types

    from lightning_moe.app import engine
    from lightning_moe.config import ConfigError
    from lightning_moe.policy.policy import Policy

    path, _ = hf_oss
    prep = types.SimpleNamespace(spec=MoESpec.from_pretrained_dir(path), treqs=[types.SimpleNamespace(error=None)])

    def job(**kw):
        return types.SimpleNamespace(**dict(dict(executor="cgopipe", config_path="job.yaml", name="j", policy="auto",
                                                 task="generate", device="cuda", expert_ffn="auto"), **kw))

    for g in (0, 1):
        pol = Policy(mu=2, n=2, prefill_mu=2, n_gpu_attn=g, dtype="fp32", weight_quant="fp32")
        monkeypatch.setattr(engine, "plan_job", lambda j, p, pol=pol: types.SimpleNamespace(policy=pol))
        if g == 0:
            assert engine.plan_for_job(job(), prep).policy is pol
            assert engine.plan_for_job(job(expert_ffn="torch"), prep).policy is pol
            for k in ("triton", "grouped_mm"):
                with pytest.raises(ConfigError, match=rf"job\.yaml: executor: cgopipe: ckpt: expert_ffn {k}: the "
                                                      r"grouped expert kernels compute silu.*\(use expert_ffn: torch\)"):
                    engine.plan_for_job(job(expert_ffn=k), prep)
        else:
            assert engine.plan_for_job(job(), prep).policy is pol


def test_quantize_refuses_gpt_oss_by_name(hf_oss, tmp_path):
    from lightning_moe.model.quantize import QuantizeError, quantize_checkpoint

    with pytest.raises(QuantizeError, match=r"the gpt_oss family's experts \(clamped_swiglu"):
        quantize_checkpoint(hf_oss[0], str(tmp_path / "q"), experts="int4")


def test_the_hub_config_reads_as_the_planners_registry_spec():
    """openai/gpt-oss-20b's config.json gives the registry's spec (120b: its layers and experts), whose family the
    serial executor runs, and whose parameter counts are the published ones (20.9 B, 116.8 B)."""
    from lightning_moe.policy.registry import resolve_spec

    reg = resolve_spec("gpt-oss-20b")
    assert read_spec(HUB_GPT_OSS_20B, reg.name) == reg
    hub120 = dict(HUB_GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                  layer_types=["sliding_attention", "full_attention"] * 18)
    assert read_spec(hub120, "gpt-oss-120b") == resolve_spec("openai/gpt-oss-120b")
    assert family_of(reg).name == "gpt_oss"
    assert abs(reg.total_params / 1e9 - 20.9) < 0.05 and abs(resolve_spec("gpt-oss-120b").total_params / 1e9 - 116.8) < 0.1


def _plan(argv):
    import argparse

    from lightning_moe import plan_cli

    parser = argparse.ArgumentParser(prog="moe-batch")
    plan_cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--hardware", "h200", "--prompt-len", "128", "--gen-len", "64"] + argv)
    return args.func(args)


def test_plan_both_registry_entries(capsys):
    """gpt-oss-20b plans (its Hub format, mxfp4) under 24 GiB of GPU and 120 GiB of host, and at bf16; gpt-oss-120b's
    bf16 experts (214 GiB: the -bf16 alias) do not fit the host; it plans at mxfp4's bytes (its default, below and
    tests/test_mxfp4_pages.py), and int4 is refused: quantize's pages cannot hold gpt-oss's experts, so run could not
    execute that plan."""
    assert _plan(["--model", "gpt-oss-20b", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB"]) == 0
    assert "predicted:" in capsys.readouterr().out
    assert _plan(["--model", "gpt-oss-20b", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB", "--quant", "bf16"]) == 0
    assert "predicted:" in capsys.readouterr().out
    assert _plan(["--model", "gpt-oss-120b-bf16", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB"]) == 2
    assert "moe-batch plan: infeasible: host memory 120.00 GiB < " in capsys.readouterr().err
    assert _plan(["--model", "gpt-oss-120b", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB", "--quant", "int4"]) == 2
    assert "--quant int4: the gpt_oss family's experts" in capsys.readouterr().err
    assert _plan(["--model", "gpt-oss-120b", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB"]) == 0
    assert "expert pages                     mxfp4" in capsys.readouterr().out
