"""Quantized checkpoints: a Mixtral checkpoint whose routed experts are stored as packed uniform pages.

``quantize_checkpoint(src, dst, experts="int4", up="int2")`` reads a Hugging Face Mixtral checkpoint and
writes ``dst`` in the same HF directory format, except that each layer's experts become ONE ``uint8``
tensor ``model.layers.{l}.block_sparse_moe.experts.packed_pages [E, page_bytes]`` made by
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
and their :class:`~lightning_moe.kernels.quant.PageLayout`); ``QuantExperts.dequantize(dtype)`` gives the
dense :class:`~lightning_moe.model.mixtral.ExpertWeights`.

Shards: one safetensors file per decoder layer (its non-expert weights + packed pages) and a last one with
the embeddings, final norm and lm_head, listed in ``model.safetensors.index.json``; written into a
temporary sibling directory and renamed onto ``dst`` at the end, so an interrupted run leaves no
half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..kernels.quant import PageLayout, expert_page_layout, pack_expert_pages, unpack_expert_page
from .mixtral import ExpertWeights
from .weights import CheckpointError, _Reader, _tensor_index, load_checkpoint

METHOD = "lightning-moe-groupwise"  # value of config.json's quantization.method
PACKED_NAME = "experts.packed_pages"  # tensor name after the layer's MoE prefix (block_sparse_moe.)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# (experts bits, up_proj bits) -> kernels.quant page scheme
SCHEMES = {("int4", None): "int4", ("int4", "int4"): "int4", ("int4", "int2"): "int2-up",
           ("int2", None): "int2", ("int2", "int2"): "int2"}
_FILE_SCHEMES = ("int4", "int2", "int2-up")  # schemes a quantized checkpoint may declare
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

__all__ = ["METHOD", "QuantExperts", "QuantizeError", "QuantizeResult", "checkpoint_page_layout",
           "checkpoint_scheme", "quantize_checkpoint", "read_packed_experts"]


class QuantizeError(ValueError):
    """Bad input to :func:`quantize_checkpoint` (the message names the file or argument and the reason)."""


@dataclass
class QuantExperts:
    """The routed experts of one layer as packed uniform pages (row ``e`` = expert ``e``).

    ``pages`` is ``uint8 [E, page_bytes]`` laid out by ``layout`` (:func:`~lightning_moe.kernels.quant.
    expert_page_layout`): w1 gate ``[F, D]``, w3 up ``[F, D]``, w2 down ``[D, F]`` as codes + scales + zeros.
    """

    pages: torch.Tensor  # uint8 [E, page_bytes]
    layout: PageLayout  # byte layout of one page (scheme, group size, scale dtype)

    def __post_init__(self):
        if not isinstance(self.layout, PageLayout):
            raise ValueError(f"QuantExperts: layout must be a PageLayout, got {type(self.layout).__name__}")
        if self.pages.dtype != torch.uint8 or self.pages.dim() != 2 or self.pages.shape[1] != self.layout.page_bytes:
            raise ValueError(f"QuantExperts: pages must be uint8 [E, page_bytes={self.layout.page_bytes}], "
                             f"got {self.pages.dtype} {tuple(self.pages.shape)}")

    @classmethod
    def quantize(cls, ew: ExpertWeights, scheme: str, group_size: int = 128,
                 scale_dtype: torch.dtype = torch.float16) -> "QuantExperts":
        """Pack stacked experts (w1/w3 ``[E, F, D]``, w2 ``[E, D, F]``) with :func:`pack_expert_pages`."""
        pages, layout = pack_expert_pages(ew.w1, ew.w3, ew.w2, scheme, group_size, scale_dtype)
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
        """The packed pages on ``device`` (a host->device copy of ``nbytes`` bytes)."""
        return QuantExperts(self.pages.to(device, non_blocking=non_blocking), self.layout)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """Dense stacked experts on the pages' device: w1/w3 ``[E, F, D]``, w2 ``[E, D, F]`` in ``dtype``.

        ``code * scale + zero`` in fp32, cast to ``dtype`` (:func:`~lightning_moe.kernels.quant.unpack_expert_page`);
        per element within ``scale / 2`` of the original weight (plus the rounding to ``dtype``).
        """
        return ExpertWeights(*unpack_expert_page(self.pages, self.layout, dtype))


@dataclass
class QuantizeResult:
    """What :func:`quantize_checkpoint` wrote."""

    dst: str  # the quantized checkpoint directory
    scheme: str  # page scheme: int4 | int2 | int2-up
    group_size: int  # G, input columns per quantization group
    page_bytes: int  # bytes of one expert page
    num_layers: int  # decoder layers
    num_experts: int  # experts per layer
    source_dtype: str  # dtype of the source weights (kept for non-expert weights)
    source_expert_bytes: int  # bytes of the source's routed experts
    packed_expert_bytes: int  # bytes of all packed pages (num_layers * num_experts * page_bytes)
    copied_files: list = field(default_factory=list)  # non-weight files copied from the source (tokenizer, ...)


def _read_config(path: str, what: str) -> tuple[str, dict]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        why = "is not a directory" if os.path.exists(path) else "not found"
        raise QuantizeError(f"{path}: {what} checkpoint directory {why}")
    if not os.path.isfile(cfg_path):
        raise QuantizeError(f"{cfg_path}: not found (is {path!r} a Hugging Face checkpoint directory?)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{cfg_path}: cannot read JSON: {e}") from None
    if not isinstance(raw, dict):
        raise QuantizeError(f"{cfg_path}: expected a JSON object")
    return cfg_path, raw


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


def checkpoint_page_layout(path: str, spec) -> Optional[PageLayout]:
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


def read_packed_experts(reader: _Reader, moe_prefix: str, layout: PageLayout, num_experts: int) -> QuantExperts:
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


def _resolve_scheme(experts: str, up: Optional[str]) -> str:
    key = (experts, up)
    if key not in SCHEMES:
        combos = ", ".join(f"experts={e}" + (f" up={u}" if u else "") for e, u in SCHEMES)
        raise QuantizeError(f"quantize: unsupported combination experts={experts!r}, up={up!r} (supported: {combos})")
    return SCHEMES[key]


def _source_dtype(src: str) -> torch.dtype:
    """Storage dtype of the source's embedding table (the dtype kept for non-expert weights)."""
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    where = _tensor_index(src)
    if name not in where:
        raise CheckpointError(f"{src}: tensor {name!r} not found in the checkpoint")
    with safe_open(where[name], framework="pt") as f:
        st = f.get_slice(name).get_dtype()
    if st not in _ST_DTYPES:
        raise QuantizeError(f"{where[name]}: {name} is stored as {st}; expected F32, BF16 or F16")
    return _ST_DTYPES[st]


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


def quantize_checkpoint(
    src_dir: str,
    dst_dir: str,
    experts: str = "int4",
    up: Optional[str] = None,
    group_size: int = 128,
    scale_dtype: str = "float16",
    progress: Optional[Callable[[int, int], None]] = None,
) -> QuantizeResult:
    """Write a copy of the Mixtral checkpoint ``src_dir`` to ``dst_dir`` with packed, quantized expert pages.

    Args:
        src_dir: Hugging Face Mixtral checkpoint directory (config.json, safetensors, tokenizer files).
        dst_dir: output directory; must not exist or be empty (its parent is created if needed).
        experts: bits of every projection: ``"int4"`` or ``"int2"``.
        up: ``"int2"`` stores up_proj (w3) at 2 bits while gate/down use ``experts`` (scheme ``int2-up``,
            only with ``experts="int4"``); None: all projections at ``experts``.
        group_size: G, input columns per quantization group (positive int; 128 is what the planner's
            byte model, ``MoESpec.expert_bytes``, assumes).
        scale_dtype: ``"float16"`` (default), ``"bfloat16"`` (weights beyond fp16 range) or ``"float32"``.
        progress: called as ``progress(layer, num_layers)`` after each layer is written.

    Returns:
        :class:`QuantizeResult`. The source is loaded in its own storage dtype (whole model in host memory)
        and non-expert weights are written in that dtype; expert codes are computed in float64
        (:func:`~lightning_moe.kernels.quant.quantize_groupwise`).

    Raises:
        QuantizeError (a ValueError): missing source / config.json, a non-Mixtral or already quantized
            source, an existing non-empty ``dst_dir``, an unsupported scheme, group size or scale dtype,
            scales that overflow ``scale_dtype``.
        CheckpointError (a ValueError): a missing weight file or tensor in the source (named).
    """
    from safetensors.torch import save_file

    from .spec import MoESpec

    scheme = _resolve_scheme(experts, up)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise QuantizeError(f"quantize: group_size must be a positive integer, got {group_size!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise QuantizeError(f"quantize: scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
    cfg_path, raw = _read_config(src_dir, "source")
    if raw.get("model_type") != "mixtral":
        raise QuantizeError(f"{cfg_path}: model_type {raw.get('model_type')!r} is not supported by quantize "
                            f"(only 'mixtral')")
    if "quantization" in raw:
        raise QuantizeError(f"{cfg_path}: the source is already quantized ({raw['quantization']}); "
                            f"quantize the original checkpoint")
    dst = os.path.abspath(dst_dir)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise QuantizeError(f"{dst_dir}: destination already exists and is not an empty directory; "
                            f"choose a new directory")
    try:
        spec = MoESpec.from_pretrained_dir(src_dir)
    except (FileNotFoundError, ValueError) as e:
        raise QuantizeError(str(e)) from None
    src_dtype = _source_dtype(src_dir)
    w = load_checkpoint(src_dir, src_dtype, spec)
    source_expert_bytes = w.expert_bytes
    sdt = SCALE_DTYPES[scale_dtype]
    L = spec.num_layers
    n_shards = L + 1
    shard = lambda i: f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"  # noqa: E731

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}-", dir=parent)
    try:
        weight_map: dict[str, str] = {}
        total = 0
        layout = None

        def write(i: int, tensors: dict[str, torch.Tensor]) -> None:
            nonlocal total
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, shard(i)), metadata={"format": "pt"})
            for k, v in tensors.items():
                weight_map[k] = shard(i)
                total += v.numel() * v.element_size()

        for l in range(L):
            p, lw = f"model.layers.{l}.", w.layers[l]
            moe = p + "block_sparse_moe."
            try:
                qe = QuantExperts.quantize(w.experts[l], scheme, group_size, sdt)
            except ValueError as e:
                raise QuantizeError(f"{src_dir}: layer {l} experts: {e}") from None
            w.experts[l] = None  # release the source copy of this layer's experts
            layout = qe.layout
            write(l, {p + "input_layernorm.weight": lw.attn_norm, p + "self_attn.q_proj.weight": lw.wq,
                      p + "self_attn.k_proj.weight": lw.wk, p + "self_attn.v_proj.weight": lw.wv,
                      p + "self_attn.o_proj.weight": lw.wo, p + "post_attention_layernorm.weight": lw.ffn_norm,
                      moe + "gate.weight": lw.router, moe + PACKED_NAME: qe.pages})
            if progress is not None:
                progress(l + 1, L)
        last = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm}
        if w.lm_head is not w.embed:  # tied embeddings: load_checkpoint re-ties from tie_word_embeddings
            last["lm_head.weight"] = w.lm_head
        write(L, last)
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

        raw["quantization"] = {"method": METHOD, "scheme": scheme, "group_size": group_size,
                               "scale_dtype": scale_dtype, "page_bytes": layout.page_bytes}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):  # mkdtemp and save_file create private files; use the usual umask
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        copied = []
        for name in sorted(os.listdir(src_dir)):
            s = os.path.join(src_dir, name)
            if name == "config.json" or name.startswith(".") or not os.path.isfile(s) or _is_weight_file(name):
                continue
            shutil.copy2(s, os.path.join(tmp, name))
            copied.append(name)
        os.rename(tmp, dst)  # replaces an empty dst directory (POSIX rename)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeResult(dst=dst_dir, scheme=scheme, group_size=group_size, page_bytes=layout.page_bytes,
                          num_layers=L, num_experts=spec.num_experts, source_dtype=str(src_dtype).replace("torch.", ""),
                          source_expert_bytes=source_expert_bytes,
                          packed_expert_bytes=L * spec.num_experts * layout.page_bytes, copied_files=copied)

