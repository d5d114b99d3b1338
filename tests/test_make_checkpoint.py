"""tests/support/make_checkpoint.py (CLI: benchmarks/make_checkpoint.py): the checkpoints the GPU runs read, for every family it writes.

Each tiny checkpoint (2 layers, 8 experts, random bf16) must load in transformers' own class with no missing and
no unexpected key and hold the same tensors our loader reads; ``--zero-experts`` leaves the routed experts as holes
of a sparse file that read as zeros; ``--preset`` takes a registry model's numbers.
"""

import dataclasses
import json
import os

import pytest
import torch

from tests.support import make_checkpoint as mk  # noqa: E402

from lightning_moe.model.spec import MoESpec  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402

TINY = dict(layers=2, hidden=64, intermediate=48, heads=4, kv_heads=2, experts=8, top_k=2, vocab=32000, max_pos=256)
FAMILIES = {
    "mixtral": mk.Dims(**TINY),
    "qwen3_moe": mk.Dims(family="qwen3_moe", hd=32, **TINY),
    "olmoe": mk.Dims(family="olmoe", norm_topk_prob=False, **TINY),
    "qwen2_moe": mk.Dims(family="qwen2_moe", shared=40, norm_topk_prob=False, **TINY),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def written(request, tmp_path_factory):
    """(family, checkpoint dir) written with a shard size that splits it into several files."""
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    mk.write_checkpoint(out, FAMILIES[request.param], shard_gib=1.5 / 1024, log=open(os.devnull, "w"))
    return request.param, out


def test_transformers_loads_every_key_and_our_loader_reads_the_same(written):
    import transformers

    family, path = written
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    spec = MoESpec.from_pretrained_dir(path)
    assert spec.model_type == family and spec.num_experts == 8 and spec.num_layers == 2
    w = load_checkpoint(path, torch.bfloat16)
    sd = model.state_dict()
    assert torch.equal(w.embed, sd["model.embed_tokens.weight"])
    assert torch.equal(w.lm_head, sd["lm_head.weight"])
    e = w.experts[1]
    hf = model.model.layers[1].mlp.experts
    # transformers 5 holds the experts fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
    F = spec.intermediate_size
    assert torch.equal(e.w1[3], hf.gate_up_proj[3, :F]) and torch.equal(e.w3[3], hf.gate_up_proj[3, F:])
    assert torch.equal(e.w2[3], hf.down_proj[3])
    assert int(torch.count_nonzero(e.w1)) > 0


def test_a_missing_tokenizer_source_fails_before_any_weight_is_written(tmp_path, monkeypatch):
    """The tokenizer comes from the embedded tiny model (mistral-common builds it): where it cannot be made, the
    writer fails before the first shard (on the GPU host a full-size write took 26 s and 87 GB of sparse files first)."""
    from lightning_moe.model.tiny import MissingPackage

    def missing():
        raise MissingPackage("no mistral-common")

    monkeypatch.setattr(mk, "tiny_tokenizer_dir", missing)
    with pytest.raises(MissingPackage):
        mk.write_checkpoint(str(tmp_path / "ckpt"), FAMILIES["mixtral"], log=open(os.devnull, "w"))
    assert not (tmp_path / "ckpt").exists()


def test_zero_experts_are_holes_that_read_as_zeros(tmp_path):
    dims = dataclasses.replace(FAMILIES["mixtral"], vocab=512, intermediate=256)  # experts: most of the bytes
    dense = mk.write_checkpoint(str(tmp_path / "dense"), dims, log=open(os.devnull, "w"))
    sparse = mk.write_checkpoint(str(tmp_path / "sparse"), dims, log=open(os.devnull, "w"), zero_experts=True)
    assert sparse["bytes"] == dense["bytes"] and sparse["zero_bytes"] > 0.8 * sparse["bytes"]

    def blocks(d):
        return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d) if n.endswith(".safetensors"))

    assert blocks(sparse["path"]) < dense["bytes"] - sparse["zero_bytes"] + 2**20  # the holes take no disk
    a, b = load_checkpoint(sparse["path"], torch.bfloat16), load_checkpoint(dense["path"], torch.bfloat16)
    assert all(int(torch.count_nonzero(getattr(a.experts[i], f))) == 0 for i in range(2) for f in ("w1", "w2", "w3"))
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[1].wq, b.layers[1].wq)
    assert torch.equal(a.layers[0].router, b.layers[0].router)


def test_preset_takes_the_registry_numbers():
    d = mk.Dims.from_registry("qwen3-30b-a3b", layers=3)
    assert (d.family, d.layers, d.hidden, d.intermediate, d.experts, d.top_k, d.head_dim, d.kv_heads) == (
        "qwen3_moe", 3, 2048, 768, 128, 8, 128, 4)
    spec = mk.tensor_shapes(d)
    assert ("model.layers.2.mlp.experts.127.down_proj.weight", (2048, 768)) in spec
    q = mk.Dims.from_registry("qwen1.5-moe-a2.7b", layers=2)
    assert (q.family, q.shared, q.experts, q.norm_topk_prob) == ("qwen2_moe", 5632, 60, False)
    with pytest.raises(ValueError, match="glm4_moe"):
        mk.Dims.from_registry("glm-4.5-air", layers=2)


# DeepSeek-V2 / V3 (MLA) and gpt-oss: the tiny width of each registry preset (Dims.tiny: the same kinds of choice:
# q_lora_rank null (V2-Lite) or set (V3), shared experts, a dense first layer, grouped routing (V3), yarn;
# gpt-oss's sliding / full layers, biases, sinks, the fused interleaved experts), 2 layers, 8 experts
NEW_PRESETS = ("deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b")
PROMPTS = [[1, 17, 33, 5, 90, 41, 7, 64], [1, 9, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module", params=NEW_PRESETS[:3])
def written_new(request, tmp_path_factory):
    """(preset, dims, checkpoint dir) at the preset's tiny width, weights std 0.125 (not degenerate), sharded."""
    dims = mk.Dims.from_registry(request.param, layers=4).tiny()
    out = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    mk.write_checkpoint(out, dims, shard_gib=0.5 / 1024, std=0.125, log=open(os.devnull, "w"))
    return request.param, dims, out


def test_new_families_load_in_transformers_and_give_our_serial_logits(written_new):
    """transformers loads every key (no missing, no unexpected), holds the tensors our loader reads, and its fp32
    logits equal the serial executor's (max abs < 1e-4): the written layout is the real one."""
    import transformers

    from lightning_moe.pipeline.sampling import DecodeSampling

    from lightning_moe.pipeline.serial import SerialExecutor

    name, dims, path = written_new
    kw = {"attn_implementation": "eager"} if dims.family == "gpt_oss" else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    spec = MoESpec.from_pretrained_dir(path)
    assert spec.model_type == dims.family and spec.num_layers == 2 and spec.num_experts == 8
    w = load_checkpoint(path, torch.float32)
    moe = 1  # layer 0 is dense for DeepSeek
    hf = model.model.layers[moe].mlp.experts
    e, F = w.experts[moe], spec.intermediate_size
    if dims.family == "gpt_oss":  # [E, D, 2F], gate = columns 0::2
        assert torch.equal(e.w1, hf.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(e.w3, hf.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(e.w2, hf.down_proj.transpose(1, 2)) and torch.equal(e.b2, hf.down_proj_bias)
        assert spec.full_attention_layers == (1,) and spec.sliding_window == 4 and spec.attention_sinks
    else:  # transformers 5 holds them fused: gate_up_proj [E, 2F, D], gate rows first
        assert torch.equal(e.w1[3], hf.gate_up_proj[3, :F]) and torch.equal(e.w3[3], hf.gate_up_proj[3, F:])
        assert torch.equal(e.w2[3], hf.down_proj[3])
        assert spec.dense_layers == (0,) and spec.kv_lora_rank == 32 and spec.q_lora_rank == (24 if name == "deepseek-v3" else 0)
    ex = SerialExecutor(w, "cpu")
    ours = ex.logits(PROMPTS)
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = model(torch.tensor([p])).logits[0].float()
            worst = max(worst, (ours[i] - ref).abs().max().item())
    assert worst < 1e-4, worst
    assert max(o.abs().max().item() for o in ours) > 0.5  # not a degenerate model
    out = ex.generate(PROMPTS, DecodeSampling(max_new_tokens=3, stop_at_eos=False))
    assert [len(ids) for ids, _ in out] == [3, 3, 3]
    print(name, "max abs logit diff", worst)


def test_new_presets_read_as_the_registry_specs():
    """config.json of each registry preset (4 layers) reads as the registry's spec with those layers: every
    MLA / gpt-oss number the family reads (DeepSeek-V3's MTP layer is not written: never run)."""
    import dataclasses as dc

    from lightning_moe.model.families import read_spec
    from lightning_moe.policy.registry import resolve_spec

    for name in NEW_PRESETS:
        d = mk.Dims.from_registry(name, layers=4)
        got, want = read_spec(mk.config_dict(d), name), resolve_spec(name)
        want = dc.replace(want, num_layers=4, num_mtp_layers=0, dense_layers=tuple(i for i in want.dense_layers if i < 3),
                          full_attention_layers=tuple(i for i in want.full_attention_layers if i < 4),
                          bos_token_id=1, eos_token_id=2)
        diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dc.fields(want)
                if getattr(got, f.name) != getattr(want, f.name) and f.name not in ("vocab_size",)}
        assert not diff, (name, diff)


def test_new_presets_zero_experts_and_shapes(tmp_path):
    """--zero-experts: gpt-oss's fused experts and DeepSeek's per-expert tensors are holes that read as zeros."""
    for name in ("deepseek-v2-lite", "gpt-oss-20b"):
        dims = mk.Dims.from_registry(name, layers=4).tiny()
        res = mk.write_checkpoint(str(tmp_path / name), dims, log=open(os.devnull, "w"), zero_experts=True)
        assert res["zero_bytes"] > 0
        w = load_checkpoint(res["path"], torch.bfloat16)
        assert int(torch.count_nonzero(w.experts[1].w1)) == 0 and int(torch.count_nonzero(w.embed)) > 0
    shapes = dict(mk.tensor_shapes(mk.Dims.from_registry("gpt-oss-120b", layers=2)))
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (128, 2880, 2880)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    v2 = dict(mk.tensor_shapes(mk.Dims.from_registry("deepseek-v2-lite", layers=2)))
    assert v2["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048) and "model.layers.1.self_attn.q_a_proj.weight" not in v2
    assert v2["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert v2["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (2816, 2048)
    v3 = dict(mk.tensor_shapes(mk.Dims.from_registry("deepseek-v3", layers=4)))
    assert v3["model.layers.3.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert v3["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)


# gpt-oss --mxfp4: the experts as the Hub's MXFP4 blocks / scales (uint8), bf16 biases, quantization_config mxfp4
def _safetensors_header(path: str) -> tuple[int, dict]:
    """(data bytes, header) of one safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return os.path.getsize(path) - 8 - n, header


@pytest.fixture(scope="module")
def written_mxfp4(tmp_path_factory):
    """(dims, checkpoint dir): gpt-oss-120b's tiny width (hidden 64, F 96: multiples of 32) with --mxfp4, std 0.125,
    sharded into several files."""
    dims = dataclasses.replace(mk.Dims.from_registry("gpt-oss-120b", layers=4).tiny(), mxfp4=True)
    out = str(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt")
    mk.write_checkpoint(out, dims, shard_gib=0.5 / 1024, std=0.125, log=open(os.devnull, "w"))
    return dims, out


def test_mxfp4_experts_are_the_hubs_tensors_and_load_eagerly_and_packed(written_mxfp4):
    """The Hub's tensor names, shapes and dtypes (uint8 blocks / scales, bf16 biases), quantization_config mxfp4; our
    loader reads them dequantized on load and kept packed (MXFP4 pages), both exactly mxfp4_dequantize of the
    written blocks (gate / up de-interleaved); the dequantized weights' std is near --std."""
    from safetensors import safe_open

    from lightning_moe.kernels.mxfp4 import mxfp4_dequantize
    from lightning_moe.model.quantized import MXFP4Experts, checkpoint_expert_scheme

    dims, path = written_mxfp4
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == mk.MXFP4_QUANTIZATION_CONFIG
    assert checkpoint_expert_scheme(path) == "mxfp4"
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    p = "model.layers.1.mlp.experts."
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in wmap)
    t = {}
    for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
              "down_proj_scales", "down_proj_bias"):
        with safe_open(os.path.join(path, wmap[p + n]), "pt") as f:
            t[n] = f.get_tensor(p + n)
    E, D, F = 8, dims.hidden, dims.intermediate
    assert t["gate_up_proj_blocks"].shape == (E, 2 * F, D // 32, 16) and t["gate_up_proj_blocks"].dtype == torch.uint8
    assert t["gate_up_proj_scales"].shape == (E, 2 * F, D // 32) and t["gate_up_proj_scales"].dtype == torch.uint8
    assert t["down_proj_blocks"].shape == (E, D, F // 32, 16) and t["down_proj_scales"].shape == (E, D, F // 32)
    assert t["gate_up_proj_bias"].dtype == torch.bfloat16 and t["down_proj_bias"].shape == (E, D)
    c, _ = mk.mxfp4_scale_choice(0.125)
    assert set(t["gate_up_proj_scales"].unique().tolist()) == {c, c + 1}
    gu = mxfp4_dequantize(t["gate_up_proj_blocks"], t["gate_up_proj_scales"], torch.float32)  # [E, D, 2F]
    down = mxfp4_dequantize(t["down_proj_blocks"], t["down_proj_scales"], torch.float32)  # [E, F, D]
    eager = load_checkpoint(path, torch.float32).experts[1]
    packed = load_checkpoint(path, torch.float32, packed_experts=True).experts[1]
    assert isinstance(packed, MXFP4Experts)
    got = packed.dequantize(torch.float32)
    for w in (eager, got):
        assert torch.equal(w.w1, gu[..., 0::2].transpose(1, 2)) and torch.equal(w.w3, gu[..., 1::2].transpose(1, 2))
        assert torch.equal(w.w2, down.transpose(1, 2))
        assert torch.equal(w.b1, t["gate_up_proj_bias"][:, 0::2].float()) and torch.equal(w.b2, t["down_proj_bias"].float())
    for std in (0.125, 0.02):  # the scale choice: dequantized std within a factor 2 of --std (in fact a few %)
        b = mk.make_tensor("x_blocks", (E, 2 * F, D // 32, 16), 0, 0, std, "cpu")
        s = mk.make_tensor("x_scales", (E, 2 * F, D // 32), 1, 0, std, "cpu")
        got_std = mxfp4_dequantize(b, s, torch.float32).std().item()
        assert std / 2 < got_std < 2 * std and abs(got_std / std - 1) < 0.1, (std, got_std)
    assert mk.mxfp4_scale_choice(0.02)[0] == 119  # 127 - 8 or 127 - 7


def test_mxfp4_index_and_shards_count_each_tensors_real_bytes(written_mxfp4):
    """The index's total_size is the files' tensor data bytes, each tensor's span is its dtype's bytes (uint8
    blocks / scales: 1 per element), the shard plan is dtype-aware (gpt-oss-120b's MXFP4 experts ~4x smaller)."""
    _, path = written_mxfp4
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    total = 0
    for name in files:
        nbytes, header = _safetensors_header(os.path.join(path, name))
        total += nbytes
        spans = {n: h["data_offsets"][1] - h["data_offsets"][0] for n, h in header.items() if n != "__metadata__"}
        assert sum(spans.values()) == nbytes and all(index["weight_map"][n] == name for n in spans)
        for n, h in header.items():
            if n != "__metadata__":
                assert h["dtype"] == ("U8" if n.endswith(("_blocks", "_scales")) else "BF16")
                assert spans[n] == mk.tensor_nbytes(n, tuple(h["shape"]))
    assert index["metadata"]["total_size"] == total
    big = mk.Dims.from_registry("gpt-oss-120b", layers=2)
    shapes = {m: mk.tensor_shapes(dataclasses.replace(big, mxfp4=m)) for m in (False, True)}
    experts = {m: sum(mk.tensor_nbytes(n, s) for n, s in shapes[m] if mk.is_expert_tensor(n)) for m in shapes}
    assert 0.26 < experts[True] / experts[False] < 0.27  # 4.25 bits of 16 (+ bf16 biases)
    shard = 2**30
    for m in shapes:
        plan = mk.plan_shards(shapes[m], shard)
        sizes = [sum(mk.tensor_nbytes(*shapes[m][i]) for i in idx) for idx in plan]
        assert all(s <= shard or len(idx) == 1 for s, idx in zip(sizes, plan)), sizes
    n = 1000  # two uint8 tensors of n elements fill one 2n-byte shard; two bf16 ones need two
    assert mk.plan_shards([("a_blocks", (n,)), ("b_scales", (n,))], 2 * n) == [[0, 1]]
    assert mk.plan_shards([("a.weight", (n,)), ("b.weight", (n,))], 2 * n) == [[0], [1]]


def test_mxfp4_loads_in_transformers_and_gives_our_serial_logits(written_mxfp4):
    """transformers' GptOssForCausalLM loads the MXFP4 checkpoint (no missing / unexpected key; on a CPU with no
    ``kernels`` package it dequantizes the blocks) and its fp32 logits equal our serial executor's, dequantized on
    load and on packed pages (max abs < 1e-4)."""
    import transformers

    from lightning_moe.pipeline.serial import SerialExecutor

    _, path = written_mxfp4
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                        output_loading_info=True,
                                                                        attn_implementation="eager")
    except (ImportError, ValueError, RuntimeError) as e:  # an environment whose transformers cannot read MXFP4
        pytest.skip(f"transformers cannot load an MXFP4 checkpoint here: {e}")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    ours = SerialExecutor(load_checkpoint(path, torch.float32), "cpu").logits(PROMPTS)
    packed = SerialExecutor(load_checkpoint(path, torch.float32, packed_experts=True), "cpu").logits(PROMPTS)
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ref = model(torch.tensor([p])).logits[0].float()
            worst = max(worst, (ours[i] - ref).abs().max().item(), (packed[i] - ref).abs().max().item())
    assert worst < 1e-4, worst
    assert max(o.abs().max().item() for o in ours) > 0.5  # not a degenerate model


def test_mxfp4_zero_experts_and_other_families_refused(tmp_path, capsys):
    """--zero-experts --mxfp4: blocks, scales and biases are holes (zero blocks dequantize to zeros); --mxfp4 for a
    family other than gpt_oss is refused by name (the CLI and config_dict); cli_sweep never takes an MXFP4
    checkpoint for a bf16 one of the same dims, nor the reverse."""
    from benchmarks import cli_sweep

    dims = dataclasses.replace(mk.Dims.from_registry("gpt-oss-20b", layers=4).tiny(), mxfp4=True)
    res = mk.write_checkpoint(str(tmp_path / "z"), dims, log=open(os.devnull, "w"), zero_experts=True)
    assert res["zero_bytes"] > 0
    w = load_checkpoint(res["path"], torch.float32, packed_experts=True)
    assert int(torch.count_nonzero(w.experts[1].pages)) == 0
    deq = w.experts[1].dequantize(torch.float32)
    assert int(torch.count_nonzero(deq.w1)) == 0 and int(torch.count_nonzero(w.embed)) > 0
    assert cli_sweep._ckpt_matches(res["path"], dims)
    assert not cli_sweep._ckpt_matches(res["path"], dataclasses.replace(dims, mxfp4=False))
    bf16 = mk.write_checkpoint(str(tmp_path / "b"), dataclasses.replace(dims, mxfp4=False), log=open(os.devnull, "w"),
                               zero_experts=True)
    assert not cli_sweep._ckpt_matches(bf16["path"], dims)
    with pytest.raises(SystemExit) as e:
        mk.main([str(tmp_path / "q"), "--preset", "qwen3-30b-a3b", "--layers", "2", "--mxfp4"])
    assert e.value.code == 2 and "--mxfp4: MXFP4 experts are gpt_oss's" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "q")
    with pytest.raises(ValueError, match="MXFP4 experts are gpt_oss's"):
        mk.config_dict(dataclasses.replace(FAMILIES["mixtral"], mxfp4=True))


def test_size_flags_with_a_preset_are_refused(tmp_path, capsys):
    """A preset sets every size but --layers: a size flag beside it is an error naming the flags (it was silently
    ignored: a user asking for a small gpt-oss got the full-width one), before anything is written."""
    with pytest.raises(SystemExit) as e:
        mk.main([str(tmp_path / "p"), "--preset", "gpt-oss-20b", "--layers", "2", "--hidden", "64", "--top-k", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--hidden, --top-k: not with --preset gpt-oss-20b" in err, err
    assert not os.path.exists(tmp_path / "p")
    a = mk.build_parser().parse_args([str(tmp_path / "p"), "--preset", "gpt-oss-20b", "--layers", "2"])
    assert mk.dims_from_args(a).hidden == 2880  # the preset's width, --layers applied


def test_benchmarks_command_line_runs_from_anywhere(tmp_path):
    """benchmarks/make_checkpoint.py (the command line of tests/support/make_checkpoint.py) runs from a directory
    outside the repository, with no PYTHONPATH: it finds the root's tests.support and lightning_moe itself."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "make_checkpoint.py"), "--help"],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--zero-experts" in r.stdout and "--preset" in r.stdout
