"""YAML read/write shared by HardwareProfile, CpuProfile and Policy: one place for the error wording (the file and
the key named), the key checks of ``from_dict`` and the ``load`` / ``save`` pair."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any, ClassVar

import yaml


def read_yaml(path: str, error: type[Exception]) -> Any:
    """``yaml.safe_load`` of ``path``; invalid YAML raises ``error`` naming the file. FileNotFoundError passes through."""
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise error(f"{path}: not valid YAML: {e}") from None


def write_yaml(path: str, data: dict, header: str = "") -> None:
    """Write ``data`` as block-style YAML in insertion order, ``header`` lines first as ``# `` comments."""
    text = "".join(f"# {line}\n" for line in header.splitlines()) if header else ""
    text += yaml.safe_dump(data, sort_keys=False, width=120, default_flow_style=None)
    with open(path, "w") as f:
        f.write(text)


class YamlRecord:
    """Mixin for a dataclass read from and written to YAML. A subclass defines ``to_dict``, ``from_dict(d, where)``
    and ``ERROR`` (the exception its checks raise); ``from_dict`` starts with :meth:`_known_fields` and ends with
    :meth:`_build`."""

    ERROR: ClassVar[type[Exception]] = ValueError
    WHAT: ClassVar[str] = "fields"  # for "expected a mapping of <WHAT>"

    @classmethod
    def _known_fields(cls, d: Any, where: str) -> dict[str, Field]:
        """The dataclass's fields by name, after checking that ``d`` is a mapping with no unknown key."""
        if not isinstance(d, dict):
            raise cls.ERROR(f"{where}: expected a mapping of {cls.WHAT}, got {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise cls.ERROR(f"{where}: unknown key(s) {', '.join(map(str, unknown))} (known: {', '.join(known)})")
        return known

    @classmethod
    def _build(cls, kw: dict, where: str, strip: str = ""):
        """``cls(**kw)``; a check of ``__post_init__`` raising ``ERROR`` is re-raised naming ``where``."""
        try:
            return cls(**kw)
        except cls.ERROR as e:
            raise cls.ERROR(f"{where}: {str(e).removeprefix(strip)}") from None

    @classmethod
    def load(cls, path: str):
        """Read a YAML written by :meth:`save` (or ``moe-batch profile`` / ``plan --output``). Raises
        FileNotFoundError, or ``ERROR`` naming the file (bad YAML, unknown or missing key, wrong type)."""
        return cls.from_dict(read_yaml(path, cls.ERROR), where=path)

    def save(self, path: str, header: str = "") -> None:
        """Write as YAML in field order; ``header`` lines (e.g. the predicted throughput) go first as comments."""
        write_yaml(path, self.to_dict(), header)
