"""Job input files for the runner tests, and a line counter for files a job is writing."""

import json


def jsonl_prompts(path, n=12):
    """Write ``n`` short prompts of varied length (ids q0..q{n-1}) as a jsonl job input; returns its path."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt": " ".join(words[: 1 + (i * 3) % 8]) + f" number {i}"}) + "\n")
    return str(path)


def count_lines(path) -> int:
    """Complete lines in ``path`` so far (0 while it does not exist): how far a running job's output has got."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0
