#!/usr/bin/env bash
# CI step: the planner (lightning_moe.policy: HRM + MILP, no torch) under Python 3.12, in a fresh venv that installs
# only the planner's dependencies with the version ranges pyproject.toml declares, so a resolver on 3.12 (which
# would pick PuLP >= 4 without the upper bound) is tested. Interpreter: $PYTHON312, else python3.12 on PATH, else
# pyenv's newest 3.12.x; a missing interpreter fails the step.
set -euo pipefail
cd "$(dirname "$0")/.."

find_py312() {
    local c
    for c in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
             $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 /root/.pyenv/versions/3.12*/bin/python3 \
                 2>/dev/null | sort -rV); do
        if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

PY312=$(find_py312) || {
    echo "ci_py312.sh: no Python 3.12 found (set PYTHON312, put python3.12 on PATH, or install it with pyenv)" >&2
    exit 1
}
VENV=$(mktemp -d)/venv312
trap 'rm -rf "$(dirname "$VENV")"' EXIT
"$PY312" -m venv "$VENV"
# the planner's requirements, read from pyproject.toml (their declared ranges), plus pytest
mapfile -t REQS < <("$VENV/bin/python" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
planner = {"pulp", "highspy", "numpy", "pyyaml"}
for d in deps:
    if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() in planner:
        print(d)
EOF
)
[ "${#REQS[@]}" -eq 4 ] || { echo "ci_py312.sh: expected pulp, highspy, numpy, pyyaml in pyproject.toml, got: ${REQS[*]}" >&2; exit 1; }
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${REQS[@]}" "pytest>=7"
"$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -i -E '^(pulp|highspy) '
# the planner's test files; tests that need torch skip themselves (no torch here); --noconftest: the shared
# fixtures build torch checkpoints
PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:cacheprovider --noconftest \
    tests/test_milp.py tests/test_hrm.py tests/test_expert_parallel_plan.py tests/test_attention_offsets.py \
    tests/test_host_stage.py tests/test_prefill_memory.py tests/test_milp_solver.py tests/test_milp_solve_cache.py \
    tests/test_dram_sharing.py
