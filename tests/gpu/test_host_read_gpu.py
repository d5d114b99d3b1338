"""Zero-copy reads of pinned host memory on CUDA (kernels.host_read) and CGOPipe with attention_h2d="kernel":
the compiled kernel's copy is bit-identical to ``dst.copy_(src)``; the executor's tokens equal the serial
executor's (fp32 greedy) in both attention_h2d modes, and only "kernel" moves attention outputs by zero-copy."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels.host_read import BLOCK, copy_from_host_triton, host_read_available  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


def test_host_read_available_on_this_gpu():
    assert host_read_available("cuda") is True


@pytest.mark.parametrize("shape", [(1,), (BLOCK - 1,), (BLOCK + 1,), (384, 4096), (5, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_copy_is_exact(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    src = torch.randn(*shape, generator=g).to(dtype).pin_memory()
    dst = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    copy_from_host_triton(src, dst)
    assert torch.equal(dst.cpu(), src)


def test_pageable_source_refused():
    with pytest.raises(ValueError, match="pinned"):
        copy_from_host_triton(torch.randn(16), torch.empty(16, device="cuda"))


def _prompts(n, seed=0, vocab=32000, maxlen=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, maxlen, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("mode", ["kernel", "dma"])
@pytest.mark.parametrize("mu,n,gpu_attn", [(3, 4, 0), (3, 4, 1), (11, 1, 0)])
def test_cgopipe_attention_h2d_modes_equal_serial_fp32(tiny_dir, mode, mu, n, gpu_attn):
    """fp32 greedy, ragged batch of 11, 16 steps: tokens equal the serial executor's with either transfer of the
    CPU attention output; "kernel" counts zero-copy bytes (every CPU row, layer and decode step), "dma" none."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=16, stop_at_eos=False)
    w = load_checkpoint(tiny_dir, torch.float32)
    ref = SerialExecutor(w, "cuda").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=2, n_gpu_attn=gpu_attn, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cuda", attention_h2d=mode)
    assert ex.attention.attention_h2d == mode
    out = ex.generate(prompts, sp)
    cpu_rows = sum(len(mb.rows) for mb in ex._micro_batches(prompts, 16, False, mu) if not mb.on_gpu)
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
    spec = w.spec
    assert 0 < cpu_rows <= 11
    want = cpu_rows * spec.num_heads * spec.head_dim * 4 * spec.num_layers * 15 if mode == "kernel" else 0
    assert ex.stats.extra.get("attention_zero_copy_bytes", 0) == want


def test_kernel_copy_does_not_synchronize():
    """The zero-copy launch makes no synchronizing torch call (sync debug mode "error"), after a first launch that
    compiles the kernel."""
    src = torch.randn(384, 4096).to(torch.bfloat16).pin_memory()
    dst = torch.empty(384, 4096, dtype=torch.bfloat16, device="cuda")
    copy_from_host_triton(src, dst)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        copy_from_host_triton(src, dst)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
