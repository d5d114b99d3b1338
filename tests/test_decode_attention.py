"""kernels.decode_attention (one-launch append + GQA decode attention over a ragged flat KV cache) under Triton's CPU
interpreter: the kernel against its pure-torch reference and against GroupedKVCache's per-group torch path
(model.layers.decode_attention), on awkward shapes; its argument checks. Tolerances: fp32 1e-5 relative (the
kernel's online softmax vs a one-shot softmax), bf16 2e-2 (the torch path rounds scores and probabilities to bf16).
The CUDA runs are in tests/gpu/test_decode_attention_gpu.py."""

import pytest
import torch

from lightning_moe.kernels import fused_moe as fm
from lightning_moe.kernels.decode_attention import BLOCK_N, decode_append_attention_reference, decode_append_attention_triton
from lightning_moe.model import layers as M
from lightning_moe.model.spec import MoESpec
from lightning_moe.pipeline.kv_cache import GroupedKVCache

needs_triton = pytest.mark.skipif(not fm.triton_available(), reason="triton not installed")


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter (triton imported first in compiled mode, as tests/test_kernels_ref.py explains)."""
    import triton  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")


def ragged_case(B, Hq, Hkv, hd, caps, pos, dtype, seed):
    """Random flat caches with rows laid out in a shuffled order (bases not monotone in the row index)."""
    g = torch.Generator().manual_seed(seed)
    caps, pos = torch.tensor(caps), torch.tensor(pos)
    base, acc = torch.zeros(B, dtype=torch.int64), 0
    for r in torch.randperm(B, generator=g).tolist():
        base[r], acc = acc, acc + Hkv * int(caps[r])
    kf, vf = torch.randn(acc * hd, generator=g).to(dtype), torch.randn(acc * hd, generator=g).to(dtype)
    q = torch.randn(B, Hq, hd, generator=g).to(dtype)
    kn, vn = torch.randn(B, Hkv, hd, generator=g).to(dtype), torch.randn(B, Hkv, hd, generator=g).to(dtype)
    return q, kn, vn, kf, vf, base, caps, pos


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("B,Hq,Hkv,hd,caps,pos,window", [
    (1, 4, 1, 16, [5], [0], None),  # one row, empty cache: attends over the new token alone
    (3, 8, 2, 32, [40, 7, 19], [39, 3, 18], None),  # rows filled to their last position
    (2, 6, 2, 24, [2 * BLOCK_N + 3, 9], [2 * BLOCK_N + 1, 8], None),  # hd not a power of 2; > 2 position blocks
    (4, 4, 4, 16, [11, 3, 30, 17], [10, 1, 25, 16], None),  # G = 1 (MHA)
    (3, 8, 2, 32, [50, 12, 33], [45, 11, 2], 4),  # sliding window, shorter and longer than the rows
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_reference(interpret, B, Hq, Hkv, hd, caps, pos, window, dtype, tol):
    q, kn, vn, kf, vf, base, cap, p = ragged_case(B, Hq, Hkv, hd, caps, pos, dtype, seed=B * hd + Hq)
    k1, v1, k2, v2 = kf.clone(), vf.clone(), kf.clone(), vf.clone()
    got = decode_append_attention_triton(q, kn, vn, k1, v1, base, cap, p, window)
    want = decode_append_attention_reference(q, kn, vn, k2, v2, base, cap, p, window)
    assert got.shape == (B, Hq * hd) and got.dtype == dtype
    assert rel_err(got, want) < tol
    assert torch.equal(k1, k2) and torch.equal(v1, v2)  # the append wrote exactly the new k / v, nothing else
    assert not torch.equal(k1, kf)


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_with_sinks_matches_reference_and_the_model_math(interpret, dtype, tol, window):
    """Per-head sink logits (gpt-oss) in the kernel's softmax: against the reference (sinks appended to the scores)
    and against ``model.layers.decode_attention(..., sinks=)`` (the family's math, checked against transformers in
    tests/test_family_gpt_oss.py) over the same cache; sinks from -4 to +6 (a sink that dominates a head included);
    the output buffer's rows are not read (the wrapper allocates it). Without the sinks the result differs."""
    B, Hq, Hkv, hd = 5, 8, 2, 24
    caps, pos = [40, 7, 19, 2 * BLOCK_N + 3, 4], [39, 3, 18, 2 * BLOCK_N + 1, 0]
    q, kn, vn, kf, vf, base, cap, p = ragged_case(B, Hq, Hkv, hd, caps, pos, dtype, seed=11)
    sinks = torch.linspace(-4.0, 6.0, Hq)[torch.randperm(Hq)].contiguous()
    k1, v1, k2, v2 = kf.clone(), vf.clone(), kf.clone(), vf.clone()
    got = decode_append_attention_triton(q, kn, vn, k1, v1, base, cap, p, window, sinks=sinks)
    want = decode_append_attention_reference(q, kn, vn, k2, v2, base, cap, p, window, sinks=sinks)
    assert rel_err(got, want) < tol and torch.equal(k1, k2) and torch.equal(v1, v2)
    Smax = max(caps)
    K = torch.zeros(B, Hkv, Smax, hd, dtype=dtype)
    V = torch.zeros_like(K)
    for r in range(B):
        blk = base[r] + torch.arange(Hkv)[:, None] * cap[r] + torch.arange(caps[r])  # [Hkv, cap]
        K[r, :, :caps[r]], V[r, :, :caps[r]] = k1.view(-1, hd)[blk], v1.view(-1, hd)[blk]
    model = M.decode_attention(q, K, V, p + 1, window, sinks=sinks)
    assert rel_err(got, model) < tol
    plain = decode_append_attention_triton(q, kn, vn, kf.clone(), vf.clone(), base, cap, p, window)
    assert rel_err(plain, got) > 10 * tol


@needs_triton
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6])
def test_grouped_cache_one_launch_equals_per_group_torch_path(interpret, dtype, tol, window):
    """GroupedKVCache.append_attend_triton == append + attend with model.layers.decode_attention (the executor's torch
    path) for 13 rows in 4 length groups over 2 decode steps; the caches end identical."""
    spec = MoESpec(name="t", model_type="mixtral", vocab_size=32, hidden_size=64, intermediate_size=32, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=128, sliding_window=window)
    g = torch.Generator().manual_seed(7)
    prompt = [int(x) for x in torch.randint(1, 30, (13,), generator=g)]
    a = GroupedKVCache(spec, [n + 2 for n in prompt], dtype, max_groups=4)
    b = GroupedKVCache(spec, [n + 2 for n in prompt], dtype, max_groups=4)
    assert a.num_groups == 4
    for l in range(2):
        for r, n in enumerate(prompt):
            k, v = torch.randn(n, 2, 8, generator=g).to(dtype), torch.randn(n, 2, 8, generator=g).to(dtype)
            a.write_prefill(l, r, k, v)
            b.write_prefill(l, r, k, v)
    for c in (a, b):
        c.lengths[:] = torch.tensor(prompt)
    for _ in range(2):
        for l in range(2):
            q = torch.randn(13, 8, 8, generator=g).to(dtype)
            k, v = torch.randn(13, 2, 8, generator=g).to(dtype), torch.randn(13, 2, 8, generator=g).to(dtype)
            got = a.append_attend_triton(l, q, k, v, a.lengths.clone())
            b.append(l, torch.arange(13), k, v)
            want = b.attend(l, q, b.lengths + 1, lambda qg, K, V, n: M.decode_attention(qg, K, V, n, window))
            assert rel_err(got, want) < tol
        for c in (a, b):
            c.lengths += 1
    for l in range(2):
        assert torch.equal(a.k_flat[l], b.k_flat[l]) and torch.equal(a.v_flat[l], b.v_flat[l])
    with pytest.raises(ValueError, match="KV cache full"):  # every row now at its final length
        a.append_attend_triton(0, q, k, v, a.lengths.clone())


def test_grouped_cache_flat_layout():
    """The group tensors are views of one flat array per layer, and (row_base, row_cap) address each row's block."""
    spec = MoESpec(name="t", model_type="mixtral", vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=4, num_experts=4, top_k=2, rope_theta=1e4, rms_norm_eps=1e-5,
                   max_position_embeddings=64)
    c = GroupedKVCache(spec, [3, 20, 4, 19, 11], torch.float32, max_groups=3)
    flat = c.k_flat[0].view(-1, 4)
    for gi, rows in enumerate(c.rows):
        assert c.k[0][gi].data_ptr() >= c.k_flat[0].data_ptr() and c.k[0][gi].is_contiguous()
        for slot, r in enumerate(rows.tolist()):
            c.k[0][gi][slot, 1, 2] = float(100 + r)  # KV head 1, position 2 of row r
            assert c.row_cap[r] == c.sizes[gi]
            assert flat[c.row_base[r] + 1 * c.row_cap[r] + 2, 0] == 100 + r
    assert c.k_flat[0].numel() == c.padded_positions * 2 * 4 and c.nbytes == 2 * c.k_flat[0].numel() * 4


@needs_triton
def test_argument_errors(interpret):
    q, kn, vn, kf, vf, base, cap, p = ragged_case(2, 4, 2, 16, [5, 6], [1, 2], torch.float32, seed=1)
    ok = (q, kn, vn, kf, vf, base, cap, p)
    bad = [
        ((q[:, :3], kn, vn, kf, vf, base, cap, p), "multiple"),
        ((q, kn.double(), vn.double(), kf, vf, base, cap, p), "share"),
        ((q, kn, vn, kf[:-1], vf[:-1], base, cap, p), "hd-vectors"),
        ((q, kn, vn, kf, vf[:-16], base, cap, p), "differ"),
        ((q, kn, vn, kf, vf, base.float(), cap, p), "row_base"),
        ((q, kn, vn, kf, vf, base, cap[:1], p), "row_cap"),
        ((q, kn, vn, kf.view(-1, 16), vf, base, cap, p), "1-D"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            decode_append_attention_triton(*args)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_append_attention_triton(*ok, sliding_window=0)
    for sinks in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            decode_append_attention_triton(*ok, sinks=sinks)
    with pytest.raises(ValueError, match="full"):
        decode_append_attention_reference(q, kn, vn, kf, vf, base, cap, torch.tensor([5, 0]))


def test_cuda_required_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kn, vn, kf, vf, base, cap, p = ragged_case(1, 2, 1, 16, [3], [0], torch.float32, seed=2)
    with pytest.raises(ValueError, match="CUDA"):
        decode_append_attention_triton(q, kn, vn, kf, vf, base, cap, p)


def test_executor_rejects_unknown_gpu_attention(tiny_dir):
    from lightning_moe.model.weights import load_checkpoint
    from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
    from lightning_moe.policy.policy import Policy

    pol = Policy(mu=2, n=1, prefill_mu=2, dtype="fp32", weight_quant="fp32")
    with pytest.raises(ValueError, match="gpu_attention"):
        CGOPipeExecutor(load_checkpoint(tiny_dir, torch.float32), pol, "cpu", gpu_attention="flash")
