"""MoESpec: the architecture numbers of a Mixture-of-Experts decoder.

One frozen dataclass serves both the model math (``model/mixtral.py`` reads its shapes from it) and
the planner (``policy/`` reads byte and FLOP counts from its properties). It is built from a Hugging
Face ``config.json`` through ``transformers.AutoConfig`` (no weights needed), or from the registry
of real configs in ``policy``'s model registry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("mixtral",)


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
    num_shared_experts: int = 0  # always-on shared experts (Qwen2-MoE / DeepSeek; 0 for Mixtral)
    shared_intermediate_size: int = 0  # FFN width of the shared expert(s)
    # -- added for the planner's byte/FLOP counts of non-Mixtral families (all default to "absent") --
    kv_lora_rank: int = 0  # MLA (DeepSeek-V2) compressed KV width per token; 0 = standard GQA attention
    qk_rope_head_dim: int = 0  # MLA decoupled RoPE key width per token (shared by all heads); 0 without MLA
    v_head_dim: int = 0  # value head width when it differs from head_dim (MLA); 0 = head_dim
    num_dense_layers: int = 0  # leading decoder layers with a dense FFN instead of experts (DeepSeek first_k_dense_replace)
    dense_intermediate_size: int = 0  # FFN width of those dense layers

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} outside 1..num_experts={self.num_experts}")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> "MoESpec":
        """The same architecture with a different number of decoder layers (for scaled benchmarks)."""
        return replace(self, num_layers=num_layers, name=f"{self.name}[{num_layers}L]")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: Optional[str] = None) -> "MoESpec":
        """Build from a ``transformers.PretrainedConfig`` (or a plain dict of config.json).

        Raises:
            ValueError: unsupported ``model_type`` or a missing field (the message names it).
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        model_type = get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported yet (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

        def need(key: str) -> Any:
            v = get(key)
            if v is None:
                raise ValueError(f"config field {key!r} is missing")
            return v

        rope_theta = get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
            rope_theta = (get("rope_parameters") or {}).get("rope_theta", 10000.0)
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = get("head_dim") or hidden // heads
        eos = get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            name=name or str(get("_name_or_path") or model_type),
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            num_experts=int(need("num_local_experts")),
            top_k=int(need("num_experts_per_tok")),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            sliding_window=get("sliding_window"),
            norm_topk_prob=True,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str) -> "MoESpec":
        """Read ``path/config.json`` (through transformers' AutoConfig) into a spec.

        Raises:
            FileNotFoundError: no config.json in ``path``.
            ValueError: unsupported model type or missing field (names ``path/config.json``).
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
            raise ValueError(f"{cfg_path}: {e}") from None


def spec_field_names() -> list[str]:
    """Names of MoESpec's fields (for YAML round-trips and error messages)."""
    return [f.name for f in fields(MoESpec)]
