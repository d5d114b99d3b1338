"""The model-family registry: which families exist and how a config or a spec finds its family.

A family (:class:`~.base.Family`) is its config reader (config.json -> MoESpec), its checkpoint key map and its
layer math as plain functions. The executors, the checkpoint loader, ``quantize`` and (through
``MoESpec.from_pretrained_dir``) the planner reach a family only through :func:`family_for` / :func:`family_of` /
:func:`read_spec`; no module outside this package names a family module. Adding a family: docs/DESIGN.md,
"Adding a family".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from . import deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from .base import ConfigView, Family, KeyMap

if TYPE_CHECKING:
    from ..spec import MoESpec

__all__ = ["ConfigView", "Family", "KeyMap", "families", "family_for", "family_of", "read_spec", "register",
           "supported_model_types"]

# model_type -> family, in registration order
_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` under each of its model types. Raises ValueError when a model type is taken, or when the family
    replaces ``decode_attention`` but not ``decode_attention_masked`` (CGOPipe's GPU-attention micro-batches call the
    masked one: the replacement would be skipped there)."""
    from .. import layers as L

    if (family.attention != "mla" and family.decode_attention is not L.decode_attention
            and family.decode_attention_masked is L.decode_attention_masked):
        raise ValueError(f"family {family.name}: replaces decode_attention but not decode_attention_masked (the "
                         f"GPU-attention micro-batches call it with the mask made once per step); define both")
    for t in family.model_types:
        if t in _REGISTRY and _REGISTRY[t] is not family:
            raise ValueError(f"model_type {t!r} is already read by the {_REGISTRY[t].name} family")
    for t in family.model_types:
        _REGISTRY[t] = family
    return family


register(mixtral.FAMILY)
register(qwen3_moe.FAMILY)
register(olmoe.FAMILY)
register(qwen2_moe.FAMILY)
register(deepseek_v2.FAMILY)
register(deepseek_v3.FAMILY)
register(gpt_oss.FAMILY)


def families() -> list[Family]:
    """The registered families, each once, in registration order."""
    return list(dict.fromkeys(_REGISTRY.values()))


def supported_model_types() -> tuple[str, ...]:
    """Every model_type some family reads."""
    return tuple(_REGISTRY)


def family_for(config: Any) -> Family:
    """The family that reads ``config`` (a dict of config.json or a ``transformers.PretrainedConfig``): by its
    ``model_type``, or, without one, by its ``architectures``.

    Raises:
        ValueError: a model_type no family reads, or neither field naming a family (the message names the field
            and the supported model types; callers that know the file prefix its path).
    """
    c = config if isinstance(config, ConfigView) else ConfigView(config)
    model_type = c.get("model_type")
    supported = ", ".join(_REGISTRY)
    if model_type is not None:
        if model_type not in _REGISTRY:
            raise ValueError(f"model_type {model_type!r} is not supported yet (supported: {supported})")
        return _REGISTRY[model_type]
    archs = c.get("architectures") or []
    for fam in families():
        if any(a in fam.architectures for a in archs):
            return fam
    raise ValueError(f"config field 'model_type' is missing and architectures {list(archs)!r} name no supported "
                     f"family (supported: {supported})")


def family_of(spec: "MoESpec") -> Family:
    """The family of a spec (by ``spec.model_type``) whose math the executors run.

    Raises:
        ValueError: no family implements the spec's model_type (the planner's registry holds specs of families the
            executors do not run).
    """
    fam = _REGISTRY.get(spec.model_type)
    if fam is None:
        raise ValueError(f"{spec.name}: model_type {spec.model_type!r} has no model family here, so it can be "
                         f"planned but not run (supported: {', '.join(_REGISTRY)})")
    return fam


def read_spec(config: Any, name: Optional[str] = None) -> "MoESpec":
    """MoESpec of ``config`` (a dict of config.json or a ``transformers.PretrainedConfig``) by its family's reader.

    Raises:
        ValueError: unsupported model_type, a missing field, or a value the family refuses (the message names it).
    """
    c = config if isinstance(config, ConfigView) else ConfigView(config)
    return family_for(c).read_spec(c, name)
