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
