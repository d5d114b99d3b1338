"""YAML read/write shared by HardwareProfile and Policy (one place for error wording and header comments)."""

from __future__ import annotations

from typing import Any

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
