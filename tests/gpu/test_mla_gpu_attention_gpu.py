"""Multi-head latent attention (DeepSeek-V2 / V3) in CGOPipe on CUDA with GPU-attention micro-batches: a latent cache
on the GPU and the family's torch latent attention per length group. fp32 greedy tokens equal the serial executor's
on CUDA (itself tied to transformers in tests/test_family_deepseek.py), with 1 and 2 of 4 micro-batches on the GPU,
gpu_attention torch and triton (MLA has no Triton decode kernel: the same torch path). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.test_family_deepseek import CASES, CGO_PROMPTS, make_hf_deepseek  # noqa: E402

from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=[next(c for c in CASES if c.startswith("v2")),
                                        next(c for c in CASES if c.startswith("v3"))])
def ds(request, tmp_path_factory):
    version, kw = CASES[request.param]
    path, _ = make_hf_deepseek(tmp_path_factory.mktemp("ds_gpu") / "ckpt", version, seed=3 + len(request.param), **kw)
    return path


@pytest.mark.parametrize("gpu_attn,gpu_attention", [(1, "torch"), (2, "torch"), (2, "triton")])
def test_cgopipe_mla_gpu_attention_micro_batches_equal_serial_fp32(ds, gpu_attn, gpu_attention):
    sp = DecodeSampling(max_new_tokens=12, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(ds, torch.float32), "cuda").generate(CGO_PROMPTS, sp)
    pol = Policy(mu=2, n=4, prefill_mu=2, n_gpu_attn=gpu_attn, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(ds, torch.float32), pol, "cuda", gpu_attention=gpu_attention)
    try:
        out = ex.generate(CGO_PROMPTS, sp)
        assert sum(mb.on_gpu for mb in ex._micro_batches(CGO_PROMPTS, 12, True, 2)) == gpu_attn
    finally:
        ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
