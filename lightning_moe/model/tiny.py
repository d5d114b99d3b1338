"""The embedded default model ``tiny-mixtral``: Mixtral architecture at toy size, real tokenizer.

Created deterministically on first use into a cache directory in Hugging Face format (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json with a chat template), so every tool that
reads HF checkpoints (transformers included) can load it. The weights are seeded random numbers, so
its text is gibberish; everything else (tokenizer, chat template, routing, KV cache) is real.

Tokenizer: the Mixtral v1 SentencePiece vocabulary (32000 pieces) that ships inside the
``mistral-common`` package (``mistral_common/data/tokenizer.model.v1``), converted once by
transformers to a fast ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

NAME = "tiny-mixtral"
VERSION = 1  # bump when the recipe changes; the cache directory name includes it

# Architecture: 4 layers, 8 experts, top-2, GQA 4 query heads over 2 KV heads.
CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}

# Mixtral-Instruct's [INST] format; a system prompt is prepended to the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def default_cache_dir() -> str:
    """``$LIGHTNING_MOE_CACHE`` or ``$XDG_CACHE_HOME/lightning-moe`` (default ``~/.cache/lightning-moe``)."""
    root = os.environ.get("LIGHTNING_MOE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightning-moe"
    )
    return root


def _weights(seed: int = 1234) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights in the HF Mixtral naming (per-expert w1/w2/w3)."""
    c = CONFIG
    D, F, E, V = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    hq, hkv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {"model.embed_tokens.weight": rnd(V, D, std=1.0), "model.norm.weight": torch.ones(D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1.0 + rnd(D, std=0.1)
        out[p + "post_attention_layernorm.weight"] = 1.0 + rnd(D, std=0.1)
        out[p + "self_attn.q_proj.weight"] = rnd(hq, D, std=D**-0.5)
        out[p + "self_attn.k_proj.weight"] = rnd(hkv, D, std=D**-0.5)
        out[p + "self_attn.v_proj.weight"] = rnd(hkv, D, std=D**-0.5)
        out[p + "self_attn.o_proj.weight"] = rnd(D, hq, std=hq**-0.5)
        out[p + "block_sparse_moe.gate.weight"] = rnd(E, D, std=1.0)
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            out[q + "w1.weight"] = rnd(F, D, std=D**-0.5)
            out[q + "w3.weight"] = rnd(F, D, std=D**-0.5)
            out[q + "w2.weight"] = rnd(D, F, std=F**-0.5)
    out["lm_head.weight"] = rnd(V, D, std=D**-0.5)
    return out


class MissingPackage(RuntimeError):
    """A package the embedded model needs is not installed (the CLI prints the message as one line, exit 2)."""


def _write_tokenizer(dst: str) -> None:
    """Convert mistral-common's Mixtral v1 SentencePiece model into tokenizer.json in ``dst``."""
    try:
        import mistral_common
    except ImportError as e:  # declared in pyproject; missing where pip could not reach an index
        raise MissingPackage("the embedded tiny-mixtral builds its tokenizer from the 'mistral-common' package, which "
                             "is not installed: pip install mistral-common (a host without network: docs/GPU.md, "
                             "'A host without network'; or set LIGHTNING_MOE_CACHE to a cache that holds "
                             f"{NAME}-v{VERSION}/)") from e
    from transformers import AutoTokenizer

    sp = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(sp):
        raise RuntimeError(f"mistral-common does not ship {sp}; cannot build the tiny-mixtral tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(sp, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(
                {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                 "add_bos_token": True, "add_eos_token": False, "legacy": False},
                f,
            )
        tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = CONFIG["max_position_embeddings"]
    tok.save_pretrained(dst)


def ensure_tiny_mixtral(cache_dir: str | None = None) -> str:
    """Path of the tiny-mixtral checkpoint directory, creating it on first use.

    Creation is atomic (built in a temporary sibling directory, then renamed), so an interrupted or
    concurrent first use never leaves a half-written model. Deterministic: same bytes every time.
    """
    root = cache_dir or default_cache_dir()
    path = os.path.join(root, f"{NAME}-v{VERSION}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{NAME}-", dir=root)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(CONFIG, f, indent=2)
        save_file(_weights(), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer(tmp)
        _plain_modes(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _plain_modes(directory: str) -> None:
    """The modes a plain ``mkdir`` / ``open`` gives under the process umask (``mkdtemp`` makes 0700, safetensors
    writes 0600), so a ``LIGHTNING_MOE_CACHE`` shared by several users serves each of them."""
    mask = _umask()
    os.chmod(directory, 0o777 & ~mask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~mask)


def _umask() -> int:
    """The process umask, read from /proc (setting it to read it would open a window for other threads' files)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022  # no /proc: the common default


def resolve_model_path(model: str) -> str:
    """``tiny-mixtral`` -> its cache directory (created on first use); anything else is returned as is."""
    return ensure_tiny_mixtral() if model == NAME else model
