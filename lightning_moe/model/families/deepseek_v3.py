"""The DeepSeek-V3 family (DeepSeek-AI 2024, arXiv 2412.19437): DeepSeek-V2's MLA layer (``families/deepseek_v2.py``)
with a different router and RoPE layout.

Router (transformers' ``DeepseekV3TopkRouter``, ``layers.route_sigmoid_biased``): sigmoid scores in fp32; experts are
chosen on ``scores + e_score_correction_bias`` (the bias is for selection only): the ``topk_group`` best of
``n_group`` groups, each scored by the sum of its top 2, then top-k; the weights are the chosen experts' unbiased
scores, renormalized with ``norm_topk_prob``, times ``routed_scaling_factor``. RoPE: over interleaved pairs with
``rope_interleave`` (default), rotate-half without, computed in the model dtype. Shared experts, dense layers
(``first_k_dense_replace``) and MLA as DeepSeek-V2's. The multi-token-prediction layers (``num_nextn_predict_layers``,
stored after the decoder layers) are never loaded (``load_checkpoint`` says so) and never run. Refused by name
besides DeepSeek-V2's list: ``topk_method`` other than noaux_tc and ``scoring_func`` other than sigmoid (transformers
ignores both and always computes this router), groups of fewer than 2 experts, a top-k larger than the kept groups.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .. import layers as L
from ..spec import MoESpec
from . import deepseek_v2 as V2
from .base import ConfigView, KeyMap, module_fields, refuse

NAME = "deepseek_v3"

KEYS: KeyMap = replace(V2.KEYS, layer_tensors={**V2.KEYS.layer_tensors,
                                               "e_bias": "{moe}gate.e_score_correction_bias"})
IMPLEMENTED_KEYS = V2.COMMON_IMPLEMENTED | {
    "rope_interleave",  # both values
    "num_nextn_predict_layers", "num_mtp_layers",  # MTP layers: skipped at load (with a message), never run
}
REFUSED_KEYS = V2.REFUSED_KEYS
HARMLESS_KEYS = V2.HARMLESS_KEYS


def read_spec(cfg, name: Optional[str] = None) -> MoESpec:
    """MoESpec of a DeepSeek-V3 config (a dict of config.json or a ``transformers.PretrainedConfig``).

    Raises:
        ValueError naming the field: ``topk_method`` other than noaux_tc, ``scoring_func`` other than sigmoid,
            ``n_group`` / ``topk_group`` that ``layers.check_router_groups`` refuses (groups of >= 2 experts), and
            the values ``deepseek_v2.read_mla_spec`` refuses.
    """
    c = cfg if isinstance(cfg, ConfigView) else ConfigView(cfg)
    get = c.get
    method = get("topk_method")
    if method not in (None, "noaux_tc"):
        raise refuse("topk_method", method, NAME, "'noaux_tc' (transformers' DeepSeek-V3 router)")
    scoring = get("scoring_func")
    if scoring not in (None, "sigmoid"):
        raise refuse("scoring_func", scoring, NAME, "'sigmoid'")
    n_group, topk_group = get("n_group"), get("topk_group")
    L.check_router_groups(c.need("n_routed_experts"), n_group, topk_group, c.need("num_experts_per_tok"), NAME,
                          min_group_size=2)
    mtp = get("num_nextn_predict_layers", get("num_mtp_layers", 0)) or 0
    router = dict(router_scoring="sigmoid", router_n_group=n_group, router_topk_group=topk_group,
                  routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
                  norm_topk_prob=bool(get("norm_topk_prob", True)),
                  rope_interleave=bool(get("rope_interleave", True)),  # null: rotate-half, as transformers' `if`
                  num_mtp_layers=int(mtp))
    return V2.read_mla_spec(c, NAME, name, router)


def pre_attention(lw, x, positions, spec, inv_freq, rope=None):
    """DeepSeek-V3's :func:`deepseek_v2.mla_pre_attention` (RoPE in the model dtype, interleaved per
    ``rope_interleave``)."""
    return V2.mla_pre_attention(lw, x, positions, spec, inv_freq, rope, rope_fp32=False)


FAMILY = replace(V2.FAMILY, **module_fields(globals()), model_types=("deepseek_v3",),
                 architectures=("DeepseekV3ForCausalLM",))
