"""gpt-oss's MXFP4 experts kept packed on CUDA: CGOPipe pages one MXFP4 page per expert through the pinned pool and
computes them with the MXFP4 Triton kernel (kernels.mxfp4.fused_experts_mxfp4_triton, expert_ffn triton and auto);
fp32 prompt logprobs within 1e-4 of the serial executor on the dequantize-on-load path, and greedy tokens equal to
transformers' model holding transformers' dequantization of the same blocks. Skipped without CUDA.
"""

from __future__ import annotations


import pytest
import torch

from tests.support.hf_checkpoints import hf_greedy  # noqa: E402
from tests.test_family_gpt_oss import CGO_PROMPTS, _mxfp4_checkpoint, make_hf_gpt_oss  # noqa: E402

from lightning_moe.kernels.mxfp4 import MXFP4PageLayout  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.expert_ffn import GroupedMXFP4ExpertFFN  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4_gpu")
    path, model = make_hf_gpt_oss(d / "ckpt")
    return _mxfp4_checkpoint(path, d / "mxfp4", model)


@pytest.mark.parametrize("ffn", ["triton", "auto"])
@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_cuda_mxfp4_kernel_equals_serial_and_transformers(mx, ffn, resident):
    qdir, deq = mx
    pol = Policy(mu=2, n=4, prefill_mu=2, resident_experts=resident, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(qdir, torch.float32, lazy_experts=True, packed_experts=True), pol, "cuda",
                         ffn=ffn)
    seqs = [p + [5, 6] for p in CGO_PROMPTS]
    try:
        assert isinstance(ex.weight_stream.page_layout, MXFP4PageLayout)
        assert isinstance(ex.expert_ffn, GroupedMXFP4ExpertFFN)
        out = ex.generate(CGO_PROMPTS, DecodeSampling(max_new_tokens=12, stop_at_eos=False))
        lp = ex.prompt_logprobs(seqs)
    finally:
        ex.close()
    assert ex.stats.extra.get("expert_ffn_decode_calls_triton", 0) > 0
    assert [o for o, _ in out] == hf_greedy(deq, CGO_PROMPTS, 12)
    ref = SerialExecutor(load_checkpoint(qdir, torch.float32), "cuda").prompt_logprobs(seqs)
    for (a, _), (b, _) in zip(lp, ref):
        assert (a.cpu() - b.cpu()).abs().max().item() < 1e-4


def test_serial_cuda_on_packed_mxfp4_pages_equals_the_dequantize_on_load_path(mx):
    qdir, _ = mx
    seqs = [p + [5, 6] for p in CGO_PROMPTS]
    a = SerialExecutor(load_checkpoint(qdir, torch.float32, packed_experts=True), "cuda").prompt_logprobs(seqs)
    b = SerialExecutor(load_checkpoint(qdir, torch.float32), "cuda").prompt_logprobs(seqs)
    for (x, _), (y, _) in zip(a, b):
        assert torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("gpu_attention", ["torch", "triton"])
def test_cgopipe_cuda_gpu_attention_micro_batches_with_sinks_equal_transformers(mx, gpu_attention):
    """GPU-attention micro-batches of an attention-sinks model (2 of 4 keep their KV on the GPU; sliding and full
    layers): the family's torch attention per length group, or the one-launch Triton kernel with the sinks; greedy
    tokens equal transformers' (fp32)."""
    qdir, deq = mx
    pol = Policy(mu=2, n=4, prefill_mu=2, n_gpu_attn=2, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(qdir, torch.float32, lazy_experts=True, packed_experts=True), pol, "cuda",
                         ffn="triton", gpu_attention=gpu_attention)
    try:
        out = ex.generate(CGO_PROMPTS, DecodeSampling(max_new_tokens=12, stop_at_eos=False))
        assert sum(mb.on_gpu for mb in ex._micro_batches(CGO_PROMPTS, 12, True, 2)) == 2
    finally:
        ex.close()
    assert [o for o, _ in out] == hf_greedy(deq, CGO_PROMPTS, 12)
