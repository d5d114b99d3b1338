#!/usr/bin/env python3
"""The peers table (issue 45): reads the result rows (``*.json`` with a ``peer`` key) of one or more folders and
writes one markdown table: per model and output length, every peer's end-to-end tokens/s, ours at the same weight
precision, and the ratio ours / peer.

Also the parser of ``llama-batched-bench`` output (``parse_batched_bench``: its markdown table or its
``--output-format jsonl`` lines) and the choice of its best row (``best_batched_bench``), which
``run_llama_cpp.py`` uses.

Rates: ``tok_s`` of a row is generated tokens / (prefill + decode) seconds, load excluded, for every peer
(llama-batched-bench's own ``S t/s`` also counts the prompt tokens; the table uses ``B * TG / T`` of its best row
instead, and gives its ``S t/s`` in the notes). Weight classes: ``bf16`` against ``bf16``; ``int4`` (ours) against
``Q4_0`` (llama.cpp), both 4-bit weights with a scale per 32 (Q4_0) or per group (ours).

Usage:
  python3 benchmarks/peers/make_table.py OUT [OUT2 ...] [--md OUT/peers-table.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BB_FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_NUM = re.compile(r"^-?\d+(\.\d+)?$")
PEER_ORDER = {"ours": 0, "llama.cpp": 1, "accelerate": 2, "deepspeed": 3}
WEIGHT_CLASS = {"bf16": "16-bit", "bfloat16": "16-bit", "float16": "16-bit", "fp16": "16-bit", "f16": "16-bit",
                "int4": "4-bit", "q4_0": "4-bit", "q4_k_m": "4-bit", "float32": "32-bit"}


def parse_batched_bench(text: str) -> list[dict]:
    """Rows of ``llama-batched-bench`` output: its markdown table (``|  PP |  TG |  B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s |``; columns split on ``|``, so a number wider than its column is fine) and/or
    ``--output-format jsonl`` lines. Header, separator and log lines are skipped. Each row: ``pp, tg, pl, n_kv``
    (int), ``t_pp, speed_pp, t_tg, speed_tg, t, speed`` (float), plus ``gen_tok_s`` = pl * tg / t."""
    rows = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{") and '"speed"' in s:
            try:
                d = json.loads(s)
            except ValueError:
                continue
            if all(k in d for k in BB_FIELDS):
                rows.append({k: (int(d[k]) if k in ("pp", "tg", "pl", "n_kv") else float(d[k])) for k in BB_FIELDS})
            continue
        if not s.startswith("|"):
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if len(cells) != len(BB_FIELDS) or not all(_NUM.match(c) for c in cells):
            continue
        rows.append({k: (int(c) if k in ("pp", "tg", "pl", "n_kv") else float(c)) for k, c in zip(BB_FIELDS, cells)})
    for r in rows:
        r["gen_tok_s"] = r["pl"] * r["tg"] / r["t"] if r["t"] > 0 else 0.0
    return rows


def best_batched_bench(rows: list[dict], pp: int | None = None, tg: int | None = None) -> dict | None:
    """The row of the highest generated tokens / s end to end (``gen_tok_s``) among those of ``pp`` / ``tg``."""
    cand = [r for r in rows if (pp is None or r["pp"] == pp) and (tg is None or r["tg"] == tg)]
    return max(cand, key=lambda r: r["gen_tok_s"]) if cand else None


def load_rows(folders: list[str]) -> list[dict]:
    rows = []
    for f in folders:
        for p in sorted(Path(f).glob("*.json")):
            try:
                d = json.loads(p.read_text())
            except ValueError:
                continue
            if isinstance(d, dict) and "peer" in d:
                d["_file"] = str(p)
                rows.append(d)
    return rows


def weight_class(w: str | None) -> str:
    return WEIGHT_CLASS.get(str(w).lower(), str(w))


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _cap(r: dict) -> str:
    cap = r.get("cap")
    peak = r.get("gpu_peak_gib")
    s = str(cap) if cap else "none"
    if r["peer"] == "llama.cpp":
        s = r.get("cap_note") or "experts on CPU"
    if peak is not None:
        s += f" (peak {peak:.1f} GiB)"
    return s


def note(r: dict) -> str:
    if r.get("status") != "ok":
        return f"**{r.get('status')}**: {r.get('reason', '')}"[:300]
    ex = r.get("extra") or {}
    if r["peer"] == "llama.cpp":
        b = ex.get("best") or {}
        return (f"best of -npl {ex.get('npl')}: B={b.get('pl')}, PP {b.get('pp')}, S t/s {_fmt(b.get('speed'))} "
                f"(with prompt), S_TG {_fmt(b.get('speed_tg'))}")
    if r["peer"] == "ours":
        pol = ex.get("policy") or {}
        pred = ex.get("predicted_end_to_end_tok_s")
        m_p = f", measured/predicted {r['tok_s'] / pred:.2f}" if pred and r.get("tok_s") else ""
        hrm = ex.get("predicted") or {}
        if hrm.get("decode_binding"):
            prof = Path(str(hrm.get("hardware"))).name
            m_p += (f" (HRM {prof}: prefill {_fmt(hrm.get('prefill_tokens_per_s'), 0)} tok/s "
                    f"{hrm.get('prefill_binding')}-bound, decode {_fmt(hrm.get('decode_tokens_per_s'), 0)} "
                    f"{hrm['decode_binding']}-bound; measured {_fmt(ex.get('prefill_tok_s'), 0)} / "
                    f"{_fmt(ex.get('decode_tok_s'), 0)})")
        return (f"mu {pol.get('mu')} x n {pol.get('n')}, {pol.get('resident_experts')} resident, "
                f"{pol.get('n_gpu_attn')} GPU-attn mb, {r.get('requests')} requests{m_p}")
    if r["peer"] in ("accelerate", "deepspeed"):
        head = f"max_memory cap - {r['headroom']}; " if r.get("headroom") else ""
        return f"{head}batches tried {ex.get('tried')}; placement {(ex.get('placement') or {}).get('device_map_counts')}"
    return ""


def make_table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (see the module docstring)."""
    ours = {}
    for r in rows:
        if r["peer"] == "ours" and r.get("status") == "ok":
            ours[(r["model"], r["gen_len"], weight_class(r["weights"]))] = r
    head = ("| model | gen | peer | weights | GPU cap | N | prompt tok | tok/s end to end | ours tok/s | "
            "ours / peer | notes |")
    out = [head, "|" + "---|" * 11]
    key = lambda r: (r["model"], r["gen_len"], weight_class(r.get("weights")), PEER_ORDER.get(r["peer"], 9))  # noqa: E731
    for r in sorted(rows, key=key):
        o = ours.get((r["model"], r["gen_len"], weight_class(r.get("weights"))))
        ok = r.get("status") == "ok" and r.get("tok_s")
        ratio = (o["tok_s"] / r["tok_s"]) if (o and ok and r["peer"] != "ours") else None
        out.append("| " + " | ".join([
            r["model"], str(r["gen_len"]), r["peer"], str(r.get("weights")), _cap(r), _fmt(r.get("N")),
            _fmt(r.get("prompt_len")), _fmt(r.get("tok_s")) if ok else "-",
            _fmt(o["tok_s"]) if o else "-", f"**{ratio:.2f}**" if ratio else "-", note(r).replace("|", "/"),
        ]) + " |")
    devices = sorted({r.get("device") for r in rows if r.get("device")})
    out.append("")
    out.append(f"Device(s): {'; '.join(devices)}. tok/s = generated tokens / (prefill + decode) s, load excluded.")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="folders of result rows (*.json)")
    ap.add_argument("--md", default=None, help="write the table here too")
    a = ap.parse_args(argv)
    rows = load_rows(a.folders)
    if not rows:
        print(f"no result rows in {a.folders}", file=sys.stderr)
        return 1
    table = make_table(rows)
    print(table)
    if a.md:
        Path(a.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
