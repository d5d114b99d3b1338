#!/usr/bin/env bash
# GPU-host plan for the CLI acceptance suite (each step < 10 minutes; run from the repository root).
# Needs: LIGHTNING_MOE_CACHE pointing at a folder holding tiny-mixtral-v1 (its tokenizer is copied into the
# checkpoints), pulp installed, ninja + g++ for the native CPU attention kernel. Checkpoints and job files live in
# $WORK (default /tmp/lmoe-suite; reused by later steps while the machine stays warm, rebuilt when missing).
#   bash benchmarks/suite_plan.sh 1   # 4-layer Mixtral-width checkpoint (cuda RNG) + int4 copy, then tests/gpu/test_cli_gpu.py
#   bash benchmarks/suite_plan.sh 2   # the acceptance suite (cli_sweep --preset suite), table in $OUT/suite/sweep.md
#   bash benchmarks/suite_plan.sh 3   # accelerate baseline on the suite's 1000 x 300-token perplexity texts at 12 GiB
#   bash benchmarks/suite_plan.sh 4   # the 24-case sweep (cli_sweep --preset sweep), table in $OUT/sweep/sweep.md
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK="${WORK:-/tmp/lmoe-suite}"
OUT="${OUT:-$WORK/out}"
mkdir -p "$WORK" "$OUT"
case "${1:?usage: suite_plan.sh STEP (1-4)}" in
  1) python3 benchmarks/cli_sweep.py --preset suite --work "$WORK" --out "$OUT/prepare" --prepare-only --gen-device cuda 2>&1 | tail -8
     timeout 420 python3 -m pytest -q tests/gpu/test_cli_gpu.py -m gpu -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/test_cli_gpu.txt" || true ;;
  2) python3 benchmarks/cli_sweep.py --preset suite --work "$WORK" --out "$OUT/suite" --time-budget 540 --skip-done \
       --gen-device cuda 2>&1 | tail -40 || true; cat "$OUT/suite/sweep.md" ;;
  3) CK=$(ls -d "$WORK"/ckpt-bf16-L4-*); python3 benchmarks/ppl_accelerate.py "$CK" \
       --data "$WORK/data/suite-ppl-accept-bf16-12g.jsonl" --cap 12GiB --batch-size 8 --time-budget 300 \
       --compare "$WORK/results/suite-ppl-accept-bf16-12g.jsonl" --out "$OUT/ppl_accelerate.json" 2>&1 | tail -45 || true ;;
  4) python3 benchmarks/cli_sweep.py --preset sweep --work "$WORK" --out "$OUT/sweep" --time-budget 540 --skip-done \
       --gen-device cuda 2>&1 | tail -40 || true; cat "$OUT/sweep/sweep.md" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
