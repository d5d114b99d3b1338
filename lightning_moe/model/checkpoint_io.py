"""Reading Hugging Face safetensors checkpoints: the tensor index of a (sharded) directory and a lazy reader."""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch
from safetensors import safe_open

MAP_LIMIT = 256 * 2**20  # bytes a _Reader reads through its open files before it closes them: the read pages of a
#   mapped file stay in this process's resident set while it is open (one layer of a full-size checkpoint's experts
#   is GiBs); reopening costs a header parse per MAP_LIMIT bytes


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or a tensor (the message names which)."""


def _tensor_index(path: str) -> dict[str, str]:
    """Map tensor name -> safetensors file for a checkpoint directory (single file or sharded)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({os.path.join(path, v) for v in weight_map.values()} - {p for p in _files(path)})
        if missing:
            raise CheckpointError(f"{index}: shard file(s) not found: {', '.join(missing)}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _files(path: str) -> Iterable[str]:
    return (os.path.join(path, n) for n in os.listdir(path))


class _Reader:
    """Lazy tensor reader over (possibly sharded) safetensors files, casting to one dtype."""

    def __init__(self, path: str, dtype: torch.dtype):
        self.path, self.dtype = path, dtype
        self.where = _tensor_index(path)
        self._open: dict[str, object] = {}
        self._mapped = 0  # bytes read through the open files since they were opened

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``, floating point cast to the reader's dtype. Safetensors returns a tensor over the mapped
        file (no copy); the pages read stay resident while the file is open, so the files are closed every
        ``MAP_LIMIT`` bytes read (a returned tensor keeps its own pages)."""
        t = self._file(name).get_tensor(name)
        self._count(t)
        return t.to(self.dtype) if t.is_floating_point() else t  # packed (uint8) tensors keep their dtype

    def shape(self, name: str) -> list[int]:
        """The stored shape of tensor ``name`` (read from the file's header, no data)."""
        return list(self._file(name).get_slice(name).get_shape())

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name``'s first dimension, as :meth:`get` reads a tensor (a layer's
        stacked experts read a few at a time: the mapped pages read stay under ``MAP_LIMIT``)."""
        t = self._file(name).get_slice(name)[start:stop]
        self._count(t)
        return t.to(self.dtype) if t.is_floating_point() else t

    def _file(self, name: str):
        """The open file holding tensor ``name`` (opened now if need be); CheckpointError when no file has it."""
        if name not in self.where:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]

    def _count(self, t: torch.Tensor) -> None:
        """Count bytes read; at MAP_LIMIT, close the files (their read pages leave the resident set)."""
        self._mapped += t.numel() * t.element_size()
        if self._mapped >= MAP_LIMIT:
            self.close()

    def close(self) -> None:
        """Drop the open files. A file's mapped pages that were read stay in this process's resident set while it
        is open (a lazy reader of every layer's experts would end up holding the whole checkpoint's pages);
        tensors already returned stay valid, and a later :meth:`get` opens the file again."""
        self._open.clear()
        self._mapped = 0
