"""The layout of a page: named tensors at byte offsets inside one ``uint8`` buffer, read back as zero-copy views.

One class serves every page of the project. The expert page of a quantized checkpoint
(:func:`lightning_moe.kernels.quant.expert_page_layout`: one expert's codes, scales and zeros, 16-byte aligned
segments in a page padded to 4096 bytes) is a :class:`PageLayout` with the scheme's fields added
(:class:`~lightning_moe.kernels.quant.ExpertPageLayout`); the executor's host pool pages
(``pipeline.pager.pool_page_layout``: ``experts_per_page`` whole experts per page, 256-byte aligned tensors) are
plain :class:`PageLayout` s. :meth:`PageEntry.view` reinterprets the bytes of one entry in a page ``[..., page_bytes]``
(one page, or a stack of pages with leading dimensions) without a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

ALIGN = 256  # bytes: the default alignment of every entry offset and of page_bytes (PageLayout.build)
TensorSpec = tuple[str, torch.dtype, Sequence[int]]  # (name, dtype, shape)


def _round_up(nbytes: int, align: int) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


@dataclass(frozen=True)
class PageEntry:
    """One named tensor inside a page."""

    name: str  # tensor name, e.g. "w1" or "w1.scales"
    dtype: torch.dtype  # element type
    shape: tuple[int, ...]  # shape inside one page (pool pages: shape[0] = experts per page)
    offset: int  # byte offset from the page start (a multiple of the layout's alignment)

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (without alignment padding)."""
        return self.numel * self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Leading dimension (experts per page for pool layouts)."""
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one expert): ``nbytes // rows``."""
        return self.nbytes // self.shape[0]

    def view(self, page: torch.Tensor) -> torch.Tensor:
        """Zero-copy view of this entry in ``page`` (uint8 ``[..., page_bytes]``, unit last stride) as
        ``[..., *shape]`` of ``dtype``."""
        return page[..., self.offset : self.offset + self.nbytes].view(self.dtype).unflatten(-1, self.shape)


@dataclass(frozen=True)
class PageLayout:
    """The tensors inside one page: (name, dtype, shape, byte offset) entries, identical for every page.

    With the default alignment (:data:`ALIGN`, 256 bytes) for offsets and ``page_bytes``, a page at any page
    boundary of a pool (or a GPU allocation, 512-byte aligned) can be reinterpreted with ``.view(dtype)`` for any
    dtype.
    """

    entries: tuple[PageEntry, ...]  # in byte order
    page_bytes: int  # bytes of one page (a multiple of the page alignment)

    @staticmethod
    def pack(specs: Sequence[TensorSpec], align: int = ALIGN,
             page_align: Optional[int] = None) -> tuple[tuple[PageEntry, ...], int]:
        """``(entries, page_bytes)`` of ``(name, dtype, shape)`` tensors packed one after another, each at an offset
        that is a multiple of ``align``; ``page_bytes`` is the end rounded up to ``page_align`` (default ``align``).

        Raises:
            ValueError: no tensors, a repeated or empty name, a shape without dimensions or with a dimension < 1, a
                dtype that is not a torch.dtype.
        """
        if not specs:
            raise ValueError("a page layout needs at least one tensor")
        entries, off, seen = [], 0, set()
        for name, dtype, shape in specs:
            shape = tuple(int(s) for s in shape)
            if not name or name in seen:
                raise ValueError(f"page layout: empty or repeated tensor name {name!r}")
            if not shape or min(shape) < 1:
                raise ValueError(f"page layout: tensor {name!r} has shape {shape}; need >= 1 dimension, all >= 1")
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"page layout: tensor {name!r} has dtype {dtype!r}, not a torch.dtype")
            seen.add(name)
            e = PageEntry(name, dtype, shape, off)
            entries.append(e)
            off = _round_up(off + e.nbytes, align)
        return tuple(entries), _round_up(off, page_align or align)

    @classmethod
    def build(cls, specs: Sequence[TensorSpec], align: int = ALIGN) -> "PageLayout":
        """Pack ``(name, dtype, shape)`` tensors one after another, each at an ``align``-byte aligned offset
        (:meth:`pack`). Raises ValueError as :meth:`pack`."""
        return cls(*cls.pack(specs, align))

    @classmethod
    def from_tensors(cls, tensors: Union[Mapping[str, torch.Tensor], Sequence[tuple[str, torch.Tensor]]]) -> "PageLayout":
        """Layout whose entries have the names, dtypes and shapes of the given tensors (in order)."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls.build([(n, t.dtype, tuple(t.shape)) for n, t in items])

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in byte order."""
        return tuple(e.name for e in self.entries)

    @property
    def payload_bytes(self) -> int:
        """Bytes of all entries without alignment padding (what a page copy of the entries moves)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def rows(self) -> int:
        """Rows (experts) per page: the common leading dimension of the entries.

        Raises:
            ValueError: the entries' leading dimensions differ.
        """
        rows = {e.rows for e in self.entries}
        if len(rows) != 1:
            raise ValueError(f"page layout entries have different leading dimensions {sorted(rows)}")
        return rows.pop()

    def entry(self, name: str) -> PageEntry:
        """The entry called ``name``. Raises KeyError (naming the known entries) if there is none."""
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no tensor {name!r} in the page layout (has {', '.join(self.names)})")

    def views(self, page: torch.Tensor) -> dict[str, torch.Tensor]:
        """Same as :func:`views`\\ ``(page, self)``."""
        return views(page, self)


def views(page: torch.Tensor, layout: PageLayout) -> dict[str, torch.Tensor]:
    """Reinterpret a ``uint8`` page (host or GPU) as the layout's named tensors, without a copy.

    Args:
        page: ``uint8 [>= layout.page_bytes]``, 1-D, stride 1, its first byte at a storage offset that
            is a multiple of every entry dtype's size (true for every page of a pool or GPU buffer).
        layout: the page's layout.

    Returns:
        ``{name: Tensor[entry.shape] of entry.dtype}``, views sharing ``page``'s memory.

    Raises:
        ValueError: ``page`` is not 1-D ``uint8`` with stride 1, or is shorter than ``layout.page_bytes``.
    """
    if page.dtype != torch.uint8 or page.dim() != 1 or (page.numel() > 1 and page.stride(0) != 1):
        raise ValueError(f"a page must be a 1-D contiguous uint8 tensor, got {page.dtype} shape {tuple(page.shape)}")
    if page.numel() < layout.page_bytes:
        raise ValueError(f"page has {page.numel()} bytes, layout needs {layout.page_bytes}")
    return {e.name: e.view(page) for e in layout.entries}
