"""Trim the llama.cpp tree vendored by the llama-cpp-python sdist into a carry tarball.

Run on a machine with internet (or give --sdist): it writes
``.carry/peers/llama.cpp-<version>.tar.gz`` holding only what a CUDA (or CPU)
build of ``llama-batched-bench`` and the HF -> GGUF conversion need:

- root CMake files, ``cmake/``, ``include/``, ``src/``, ``common/``,
  ``vendor/``, ``licenses/``;
- ``ggml/`` with only the ``ggml-cpu`` and ``ggml-cuda`` backends;
- the ``tools/`` subfolders its CMake always adds (not server/ui/cli/rpc);
- ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``.

Nothing of llama.cpp goes into git; ``build_llama_cpp.sh`` untars this file.

    python benchmarks/peers/prepare_llama_cpp.py            # pip download + trim
    python benchmarks/peers/prepare_llama_cpp.py --sdist /tmp/llama_cpp_python-0.3.36.tar.gz
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".carry" / "peers"
DEFAULT_VERSION = "0.3.36"

ROOT_FILES = {"CMakeLists.txt", "CMakePresets.json", "LICENSE", "convert_hf_to_gguf.py",
              "pyproject.toml"}
ROOT_DIRS = {"cmake", "include", "src", "common", "vendor", "licenses", "conversion",
             "gguf-py"}
# tools/CMakeLists.txt adds these unconditionally (server/ui/cli only with
# LLAMA_BUILD_SERVER, rpc with GGML_RPC, tuning with GGML_METAL).
TOOLS = {"batched-bench", "gguf-split", "imatrix", "llama-bench", "completion",
         "perplexity", "quantize", "tokenize", "tts", "mtmd", "cvector-generator",
         "export-lora", "fit-params", "results"}
GGML_BACKENDS = {"ggml-cpu", "ggml-cuda"}
# Never needed for the build or the conversion.
SKIP_PARTS = {"__pycache__", ".git", ".github"}
SKIP_SUFFIXES = (".gguf", ".png", ".jpg", ".jpeg", ".mp4", ".webp")


def keep(rel: str) -> bool:
    """Whether the path relative to the llama.cpp root goes into the tarball."""
    parts = rel.split("/")
    if any(p in SKIP_PARTS for p in parts) or rel.endswith(SKIP_SUFFIXES):
        return False
    top = parts[0]
    if len(parts) == 1:
        return top in ROOT_FILES or top in ROOT_DIRS or top in ("tools", "ggml")
    if top in ROOT_DIRS:
        # vendor/miniaudio is only for tts/mtmd audio; still compiled, keep it.
        return True
    if top == "tools":
        return parts[1] == "CMakeLists.txt" or parts[1] in TOOLS
    if top == "ggml":
        if parts[1] != "src" or len(parts) == 2:
            return True
        name = parts[2]
        if name.startswith("ggml-") and "." not in name and len(parts) >= 3:
            # a backend folder
            return name in GGML_BACKENDS
        return True
    return False


def find_sdist(version: str, work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
                    "--no-deps", "--no-binary", ":all:", "-d", str(work)], check=True)
    return next(work.glob("llama_cpp_python-*.tar.gz"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, help="llama_cpp_python-X.tar.gz (default: pip download)")
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or find_sdist(args.version, Path(tmp))
        base = sdist.name.removesuffix(".tar.gz")
        version = base.split("-")[-1]
        prefix = f"{base}/vendor/llama.cpp/"
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / f"llama.cpp-{version}.tar.gz"
        n = 0
        total = 0
        with tarfile.open(sdist, "r:gz") as src, tarfile.open(out, "w:gz", compresslevel=9) as dst:
            for m in src:
                if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                    continue
                rel = m.name[len(prefix):].rstrip("/")
                if not rel or not keep(rel):
                    continue
                m2 = tarfile.TarInfo(f"llama.cpp/{rel}")
                m2.mode, m2.mtime = m.mode, m.mtime
                if m.isdir():
                    m2.type = tarfile.DIRTYPE
                    dst.addfile(m2)
                    continue
                data = src.extractfile(m).read()
                m2.size = len(data)
                dst.addfile(m2, io.BytesIO(data))
                n += 1
                total += len(data)
            # A marker the build script checks for.
            stamp = f"llama-cpp-python {version}\n".encode()
            m2 = tarfile.TarInfo("llama.cpp/PEERS_SOURCE")
            m2.size = len(stamp)
            dst.addfile(m2, io.BytesIO(stamp))
    print(f"{out}: {n} files, {total / 2**20:.1f} MiB raw, "
          f"{out.stat().st_size / 2**20:.1f} MiB gzipped")


if __name__ == "__main__":
    main()
