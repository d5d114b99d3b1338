"""``moe-batch quantize``: write a copy of a checkpoint whose routed experts are packed uniform pages.

Any registered model family (model/families/): tensor names come from the family's key map.

The format and how it is read are described in model/quantized.py; this module writes it
(:func:`quantize_checkpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint_io import CheckpointError, _tensor_index
from .families import KeyMap, family_for, supported_model_types
from .quantized import METHOD, PACKED_NAME, SCALE_DTYPES, SCHEMES, _ST_DTYPES, _WEIGHT_SUFFIXES, QuantExperts
from .spec import MoESpec
from .weights import load_checkpoint


class QuantizeError(ValueError):
    """Bad input to :func:`quantize_checkpoint` (the message names the file or argument and the reason)."""


@dataclass
class QuantizeResult:
    """What :func:`quantize_checkpoint` wrote."""

    dst: str  # the quantized checkpoint directory
    scheme: str  # page scheme: int4 | int2 | int2-up
    group_size: int  # G, input columns per quantization group
    page_bytes: int  # bytes of one expert page
    num_layers: int  # decoder layers
    num_experts: int  # experts per MoE layer
    source_dtype: str  # dtype of the source weights (kept for non-expert weights)
    source_expert_bytes: int  # bytes of the source's routed experts
    packed_expert_bytes: int  # bytes of all packed pages (num_moe_layers * num_experts * page_bytes)
    copied_files: list = field(default_factory=list)  # non-weight files copied from the source (tokenizer, ...)


def packed_pages_refusal(fam) -> Optional[str]:
    """Why quantize's int4 / int2 pages cannot hold family ``fam``'s experts (a layout of their own, or an activation
    other than silu: gpt-oss), naming it; None when they can. ``quantize`` and ``plan --quant`` check it."""
    if fam.load_experts is not None or fam.expert_activation != "silu":
        return (f"the {fam.name} family's experts ({fam.expert_activation}, their own checkpoint layout) are not "
                f"implemented by quantize's packed pages")
    return None


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


def _resolve_scheme(experts: str, up: Optional[str]) -> str:
    key = (experts, up)
    if key not in SCHEMES:
        combos = ", ".join(f"experts={e}" + (f" up={u}" if u else "") for e, u in SCHEMES)
        raise QuantizeError(f"quantize: unsupported combination experts={experts!r}, up={up!r} (supported: {combos})")
    return SCHEMES[key]


def _source_dtype(src: str, keys: KeyMap) -> torch.dtype:
    """Storage dtype of the source's embedding table (the dtype kept for non-expert weights)."""
    name = keys.embed
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
    device: str = "cpu",
) -> QuantizeResult:
    """Write a copy of the checkpoint ``src_dir`` to ``dst_dir`` with packed, quantized expert pages.

    Args:
        src_dir: Hugging Face checkpoint directory of a supported model family (config.json, safetensors,
            tokenizer files).
        dst_dir: output directory; must not exist or be empty (its parent is created if needed).
        experts: bits of every projection: ``"int4"`` or ``"int2"``.
        up: ``"int2"`` stores up_proj (w3) at 2 bits while gate/down use ``experts`` (scheme ``int2-up``,
            only with ``experts="int4"``); None: all projections at ``experts``.
        group_size: G, input columns per quantization group (positive int; 128 is what the planner's
            byte model, ``MoESpec.expert_bytes``, assumes).
        scale_dtype: ``"float16"`` (default), ``"bfloat16"`` (weights beyond fp16 range) or ``"float32"``.
        progress: called as ``progress(layer, num_layers)`` after each layer is written.
        device: where the expert codes are computed: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (expert by expert; the
            same bytes on either, :func:`~lightning_moe.kernels.quant.pack_expert_pages`).

    Returns:
        :class:`QuantizeResult`. The source is loaded in its own storage dtype (the non-expert weights whole, the
        routed experts a layer at a time, the next one read while one is packed) and non-expert weights (shared experts and dense layers' MLPs among them) are written in that dtype, under
        their own names; only routed experts are packed; expert codes are computed in float64
        (:func:`~lightning_moe.kernels.quant.quantize_groupwise`).

    Raises:
        QuantizeError (a ValueError): missing source / config.json, a model type no family reads, an already quantized
            source, an existing non-empty ``dst_dir``, an unsupported scheme, group size, scale dtype or device
            (CUDA asked for without one), scales that overflow ``scale_dtype``.
        CheckpointError (a ValueError): a missing weight file or tensor in the source (named).
    """
    scheme, cfg_path, raw, fam = _check_request(src_dir, dst_dir, experts, up, group_size, scale_dtype, device)
    try:
        spec = MoESpec.from_pretrained_dir(src_dir)
    except (FileNotFoundError, ValueError) as e:
        raise QuantizeError(str(e)) from None
    src_dtype = _source_dtype(src_dir, fam.keys)
    w = load_checkpoint(src_dir, src_dtype, spec, lazy_experts=True)  # experts read layer by layer in _write_layers
    L = spec.num_layers
    dst = os.path.abspath(dst_dir)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}-", dir=parent)
    try:
        out = _Shards(tmp, L + 1)
        layout, source_expert_bytes = _write_layers(out, w, spec, fam.keys, scheme, group_size,
                                                    SCALE_DTYPES[scale_dtype], src_dir, progress, device)
        out.write_index()
        raw["quantization"] = {"method": METHOD, "scheme": scheme, "group_size": group_size,
                               "scale_dtype": scale_dtype, "page_bytes": layout.page_bytes}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        copied = _finish_directory(tmp, src_dir)
        os.rename(tmp, dst)  # replaces an empty dst directory (POSIX rename)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeResult(dst=dst_dir, scheme=scheme, group_size=group_size, page_bytes=layout.page_bytes,
                          num_layers=L, num_experts=spec.num_experts, source_dtype=str(src_dtype).replace("torch.", ""),
                          source_expert_bytes=source_expert_bytes,
                          packed_expert_bytes=spec.num_moe_layers * spec.num_experts * layout.page_bytes,
                          copied_files=copied)


def _check_request(src_dir: str, dst_dir: str, experts: str, up: Optional[str], group_size: int,
                   scale_dtype: str, device: str = "cpu") -> tuple[str, str, dict, object]:
    """(scheme, config.json path, config, family) of a quantize request, every argument and the source checked
    (QuantizeError naming the file or argument) before anything is read or written."""
    scheme = _resolve_scheme(experts, up)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise QuantizeError(f"quantize: device must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu" and not torch.cuda.is_available():
        raise QuantizeError(f"quantize: device {device}: CUDA is not available here (use device cpu)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise QuantizeError(f"quantize: group_size must be a positive integer, got {group_size!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise QuantizeError(f"quantize: scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
    cfg_path, raw = _read_config(src_dir, "source")
    try:
        fam = family_for(raw)
    except ValueError:
        raise QuantizeError(f"{cfg_path}: model_type {raw.get('model_type')!r} is not supported by quantize "
                            f"(only {', '.join(repr(t) for t in supported_model_types())})") from None
    why = packed_pages_refusal(fam)
    if why is not None:
        raise QuantizeError(f"{cfg_path}: {why}")
    if "quantization" in raw:
        raise QuantizeError(f"{cfg_path}: the source is already quantized ({raw['quantization']}); "
                            f"quantize the original checkpoint")
    dst = os.path.abspath(dst_dir)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise QuantizeError(f"{dst_dir}: destination already exists and is not an empty directory; "
                            f"choose a new directory")
    return scheme, cfg_path, raw, fam


class _Shards:
    """The safetensors shards of the quantized checkpoint in directory ``tmp`` (``n_shards``: one per layer and one for
    the embedding, norm and head), and their index."""

    def __init__(self, tmp: str, n_shards: int):
        self.tmp = tmp
        self.n_shards = n_shards
        self.weight_map: dict[str, str] = {}  # tensor name -> shard file
        self.total = 0  # bytes written

    def write(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write shard ``i``."""
        name = f"model-{i + 1:05d}-of-{self.n_shards:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(self.tmp, name),
                  metadata={"format": "pt"})
        for k, v in tensors.items():
            self.weight_map[k] = name
            self.total += v.numel() * v.element_size()

    def write_index(self) -> None:
        """Write ``model.safetensors.index.json``."""
        with open(os.path.join(self.tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f, indent=2)


def _write_layers(out: _Shards, w, spec, keys: KeyMap, scheme: str, group_size: int, sdt, src_dir: str,
                  progress: Optional[Callable[[int, int], None]], device: str = "cpu"):
    """Write every layer of weights ``w`` (a MoE layer's routed experts, read from the files now (``ExpertsOnDisk``),
    as packed pages, released as they are written; a dense layer as it is), then the embedding, norm and head; returns
    (the pages' layout, bytes of the source's routed experts). Three stages overlap on two threads: the next MoE
    layer's experts are read while this one is quantized, and a layer's shard is written while the next is quantized
    (host memory: up to two layers of source experts, the one being packed and the next being read, and two of pages,
    the one being written and the one being built; the bytes written are the same). A failed write is raised at the
    next layer at the latest, ahead of that layer's own error."""
    L = spec.num_layers
    layout, source_bytes = None, 0
    block = keys.moe_blocks[0]  # packed pages are written under the family's first MoE block name
    moe = [l for l in range(L) if not spec.is_dense_layer(l)]
    with ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as writer:
        reads = {moe[0]: reader.submit(w.experts[moe[0]].read)} if moe else {}  # ExpertsOnDisk (lazy_experts)
        written = None
        for l in range(L):
            lw = w.layers[l]
            if spec.is_dense_layer(l):  # no routed experts: the dense layer's weights as they are
                tensors = {n: getattr(lw, f) for f, n in keys.dense_layer_names(l).items() if getattr(lw, f) is not None}
            else:
                if written is not None and written.done():
                    written.result()  # a failed write is raised now, before more work
                ew = reads.pop(l).result()
                nxt = next((m for m in moe if m > l), None)
                if nxt is not None:
                    reads[nxt] = reader.submit(w.experts[nxt].read)
                source_bytes += ew.nbytes
                try:
                    qe = QuantExperts.quantize(ew, scheme, group_size, sdt, device=device)
                except ValueError as e:
                    if written is not None:
                        written.result()  # an earlier layer's failed write is the first error
                    raise QuantizeError(f"{src_dir}: layer {l} experts: {e}") from None
                w.experts[l] = ew = None  # release the source copy of this layer's experts
                layout = qe.layout
                tensors = {**{n: getattr(lw, f) for f, n in keys.layer_names(l, block).items()
                              if getattr(lw, f) is not None}, keys.layer_prefix(l) + block + PACKED_NAME: qe.pages}
            if written is not None:  # one shard in flight: the previous layer's pages are released before the next
                written.result()
                if progress is not None:
                    progress(l, L)
            written = writer.submit(out.write, l, tensors)
            tensors = qe = None  # the writer holds the pages until they are written
        if written is not None:
            written.result()
            if progress is not None:
                progress(L, L)
    last = {keys.embed: w.embed, keys.norm: w.norm}
    if w.lm_head is not w.embed:  # tied embeddings: load_checkpoint re-ties from tie_word_embeddings
        last[keys.lm_head] = w.lm_head
    out.write(L, last)
    return layout, source_bytes


def _finish_directory(tmp: str, src_dir: str) -> list[str]:
    """Give ``tmp``'s files the usual permissions (mkdtemp and save_file create private ones) and copy the source's
    non-weight files (tokenizer, ...) into it; returns the names copied."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        s = os.path.join(src_dir, name)
        if name == "config.json" or name.startswith(".") or not os.path.isfile(s) or _is_weight_file(name):
            continue
        shutil.copy2(s, os.path.join(tmp, name))
        copied.append(name)
    return copied
