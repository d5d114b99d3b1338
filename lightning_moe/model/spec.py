"""MoESpec: the architecture numbers of a Mixture-of-Experts decoder.

One frozen dataclass serves both the model math (each family in ``model/families/`` reads its shapes from it)
and the planner (``policy/`` reads byte and FLOP counts from its properties). It is built from a Hugging
Face ``config.json`` through ``transformers.AutoConfig`` (no weights needed) by the model family's config reader
(``model.families.read_spec``; this module imports nothing of the model at import time), or from the registry
of real configs in ``policy``'s model registry.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

# ---- byte sizes used by MoESpec's byte properties (planner) ------------------------------------------
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}  # itemsize per float dtype name
# Group-wise integer expert formats: name -> bits of (gate, up, down). "int2-up" follows FloE (up_proj to
# INT2); its gate/down stay INT4 here because FloE's activation-sparsity compression of gate/down does
# not reduce the bytes a dense page carries.
QUANT_FORMATS = {"int4": (4, 4, 4), "int2": (2, 2, 2), "int2-up": (4, 2, 4)}
QUANT_GROUP = 128  # elements per quantization group, along a projection's input dimension
QUANT_GROUP_META_BYTES = 4  # fp16 scale + fp16 zero point per group
ROPE_TYPES = ("default", "linear", "yarn")  # RoPE frequency variants the model math implements (layers.rope_inv_freq)
# packed formats of a family's own checkpoints that the executors compute packed (no dequantized scratch): gpt-oss's
# MXFP4 (E2M1 values with one E8M0 scale per 32: 17 bytes per 32 weights; the expert biases stored fp32 in the page:
# kernels.mxfp4.mxfp4_page_layout as model/families/gpt_oss.py builds it)
PACKED_FORMATS = ("mxfp4",)
MXFP4_BIAS_BYTES = 4  # the page's biases are fp32 (lossless for any checkpoint dtype)
EXPERT_PAGE_ALIGN = 4096  # bytes; each expert page is padded to a multiple of this (one page size per model)


def dtype_bytes(dtype: str) -> int:
    """Itemsize in bytes of a float dtype name ("bf16"/"bfloat16", "fp16"/"float16", "fp32"/"float32").

    Raises ValueError for any other name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})") from None


def _quant_proj_bytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes of one [out, in] projection quantized to ``bits`` with groups of QUANT_GROUP along ``in``."""
    packed = -(-out_features * in_features * bits // 8)
    groups = out_features * -(-in_features // QUANT_GROUP)
    return packed + groups * QUANT_GROUP_META_BYTES


@dataclass(frozen=True)
class MoESpec:
    """Architecture of an MoE decoder-only LM (Mixtral family first).

    All sizes are element counts, not bytes. Byte counts for a dtype are derived properties/methods.
    """

    name: str  # human-readable model name (registry key or checkpoint directory name)
    model_type: str  # HF model_type, e.g. "mixtral"
    vocab_size: int  # number of token ids (rows of embed_tokens / lm_head)
    hidden_size: int  # d_model
    intermediate_size: int  # per-expert FFN width (rows of w1/w3)
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA groups); num_heads % num_kv_heads == 0
    head_dim: int  # per-head width; usually hidden_size // num_heads
    num_experts: int  # routed experts per layer
    top_k: int  # experts each token is routed to
    rope_theta: float  # RoPE base frequency
    rms_norm_eps: float  # RMSNorm epsilon
    max_position_embeddings: int  # model context length in tokens
    sliding_window: Optional[int] = None  # attention window in tokens (None = full causal)
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum 1 (Mixtral: always)
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    bos_token_id: Optional[int] = 1  # beginning-of-sequence id from the config
    eos_token_id: Optional[int] = 2  # end-of-sequence id from the config
    num_shared_experts: int = 0  # always-on shared experts of every MoE layer (Qwen2-MoE 1, DeepSeek-V2 2; Mixtral 0),
    #   non-expert weights: resident on the compute device with the layer's other weights, never paged
    shared_intermediate_size: int = 0  # FFN width of each shared expert
    # -- added for the planner's byte/FLOP counts of non-Mixtral families (all default to "absent") --
    kv_lora_rank: int = 0  # MLA (DeepSeek-V2) compressed KV width per token; 0 = standard GQA attention
    qk_rope_head_dim: int = 0  # MLA decoupled RoPE key width per token (shared by all heads); 0 without MLA
    v_head_dim: int = 0  # value head width when it differs from head_dim (MLA); 0 = head_dim
    dense_layers: tuple[int, ...] = ()  # ascending indices of the decoder layers whose FFN is one dense MLP instead of
    #   routed experts (DeepSeek first_k_dense_replace: the leading ones; Qwen2/3-MoE mlp_only_layers and
    #   decoder_sparse_step); resident non-expert weights, nothing of them is paged
    dense_intermediate_size: int = 0  # FFN width of those dense layers' MLP (0 without dense layers)
    # -- RoPE scaling (config.json rope_parameters / rope_scaling, read by the family; layers.rope_inv_freq) --
    rope_type: str = "default"  # RoPE frequencies: "default", "linear" (divided by rope_factor) or "yarn" (YaRN blend)
    rope_factor: float = 1.0  # context extension factor of "linear" and "yarn" (1.0 for "default")
    rope_original_max_position_embeddings: int = 0  # "yarn": pretraining context of the correction range; 0 otherwise
    rope_beta_fast: float = 32.0  # "yarn": rotations below which a dim is extrapolated (kept unscaled)
    rope_beta_slow: float = 1.0  # "yarn": rotations above which a dim is interpolated (divided by rope_factor)
    rope_truncate: bool = True  # "yarn": floor / ceil the correction range's ends to whole dims
    rope_attention_factor: float = 1.0  # multiplies cos and sin ("yarn": attention_factor or its mscale formula)
    # -- model math of some families (no bytes or FLOPs) --
    clip_qkv: Optional[float] = None  # q, k, v projections clamped to [-clip_qkv, clip_qkv] (OLMoE); None = not
    # -- DeepSeek-V2/V3 (MLA attention, grouped / biased routers; read by model/families/deepseek_v2.py) --
    q_lora_rank: int = 0  # MLA query compression width (q_a_proj -> RMSNorm -> q_b_proj); 0 = one q_proj
    rope_interleave: bool = False  # RoPE over interleaved pairs (x0, x1), (x2, x3), ... instead of rotate-half
    rope_mscale_all_dim: float = 0.0  # yarn's mscale_all_dim as MLA reads it: the softmax scale is multiplied by
    #   (0.1 mscale_all_dim ln(rope_factor) + 1)^2 (:attr:`softmax_scale`); 0 = not
    router_scoring: str = "softmax"  # "softmax" (Mixtral ... DeepSeek-V2) or "sigmoid" (DeepSeek-V3 / GLM-4.5: scores
    #   + e_score_correction_bias choose, the unbiased scores weigh)
    router_n_group: int = 0  # expert groups of a group-limited router (V2 group_limited_greedy, V3); 0 = no groups
    router_topk_group: int = 0  # groups kept per token (with router_n_group)
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this (DeepSeek)
    num_mtp_layers: int = 0  # multi-token-prediction layers after the decoder layers in the checkpoint
    #   (num_nextn_predict_layers): never loaded, never run, no bytes
    # -- gpt-oss (read by model/families/gpt_oss.py; model math, no bytes or FLOPs) --
    full_attention_layers: tuple[int, ...] = ()  # layers that attend to the whole causal context although
    #   sliding_window is set (gpt-oss layer_types "full_attention"); () = sliding_window holds in every layer
    attention_sinks: bool = False  # one learned logit per query head joins each softmax and is dropped (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: the experts' clamped SwiGLU (gpt-oss: gate <= limit, |up| <= limit,
    #   (up + 1) * gate * sigmoid(swiglu_alpha * gate)); 0 = plain SwiGLU
    swiglu_alpha: float = 1.702  # the clamped SwiGLU's sigmoid gain (with swiglu_limit)
    expert_bias: bool = False  # routed experts carry biases (gate, up, down; gpt-oss); vectors, not counted in bytes

    def __post_init__(self) -> None:
        dense = tuple(sorted({int(i) for i in self.dense_layers}))
        if any(not 0 <= i < self.num_layers for i in dense):
            raise ValueError(f"{self.name}: dense_layers={self.dense_layers} outside 0..num_layers-1={self.num_layers - 1}")
        object.__setattr__(self, "dense_layers", dense)  # a list from a caller becomes a sorted tuple
        full = tuple(sorted({int(i) for i in self.full_attention_layers}))
        if any(not 0 <= i < self.num_layers for i in full):
            raise ValueError(f"{self.name}: full_attention_layers={self.full_attention_layers} outside "
                             f"0..num_layers-1={self.num_layers - 1}")
        object.__setattr__(self, "full_attention_layers", full)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} outside 1..num_experts={self.num_experts}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"{self.name}: rope_type={self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{self.name}: router_scoring={self.router_scoring!r} is not softmax or sigmoid")
        if self.router_n_group and (self.num_experts % self.router_n_group
                                    or not 1 <= self.router_topk_group <= self.router_n_group):
            raise ValueError(f"{self.name}: router_n_group={self.router_n_group} must divide num_experts="
                             f"{self.num_experts}, router_topk_group={self.router_topk_group} in 1..router_n_group")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates per head: qk_rope_head_dim with MLA (the decoupled rope part), else head_dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the per-head query/key dims without RoPE (head_dim - qk_rope_head_dim); 0 without MLA."""
        return self.head_dim - self.qk_rope_head_dim if self.is_mla else 0

    @property
    def softmax_scale(self) -> float:
        """Attention logits scale: ``head_dim ** -0.5``, times ``mscale ** 2`` with ``mscale = 0.1 *
        rope_mscale_all_dim * ln(rope_factor) + 1`` when rope_mscale_all_dim is set, rope is scaled and rope_factor
        > 1 (transformers' DeepSeek ``yarn_apply_mscale``, same float operations)."""
        scale = self.head_dim ** (-0.5)
        if self.rope_mscale_all_dim and self.rope_type != "default" and self.rope_factor > 1:
            mscale = 0.1 * self.rope_mscale_all_dim * math.log(self.rope_factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def layer_sliding_window(self, layer: int) -> Optional[int]:
        """The attention window of decoder layer ``layer``: ``sliding_window``, or None (full causal attention) when
        the spec has none or the layer is one of ``full_attention_layers``."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def with_layers(self, num_layers: int) -> "MoESpec":
        """The same architecture with a different number of decoder layers (for scaled benchmarks)."""
        return replace(self, num_layers=num_layers, name=f"{self.name}[{num_layers}L]",
                       full_attention_layers=tuple(i for i in self.full_attention_layers if i < num_layers))

    # ---- bytes and FLOPs (planner; added by the policy helper) -----------------------------------
    # Element counts are exact for the weights each family has; vectors smaller than one hidden row per
    # layer (attention biases of Qwen1.5, q/k norms of Qwen3/OLMoE, the shared-expert gate, MLA's
    # kv_a_layernorm) are left out: together they are < 0.01 % of any registered model.

    @property
    def num_dense_layers(self) -> int:
        """Decoder layers whose FFN is a dense MLP: len(dense_layers)."""
        return len(self.dense_layers)

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers whose FFN is routed experts: num_layers - num_dense_layers."""
        return self.num_layers - self.num_dense_layers

    def is_dense_layer(self, layer: int) -> bool:
        """True when decoder layer ``layer``'s FFN is a dense MLP (no routed experts, no router, no shared expert)."""
        return layer in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Ascending indices of the decoder layers whose FFN is routed experts."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def value_head_dim(self) -> int:
        """Per-head value width: v_head_dim when set (MLA), else head_dim."""
        return self.v_head_dim or self.head_dim

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2): the KV cache holds the compressed latent."""
        return self.kv_lora_rank > 0

    @property
    def expert_params(self) -> int:
        """Elements of one routed expert: gate [F, D] + up [F, D] + down [D, F] = 3 * D * F."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_bytes(self, quant: str = "bf16") -> int:
        """Bytes of one routed expert as stored in a page, padded to EXPERT_PAGE_ALIGN.

        quant: a float dtype ("bf16", "fp16", "fp32") or a group-wise integer format (see QUANT_FORMATS):
        per projection [out, in], ``out * in * bits / 8`` packed bytes + ``out * ceil(in / 128)`` groups x
        (fp16 scale + fp16 zero) = 4 bytes per group; groups run along the input dimension. The sum of
        the three projections is rounded up to a multiple of EXPERT_PAGE_ALIGN so every expert page has
        one size (CommitMoE's padded quantization pages; DESIGN.md "kernels/quant.py").
        "mxfp4" (gpt-oss's MXFP4 pages, PACKED_FORMATS): per projection [out, in] ``out * in / 2`` block bytes +
        ``out * in / 32`` E8M0 scales (4.25 bits per weight), plus the biases (2F + D fp32), each of the six
        segments rounded up to 16 bytes -- the bytes of ``kernels.mxfp4.mxfp4_page_layout(D, F, torch.float32)``.
        Raises ValueError for an unknown format.
        """
        D, F = self.hidden_size, self.intermediate_size
        if quant == "mxfp4":
            segs = (2 * F * D // 2, 2 * F * D // 32, D * F // 2, D * F // 32, 2 * F * MXFP4_BIAS_BYTES,
                    D * MXFP4_BIAS_BYTES)  # gate_up blocks, scales; down blocks, scales; biases
            raw = sum(-(-s // 16) * 16 for s in segs)
            return -(-raw // EXPERT_PAGE_ALIGN) * EXPERT_PAGE_ALIGN
        if quant in DTYPE_BYTES:
            raw = 3 * D * F * DTYPE_BYTES[quant]
        elif quant in QUANT_FORMATS:
            g_bits, u_bits, d_bits = QUANT_FORMATS[quant]
            raw = (
                _quant_proj_bytes(F, D, g_bits)  # gate [F, D]
                + _quant_proj_bytes(F, D, u_bits)  # up [F, D]
                + _quant_proj_bytes(D, F, d_bits)  # down [D, F]
            )
        else:
            raise ValueError(f"unknown weight format {quant!r} (known: "
                             f"{', '.join(list(DTYPE_BYTES) + list(QUANT_FORMATS) + list(PACKED_FORMATS))})")
        return -(-raw // EXPERT_PAGE_ALIGN) * EXPERT_PAGE_ALIGN

    def layer_expert_bytes(self, quant: str = "bf16") -> int:
        """Bytes of all routed experts of one MoE layer: num_experts * expert_bytes(quant)."""
        return self.num_experts * self.expert_bytes(quant)

    def total_expert_bytes(self, quant: str = "bf16") -> int:
        """Bytes of all routed experts of the model: num_moe_layers * num_experts * expert_bytes(quant)."""
        return self.num_moe_layers * self.layer_expert_bytes(quant)

    @property
    def attn_in_params(self) -> int:
        """Elements of the projections before attention (per layer).

        GQA: wq [Hq*hd, D] + wk, wv [Hkv*hd, D]. MLA: q_proj [Hq*hd, D] (with q_lora_rank r: q_a_proj [r, D] +
        q_b_proj [Hq*hd, r]) + kv_a_proj [(kv_lora + rope), D] + kv_b_proj [Hq*(hd - rope + v_hd), kv_lora].
        """
        D = self.hidden_size
        if self.is_mla:
            nope = self.head_dim - self.qk_rope_head_dim
            q = self.q_lora_rank * (D + self.q_size) if self.q_lora_rank else D * self.q_size
            return (
                q
                + D * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank * self.num_heads * (nope + self.value_head_dim)
            )
        return D * (self.q_size + 2 * self.kv_size)

    @property
    def attn_out_params(self) -> int:
        """Elements of the output projection wo [D, Hq * v_hd] (per layer)."""
        return self.hidden_size * self.num_heads * self.value_head_dim

    @property
    def shared_expert_params(self) -> int:
        """Elements of the always-on shared experts of one MoE layer: num_shared_experts * 3 * D * shared_intermediate_size.

        shared_intermediate_size is read as the width of EACH shared expert (Qwen1.5-MoE: 1 x 5632;
        DeepSeek-V2-Lite: 2 x 1408).
        """
        return self.num_shared_experts * 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def dense_ffn_params(self) -> int:
        """Elements of the dense SwiGLU FFN of a dense layer: 3 * D * dense_intermediate_size."""
        return 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def router_params(self) -> int:
        """Elements of the router of one MoE layer: [E, D]."""
        return self.num_experts * self.hidden_size

    def layer_non_expert_params(self, layer: int) -> int:
        """Elements of layer ``layer`` that are not routed experts (always GPU-resident).

        attention projections + 2 RMSNorm vectors + (MoE layer: router + shared experts | dense layer: dense FFN).
        """
        base = self.attn_in_params + self.attn_out_params + 2 * self.hidden_size
        if self.is_dense_layer(layer):
            return base + self.dense_ffn_params
        return base + self.router_params + self.shared_expert_params

    @property
    def non_expert_params(self) -> int:
        """Elements of everything but routed experts: embeddings, lm_head (unless tied), final norm, all layers."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (
            self.vocab_size * self.hidden_size
            + head
            + self.hidden_size
            + sum(self.layer_non_expert_params(i) for i in range(self.num_layers))
        )

    def non_expert_bytes(self, dtype: str = "bf16") -> int:
        """Bytes of the non-expert weights in ``dtype`` (they stay on the GPU in the model dtype)."""
        return self.non_expert_params * dtype_bytes(dtype)

    def layer_bytes(self, layer: int, dtype: str = "bf16", quant: Optional[str] = None) -> int:
        """Bytes of decoder layer ``layer``: non-expert part in ``dtype`` + its routed experts in ``quant`` (default dtype)."""
        experts = 0 if self.is_dense_layer(layer) else self.layer_expert_bytes(quant or dtype)
        return self.layer_non_expert_params(layer) * dtype_bytes(dtype) + experts

    def total_bytes(self, dtype: str = "bf16", quant: Optional[str] = None) -> int:
        """Bytes of the whole model: non-expert weights in ``dtype`` + routed experts in ``quant`` (default dtype)."""
        return self.non_expert_bytes(dtype) + self.total_expert_bytes(quant or dtype)

    @property
    def total_params(self) -> int:
        """All weight elements (Mixtral-8x7B: 46.70e9)."""
        return self.non_expert_params + self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def kv_elems_per_token(self) -> int:
        """KV-cache elements per token per layer: GQA 2 * Hkv * hd (K and V); MLA kv_lora_rank + qk_rope_head_dim."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_size

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """KV-cache bytes per token summed over all layers: num_layers * kv_elems_per_token * itemsize."""
        return self.num_layers * self.kv_elems_per_token * dtype_bytes(dtype)

    @property
    def attn_query_elems(self) -> int:
        """Elements of one token's attention query as the attention kernel consumes it.

        GQA: Hq * hd. MLA decode (weights absorbed): Hq * (kv_lora_rank + qk_rope_head_dim).
        """
        if self.is_mla:
            return self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.q_size

    @property
    def attn_output_elems(self) -> int:
        """Elements of one token's attention output before wo: GQA Hq * v_hd; MLA decode Hq * kv_lora_rank."""
        if self.is_mla:
            return self.num_heads * self.kv_lora_rank
        return self.num_heads * self.value_head_dim

    @property
    def attn_flops_per_position(self) -> int:
        """Decode attention FLOPs per query token per attended position (one layer).

        GQA: QK^T 2 * Hq * hd + PV 2 * Hq * v_hd. MLA (absorbed): 2 * Hq * (kv_lora + rope) + 2 * Hq * kv_lora.
        Softmax is not counted (O(Hq) per position).
        """
        if self.is_mla:
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_heads * (self.head_dim + self.value_head_dim)

    @property
    def prefill_attn_flops_per_position(self) -> int:
        """Prefill attention FLOPs per (query, key) pair (one layer, not absorbed): 2 * Hq * (hd + v_hd)."""
        return 2 * self.num_heads * (self.head_dim + self.value_head_dim)

    def flops_per_token(self, context: int) -> int:
        """Forward FLOPs of one token attending to ``context`` positions, all layers + lm_head.

        2 * (active parameters: attention + router + top_k experts + shared/dense FFN + lm_head)
        + num_layers * context * attn_flops_per_position. (Kaplan et al. 2020's 2N rule plus attention.)
        """
        per_layer = 0
        for i in range(self.num_layers):
            p = self.attn_in_params + self.attn_out_params
            if self.is_dense_layer(i):
                p += self.dense_ffn_params
            else:
                p += self.router_params + self.shared_expert_params + self.top_k * self.expert_params
            per_layer += 2 * p
        return per_layer + 2 * self.vocab_size * self.hidden_size + self.num_layers * context * self.attn_flops_per_position

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: Optional[str] = None) -> "MoESpec":
        """Build from a ``transformers.PretrainedConfig`` (or a plain dict of config.json) by its model family's
        reader (``model.families.read_spec``: the family is chosen by ``model_type``).

        Raises:
            ValueError: unsupported ``model_type``, a missing field, or a value the family refuses (the message
                names it).
        """
        from .families import read_spec

        return read_spec(cfg, name)

    @classmethod
    def from_pretrained_dir(cls, path: str) -> "MoESpec":
        """Read ``path/config.json`` (through transformers' AutoConfig) into a spec.

        Raises:
            FileNotFoundError: no config.json in ``path``.
            ValueError: unsupported model type, a missing field or a value the model family refuses (names
                ``path/config.json`` and the field).
        """
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path}: no config.json (is {path!r} a Hugging Face checkpoint directory?)")
        with open(cfg_path) as f:
            raw = json.load(f)
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(path)
        except Exception:  # an architecture transformers does not know: fall back to the raw dict
            cfg = raw
        try:
            return cls.from_hf_config(cfg, name=os.path.basename(os.path.normpath(path)))
        except ValueError as e:
            msg = str(e)
            if cfg is not raw and "rope_parameters" not in raw and raw.get("rope_scaling"):
                # transformers moved the file's legacy rope_scaling into rope_parameters: name the field as written
                msg = msg.replace("config field 'rope_parameters'", "config field 'rope_scaling'")
            raise ValueError(f"{cfg_path}: {msg}") from None
