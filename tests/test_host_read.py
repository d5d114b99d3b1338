"""kernels.host_read: the zero-copy host-read kernel under Triton's CPU interpreter (exact copy: bit-identical to
``dst.copy_(src)``), its argument checks, and CGOPipe's attention_h2d switch. The CUDA runs (pinned memory read by
a compiled kernel, the executor in both modes) are in tests/gpu/test_host_read_gpu.py."""

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.host_read import BLOCK, copy_from_host_reference, copy_from_host_triton, host_read_available

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first in compiled mode, as tests/test_kernels_ref.py explains)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("shape", [(1,), (BLOCK - 1,), (BLOCK,), (BLOCK + 1,), (3, 4096), (7, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_copy_is_exact(interpret, shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    src = torch.randn(*shape, generator=g).to(dtype)
    dst = torch.full(shape, float("nan"), dtype=dtype)
    want = copy_from_host_reference(src, torch.empty_like(src))
    assert copy_from_host_triton(src, dst) is dst
    assert torch.equal(dst, want)  # every element, including the last partial block


@needs_triton
def test_interpreter_empty_is_a_no_op(interpret):
    src, dst = torch.empty(0, 8), torch.empty(0, 8)
    assert copy_from_host_triton(src, dst) is dst


def test_bad_arguments(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = torch.randn(4, 8)
    with pytest.raises(ValueError, match="differ"):
        copy_from_host_triton(src, torch.empty(4, 9))
    with pytest.raises(ValueError, match="differ"):
        copy_from_host_triton(src, torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        copy_from_host_triton(src.t(), torch.empty(8, 4))
    with pytest.raises(ValueError, match="CUDA"):  # compiled mode: dst must be on the GPU
        copy_from_host_triton(src, torch.empty(4, 8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_host_read_unavailable_without_cuda():
    assert host_read_available() is False


def test_executor_attention_h2d_checked(tiny_dir):
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    pol = Policy(mu=2, n=2, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    with pytest.raises(ValueError, match="attention_h2d"):
        CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", attention_h2d="zero")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", attention_h2d="kernel")
    assert ex.attention.attention_h2d == "dma"  # on the CPU there is nothing to copy: the setting is ignored
    ex.close()
