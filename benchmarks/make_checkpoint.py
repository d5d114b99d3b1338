#!/usr/bin/env python3
"""Write an MoE checkpoint with random weights (few layers) in Hugging Face layout, of any family ``run`` executes:
the command-line entry of ``tests/support/make_checkpoint.py`` (the code lives there because the tests import it;
its docstring describes the layout, ``--zero-experts`` and ``--mxfp4``).

Usage (from anywhere; the repository root is put first on the import path):
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 4 [--device cuda]            # Mixtral-width
  python3 benchmarks/make_checkpoint.py OUT_DIR --preset qwen3-30b-a3b --layers 4      # Qwen3-30B-A3B width
  python3 benchmarks/make_checkpoint.py OUT_DIR --layers 32 --zero-experts              # full size, sparse file
  python3 benchmarks/make_checkpoint.py OUT_DIR --preset gpt-oss-120b --layers 4 --mxfp4  # the Hub's MXFP4 experts
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.make_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
