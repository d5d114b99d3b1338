"""tests/gpu: every test here needs a CUDA device. Items collected from this folder get the `gpu` marker
and are skipped (with a reason) when torch sees no CUDA device, so CPU-only CI collects and skips them.
Run them on a CUDA host with `python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    has_cuda = torch.cuda.is_available()
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents:
            continue  # this hook sees the whole session's items; touch only tests/gpu
        item.add_marker(pytest.mark.gpu)
        if not has_cuda:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """GPU tests exercise compiled kernels, never Triton's CPU interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
