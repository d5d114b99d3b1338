"""The deepseek_v2 and deepseek_v3 families against transformers' own DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
(the oracle), through the serial executor.

Tiny random checkpoints saved by transformers' ``save_pretrained`` (fp32, sharded): 3 layers (a dense first layer
through ``first_k_dense_replace=1``, then 2 MoE layers), 8 routed experts top-2 (top-3), shared experts
(``n_shared_experts`` 2 and 1), MLA with ``q_lora_rank`` null and set, random norm weights, ``rms_norm_eps`` 1e-5
(the latent norms keep 1e-6: one checkpoint's latent is small enough for the eps to show), both V2 router methods (greedy, group_limited_greedy) and V3's biased sigmoid router
with a random correction bias, ``routed_scaling_factor`` != 1, V3 with ``rope_interleave`` true and false, yarn RoPE
with ``mscale_all_dim`` (DeepSeek-V2-Lite's and V3's rope_scaling in small). Logits equal transformers' on a ragged
batch (max abs < 1e-4), greedy tokens equal transformers' ``generate`` for 20 steps (the decode attends over the
latent cache), prompt log-probs equal transformers' log-softmax, MLA decode over the latent equals the uncompressed
attention (fp32, 1e-5), the cache holds exactly the planner's KV bytes per token; CGOPipe on the CPU (the latent cache
on the worker) gives the serial executor's and transformers' tokens and the serial executor's prompt log-probs, and
refuses GPU-attention micro-batches by name.
"""

import dataclasses
import json
import os

import pytest
import torch
from tests.support.hf_checkpoints import assert_scores_match, hf_greedy as _hf_greedy, ragged_logit_diff  # noqa: E402

from lightning_moe.model.families import family_for, family_of, read_spec
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.kv_cache import LatentKVCache, make_kv_cache
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor

VOCAB = 128
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]
YARN_V2 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
           "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_V3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def make_hf_deepseek(path, version, *, q_lora_rank=None, seed=0, rope=None, shard="20KB", small_latent=False, **kw):
    """Save a random DeepseekV2/V3ForCausalLM with save_pretrained; return (path, model). ``small_latent``: the
    latent's rows of kv_a_proj_with_mqa scaled by 1e-3, so its mean square (~1e-6) is near the latent norm's eps."""
    import transformers

    cls = {2: (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
           3: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[version]
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=q_lora_rank,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    args.update(kw)
    cfg = cls[0](**args)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # larger-than-default init so routing and tokens are not degenerate
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if n.endswith("mlp.gate.weight") else p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            if small_latent and n.endswith("kv_a_proj_with_mqa.weight"):
                p[:cfg.kv_lora_rank] *= 1e-3
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b) - 0.1)
    model.save_pretrained(str(path), max_shard_size=shard)
    return str(path), model


CASES = {  # id -> (version, make_hf_deepseek kwargs)
    "v2-greedy-no_qlora": (2, dict(topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                   small_latent=True)),
    "v2-group_limited-qlora-yarn": (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                            routed_scaling_factor=1.7, q_lora_rank=12, num_experts_per_tok=3,
                                            rope=YARN_V2)),
    "v3-interleave-qlora": (3, dict(n_group=4, topk_group=2, q_lora_rank=12, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, n_shared_experts=1)),
    "v3-rotate_half-no_qlora-yarn": (3, dict(n_group=2, topk_group=1, norm_topk_prob=False, rope_interleave=False,
                                             routed_scaling_factor=1.5, num_experts_per_tok=3, rope=YARN_V3)),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def hf_ds(request, tmp_path_factory):
    version, kw = CASES[request.param]
    path, model = make_hf_deepseek(tmp_path_factory.mktemp("hf_ds") / "ckpt", version, seed=3 + len(request.param), **kw)
    return path, model, request.param


def test_spec(hf_ds):
    path, model, case = hf_ds
    spec = MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    c = model.config
    assert fam.name == c.model_type and fam.attention == "mla"
    assert family_for({"architectures": [type(model).__name__]}) is fam
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.kv_lora_rank, spec.qk_rope_head_dim,
            spec.qk_nope_head_dim, spec.v_head_dim, spec.q_lora_rank, spec.num_experts, spec.top_k,
            spec.num_shared_experts, spec.shared_intermediate_size, spec.intermediate_size, spec.rms_norm_eps) == (
        3, 4, 4, 16, 16, 8, 8, 12, c.q_lora_rank or 0, 8, c.num_experts_per_tok, c.n_shared_experts, 16, 16, 1e-5)
    hf_dense = tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))
    assert spec.dense_layers == hf_dense == (0,) and spec.dense_intermediate_size == 40
    assert spec.softmax_scale == model.model.layers[0].self_attn.scaling  # incl. yarn's mscale_all_dim
    assert spec.routed_scaling_factor == c.routed_scaling_factor
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert read_spec(raw, spec.name) == spec  # the raw dict and transformers' AutoConfig read alike


def test_logits_equal_transformers_fp32_ragged_batch(hf_ds):
    path, model, _ = hf_ds
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    ours = ex.logits(PROMPTS)
    worst = ragged_logit_diff(ours, model, PROMPTS, VOCAB)
    assert worst < 1e-4, worst


def test_greedy_20_steps_equal_transformers_over_the_latent_cache(hf_ds):
    """20 greedy tokens per prompt equal transformers' generate (each prompt alone), as a ragged batch and each prompt
    alone; decode attends over the latent cache (LatentKVCache) with the projections absorbed."""
    path, model, _ = hf_ds
    want = _hf_greedy(model, PROMPTS, 20)
    assert len({tuple(w) for w in want}) > 1
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    serial = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    assert serial._experts_and_ffn(0)[0] is None  # the dense first layer pages nothing
    out = serial.generate(PROMPTS, sp)
    assert [o for o, _ in out] == want and all(r == "length" for _, r in out)
    assert [serial.generate([p], sp)[0][0] for p in PROMPTS] == want


def test_prompt_logprobs_equal_transformers_log_softmax(hf_ds):
    path, model, _ = hf_ds
    seqs = [p + [5, 6] for p in PROMPTS]
    out = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    with torch.no_grad():
        for s, (a, ga) in zip(seqs, out):
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), dim=-1)[:-1]
            tgt = torch.tensor(s[1:])
            assert (a - lp.gather(1, tgt[:, None])[:, 0]).abs().max().item() < 1e-4
            assert torch.equal(ga, lp.argmax(-1) == tgt)


def test_latent_decode_equals_uncompressed_attention(hf_ds):
    """Decode over the latent cache (absorbed q, one shared latent key per position, W_UV after) equals softmax(q k^T
    * scale) v over the per-head keys and values that kv_b_proj expands from the same latents (fp32, 1e-5)."""
    path, _, _ = hf_ds
    w = load_checkpoint(path, torch.float32)
    spec, fam = w.spec, family_of(w.spec)
    lw = w.layers[1]
    g = torch.Generator().manual_seed(0)
    B, S = 3, 11
    lengths = torch.tensor([11, 4, 1])
    q = torch.randn(B, spec.num_heads, spec.head_dim, generator=g)
    c = torch.randn(B, S, spec.kv_lora_rank, generator=g)
    k_pe = torch.randn(B, S, spec.qk_rope_head_dim, generator=g)
    cache = torch.cat([c, k_pe], dim=-1)
    ours = fam.decode_attention(lw, q, cache, lengths, spec)  # [B, Hq*vd]
    ref = []
    for b in range(B):
        n = int(lengths[b])
        kv = (c[b, :n] @ lw.wkv_b.T).view(n, spec.num_heads, -1)  # kv_b_proj: [n, Hq, nope + vd]
        k = torch.cat([kv[..., :spec.qk_nope_head_dim], k_pe[b, :n, None, :].expand(-1, spec.num_heads, -1)], -1)
        v = kv[..., spec.qk_nope_head_dim:]  # [n, Hq, hd], [n, Hq, vd]
        p = torch.softmax(torch.einsum("hd,shd->hs", q[b], k) * spec.softmax_scale, dim=-1)
        ref.append(torch.einsum("hs,shv->hv", p, v).reshape(-1))
    assert ours.shape == (B, spec.num_heads * spec.value_head_dim)
    assert (ours - torch.stack(ref)).abs().max().item() < 1e-5


def test_the_cache_holds_the_planners_kv_bytes_per_token(hf_ds):
    path, _, _ = hf_ds
    spec = MoESpec.from_pretrained_dir(path)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        kv = make_kv_cache(spec, 5, 37, dtype)
        assert isinstance(kv, LatentKVCache)
        assert kv.nbytes == 5 * 37 * spec.kv_bytes_per_token(name) == 5 * 37 * 3 * (16 + 8) * dtype.itemsize


# a ragged batch of 7 prompts: with mu=2, 4 micro-batches, several KV length groups in some of them
CGO_PROMPTS = PROMPTS + [[1, 5, 9, 13, 17], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 50], [8, 6]]


def _cgopipe(path, resident=0, mu=2, n=4, **kw):
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    pol = Policy(mu=mu, n=n, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32", **kw)
    return CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu")


@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_greedy_20_steps_equal_serial_and_transformers(hf_ds, resident):
    """CGOPipe on the CPU (decode attention over the grouped latent cache on the worker, the absorbed query and the
    un-absorb on the compute device, experts paged or partly resident): 20 greedy tokens per row of a ragged batch of
    4 micro-batches equal the serial executor's and transformers' (each prompt alone)."""
    path, model, _ = hf_ds
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    want = _hf_greedy(model, CGO_PROMPTS, 20)
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").generate(CGO_PROMPTS, sp)
    assert [o for o, _ in ref] == want
    ex = _cgopipe(path, resident)
    mbs = ex._micro_batches(CGO_PROMPTS, 20, True, ex.policy.mu)
    assert len(mbs) >= 3 and all(type(mb.kv).__name__ == "GroupedLatentKVCache" for mb in mbs)
    out = ex.generate(CGO_PROMPTS, sp)
    ex.close()
    assert [o for o, _ in out] == want and all(r == "length" for _, r in out)
    assert ex.weight_stream.resident_count() == 2 * resident and ex.stats.decode_steps == 19
    # the worker read every valid latent position of every layer and step
    lens = [len(p) for p in CGO_PROMPTS]
    per_pos = ex.spec.num_layers * (ex.spec.kv_lora_rank + ex.spec.qk_rope_head_dim) * 4
    assert ex.stats.extra["cpu_attention_valid_kv_bytes"] == sum(n + s for n in lens for s in range(1, 20)) * per_pos


def test_cgopipe_prompt_logprobs_equal_serial(hf_ds):
    path, _, _ = hf_ds
    seqs = [p + [5, 6] for p in CGO_PROMPTS]
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").prompt_logprobs(seqs)
    ex = _cgopipe(path, 2)
    out = ex.prompt_logprobs(seqs)
    ex.close()
    assert_scores_match(out, ref)


def test_the_grouped_latent_cache_holds_the_planners_kv_bytes(hf_ds):
    """CGOPipe's grouped latent cache allocates exactly the planner's KV bytes per padded position
    (hrm.kv_bytes_per_position: L * (kv_lora_rank + qk_rope_head_dim) * itemsize), and the planner's CPU KV bytes
    (hrm.kv_cache_bytes) of a batch of one length are what its micro-batches' caches allocate."""
    from lightning_moe.pipeline.kv_cache import GroupedLatentKVCache
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Policy
    from lightning_moe.policy.policy import Workload

    path, _, _ = hf_ds
    spec = MoESpec.from_pretrained_dir(path)
    assert hrm.kv_bytes_per_position(spec, "fp32") == spec.num_layers * (16 + 8) * 4
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        kv = GroupedLatentKVCache(spec, [5, 9, 30, 31, 2], dtype, max_groups=3)
        assert kv.num_groups == 3
        assert kv.nbytes == kv.padded_positions * hrm.kv_bytes_per_position(spec, name)
        assert kv.nbytes == kv.padded_positions * spec.kv_bytes_per_token(name)
    pol = Policy(mu=2, n=3, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    wl = Workload(prompt_len=12, gen_len=20)
    ex = _cgopipe(path, mu=2, n=3)
    mbs = ex._micro_batches([[1] * 12] * 6, 20, True, 2)
    ex.close()
    assert hrm.kv_cache_bytes(pol, spec, wl) == (0, sum(mb.kv.nbytes for mb in mbs)) == (0, 6 * 32 * 3 * 24 * 4)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_gpu_attention_micro_batch_equals_cpu_attention(hf_ds, kernel, monkeypatch):
    """A GPU-attention micro-batch of an MLA model (a latent cache kept where the GPU's would be: here the CPU's
    memory; AttentionPlacement.gpu: the family's torch latent attention per length group, for gpu_attention "triton"
    too: there is no Triton latent kernel) equals the CPU attention of the same rows (the native MLA kernel), every
    layer, two steps: fp32 1e-5 relative, the attention-weighted latents [B, Hq, kv_lora]."""
    path, _, _ = hf_ds
    ex = _cgopipe(path, n_gpu_attn=1)
    from tests.support.placement import gpu_and_cpu_micro_batch

    at, spec = ex.attention, ex.spec
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    Hq, Dl, rd = spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    gpu_mb, cpu_mb = gpu_and_cpu_micro_batch(ex, kernel, ((Dl,), (rd,)), g)
    B = len(gpu_mb.rows)
    from lightning_moe.kernels import cpu_latent_attention as CLA

    native = []
    real = CLA.latent_attention_append_groups
    monkeypatch.setattr(CLA, "latent_attention_append_groups", lambda *a, **k: (native.append(1), real(*a, **k))[1])
    for _ in range(2):
        gpu_mb.pos = gpu_mb.kv.lengths.clone()  # as CGOPipe's decode step sets it (the GPU path appends at pos)
        for l in range(spec.num_layers):
            q = torch.randn(B, Hq, Dl + rd, generator=g)
            c, k_pe = torch.randn(B, Dl, generator=g), torch.randn(B, rd, generator=g)
            n0 = len(native)
            got = at.gpu(l, gpu_mb, q, c, k_pe).clone()
            assert len(native) == n0  # the GPU path is the torch one, whatever device the cache is on
            want = at.receive(at.submit_cpu(l, cpu_mb, q, c, k_pe)).clone()
            assert got.shape == (B, Hq, Dl)
            assert float((got - want).norm() / want.norm()) < 1e-5, (l, kernel)
        for mb in (gpu_mb, cpu_mb):
            mb.kv.lengths += 1
    for l in range(spec.num_layers):  # the appends landed in both caches alike
        for a, b in zip(gpu_mb.kv.lat[l], cpu_mb.kv.lat[l]):
            assert torch.equal(a, b)
    ex.close()


def test_a_cgopipe_job_with_gpu_attention_micro_batches_is_planned(hf_ds, monkeypatch):
    """plan_for_job plans an MLA model under executor: cgopipe, with a generation policy of n_gpu_attn > 0 on CUDA as
    well (the planner plans them where the HRM prices them faster; a policy file may ask for them)."""
    import types

    from lightning_moe.app import engine
    from lightning_moe.policy.policy import Policy

    path, _, _ = hf_ds
    job = types.SimpleNamespace(executor="cgopipe", config_path="job.yaml", name="j", policy="auto", task="generate",
                                device="cuda")
    prep = types.SimpleNamespace(spec=MoESpec.from_pretrained_dir(path), treqs=[types.SimpleNamespace(error=None)])
    for g in (0, 1):
        pol = Policy(mu=2, n=2, prefill_mu=2, n_gpu_attn=g, dtype="fp32", weight_quant="fp32")
        monkeypatch.setattr(engine, "plan_job", lambda j, p, pol=pol: types.SimpleNamespace(policy=pol))
        assert engine.plan_for_job(job, prep).policy is pol


def test_mtp_layers_are_skipped_at_load_with_a_message(hf_ds, capsys):
    path, model, case = hf_ds
    w = load_checkpoint(path, torch.float32)
    err = capsys.readouterr().err
    if case.startswith("v3"):
        assert w.spec.num_mtp_layers == model.config.num_nextn_predict_layers == 1
        assert "skipping 1 multi-token-prediction layer(s) (model.layers.3.*, num_nextn_predict_layers)" in err
    else:
        assert w.spec.num_mtp_layers == 0 and "multi-token" not in err
    assert len(w.layers) == 3


# deepseek-ai/DeepSeek-V2-Lite's config.json on the Hub (transformers 4.33 names; auto_map abridged)
HUB_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
# deepseek-ai/DeepSeek-V3's config.json on the Hub (auto_map abridged)
HUB_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_hub_configs_read_as_the_planners_registry_specs():
    from lightning_moe.policy.registry import resolve_spec

    assert read_spec(HUB_V2_LITE, "deepseek-v2-lite") == resolve_spec("deepseek-v2-lite")
    with pytest.raises(ValueError, match=r"config field 'quantization_config'.* is not implemented by the deepseek_v3"):
        read_spec(HUB_V3, "deepseek-v3")  # the Hub checkpoint is fp8; a bf16 conversion drops the field
    bf16 = {k: v for k, v in HUB_V3.items() if k != "quantization_config"}
    assert read_spec(bf16, "deepseek-v3") == resolve_spec("deepseek-v3")
    # and the same through transformers' config classes
    from transformers import DeepseekV2Config, DeepseekV3Config

    hf2 = DeepseekV2Config(**{k: v for k, v in HUB_V2_LITE.items() if k not in ("architectures", "auto_map")})
    hf3 = DeepseekV3Config(**{k: v for k, v in bf16.items() if k not in ("architectures", "auto_map")})
    assert read_spec(hf2, "deepseek-v2-lite") == resolve_spec("deepseek-v2-lite")
    assert read_spec(hf3, "deepseek-v3") == resolve_spec("deepseek-v3")


def test_registry_totals_and_kv_bytes():
    """Published totals (DeepSeek-V3: 671 B without its 14 B MTP module; GLM-4.5-Air: 106 B) and the latent's bytes."""
    from lightning_moe.policy.registry import resolve_spec

    for name, total_b in (("deepseek-v2-lite", 15.7), ("deepseek-v3", 671), ("glm-4.5-air", 106)):
        assert abs(resolve_spec(name).total_params / 1e9 - total_b) / total_b < 0.01, name
    v3 = resolve_spec("deepseek-v3")
    assert v3.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 and v3.attn_query_elems == 128 * 576
    assert v3.attn_in_params == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * (128 + 128)
    assert resolve_spec("glm-4.5-air").kv_bytes_per_token("bf16") == 46 * 2 * 8 * 128 * 2


def _plan(argv):
    import argparse

    from lightning_moe import plan_cli

    parser = argparse.ArgumentParser(prog="moe-batch")
    plan_cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--hardware", "h200", "--prompt-len", "128", "--gen-len", "64"] + argv)
    return args.func(args)


def test_plan_each_registry_entry(capsys):
    assert _plan(["--model", "deepseek-v2-lite", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB"]) == 0
    out = capsys.readouterr().out
    assert "predicted:" in out and "attention split" in out
    assert _plan(["--model", "glm-4.5-air", "--gpu-memory", "24GiB", "--cpu-memory", "120GiB", "--quant", "int4"]) == 0
    assert "predicted:" in capsys.readouterr().out
    # DeepSeek-V3 does not fit one H200 host (128 GiB) even at int4: the planner says what it needs
    assert _plan(["--model", "deepseek-v3", "--gpu-memory", "139GiB", "--cpu-memory", "120GiB", "--quant", "int4"]) == 2
    assert "moe-batch plan: infeasible: host memory 120.00 GiB < " in capsys.readouterr().err


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_dummy_weights_of_the_registry_shapes_run(name):
    """Benchmark weights (model.weights.dummy_weights) of a registry spec scaled down (q compression with V3) run."""
    from lightning_moe.model.weights import dummy_weights
    from lightning_moe.policy.registry import resolve_spec

    small = dataclasses.replace(resolve_spec(name), vocab_size=64, hidden_size=32, intermediate_size=8, num_layers=2,
                                num_heads=2, num_kv_heads=2, num_experts=16, dense_intermediate_size=16,
                                shared_intermediate_size=8, dense_layers=(0,), kv_lora_rank=8, qk_rope_head_dim=4,
                                head_dim=12, v_head_dim=6, q_lora_rank=4 if name == "deepseek-v3" else 0,
                                router_n_group=4 if name == "deepseek-v3" else 0, router_topk_group=2 if name == "deepseek-v3" else 0)
    w = dummy_weights(small, torch.float32, scale=0.3)
    out = SerialExecutor(w, "cpu").generate([[1, 2, 3], [4]], DecodeSampling(max_new_tokens=3, stop_at_eos=False))
    assert [len(o) for o, _ in out] == [3, 3]


@pytest.mark.parametrize("version", [2, 3])
def test_every_config_field_is_implemented_refused_or_harmless(version, tmp_path):
    from transformers import DeepseekV2Config, DeepseekV3Config

    fam = family_for({"model_type": f"deepseek_v{version}"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys)
    assert not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    cls = DeepseekV2Config if version == 2 else DeepseekV3Config
    fields = set(cls().to_dict())
    path, _ = make_hf_deepseek(tmp_path / "ckpt", version, n_group=4, topk_group=2)
    with open(os.path.join(path, "config.json")) as f:
        fields |= set(json.load(f))
    fields |= set(HUB_V2_LITE if version == 2 else HUB_V3)
    assert sorted(fields - known) == []


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory):
    v2 = dict(topk_method="group_limited_greedy")
    return {v: make_hf_deepseek(tmp_path_factory.mktemp(f"ds{v}_refuse") / "ckpt", v, n_group=4, topk_group=2,
                                **(v2 if v == 2 else {}))[0] for v in (2, 3)}


def _write_config(src: str, dst, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


REFUSED = [  # (version, changes, the field the message names)
    (2, dict(topk_method="noaux_tc"), "topk_method': 'noaux_tc"),
    (2, dict(scoring_func="sigmoid"), "scoring_func': 'sigmoid"),
    (2, dict(norm_topk_prob=True), "norm_topk_prob': True"),
    (2, dict(moe_layer_freq=2), "moe_layer_freq': 2"),
    (2, dict(attention_bias=True), "attention_bias': True"),
    (2, dict(mlp_bias=True), "mlp_bias': True"),
    (2, dict(num_key_value_heads=2), "num_key_value_heads': 2"),
    (2, dict(first_k_dense_replace=3), "first_k_dense_replace': 3"),
    (2, dict(n_shared_experts=0), "n_shared_experts': 0"),
    (2, dict(q_lora_rank=0), "q_lora_rank': 0"),
    (2, dict(qk_rope_head_dim=7), "qk_rope_head_dim': 7"),
    (2, dict(hidden_act="gelu"), "hidden_act': 'gelu"),
    (2, dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope_(parameters|scaling)'"),
    (2, dict(quantization_config={"quant_method": "fp8"}), "quantization_config'"),
    (3, dict(topk_method="greedy"), "topk_method': 'greedy"),
    (3, dict(scoring_func="softmax"), "scoring_func': 'softmax"),
    (3, dict(moe_layer_freq=2), "moe_layer_freq': 2"),
    (3, dict(attention_bias=True), "attention_bias': True"),
    (3, dict(num_key_value_heads=1), "num_key_value_heads': 1"),
    (3, dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}), "quantization_config'"),
]


@pytest.mark.parametrize("version, changes, field", REFUSED, ids=[f"v{v}-{f.split(chr(39))[0]}" for v, _, f in REFUSED])
def test_a_value_that_changes_the_math_is_refused_by_name(ds_dirs, tmp_path, version, changes, field):
    d = _write_config(ds_dirs[version], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         rf"deepseek_v{version} family"):
        MoESpec.from_pretrained_dir(d)


@pytest.mark.parametrize("version, changes, match", [
    (2, dict(n_group=3), r"config field 'n_group': 3 must be an int >= 1 that divides the routed experts "
                         r"\(n_routed_experts=8\)"),
    (2, dict(topk_group=5), r"config field 'topk_group': 5 must be an int in 1..n_group=4"),
    (3, dict(n_group=3), r"config field 'n_group': 3 must be an int >= 1 that divides the routed experts"),
    (3, dict(n_group=8, topk_group=2), r"config fields 'n_group' and 'n_routed_experts': 8 groups of 8 experts hold 1"),
    (3, dict(topk_group=1, num_experts_per_tok=3), r"config fields 'num_experts_per_tok' and 'topk_group': top-3 from "
                                                   r"1 kept groups of 2 experts"),
])
def test_group_limited_routing_numbers_are_checked_by_name(ds_dirs, tmp_path, version, changes, match):
    d = _write_config(ds_dirs[version], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=r"m/config\.json: " + match):
        MoESpec.from_pretrained_dir(d)


def test_harmless_values_are_read_alike(ds_dirs, tmp_path):
    """Training-only and bookkeeping fields change nothing; V2's greedy router ignores n_group / topk_group."""
    base = MoESpec.from_pretrained_dir(ds_dirs[3])
    d = _write_config(ds_dirs[3], tmp_path / "m", ep_size=8, aux_loss_alpha=0.5, seq_aux=False, pretraining_tp=4,
                      attention_dropout=0.3, initializer_range=0.5, output_router_logits=True)
    assert MoESpec.from_pretrained_dir(d) == dataclasses.replace(base, name="m")
    base2 = MoESpec.from_pretrained_dir(_write_config(ds_dirs[2], tmp_path / "g", topk_method="greedy"))
    d2 = _write_config(ds_dirs[2], tmp_path / "g2", topk_method="greedy", n_group=3, topk_group=7)
    assert MoESpec.from_pretrained_dir(d2) == dataclasses.replace(base2, name="g2") and base2.router_n_group == 0


def test_quantized_checkpoint_keeps_every_non_expert_tensor_and_runs(tmp_path):
    """``moe-batch quantize`` through the key map: only the routed experts are packed; the MLA projections (q_a / q_b
    here, no q_proj), the router, its correction bias and the shared experts are kept bit for bit; the quantized
    checkpoint generates with the serial executor."""
    from lightning_moe.model.quantize import quantize_checkpoint
    from lightning_moe.model.quantized import QuantExperts

    path, _ = make_hf_deepseek(tmp_path / "src", 3, n_group=4, topk_group=2, q_lora_rank=12)
    res = quantize_checkpoint(path, str(tmp_path / "q"), experts="int4", group_size=8)
    src, w = load_checkpoint(path, torch.float32), load_checkpoint(res.dst, torch.float32)
    assert w.spec == dataclasses.replace(src.spec, name=w.spec.name)
    assert w.experts[0] is None and all(isinstance(e, QuantExperts) for e in w.experts[1:])
    for a, b in zip(w.layers, src.layers):
        assert a.wq is None and b.wq is None
        for k, t in b.__dict__.items():
            assert (t is None and getattr(a, k) is None) or torch.equal(getattr(a, k), t), k
    out = SerialExecutor(w, "cpu").generate(PROMPTS[:2], DecodeSampling(max_new_tokens=4, stop_at_eos=False))
    assert [len(o) for o, _ in out] == [4, 4]
