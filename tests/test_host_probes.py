"""The host term per family and expert format (issue 44, item 4): a host issue probe per registered family and format
runs CGOPipe's decode on the CPU; HardwareProfile.host_issue_by_family holds their numbers; the HRM and the MILP price
a job with its own key, else its family's dense one, else the MLA probe (MLA models), else the generic probe, and say
which; a profile written with the older host_issue_cpu_attn_mla loads to the same prediction; unknown keys stay errors."""

import dataclasses
import importlib.util

import pytest
import yaml

from lightning_moe.policy import hrm, milp
from lightning_moe.policy.hardware import (HardwareError, HardwareProfile, get_preset, host_probe_key,
                                           host_probe_line)
from lightning_moe.policy.policy import Policy, Workload, format_table
from lightning_moe.policy.registry import resolve_spec

HW = dataclasses.replace(get_preset("h200"), host_issue_cpu_attn=0.004, host_issue_gpu_attn=0.006)
ENTRIES = {"qwen3_moe": (0.009, 0.011), "mixtral/int4": (0.007, 0.008), "mla": (0.005, 0.0),
           "gpt_oss/mxfp4": (0.012, 0.013)}


def _probe_keys() -> list:
    """profiler.host_probe_keys() where torch is installed (the torch-free planner venv collects none)."""
    if importlib.util.find_spec("torch") is None:
        return []
    from lightning_moe.pipeline.profiler import host_probe_keys

    return list(host_probe_keys())


def test_probe_keys_cover_every_family_and_its_formats():
    """One dense probe per registered family (Mixtral's is the generic one), an int4 probe for every family quantize's
    pages hold, gpt-oss's MXFP4 pages; quick: the MLA probe only. Each probe model is its family's."""
    pytest.importorskip("torch")
    from lightning_moe.model.families import families
    from lightning_moe.model.quantize import packed_pages_refusal
    from lightning_moe.pipeline.profiler import _host_probe_spec, host_probe_keys

    keys = host_probe_keys()
    assert host_probe_keys(quick=True) == ("mla",) and keys[0] == "mla" and "mixtral" not in keys
    for fam in families():
        mt = fam.model_types[0]
        assert (mt in keys) == (mt != "mixtral"), mt
        assert (f"{mt}/int4" in keys) == (packed_pages_refusal(fam) is None), mt
    assert "gpt_oss/mxfp4" in keys and sum(k.endswith("/mxfp4") for k in keys) == 1
    for key in keys[1:]:
        spec = _host_probe_spec(2, key)
        assert spec.model_type == key.split("/")[0] and spec.num_layers == 2 and not spec.dense_layers, key
    assert _host_probe_spec(2, "mla").is_mla and _host_probe_spec(2, "generic").model_type == "mixtral"
    assert _host_probe_spec(2, "qwen3_moe").num_experts == 128 and _host_probe_spec(2, "qwen3_moe").top_k == 8
    assert _host_probe_spec(2, "gpt_oss").attention_sinks and _host_probe_spec(2, "gpt_oss").sliding_window
    assert _host_probe_spec(2, "deepseek_v3").is_mla
    with pytest.raises(ValueError, match="unknown host probe 'gpt_oss/int4'"):
        _host_probe_spec(2, "gpt_oss/int4")


def test_probe_weights_are_stored_in_the_keys_format():
    """"/int4" probes page their experts as quantize's int4 pages, "/mxfp4" as MXFP4 pages, dense ones as tensors."""
    torch = pytest.importorskip("torch")
    from lightning_moe.model.quantized import MXFP4Experts, QuantExperts
    from lightning_moe.pipeline.profiler import _host_probe_spec, _host_probe_weights

    for key, kind in (("qwen3_moe/int4", "int4"), ("gpt_oss/mxfp4", "mxfp4"), ("qwen3_moe", None)):
        w = _host_probe_weights(_host_probe_spec(2, key), key, torch.float32)
        for e in w.experts:
            if kind is None:
                assert not isinstance(e, QuantExperts), key
            else:
                assert isinstance(e, MXFP4Experts if kind == "mxfp4" else QuantExperts) and e.scheme == kind, key
    mx = _host_probe_weights(_host_probe_spec(1, "gpt_oss/mxfp4"), "gpt_oss/mxfp4", torch.float32).experts[0]
    dense = mx.dequantize(torch.float32)
    assert torch.isfinite(dense.w1).all() and 0 < dense.w1.abs().max() < 1  # small weights: the decode stays finite


@pytest.mark.parametrize("key", ["generic"] + _probe_keys())
def test_every_probe_runs_cgopipe_on_the_cpu(key):
    """Each family's (and format's) probe decodes with CGOPipe on the CPU and gives positive host seconds per
    micro-batch and decode layer, both placements."""
    from lightning_moe.pipeline.profiler import measure_host_issue

    h_c, h_g = measure_host_issue("cpu", layers=2, mu=3, steps=2, probe=key)
    assert 0 < h_c < 1 and 0 < h_g < 1, (key, h_c, h_g)


def test_hrm_takes_the_jobs_key_then_family_then_mla_then_generic():
    """host_issue_for: the job's own key; an int4 job of a family with only its dense entry: that; an MLA model with no
    entry: "mla" (its GPU-attention micro-batch at the generic h_g, the entry's 0); anything else: the generic fields.
    decode_host_issue_time and the MILP's host row charge the same numbers; the estimate names the probe."""
    hw = dataclasses.replace(HW, host_issue_by_family=ENTRIES)
    qwen3, mixtral, ds3, oss = (resolve_spec(n) for n in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"))
    olmoe = resolve_spec("olmoe-1b-7b")
    cases = [(qwen3, "bf16", "qwen3_moe", 0.009, 0.011), (qwen3, "int4", "qwen3_moe", 0.009, 0.011),
             (qwen3, "int2-up", "qwen3_moe", 0.009, 0.011), (mixtral, "int2", "mixtral/int4", 0.007, 0.008),
             (mixtral, "bf16", "generic", 0.004, 0.006), (ds3, "bf16", "mla", 0.005, 0.006),
             (oss, "mxfp4", "gpt_oss/mxfp4", 0.012, 0.013), (oss, "bf16", "generic", 0.004, 0.006),
             (olmoe, "bf16", "generic", 0.004, 0.006)]
    pol = Policy(mu=64, n=3, prefill_mu=16, n_gpu_attn=1)
    for spec, q, probe, h_c, h_g in cases:
        assert hw.host_issue_for(spec.model_type, q, spec.is_mla) == (probe, h_c, h_g), (spec.name, q)
        assert hrm.host_issue_times(hw, spec, q) == (h_c, h_g) and hrm.host_probe(hw, spec, q) == probe
        p = dataclasses.replace(pol, weight_quant=q)
        assert hrm.decode_host_issue_time(hw, p, spec) == pytest.approx(2 * h_c + h_g, rel=1e-12)
    assert hrm.host_probe(get_preset("h200"), qwen3, "bf16") == ""  # no host stage: no probe
    assert host_probe_key("qwen3_moe", "int2-up") == "qwen3_moe/int4" and host_probe_key("gpt_oss", "fp16") == "gpt_oss"
    wl = Workload(prompt_len=150, gen_len=8)
    C = milp._coefficients(qwen3, hw, wl, milp.Budgets(gpu_memory=80 << 30, cpu_memory=200 << 30), [4], 2,
                           wl.kv_positions(1))
    assert (C.host_c, C.host_g) == (0.009, 0.011)
    two = Policy(mu=64, n=2, prefill_mu=16, resident_experts=1)
    est = hrm.evaluate(two, qwen3, hw, wl)
    assert est.host_probe == "qwen3_moe" and est.decode_stages["host"] > 0
    assert f"  {host_probe_line('qwen3_moe')}" in format_table(two, est, qwen3, hw).splitlines()
    assert "host term" not in format_table(two, hrm.evaluate(two, qwen3, get_preset("h200"), wl), qwen3, hw)
    assert hrm.evaluate(Policy(mu=64, n=2, prefill_mu=16), qwen3, HW, wl).host_probe == "generic"
    assert "generic host issue probe" in host_probe_line("generic") and host_probe_line("") == ""


def test_family_entry_changes_the_prediction_as_its_numbers_say():
    """A Qwen3 job priced by a slower qwen3_moe entry decodes slower than on the generic probe, all else equal."""
    spec, wl = resolve_spec("qwen3-30b-a3b"), Workload(prompt_len=150, gen_len=16)
    pol = Policy(mu=128, n=4, prefill_mu=16, resident_experts=1)
    base = hrm.evaluate(pol, spec, dataclasses.replace(HW, host_issue_cpu_attn=0.05), wl)
    fam = hrm.evaluate(pol, spec, dataclasses.replace(HW, host_issue_cpu_attn=0.05,
                                                      host_issue_by_family={"qwen3_moe": (0.08, 0.0)}), wl)
    assert base.decode_binding == fam.decode_binding == "host"
    assert fam.decode_stages["host"] > base.decode_stages["host"] and fam.decode_tok_s < base.decode_tok_s


def _legacy_yaml(tmp_path, value, **extra):
    d = {k: v for k, v in HW.to_dict().items() if k != "host_issue_by_family"}
    d.update({"host_issue_cpu_attn_mla": value, **extra})
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def test_old_profile_with_host_issue_cpu_attn_mla_loads_to_the_same_prediction(tmp_path):
    """A profile written before host_issue_by_family (host_issue_cpu_attn_mla: x) loads as {"mla": (x, 0)}: an MLA
    model's CPU-attention micro-batch costs x, its GPU-attention one the generic h_g, a GQA model the generic numbers,
    as before; saved again it writes the new field and reads back equal. 0 (unmeasured) adds no entry. The committed
    h100-host profile (the older field) loads."""
    old = HardwareProfile.load(_legacy_yaml(tmp_path, 0.0025))
    assert old.host_issue_by_family == (("mla", (0.0025, 0.0)),)
    mla, gqa = resolve_spec("deepseek-v2-lite"), resolve_spec("mixtral-8x7b")
    pol = Policy(mu=64, n=3, prefill_mu=16, n_gpu_attn=1)
    assert hrm.decode_host_issue_time(old, pol, mla) == pytest.approx(2 * 0.0025 + 0.006, rel=1e-12)
    assert hrm.decode_host_issue_time(old, pol, gqa) == pytest.approx(2 * 0.004 + 0.006, rel=1e-12)
    wl = Workload(prompt_len=150, gen_len=8)
    new = dataclasses.replace(HW, host_issue_by_family={"mla": (0.0025, 0.0)})
    assert hrm.evaluate(pol, mla, old, wl) == hrm.evaluate(pol, mla, new, wl)
    assert hrm.evaluate(pol, mla, old, wl).host_probe == "mla"
    old.save(str(tmp_path / "again.yaml"))
    text = (tmp_path / "again.yaml").read_text()
    assert "host_issue_cpu_attn_mla" not in text and "host_issue_by_family:" in text
    assert HardwareProfile.load(str(tmp_path / "again.yaml")) == old
    assert HardwareProfile.load(_legacy_yaml(tmp_path, 0.0)).host_issue_by_family == ()
    assert HardwareProfile.load(_legacy_yaml(tmp_path, "2.5e-3")).host_issue_by_family == (("mla", (0.0025, 0.0)),)
    import os

    import lightning_moe.policy as P

    committed = HardwareProfile.load(os.path.join(os.path.dirname(P.__file__), "profiles", "h100-host.yaml"))
    assert dict(committed.host_issue_by_family) == {"mla": (0.00530313400781246, 0.0)}


def test_unknown_and_bad_host_issue_keys_are_errors(tmp_path):
    """An unknown profile key stays an error (a near name of the old field too); the old field beside the new one's
    "mla", a bad number, a bad entry or the reserved key "generic" are errors naming the file and key."""
    with pytest.raises(HardwareError, match=r"old.yaml: unknown key\(s\) host_issue_cpu_attn_mlb"):
        HardwareProfile.load(_legacy_yaml(tmp_path, 0.002, host_issue_cpu_attn_mlb=0.001))
    with pytest.raises(HardwareError, match="host_issue_cpu_attn_mla and host_issue_by_family's 'mla' both given"):
        HardwareProfile.load(_legacy_yaml(tmp_path, 0.002, host_issue_by_family={"mla": [0.003, 0.0]}))
    with pytest.raises(HardwareError, match="old.yaml: host_issue_cpu_attn_mla: expected a non-negative number"):
        HardwareProfile.load(_legacy_yaml(tmp_path, "fast"))
    d = HW.to_dict()
    for bad, msg in (({"qwen3_moe": [0.0, 0.1]}, "qwen3_moe: expected"), ({"qwen3_moe": [0.1]}, "qwen3_moe: expected"),
                     ({"generic": [0.1, 0.1]}, "bad or repeated key 'generic'"), ([1, 2], "bad or repeated key"),
                     ({"x": [float("nan"), 0]}, "x: expected"), ("abc", "expected a mapping")):
        with pytest.raises(HardwareError, match=f"hw.yaml: host_issue_by_family: .*{msg}"):
            HardwareProfile.from_dict({**d, "host_issue_by_family": bad}, "hw.yaml")
    ok = HardwareProfile.from_dict({**d, "host_issue_by_family": {"olmoe": ["1e-3", 0]}}, "hw.yaml")
    assert ok.host_issue_by_family == (("olmoe", (1e-3, 0.0)),) and hash(ok)


def test_profile_measures_every_key_logs_each_and_leaves_out_a_failing_one(monkeypatch):
    """_host_issue_fields: the generic probe, then every key (quick: "mla" only), one log line each in ms per
    micro-batch-layer; a failing probe is logged and left out; a failing generic probe leaves the host stage out."""
    pytest.importorskip("torch")
    from lightning_moe.pipeline import profiler as P

    def probe(probe="generic"):
        if probe == "olmoe/int4":
            raise RuntimeError("broke\nmore")
        return (0.002, 0.003) if probe == "generic" else (0.004, 0.005)

    monkeypatch.setattr(P, "measure_host_issue", probe)
    lines = []
    f = P._host_issue_fields(P.host_probe_keys(), lines.append)
    assert (f["host_issue_cpu_attn"], f["host_issue_gpu_attn"]) == (0.002, 0.003)
    assert set(f["host_issue_by_family"]) == set(P.host_probe_keys()) - {"olmoe/int4"}
    assert "  host issue probe olmoe/int4 failed (RuntimeError: broke); left out" in "\n".join(lines)
    assert "  probe qwen3_moe: 4.00 ms (CPU attention), 5.00 ms (GPU attention)" in "\n".join(lines)
    assert len(lines) == 1 + len(P.host_probe_keys())
    assert set(P._host_issue_fields(P.host_probe_keys(quick=True), lines.append)["host_issue_by_family"]) == {"mla"}
    monkeypatch.setattr(P, "measure_host_issue", lambda probe="generic": 1 / 0)
    assert P._host_issue_fields(P.host_probe_keys(), lines.append) == {}
