"""families.register: a family that replaces decode_attention must replace decode_attention_masked too (CGOPipe's
GPU-attention micro-batches call the masked one; the replacement would be skipped there)."""

import dataclasses

import pytest

from lightning_moe.model import families
from lightning_moe.model.families import mixtral


def test_a_family_replacing_only_decode_attention_is_refused():
    def my_attention(q, K, V, lengths, sliding_window=None):  # a family's own decode attention
        raise AssertionError("not called")

    fam = dataclasses.replace(mixtral.FAMILY, name="mine", model_types=("mine_moe",), decode_attention=my_attention)
    with pytest.raises(ValueError, match="family mine: replaces decode_attention but not decode_attention_masked"):
        families.register(fam)
    assert "mine_moe" not in families.supported_model_types()
    both = dataclasses.replace(fam, decode_attention_masked=lambda q, K, V, masked: None)
    try:
        assert families.register(both) is both and families.family_for({"model_type": "mine_moe"}) is both
    finally:
        families._REGISTRY.pop("mine_moe", None)


def test_every_registered_family_replaces_both_or_neither():
    """gpt-oss replaces both (its sinks); MLA families' decode_attention is the variant's own signature."""
    for fam in families.families():
        families.register(fam)  # registering again is allowed and checks it
