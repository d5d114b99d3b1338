"""Quantized checkpoints: a checkpoint whose routed experts are stored as packed uniform pages.

``model.quantize.quantize_checkpoint(src, dst, experts="int4", up="int2")`` reads a Hugging Face checkpoint of a
supported family and writes ``dst`` in the same HF directory format, except that each layer's experts become ONE
``uint8`` tensor ``{moe}experts.packed_pages [E, page_bytes]`` under the layer's MoE block (the family's first
``KeyMap.moe_blocks``; Mixtral: ``model.layers.{l}.block_sparse_moe.experts.packed_pages``) made by
:func:`lightning_moe.kernels.quant.pack_expert_pages` (group-wise asymmetric int4 / int2 codes, fp16
scales and zeros, every expert page of one size: CommitMoE's padded pages, FloE's INT2 up_proj).
Everything else (embeddings, attention, norms, routers, lm_head) keeps its HF name and the source
checkpoint's dtype. ``config.json`` is the source's plus a section

    "quantization": {"method": "lightning-moe-groupwise", "scheme": "int4" | "int2" | "int2-up",
                     "group_size": 128, "scale_dtype": "float16", "page_bytes": <bytes of one expert page>}

and the tokenizer files (every other top-level non-weight file) are copied, so ``dst`` works wherever a
model directory is accepted (``moe-batch run`` with ``model: DST``, ``moe-batch plan --model DST``).

Loading: :func:`lightning_moe.model.weights.load_checkpoint` detects the section
(:func:`checkpoint_page_layout`) and keeps each layer's experts as :class:`QuantExperts` (the packed pages
and their :class:`~lightning_moe.kernels.quant.ExpertPageLayout`); ``QuantExperts.dequantize(dtype)`` gives the
dense :class:`~lightning_moe.model.layers.ExpertWeights`.

Shards: one safetensors file per decoder layer (its non-expert weights + packed pages) and a last one with
the embeddings, final norm and lm_head, listed in ``model.safetensors.index.json``; written into a
temporary sibling directory and renamed onto ``dst`` at the end, so an interrupted run leaves no
half-written model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.mxfp4 import MXFP4_SCHEME, MXFP4PageLayout, unpack_mxfp4_page
from ..kernels.quant import ExpertPageLayout, expert_page_layout, pack_expert_pages, unpack_expert_page
from .checkpoint_io import CheckpointError, _Reader
from .layers import ExpertWeights

METHOD = "lightning-moe-groupwise"  # value of config.json's quantization.method
PACKED_NAME = "experts.packed_pages"  # tensor name after the layer's MoE prefix (Mixtral: block_sparse_moe.)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# (experts bits, up_proj bits) -> kernels.quant page scheme
SCHEMES = {("int4", None): "int4", ("int4", "int4"): "int4", ("int4", "int2"): "int2-up",
           ("int2", None): "int2", ("int2", "int2"): "int2"}
_FILE_SCHEMES = ("int4", "int2", "int2-up")  # schemes a quantized checkpoint may declare
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

__all__ = ["METHOD", "MXFP4Experts", "QuantExperts", "checkpoint_expert_scheme", "checkpoint_page_layout",
           "checkpoint_scheme", "read_packed_experts"]


@dataclass
class QuantExperts:
    """The routed experts of one layer as packed uniform pages (row ``e`` = expert ``e``).

    ``pages`` is ``uint8 [E, page_bytes]`` laid out by ``layout`` (:func:`~lightning_moe.kernels.quant.
    expert_page_layout`): w1 gate ``[F, D]``, w3 up ``[F, D]``, w2 down ``[D, F]`` as codes + scales + zeros.
    """

    pages: torch.Tensor  # uint8 [E, page_bytes]
    layout: ExpertPageLayout  # byte layout of one page (scheme, group size, scale dtype)
    _LAYOUT = ExpertPageLayout  # the layout class this page kind takes (not a field)

    def __post_init__(self):
        kind = type(self).__name__
        if not isinstance(self.layout, self._LAYOUT):
            raise ValueError(f"{kind}: layout must be an {self._LAYOUT.__name__}, got {type(self.layout).__name__}")
        if self.pages.dtype != torch.uint8 or self.pages.dim() != 2 or self.pages.shape[1] != self.layout.page_bytes:
            raise ValueError(f"{kind}: pages must be uint8 [E, page_bytes={self.layout.page_bytes}], "
                             f"got {self.pages.dtype} {tuple(self.pages.shape)}")

    @classmethod
    def quantize(cls, ew: ExpertWeights, scheme: str, group_size: int = 128,
                 scale_dtype: torch.dtype = torch.float16, device=None) -> "QuantExperts":
        """Pack stacked experts (w1/w3 ``[E, F, D]``, w2 ``[E, D, F]``) with :func:`pack_expert_pages`, computed on
        ``device`` (None: where the experts are; the same bytes either way), the pages where the experts are."""
        pages, layout = pack_expert_pages(ew.w1, ew.w3, ew.w2, scheme, group_size, scale_dtype, device=device)
        return cls(pages, layout)

    @property
    def num_experts(self) -> int:
        """E."""
        return int(self.pages.shape[0])

    @property
    def scheme(self) -> str:
        """Page scheme (``int4``, ``int2``, ``int2-up``)."""
        return self.layout.scheme

    @property
    def nbytes(self) -> int:
        """Bytes of the packed pages (codes, scales, zeros and page padding): ``E * page_bytes``."""
        return self.pages.numel() * self.pages.element_size()

    def to(self, device, non_blocking: bool = False) -> "QuantExperts":
        """The packed pages on ``device`` (a host->device copy of ``nbytes`` bytes), of this class."""
        return type(self)(self.pages.to(device, non_blocking=non_blocking), self.layout)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """Dense stacked experts on the pages' device: w1/w3 ``[E, F, D]``, w2 ``[E, D, F]`` in ``dtype``.

        ``code * scale + zero`` in fp32, cast to ``dtype`` (:func:`~lightning_moe.kernels.quant.unpack_expert_page`);
        per element within ``scale / 2`` of the original weight (plus the rounding to ``dtype``).
        """
        return ExpertWeights(*unpack_expert_page(self.pages, self.layout, dtype))

    def expert(self, e: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
        """Expert ``e`` alone, dense in ``dtype``: ``(w1 [F, D], w3 [F, D], w2 [D, F])``, the same values as row
        ``e`` of :meth:`dequantize` (an elementwise decode of its page only)."""
        return unpack_expert_page(self.pages[e], self.layout, dtype)


@dataclass
class MXFP4Experts(QuantExperts):
    """The routed experts of one layer as MXFP4 pages (gpt-oss's Hub checkpoints kept packed): ``pages`` uint8
    ``[E, page_bytes]`` laid out by a :class:`~lightning_moe.kernels.mxfp4.MXFP4PageLayout` (the checkpoint's E2M1
    blocks and E8M0 scales of gate_up and down, and the expert biases). Travels wherever :class:`QuantExperts` does
    (the pool's ``"page"`` tensor, the serial executor's per-layer copy)."""

    layout: MXFP4PageLayout  # byte layout of one page
    _LAYOUT = MXFP4PageLayout  # (QuantExperts.__post_init__ checks it; ``to`` keeps the class)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """Dense stacked experts with their biases in ``dtype`` (:func:`~lightning_moe.kernels.mxfp4.
        unpack_mxfp4_page`: bit for bit gpt_oss's dequantize-on-load)."""
        return ExpertWeights(*unpack_mxfp4_page(self.pages, self.layout, dtype))

    def expert(self, e: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
        """Expert ``e`` alone: ``(w1, w3, w2, b1, b3, b2)`` in ``dtype``, row ``e`` of :meth:`dequantize`."""
        return unpack_mxfp4_page(self.pages[e], self.layout, dtype)


def checkpoint_expert_scheme(path: str) -> Optional[str]:
    """The packed expert scheme of a checkpoint directory: "mxfp4" for a ``quantization_config`` with ``quant_method:
    mxfp4`` (the Hub's gpt-oss), else :func:`checkpoint_scheme` (this package's pages), None for an ordinary one."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        qc = json.load(f).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == MXFP4_SCHEME:
        return MXFP4_SCHEME
    return checkpoint_scheme(path)


def checkpoint_scheme(path: str) -> Optional[str]:
    """The expert page scheme declared by ``path/config.json`` (``int4``, ``int2-up``, ...), or None.

    None for a directory without config.json or without a quantization section (and for registry names);
    the planner can use it as ``Budgets(weight_quant=checkpoint_scheme(model) or dtype)``.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        section = json.load(f).get("quantization")
    return section.get("scheme") if isinstance(section, dict) else None


def checkpoint_page_layout(path: str, spec) -> Optional[ExpertPageLayout]:
    """The expert page layout of a quantized checkpoint directory, or None for an ordinary one.

    Reads ``path/config.json``'s ``quantization`` section (see the module docstring) and builds
    :func:`~lightning_moe.kernels.quant.expert_page_layout` for ``spec``'s D and F.

    Raises:
        CheckpointError: a section that is not this package's (another method), an unknown scheme or
            scale dtype, a bad group size, or a ``page_bytes`` that does not match the layout (the message
            names config.json and the field).
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        raw = json.load(f)
    q = raw.get("quantization")
    if q is None:
        return None
    where = f"{cfg_path}: quantization"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: expected a mapping, got {type(q).__name__}")
    if q.get("method") != METHOD:
        raise CheckpointError(f"{where}.method: {q.get('method')!r} is not supported (only {METHOD!r})")
    scheme, g, sdt = q.get("scheme"), q.get("group_size"), q.get("scale_dtype", "float16")
    if scheme not in _FILE_SCHEMES:
        raise CheckpointError(f"{where}.scheme: {scheme!r} unknown (known: {', '.join(_FILE_SCHEMES)})")
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise CheckpointError(f"{where}.group_size: expected a positive integer, got {g!r}")
    if sdt not in SCALE_DTYPES:
        raise CheckpointError(f"{where}.scale_dtype: {sdt!r} unknown (known: {', '.join(SCALE_DTYPES)})")
    layout = expert_page_layout(spec.hidden_size, spec.intermediate_size, scheme, g, SCALE_DTYPES[sdt])
    if "page_bytes" in q and q["page_bytes"] != layout.page_bytes:
        raise CheckpointError(f"{where}.page_bytes: {q['page_bytes']!r} but the {scheme} layout for D={spec.hidden_size}, "
                              f"F={spec.intermediate_size}, G={g} has {layout.page_bytes} bytes per page")
    return layout


def read_packed_experts(reader: _Reader, moe_prefix: str, layout: ExpertPageLayout, num_experts: int) -> QuantExperts:
    """One layer's ``{moe_prefix}experts.packed_pages`` from a checkpoint reader, checked against ``layout``.

    Raises CheckpointError naming the tensor and its file when it is missing or not ``uint8 [E, page_bytes]``.
    """
    name = moe_prefix + PACKED_NAME
    if not reader.has(name):
        raise CheckpointError(f"{reader.path}: tensor {name!r} not found (config.json declares {layout.scheme} "
                              f"packed experts)")
    pages = reader.get(name)
    if pages.dtype != torch.uint8 or tuple(pages.shape) != (num_experts, layout.page_bytes):
        raise CheckpointError(f"{reader.where[name]}: tensor {name!r} must be uint8 [{num_experts}, {layout.page_bytes}] "
                              f"({layout.scheme} pages), got {pages.dtype} {tuple(pages.shape)}")
    return QuantExperts(pages, layout)
