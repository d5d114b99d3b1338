#!/usr/bin/env python3
"""Generate the small example data sets under jobs/data/ (deterministic: same seed, same bytes).

Outputs (one JSON object per line, see lightning_moe/data/sources.py for the fields):
  arith_mc.jsonl   64 multiple-choice additions/subtractions: prompt, 4 numeric choices, answer index
  arith_ll.jsonl   32 loglikelihood items: prompt "17 + 25 =", continuation " 42"
  text_ppl.jsonl   16 perplexity texts: a few generated sentences each (from word lists below)
  arith_gen.jsonl  16 generation prompts (plain text, for task: generate on CPU)

Usage: python scripts/make_arith_mc.py [--out jobs/data] [--seed 1234]
"""

from __future__ import annotations

import argparse
import json
import os
import random

SUBJECTS = ["The small robot", "A curious fox", "My neighbour", "The old sailor", "A young student",
            "The tired baker", "Our teacher", "The quiet engineer"]
VERBS = ["carried", "painted", "found", "counted", "repaired", "watched", "opened", "described"]
OBJECTS = ["three red boxes", "a wooden boat", "the broken clock", "seven blue stones", "an empty bottle",
           "the garden gate", "a long letter", "twelve paper birds"]
PLACES = ["near the river", "before breakfast", "in the busy market", "after the storm", "on the hill",
          "under the bridge", "at the station", "during the night"]
ENDINGS = ["Nobody knew why.", "It took a long time.", "Everyone was surprised.", "Then the rain began.",
           "The day was almost over.", "It was a good idea."]


def _problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    a, b = max(a, b), min(a, b)
    return f"{a} - {b}", a - b


def arith_mc(rng: random.Random, n: int = 64) -> list[dict]:
    out = []
    for i in range(n):
        expr, ans = _problem(rng)
        wrong: list[int] = []
        for d in rng.sample([1, -1, 2, -2, 10, -10, 11, -9], 8):
            v = ans + d
            if v >= 0 and v != ans and v not in wrong:
                wrong.append(v)
            if len(wrong) == 3:
                break
        nums = wrong + [ans]
        rng.shuffle(nums)
        out.append({"id": f"arith-mc-{i:03d}", "prompt": f"Question: What is {expr}?\nAnswer:",
                    "choices": [f" {v}" for v in nums], "answer": nums.index(ans)})
    return out


def arith_ll(rng: random.Random, n: int = 32) -> list[dict]:
    out = []
    for i in range(n):
        expr, ans = _problem(rng)
        out.append({"id": f"arith-ll-{i:03d}", "prompt": f"{expr} =", "continuation": f" {ans}"})
    return out


def text_ppl(rng: random.Random, n: int = 16) -> list[dict]:
    out = []
    for i in range(n):
        sents = []
        for _ in range(rng.randint(2, 4)):
            s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
            if rng.random() < 0.4:
                s += " " + rng.choice(ENDINGS)
            sents.append(s)
        out.append({"id": f"text-ppl-{i:03d}", "text": " ".join(sents)})
    return out


def arith_gen(rng: random.Random, n: int = 16) -> list[dict]:
    out = []
    for i in range(n):
        expr, _ans = _problem(rng)
        out.append({"id": f"arith-gen-{i:03d}", "prompt": f"Question: What is {expr}? Explain briefly.\nAnswer:"})
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(here, "..", "jobs", "data"), help="output directory")
    ap.add_argument("--seed", type=int, default=1234, help="RNG seed (default 1234, the committed files)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # One RNG per file (seed + offset) so changing one generator never changes the other files.
    for k, (name, fn) in enumerate([("arith_mc.jsonl", arith_mc), ("arith_ll.jsonl", arith_ll),
                                    ("text_ppl.jsonl", text_ppl), ("arith_gen.jsonl", arith_gen)]):
        recs = fn(random.Random(args.seed + k))
        path = os.path.join(args.out, name)
        write_jsonl(path, recs)
        print(f"wrote {len(recs):3d} records to {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
