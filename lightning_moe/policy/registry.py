"""Registry of real MoE configurations as numbers (no downloads), and ``resolve_spec``.

Each entry copies the fields of the model's Hugging Face ``config.json`` that matter for bytes and FLOPs
(the config file named in the comment). Non-Mixtral families use MoESpec's optional fields: shared
experts (Qwen1.5-MoE, DeepSeek, GLM-4.5), MLA attention and leading dense layers (DeepSeek), the DeepSeek-V3 router
(DeepSeek-V3, GLM-4.5-Air). The model code (``model/``) runs only the families of ``model/families/`` (not dbrx,
glm4_moe); these specs are for the planner.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from ..model.spec import MoESpec

REGISTRY: dict[str, MoESpec] = {
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": MoESpec(
        name="mixtral-8x7b", model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None, bos_token_id=1, eos_token_id=2,
    ),
    # mistralai/Mixtral-8x22B-v0.1 config.json
    "mixtral-8x22b": MoESpec(
        name="mixtral-8x22b", model_type="mixtral", vocab_size=32000, hidden_size=6144, intermediate_size=16384,
        num_layers=56, num_heads=48, num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=65536, sliding_window=None, bos_token_id=1, eos_token_id=2,
    ),
    # databricks/dbrx-base config.json: d_model 6144, n_heads 48, kv_n_heads 8, n_layers 40, ffn_hidden_size
    # 10752, moe_num_experts 16, moe_top_k 4, vocab 100352, rope_theta 5e5 (LayerNorm without bias ~ RMSNorm bytes)
    "dbrx": MoESpec(
        name="dbrx", model_type="dbrx", vocab_size=100352, hidden_size=6144, intermediate_size=10752,
        num_layers=40, num_heads=48, num_kv_heads=8, head_dim=128, num_experts=16, top_k=4, rope_theta=5e5,
        rms_norm_eps=1e-5, max_position_embeddings=32768, norm_topk_prob=True, bos_token_id=None, eos_token_id=100257,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B config.json: moe_intermediate_size 1408, shared_expert_intermediate_size 5632,
    # 60 experts top-4, norm_topk_prob false
    "qwen1.5-moe-a2.7b": MoESpec(
        name="qwen1.5-moe-a2.7b", model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=1408,
        num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, num_experts=60, top_k=4, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=8192, norm_topk_prob=False, bos_token_id=151643, eos_token_id=151643,
        num_shared_experts=1, shared_intermediate_size=5632,
    ),
    # Qwen/Qwen3-30B-A3B config.json: head_dim 128 (q_size 4096 > hidden 2048), moe_intermediate_size 768,
    # 128 experts top-8, norm_topk_prob true, no shared expert
    "qwen3-30b-a3b": MoESpec(
        name="qwen3-30b-a3b", model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=768,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=40960, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645,
    ),
    # Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 64 heads over 4 KV heads of 128, 128 experts top-8
    # of width 1536, norm_topk_prob true, no shared expert, no dense layer
    "qwen3-235b-a22b": MoESpec(
        name="qwen3-235b-a22b", model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=1536,
        num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=40960, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645,
    ),
    # deepseek-ai/DeepSeek-V2-Lite config.json: MLA (q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128), 64 routed experts top-6 of width 1408 (topk_method greedy,
    # routed_scaling_factor 1.0, norm_topk_prob false), 2 shared experts, first_k_dense_replace 1 with
    # intermediate_size 10944, rope_scaling yarn (factor 40, original_max_position_embeddings 4096, beta 32 / 1,
    # mscale = mscale_all_dim = 0.707: attention factor 1, softmax scale x (0.1 * 0.707 * ln 40 + 1)^2)
    "deepseek-v2-lite": MoESpec(
        name="deepseek-v2-lite", model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=1408,
        num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192, num_experts=64, top_k=6, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position_embeddings=163840, norm_topk_prob=False, bos_token_id=100000, eos_token_id=100001,
        num_shared_experts=2, shared_intermediate_size=1408,
        kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, dense_layers=(0,), dense_intermediate_size=10944,
        rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096, rope_attention_factor=1.0,
        rope_mscale_all_dim=0.707, rope_interleave=True, router_scoring="softmax", routed_scaling_factor=1.0,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (its fp8 quantization_config aside: a bf16 conversion's numbers): MLA with
    # q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; 256 routed experts top-8 of width 2048,
    # sigmoid router (noaux_tc: n_group 8, topk_group 4, norm_topk_prob true, routed_scaling_factor 2.5), 1 shared
    # expert, first_k_dense_replace 3 with intermediate_size 18432, 1 multi-token-prediction layer (not run),
    # rope_scaling yarn (factor 40, original 4096, mscale = mscale_all_dim = 1.0)
    "deepseek-v3": MoESpec(
        name="deepseek-v3", model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=2048,
        num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192, num_experts=256, top_k=8, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position_embeddings=163840, norm_topk_prob=True, bos_token_id=0, eos_token_id=1,
        num_shared_experts=1, shared_intermediate_size=2048,
        kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, dense_layers=(0, 1, 2), dense_intermediate_size=18432,
        q_lora_rank=1536, rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096,
        rope_attention_factor=1.0, rope_mscale_all_dim=1.0, rope_interleave=True, router_scoring="sigmoid",
        router_n_group=8, router_topk_group=4, routed_scaling_factor=2.5, num_mtp_layers=1,
    ),
    # zai-org/GLM-4.5-Air config.json (model_type glm4_moe: planned, not run here): GQA 96 query / 8 KV heads of 128
    # (partial rotary 0.5 and q/k/v biases, neither counted in bytes), 128 routed experts top-8 of width 1408 behind
    # transformers' Glm4MoeTopkRouter, which is DeepSeek-V3's (sigmoid, e_score_correction_bias; n_group 1, topk_group
    # 1, norm_topk_prob true, routed_scaling_factor 1.0), 1 shared expert, first_k_dense_replace 1 with
    # intermediate_size 10944, 1 multi-token-prediction layer
    "glm-4.5-air": MoESpec(
        name="glm-4.5-air", model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=1408,
        num_layers=46, num_heads=96, num_kv_heads=8, head_dim=128, num_experts=128, top_k=8, rope_theta=1e6,
        rms_norm_eps=1e-5, max_position_embeddings=131072, norm_topk_prob=True, bos_token_id=None, eos_token_id=151329,
        num_shared_experts=1, shared_intermediate_size=1408, dense_layers=(0,), dense_intermediate_size=10944,
        router_scoring="sigmoid", router_n_group=1, router_topk_group=1, routed_scaling_factor=1.0, num_mtp_layers=1,
    ),
    # allenai/OLMoE-1B-7B-0924 config.json: 64 experts top-8 of width 1024, norm_topk_prob false
    "olmoe-1b-7b": MoESpec(
        name="olmoe-1b-7b", model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128, num_experts=64, top_k=8, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=4096, norm_topk_prob=False, bos_token_id=None, eos_token_id=50279,
    ),
    # openai/gpt-oss-20b config.json: 24 layers alternating sliding_attention (window 128) and full_attention, GQA 64
    # query / 8 KV heads of 64 (q_size 4096 > hidden 2880), q/k/v/o biases and per-head attention sinks (vectors, not
    # counted in bytes), 32 experts top-4 of width 2880 with biases and the clamped SwiGLU (swiglu_limit 7.0), router
    # with bias (top-k, then softmax over the k), rope_scaling yarn (factor 32 over 4096, beta 32 / 1, truncate
    # false), rope_theta 150000. Its experts are MXFP4 on the Hub (4.25 bits per weight), kept packed by the loader:
    # planned as "mxfp4" pages (EXPERT_FORMATS) unless --quant says otherwise; the "-bf16" aliases plan the model dtype
    "gpt-oss-20b": MoESpec(
        name="gpt-oss-20b", model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, num_experts=32, top_k=4, rope_theta=150000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=128, norm_topk_prob=True,
        bos_token_id=None, eos_token_id=200002, rope_type="yarn", rope_factor=32.0,
        rope_original_max_position_embeddings=4096, rope_truncate=False, rope_attention_factor=0.1 * math.log(32.0) + 1,
        full_attention_layers=tuple(range(1, 24, 2)), attention_sinks=True, swiglu_limit=7.0, expert_bias=True,
    ),
}
# openai/gpt-oss-120b config.json: gpt-oss-20b's with 36 layers and 128 experts
REGISTRY["gpt-oss-120b"] = dataclasses.replace(REGISTRY["gpt-oss-20b"], name="gpt-oss-120b", num_layers=36,
                                               num_experts=128, full_attention_layers=tuple(range(1, 36, 2)))
ALIASES = {
    "mixtral-8x7b-instruct": "mixtral-8x7b", "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x22b-v0.1": "mixtral-8x22b",
    "dbrx-base": "dbrx", "dbrx-instruct": "dbrx", "qwen1.5-moe": "qwen1.5-moe-a2.7b", "qwen3-30b": "qwen3-30b-a3b",
    "qwen3-235b": "qwen3-235b-a22b",
    "deepseek-v2-lite-chat": "deepseek-v2-lite", "deepseek-v3-base": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3",
    "glm-4.5-air-base": "glm-4.5-air", "olmoe": "olmoe-1b-7b", "olmoe-1b-7b-0924": "olmoe-1b-7b",
    "gpt-oss-20b-bf16": "gpt-oss-20b", "gpt-oss-120b-bf16": "gpt-oss-120b",
}


# registry entries whose Hub checkpoints store the experts in a packed format the executors compute packed
EXPERT_FORMATS = {"gpt-oss-20b": "mxfp4", "gpt-oss-120b": "mxfp4"}


def registry_expert_format(name: str) -> Optional[str]:
    """The expert page format a registry name's Hub checkpoint holds ("mxfp4" for gpt-oss-20b / -120b and their repo
    ids), None for the others, for aliases that name another format (``gpt-oss-120b-bf16``) and for directories."""
    if os.path.isdir(name):
        return None
    return EXPERT_FORMATS.get(name.lower().rsplit("/", 1)[-1])


def resolve_spec(name_or_dir: str) -> MoESpec:
    """A MoESpec from a registry name (case-insensitive, aliases, HF repo ids like ``mistralai/Mixtral-8x7B-v0.1``) or a
    checkpoint directory with config.json (the embedded ``tiny-mixtral``: pass its directory,
    ``model.tiny.resolve_model_path``).

    Raises ValueError naming the registry when the name is unknown and no such directory exists;
    errors of MoESpec.from_pretrained_dir pass through.
    """
    if os.path.isdir(name_or_dir):
        return MoESpec.from_pretrained_dir(name_or_dir)
    key = name_or_dir.lower().rsplit("/", 1)[-1]
    key = ALIASES.get(key, key)
    if key in REGISTRY:
        return REGISTRY[key]
    raise ValueError(f"unknown model {name_or_dir!r}: not a checkpoint directory and not in the registry "
                     f"({', '.join(REGISTRY)})")
