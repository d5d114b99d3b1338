"""Every family on CUDA: CGOPipe's greedy tokens equal the serial executor's (fp32, ragged batch, paged and resident
experts, CPU and GPU attention micro-batches), and the serial executor's fp32 logits on CUDA equal transformers' own
model on CUDA (max abs < 1e-4, TF32 off). Tiny random checkpoints saved by transformers' own classes with each
family's flags on: Qwen3-MoE with a dense layer, OLMoE with clip_qkv, Qwen2-MoE with its shared expert and a dense
layer, Mixtral with yarn rope past the original context. The CPU suite ties the serial executor to transformers on
the CPU; this ties the GPU paths (Triton expert FFN, GPU decode attention, pinned pages) to it.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from lightning_moe.model.weights import load_checkpoint  # noqa: E402
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor  # noqa: E402
from lightning_moe.pipeline.sampling import DecodeSampling  # noqa: E402
from lightning_moe.pipeline.serial import SerialExecutor  # noqa: E402
from lightning_moe.policy.policy import Policy  # noqa: E402

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(family: str):
    import transformers

    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            intermediate_size=80, moe_intermediate_size=48, num_experts=8, head_dim=16, norm_topk_prob=True,
            mlp_only_layers=[1], **COMMON)
    if family == "olmoe":
        return transformers.OlmoeForCausalLM, transformers.OlmoeConfig(intermediate_size=48, num_experts=8,
                                                                       clip_qkv=0.7, **COMMON)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            intermediate_size=80, moe_intermediate_size=48, num_experts=8, shared_expert_intermediate_size=40,
            mlp_only_layers=[1], **COMMON)
    return transformers.MixtralForCausalLM, transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=8, head_dim=16,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0}, **COMMON)


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe", "qwen2_moe", "mixtral"])
def family_ckpt(request, tmp_path_factory):
    """(family, checkpoint dir, transformers model on the CPU) of one family."""
    cls, cfg = _config(request.param)
    torch.manual_seed(11)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger than the default init: routing and greedy tokens are not degenerate
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "gate" in n and "experts" not in n else p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    model.save_pretrained(path, max_shard_size="200KB")
    return request.param, path, model


def _prompts(n=9, seed=0, maxlen=40):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, VOCAB, (int(m),), generator=g).tolist()
            for m in torch.randint(1, maxlen, (n,), generator=g)]


@pytest.mark.parametrize("mu,n,resident,gpu_attn", [(3, 3, 0, 0), (3, 3, 3, 1), (9, 1, 0, 1)])
def test_cgopipe_cuda_tokens_equal_serial_fp32(family_ckpt, mu, n, resident, gpu_attn):
    family, path, _ = family_ckpt
    prompts = _prompts()
    sp = DecodeSampling(max_new_tokens=20, stop_at_eos=False)
    ref = SerialExecutor(load_checkpoint(path, torch.float32), "cuda").generate(prompts, sp)
    pol = Policy(mu=mu, n=n, prefill_mu=mu, resident_experts=resident, n_gpu_attn=gpu_attn, dtype="fp32",
                 weight_quant="fp32")
    ex = CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cuda")
    try:
        out = ex.generate(prompts, sp)
    finally:
        ex.close()
    mism = [(i, a, b) for i, ((a, _), (b, _)) in enumerate(zip(out, ref)) if a != b]
    assert not mism, f"{family}: {len(mism)} of {len(prompts)} sequences differ, first: {mism[0]}"


def test_serial_cuda_logits_equal_transformers_cuda_fp32(family_ckpt):
    """The last position's fp32 logits of each prompt alone, ours on CUDA vs transformers' model on CUDA."""
    import lightning_moe.pipeline.sampling as S  # DecodeRows.commit: the one place logits become tokens

    family, path, model = family_ckpt
    prompts = _prompts(4)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        hf = model.to("cuda")
        want = [hf(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu() for p in prompts]
        got = []
        ser = SerialExecutor(load_checkpoint(path, torch.float32), "cuda")
        orig = S.sample

        def capture(logits, *a, **k):  # the first sampled step's logits are the prompt's last position's
            got.append(logits[0].float().cpu())
            return orig(logits, *a, **k)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(S, "sample", capture)
            for p in prompts:
                ser.generate([p], DecodeSampling(max_new_tokens=1, stop_at_eos=False))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        model.to("cpu")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-4, f"{family}: max |dlogit| {(g - w).abs().max():.2e}"
