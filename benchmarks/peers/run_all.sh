#!/usr/bin/env bash
# Issue 45 on the GPU host: every peer on the same checkpoint, prompts, lengths and cap; steps in the order given.
#
#   bash benchmarks/peers/run_all.sh STEP...      steps: setup build ckpt convert ours llama accelerate deepspeed table
#
# Device calls: each < 600 s; a step whose row is already written is skipped, so a call that ran out of time is
# continued by the next one with the same steps. The calls of the latest results, with their times:
# benchmarks/peers/README.md, "Device calls".
#
# Env: WORK (checkpoints, GGUFs; default /tmp/peers-work), OUT (rows, logs, table; default ${OUT:-/tmp/out}/peers),
# LAYERS (4), CAP (12GiB), GENS ("128 32"), REQUESTS (2000, ours), MAXB (256, accelerate/deepspeed),
# DEADLINE (seconds this call may use, default 570; each run step gets the time left as its timeout),
# PRESET (make_checkpoint.py --preset, e.g. qwen3-30b-a3b; default none: Mixtral-8x7B width; its rows go to
# OUT/peers-PRESET), GGUF_PRE (convert_gguf.py --pre-tokenizer; default qwen2 for a qwen* preset),
# NPL (llama-batched-bench -npl, default run_llama_cpp.py's 256,128,...,1), HARDWARE (ours: the job's hardware
# profile, e.g. lightning_moe/policy/profiles/h100-host.yaml; default the host's measured profile, measured once by the first job),
# HEADROOMS (accelerate: one run per value, max_memory = CAP minus it; default 3GiB), PREBUILT (a tarball of
# llama.cpp's CUDA binaries, bin/ and lib/; used when present and it runs, else the source build).
# SMOKE=1: the same steps on this CPU machine with a tiny checkpoint (2 layers, width 128), a CPU build of llama.cpp,
# 40 requests, gen 8 and 16: proves the scripts and parsers, its numbers are not results.
set -uo pipefail
cd "$(dirname "$0")/../.."
T_START=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LIGHTNING_MOE_CACHE=${LIGHTNING_MOE_CACHE:-$PWD/.carry/cache}
WORK=${WORK:-/tmp/peers-work}
OUT=${OUT:-/tmp/out}/peers${PRESET:+-$PRESET}   # a preset's rows in their own folder: a row name has no model
LAYERS=${LAYERS:-4}; CAP=${CAP:-12GiB}; GENS=${GENS:-"128 32"}; REQUESTS=${REQUESTS:-2000}; MAXB=${MAXB:-256}
DEADLINE=${DEADLINE:-570}; PRESET=${PRESET:-}   # empty: make_checkpoint's defaults, the Mixtral-8x7B width
MODE=cuda; CKARGS=(--device cuda); OURS=(); LLAMA=(); HF=(); BUILD=()
if [[ ${SMOKE:-0} == 1 && -n $PRESET ]]; then  # make_checkpoint.py takes no width flags beside a preset
  echo "run_all.sh: SMOKE=1 writes a Mixtral-shaped tiny checkpoint; it does not take PRESET=$PRESET" >&2; exit 2
fi
if [[ ${SMOKE:-0} == 1 ]]; then
  WORK=${WORK%-work}-smoke; LAYERS=2; GENS=${GENS_SMOKE:-"16 8"}; REQUESTS=40; MAXB=8; MODE=cpu; DEADLINE=${DEADLINE_SMOKE:-1800}
  CKARGS=(--hidden 128 --intermediate 256 --heads 4 --kv-heads 2)
  OURS=(--device cpu --dtype float32 --cap ''); LLAMA=(--ngl 0 --threads 2 --npl 16,8,4,2,1); HF=(--device cpu); BUILD=(--cpu)
fi
NAME=${PRESET:-mixtral-8x7b}; CK=$WORK/ckpt-$NAME-L$LAYERS; CK4=$CK-int4; GG=$WORK/gguf-$NAME-L$LAYERS
PRESET_ARG=(); [[ -n $PRESET ]] && PRESET_ARG=(--preset "$PRESET")
GGUF_PRE=${GGUF_PRE:-}; [[ -z $GGUF_PRE && $PRESET == qwen* ]] && GGUF_PRE=qwen2  # convert_gguf.py --pre-tokenizer
PRE_ARG=(); [[ -n $GGUF_PRE ]] && PRE_ARG=(--pre-tokenizer "$GGUF_PRE")
P=benchmarks/peers
mkdir -p "$WORK" "$OUT"
left() { echo $(( DEADLINE - ($(date +%s) - T_START) )); }
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T_START ))s] $*"; }
have_row() { python3 -c "import json,sys; sys.exit(0 if json.load(open('$OUT/$1.json')).get('status')=='ok' else 1)" 2>/dev/null; }

step_setup() {   # wheels the host lacks into /tmp/site (no resolver, torch's own requirements untouched)
  local site=/tmp/site
  export PYTHONPATH=$site:$PWD
  python3 -c "import highspy, pulp, mistral_common, sentencepiece, deepspeed" 2>/dev/null && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site \
      .carry/whl/*.whl .carry/peers/wheels/*.whl 2>&1 | tail -2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h "$WORK" | tail -1; nproc; free -g | head -2
  python3 -c "import torch, transformers, accelerate, deepspeed; print(torch.__version__, transformers.__version__, accelerate.__version__, deepspeed.__version__)"
}
PREBUILT=${PREBUILT:-.carry/peers/llama-prebuilt-cuda13-sm90.tar.xz}  # CUDA 13 / sm_90 binaries built elsewhere
use_prebuilt() {  # unpack them and run one; any failure: build from source instead
  [[ $MODE == cuda && -f $PREBUILT ]] || return 1
  local dst=build/peers/llama-build-cuda lib
  lib=$(python3 -c "import importlib.util, pathlib, sys
s = importlib.util.find_spec('nvidia')
for r in (s.submodule_search_locations if s else []):
    for h in sorted(pathlib.Path(r).rglob('libcublas.so.13*')):
        print(h.parent); sys.exit()") || return 1
  [[ -n $lib ]] || return 1
  mkdir -p "$dst" && tar xJf "$PREBUILT" -C "$dst" || return 1
  echo "$lib" > build/peers/cublas-libdir
  if LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$dst/bin/llama-batched-bench" --list-devices 2>&1 \
      | tee "$OUT/prebuilt-check.log" | grep -q CUDA0; then
    log "llama.cpp: the prebuilt binaries of $PREBUILT run ($(grep -m1 CUDA0 "$OUT/prebuilt-check.log"))"; return 0
  fi
  log "llama.cpp: the prebuilt binaries do not run here ($OUT/prebuilt-check.log): building from source"
  rm -rf "$dst" build/peers/cublas-libdir; return 1
}
step_build() {   # in the background: ckpt and convert's bf16 GGUF run beside it; every later step waits for it
  if [[ -x build/peers/llama-build-$MODE/bin/llama-batched-bench ]]; then return; fi
  use_prebuilt && return
  log "llama.cpp $MODE build started (log $OUT/build.log)"
  PEERS_DIR=build/peers setsid bash $P/build_llama_cpp.sh "${BUILD[@]}" > "$OUT/build.log" 2>&1 &  # its own
  #   process group: wait_build can stop it whole
  BUILD_PID=$!
}
wait_build() {   # a step that times anything waits for a background build first (a 16-core compile beside a
  #   measured run would slow it), within DEADLINE: a build still running 30 s before it is stopped
  [[ -n ${BUILD_PID:-} ]] || return 0
  if ! kill -0 "$BUILD_PID" 2>/dev/null; then wait "$BUILD_PID"; tail -4 "$OUT/build.log"; BUILD_PID=; return 0; fi
  log "waiting for the llama.cpp build before $1"
  while kill -0 "$BUILD_PID" 2>/dev/null; do
    (( $(left) > 30 )) || { log "llama.cpp build not done 30 s before DEADLINE: stopped"; kill -- -"$BUILD_PID" 2>/dev/null; wait "$BUILD_PID" 2>/dev/null; BUILD_PID=; return 1; }
    sleep 2
  done
  wait "$BUILD_PID"; tail -4 "$OUT/build.log"; BUILD_PID=
}
step_ckpt() {
  [[ -f $CK/config.json ]] || python3 benchmarks/make_checkpoint.py "$CK" "${PRESET_ARG[@]}" --layers "$LAYERS" \
      "${CKARGS[@]}" > "$OUT/ckpt.log" 2>&1 || { tail -5 "$OUT/ckpt.log"; return 1; }
  tail -1 "$OUT/ckpt.log"
  [[ -f $CK4/config.json ]] || python3 -m lightning_moe.cli quantize "$CK" "$CK4" --experts int4 > "$OUT/quantize.log" 2>&1 \
      || { tail -5 "$OUT/quantize.log"; return 1; }
  tail -2 "$OUT/quantize.log"; du -sh "$CK" "$CK4"
}
step_convert() {   # convert_hf_to_gguf.py comes from the source tree (the prebuilt binaries do not carry it)
  if [[ ! -f build/peers/llama.cpp/PEERS_SOURCE ]]; then
    mkdir -p build/peers && tar xzf "$(ls -t .carry/peers/llama.cpp-*.tar.gz | head -1)" -C build/peers || return 1
  fi
  python3 $P/convert_gguf.py "$CK" --out "$GG" "${PRE_ARG[@]}" > "$OUT/convert-bf16.log" 2>&1 || { tail -8 "$OUT/convert-bf16.log"; return 1; }
  wait_build "the Q4_0 conversion (llama-quantize)" || return 1
  python3 $P/convert_gguf.py "$CK" --out "$GG" --quant Q4_0 > "$OUT/convert-q4.log" 2>&1 || { tail -8 "$OUT/convert-q4.log"; return 1; }
  tail -1 "$OUT/convert-q4.log"; df -h "$WORK" | tail -1
}
step_ours() {
  wait_build ours || return 1
  for g in $GENS; do for ck in "$CK" "$CK4"; do
    w=bf16; [[ ${SMOKE:-0} == 1 ]] && w=float32   # run_ours.py names its row by the dtype (SMOKE: --dtype float32)
    [[ $ck == "$CK4" ]] && w=int4
    have_row ours-$w-g$g && continue
    (( $(left) > 30 )) || { log "no time left for ours $w g$g"; return; }
    log "ours $w gen $g"
    python3 $P/run_ours.py "$ck" --gen "$g" --requests "$REQUESTS" --cap "$CAP" --out "$OUT" --work "$WORK/ours" \
      --timeout $(( $(left) - 10 )) ${HARDWARE:+--hardware "$HARDWARE"} "${OURS[@]}"
  done; done
}
step_llama() {
  wait_build llama.cpp || return 1
  local gl=${GENS// /,}
  for w in bf16 Q4_0; do
    have_row llama-$w-g${GENS##* } && continue
    (( $(left) > 40 )) || { log "no time left for llama.cpp $w"; return; }
    local t=$(( $(left) - 10 )); [[ $w == bf16 ]] && (( t > ($(left) - 10) * 55 / 100 )) && t=$(( ($(left) - 10) * 55 / 100 ))
    log "llama.cpp $w gen $gl (timeout $t s)"
    python3 $P/run_llama_cpp.py "$GG/model-$w.gguf" --tokenizer "$CK" --gen "$gl" --cap "$CAP" --out "$OUT" --timeout "$t" ${NPL:+--npl "$NPL"} "${LLAMA[@]}"
  done
}
step_hf() {  # accelerate | deepspeed; accelerate once per HEADROOMS value (its max_memory is CAP minus it)
  local who=$1 hs=(3GiB) h row
  [[ $who == accelerate ]] && read -ra hs <<< "${HEADROOMS:-3GiB}"
  wait_build "$who" || return 1
  for g in $GENS; do for h in "${hs[@]}"; do
    row=$who-bf16-g$g; [[ $h != 3GiB ]] && row=$row-h$h
    have_row $row && continue
    (( $(left) > 60 )) || { log "no time left for $row"; return; }
    local budget=$(( ($(left) - 60) / 2 )); (( budget > 200 )) && budget=200
    log "$row (time budget $budget s)"
    local extra=(); [[ $who == accelerate ]] && extra=(--headroom "$h")
    timeout $(( $(left) - 5 )) python3 $P/run_$who.py "$CK" --gen "$g" --cap "$CAP" --max-batch "$MAXB" --batches 2 \
      --time-budget "$budget" --out "$OUT" "${extra[@]}" "${HF[@]}" > "$OUT/$row.log" 2>&1; tail -1 "$OUT/$row.log"
  done; done
}
step_accelerate() { step_hf accelerate; }
step_deepspeed() { step_hf deepspeed; }
step_table() { python3 $P/make_table.py "$OUT" --md "$OUT/peers-table.md"; }

FAILED=()
for s in "$@"; do
  log "step $s"
  if ! declare -F "step_$s" > /dev/null; then log "no step '$s' (steps: setup build ckpt convert ours llama accelerate deepspeed table)"; FAILED+=("$s"); continue; fi
  "step_$s" || { log "step $s failed"; FAILED+=("$s"); }
done
wait_build "the end" || FAILED+=(build)
log "done${FAILED:+; failed: ${FAILED[*]}}"
(( ${#FAILED[@]} == 0 ))   # the exit status: 1 when a step failed or was unknown
