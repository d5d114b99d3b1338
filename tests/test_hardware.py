"""HardwareProfile presets, YAML load/save validation, byte parsing, and the CPU side of the profiler."""

import pytest
import torch
import yaml

from lightning_moe.pipeline import profiler
from lightning_moe.policy.hrm import dram_sharing as hrm_sharing
from lightning_moe.policy.hardware import (GiB, PRESETS, HardwareError, HardwareProfile, get_preset, parse_bytes,
                                           resolve_hardware)


def test_artifact_presets():
    t4, l4 = get_preset("t4"), get_preset("l4")
    # MoE-Lightning artifact (GB = 2**30): T4 15 GB, 16 GB/s PCIe, 300 GB/s HBM, 65 TFLOP/s; L4 24, 16, 285, 104
    assert (t4.gpu_memory, t4.pcie_h2d, t4.gpu_hbm_bandwidth, t4.gpu_flops_fp16) == (15 * GiB, 16 * GiB, 300 * GiB, 65e12)
    assert (l4.gpu_memory, l4.pcie_h2d, l4.gpu_hbm_bandwidth, l4.gpu_flops_bf16) == (24 * GiB, 16 * GiB, 285 * GiB, 104e12)
    assert l4.cpu_attention_flops == 1.6e12 and t4.cpu_attention_flops == 0.8e12 and l4.host_memory == 192 * GiB
    h200 = get_preset("H200")
    assert h200.gpu_hbm_bandwidth == 4.8e12 and h200.gpu_flops_bf16 == 989e12 and h200.pcie_h2d == 55e9
    assert h200.host_memory == 128 * GiB and h200.cpu_cores == 16
    assert {"t4", "l4", "a100-40g", "h100", "h200"} <= set(PRESETS)
    for p in PRESETS.values():
        assert p.source and p.gpu_flops("bfloat16") == p.gpu_flops_bf16
    with pytest.raises(HardwareError, match="unknown hardware preset"):
        get_preset("v100")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    PRESETS[name].save(str(path), header="a comment\nanother")
    assert path.read_text().startswith("# a comment\n# another\n")
    assert HardwareProfile.load(str(path)) == PRESETS[name]
    assert resolve_hardware(str(path)) == PRESETS[name]


def _write(tmp_path, **changes):
    d = PRESETS["l4"].to_dict()
    d.update(changes)
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_yaml_validation(tmp_path):
    with pytest.raises(HardwareError, match=r"hw.yaml: unknown key\(s\) pcie_bw"):
        HardwareProfile.load(_write(tmp_path, pcie_bw=1))
    with pytest.raises(HardwareError, match="hw.yaml: cpu_cores: expected an integer"):
        HardwareProfile.load(_write(tmp_path, cpu_cores="many"))
    with pytest.raises(HardwareError, match="hw.yaml: pcie_h2d: expected a number"):
        HardwareProfile.load(_write(tmp_path, pcie_h2d=True))
    with pytest.raises(HardwareError, match="hw.yaml: pcie_h2d: expected a number, got 'fast'"):
        HardwareProfile.load(_write(tmp_path, pcie_h2d="fast"))
    with pytest.raises(HardwareError, match="hw.yaml: name: expected a string"):
        HardwareProfile.load(_write(tmp_path, name=3))
    with pytest.raises(HardwareError, match="pcie_h2d: must be > 0"):
        HardwareProfile.load(_write(tmp_path, pcie_h2d=0))
    d = PRESETS["l4"].to_dict()
    del d["gpu_memory"]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareError, match="m.yaml: gpu_memory: missing"):
        HardwareProfile.load(str(tmp_path / "m.yaml"))
    # byte strings and YAML-1.1 exponent strings are accepted
    p = HardwareProfile.load(_write(tmp_path, gpu_memory="22GiB", pcie_h2d="1.2e10"))
    assert p.gpu_memory == 22 * GiB and p.pcie_h2d == 1.2e10
    with pytest.raises(HardwareError, match="no such hardware profile"):
        resolve_hardware(str(tmp_path / "missing.yaml"))


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes(1000) == 1000 and parse_bytes("77") == 77
    for bad in ("24 gigs", "-1GiB", True, -5, "GiB", None):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_reference_attention_matches_project_routine():
    from lightning_moe.pipeline.cpu_attention import cpu_decode_attention

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(3, 2, 10, 8, generator=g)
    v = torch.randn(3, 2, 10, 8, generator=g)
    lengths = torch.tensor([10, 4, 7])
    torch.testing.assert_close(profiler._reference_decode_attention(q, k, v, lengths), cpu_decode_attention(q, k, v, lengths),
                               rtol=1e-5, atol=1e-5)


def test_profile_cpu_side(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = []
    prof = profiler.profile_host(name="here", gpu_preset="l4", gpu_memory=20 * GiB, quick=True, log=lines.append)
    assert any("GPU side skipped" in ln for ln in lines)
    assert "GPU side skipped" in prof.source and "cpu_decode_attention" in prof.source
    assert prof.cpu_attention_bandwidth > 0 and prof.cpu_attention_flops > 0 and prof.host_memory_bandwidth > 0
    assert prof.gpu_memory == 20 * GiB and prof.pcie_h2d == get_preset("l4").pcie_h2d  # GPU side from the preset
    assert prof.date and prof.host and prof.cpu_cores >= 1 and prof.name == "here"
    path = tmp_path / "p.yaml"
    prof.save(str(path))
    assert HardwareProfile.load(str(path)) == prof


def test_profile_gpu_side_assembles_each_probe_and_survives_a_failing_one(monkeypatch):
    """The CUDA side of profile_host with its probes stubbed (this machine has no GPU): every measured field lands in
    the profile; a failing kernel probe leaves its field at the preset's and says so in one line, the rest stands."""
    from lightning_moe.pipeline import profiler as P

    def fail(*a, **k):
        raise RuntimeError("probe broke\nsecond line")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "_measure_cpu_attention_side",
                        lambda quick, log: (dict(cpu_attention_flops=1e9, cpu_attention_bandwidth=6e10), "stub"))
    from lightning_moe.pipeline import dram_sharing

    monkeypatch.setattr(dram_sharing, "measure_cpu_attention_under_h2d",
                        lambda layer, nbytes, layers, **kw: dram_sharing.SharingPoint(2e10, 1e10, 1e10, 0.8e10))
    gpu = dict(gpu_name="Stub GPU", pcie_h2d=11e9, pcie_d2h=12e9, gpu_hbm_bandwidth=1e12, gpu_flops_bf16=2e14)
    monkeypatch.setattr(P, "measure_gpu", lambda **kw: dict(gpu))
    monkeypatch.setattr(P, "measure_microbatch_overhead", lambda: 1.5e-3)
    monkeypatch.setattr(P, "measure_expert_kernel_flops", lambda: 3e14)
    monkeypatch.setattr(P, "measure_expert_ffn_rates", fail)
    monkeypatch.setattr(P, "measure_host_issue", lambda probe="generic": (7e-3, 5e-3) if probe == "mla" else (4e-3, 6e-3))
    monkeypatch.setattr(P, "measure_gpu_context_bytes", lambda: 797769728)
    lines = []
    prof = P.profile_host(name="here", gpu_preset="l4", quick=True, log=lines.append)
    assert prof.gpu_context_bytes == 797769728 and "0.74 GiB (the profile's gpu_context_bytes" in "\n".join(lines)
    assert (prof.pcie_h2d, prof.gpu_flops_bf16, prof.microbatch_overhead, prof.gpu_expert_flops) == (11e9, 2e14, 1.5e-3, 3e14)
    assert (prof.host_issue_cpu_attn, prof.host_issue_gpu_attn) == (4e-3, 6e-3)
    assert prof.host_issue_by_family == (("mla", (7e-3, 5e-3)),)  # quick: the MLA probe only
    # the point of CPU attention beside pinned copies, from the rates alone just measured
    assert (prof.cpu_attention_bandwidth_under_h2d, prof.pcie_h2d_under_cpu_attention) == (3e10, 0.8 * 11e9)
    assert ("CPU decode attention beside full-rate pinned H2D copies: 0.50 of its rate alone (10.0 of 20.0 GB/s of KV "
            "in this probe), H2D 0.80 (8.0 of 10.0 GB/s)") in "\n".join(lines)
    assert prof.expert_ffn_rates == get_preset("l4").expert_ffn_rates and "GPU side measured" in prof.source
    assert "expert FFN kernel probe failed (RuntimeError: probe broke); expert_ffn_rates left empty" in "\n".join(lines)
    monkeypatch.setattr(P, "measure_host_issue", fail)
    monkeypatch.setattr(dram_sharing, "measure_cpu_attention_under_h2d", fail)
    prof = P.profile_host(name="here", gpu_preset="l4", quick=True, log=lines.append)
    assert prof.host_issue_cpu_attn == get_preset("l4").host_issue_cpu_attn and prof.gpu_expert_flops == 3e14
    assert prof.cpu_attention_bandwidth_under_h2d == 0.0 and hrm_sharing(prof) is None
    assert ("CPU decode attention beside pinned H2D copies: not measured (RuntimeError: probe broke)"
            in "\n".join(lines))
    # an MXFP4 model among the expert shapes: the MXFP4 kernel's entries join the dense ones
    from lightning_moe.policy.hardware import ExpertFFNRate

    dense = ExpertFFNRate(2880, 2880, 128, 4, "bf16", 16, triton=1e12)
    monkeypatch.setattr(P, "measure_expert_ffn_rates", lambda shapes, toks, **kw: (dense,))
    monkeypatch.setattr(P, "measure_mxfp4_ffn_rates", lambda shapes, toks, **kw: tuple(
        ExpertFFNRate(*sh, "bf16", 16, triton=2e12, weights="mxfp4") for sh in shapes))
    prof = P.profile_host(name="here", gpu_preset="l4", quick=True, log=lines.append,
                          expert_shapes=["gpt-oss-120b", "mixtral-8x7b"])
    assert prof.expert_ffn_rates == (dense, ExpertFFNRate(2880, 2880, 128, 4, "bf16", 16, triton=2e12, weights="mxfp4"))


def test_profile_keeps_the_compute_bound_attention_flop_rate(monkeypatch):
    """cpu_attention_flops is the higher of the decode-shaped probe's FLOP rate and the 8-query-heads-per-KV-head
    probe's (where the routine is compute-bound): (H5)'s FLOP term must be a peak."""
    from lightning_moe.pipeline import profiler as P

    real = P.measure_cpu_attention

    def fake(batch=32, q_heads=32, kv_heads=8, seq=1024, head_dim=128, **kw):
        bw, _, which = real(batch=4, q_heads=q_heads, kv_heads=kv_heads, seq=16, head_dim=head_dim, repeats=1)
        return bw, (3e9 if q_heads // kv_heads == 8 else 2e9), which

    monkeypatch.setattr(P, "measure_cpu_attention", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prof = P.profile_host(name="here", gpu_preset="l4", quick=True, log=lambda s: None)
    assert prof.cpu_attention_flops == 3e9


def test_latent_attention_probe_counts_mla_flops(monkeypatch):
    """measure_cpu_latent_attention: rows seq heads (2 (Dl + rd) + 2 Dl) FLOPs over the native kernel's best time
    (a fake clock: every call 0.5 s), the kernel called on the probe's shapes; 0.0 without the native kernel."""
    from lightning_moe.kernels import cpu_attention as ca
    from lightning_moe.kernels import cpu_latent_attention as cla
    from lightning_moe.pipeline import profiler as P

    seen = []
    monkeypatch.setattr(cla, "latent_attention_append", lambda q, c, k, rows, cache, lengths, out, scale:
                        seen.append((tuple(q.shape), tuple(cache.shape), lengths.tolist(), c, k)))
    monkeypatch.setattr(ca, "native_available", lambda: True)
    calls = iter(range(10**6))
    monkeypatch.setattr(P.time, "perf_counter", lambda: 0.5 * next(calls))
    flops = P.measure_cpu_latent_attention(rows=3, heads=4, kv_lora_rank=32, rope_dim=16, seq=10, repeats=2)
    assert flops == pytest.approx(3 * 10 * 4 * (2 * 48 + 2 * 32) / 0.5)
    assert seen and all(x == ((3, 4, 48), (3, 10, 48), [10] * 3, None, None) for x in seen)
    monkeypatch.setattr(ca, "native_available", lambda: False)
    assert P.measure_cpu_latent_attention(rows=3, seq=10) == 0.0


def test_cpu_attention_executor_probe_counts_valid_kv(monkeypatch):
    """measure_cpu_attention_executor: bytes/s of valid KV = sum(len + 1) * 2 Hkv hd * 2 bytes / seconds per
    layer; checked against a clock that makes every layer take exactly 0.5 s (fake perf_counter)."""
    from lightning_moe.pipeline import profiler as P

    calls = iter(range(10**6))
    monkeypatch.setattr(P.time, "perf_counter", lambda: 0.25 * next(calls))  # each pass: 2 reads, 0.25 s apart
    rows, mean, layers = 12, 20, 2
    bw = P.measure_cpu_attention_executor(rows=rows, mean_len=mean, gen=4, layers=layers, repeats=1)
    ramp = torch.exp(torch.linspace(-1.2, 1.2, rows))
    lens = (ramp / ramp.mean() * mean).round().clamp(min=1).long()
    valid = int((lens + 1).sum())
    assert bw == pytest.approx(valid * 2 * 8 * 128 * 2 / (0.25 / layers))


# ---------------------------------------------------------------------------------------------- MXFP4 kernel rates
def test_mxfp4_rates_are_their_own_entries_and_the_hrm_charges_mxfp4_pages_with_them(tmp_path):
    """expert_ffn_rates entries with weights: mxfp4 (the MXFP4 kernel's measured rate) are looked up only for MXFP4
    pages: hrm.gpu_experts_time with quant "mxfp4" uses them (log-T interpolated), with bf16 experts the dense
    entries; without an mxfp4 entry MXFP4 pages fall back to gpu_expert_flops, as before. The YAML keeps weights for
    mxfp4 entries and leaves the default out; an unknown storage is refused by name."""
    from lightning_moe.policy import hrm
    from lightning_moe.policy.hardware import ExpertFFNRate
    from lightning_moe.policy.registry import resolve_spec

    spec = resolve_spec("gpt-oss-120b")
    shape = (spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k)
    rows = [ExpertFFNRate(*shape, "bf16", 1024, triton=4e14, grouped_mm=5e14),
            ExpertFFNRate(*shape, "bf16", 1024, triton=1e14, weights="mxfp4"),
            ExpertFFNRate(*shape, "bf16", 4096, triton=2e14, weights="mxfp4")]
    hw = get_preset("h100").with_overrides(expert_ffn_rates=rows, gpu_expert_flops=3e14)
    assert hw.expert_ffn_rate(*shape, "bf16", 1024) == 5e14  # dense: the best kernel
    assert hw.expert_ffn_rate(*shape, "bf16", 2048, ("triton",), "mxfp4") == pytest.approx(1.5e14)  # halfway in log T
    flops = 2 * 2048 * spec.top_k * spec.expert_params
    t_mx = hrm.gpu_experts_time(spec, hw, 2048, "bf16", "mxfp4", prefill=True)
    assert t_mx == pytest.approx(flops / 1.5e14, rel=1e-9)  # compute-bound at this size
    assert hrm.gpu_experts_time(spec, hw, 65536, "bf16", "bf16", prefill=True) == pytest.approx(
        2 * 65536 * spec.top_k * spec.expert_params / 5e14, rel=1e-9)  # dense: the end bucket's best, compute-bound
    dense_only = hw.with_overrides(expert_ffn_rates=rows[:1])
    assert hrm.gpu_experts_time(spec, dense_only, 2048, "bf16", "mxfp4", prefill=True) == pytest.approx(
        flops / 3e14, rel=1e-9)  # no MXFP4 measurement: gpu_expert_flops
    path = tmp_path / "p.yaml"
    hw.save(str(path))
    text = path.read_text()
    assert text.count("weights: mxfp4") == 2 and "weights: dense" not in text
    assert HardwareProfile.load(str(path)).expert_ffn_rates == tuple(rows)
    with pytest.raises(HardwareError, match="weights: expected one of dense, mxfp4"):
        ExpertFFNRate(*shape, "bf16", 16, weights="int4")


def test_mxfp4_rate_probe_times_the_mxfp4_kernel_per_bucket(monkeypatch):
    """measure_mxfp4_ffn_rates: one weights: mxfp4 entry per (shape, T), FLOPs 2 T k 3 D F over the best time (a fake
    timer: 0.5 s), the kernel called on the shape's pages; a failing call gives rate 0 and a line. mxfp4_shapes_of
    keeps only the MXFP4 models (gpt-oss by name, not Mixtral)."""
    from lightning_moe.kernels import mxfp4

    seen = []
    monkeypatch.setattr(mxfp4, "fused_experts_mxfp4_triton", lambda x, pages, lay, w, ids, **kw:
                        seen.append((tuple(x.shape), x.dtype, lay.hidden_size, lay.intermediate_size, tuple(pages.shape),
                                     tuple(ids.shape))))
    monkeypatch.setattr(profiler, "_best_time", lambda fn, repeats, sync: (fn(), 0.5)[1])
    got = profiler.measure_mxfp4_ffn_rates([(64, 32, 4, 2)], tokens=(3, 8), device="cpu", repeats=1)
    assert [(r.tokens, r.weights, r.dtype, r.triton, r.grouped_mm) for r in got] == [
        (3, "mxfp4", "bf16", 2 * 3 * 2 * 3 * 64 * 32 / 0.5, 0.0), (8, "mxfp4", "bf16", 2 * 8 * 2 * 3 * 64 * 32 / 0.5, 0.0)]
    assert seen[0][:5] == ((3, 64), torch.bfloat16, 64, 32, seen[0][4]) and seen[0][4][0] == 4 and seen[0][5] == (3, 2)

    def fail(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(mxfp4, "fused_experts_mxfp4_triton", fail)
    lines = []
    got = profiler.measure_mxfp4_ffn_rates([(64, 32, 4, 2)], tokens=(3,), device="cpu", repeats=1, log=lines.append)
    assert got[0].triton == 0.0 and "failed (RuntimeError: no kernel here); rate 0" in lines[0]
    assert profiler.mxfp4_shapes_of(["gpt-oss-120b", "mixtral-8x7b", "gpt-oss-120b"]) == ((2880, 2880, 128, 4),)
    assert profiler.mxfp4_shapes_of(["mixtral-8x7b"]) == ()


def test_one_shapes_expert_rates_as_moe_batch_profile_measures_them(monkeypatch):
    """measure_shape_expert_ffn_rates (a job's missing entries, app.plan.with_model_expert_rates): `moe-batch
    profile`'s probes over EXPERT_FFN_TOKENS for one shape in the given dtype: dense (the kernels measured on the CPU
    here: grouped_mm and mm_loop), or MXFP4 pages at that dtype (activations and biases; a fake kernel here)."""
    from lightning_moe.kernels import mxfp4

    calls = []
    monkeypatch.setattr(profiler, "_best_time", lambda fn, repeats, sync: (fn(), 0.5)[1])
    monkeypatch.setattr(mxfp4, "fused_experts_mxfp4_triton", lambda x, pages, lay, w, ids, **kw:
                        calls.append((x.dtype, lay.bias_dtype)))
    dense = profiler.measure_shape_expert_ffn_rates((32, 48, 4, 2), "fp32", device="cpu")
    assert [r.tokens for r in dense] == list(profiler.EXPERT_FFN_TOKENS)
    assert {(r.shape, r.weights) for r in dense} == {((32, 48, 4, 2, "fp32"), "dense")}
    assert all(r.grouped_mm > 0 or r.mm_loop > 0 for r in dense)
    mx = profiler.measure_shape_expert_ffn_rates((64, 32, 4, 2), "fp16", "mxfp4", device="cpu")
    assert {(r.shape, r.weights) for r in mx} == {((64, 32, 4, 2, "fp16"), "mxfp4")} and all(r.triton > 0 for r in mx)
    assert calls == [(torch.float16, torch.float16)] * len(profiler.EXPERT_FFN_TOKENS)


def test_expert_ffn_table_index_matches_a_scan_of_every_entry():
    """expert_ffn_table reads an index made once per profile: for every committed profile, every shape, weight
    storage and kernel set it gives what a scan of all entries (filtered, then sorted by tokens) gives; a replaced
    profile gets its own index (no stale table)."""
    import dataclasses
    import glob
    import os

    from lightning_moe.policy import hardware
    from lightning_moe.policy.hardware import EXPERT_FFN_KERNELS, resolve_hardware

    def scan(hw, shape, kernels, weights):
        return tuple(sorted((r for r in hw.expert_ffn_rates if r.shape == shape and r.weights == weights
                             and r.best_rate_of(kernels) > 0), key=lambda r: r.tokens))

    paths = sorted(glob.glob(os.path.join(os.path.dirname(hardware.__file__), "profiles", "*.yaml")))
    assert paths
    for path in paths:
        hw = resolve_hardware(path)
        assert hw.expert_ffn_rates
        for shape in {r.shape for r in hw.expert_ffn_rates}:
            for weights in ("dense", "mxfp4"):
                for kernels in (EXPERT_FFN_KERNELS, ("triton",), ("grouped_mm",), EXPERT_FFN_KERNELS[1:]):
                    assert hw.expert_ffn_table(*shape, kernels, weights) == scan(hw, shape, kernels, weights)
        shape = hw.expert_ffn_rates[0].shape
        assert hw.expert_ffn_table(*shape)  # the index is made
        fewer = dataclasses.replace(hw, expert_ffn_rates=hw.expert_ffn_rates[1:])
        assert fewer.expert_ffn_table(*shape) == scan(fewer, shape, EXPERT_FFN_KERNELS, "dense")
        assert fewer == dataclasses.replace(hw, expert_ffn_rates=hw.expert_ffn_rates[1:])  # the index is no field
        r0 = hw.expert_ffn_rates[0]  # an MXFP4 entry of a dense entry's shape and tokens: kept apart by weights
        mixed = dataclasses.replace(hw, expert_ffn_rates=(dataclasses.replace(r0, weights="mxfp4", grouped_mm=0.0,
                                                                              mm_loop=0.0, triton=1e12),)
                                    + hw.expert_ffn_rates)
        for weights in ("dense", "mxfp4"):
            assert mixed.expert_ffn_table(*shape, weights=weights) == scan(mixed, shape, EXPERT_FFN_KERNELS, weights)
        assert len(mixed.expert_ffn_table(*shape, weights="mxfp4")) == 1
        rev = dataclasses.replace(hw, expert_ffn_rates=tuple(reversed(hw.expert_ffn_rates)))  # file order not by tokens
        assert rev.expert_ffn_table(*shape) == scan(rev, shape, EXPERT_FFN_KERNELS, "dense")
