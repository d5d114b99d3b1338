"""What a model family is: :class:`Family` (config reader, checkpoint key map, layer math) and its parts.

A family is data plus plain functions, no class hierarchy: ``families/<name>.py`` defines its functions and one
``FAMILY = Family(...)``; ``families/__init__.py`` lists it. Everything outside ``model/families/`` reaches a
family through the registry (``family_for(config)``, ``family_of(spec)``), never by module name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

import torch

from ...kernels.fused_moe import experts_ffn_reference_from
from .. import layers as L

if TYPE_CHECKING:
    from ..spec import MoESpec


class ConfigView:
    """A model's config read by key: a plain dict (config.json) or a ``transformers.PretrainedConfig``."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value, ``default`` when absent."""
        if isinstance(self.cfg, Mapping):
            return self.cfg.get(key, default)
        return getattr(self.cfg, key, default)

    def need(self, key: str) -> Any:
        """The field's value; ValueError naming it when it is missing (or null)."""
        v = self.get(key)
        if v is None:
            raise ValueError(f"config field {key!r} is missing")
        return v


def refuse(key: str, value: Any, family: str, implemented: str, what: str = "") -> ValueError:
    """The error for a config field whose value changes the math in a way ``family`` does not implement (``what``:
    which part of the field's value, e.g. ``"rope_type "``)."""
    return ValueError(f"config field {key!r}: {what}{value!r} is not implemented by the {family} family "
                      f"(implemented: {implemented})")


# Keys a rope_parameters / rope_scaling mapping may hold, per rope_type (transformers' _validate_<type>_rope_parameters:
# required and optional keys; "type" is the legacy name of "rope_type")
_ROPE_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
ROPE_KEYS = {
    "default": _ROPE_COMMON_KEYS,
    "linear": _ROPE_COMMON_KEYS + ("factor",),
    "yarn": _ROPE_COMMON_KEYS + ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                                 "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1; transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _read_rope_mapping(key: str, rp: Mapping, c: ConfigView, family: str, default_theta: float,
                       max_position_embeddings: int) -> dict[str, Any]:
    """MoESpec's rope fields of one rope mapping (config field ``key``), as transformers reads it."""
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise refuse(key, rope_type, family, ", ".join(repr(t) for t in ROPE_KEYS), what="rope_type ")
    for k in rp:
        if k not in ROPE_KEYS[rope_type]:
            raise refuse(key, k, family, ", ".join(ROPE_KEYS[rope_type]), what=f"rope_type {rope_type!r} key ")
    prf = rp.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise refuse(key, prf, family, "1.0 (RoPE over the whole head)", what="partial_rotary_factor ")
    theta = rp.get("rope_theta")
    if theta is None:  # older configs: top level (transformers moves it into the mapping), else the config class's
        theta = c.get("rope_theta")
    out: dict[str, Any] = {"rope_theta": float(default_theta if theta is None else theta), "rope_type": rope_type}
    if rope_type == "default":
        return out
    if "factor" not in rp or (rope_type == "linear" and rp["factor"] is None):
        raise ValueError(f"config field {key!r}: rope_type {rope_type!r} needs its 'factor'")
    factor = rp["factor"]
    if rope_type == "linear":
        return {**out, "rope_factor": float(factor)}
    # yarn (transformers' _compute_yarn_parameters): a top-level original_max_position_embeddings wins over the
    # mapping's (standardize_rope_params), which defaults to max_position_embeddings
    orig = c.get("original_max_position_embeddings")
    if orig is None:
        orig = rp.get("original_max_position_embeddings")
    orig = int(max_position_embeddings if orig is None else orig)
    if factor is None:  # DeepSeek-V3 style: the factor is the context ratio
        factor = max_position_embeddings / orig
    factor = float(factor)
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return {**out, "rope_factor": factor, "rope_original_max_position_embeddings": orig,
            "rope_beta_fast": float(rp.get("beta_fast") or 32), "rope_beta_slow": float(rp.get("beta_slow") or 1),
            "rope_truncate": bool(rp.get("truncate", True)), "rope_attention_factor": float(attention_factor)}


def decoder_fields(c: ConfigView, name: Optional[str], family: str, *, default_theta: float, default_max_pos: int,
                   default_eps: float) -> dict[str, Any]:
    """MoESpec fields every GQA family reads alike from its config: name and model_type, vocabulary, hidden size,
    layers, heads and KV heads, ``head_dim`` (the config's, else hidden / heads), top-k, rope (:func:`read_rope`),
    ``rms_norm_eps``, ``max_position_embeddings``, tied embeddings, BOS and EOS (the first of an EOS list).
    Defaults are the family's config class's. Raises ValueError naming a missing field."""
    get, need = c.get, c.need
    model_type = get("model_type") or family  # a config found by its architectures alone
    max_pos = int(get("max_position_embeddings", default_max_pos))
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    eos = get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return dict(
        name=name or str(get("_name_or_path") or model_type), model_type=model_type,
        vocab_size=int(need("vocab_size")), hidden_size=hidden, num_layers=int(need("num_hidden_layers")),
        num_heads=heads, num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or hidden // heads), top_k=int(need("num_experts_per_tok")),
        **read_rope(c, family, default_theta, max_pos),  # rope_theta, rope_type and its parameters
        rms_norm_eps=float(get("rms_norm_eps", default_eps)), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)), bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
    )


def read_rope(c: ConfigView, family: str, default_theta: float, max_position_embeddings: int) -> dict[str, Any]:
    """MoESpec's rope fields (``rope_theta``, ``rope_type``, ``rope_factor``, the yarn ones) of a config, as
    transformers 5 reads it: the legacy ``rope_scaling`` mapping (``type`` or ``rope_type``; Hub config.json files)
    when set, else ``rope_parameters``; ``rope_theta`` from the mapping, else the top level, else the config class's
    ``default_theta``; yarn's attention factor resolved from ``attention_factor`` / ``mscale`` / ``mscale_all_dim``.

    Raises:
        ValueError naming the field: a rope_type other than default, linear, yarn; a key the type does not read;
            ``partial_rotary_factor`` != 1 (top level or in the mapping); a missing ``factor``; ``rope_scaling`` and
            ``rope_parameters`` that both are set and disagree.
    """
    prf = c.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise refuse("partial_rotary_factor", prf, family, "1.0 (RoPE over the whole head)")
    read = {}
    # a transformers config holds the legacy mapping in rope_parameters (its rope_scaling is an alias of it)
    for key in ("rope_scaling", "rope_parameters") if isinstance(c.cfg, Mapping) else ("rope_parameters",):
        rp = c.get(key)
        if rp is None:
            continue
        if not isinstance(rp, Mapping):
            raise refuse(key, rp, family, "a mapping with rope_type (or type) and its parameters")
        if rp:
            read[key] = _read_rope_mapping(key, rp, c, family, default_theta, max_position_embeddings)
    if len(read) == 2 and read["rope_scaling"] != read["rope_parameters"]:
        raise ValueError(f"config fields 'rope_scaling' and 'rope_parameters' disagree: {c.get('rope_scaling')!r} "
                         f"vs {c.get('rope_parameters')!r}")
    if read:
        return next(iter(read.values()))  # rope_scaling first, as transformers' convert_rope_params_to_dict
    return _read_rope_mapping("rope_parameters", {}, c, family, default_theta, max_position_embeddings)


# ---- config fields every family handles alike (a family's sets are these plus its own) -----------------------------
# what read_rope reads
ROPE_CONFIG_KEYS = frozenset({
    "rope_parameters", "rope_scaling",  # rope_type default, linear, yarn (transformers 5 / older names)
    "rope_theta",  # older configs: top level; transformers 5: in rope_parameters
    "partial_rotary_factor",  # not a config class field (transformers moves a top-level one into rope_parameters): 1 only
    "original_max_position_embeddings",  # older top-level name (wins over rope_parameters' for yarn, as in transformers)
})
# what decoder_fields reads
DECODER_KEYS = ROPE_CONFIG_KEYS | {
    "model_type", "_name_or_path", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts_per_tok", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
}
# fields of every family's config class with no effect on inference (training, bookkeeping)
HARMLESS_COMMON_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache",
    "pad_token_id",  # the embedding's padding_idx: gradients and init only
    "attention_dropout",  # dropout: training only
    "output_router_logits",  # the auxiliary loss: training only
})
QUANTIZED_REFUSED_KEYS = frozenset({"quantization_config"})  # a transformers-quantized checkpoint (GPTQ, AWQ, FP8, ...)


def check_act_and_refused(get: Callable[..., Any], family: str, hidden_acts: tuple[str, ...],
                          refused_keys: Iterable[str] = QUANTIZED_REFUSED_KEYS) -> None:
    """Refuse, by name, a ``hidden_act`` outside ``hidden_acts`` (default silu) and any of ``refused_keys`` that is
    set (a transformers-quantized checkpoint)."""
    act = get("hidden_act", "silu")
    if act not in hidden_acts:
        raise refuse("hidden_act", act, family, ", ".join(repr(a) for a in hidden_acts))
    for key in refused_keys:
        if get(key) is not None:
            raise refuse(key, get(key), family, "unquantized checkpoints and moe-batch quantize's packed pages")


def check_no_attention_bias(get: Callable[..., Any], family: str) -> None:
    """Refuse, by name, ``attention_bias`` true (the family's q/k/v/o projections have no bias)."""
    if get("attention_bias", False):
        raise refuse("attention_bias", get("attention_bias"), family, "False (q/k/v/o projections without bias)")


# ---- checkpoint names every Hugging Face decoder shares ------------------------------------------------------------
# KeyMap's model-level names (embed, final norm, lm_head, layer prefix)
HF_MODEL_KEYS = dict(embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
                     layer="model.layers.{layer}.")
# a LayerWeights field -> name: the layer's two norms and its q/k/v/o projections (no bias)
HF_ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}
# KeyMap's expert names of the Qwen / OLMoE layout: per expert gate/up/down_proj, or transformers 5's fused
# gate_up_proj [E, 2F, D] (gate rows first, then up: *Experts.chunk(2)) and down_proj [E, D, F]
HF_EXPERT_KEYS = dict(
    expert_tensors={"w1": "{moe}experts.{expert}.gate_proj.weight", "w3": "{moe}experts.{expert}.up_proj.weight",
                    "w2": "{moe}experts.{expert}.down_proj.weight"},
    fused_gate_up="{moe}experts.gate_up_proj", fused_down="{moe}experts.down_proj",
)


def tensors_to(weights: Any, device, dtype: Optional[torch.dtype] = None, keep_fp32: Iterable[str] = ()) -> Any:
    """A copy of a weights dataclass with every tensor on ``device`` (and ``dtype`` when given; the fields named in
    ``keep_fp32`` in fp32); None fields stay None. A family's ``LayerWeights.to``."""
    keep = frozenset(keep_fp32)
    out = {}
    for f in fields(weights):
        t = getattr(weights, f.name)
        if t is not None:
            t = t.to(device=device, dtype=torch.float32 if f.name in keep else (dtype or t.dtype))
        out[f.name] = t
    return type(weights)(**out)


@dataclass
class QKVWeights:
    """The first weights of a GQA decoder layer (HF layout [out_features, in_features], host or device tensors): a
    family's LayerWeights extends it with the rest of its layer, in checkpoint order."""

    attn_norm: torch.Tensor  # [D] input_layernorm
    wq: torch.Tensor  # [Hq*hd, D] self_attn.q_proj
    wk: torch.Tensor  # [Hkv*hd, D] self_attn.k_proj
    wv: torch.Tensor  # [Hkv*hd, D] self_attn.v_proj

    to = tensors_to  # (device, dtype=None) -> a copy on device


@dataclass(frozen=True)
class KeyMap:
    """Checkpoint tensor names of a family (Hugging Face names).

    ``{layer}`` and ``{expert}`` are filled in; ``{moe}`` is the layer's MoE block prefix: the first of
    ``moe_blocks`` under which ``moe_probe`` exists (else the last), so one family reads every layout its
    checkpoints come in. Names of ``layer_tensors``, ``dense_layer_tensors`` and ``expert_tensors`` follow the layer
    prefix.
    """

    embed: str  # token embedding [V, D]
    norm: str  # final norm [D]
    lm_head: str  # output projection [V, D] (absent when tied: MoESpec.tie_word_embeddings)
    layer: str  # prefix of decoder layer {layer}
    moe_blocks: tuple[str, ...]  # MoE block prefixes after the layer prefix, in the order tried
    moe_probe: str  # a tensor under the MoE block that tells which prefix a checkpoint uses
    layer_tensors: Mapping[str, str]  # field of the family's LayerWeights -> name (may contain {moe})
    expert_tensors: Mapping[str, str]  # ExpertWeights field (w1, w3, w2) -> per-expert name ({moe}, {expert})
    fused_gate_up: str = ""  # transformers-5 fused layout: gate|up of all experts [E, 2F, D] ({moe}); "" = none
    fused_down: str = ""  # ... and down [E, D, F]
    dense_layer_tensors: Mapping[str, str] = field(default_factory=dict)  # field of the family's DenseLayerWeights ->
    #   name, for the dense (MLP-only) layers of MoESpec.dense_layers; empty: the family has none
    optional_tensors: frozenset[str] = frozenset()  # fields of layer_tensors / dense_layer_tensors a checkpoint may
    #   lack (left at their dataclass default, None: DeepSeek's q_proj or q_a/q_b by q_lora_rank); the rest must exist

    def layer_prefix(self, layer: int) -> str:
        """Prefix of every tensor of decoder layer ``layer``."""
        return self.layer.format(layer=layer)

    def moe_prefix(self, has: Callable[[str], bool], layer: int) -> str:
        """The MoE block prefix (after the layer prefix) layer ``layer`` of a checkpoint uses (``has(name)``:
        whether the checkpoint holds a tensor)."""
        p = self.layer_prefix(layer)
        for block in self.moe_blocks[:-1]:
            if has(p + block + self.moe_probe):
                return block
        return self.moe_blocks[-1]

    def layer_names(self, layer: int, moe: str) -> dict[str, str]:
        """LayerWeights field -> full tensor name for layer ``layer`` with MoE block prefix ``moe``."""
        p = self.layer_prefix(layer)
        return {f: p + n.format(moe=moe) for f, n in self.layer_tensors.items()}

    def dense_layer_names(self, layer: int) -> dict[str, str]:
        """DenseLayerWeights field -> full tensor name for dense layer ``layer``."""
        p = self.layer_prefix(layer)
        return {f: p + n for f, n in self.dense_layer_tensors.items()}

    def expert_name(self, layer: int, moe: str, field: str, expert: int) -> str:
        """Full tensor name of ExpertWeights field ``field`` of expert ``expert``."""
        return self.layer_prefix(layer) + self.expert_tensors[field].format(moe=moe, expert=expert)


@dataclass(frozen=True, eq=False)  # a family is an identity: compared and hashed as an object
class Family:
    """One model family: how its config is read, where its tensors are, and its layer math.

    The math fields hold plain functions (shape comments in the family module); the executors call them in this
    order per layer: ``pre_attention`` -> ``prefill_attention_packed`` (prefill) or decode attention (the
    executors' KV caches and CPU kernels implement the ``attention`` variant; ``decode_attention`` is its torch
    reference) -> ``post_attention(..., ffn)`` with ``ffn`` = ``experts_ffn`` or the executor's own expert FFN
    (which must compute ``expert_activation``); after the last layer ``final_logits``. A dense layer
    (``MoESpec.dense_layers``) holds a ``dense_layer_weights``; its ``post_attention`` computes the layer's MLP and
    never calls ``ffn`` (the executors page nothing for it and pass no experts).
    """

    name: str  # family name, e.g. "mixtral"
    model_types: tuple[str, ...]  # HF config.json ``model_type`` values this family reads
    architectures: tuple[str, ...]  # HF ``architectures`` entries (used when a config has no model_type)
    # ---- config: config.json -> MoESpec ---------------------------------------------------------------
    read_spec: Callable[[ConfigView, Optional[str]], "MoESpec"]  # (config, name) -> MoESpec; raises ValueError
    #   naming the field for a missing one and for every value that changes the math and is not implemented
    implemented_keys: frozenset[str]  # config fields read_spec (or the loader) reads (some values refused)
    refused_keys: frozenset[str]  # fields refused whenever present
    harmless_keys: frozenset[str]  # fields with no effect on inference (training, bookkeeping)
    # ---- checkpoint ------------------------------------------------------------------------------------
    keys: KeyMap  # tensor names
    layer_weights: type  # dataclass of one MoE layer's non-expert weights; fields = keys.layer_tensors; has .to()
    dummy_layer: Callable  # (spec, rnd(*shape) -> tensor, dtype, layer) -> layer ``layer``'s weights (layer_weights,
    #   or dense_layer_weights for a dense layer), deterministic order
    # ---- layer math: the family's own pieces ------------------------------------------------------------
    pre_attention: Callable  # (lw, x [T, D], positions [T], spec, inv_freq, rope=None) -> q, k, v
    post_attention: Callable  # (lw, ew, x, attn, spec, ffn) -> layer output [T, D] (a dense layer: ew, ffn unused)
    # ---- layer math every family shares unless it says otherwise (model/layers.py) ---------------------
    rope_inv_freq: Callable = L.rope_inv_freq  # (spec, device) -> fp32 [hd/2] (spec.rope_type's frequencies)
    rope_cos_sin: Callable = L.rope_cos_sin  # (spec, positions [T], inv_freq, dtype) -> (cos, sin) [T, hd]
    #   (x spec.rope_attention_factor)
    prefill_packed_layout: Callable = L.prefill_packed_layout  # (spans, T, device) -> index tensors for
    #   prefill_attention_packed
    prefill_attention_packed: Callable = L.prefill_attention_packed  # (q, k, v, spans, sliding_window, layout=None)
    #   -> [T, Hq*hd]
    decode_attention: Callable = L.decode_attention  # (q [B, Hq, hd], K, V [B, Hkv, S, hd], lengths [B],
    #   sliding_window) -> [B, Hq*hd]
    decode_attention_masked: Callable = L.decode_attention_masked  # (q, K, V, masked bool [B, 1, 1, S]) -> [B, Hq*hd]:
    #   decode_attention with the mask layers.decode_mask(lengths, S, sliding_window) made by the caller (CGOPipe's
    #   GPU-attention micro-batches make it once per decode step); bit for bit decode_attention. A family that
    #   replaces decode_attention replaces this one too
    experts_ffn: Callable = L.experts_ffn  # (x [T, D], ExpertWeights, topk_w [T, k], topk_ids [T, k]) -> [T, D]
    #   (reference)
    experts_ffn_from: Callable = experts_ffn_reference_from  # (x, get_expert(e) -> (w1, w3, w2), E, topk_w,
    #   topk_ids) -> [T, D] (reference)
    final_logits: Callable = L.final_logits  # (x [T, D], norm_w, lm_head, eps) -> fp32 [T, V]; when it is a
    #   model-dtype head's output cast to fp32 and nothing more, it names that head in its ``model_dtype_logits``
    #   attribute (layers.model_dtype_head), which the scoring head reads before the cast; a family whose head does
    #   more after the GEMM (a soft-cap, a scale) leaves it unset
    attention: str = "gqa"  # attention variant: "gqa" (grouped-query over a per-head K/V cache), "gqa_sinks" (the
    #   same cache, per-head attention sinks: below) or "mla" (below)
    expert_activation: str = "silu"  # the gate activation inside experts_ffn (fused kernels check they compute it)
    load_experts: Optional[Callable] = None  # (reader, prefix of the layer's MoE block, spec, dtype) -> ExpertWeights:
    #   a family whose checkpoints store experts in a layout of its own (gpt-oss: interleaved gate/up, biases, MXFP4
    #   blocks); None: the key map's per-expert or fused tensors. With packed_expert_layout, also called with
    #   packed=True (load_checkpoint(packed_experts=True)): a packed layer then reads as a model.quantized.QuantExperts
    packed_expert_layout: Optional[Callable] = None  # (reader, MoE prefix, spec, dtype) -> the page layout of a layer
    #   the checkpoint stores packed in a format of the family's own (gpt-oss: MXFP4), else None
    dense_layer_weights: Optional[type] = None  # dataclass of a dense (MLP-only) layer's weights; fields =
    #   keys.dense_layer_tensors; has .to(); None: the family has no dense layers (read_spec gives none)
    # ---- attention "gqa_sinks" (gpt-oss): the GQA K/V cache, and functions that take the layer's weights (its
    #   per-head sink logits): prefill_attention_packed(lw, q, k, v, spans, sliding_window, layout=None) -> [T, Hq*hd];
    #   decode_attention(lw, q [B, Hq, hd], K, V [B, Hkv, S, hd], lengths [B], sliding_window) -> [B, Hq*hd]
    #   and decode_attention_masked(lw, q, K, V, masked bool [B, 1, 1, S]) -> [B, Hq*hd]
    # ---- attention "mla" (multi-head latent attention, DeepSeek): the variant's own signatures ---------------
    #   pre_attention -> (q [T, Hq, hd], c [T, kv_lora], k_pe [T, rope]); the KV cache holds [c, k_pe] per token;
    #   prefill_attention_packed(lw, q, c, k_pe, spans, spec, layout=None) -> [T, Hq*v_hd];
    #   decode_attention(lw, q, cache [B, S, kv_lora + rope], lengths, spec) -> [B, Hq*v_hd] (the torch reference of
    #   the three below, which the executors compose across devices)
    mla_absorb: Optional[Callable] = None  # (lw, q [B, Hq, hd], spec) -> q over the latent [B, Hq, kv_lora + rope]
    latent_attention: Optional[Callable] = None  # (q_lat, cache [B, S, kv_lora + rope], lengths [B], spec) ->
    #   attention-weighted latents [B, Hq, kv_lora]
    mla_unabsorb: Optional[Callable] = None  # (lw, o_lat [B, Hq, kv_lora], spec) -> [B, Hq*v_hd]


# a family module's names for the Family fields that are not named alike (module_fields)
_MODULE_NAMES = {"NAME": "name", "IMPLEMENTED_KEYS": "implemented_keys", "REFUSED_KEYS": "refused_keys",
                 "HARMLESS_KEYS": "harmless_keys", "KEYS": "keys", "LayerWeights": "layer_weights",
                 "DenseLayerWeights": "dense_layer_weights"}


def module_fields(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The Family fields a family module defines, read from its ``globals()``: ``NAME``, ``IMPLEMENTED_KEYS``,
    ``REFUSED_KEYS``, ``HARMLESS_KEYS``, ``KEYS``, ``LayerWeights`` (and ``DenseLayerWeights`` when it has dense
    layers), and every function named as a Family field (``read_spec``, ``dummy_layer``, ``pre_attention``,
    ``post_attention``; a module's own ``decode_attention``, ``experts_ffn``, ... replace the ``layers.py``
    defaults). The one seam of a family module: ``FAMILY = Family(**module_fields(globals()), model_types=...,
    architectures=...)`` plus the fields that are values (``attention``, ``expert_activation``)."""
    out = {f: namespace[name] for name, f in _MODULE_NAMES.items() if name in namespace}
    for f in fields(Family):
        if callable(namespace.get(f.name)) and not isinstance(namespace[f.name], type):
            out[f.name] = namespace[f.name]
    return out
