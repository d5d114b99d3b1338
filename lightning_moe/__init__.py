"""lightning-moe: offline batch-throughput inference for Mixture-of-Experts LLMs (CLI ``moe-batch``).

The Python API, ``from lightning_moe import LLM, SamplingParams``, lives in :mod:`lightning_moe.api`; it is imported
on first use of those names, so ``import lightning_moe`` stays light (no torch, no transformers).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
