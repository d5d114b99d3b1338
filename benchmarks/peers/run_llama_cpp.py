#!/usr/bin/env python3
"""Peer: llama.cpp's ``llama-batched-bench`` on a GGUF of the checkpoint, experts on the CPU (``--cpu-moe``),
everything else on the GPU (``-ngl 99``); one result row from its best batch.

Runs ``llama-batched-bench -m GGUF -ngl 99 --cpu-moe -c C -b 2048 -ub 512 -npp P -ntg G -npl 256,128,...,2,1 --load-mode none``
(output to ``OUT/llama-WEIGHTS-gG.txt``; ``--gen 32,128`` runs both lengths in one process, a row each), parses its table (``make_table.parse_batched_bench``) and keeps the row of
the highest generated tokens / s end to end, ``B * TG / T`` (``T`` = prompt + generation time of that batch; its
own ``S t/s`` also counts prompt tokens and is kept in the row's ``extra``). ``P`` is the mean templated length of
the MT-Bench first turns under the checkpoint's tokenizer (``--prompt-len`` overrides; batched-bench's prompts are
random token ids of that length, so it sees the same lengths, not the same texts), ``C = max(npl) * (P + G)`` rounded up to 256 per sequence.
``N`` is that batch's B. The GPU's peak memory (nvidia-smi) is recorded; llama.cpp has no memory cap, the
experts on the host keep it far below the others' cap (``--n-cpu-moe K`` instead keeps only the first K layers'
experts on the CPU, to fill a cap).

A run stopped by ``--timeout`` keeps the batches it finished (the row says ``partial``).

Examples:
  python3 benchmarks/peers/run_llama_cpp.py GGUF --tokenizer CKPT --gen 128 --out OUT
  python3 benchmarks/peers/run_llama_cpp.py GGUF --tokenizer CKPT --gen 8 --npl 1,2,4 --bin build/peers/llama-build-cpu/bin --ngl 0 --out OUT
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import make_table  # noqa: E402

# largest first: a run stopped by --timeout has measured the batches that matter most
DEFAULT_NPL = "256,128,64,32,16,8,4,2,1"


def default_bin() -> Path:
    for mode in ("cuda", "cpu"):
        b = common.REPO / "build" / "peers" / f"llama-build-{mode}" / "bin"
        if (b / "llama-batched-bench").exists():
            return b
    return common.REPO / "build" / "peers" / "llama-build-cuda" / "bin"


def weights_of(gguf: str) -> str:
    m = re.search(r"-(bf16|f16|f32|Q\d\w*)\.gguf$", Path(gguf).name, re.I)
    return m.group(1) if m else Path(gguf).stem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--tokenizer", required=True, help="the HF checkpoint (its tokenizer gives P; config the label)")
    ap.add_argument("--gen", default="128", help="-ntg: one or more output lengths, e.g. 32,128 (a row each)")
    ap.add_argument("--prompt-len", type=int, default=None, help="P (default: mean templated MT-Bench length)")
    ap.add_argument("--npl", default=DEFAULT_NPL)
    ap.add_argument("--bin", default=None, help="folder of llama-batched-bench (default build/peers/llama-build-*/bin)")
    ap.add_argument("--ngl", default="99")
    ap.add_argument("--n-cpu-moe", type=int, default=None, help="experts of the first K layers on the CPU "
                    "(default: all, --cpu-moe)")
    ap.add_argument("--batch", type=int, default=2048, help="-b (default 2048)")
    ap.add_argument("--ubatch", type=int, default=2048, help="-ub (default 2048: fewer passes of the host experts "
                    "through the GPU in prefill)")
    ap.add_argument("--threads", type=int, default=None, help="-t (default: llama.cpp's)")
    ap.add_argument("--cap", default="12GiB", help="the cap the other rows ran at (recorded; llama.cpp takes none)")
    ap.add_argument("--extra", default="--load-mode none", help="more llama-batched-bench arguments, one string "
                    "(default '--load-mode none': llama.cpp's advice when tensors are overridden to the CPU)")
    ap.add_argument("--weights", default=None, help="label (default: from the file name, e.g. bf16 / Q4_0)")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--mtbench", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    weights = a.weights or weights_of(a.gguf)
    gens = [int(x) for x in str(a.gen).split(",")]
    tag = "-".join(f"g{g}" for g in gens)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mean_p = common.mean_prompt_len(a.tokenizer, a.mtbench)
    pp = a.prompt_len or round(mean_p)
    npl = [int(x) for x in a.npl.split(",")]
    ctx = max(npl) * (-(-(pp + max(gens)) // 256) * 256)  # each sequence's share a multiple of 256 (llama.cpp pads)
    b = Path(a.bin) if a.bin else default_bin()
    cmd = [str(b / "llama-batched-bench"), "-m", a.gguf, "-ngl", str(a.ngl), "-c", str(ctx), "-b", str(a.batch),
           "-ub", str(a.ubatch), "-npp", str(pp), "-ntg", ",".join(map(str, gens)), "-npl", a.npl]
    cmd += ["--n-cpu-moe", str(a.n_cpu_moe)] if a.n_cpu_moe is not None else ["--cpu-moe"]
    if a.threads:
        cmd += ["-t", str(a.threads)]
    cmd += a.extra.split()
    print("+", " ".join(cmd), flush=True)
    txt, err = out / f"llama-{weights}-{tag}.txt", out / f"llama-{weights}-{tag}.stderr.txt"
    base = {"peer": "llama.cpp", "weights": weights, "model": common.model_label(a.tokenizer), "model_dir": a.gguf,
            "prompt_len": pp, "prompt_len_mean": round(mean_p, 1), "cap": a.cap,
            "cap_note": "experts on CPU" if a.n_cpu_moe is None else f"experts of {a.n_cpu_moe} layers on CPU",
            "device": common.device_name(), "command": " ".join(cmd)}
    src = common.REPO / "build" / "peers" / "llama.cpp" / "PEERS_SOURCE"
    if src.exists():
        base["llama_cpp_source"] = src.read_text().strip()
    t0 = time.perf_counter()
    with open(txt, "w") as fo, open(err, "w") as fe, common.GpuMemPoller() as mem:
        try:
            rc = subprocess.run(cmd, stdout=fo, stderr=fe, timeout=a.timeout, env=common.llama_env()).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    base["wall_s_process"] = round(time.perf_counter() - t0, 2)
    base["gpu_peak_gib"] = mem.peak_gib
    rows = make_table.parse_batched_bench(txt.read_text())
    failed = 0
    for g in gens:
        row = dict(base, gen_len=g)
        mine = [r for r in rows if r["tg"] == g]
        best = make_table.best_batched_bench(mine, pp=pp, tg=g)
        if best is None:
            tail = err.read_text().splitlines()[-12:]
            row.update(status="failed", reason=f"exit {rc}, no table rows for TG {g}: " + " | ".join(tail)[-600:])
            failed += 1
        else:
            done = sorted(r["pl"] for r in mine)
            row.update(N=best["pl"], requests=best["pl"], gen_tokens=best["pl"] * best["tg"], seconds=best["t"],
                       tok_s=best["gen_tok_s"], status="ok",
                       extra={"best": best, "npl": a.npl, "rows": mine, "exit": rc,
                              "complete": rc == 0 and len(done) == len(npl), "output": str(txt)})
            if not row["extra"]["complete"]:
                row["extra"]["note"] = f"partial (exit {rc}): measured B = {done}"
        common.write_row(out, f"llama-{weights}-g{g}", row)
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
