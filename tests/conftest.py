"""Shared fixtures: small random Mixtral checkpoints saved in HF format by transformers itself."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def make_hf_mixtral(path, *, layers=2, experts=4, top_k=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=128,
                    max_pos=256, sliding_window=None, seed=0, shard="20KB", hidden_act="silu"):
    """Save a random MixtralForCausalLM with save_pretrained (sharded safetensors); return (path, model)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=max_pos, sliding_window=sliding_window,
                        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act=hidden_act)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default init so routing and tokens are not degenerate
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "gate" in n and "experts" not in n else p.shape[-1] ** -0.5)
    model.save_pretrained(str(path), max_shard_size=shard)
    return str(path), model


@pytest.fixture(scope="session")
def hf_mixtral(tmp_path_factory):
    """(checkpoint dir, transformers model) for a 2-layer, 4-expert, top-2, GQA Mixtral in fp32."""
    return make_hf_mixtral(tmp_path_factory.mktemp("hf_mixtral") / "ckpt")


@pytest.fixture(scope="session")
def hf_mixtral_gelu(tmp_path_factory):
    """(checkpoint dir, transformers model) as hf_mixtral with GELU-gated experts (MixtralConfig hidden_act="gelu")."""
    return make_hf_mixtral(tmp_path_factory.mktemp("hf_mixtral_gelu") / "ckpt", hidden_act="gelu", seed=3)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The embedded tiny-mixtral, created in a temporary cache directory."""
    from lightning_moe.model.tiny import ensure_tiny_mixtral

    if os.environ.get("LIGHTNING_MOE_CACHE"):  # a prepared cache (e.g. carried to a GPU host without mistral-common)
        return ensure_tiny_mixtral()
    return ensure_tiny_mixtral(str(tmp_path_factory.mktemp("cache")))


FIXED_CPU_PROFILE = dict(  # a CPU profile with fixed rates for tests (policy.cpu_hrm), so no test measures this host
    name="cpu-test", machine="test machine", cpu_model="test CPU", cpu_cores=2, threads=2, torch_version="test",
    host_memory=64 * 2**30, memory_bandwidth=10e9, matmul_flops_fp32=50e9, matmul_flops_bf16=0.0, gemm_call=5e-6,
    op_call=3e-6, view_call=1e-6, glue_call=2e-6, attention_call=2e-5, nonzero_call=1e-5, argmax_rate=1e9, sample_rate=2e8, record_write=1e-3,
    scatter_bandwidth=2e9)


@pytest.fixture(autouse=True)
def fixed_cpu_profile(tmp_path_factory, monkeypatch):
    """Every test's CPU jobs predict with FIXED_CPU_PROFILE ($LIGHTNING_MOE_CPU_PROFILE), not a measurement of this
    host written to the user's cache (tests of the cache delete the variable)."""
    from lightning_moe.policy.cpu_hrm import CpuProfile

    path = tmp_path_factory.getbasetemp() / "cpu-test-profile.yaml"
    if not path.exists():
        CpuProfile(**FIXED_CPU_PROFILE).save(str(path))
    monkeypatch.setenv("LIGHTNING_MOE_CPU_PROFILE", str(path))
    return str(path)


@pytest.fixture(autouse=True)
def no_solve_cache(monkeypatch):
    """Every test's plans solve every MILP ($LIGHTNING_MOE_SOLVE_CACHE off), as before the solve cache: nothing is
    written to the user's cache and no answer carries over between tests (tests of the cache set it)."""
    monkeypatch.setenv("LIGHTNING_MOE_SOLVE_CACHE", "off")
