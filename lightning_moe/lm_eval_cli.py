"""``moe-lm-eval``: lm-evaluation-harness's command line with the ``lightning-moe`` model registered.

    moe-lm-eval --model lightning-moe --model_args pretrained=DIR,gpu_memory=24GiB --tasks hellaswag

Every argument is lm-eval's (``lm_eval --help``); this only imports :mod:`lightning_moe.lm_eval_backend` before
lm-eval parses them (lm-eval 0.4.13 reads no plugin entry points, so ``lm_eval --model lightning-moe`` alone does not
find the backend). ``python -m lightning_moe.lm_eval_cli ...`` is the same.
"""

from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list] = None) -> None:
    """Run lm-eval's CLI (``argv``: its arguments, default ``sys.argv[1:]``) with the backend registered."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        sys.exit("moe-lm-eval: lm-evaluation-harness is not installed: pip install 'lightning-moe[lm-eval]'")
    import lightning_moe.lm_eval_backend  # noqa: F401  (registers "lightning-moe")
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
