"""Model math and checkpoint loading against transformers' own MixtralForCausalLM (the oracle)."""

import os

import torch

from lightning_moe.model import layers as M
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor


def test_checkpoint_is_sharded(hf_mixtral):
    path, _ = hf_mixtral
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))


def test_logits_equal_transformers_fp32(hf_mixtral):
    """Full-sequence logits within 1e-4 (max abs) of transformers in fp32, for several prompts."""
    path, model = hf_mixtral
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 17):
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        ours = ex.logits([ids])[0]
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_20_steps_equal_transformers(hf_mixtral):
    path, model = hf_mixtral
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    prompt = [1, 17, 33, 5, 90, 41]
    out, reason = ex.generate([prompt], DecodeSampling(max_new_tokens=20, stop_at_eos=False))[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert reason == "length" and len(out) == 20
    assert out == ref


def test_bf16_and_fp16_load_cast(hf_mixtral):
    path, _ = hf_mixtral
    for dt in (torch.bfloat16, torch.float16):
        w = load_checkpoint(path, dt)
        assert w.embed.dtype == dt and w.experts[0].w1.dtype == dt and w.experts[0].w1.shape == (4, 48, 32)


def test_ragged_batch_equals_alone_every_step(hf_mixtral):
    """Prompts of 3 and 12 tokens batched together give exactly the tokens each gives alone (>= 20 steps)."""
    path, _ = hf_mixtral
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    g = torch.Generator().manual_seed(7)
    p3, p12 = torch.randint(3, 128, (3,), generator=g).tolist(), torch.randint(3, 128, (12,), generator=g).tolist()
    sp = DecodeSampling(max_new_tokens=24, stop_at_eos=False)
    both = ex.generate([p3, p12], sp)
    alone3, alone12 = ex.generate([p3], sp)[0], ex.generate([p12], sp)[0]
    assert len(both[0][0]) == 24
    for step in range(24):  # compared at every decode step
        assert both[0][0][step] == alone3[0][step], f"short prompt differs at step {step}"
        assert both[1][0][step] == alone12[0][step], f"long prompt differs at step {step}"


def test_ragged_decode_matches_transformers_logits(hf_mixtral):
    """Each decode step's logits of a ragged batch match transformers run on each sequence alone."""
    path, model = hf_mixtral
    ex = SerialExecutor(load_checkpoint(path, torch.float32), "cpu")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    outs = ex.generate(prompts, DecodeSampling(max_new_tokens=8, stop_at_eos=False))
    for p, (o, _) in zip(prompts, outs):
        seq = p + o
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0]
        assert ref[len(p) - 1 :].argmax(-1).tolist()[: len(o)] == o


def test_router_picks_fp32_winner_with_bf16_weights():
    """Two router logits closer than bf16 resolution: the fp32 winner is picked, not a bf16 tie."""
    h = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)  # [T=1, D=2]
    w = torch.tensor([[1.0, 2.0**-10], [1.0, 2.0**-9], [-1.0, 0.0]], dtype=torch.bfloat16)  # [E=3, D]
    bf16_logits = torch.nn.functional.linear(h, w)  # what a bf16 router computes
    assert bf16_logits[0, 0] == bf16_logits[0, 1], "test premise: the two logits tie in bf16"
    fp32_logits = h.float() @ w.float().T
    assert fp32_logits[0, 1] > fp32_logits[0, 0]
    weights, ids = M.route(h, w, top_k=1)
    assert ids[0, 0].item() == 1 and weights.dtype == torch.float32
    _, ids2 = M.route(h, w, top_k=2)
    assert ids2[0].tolist() == [1, 0]


def test_sliding_window_masks_old_keys():
    """With a window of 2, decode attention ignores keys older than the window."""
    q = torch.randn(1, 2, 4)
    k = torch.randn(1, 1, 5, 4)
    v = torch.randn(1, 1, 5, 4)
    full = M.decode_attention(q, k, v, torch.tensor([5]), sliding_window=2)
    only_last2 = M.decode_attention(q, k[:, :, 3:], v[:, :, 3:], torch.tensor([2]))
    torch.testing.assert_close(full, only_last2)
