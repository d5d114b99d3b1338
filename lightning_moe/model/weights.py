"""Checkpoint loading: a Hugging Face directory (config.json + safetensors) -> ModelWeights on the host.

Supports one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``, stored in
bf16, fp16 or fp32 (cast to the requested dtype on load). Tensor names come from the model family's key map
(``Family.keys``, model/families/), with both expert layouts found in the wild: per-expert tensors (Mixtral:
``block_sparse_moe.experts.{e}.w1/w2/w3.weight``, what checkpoints on the Hub and transformers'
``save_pretrained`` write) and transformers-5's fused in-memory layout (Mixtral: ``mlp.experts.gate_up_proj``
[E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]).
A checkpoint written by ``moe-batch quantize`` (model/quantize.py; read by model/quantized.py) keeps its experts as
packed pages.

Also builds deterministic dummy weights for a spec (speed benchmarks of real configs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .checkpoint_io import CheckpointError, _Reader
from .families import family_of
from .layers import ExpertWeights
from .quantized import checkpoint_page_layout, read_packed_experts
from .spec import MoESpec


@dataclass
class ModelWeights:
    """All weights of an MoE decoder, on the host (or a device for tiny models)."""

    spec: MoESpec  # architecture
    embed: torch.Tensor  # [V, D] embed_tokens
    norm: torch.Tensor  # [D] final norm
    lm_head: torch.Tensor  # [V, D] (same storage as embed when tied)
    layers: list  # non-expert weights, one per decoder layer (the family's LayerWeights; DenseLayerWeights for a
    #   dense layer of spec.dense_layers, whose MLP is resident with the rest)
    experts: list[Optional[ExpertWeights]]  # stacked routed experts per decoder layer (QuantExperts: packed pages,
    #   model/quantized.py); None for a dense layer (no routed experts)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.embed.dtype

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed-expert weights (packed bytes for QuantExperts)."""
        return sum(e.nbytes for e in self.experts if e is not None)

    @property
    def non_expert_bytes(self) -> int:
        """Bytes of everything except the routed experts (embeddings, lm_head, attention, norms, routers, shared
        experts, dense layers' MLPs)."""
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            tensors += [t for t in lw.__dict__.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def load_checkpoint(path: str, dtype: torch.dtype = torch.bfloat16, spec: Optional[MoESpec] = None) -> ModelWeights:
    """Load a Hugging Face checkpoint directory of a supported model family into host memory.

    Args:
        path: directory with config.json and safetensors weights.
        dtype: torch.float32, torch.bfloat16 or torch.float16; tensors are cast on load.
        spec: the spec, when already read (else from ``path/config.json``).
    Returns:
        ModelWeights with the family's LayerWeights and experts stacked per layer ([E, F, D] / [E, D, F]), or, for
        a quantized checkpoint (config.json has a ``quantization`` section), ``QuantExperts`` (uint8
        [E, page_bytes]); a dense layer (``spec.dense_layers``) has the family's DenseLayerWeights and no experts
        (None).
    Raises:
        FileNotFoundError / CheckpointError: missing config, shard or tensor (named in the message).
        ValueError: a spec of a model type no family implements.
    """
    spec = spec or MoESpec.from_pretrained_dir(path)
    fam = family_of(spec)
    keys = fam.keys
    r = _Reader(path, dtype)
    if spec.num_mtp_layers:
        L0 = spec.num_layers
        print(f"moe-batch: {path}: skipping {spec.num_mtp_layers} multi-token-prediction layer(s) (model.layers."
              f"{L0}{'' if spec.num_mtp_layers == 1 else f'..{L0 + spec.num_mtp_layers - 1}'}.*, "
              f"num_nextn_predict_layers): generation here uses the decoder layers only", file=sys.stderr)

    def read(names: dict[str, str]) -> dict:  # field -> tensor; an optional tensor the checkpoint lacks is left out
        return {f: r.get(n) for f, n in names.items() if f not in keys.optional_tensors or r.has(n)}

    page_layout = checkpoint_page_layout(path, spec)  # None unless the experts are packed pages
    layers, experts = [], []
    for i in range(spec.num_layers):
        if spec.is_dense_layer(i):  # one dense MLP, resident with the layer's other weights; nothing to page
            layers.append(fam.dense_layer_weights(**read(keys.dense_layer_names(i))))
            experts.append(None)
            continue
        p, block = keys.layer_prefix(i), keys.moe_prefix(r.has, i)
        layers.append(fam.layer_weights(**read(keys.layer_names(i, block))))
        gate_up = p + keys.fused_gate_up.format(moe=block) if keys.fused_gate_up else None
        if page_layout is not None:  # quantized checkpoint: keep the packed pages
            experts.append(read_packed_experts(r, p + block, page_layout, spec.num_experts))
        elif fam.load_experts is not None:  # the family's own expert layout (gpt-oss: interleaved, biased, MXFP4)
            experts.append(fam.load_experts(r, p + block, spec, dtype))
        elif gate_up is not None and r.has(gate_up):  # transformers-5 fused layout
            gu = r.get(gate_up)  # [E, 2F, D]
            F = spec.intermediate_size
            down = r.get(p + keys.fused_down.format(moe=block))  # [E, D, F]
            experts.append(ExpertWeights(gu[:, :F].contiguous(), gu[:, F:].contiguous(), down))
        else:  # one tensor per expert and projection, stacked
            experts.append(ExpertWeights(*(
                torch.stack([r.get(keys.expert_name(i, block, w, e)) for e in range(spec.num_experts)])
                for w in ("w1", "w3", "w2"))))  # [E, F, D], [E, F, D], [E, D, F]
    embed = r.get(keys.embed)
    if r.has(keys.lm_head):
        lm_head = r.get(keys.lm_head)
    elif spec.tie_word_embeddings:
        lm_head = embed
    else:
        raise CheckpointError(f"{path}: tensor {keys.lm_head!r} not found and tie_word_embeddings is false")
    return ModelWeights(spec, embed, r.get(keys.norm), lm_head, layers, experts)


def dummy_weights(spec: MoESpec, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 0.02) -> ModelWeights:
    """Deterministic random weights for a spec (speed work on real configs without a checkpoint).

    Every tensor is filled from ``torch.Generator().manual_seed(seed + tensor index)`` with N(0, scale^2)
    (norm weights are ones), so two runs with the same seed produce bit-identical models. Generation
    runs at about 1 GB/s on one core: a 47 B-parameter Mixtral-8x7B takes minutes; benchmarks may scale
    the layer count down and say so.
    """
    counter = [seed]

    def rnd(*shape: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(counter[0])
        counter[0] += 1
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)

    D, F, E = spec.hidden_size, spec.intermediate_size, spec.num_experts
    fam = family_of(spec)
    layers, experts = [], []
    for i in range(spec.num_layers):
        layers.append(fam.dummy_layer(spec, rnd, dtype, i))
        experts.append(None if spec.is_dense_layer(i) else ExpertWeights(rnd(E, F, D), rnd(E, F, D), rnd(E, D, F)))
    embed = rnd(spec.vocab_size, D)
    return ModelWeights(spec, embed, torch.ones(D, dtype=dtype), rnd(spec.vocab_size, D), layers, experts)
