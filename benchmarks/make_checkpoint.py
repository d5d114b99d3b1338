#!/usr/bin/env python3
"""Write a Mixtral-architecture checkpoint with random weights (few layers) in Hugging Face layout.

The directory gets ``config.json`` (transformers' ``MixtralConfig``; defaults are the real Mixtral-8x7B
dimensions, only ``num_hidden_layers`` is small), sharded ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json`` under the HF key names, all in bf16, and the tokenizer files of the
embedded tiny model (``tiny-mixtral-v1`` in ``$LIGHTNING_MOE_CACHE``, default ``~/.cache/lightning-moe``;
created on first use when missing), so ``moe-batch run`` and ``transformers`` both load it.

No transformers model is ever built: tensors are generated one at a time (seeded ``torch.Generator``,
N(0, std^2), layer norms 1), packed into shards of about ``--shard-gib`` and written with
``safetensors.torch.save_file`` shard by shard. ``--device cuda`` generates on the GPU (faster) and
copies each tensor to the host. A 4-layer Mixtral-8x7B-width checkpoint is ~11 GiB.

Usage:
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 4 [--device cuda]            # Mixtral-width
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 2 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

MIXTRAL_8X7B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "experts": 8, "top_k": 2,
                "vocab": 32000, "rope_theta": 1e6, "max_pos": 32768}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json")


@dataclass(frozen=True)
class Dims:
    """Architecture numbers of the checkpoint (defaults: Mixtral-8x7B with 4 layers)."""

    layers: int = 4
    hidden: int = MIXTRAL_8X7B["hidden"]
    intermediate: int = MIXTRAL_8X7B["intermediate"]
    heads: int = MIXTRAL_8X7B["heads"]
    kv_heads: int = MIXTRAL_8X7B["kv_heads"]
    experts: int = MIXTRAL_8X7B["experts"]
    top_k: int = MIXTRAL_8X7B["top_k"]
    vocab: int = MIXTRAL_8X7B["vocab"]
    rope_theta: float = MIXTRAL_8X7B["rope_theta"]
    max_pos: int = MIXTRAL_8X7B["max_pos"]

    @property
    def head_dim(self) -> int:
        """Per-head width: hidden // heads."""
        return self.hidden // self.heads


def config_dict(d: Dims) -> dict:
    """The config.json content: ``MixtralConfig(...).to_dict()`` plus top-level ``rope_theta`` / ``torch_dtype``
    (read by transformers 4 and 5 alike)."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate,
                        num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads,
                        head_dim=d.head_dim, num_local_experts=d.experts, num_experts_per_tok=d.top_k,
                        rope_theta=d.rope_theta, max_position_embeddings=d.max_pos, sliding_window=None,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    out = cfg.to_dict()
    out["architectures"] = ["MixtralForCausalLM"]
    out["rope_theta"] = d.rope_theta
    out["torch_dtype"] = "bfloat16"
    out["dtype"] = "bfloat16"
    return out


def tensor_shapes(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in file order: embeddings, layer by layer, final norm, lm_head."""
    D, F, E, V = d.hidden, d.intermediate, d.experts, d.vocab
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (D,)), (p + "self_attn.q_proj.weight", (q, D)),
                (p + "self_attn.k_proj.weight", (kv, D)), (p + "self_attn.v_proj.weight", (kv, D)),
                (p + "self_attn.o_proj.weight", (D, q)), (p + "post_attention_layernorm.weight", (D,)),
                (p + "block_sparse_moe.gate.weight", (E, D))]
        for e in range(E):
            x = p + f"block_sparse_moe.experts.{e}."
            out += [(x + "w1.weight", (F, D)), (x + "w2.weight", (D, F)), (x + "w3.weight", (F, D))]
    out += [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]
    return out


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[int]]:
    """Indices of ``shapes`` per shard: consecutive tensors, a new shard when the next would pass ``shard_bytes``."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_tensor(name: str, shape: tuple[int, ...], index: int, seed: int, std: float, device: str) -> torch.Tensor:
    """One bf16 host tensor: ones for norm weights, else N(0, std^2) from a generator seeded with seed + index
    (the same bytes whatever the sharding; cpu and cuda generators give different numbers)."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed + index)
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    t = t.mul_(std).to(torch.bfloat16)
    return t.cpu() if t.device.type != "cpu" else t


def tiny_tokenizer_dir() -> str:
    """The embedded tiny model's directory (``$LIGHTNING_MOE_CACHE``/tiny-mixtral-v1), created when missing."""
    from lightning_moe.model.tiny import default_cache_dir, ensure_tiny_mixtral

    path = os.path.join(default_cache_dir(), "tiny-mixtral-v1")
    if os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(os.path.join(path, "tokenizer.model")):
        return path
    return ensure_tiny_mixtral()


def copy_tokenizer(dst: str, src: str | None = None) -> list[str]:
    """Copy the tokenizer files of ``src`` (default: the tiny model's directory) into ``dst``; returns their names."""
    src = src or tiny_tokenizer_dir()
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy(p, os.path.join(dst, name))
            copied.append(name)
    if not copied:
        raise FileNotFoundError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return copied


def write_checkpoint(out_dir: str, dims: Dims, shard_gib: float = 3.0, seed: int = 0, std: float = 0.02,
                     device: str = "cpu", log=sys.stderr) -> dict:
    """Write the checkpoint into ``out_dir`` (created; must be empty or absent). Returns
    ``{"path", "bytes", "seconds", "shards", "tensors", "tokenizer_files"}``; ``bytes`` counts the safetensors files."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not empty")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict(dims), f, indent=2)
    shapes = tensor_shapes(dims)
    shards = plan_shards(shapes, int(shard_gib * 2**30))
    weight_map, total = {}, 0
    for k, idx in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {shapes[i][0]: make_tensor(shapes[i][0], shapes[i][1], i, seed, std, device) for i in idx}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map.update({name: fname for name in tensors})
        del tensors
        print(f"  {fname}: {nbytes / 2**30:.2f} GiB, {time.perf_counter() - t0:.1f} s", file=log, flush=True)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    tok = copy_tokenizer(out_dir)
    if device != "cpu":
        torch.cuda.empty_cache()  # the caller may go on to run capped jobs in subprocesses
    return {"path": out_dir, "bytes": total, "seconds": time.perf_counter() - t0, "shards": len(shards),
            "tensors": len(shapes), "tokenizer_files": tok}


def build_parser() -> argparse.ArgumentParser:
    d = Dims()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("out", help="output directory (created; must be empty or absent)")
    p.add_argument("--layers", type=int, default=d.layers, help=f"num_hidden_layers (default {d.layers})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden_size (default {d.hidden})")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help=f"expert intermediate_size (default {d.intermediate})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help=f"key/value heads (default {d.kv_heads})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"experts per layer (default {d.experts})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"experts per token (default {d.top_k})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab}; the tokenizer has 32000)")
    p.add_argument("--max-pos", type=int, default=d.max_pos, help=f"max_position_embeddings (default {d.max_pos})")
    p.add_argument("--shard-gib", type=float, default=3.0, help="target shard size in GiB (default 3)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (tensor i uses seed + i)")
    p.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights (default 0.02)")
    p.add_argument("--device", default="cpu", help="where random numbers are generated: cpu or cuda (default cpu)")
    return p


def dims_from_args(a: argparse.Namespace) -> Dims:
    """Dims from parsed command-line arguments."""
    return Dims(layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads,
                experts=a.experts, top_k=a.top_k, vocab=a.vocab, max_pos=a.max_pos)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    res = write_checkpoint(a.out, dims_from_args(a), a.shard_gib, a.seed, a.std, a.device)
    print(f"wrote {res['path']}: {res['bytes']:,} bytes ({res['bytes'] / 2**30:.2f} GiB) in {res['shards']} shards, "
          f"{res['tensors']} tensors, {res['seconds']:.1f} s ({res['bytes'] / 2**30 / max(res['seconds'], 1e-9):.2f} GiB/s); "
          f"tokenizer: {', '.join(res['tokenizer_files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
