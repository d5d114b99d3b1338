"""CGOPipe with the Triton expert FFN (`expert_ffn: triton`, the default on CUDA) against the exact torch path,
dense bf16 pages and packed int4 / int2-up pages. Not bit-identical by design (fp32 accumulation in the kernel,
other summation order): compared on per-token log-probabilities with a bf16 tolerance (relative L2 <= 2e-2).
Written after the last GPU session of 2026-11-29: run it first on the next CUDA host."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model.quantize import quantize_checkpoint  # noqa: E402
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


def _seqs(n=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (int(m),), generator=g).tolist() for m in torch.randint(2, 40, (n,), generator=g)]


def _logprobs(path, ffn, quant, resident):
    pol = Policy(mu=3, n=3, prefill_mu=3, resident_experts=resident, dtype="bf16", weight_quant=quant)
    ex = CGOPipeExecutor(load_checkpoint(path, torch.bfloat16), pol, "cuda", ffn=ffn)
    out = ex.prompt_logprobs(_seqs())
    ex.close()
    return torch.cat([lp for lp, _ in out])


@pytest.mark.parametrize("scheme", ["bf16", "int4", "int2-up"])
@pytest.mark.parametrize("resident", [0, 3])
def test_triton_ffn_matches_torch_path(tiny_dir, tmp_path, scheme, resident):
    path = tiny_dir
    if scheme != "bf16":
        kw = {"experts": "int4", "up": "int2"} if scheme == "int2-up" else {"experts": "int4"}
        path = quantize_checkpoint(tiny_dir, str(tmp_path / scheme), **kw).dst
    ref = _logprobs(path, "torch", scheme, resident)
    tri = _logprobs(path, "triton", scheme, resident)
    err = (tri - ref).norm() / ref.norm()
    assert torch.isfinite(tri).all() and err < 2e-2, f"relative L2 error {err:.2e}"


@pytest.mark.parametrize("scheme", ["int4", "int2-up"])
@pytest.mark.parametrize("resident", [0, 3])
def test_triton_ffn_dequant_path_matches_torch_path(tiny_dir, tmp_path, scheme, resident):
    """Packed pages: all the layer's experts, paged and resident, are dequantized once per layer visit into the
    strategy's scratch [E, ...] (allocated once, up front, and reused), then one dense kernel: the same per-token
    log-probabilities as the torch path within the bf16 tolerance above (relative L2 <= 2e-2)."""
    kw = {"experts": "int4", "up": "int2"} if scheme == "int2-up" else {"experts": "int4"}
    path = quantize_checkpoint(tiny_dir, str(tmp_path / scheme), **kw).dst
    ref = _logprobs(path, "torch", scheme, resident)
    pol = Policy(mu=3, n=3, prefill_mu=3, resident_experts=resident, dtype="bf16", weight_quant=scheme)
    ex = CGOPipeExecutor(load_checkpoint(path, torch.bfloat16), pol, "cuda", ffn="triton")
    E, F, D = ex.spec.num_experts, ex.spec.intermediate_size, ex.spec.hidden_size
    assert [tuple(t.shape) for t in ex.expert_ffn.scratch] == [(E, F, D)] * 2 + [(E, D, F)]
    ptr = ex.expert_ffn.scratch[0].data_ptr()
    tri = torch.cat([lp for lp, _ in ex.prompt_logprobs(_seqs())])
    assert ex.expert_ffn.scratch[0].data_ptr() == ptr  # reused, never reallocated
    ex.close()
    err = (tri - ref).norm() / ref.norm()
    assert torch.isfinite(tri).all() and err < 2e-2, f"relative L2 error {err:.2e}"
