"""Helpers of the family tests around checkpoints saved by transformers' own classes (imported by name, as
``prompt_files``: tests/gpu has a conftest of its own)."""

import json
import os
import shutil

import torch


def write_config(src: str, dst, **changes) -> str:
    """A copy of checkpoint ``src`` in ``dst`` whose config.json has ``changes`` (value None: key removed)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def hf_greedy(model, prompts, steps):
    """transformers' own greedy tokens of each prompt alone: exactly ``steps`` new tokens (no EOS stop)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(model.generate(torch.tensor([p]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    return out


def ragged_logit_diff(ours, model, prompts, vocab) -> float:
    """Max abs difference of our logits ``ours[i]`` ([len(p), vocab] per prompt) from transformers' for each prompt
    run alone and run as one right-padded batch with an attention mask; asserts the shapes and that the model is not
    degenerate (some logit above 1)."""
    S = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (S - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (S - len(p)) for p in prompts])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits.float()
        alone = [model(torch.tensor([p])).logits[0].float() for p in prompts]
    worst = 0.0
    for i, p in enumerate(prompts):
        assert ours[i].shape == (len(p), vocab)
        worst = max(worst, (ours[i] - alone[i]).abs().max().item(), (ours[i] - batched[i, :len(p)]).abs().max().item())
    assert max(a.abs().max().item() for a in alone) > 1.0  # not a degenerate model
    return worst


def hf_prompt_logprobs(model, seqs):
    """transformers' scoring of each sequence alone: (log-prob of every next token [len-1], greedy flags [len-1])."""
    ref = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), dim=-1)[:-1]  # [len-1, V]
            tgt = torch.tensor(s[1:])
            ref.append((lp.gather(1, tgt[:, None])[:, 0], lp.argmax(-1) == tgt))
    return ref


def assert_scores_match(out, ref, tol: float = 1e-4):
    """Two executors' (or an executor's and transformers') prompt scores agree: as many sequences, per sequence the
    same shape, log-probs within ``tol`` (max abs) and identical greedy flags."""
    assert len(out) == len(ref), (len(out), len(ref))
    for (a, ga), (b, gb) in zip(out, ref):
        assert a.shape == b.shape and (a - b).abs().max().item() < tol
        assert torch.equal(ga, gb)
