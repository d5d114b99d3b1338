"""Tiny config.json dicts of the families whose layers differ in kind (tests build models from them with
``read_spec`` and ``dummy_weights``): Mixtral (every layer MoE), DeepSeek-V2 (MLA, a shared expert, a dense first
layer), gpt-oss (sliding and full attention layers, sinks, expert biases). Three layers, six heads."""

from __future__ import annotations


def tiny_family_config(family: str, *, vocab: int, hidden: int, inter: int, dense_inter: int = 0, lora: int = 0,
                       head: int = 0, rope: int = 0) -> dict:
    """``inter``: the experts' width; DeepSeek: ``dense_inter`` its dense layer's MLP, ``lora`` kv_lora_rank, ``head``
    the nope and value head widths, ``rope`` the rope head width; gpt-oss: ``head`` its head width."""
    base = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": 3, "num_attention_heads": 6,
            "num_key_value_heads": 2, "num_experts_per_tok": 2, "rope_theta": 1000.0}
    if family == "mixtral":
        return {**base, "model_type": "mixtral", "intermediate_size": inter, "num_local_experts": 5}
    if family == "deepseek_v2":
        return {**base, "model_type": "deepseek_v2", "num_key_value_heads": 6, "intermediate_size": dense_inter,
                "moe_intermediate_size": inter, "n_routed_experts": 6, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "kv_lora_rank": lora, "q_lora_rank": None, "qk_nope_head_dim": head, "qk_rope_head_dim": rope,
                "v_head_dim": head, "topk_method": "greedy", "norm_topk_prob": False}
    if family == "gpt_oss":
        return {**base, "model_type": "gpt_oss", "intermediate_size": inter, "num_local_experts": 5, "head_dim": head,
                "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    raise ValueError(f"tiny_family_config: unknown family {family!r}")
