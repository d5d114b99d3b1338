#!/usr/bin/env bash
# The next GPU session's measurements, one step per call of the `device` tool (each call <= 10 min):
#   bash benchmarks/device_plan.sh 1   # GPU tests, quant FFN sweep, host profile          (~6 min)
#   bash benchmarks/device_plan.sh 2   # issue 6: full32 24 GiB gen 128, bf16 vs int4      (~9 min)
#   bash benchmarks/device_plan.sh 3   # full32 16 GiB, full-size accelerate, l8 same-run   (~9 min)
# Call it with carry [".carry"] (wheels + tiny-mixtral cache, see the closing note) and BENCH_COMMIT set to
# the commit hash (the GPU host's .git is stale). Results land in $OUT; append them to benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LIGHTNING_MOE_CACHE=$PWD/.carry/cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
C=${BENCH_COMMIT:-unknown}
case "${1:-1}" in
  1)
    timeout 240 python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -15 "$OUT/gpu_tests.txt"
    timeout 90 python3 benchmarks/bench_quant_ffn.py > "$OUT/quant_ffn.md" 2>&1; cat "$OUT/quant_ffn.md"
    timeout 120 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | tail -12
    ;;
  2)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128,full32-24g-g128-int4 --timeout 400 \
      --commit "$C" --out "$OUT" 2> "$OUT/bench_stderr.txt" | tail -8
    ;;
  3)
    python3 benchmarks/bench_cgopipe.py --cases full32-16g-g32,full32-24g-accel,l8-10g-g32 --timeout 200 \
      --commit "$C" --out "$OUT" 2> "$OUT/bench_stderr.txt" | tail -10
    ;;
esac
