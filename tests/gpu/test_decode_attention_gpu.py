"""kernels.decode_attention on CUDA: the compiled one-launch append + attention against its pure-torch reference
(fp32 1e-5, bf16 2e-2 relative) at awkward and Mixtral-8x7B decode shapes, no host sync in the launch, and
CGOPipe with gpu_attention="triton" equal to the serial executor (fp32 greedy tokens) and to its own torch path."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.kernels.decode_attention import (  # noqa: E402
    decode_append_attention_reference,
    decode_append_attention_triton,
)
from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402


def _case(B, Hq, Hkv, hd, max_cap, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(1, max_cap + 1, (B,), generator=g)
    pos = (torch.rand(B, generator=g) * cap).long().clamp(max=cap - 1)
    base, acc = torch.zeros(B, dtype=torch.int64), 0
    for r in torch.randperm(B, generator=g).tolist():
        base[r], acc = acc, acc + Hkv * int(cap[r])
    t = lambda *s: torch.randn(*s, generator=g).to(dtype).cuda()  # noqa: E731
    return t(B, Hq, hd), t(B, Hkv, hd), t(B, Hkv, hd), t(acc * hd), t(acc * hd), base.cuda(), cap.cuda(), pos.cuda()


@pytest.mark.parametrize("B,Hq,Hkv,hd,max_cap,window", [
    (1, 4, 1, 16, 1, None), (7, 8, 2, 24, 70, None), (33, 32, 8, 128, 300, None), (9, 8, 2, 64, 90, 17),
    (512, 32, 8, 128, 700, None),  # a Mixtral-8x7B GPU-attention micro-batch
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference_cuda(B, Hq, Hkv, hd, max_cap, window, dtype, tol):
    q, kn, vn, kf, vf, base, cap, pos = _case(B, Hq, Hkv, hd, max_cap, dtype, seed=B + hd)
    k1, v1, k2, v2 = kf.clone(), vf.clone(), kf.clone(), vf.clone()
    got = decode_append_attention_triton(q, kn, vn, k1, v1, base, cap, pos, window)
    want = decode_append_attention_reference(q, kn, vn, k2, v2, base, cap, pos, window)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < tol
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_with_sinks_matches_reference_cuda(window, dtype, tol):
    """gpt-oss's decode shape (64 query heads, 8 KV heads, hd 64, sliding 128 or full) with a sink logit per query
    head, some large enough to dominate their head."""
    q, kn, vn, kf, vf, base, cap, pos = _case(40, 64, 8, 64, 400, dtype, seed=5)
    sinks = torch.linspace(-4.0, 6.0, 64)[torch.randperm(64)].contiguous().cuda()
    k1, v1, k2, v2 = kf.clone(), vf.clone(), kf.clone(), vf.clone()
    got = decode_append_attention_triton(q, kn, vn, k1, v1, base, cap, pos, window, sinks=sinks)
    want = decode_append_attention_reference(q, kn, vn, k2, v2, base, cap, pos, window, sinks=sinks)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < tol
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_launch_does_not_synchronize():
    q, kn, vn, kf, vf, base, cap, pos = _case(64, 32, 8, 128, 200, torch.bfloat16, seed=3)
    decode_append_attention_triton(q, kn, vn, kf, vf, base, cap, pos)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode_append_attention_triton(q, kn, vn, kf, vf, base, cap, pos)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _prompts(n, seed=0, vocab=32000, maxlen=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, maxlen, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


@pytest.mark.parametrize("mu,n,gpu_attn", [(3, 4, 2), (11, 1, 1), (4, 3, 3)])
def test_cgopipe_triton_gpu_attention_equals_serial_fp32(tiny_dir, mu, n, gpu_attn):
    """fp32 greedy, ragged batch of 11 (several KV length groups per micro-batch), 16 steps: the one-launch GPU
    attention gives the serial executor's tokens."""
    prompts = _prompts(11)
    sp = DecodeSampling(max_new_tokens=16, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cuda").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=2, n_gpu_attn=gpu_attn, dtype="fp32", weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cuda", gpu_attention="triton")
    out = ex.generate(prompts, sp)
    assert any(mb.on_gpu and mb.kv.num_groups > 1 for mb in ex._micro_batches(prompts, 16, True, mu))
    ex.close()
    assert [o for o, _ in out] == [o for o, _ in ref]
