"""The model-family seam (model/families/): the registry, config honesty, and a family variant end to end.

Every field of transformers' MixtralConfig is implemented, refused or harmless (so a field a new transformers
version adds cannot be ignored in silence); a value the family does not implement is refused with the config file
and the field named; only the registry names a family module; and a variant family registered at run time (Mixtral
with GELU experts) is what both executors compute, equal to transformers' own model with ``hidden_act="gelu"``.
"""

import dataclasses
import functools
import json
import os

import pytest
import torch
from tests.support.hf_checkpoints import write_config as _write_config  # noqa: E402
import torch.nn.functional as F

from tests.test_layering import project_imports

from lightning_moe.kernels.fused_moe import experts_ffn_reference_from
from lightning_moe.model import families
from lightning_moe.model import layers as L
from lightning_moe.model.families import family_for, family_of, read_spec
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.policy.policy import Policy
from lightning_moe.policy.registry import resolve_spec


def test_registry_finds_mixtral_by_model_type_or_architectures(tiny_dir):
    fam = family_for({"model_type": "mixtral"})
    assert fam.name == "mixtral" and "mixtral" in families.supported_model_types()
    assert family_for({"architectures": ["MixtralForCausalLM"]}) is fam
    assert family_of(MoESpec.from_pretrained_dir(tiny_dir)) is fam
    with pytest.raises(ValueError, match=r"model_type 'dbrx' has no model family here, so it can be planned but not run"):
        family_of(resolve_spec("dbrx"))


def test_reader_gives_the_spec_it_always_gave(tiny_dir):
    """The family reader on the embedded model: the same numbers the planner and the executors used before."""
    s = MoESpec.from_pretrained_dir(tiny_dir)
    assert (s.model_type, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim,
            s.num_experts, s.top_k, s.rope_theta, s.rms_norm_eps, s.max_position_embeddings, s.sliding_window,
            s.norm_topk_prob, s.tie_word_embeddings, s.bos_token_id, s.eos_token_id) == (
        "mixtral", 64, 128, 4, 4, 2, 16, 8, 2, 1e6, 1e-5, 4096, None, True, False, 1, 2)
    with open(os.path.join(tiny_dir, "config.json")) as f:
        assert read_spec(json.load(f), s.name) == s  # the raw dict and transformers' AutoConfig read alike


@pytest.mark.parametrize("model_type", ["dbrx", "no_such_moe"])
def test_unknown_model_type_names_the_file_and_the_field(tiny_dir, tmp_path, model_type):
    d = _write_config(tiny_dir, tmp_path / "m", model_type=model_type)
    with pytest.raises(ValueError, match=rf"m/config\.json: model_type '{model_type}' is not supported yet "
                                         r"\(supported: [^)]*\bmixtral\b[^)]*\)$"):
        MoESpec.from_pretrained_dir(d)


def test_every_mixtral_config_field_is_implemented_refused_or_harmless(tiny_dir, hf_mixtral):
    from transformers import MixtralConfig

    fam = family_for({"model_type": "mixtral"})
    known = fam.implemented_keys | fam.refused_keys | fam.harmless_keys
    assert not (fam.implemented_keys & fam.refused_keys) and not (fam.harmless_keys & (fam.implemented_keys | fam.refused_keys))
    fields = set(MixtralConfig().to_dict())
    for d in (tiny_dir, hf_mixtral[0]):  # what config.json files in the wild (and save_pretrained) hold
        with open(os.path.join(d, "config.json")) as f:
            fields |= set(json.load(f))
    assert sorted(fields - known) == []


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_act="gelu"), r"hidden_act': 'gelu'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 4.0}), r"rope_(parameters|scaling)'"),
    (dict(rope_theta=None, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}),
     r"rope_(parameters|scaling)'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config'"),
])
def test_a_value_that_changes_the_math_is_refused_by_name(tiny_dir, tmp_path, changes, field):
    d = _write_config(tiny_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=rf"m/config\.json: config field '{field}.* is not implemented by the "
                                         r"mixtral family"):
        MoESpec.from_pretrained_dir(d)


def test_only_the_registry_names_a_family_module():
    """Executors, the loader, quantize and the planner reach a family through model.families, never by name."""
    fam_pkg = "lightning_moe.model.families"
    named = sorted({f"{a} imports {b}" for a, b in project_imports()
                    if b.startswith(fam_pkg + ".") and not a.startswith(fam_pkg)})
    assert named == []
    assert any(b == fam_pkg for _, b in project_imports())  # ... and they do go through it


@pytest.fixture
def gelu_family(monkeypatch):
    """A Mixtral variant whose experts gate with GELU (transformers' MixtralConfig(hidden_act="gelu")), registered
    for this test under its own model_type: what a family variant is (base.Family built from another's parts)."""
    mixtral = family_for({"model_type": "mixtral"})
    fam = dataclasses.replace(
        mixtral, name="mixtral-gelu", model_types=("mixtral_gelu_test",), architectures=(),
        read_spec=functools.partial(mixtral.read_spec, hidden_acts=("gelu",)),
        experts_ffn=functools.partial(L.experts_ffn, act=F.gelu),
        experts_ffn_from=functools.partial(experts_ffn_reference_from, act=F.gelu), expert_activation="gelu")
    monkeypatch.setitem(families._REGISTRY, "mixtral_gelu_test", fam)
    return fam


def test_a_family_variant_is_what_both_executors_compute(tmp_path, hf_mixtral_gelu, gelu_family):
    path, model = hf_mixtral_gelu
    _write_config(path, tmp_path / "gelu", model_type="mixtral_gelu_test")  # transformers does not know this type
    spec = MoESpec.from_pretrained_dir(str(tmp_path / "gelu"))
    assert family_of(spec) is gelu_family
    serial = SerialExecutor(load_checkpoint(str(tmp_path / "gelu"), torch.float32, spec), "cpu")
    ids = [1, 17, 33, 5, 90, 41, 7, 64]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    assert (serial.logits([ids])[0] - ref).abs().max().item() < 1e-4
    # the silu family on the same weights is far off: the activation is the family's, not a constant
    silu = SerialExecutor(load_checkpoint(path, torch.float32, dataclasses.replace(spec, model_type="mixtral")), "cpu")
    assert (silu.logits([ids])[0] - ref).abs().max().item() > 1e-2

    prompts = [ids, [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = DecodeSampling(max_new_tokens=10, stop_at_eos=False)
    want = []
    with torch.no_grad():
        for p in prompts:
            want.append(model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    assert [o for o, _ in serial.generate(prompts, params)] == want
    pipe = CGOPipeExecutor(load_checkpoint(str(tmp_path / "gelu"), torch.float32, spec),
                           Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32"), "cpu")  # paged experts
    try:
        assert [o for o, _ in pipe.generate(prompts, params)] == want
    finally:
        pipe.close()
