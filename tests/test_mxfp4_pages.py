"""gpt-oss's MXFP4 experts kept packed end to end on the CPU: loaded as MXFP4 pages (eagerly, or lazily through
ExpertsOnDisk), carried by CGOPipe's page pool / buffers / resident experts as one uint8 page per expert, and computed
by the serial executor (dequantized per layer) and CGOPipe (torch loop over unpacked pages; the MXFP4 Triton kernel
under Triton's interpreter). Every path gives the dequantize-on-load path's logits (fp32, 1e-4; the torch paths
bit for bit) and greedy tokens, and transformers' (holding transformers' dequantization of the same blocks).
"""

from __future__ import annotations

import pytest
import torch
from tests.test_family_gpt_oss import CGO_PROMPTS, PROMPTS, _mxfp4_checkpoint, make_hf_gpt_oss  # noqa: E402
from tests.support.hf_checkpoints import assert_scores_match, hf_greedy  # noqa: E402

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.mxfp4 import MXFP4PageLayout
from lightning_moe.model.quantized import MXFP4Experts, checkpoint_expert_scheme
from lightning_moe.model.spec import MoESpec
from lightning_moe.model.weights import ExpertsOnDisk, load_checkpoint
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """(MXFP4 checkpoint dir, transformers' model holding transformers' dequantization of its blocks)."""
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    path, model = make_hf_gpt_oss(d / "ckpt")
    return _mxfp4_checkpoint(path, d / "mxfp4", model)


def _cgopipe(path, resident=0, ffn="torch", packed=True, lazy=True):
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    pol = Policy(mu=2, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
    w = load_checkpoint(path, torch.float32, lazy_experts=lazy, packed_experts=packed)
    return CGOPipeExecutor(w, pol, "cpu", ffn=ffn)


def test_mxfp4_loads_packed_eagerly_and_lazily_and_dequantizes_to_the_load_path_exactly(mx):
    qdir, _ = mx
    assert checkpoint_expert_scheme(qdir) == "mxfp4"
    dense = load_checkpoint(qdir, torch.float32)  # the dequantize-on-load path (the default)
    packed = load_checkpoint(qdir, torch.float32, packed_experts=True)
    lazy = load_checkpoint(qdir, torch.float32, lazy_experts=True, packed_experts=True)
    spec = packed.spec
    for l in range(spec.num_layers):
        ex = packed.experts[l]
        assert isinstance(ex, MXFP4Experts) and isinstance(ex.layout, MXFP4PageLayout)
        assert ex.pages.shape == (spec.num_experts, ex.layout.page_bytes) and ex.scheme == "mxfp4"
        assert isinstance(lazy.experts[l], ExpertsOnDisk) and lazy.experts[l].layout == ex.layout
        assert torch.equal(lazy.experts[l].read().pages, ex.pages)
        got, want = ex.dequantize(torch.float32), dense.experts[l]
        for f in ("w1", "w3", "w2", "b1", "b3", "b2"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
    # 4.25 bits per weight plus biases, each page padded to 4096 bytes: far fewer bytes than the dense experts
    assert packed.expert_bytes == spec.num_layers * spec.num_experts * ex.layout.page_bytes < dense.expert_bytes


def test_serial_executor_on_packed_pages_equals_the_dequantize_on_load_path_and_transformers(mx):
    qdir, deq = mx
    ours = SerialExecutor(load_checkpoint(qdir, torch.float32, packed_experts=True), "cpu")
    ref = SerialExecutor(load_checkpoint(qdir, torch.float32), "cpu")
    for a, b in zip(ours.logits(PROMPTS), ref.logits(PROMPTS)):
        assert torch.equal(a, b)
    with torch.no_grad():
        hf = [deq(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    assert max((a - b).abs().max().item() for a, b in zip(ours.logits(PROMPTS), hf)) < 1e-4
    sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False)
    assert [o for o, _ in ours.generate(PROMPTS, sp)] == hf_greedy(deq, PROMPTS, 8)


@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_pages_mxfp4_and_equals_serial_and_transformers(mx, resident):
    """The pool holds one uint8 MXFP4 page per expert ("page"); 12 greedy tokens per row of a ragged batch equal
    transformers' and the serial executor's; prompt logprobs equal the serial executor's (1e-4)."""
    qdir, deq = mx
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    want = hf_greedy(deq, CGO_PROMPTS, 12)
    ex = _cgopipe(qdir, resident)
    lay = ex.weight_stream.page_layout
    assert isinstance(lay, MXFP4PageLayout) and ex.weight_stream.pool.layout.names == ("page",)
    assert ex.policy_summary()["expert_pages"] == "mxfp4"
    out = ex.generate(CGO_PROMPTS, sp)
    seqs = [p + [5, 6] for p in CGO_PROMPTS]
    lp = ex.prompt_logprobs(seqs)
    ex.close()
    assert [o for o, _ in out] == want
    assert ex.weight_stream.resident_count() == 3 * resident
    ref = SerialExecutor(load_checkpoint(qdir, torch.float32), "cpu").prompt_logprobs(seqs)
    assert_scores_match(lp, ref)


def test_grouped_kernels_over_mxfp4_pages_are_picked_or_refused_by_name(mx):
    """MXFP4 pages: the MXFP4 kernel computes gpt-oss's experts (triton / auto are not refused; auto on CUDA picks it);
    torch's grouped_mm has none and is refused by name; the dense (dequantized) path still refuses the grouped kernels."""
    from types import SimpleNamespace

    from lightning_moe.pipeline.expert_ffn import expert_ffn_for, grouped_kernels_refusal

    qdir, _ = mx
    spec = MoESpec.from_pretrained_dir(qdir)
    assert grouped_kernels_refusal(spec, "triton", "mxfp4") is None
    assert grouped_kernels_refusal(spec, "auto", "mxfp4") is None
    assert "torch's GEMMs (grouped_mm, mm_loop) have no MXFP4 kernel" in grouped_kernels_refusal(spec, "grouped_mm", "mxfp4")
    assert grouped_kernels_refusal(spec, "mm_loop", "mxfp4") == grouped_kernels_refusal(spec, "grouped_mm", "mxfp4")
    assert "expert biases" in grouped_kernels_refusal(spec, "triton")  # dequantized on load: dense pages
    cuda_auto = SimpleNamespace(expert_ffn="auto", device="cuda")
    assert expert_ffn_for(cuda_auto, spec, "mxfp4") == ("auto" if fm.triton_available() else "torch")
    assert expert_ffn_for(cuda_auto, spec) == "torch"
    with pytest.raises(ValueError, match=r"expert_ffn grouped_mm: torch's GEMMs \(grouped_mm, mm_loop\) have no MXFP4 kernel"):
        _cgopipe(qdir, ffn="grouped_mm")


@pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy deprecation inside the interpreter
def test_cgopipe_with_the_mxfp4_kernel_in_the_interpreter_equals_the_torch_loop(mx, monkeypatch):
    """CGOPipe's GroupedMXFP4ExpertFFN (paged and resident pages, each call skipping the other group's pairs), run by
    Triton's CPU interpreter: logits within 1e-4 of the dequantize-on-load path and the same greedy tokens."""
    import triton  # noqa: F401  (compiled mode first: see tests/test_kernels_ref.py's interpret fixture)

    from lightning_moe.pipeline.expert_ffn import GroupedMXFP4ExpertFFN, expert_ffn

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qdir, deq = mx
    ex = _cgopipe(qdir, resident=3)
    ws, spec = ex.weight_stream, ex.spec
    ex.expert_ffn = expert_ffn("triton", None, ws.paging, ws.page_layout, spec.num_experts, torch.float32, ex.device,
                               swiglu=(spec.swiglu_limit, spec.swiglu_alpha))
    assert isinstance(ex.expert_ffn, GroupedMXFP4ExpertFFN)
    prompts = CGO_PROMPTS[:4]
    seqs = [p + [5, 6] for p in prompts]
    lp = ex.prompt_logprobs(seqs)
    out = ex.generate(prompts, DecodeSampling(max_new_tokens=4, stop_at_eos=False))
    ex.close()
    assert ex.stats.extra.get("expert_ffn_decode_calls_triton", 0) > 0  # the kernel ran (counted per phase)
    ref = SerialExecutor(load_checkpoint(qdir, torch.float32), "cpu").prompt_logprobs(seqs)
    for (a, _), (b, _) in zip(lp, ref):
        assert (a - b).abs().max().item() < 1e-4
    assert [o for o, _ in out] == hf_greedy(deq, prompts, 4)


# ---------------------------------------------------------------------------------------------------
# the planner counts MXFP4 bytes
# ---------------------------------------------------------------------------------------------------
def test_planner_bytes_per_mxfp4_expert_equal_the_page_layout(mx):
    """MoESpec.expert_bytes("mxfp4") (what the HRM, the MILP and the memory model count) equals the bytes of the page
    the loader makes (kernels.mxfp4.mxfp4_page_layout with fp32 biases), for the registry's gpt-oss-20b / -120b and
    the tiny checkpoint; the memory model's host pool counts those bytes for every non-resident expert."""
    from lightning_moe.kernels.mxfp4 import mxfp4_page_layout
    from lightning_moe.policy import hrm
    from lightning_moe.policy.policy import Policy, Workload
    from lightning_moe.policy.registry import resolve_spec

    qdir, _ = mx
    w = load_checkpoint(qdir, torch.bfloat16, packed_experts=True)
    tiny = w.spec
    assert tiny.expert_bytes("mxfp4") == w.experts[0].layout.page_bytes
    for spec in (resolve_spec("gpt-oss-20b"), resolve_spec("gpt-oss-120b"), tiny):
        lay = mxfp4_page_layout(spec.hidden_size, spec.intermediate_size, torch.float32)
        assert spec.expert_bytes("mxfp4") == lay.page_bytes
    big = resolve_spec("gpt-oss-120b")
    assert big.expert_bytes("mxfp4") == 13254656  # 3 * 2880^2 * 17 / 32 + 8640 fp32 biases, padded to 4096
    pol = Policy(mu=8, n=2, prefill_mu=8, resident_experts=4, dtype="bf16", weight_quant="mxfp4")
    mem = hrm.memory_estimate(pol, big, Workload(prompt_len=128, gen_len=16))
    paged = big.num_moe_layers * (big.num_experts - 4)
    assert mem.cpu["pinned experts (not resident)"] == paged * big.expert_bytes("mxfp4")
    assert all(ph["dequantized expert scratch"] == 0 for ph in mem.gpu_phases.values())  # dequantized in registers


def test_plan_counts_mxfp4_for_the_hub_names_and_mxfp4_checkpoints(mx, capsys):
    """`moe-batch plan --model gpt-oss-120b` plans MXFP4 pages (the Hub's format; 120 GiB of host hold them), the -bf16
    alias and --quant bf16 plan bf16 experts (which do not fit); an MXFP4 checkpoint directory plans mxfp4 and refuses
    --quant int4 by name."""
    from tests.test_family_gpt_oss import _plan

    args = ["--gpu-memory", "24GiB", "--cpu-memory", "120GiB"]
    assert _plan(["--model", "gpt-oss-120b"] + args) == 0
    assert "expert pages                     mxfp4, 12.6 MiB per expert" in capsys.readouterr().out
    assert _plan(["--model", "gpt-oss-120b-bf16"] + args) == 2
    assert "infeasible: host memory 120.00 GiB < " in capsys.readouterr().err
    assert _plan(["--model", "gpt-oss-120b", "--quant", "bf16"] + args) == 2
    capsys.readouterr()
    qdir, _ = mx
    assert _plan(["--model", qdir] + args) == 0
    assert "expert pages                     mxfp4," in capsys.readouterr().out
    assert _plan(["--model", qdir, "--quant", "int4"] + args) != 0
    assert f"--quant int4 but {qdir} holds mxfp4 expert pages" in capsys.readouterr().err
