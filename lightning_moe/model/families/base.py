"""What a model family is: :class:`Family` (config reader, checkpoint key map, layer math) and its parts.

A family is data plus plain functions, no class hierarchy: ``families/<name>.py`` defines its functions and one
``FAMILY = Family(...)``; ``families/__init__.py`` lists it. Everything outside ``model/families/`` reaches a
family through the registry (``family_for(config)``, ``family_of(spec)``), never by module name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

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


def refuse(key: str, value: Any, family: str, implemented: str) -> ValueError:
    """The error for a config field whose value changes the math in a way ``family`` does not implement."""
    return ValueError(f"config field {key!r}: {value!r} is not implemented by the {family} family "
                      f"(implemented: {implemented})")


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
    # ---- layer math -------------------------------------------------------------------------------------
    rope_inv_freq: Callable  # (spec, device) -> fp32 [hd/2]
    rope_cos_sin: Callable  # (positions [T], inv_freq, dtype) -> (cos, sin) [T, hd]
    pre_attention: Callable  # (lw, x [T, D], positions [T], spec, inv_freq, rope=None) -> q, k, v
    prefill_packed_layout: Callable  # (spans, T, device) -> index tensors for prefill_attention_packed
    prefill_attention_packed: Callable  # (q, k, v, spans, sliding_window, layout=None) -> [T, Hq*hd]
    decode_attention: Callable  # (q [B, Hq, hd], K, V [B, Hkv, S, hd], lengths [B], sliding_window) -> [B, Hq*hd]
    post_attention: Callable  # (lw, ew, x, attn, spec, ffn) -> layer output [T, D] (a dense layer: ew, ffn unused)
    experts_ffn: Callable  # (x [T, D], ExpertWeights, topk_w [T, k], topk_ids [T, k]) -> [T, D] (reference)
    experts_ffn_from: Callable  # (x, get_expert(e) -> (w1, w3, w2), E, topk_w, topk_ids) -> [T, D] (reference)
    final_logits: Callable  # (x [T, D], norm_w, lm_head, eps) -> fp32 [T, V]
    attention: str = "gqa"  # attention variant: "gqa" (grouped-query over a per-head K/V cache)
    expert_activation: str = "silu"  # the gate activation inside experts_ffn (fused kernels check they compute it)
    dense_layer_weights: Optional[type] = None  # dataclass of a dense (MLP-only) layer's weights; fields =
    #   keys.dense_layer_tensors; has .to(); None: the family has no dense layers (read_spec gives none)
