"""GPU acceptance through the user path: ``moe-batch run JOB.yaml`` in subprocesses on ``device: cuda``.

A small Mixtral-shaped checkpoint (8 layers, hidden 1024, expert width 3584, 8 experts top-2, GQA 8/2, vocab
32000: ~1.6 GB, sharded) is written once per module with ``tests/support/make_checkpoint.py`` and quantized with
``moe-batch quantize``. Every mode (generate, loglikelihood, multiple_choice, perplexity) runs on bf16 and int4
pages with ``policy: auto`` under a GPU cap smaller than the model; then ``device: cuda:0`` with ``gpu_memory``,
an explicit policy that fits, an oversized explicit policy (refused, exit 2, before any weight is read: the
checkpoint it runs on has empty weight files), an inline policy with an unknown key (refused, exit 2), and
cgopipe (``expert_ffn: torch``) against the serial executor token for token. About 15 runs, ~2-3 minutes.

The helpers (``make_ckpts``, ``write_mode_job``, ``run_cli``...) also work on the CPU (``run_cli(...,
"device=cpu")``); the tests themselves are GPU-only (tests/gpu/conftest.py skips them without CUDA).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support import make_checkpoint  # noqa: E402
from tests.support import suite_jobs as sj  # noqa: E402

DIMS = make_checkpoint.Dims(layers=8, hidden=1024, intermediate=3584, heads=8, kv_heads=2, experts=8, top_k=2,
                            vocab=32000, max_pos=4096)
CAP = "2GiB"  # < 1 GiB allocator reserve + non-experts + all experts (~2.5 GiB): some experts stream
CAP_BYTES = 2 * 2**30
N_REQ = 12
PROMPT_LEN = {"generate": 48, "loglikelihood": 64, "multiple_choice": 40, "perplexity": 128}
MODES = sj.MODES


def make_ckpts(root: str, dims: make_checkpoint.Dims = DIMS, gen_device: str = "cpu") -> dict:
    """Write the bf16 checkpoint (4 shards) and its int4 copy under ``root``; returns ``{"bf16": dir, "int4": dir}``."""
    bf16, int4 = os.path.join(root, "ckpt-bf16"), os.path.join(root, "ckpt-int4")
    shard_gib = make_checkpoint._numel((dims.vocab, dims.hidden)) * 2 * 2 / 4 / 2**30 + 1e-3
    res = make_checkpoint.write_checkpoint(bf16, dims, shard_gib=shard_gib, device=gen_device)
    assert res["shards"] >= 2, res
    cli(["quantize", bf16, int4, "--experts", "int4", "--quiet"], check=True)
    return {"bf16": bf16, "int4": int4}


def hollow_copy(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` whose safetensors files are empty: loading any weight fails, reading the
    config, tokenizer and index does not."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            open(os.path.join(dst, name), "wb").close()
        else:
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def cli(args: list[str], check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python3 -m lightning_moe.cli ARGS`` with this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-m", "lightning_moe.cli", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"moe-batch {' '.join(args)}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def write_data(work: str, mode: str, n: int = N_REQ) -> str:
    """The mode's JSONL (``n`` requests of PROMPT_LEN[mode] tokens) in ``work``; returns its path."""
    from lightning_moe.data.tokenize import load_tokenizer

    words = sj.one_token_words(load_tokenizer(make_checkpoint.tiny_tokenizer_dir()))
    return sj.write_jsonl(os.path.join(work, f"{mode}.jsonl"), sj.records_for(mode, words, n, PROMPT_LEN[mode]))


def write_mode_job(work: str, name: str, model: str, mode: str, data: str, **kw) -> tuple[str, str]:
    """Job YAML ``work/name.yaml`` for ``mode`` on ``model`` (cuda, bf16, cgopipe, auto at CAP, h200-host profile,
    8 new tokens; ``kw`` overrides job_dict's arguments). Returns (job path, output path)."""
    args = dict(device="cuda", dtype="bfloat16", executor="cgopipe", policy="auto", hardware=sj.H200_PROFILE,
                gpu_memory=CAP, cpu_memory="32GiB", max_new_tokens=8, name=name)
    args.update(kw)
    output = os.path.join(work, "results", name + ".jsonl")
    job = sj.job_dict(model, mode, data, output, **args)
    return sj.write_job(os.path.join(work, name + ".yaml"), job), output


def run_job(job: str, *sets: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``moe-batch run JOB --no-progress [--set S]...``."""
    args = ["run", job, "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return cli(args, timeout=timeout)


def check_done(p: subprocess.CompletedProcess, output: str, n: int, cap_bytes: int = CAP_BYTES,
               check_memory: bool = True) -> tuple[list[dict], dict]:
    """Assert exit 0, ``n`` records, report status done and (``check_memory``) reserved peak <= cap; returns
    (records, report)."""
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    recs = sj.read_jsonl(output)
    assert len(recs) == n and len({r["id"] for r in recs}) == n, f"{len(recs)} records of {n}"
    assert not [r for r in recs if "error" in r], [r for r in recs if "error" in r][:2]
    with open(sj.report_path(output)) as f:
        report = json.load(f)
    assert report["status"] == "done", report["status"]
    if check_memory:
        mem = report.get("memory")
        assert mem, "the run report has no 'memory' block"
        assert mem["cap_bytes"] == cap_bytes, mem
        assert mem["measured_peak_reserved_bytes"] <= mem["cap_bytes"], mem
    return recs, report


def refusal_line(p: subprocess.CompletedProcess) -> str:
    """Assert exit 2 with one ``moe-batch: error:`` line on stderr; returns it."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("moe-batch: error:"), p.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_ckpts(str(tmp_path_factory.mktemp("cli_gpu")), gen_device="cpu")  # this process never holds the GPU: its memory would count as the jobs' outside-torch use


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cli_gpu_data"))
    return {m: write_data(work, m) for m in MODES}


@pytest.mark.parametrize("ckpt", ["bf16", "int4"])
@pytest.mark.parametrize("mode", MODES)
def test_auto_policy_under_cap(ckpts, datasets, tmp_path, ckpt, mode):
    job, out = write_mode_job(str(tmp_path), f"{mode}-{ckpt}", ckpts[ckpt], mode, datasets[mode])
    _, report = check_done(run_job(job), out, N_REQ)
    assert report.get("policy"), "cgopipe on CUDA reports its policy"
    # the shipped measured profile has host issue times (no such note); it predates (H5')'s point of CPU attention
    # beside pinned copies, which a plan with CPU attention notes
    notes = report["predicted"]["notes"]
    assert all(n.startswith("note: hardware measured has no measured point of CPU attention") for n in notes), notes


def test_cuda0_with_gpu_memory(ckpts, datasets, tmp_path):
    job, out = write_mode_job(str(tmp_path), "gen-cuda0", ckpts["bf16"], "generate", datasets["generate"],
                              device="cuda:0", gpu_memory="2304MiB", hardware="h200")
    _, report = check_done(run_job(job), out, N_REQ, cap_bytes=2304 * 2**20)
    (note,) = report["predicted"]["notes"]  # the preset has no host issue times: the report says so
    assert note.startswith("note: hardware h200 has no host issue times"), note


def test_explicit_policy_that_fits(ckpts, datasets, tmp_path):
    pol = {"mu": 4, "n": 3, "prefill_mu": 4, "resident_experts": 2, "n_gpu_attn": 1}
    job, out = write_mode_job(str(tmp_path), "gen-explicit", ckpts["bf16"], "generate", datasets["generate"], policy=pol)
    _, report = check_done(run_job(job), out, N_REQ)
    p = report["policy"]
    assert (p["mu"], p["n"], p["n_gpu_attn"]) == (4, 3, 1), p


def test_oversized_policy_refused_before_weights(ckpts, datasets, tmp_path):
    hollow = hollow_copy(ckpts["bf16"], str(tmp_path / "hollow"))  # any weight read would fail differently
    pol = {"mu": 100000, "n": 8, "resident_experts": 8}
    job, out = write_mode_job(str(tmp_path), "gen-oversized", hollow, "generate", datasets["generate"], policy=pol)
    line = refusal_line(run_job(job))
    low = line.lower()
    assert "peak" in low, line
    assert any(s in line for s in ("2.0 GiB", "2.00 GiB", "2048 MiB", "2GiB", str(CAP_BYTES))), line
    assert not os.path.exists(out) or not sj.read_jsonl(out)


def test_unknown_policy_key_refused(ckpts, datasets, tmp_path):
    job, _ = write_mode_job(str(tmp_path), "gen-badkey", ckpts["bf16"], "generate", datasets["generate"],
                            policy={"mu": 4, "nn": 2})
    assert "nn" in refusal_line(run_job(job))


def test_cgopipe_tokens_equal_serial(ckpts, datasets, tmp_path):
    outs = {}
    for ex, extra in (("serial", {"executor": "serial"}), ("cgopipe", {"executor": "cgopipe", "expert_ffn": "torch"})):
        job, out = write_mode_job(str(tmp_path), f"gen-{ex}", ckpts["bf16"], "generate", datasets["generate"],
                                  max_new_tokens=16, **extra)
        recs, _ = check_done(run_job(job), out, N_REQ, check_memory=(ex == "cgopipe"))
        outs[ex] = {r["id"]: r["output_ids"] for r in recs}
    diff = [i for i in outs["serial"] if outs["serial"][i] != outs["cgopipe"][i]]
    assert not diff, f"{len(diff)} of {N_REQ} requests differ, e.g. {diff[0]}: serial {outs['serial'][diff[0]]} " \
                     f"cgopipe {outs['cgopipe'][diff[0]]}"


@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_cuda1_equals_cuda0_with_triton_kernels(ckpts, datasets, tmp_path):
    """A job on cuda:1 (the Triton expert kernels, int4 pages, the GPU cap) finishes under its cap with cuda:0's
    tokens: kernel launches and events made without a device follow the job's device (``app.gpu.use_device``)."""
    outs = {}
    for dev in ("cuda:0", "cuda:1"):
        job, out = write_mode_job(str(tmp_path), f"gen-{dev[-1]}", ckpts["int4"], "generate", datasets["generate"],
                                  device=dev, expert_ffn="triton")
        recs, report = check_done(run_job(job), out, N_REQ)
        assert report["device"] == dev, report["device"]
        outs[dev] = {r["id"]: r["output_ids"] for r in recs}
    assert outs["cuda:1"] == outs["cuda:0"]
