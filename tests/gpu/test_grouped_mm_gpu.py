"""The grouped_mm expert FFN on CUDA (issue 22; written in a CPU-only session, NOT yet run on a GPU:
run it first on a new CUDA host). What the CPU tests cannot cover: CUTLASS's grouped GEMM
itself (bf16, 16-byte aligned operands), rows past the last offset left unwritten (the skip bucket), no host sync,
and the page buffers' strided views on the device.
Run on a CUDA host: ``python -m pytest tests/gpu -m gpu``."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels.fused_moe import (experts_ffn_reference, fused_experts_grouped_mm,  # noqa: E402
                                             fused_experts_triton, grouped_mm_available, grouped_mm_unsupported)
from lightning_moe.model.quantize import quantize_checkpoint  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


def _inputs(T, D=512, Fd=1024, E=8, k=2, empty=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, Fd, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, Fd, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, Fd, device="cuda", generator=g) / Fd**0.5).bfloat16()
    scores = torch.rand(T, E, device="cuda", generator=g)
    if empty is not None:
        scores[:, empty] = -1.0
    wts, ids = torch.topk(scores.softmax(-1), k, dim=-1)
    return x, w1, w3, w2, wts, ids


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T", [1, 33, 512, 4096])
def test_grouped_mm_matches_reference_and_triton(T):
    assert grouped_mm_available("cuda")
    x, w1, w3, w2, wts, ids = _inputs(T, empty=3)
    assert grouped_mm_unsupported(x, w1, w3, w2) is None
    ref = experts_ffn_reference(x.float(), w1.float(), w3.float(), w2.float(), wts, ids)
    gmm = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)
    tri = fused_experts_triton(x, w1, w3, w2, wts, ids)
    assert torch.isfinite(gmm).all() and _rel(gmm, ref) < 1e-2 and _rel(gmm, tri) < 1e-2
    for chunks in (1, 4):
        assert _rel(fused_experts_grouped_mm(x, w1, w3, w2, wts, ids, gate_up_chunks=chunks), ref) < 1e-2


def test_grouped_mm_skip_rows_and_no_host_sync():
    """Two groups with the skip id sum to one call (the skip bucket's unwritten rows add exactly 0), and a call
    with validate=False makes no host sync (set_sync_debug_mode('error'))."""
    x, w1, w3, w2, wts, ids = _inputs(300, seed=1)
    ref = fused_experts_grouped_mm(x, w1, w3, w2, wts, ids)
    a = ids < 5
    la = torch.where(a, ids, torch.full_like(ids, 5))
    lb = torch.where(~a, ids - 5, torch.full_like(ids, 3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ya = fused_experts_grouped_mm(x, w1[:5], w3[:5], w2[:5], wts, la, validate=False, skip=True)
        yb = fused_experts_grouped_mm(x, w1[5:], w3[5:], w2[5:], wts, lb, validate=False, skip=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(ya).all() and torch.isfinite(yb).all() and _rel(ya + yb, ref) < 1e-2
    none = fused_experts_grouped_mm(x, w1[:5], w3[:5], w2[:5], wts, torch.full_like(ids, 5), skip=True)
    assert torch.equal(none, torch.zeros_like(none))
    assert "bfloat16 only" in grouped_mm_unsupported(x.half(), w1.half(), w3.half(), w2.half())


def _seqs(n=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (int(m),), generator=g).tolist() for m in torch.randint(2, 40, (n,), generator=g)]


@pytest.mark.parametrize("kernel", ["grouped_mm", "mm_loop"])
@pytest.mark.parametrize("scheme", ["bf16", "int4"])
@pytest.mark.parametrize("resident", [0, 3])
def test_cgopipe_grouped_mm_matches_torch_path(tiny_dir, tmp_path, scheme, resident, kernel):
    """CGOPipe with expert_ffn grouped_mm (or mm_loop, the per-expert library GEMMs) over the page buffers' views
    (dense) or the dequantized scratch (int4): per-token log-probs within the bf16 tolerance of
    tests/gpu/test_cgopipe_triton_gpu.py (relative L2 <= 2e-2); every expert call ran that kernel."""
    path = tiny_dir if scheme == "bf16" else quantize_checkpoint(tiny_dir, str(tmp_path / scheme), experts="int4").dst
    out = {}
    for ffn in ("torch", kernel):
        pol = Policy(mu=3, n=3, prefill_mu=3, resident_experts=resident, dtype="bf16", weight_quant=scheme)
        ex = CGOPipeExecutor(load_checkpoint(path, torch.bfloat16), pol, "cuda", ffn=ffn)
        out[ffn] = torch.cat([lp for lp, _ in ex.prompt_logprobs(_seqs())])
        if ffn == kernel:
            calls = {k: v for k, v in ex.stats.extra.items() if k.startswith("expert_ffn_prefill_calls_")}
            assert calls.get(f"expert_ffn_prefill_calls_{kernel}", 0) > 0 and len(calls) == 1, calls
        ex.close()
    err = _rel(out[kernel], out["torch"])
    assert torch.isfinite(out[kernel]).all() and err < 2e-2, f"relative L2 error {err:.2e}"
