"""GPU tests: skipped without a CUDA device (see conftest.py)."""
