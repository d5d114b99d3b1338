#!/usr/bin/env python3
"""Write an MoE checkpoint with random weights (few layers) in Hugging Face layout, of any family ``run`` executes.

The directory gets ``config.json`` (the family's transformers config class: ``MixtralConfig``, ``Qwen3MoeConfig``,
``OlmoeConfig``, ``Qwen2MoeConfig``, ``DeepseekV2Config``, ``DeepseekV3Config``, ``GptOssConfig``; defaults are the real Mixtral-8x7B dimensions, ``--preset`` takes a registry
model's, only ``num_hidden_layers`` is small), sharded ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json`` under the family's HF key names (the per-expert layout; gpt-oss: transformers'
fused, interleaved one), all in bf16 (``--mxfp4``, gpt-oss only: the experts as the Hub stores them, below), and the
tokenizer files of the embedded tiny model (``tiny-mixtral-v1`` in ``$LIGHTNING_MOE_CACHE``, default
``~/.cache/lightning-moe``; created on first use when missing; its 32000 ids are below every preset's vocabulary),
so ``moe-batch run`` and ``transformers`` both load it.

No transformers model is ever built: the tensor names come from the family's key map and the shapes from its
``dummy_layer`` (on the meta device); tensors are generated one at a time (seeded ``torch.Generator``, N(0, std^2),
norms 1), packed into shards of about ``--shard-gib`` and written shard by shard. ``--device cuda`` generates on the
GPU (faster) and copies each tensor to the host. A 4-layer Mixtral-8x7B-width checkpoint is ~11 GiB.

``--zero-experts``: every routed expert tensor is zeros, left as holes of a sparse file (no disk blocks, no write
time), everything else random. For speed and memory runs of checkpoints larger than the disk (the full 32-layer
Mixtral-8x7B is ~93 GB): the bytes paged, copied and multiplied are the same; the outputs are not meaningful.

``--mxfp4`` (gpt_oss only; refused by name for other families): the routed experts are written as the Hub's gpt-oss
checkpoints hold them, MXFP4 (``kernels.mxfp4``): ``experts.gate_up_proj_blocks`` uint8 [E, 2F, D/32, 16],
``gate_up_proj_scales`` uint8 [E, 2F, D/32], ``down_proj_blocks`` uint8 [E, D, F/32, 16], ``down_proj_scales`` uint8
[E, D, F/32], the biases ``gate_up_proj_bias`` [E, 2F] / ``down_proj_bias`` [E, D] bf16, and config.json gets the Hub's
``quantization_config`` (``quant_method: mxfp4``, ``modules_to_not_convert``). The blocks are uniform random bytes
(every E2M1 code equally likely: values of mean square 8.5625); each E8M0 scale is ``c`` or ``c + 1`` (``c + 1`` with
probability ``p``), ``c`` and ``p`` solved so that the dequantized weights' mean square is ``std^2`` exactly
(``--std`` 0.02: scales 119 / 120, i.e. 127 - 8 / 127 - 7, p ~ 0.69). gpt-oss-120b's experts are then ~4x smaller
(4.25 bits per weight). ``--zero-experts`` with ``--mxfp4``: blocks, scales and biases are holes (zero blocks
dequantize to zeros).

Usage:
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 4 [--device cuda]            # Mixtral-width
  python3 benchmarks/make_checkpoint.py OUT_DIR --preset qwen3-30b-a3b --layers 4      # Qwen3-30B-A3B width
  python3 benchmarks/make_checkpoint.py OUT_DIR --preset deepseek-v2-lite --layers 4   # also deepseek-v3, gpt-oss-*
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 32 --zero-experts              # full size, sparse file
  python3 benchmarks/make_checkpoint.py OUT_DIR --preset gpt-oss-120b --layers 4 --mxfp4  # the Hub's MXFP4 experts
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 2 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

MIXTRAL_8X7B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "experts": 8, "top_k": 2,
                "vocab": 32000, "rope_theta": 1e6, "max_pos": 32768}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json")


@dataclass(frozen=True)
class Dims:
    """Architecture numbers of the checkpoint (defaults: Mixtral-8x7B with 4 layers)."""

    family: str = "mixtral"  # model_type: mixtral, qwen3_moe, olmoe, qwen2_moe, deepseek_v2, deepseek_v3, gpt_oss
    layers: int = 4
    hidden: int = MIXTRAL_8X7B["hidden"]
    intermediate: int = MIXTRAL_8X7B["intermediate"]
    heads: int = MIXTRAL_8X7B["heads"]
    kv_heads: int = MIXTRAL_8X7B["kv_heads"]
    experts: int = MIXTRAL_8X7B["experts"]
    top_k: int = MIXTRAL_8X7B["top_k"]
    vocab: int = MIXTRAL_8X7B["vocab"]
    rope_theta: float = MIXTRAL_8X7B["rope_theta"]
    max_pos: int = MIXTRAL_8X7B["max_pos"]
    hd: int = 0  # per-head width when it is not hidden // heads (Qwen3-MoE); 0 = hidden // heads
    shared: int = 0  # width of the shared expert (qwen2_moe); 0 = none
    dense: int = 0  # width of a dense layer's MLP (config intermediate_size of the Qwen families; 0 = 4 x expert width)
    norm_topk_prob: bool = True  # renormalize the top-k router weights (Qwen / OLMoE config field; Mixtral always)
    # DeepSeek-V2 / V3 (MLA; ``hd`` is qk_nope_head_dim + qk_rope_head_dim, ``intermediate`` moe_intermediate_size,
    # ``dense`` the dense layers' intermediate_size, ``shared`` n_shared * moe_intermediate_size)
    kv_lora: int = 0  # kv_lora_rank
    q_lora: int = 0  # q_lora_rank; 0 = null (one q_proj)
    rope_dim: int = 0  # qk_rope_head_dim
    v_hd: int = 0  # v_head_dim
    n_shared: int = 0  # n_shared_experts
    first_dense: int = 0  # first_k_dense_replace
    n_group: int = 0  # router groups (0: greedy / one group)
    topk_group: int = 0
    routed_scaling: float = 1.0  # routed_scaling_factor
    # gpt-oss
    sliding_window: int = 0  # the sliding_attention layers' window; layer_types alternate sliding / full from layer 0
    swiglu_limit: float = 7.0
    rope: tuple = ()  # rope scaling items ((key, value), ...) without rope_theta; () = the default rope
    mxfp4: bool = False  # gpt_oss only: the experts as MXFP4 blocks / scales (the Hub's layout; module docstring)

    @property
    def head_dim(self) -> int:
        """Per-head width: ``hd``, else hidden // heads."""
        return self.hd or self.hidden // self.heads

    @classmethod
    def from_registry(cls, name: str, layers: int) -> "Dims":
        """The dims of a registry model (``lightning_moe.policy.registry``) with ``layers`` decoder layers."""
        from lightning_moe.policy.registry import resolve_spec

        s = resolve_spec(name)
        if s.model_type not in CONFIG_CLASSES:
            raise ValueError(f"{name}: model_type {s.model_type!r} is not one make_checkpoint writes "
                             f"({', '.join(CONFIG_CLASSES)})")
        rope = ()
        if s.rope_type == "yarn":
            rope = (("rope_type", "yarn"), ("factor", s.rope_factor),
                    ("original_max_position_embeddings", s.rope_original_max_position_embeddings),
                    ("beta_fast", s.rope_beta_fast), ("beta_slow", s.rope_beta_slow))
            if s.kv_lora_rank:  # DeepSeek: attention factor 1 = mscale equal to mscale_all_dim
                rope += (("mscale", s.rope_mscale_all_dim), ("mscale_all_dim", s.rope_mscale_all_dim))
            else:
                rope += (("truncate", s.rope_truncate),)
        elif s.rope_type != "default":
            raise ValueError(f"{name}: rope_type {s.rope_type!r}: make_checkpoint writes default and yarn")
        if s.kv_lora_rank:  # MLA
            first_dense = len(s.dense_layers)
            if s.dense_layers != tuple(range(first_dense)):
                raise ValueError(f"{name}: dense layers {s.dense_layers} are not the first ones")
            return cls(family=s.model_type, layers=layers, hidden=s.hidden_size, intermediate=s.intermediate_size,
                       heads=s.num_heads, kv_heads=s.num_kv_heads, experts=s.num_experts, top_k=s.top_k,
                       vocab=s.vocab_size, rope_theta=s.rope_theta, max_pos=s.max_position_embeddings, hd=s.head_dim,
                       shared=s.shared_intermediate_size * s.num_shared_experts, n_shared=s.num_shared_experts,
                       dense=s.dense_intermediate_size, norm_topk_prob=bool(s.norm_topk_prob), kv_lora=s.kv_lora_rank,
                       q_lora=s.q_lora_rank, rope_dim=s.qk_rope_head_dim, v_hd=s.v_head_dim,
                       first_dense=min(first_dense, layers - 1), n_group=s.router_n_group,
                       topk_group=s.router_topk_group, routed_scaling=s.routed_scaling_factor, rope=rope)
        if s.model_type == "gpt_oss":
            full = tuple(i for i in s.full_attention_layers if i < layers)
            if full != tuple(range(1, layers, 2)):
                raise ValueError(f"{name}: full_attention_layers {s.full_attention_layers} do not alternate")
            return cls(family=s.model_type, layers=layers, hidden=s.hidden_size, intermediate=s.intermediate_size,
                       heads=s.num_heads, kv_heads=s.num_kv_heads, experts=s.num_experts, top_k=s.top_k,
                       vocab=s.vocab_size, rope_theta=s.rope_theta, max_pos=s.max_position_embeddings, hd=s.head_dim,
                       sliding_window=s.sliding_window or 0, swiglu_limit=s.swiglu_limit, rope=rope)
        return cls(family=s.model_type, layers=layers, hidden=s.hidden_size, intermediate=s.intermediate_size,
                   heads=s.num_heads, kv_heads=s.num_kv_heads, experts=s.num_experts, top_k=s.top_k,
                   vocab=s.vocab_size, rope_theta=s.rope_theta, max_pos=s.max_position_embeddings,
                   hd=0 if s.head_dim == s.hidden_size // s.num_heads else s.head_dim,
                   shared=s.shared_intermediate_size * s.num_shared_experts, norm_topk_prob=bool(s.norm_topk_prob))

    def tiny(self) -> "Dims":
        """This family's checkpoint at a tiny width (2 layers, hidden 64, 8 experts top-2; CPU checks): the same
        family and the same kind of each choice (shared experts, a dense first layer, q_lora_rank set or null,
        grouped routing, yarn, sliding / full layers), the tokenizer's 32000 ids (Mixtral / Qwen / OLMoE: the
        width cli_sweep --check-on-cpu always used)."""
        base = dict(family=self.family, layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, experts=8, top_k=2,
                    vocab=32000, rope_theta=self.rope_theta, norm_topk_prob=self.norm_topk_prob)
        rope = tuple((k, 64 if k == "original_max_position_embeddings" else v) for k, v in self.rope)
        if rope:  # max_position_embeddings = factor x original (transformers warns otherwise)
            base["max_pos"] = int(64 * dict(rope)["factor"])
        if self.kv_lora:
            n_group = 4 if self.n_group > 1 else 0
            return Dims(**{**base, "kv_heads": 4, "intermediate": 48}, hd=24, rope_dim=8, v_hd=16, kv_lora=32,
                        q_lora=24 if self.q_lora else 0, n_shared=self.n_shared, shared=48 * self.n_shared, dense=80,
                        first_dense=min(self.first_dense, 1), n_group=n_group, topk_group=2 if n_group else 0,
                        routed_scaling=self.routed_scaling, rope=rope)
        if self.family == "gpt_oss":
            return Dims(**base, hd=16, sliding_window=4, swiglu_limit=self.swiglu_limit, rope=rope, mxfp4=self.mxfp4)
        return Dims(**{**base, "rope_theta": MIXTRAL_8X7B["rope_theta"]}, shared=64 if self.shared else 0)


CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig",
                  "qwen2_moe": "Qwen2MoeConfig", "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config",
                  "gpt_oss": "GptOssConfig"}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


# the Hub's gpt-oss quantization_config (openai/gpt-oss-20b / -120b config.json)
MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def config_dict(d: Dims) -> dict:
    """The config.json content: the family's transformers config ``.to_dict()`` plus top-level ``rope_theta`` /
    ``torch_dtype`` (read by transformers 4 and 5 alike); ``d.mxfp4``: the Hub's ``quantization_config``.
    Raises ValueError: ``mxfp4`` for a family other than gpt_oss, or widths not multiples of 32."""
    import transformers

    if d.mxfp4 and d.family != "gpt_oss":
        raise ValueError(f"mxfp4: MXFP4 experts are gpt_oss's (the Hub's gpt-oss checkpoints), not {d.family}'s")
    if d.mxfp4 and (d.hidden % 32 or d.intermediate % 32):
        raise ValueError(f"mxfp4: hidden {d.hidden} and intermediate {d.intermediate} must be multiples of 32")

    common = dict(vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers,
                  num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, num_experts_per_tok=d.top_k,
                  rope_theta=d.rope_theta, max_position_embeddings=d.max_pos, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if d.family == "mixtral":
        kw = dict(intermediate_size=d.intermediate, head_dim=d.head_dim, num_local_experts=d.experts,
                  sliding_window=None, rms_norm_eps=1e-5)
    elif d.family == "olmoe":  # head_dim is hidden / heads (q_norm is sized by hidden_size)
        if d.hd:
            raise ValueError("olmoe: head_dim is hidden / heads")
        kw = dict(intermediate_size=d.intermediate, num_experts=d.experts, norm_topk_prob=d.norm_topk_prob,
                  clip_qkv=None, rms_norm_eps=1e-5)
    elif d.family in ("qwen3_moe", "qwen2_moe"):
        kw = dict(intermediate_size=d.dense or 4 * d.intermediate, moe_intermediate_size=d.intermediate,
                  num_experts=d.experts, norm_topk_prob=d.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                  rms_norm_eps=1e-6)
        if d.family == "qwen3_moe":
            kw["head_dim"] = d.head_dim
        else:
            if not d.shared:
                raise ValueError("qwen2_moe: the shared expert's width (Dims.shared) must be > 0")
            kw["shared_expert_intermediate_size"] = d.shared
    elif d.family in ("deepseek_v2", "deepseek_v3"):
        if not (d.kv_lora and d.rope_dim and d.v_hd and d.n_shared and d.hd > d.rope_dim):
            raise ValueError(f"{d.family}: kv_lora, rope_dim, v_hd, n_shared and hd > rope_dim must be set")
        if d.kv_heads != d.heads:
            raise ValueError(f"{d.family}: kv_heads must equal heads (MLA)")
        kw = dict(intermediate_size=d.dense or 4 * d.intermediate, moe_intermediate_size=d.intermediate,
                  n_routed_experts=d.experts, n_shared_experts=d.n_shared, first_k_dense_replace=d.first_dense,
                  kv_lora_rank=d.kv_lora, q_lora_rank=d.q_lora or None, qk_nope_head_dim=d.hd - d.rope_dim,
                  qk_rope_head_dim=d.rope_dim, v_head_dim=d.v_hd, n_group=d.n_group or 1,
                  topk_group=d.topk_group or 1, routed_scaling_factor=d.routed_scaling, norm_topk_prob=d.norm_topk_prob,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False)
        if d.family == "deepseek_v2":
            kw["topk_method"] = "group_limited_greedy" if d.n_group > 1 else "greedy"
            if d.norm_topk_prob:
                raise ValueError("deepseek_v2: norm_topk_prob must be False")
        else:
            kw.update(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0)  # MTP: never run
    elif d.family == "gpt_oss":
        if not d.sliding_window:
            raise ValueError("gpt_oss: sliding_window must be > 0")
        kw = dict(intermediate_size=d.intermediate, head_dim=d.head_dim, num_local_experts=d.experts,
                  sliding_window=d.sliding_window, swiglu_limit=d.swiglu_limit, attention_bias=True,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)],
                  rms_norm_eps=1e-5)
    else:
        raise ValueError(f"family {d.family!r}: make_checkpoint writes {', '.join(CONFIG_CLASSES)}")
    if d.rope:
        common["rope_parameters"] = {**dict(d.rope), "rope_theta": d.rope_theta}
        del common["rope_theta"]
    elif d.family in ("deepseek_v2", "deepseek_v3", "gpt_oss"):  # gpt-oss's config class defaults to yarn
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": d.rope_theta}
        del common["rope_theta"]
    cfg = getattr(transformers, CONFIG_CLASSES[d.family])(**common, **kw)
    out = cfg.to_dict()
    out["architectures"] = [ARCHITECTURES[d.family]]
    out["rope_theta"] = d.rope_theta
    out["torch_dtype"] = "bfloat16"
    out["dtype"] = "bfloat16"
    if d.mxfp4:
        out["quantization_config"] = json.loads(json.dumps(MXFP4_QUANTIZATION_CONFIG))
    return out


def tensor_shapes(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in file order: embeddings, layer by layer (its non-expert tensors, then its
    experts w1, w2, w3 each), final norm, lm_head. Names from the family's key map (the first MoE block prefix,
    per-expert layout; gpt-oss: transformers' fused ``experts.gate_up_proj`` [E, D, 2F] (gate / up interleaved),
    ``down_proj`` [E, F, D] and their biases, the only layout its transformers class loads; ``d.mxfp4``: the Hub's
    ``*_blocks`` / ``*_scales`` and the biases, module docstring), shapes from its
    ``dummy_layer`` (the tensors it leaves None, DeepSeek's q_proj or q_a / q_b by q_lora_rank, are not written)."""
    from lightning_moe.model.families import family_of, read_spec

    spec = read_spec(config_dict(d))
    fam, keys = family_of(spec), family_of(spec).keys
    D, F, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    out = [(keys.embed, (V, D))]
    moe = keys.moe_blocks[0]
    for i in range(spec.num_layers):
        lw = fam.dummy_layer(spec, lambda *shape: torch.empty(shape, device="meta"), torch.bfloat16, i)
        dense = spec.is_dense_layer(i)
        names = keys.dense_layer_names(i) if dense else keys.layer_names(i, moe)
        out += [(names[f], tuple(getattr(lw, f).shape)) for f in names if getattr(lw, f, None) is not None]
        if not dense and fam.load_experts is not None and d.mxfp4:  # gpt-oss, the Hub's MXFP4: [E, rows, C/32, 16]
            p, E = keys.layer_prefix(i) + moe + "experts.", spec.num_experts
            out += [(p + "gate_up_proj_blocks", (E, 2 * F, D // 32, 16)), (p + "gate_up_proj_scales", (E, 2 * F, D // 32)),
                    (p + "gate_up_proj_bias", (E, 2 * F)), (p + "down_proj_blocks", (E, D, F // 32, 16)),
                    (p + "down_proj_scales", (E, D, F // 32)), (p + "down_proj_bias", (E, D))]
        elif not dense and fam.load_experts is not None:  # gpt-oss: transformers' fused tensors, gate/up interleaved
            p, E = keys.layer_prefix(i) + moe + "experts.", spec.num_experts
            out += [(p + "gate_up_proj", (E, D, 2 * F)), (p + "gate_up_proj_bias", (E, 2 * F)),
                    (p + "down_proj", (E, F, D)), (p + "down_proj_bias", (E, D))]
        elif not dense:
            for e in range(spec.num_experts):
                out += [(keys.expert_name(i, moe, f, e), shape) for f, shape in (("w1", (F, D)), ("w2", (D, F)),
                                                                                 ("w3", (F, D)))]
    out += [(keys.norm, (D,)), (keys.lm_head, (V, D))]
    return out


def is_expert_tensor(name: str) -> bool:
    """True for a routed expert's weight (the per-expert layout's ``.experts.{e}.``)."""
    return ".experts." in name


def tensor_dtype(name: str) -> torch.dtype:
    """The stored dtype of a tensor: uint8 for MXFP4 ``*_blocks`` / ``*_scales``, else bf16."""
    return torch.uint8 if name.endswith(("_blocks", "_scales")) else torch.bfloat16


def tensor_nbytes(name: str, shape: tuple[int, ...]) -> int:
    """The bytes of tensor ``name`` of ``shape`` in the file (its :func:`tensor_dtype`)."""
    return _numel(shape) * (1 if tensor_dtype(name) == torch.uint8 else 2)


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.uint8: "U8"}


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[int]]:
    """Indices of ``shapes`` per shard: consecutive tensors, a new shard when the next would pass ``shard_bytes``
    (each tensor's bytes in its stored dtype, :func:`tensor_nbytes`)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (name, shape) in enumerate(shapes):
        nbytes = tensor_nbytes(name, shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


FP4_MEAN_SQUARE = 8.5625  # mean of the 16 E2M1 values squared (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)


def mxfp4_scale_choice(std: float) -> tuple[int, float]:
    """(c, p): E8M0 scales ``c`` or ``c + 1`` (``c + 1`` with probability p) give uniform random E2M1 codes a mean
    square of ``std^2``: ``4^(c - 127) * (1 + 3p) * 8.5625 = std^2``, c clamped to [1, 253]."""
    x = math.log(std * std / FP4_MEAN_SQUARE, 4)
    c = math.floor(x)
    p = (4 ** (x - c) - 1) / 3
    c += 127
    if not 1 <= c <= 253:
        c, p = min(max(c, 1), 253), 0.5
    return c, p


def make_tensor(name: str, shape: tuple[int, ...], index: int, seed: int, std: float, device: str) -> torch.Tensor:
    """One host tensor from a generator seeded with seed + index (the same bytes whatever the sharding; cpu and cuda
    generators give different numbers): bf16 ones for norm weights, MXFP4 ``*_blocks`` uniform random uint8,
    ``*_scales`` uint8 ``c`` or ``c + 1`` (:func:`mxfp4_scale_choice`: dequantized std ``std``), else bf16 N(0, std^2)."""
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed + index)
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8).cpu()
    if name.endswith("_scales"):
        c, p = mxfp4_scale_choice(std)
        up = torch.rand(shape, generator=g, device=device) < p
        return (up.to(torch.uint8) + c).cpu()
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    t = t.mul_(std).to(torch.bfloat16)
    return t.cpu() if t.device.type != "cpu" else t


def save_shard(path: str, names: list[str], shapes: list[tuple[int, ...]], make, zero) -> int:
    """Write one safetensors file (the format: 8-byte little-endian header size, the JSON header, the data), each
    tensor in its :func:`tensor_dtype` (bf16, or uint8 MXFP4 blocks / scales); tensor ``i`` is ``make(i)``, or, where ``zero(i)``, a hole of the sparse file (reads as zeros). Returns the
    data bytes. ``safetensors.torch.save_file`` needs every tensor in memory and writes every byte; this writes
    one tensor at a time and skips the zeros."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n, shape in zip(names, shapes):
        nbytes = tensor_nbytes(n, shape)
        header[n] = {"dtype": SAFETENSORS_DTYPES[tensor_dtype(n)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for i, (n, shape) in enumerate(zip(names, shapes)):
            if zero(i):
                f.seek(tensor_nbytes(n, shape), os.SEEK_CUR)
            else:
                t = make(i).contiguous()
                if t.dtype != tensor_dtype(n) or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{n}: made {t.dtype} {tuple(t.shape)}, expected {tensor_dtype(n)} {tuple(shape)}")
                f.write((t if t.dtype == torch.uint8 else t.view(torch.int16)).numpy().tobytes())
        f.truncate(8 + len(h) + off)
    return off


def tiny_tokenizer_dir() -> str:
    """The embedded tiny model's directory (``$LIGHTNING_MOE_CACHE``/tiny-mixtral-v1), created when missing."""
    from lightning_moe.model.tiny import default_cache_dir, ensure_tiny_mixtral

    path = os.path.join(default_cache_dir(), "tiny-mixtral-v1")
    if os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(os.path.join(path, "tokenizer.model")):
        return path
    return ensure_tiny_mixtral()


def copy_tokenizer(dst: str, src: str | None = None) -> list[str]:
    """Copy the tokenizer files of ``src`` (default: the tiny model's directory) into ``dst``; returns their names."""
    src = src or tiny_tokenizer_dir()
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy(p, os.path.join(dst, name))
            copied.append(name)
    if not copied:
        raise FileNotFoundError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return copied


def write_checkpoint(out_dir: str, dims: Dims, shard_gib: float = 3.0, seed: int = 0, std: float = 0.02,
                     device: str = "cpu", log=sys.stderr, zero_experts: bool = False) -> dict:
    """Write the checkpoint into ``out_dir`` (created; must be empty or absent); ``zero_experts``: routed expert
    tensors are zeros, holes of sparse files. Returns ``{"path", "bytes", "seconds", "shards", "tensors",
    "tokenizer_files", "zero_bytes"}``; ``bytes`` counts the safetensors data, ``zero_bytes`` its holes."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not empty")
    tok_src = tiny_tokenizer_dir()  # before any weight is written (its tokenizer needs mistral-common)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict(dims), f, indent=2)
    shapes = tensor_shapes(dims)
    shards = plan_shards(shapes, int(shard_gib * 2**30))
    weight_map, total, zero_bytes = {}, 0, 0
    for k, idx in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        zero = [zero_experts and is_expert_tensor(shapes[i][0]) for i in idx]
        nbytes = save_shard(os.path.join(out_dir, fname), [shapes[i][0] for i in idx], [shapes[i][1] for i in idx],
                            lambda j: make_tensor(shapes[idx[j]][0], shapes[idx[j]][1], idx[j], seed, std, device),
                            lambda j: zero[j])
        total += nbytes
        zero_bytes += sum(tensor_nbytes(*shapes[i]) for i, z in zip(idx, zero) if z)
        weight_map.update({shapes[i][0]: fname for i in idx})
        print(f"  {fname}: {nbytes / 2**30:.2f} GiB, {time.perf_counter() - t0:.1f} s", file=log, flush=True)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    tok = copy_tokenizer(out_dir, tok_src)
    if device != "cpu":
        torch.cuda.empty_cache()  # the caller may go on to run capped jobs in subprocesses
    return {"path": out_dir, "bytes": total, "seconds": time.perf_counter() - t0, "shards": len(shards),
            "tensors": len(shapes), "tokenizer_files": tok, "zero_bytes": zero_bytes}


def build_parser() -> argparse.ArgumentParser:
    d = Dims()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("out", help="output directory (created; must be empty or absent)")
    p.add_argument("--preset", default=None, help="a registry model's dims (e.g. qwen3-30b-a3b, olmoe-1b-7b, "
                   "qwen1.5-moe-a2.7b, mixtral-8x7b, deepseek-v2-lite, deepseek-v3, gpt-oss-20b, gpt-oss-120b); "
                   "--layers still applies; the other size flags are refused beside it")
    p.add_argument("--zero-experts", action="store_true", help="routed experts are zeros: holes of sparse files")
    p.add_argument("--mxfp4", action="store_true", help="gpt_oss only: the experts as the Hub's MXFP4 blocks / scales "
                   "(bf16 biases, quantization_config mxfp4; scales give the dequantized weights std --std)")
    p.add_argument("--layers", type=int, default=d.layers, help=f"num_hidden_layers (default {d.layers})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden_size (default {d.hidden})")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help=f"expert intermediate_size (default {d.intermediate})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help=f"key/value heads (default {d.kv_heads})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"experts per layer (default {d.experts})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"experts per token (default {d.top_k})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab}; the tokenizer has 32000)")
    p.add_argument("--max-pos", type=int, default=d.max_pos, help=f"max_position_embeddings (default {d.max_pos})")
    p.add_argument("--shard-gib", type=float, default=3.0, help="target shard size in GiB (default 3)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (tensor i uses seed + i)")
    p.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights (default 0.02)")
    p.add_argument("--device", default="cpu", help="where random numbers are generated: cpu or cuda (default cpu)")
    return p


SIZE_FLAGS = ("hidden", "intermediate", "heads", "kv_heads", "experts", "top_k", "vocab", "max_pos")  # = Dims fields


def dims_from_args(a: argparse.Namespace) -> Dims:
    """Dims from parsed command-line arguments (``--mxfp4``: gpt_oss only, ValueError naming the family else)."""
    if a.preset:  # a preset sets every size but --layers: a size flag beside it would be silently ignored
        given = [f"--{f.replace('_', '-')}" for f in SIZE_FLAGS if getattr(a, f) != getattr(Dims(), f)]
        if given:
            raise ValueError(f"{', '.join(given)}: not with --preset {a.preset} (a preset sets every size but "
                             f"--layers)")
    d = Dims.from_registry(a.preset, a.layers) if a.preset else Dims(layers=a.layers, hidden=a.hidden,
                                                                    intermediate=a.intermediate, heads=a.heads,
                                                                    kv_heads=a.kv_heads, experts=a.experts,
                                                                    top_k=a.top_k, vocab=a.vocab, max_pos=a.max_pos)
    if getattr(a, "mxfp4", False):
        if d.family != "gpt_oss":
            raise ValueError(f"--mxfp4: MXFP4 experts are gpt_oss's (the Hub's gpt-oss checkpoints), not family "
                             f"{d.family}'s ({'--preset ' + a.preset if a.preset else 'the default dimensions'}); "
                             f"use --preset gpt-oss-20b or --preset gpt-oss-120b")
        d = dataclasses.replace(d, mxfp4=True)
    return d


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        dims = dims_from_args(a)
    except ValueError as e:
        parser.error(str(e))
    res = write_checkpoint(a.out, dims, a.shard_gib, a.seed, a.std, a.device, zero_experts=a.zero_experts)
    print(f"wrote {res['path']}: {res['bytes']:,} bytes ({res['bytes'] / 2**30:.2f} GiB) in {res['shards']} shards, "
          f"{res['tensors']} tensors ({res['zero_bytes'] / 2**30:.2f} GiB of zeros as holes), {res['seconds']:.1f} s ({res['bytes'] / 2**30 / max(res['seconds'], 1e-9):.2f} GiB/s); "
          f"tokenizer: {', '.join(res['tokenizer_files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
