#!/usr/bin/env python3
"""HF checkpoint -> GGUF with the carried llama.cpp tree: bf16 (``convert_hf_to_gguf.py --outtype bf16``), then
each ``--quant`` type (``llama-quantize IN OUT TYPE``, e.g. Q4_0) from the bf16 file. Skips a file that exists.

The exact commands it runs (printed too), with ``L`` the untarred tree (``build/peers/llama.cpp``):
  python3 L/convert_hf_to_gguf.py CKPT --outtype bf16 --outfile OUT/model-bf16.gguf
  BIN/llama-quantize OUT/model-bf16.gguf OUT/model-Q4_0.gguf Q4_0 [threads]
``convert_hf_to_gguf.py`` puts ``L/gguf-py`` first on the import path itself; it needs torch, numpy, pyyaml, tqdm
and transformers (all on the GPU host), sentencepiece only for a ``tokenizer.model`` (our checkpoints carry
``tokenizer.json``: its LlamaHfVocab path reads that through transformers).

Examples:
  python3 benchmarks/peers/convert_gguf.py CKPT --out /tmp/peers/gguf --quant Q4_0
  python3 benchmarks/peers/convert_gguf.py CKPT --out /tmp/peers/gguf --bin build/peers/llama-build-cpu/bin
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEFAULT_SRC = common.REPO / "build" / "peers" / "llama.cpp"


def default_bin() -> Path:
    for mode in ("cuda", "cpu"):
        b = common.REPO / "build" / "peers" / f"llama-build-{mode}" / "bin"
        if (b / "llama-quantize").exists():
            return b
    return common.REPO / "build" / "peers" / "llama-build-cuda" / "bin"


def run(cmd: list[str]) -> float:
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=common.llama_env())
    return time.perf_counter() - t0


def convert_command(src: Path, pre_tokenizer: str | None) -> list[str]:
    """``python3 L/convert_hf_to_gguf.py``; with a pre-tokenizer name, the same script run with
    ``TextModel.get_vocab_base_pre`` answering that name."""
    script = src / "convert_hf_to_gguf.py"
    if pre_tokenizer is None:
        return [sys.executable, str(script)]
    code = (f"import runpy, sys; sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]; "
            f"sys.argv[0] = {str(script)!r}; import conversion.base as b; "
            f"b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre_tokenizer!r}; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    return [sys.executable, "-c", code]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--out", required=True, help="folder of the .gguf files")
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="the untarred llama.cpp tree (build_llama_cpp.sh)")
    ap.add_argument("--bin", default=None, help="folder of llama-quantize (default: build/peers/llama-build-*/bin)")
    ap.add_argument("--quant", action="append", default=[], help="llama-quantize type (repeatable), e.g. Q4_0")
    ap.add_argument("--name", default="model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pre-tokenizer", default=None,
                    help="write this tokenizer.ggml.pre (e.g. qwen2) instead of llama.cpp's hash lookup, which knows "
                         "only published tokenizers: our random checkpoints carry a synthetic one; llama-batched-bench "
                         "feeds token ids, so the pre-tokenizer never runs")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    times = {}
    bf16 = out / f"{a.name}-bf16.gguf"
    if not bf16.exists():
        tmp = bf16.with_suffix(".gguf.part")
        times["bf16"] = run(convert_command(Path(a.src), a.pre_tokenizer) + [a.ckpt, "--outtype", "bf16",
                                                                            "--outfile", str(tmp)])
        tmp.replace(bf16)
    for q in a.quant:
        dst = out / f"{a.name}-{q}.gguf"
        if not dst.exists():
            tmp = dst.with_suffix(".gguf.part")
            b = Path(a.bin) if a.bin else default_bin()
            times[q] = run([str(b / "llama-quantize"), str(bf16), str(tmp), q, str(a.threads)])
            tmp.replace(dst)
    info = {"ckpt": a.ckpt, "model": common.model_label(a.ckpt), "files": {
        p.name: p.stat().st_size for p in sorted(out.glob(f"{a.name}-*.gguf"))}, "seconds": times}
    (out / f"{a.name}-convert.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
