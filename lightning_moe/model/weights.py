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

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import checkpoint_io
from .checkpoint_io import CheckpointError, _Reader
from .families import family_of
from .layers import ExpertWeights
from .quantized import PACKED_NAME, checkpoint_page_layout, read_packed_experts
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
    #   model/quantized.py; ExpertsOnDisk: not read yet, load_checkpoint(lazy_experts=True)); None for a dense layer

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.embed.dtype

    def release_non_expert(self) -> None:
        """Drop the references to every non-expert tensor (an executor that copied them to its device: the host
        copies are freed unless held elsewhere); only ``spec`` and ``experts`` remain usable."""
        self.embed = self.norm = self.lm_head = None
        self.layers = [None] * len(self.layers)

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


@dataclass(frozen=True)
class ExpertsOnDisk:
    """A layer's routed experts left in the checkpoint by ``load_checkpoint(lazy_experts=True)``: ``read()`` reads
    them (``ExpertWeights``, or ``QuantExperts`` for packed pages) each time it is called, so a consumer that takes
    the experts layer by layer (CGOPipe's page pool) never holds more than one layer's host copy."""

    layer: int  # decoder layer
    read: Callable[[], Any]  # () -> ExpertWeights | QuantExperts, read from the checkpoint's files
    layout: Any = None  # the packed pages' kernels.quant.ExpertPageLayout (what read() returns); None: unpacked


def _stacked(r: _Reader, names: list[str]) -> torch.Tensor:
    """The tensors ``names`` stacked on a new first dimension, each copied into place as it is read (torch.stack of
    a list would hold every one of them beside the stack: 1/3 of a layer of experts more at the load's peak)."""
    first = r.get(names[0])
    out = torch.empty((len(names), *first.shape), dtype=first.dtype)
    out[0] = first
    del first
    for e, n in enumerate(names[1:], 1):
        out[e] = r.get(n)
    return out


def _fused_experts(r: _Reader, gate_up: str, down: str, F: int) -> ExpertWeights:
    """A layer's experts stored fused (gate_up [E, 2F, D], down [E, D, F]) as w1 / w3 [E, F, D] and w2 [E, D, F],
    read a few experts at a time into place (the mapped source of a whole layer never sits beside its copy)."""
    E, _, D = r.shape(gate_up)
    w1 = w3 = w2 = None
    step = max(1, checkpoint_io.MAP_LIMIT // max(1, 3 * F * D * 2))  # experts per read (bf16-sized bytes)
    for a in range(0, E, step):
        gu, dn = r.get_rows(gate_up, a, a + step), r.get_rows(down, a, a + step)
        if w1 is None:
            w1, w3 = (torch.empty((E, F, D), dtype=gu.dtype) for _ in range(2))
            w2 = torch.empty((E, *dn.shape[1:]), dtype=dn.dtype)
        w1[a:a + step], w3[a:a + step], w2[a:a + step] = gu[:, :F], gu[:, F:], dn
    return ExpertWeights(w1, w3, w2)


def load_checkpoint(path: str, dtype: torch.dtype = torch.bfloat16, spec: Optional[MoESpec] = None,
                    lazy_experts: bool = False, packed_experts: bool = False) -> ModelWeights:
    """Load a Hugging Face checkpoint directory of a supported model family into host memory.

    Args:
        path: directory with config.json and safetensors weights.
        dtype: torch.float32, torch.bfloat16 or torch.float16; tensors are cast on load.
        spec: the spec, when already read (else from ``path/config.json``).
        lazy_experts: leave each MoE layer's routed experts in the files as :class:`ExpertsOnDisk` (their tensors'
            presence is checked now); everything else is read.
        packed_experts: keep experts that a family stores packed in a format of its own packed
            (``Family.packed_expert_layout``; gpt-oss's MXFP4: ``QuantExperts``' subclass ``MXFP4Experts``) instead of
            dequantizing them into ``dtype``: for an executor that computes packed pages (serial, CGOPipe).
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
    r = _Reader(path, dtype)
    if spec.num_mtp_layers:
        L0 = spec.num_layers
        print(f"moe-batch: {path}: skipping {spec.num_mtp_layers} multi-token-prediction layer(s) (model.layers."
              f"{L0}{'' if spec.num_mtp_layers == 1 else f'..{L0 + spec.num_mtp_layers - 1}'}.*, "
              f"num_nextn_predict_layers): generation here uses the decoder layers only", file=sys.stderr)
    src = _LayerReader(path, spec, fam, r, dtype, packed_experts)
    layers, experts = [], []
    for i in range(spec.num_layers):
        if spec.is_dense_layer(i):  # one dense MLP, resident with the layer's other weights; nothing to page
            layers.append(fam.dense_layer_weights(**src.read(fam.keys.dense_layer_names(i))))
            experts.append(None)
            continue
        p, block = fam.keys.layer_prefix(i), fam.keys.moe_prefix(r.has, i)
        layers.append(fam.layer_weights(**src.read(fam.keys.layer_names(i, block))))
        experts.append(src.lazy_experts(i, p, block) if lazy_experts else src.experts(i, p, block))
    weights = ModelWeights(spec, *src.embed_norm_head(), layers, experts)
    r.close()
    return weights


class _LayerReader:
    """:func:`load_checkpoint`'s reads of one checkpoint (``r``: its files) for model family ``fam``: a layer's named
    tensors, its routed experts in whichever layout the checkpoint holds them (packed pages of ``moe-batch quantize``,
    the family's own layout, transformers-5's fused tensors or one tensor per expert), now or on demand."""

    def __init__(self, path: str, spec: MoESpec, fam, r: _Reader, dtype: torch.dtype, packed_experts: bool):
        self.path = path
        self.spec = spec
        self.fam = fam
        self.keys = fam.keys
        self.r = r
        self.dtype = dtype
        self.packed_experts = packed_experts  # keep a family's own packed experts packed (gpt-oss's MXFP4)
        self.page_layout = checkpoint_page_layout(path, spec)  # None unless the experts are packed pages

    def read(self, names: dict[str, str]) -> dict:
        """field -> tensor; an optional tensor the checkpoint lacks is left out."""
        return {f: self.r.get(n) for f, n in names.items() if f not in self.keys.optional_tensors or self.r.has(n)}

    def expert_names(self, i: int, p: str, block: str) -> list[str]:
        """The tensors :meth:`experts` reads for layer ``i`` (none for a family's own layout: its load_experts names
        what is missing)."""
        keys = self.keys
        if self.page_layout is not None:
            return [p + block + PACKED_NAME]
        if self.fam.load_experts is not None:
            return []
        gate_up = p + keys.fused_gate_up.format(moe=block) if keys.fused_gate_up else None
        if gate_up is not None and self.r.has(gate_up):
            return [gate_up, p + keys.fused_down.format(moe=block)]
        return [keys.expert_name(i, block, w, e) for w in ("w1", "w3", "w2") for e in range(self.spec.num_experts)]

    def family_layout(self, p: str, block: str):
        """The page layout of a layer the family keeps packed, or None."""
        if not self.packed_experts or self.fam.packed_expert_layout is None:
            return None
        return self.fam.packed_expert_layout(self.r, p + block, self.spec, self.dtype)

    def experts(self, i: int, p: str, block: str):
        """Layer ``i``'s routed experts, read now."""
        fam, spec, r = self.fam, self.spec, self.r
        if self.page_layout is not None:  # quantized checkpoint: keep the packed pages
            return read_packed_experts(r, p + block, self.page_layout, spec.num_experts)
        if fam.load_experts is not None:  # the family's own expert layout (gpt-oss: interleaved, biased, MXFP4)
            if self.family_layout(p, block) is not None:
                return fam.load_experts(r, p + block, spec, self.dtype, packed=True)
            return fam.load_experts(r, p + block, spec, self.dtype)
        names = self.expert_names(i, p, block)
        if len(names) == 2:  # transformers-5 fused layout: [E, 2F, D], [E, D, F]
            return _fused_experts(r, names[0], names[1], spec.intermediate_size)
        E = spec.num_experts  # one tensor per expert and projection, stacked: [E, F, D], [E, F, D], [E, D, F]
        return ExpertWeights(*(_stacked(r, names[j * E:(j + 1) * E]) for j in range(3)))

    def _read_and_close(self, i: int, p: str, block: str):
        """A lazy layer read: its files' mapped pages go with it."""
        try:
            return self.experts(i, p, block)
        finally:
            self.r.close()

    def lazy_experts(self, i: int, p: str, block: str) -> ExpertsOnDisk:
        """Layer ``i``'s routed experts left in the files (their tensors' presence checked now)."""
        missing = [n for n in self.expert_names(i, p, block) if not self.r.has(n)]
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]!r} not found in the checkpoint")
        lay = self.page_layout if self.page_layout is not None else self.family_layout(p, block)
        return ExpertsOnDisk(i, functools.partial(self._read_and_close, i, p, block), lay)

    def embed_norm_head(self) -> tuple:
        """(embed, norm, lm_head); a missing lm_head is the embedding when the spec ties them."""
        keys, r = self.keys, self.r
        embed = r.get(keys.embed)
        if r.has(keys.lm_head):
            lm_head = r.get(keys.lm_head)
        elif self.spec.tie_word_embeddings:
            lm_head = embed
        else:
            raise CheckpointError(f"{self.path}: tensor {keys.lm_head!r} not found and tie_word_embeddings is false")
        return embed, r.get(keys.norm), lm_head


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
        if spec.is_dense_layer(i):
            experts.append(None)
        else:  # a family whose experts carry biases (gpt-oss) gets them: a stream refuses experts without them
            w = (rnd(E, F, D), rnd(E, F, D), rnd(E, D, F))
            experts.append(ExpertWeights(*w, rnd(E, F), rnd(E, F), rnd(E, D)) if spec.expert_bias else ExpertWeights(*w))
    embed = rnd(spec.vocab_size, D)
    return ModelWeights(spec, embed, torch.ones(D, dtype=dtype), rnd(spec.vocab_size, D), layers, experts)
