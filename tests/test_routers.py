"""The DeepSeek routers of model/layers.py against transformers' own router modules (the oracle), fp32, on random
inputs: DeepSeek-V2's softmax router (``greedy`` and ``group_limited_greedy``, ``routed_scaling_factor``) and
DeepSeek-V3's sigmoid router (``e_score_correction_bias`` for selection only, groups scored by their top 2,
``topk_group`` kept, ``norm_topk_prob`` both ways, ``routed_scaling_factor``), with scores pushed below zero by the
correction bias and with exactly tied experts; the group checks name the config fields."""

import pytest
import torch

from lightning_moe.model import layers as L

D = 24


def _v2_router(E, top_k, method, n_group, topk_group, scale, seed):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=D, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=top_k,
                           topk_method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    r = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, D, generator=g))
    return r


def _v3_router(E, top_k, n_group, topk_group, norm, scale, seed, bias_scale=0.3):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
                           num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    r = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, D, generator=g))
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * bias_scale)
    return r


def _h(T=64, seed=1):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def _same(ref, ours):
    (_, w_ref, ids_ref), (w, ids) = ref, ours
    assert torch.equal(ids, ids_ref), (ids, ids_ref)
    assert (w - w_ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("E, top_k, method, n_group, topk_group, scale", [
    (8, 2, "greedy", None, None, 1.0),
    (16, 6, "greedy", 1, 1, 16.0),  # DeepSeek-V2-Lite's numbers in small: greedy ignores n_group
    (16, 3, "group_limited_greedy", 4, 2, 1.0),
    (16, 4, "group_limited_greedy", 8, 3, 16.0),  # DeepSeek-V2: 8 groups, 3 kept, scaling 16
    (8, 2, "group_limited_greedy", 1, 1, 1.0),
])
def test_v2_router_equals_transformers(E, top_k, method, n_group, topk_group, scale):
    r = _v2_router(E, top_k, method, n_group, topk_group, scale, seed=E + top_k)
    h = _h()
    with torch.no_grad():
        ref = r(h)
    ours = L.route_softmax_grouped(h, r.weight, top_k, n_group if method == "group_limited_greedy" else 0,
                                   topk_group or 0, scale)
    _same(ref, ours)


@pytest.mark.parametrize("E, top_k, n_group, topk_group, norm, scale", [
    (16, 4, 4, 2, True, 2.5),
    (16, 4, 4, 2, False, 1.0),
    (32, 8, 8, 4, True, 2.5),  # DeepSeek-V3's routing in small (256 experts, 8 groups, 4 kept, top-8)
    (8, 2, 1, 1, True, 1.0),  # GLM-4.5: one group
])
def test_v3_router_equals_transformers(E, top_k, n_group, topk_group, norm, scale):
    r = _v3_router(E, top_k, n_group, topk_group, norm, scale, seed=E + top_k)
    h = _h()
    with torch.no_grad():
        ref = r(h)
    ours = L.route_sigmoid_biased(h, r.weight, r.e_score_correction_bias, top_k, n_group, topk_group, norm, scale)
    _same(ref, ours)


def test_v3_router_with_scores_below_zero_selects_on_the_biased_scores_and_weights_the_unbiased():
    """A correction bias of -2 on most experts puts their selection scores below zero (sigmoid is in (0, 1)): the
    masked groups must sit at -inf, not 0, and the weights are the unbiased scores."""
    E, top_k = 16, 4
    r = _v3_router(E, top_k, 4, 2, True, 2.5, seed=3)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.where(torch.arange(E) % 3 == 0, 0.1, -2.0))
    h = _h(seed=4)
    with torch.no_grad():
        ref = r(h)
        choice = torch.sigmoid(h @ r.weight.T) + r.e_score_correction_bias
    assert (choice < 0).float().mean() > 0.5  # most selection scores are negative
    ours = L.route_sigmoid_biased(h, r.weight, r.e_score_correction_bias, top_k, 4, 2, True, 2.5)
    _same(ref, ours)
    # the bias changes the choice but not the weights: they are the chosen experts' sigmoid scores, renormalized
    w, ids = ours
    s = torch.sigmoid(h @ r.weight.T).gather(1, ids)
    assert torch.allclose(w, 2.5 * s / s.sum(-1, keepdim=True), atol=1e-6)
    plain = L.route_sigmoid_biased(h, r.weight, torch.zeros(E), top_k, 4, 2, True, 2.5)[1]
    assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def test_routers_break_ties_as_transformers():
    """Duplicated router rows give exactly tied experts (and tied groups): the same experts are chosen, in the same
    order, as transformers chooses them."""
    E = 16
    r2 = _v2_router(E, 3, "group_limited_greedy", 4, 2, 1.0, seed=5)
    r3 = _v3_router(E, 3, 4, 2, True, 1.0, seed=5, bias_scale=0.0)
    for r in (r2, r3):
        with torch.no_grad():
            r.weight[1::2] = r.weight[0::2]  # experts 2i and 2i+1 tie in every token
            r.weight[8:] = r.weight[:8]  # groups 0/2 and 1/3 tie
    h = _h(seed=6)
    with torch.no_grad():
        ref2, ref3 = r2(h), r3(h)
    _same(ref2, L.route_softmax_grouped(h, r2.weight, 3, 4, 2, 1.0))
    _same(ref3, L.route_sigmoid_biased(h, r3.weight, r3.e_score_correction_bias, 3, 4, 2, True, 1.0))


@pytest.mark.parametrize("args, match", [
    ((16, 3, 2, 4), r"'n_group': 3 must be an int >= 1 that divides the routed experts \(n_routed_experts=16\)"),
    ((16, 0, 1, 4), r"'n_group': 0"),
    ((16, 4, 5, 4), r"'topk_group': 5 must be an int in 1..n_group=4"),
    ((16, 4, 1, 8), r"'num_experts_per_tok' and 'topk_group': top-8 from 1 kept groups of 4"),
])
def test_group_checks_name_the_fields(args, match):
    with pytest.raises(ValueError, match=match):
        L.check_router_groups(*args, family="deepseek_v3")


def test_v3_group_of_one_expert_is_refused():
    with pytest.raises(ValueError, match=r"'n_group' and 'n_routed_experts': 8 groups of 8 experts hold 1 each"):
        L.check_router_groups(8, 8, 2, 2, "deepseek_v3", min_group_size=2)
