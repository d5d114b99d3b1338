"""Shared inputs of the GPU kernel tests (test_fused_moe_gpu.py, test_quant_gpu.py): awkward shapes, random
experts and routing, and the relative error they are judged by."""

from __future__ import annotations

import torch

DEV = "cuda"

# (T, D, F, E, k, expert given no tokens or None). T=1; odd T=33; D and F not multiples of the tiles
# (200, 344, 100); a prefill-sized case that selects the 64-row tile config; k=1 and k=3.
SHAPES = [
    (1, 128, 256, 8, 2, None),
    (33, 200, 344, 8, 2, 3),
    (33, 100, 72, 4, 1, 0),
    (17, 96, 80, 6, 3, 5),
    (600, 1024, 1408, 8, 2, 6),
]
SHAPE_IDS = [f"T{s[0]}-D{s[1]}-F{s[2]}-E{s[3]}-k{s[4]}-skip{s[5]}" for s in SHAPES]


def make_inputs(T, D, Fd, E, k, skip, dtype, seed):
    """x [T,D] ~ N(0,1); weights ~ N(0, 1/fan_in); routing: k distinct ids per token avoiding `skip`.
    Returns x, w1 [E,F,D], w3, w2 [E,D,F] in ``dtype`` and fp32 weights [T,k], int64 ids [T,k], all on CUDA."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w1 = torch.randn(E, Fd, D, generator=g) / D**0.5
    w3 = torch.randn(E, Fd, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, Fd, generator=g) / Fd**0.5
    allowed = torch.tensor([e for e in range(E) if e != skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    wts = torch.rand(T, k, generator=g).softmax(-1)
    cast = lambda t: t.to(DEV, dtype)  # noqa: E731
    return cast(x), cast(w1), cast(w3), cast(w2), wts.to(DEV), ids.to(DEV)


def rel_err(a, b):
    """||a - b|| / ||b|| in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
