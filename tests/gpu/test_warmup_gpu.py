"""The warm-up covers the decode step: in a fresh process (Triton compiles each kernel specialization once per process,
as on a user's first run), a CGOPipe run with its warm-up on compiles no Triton kernel during decode; with it off, the
same run compiles its decode kernels inside decode (the control: the probe sees compiles where they happen). Families:
Mixtral (one GPU-attention micro-batch, one on the CPU), DeepSeek-V2 (MLA, a dense first layer), gpt-oss (MXFP4 pages,
sliding and full layers). Sampled decoding (temperature 1.0, seeded): the tokens with and without the warm-up are equal.
Skipped without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(family: str, warm: str, tmp) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.support.warmup_probe", family, warm, str(tmp)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_warmup_leaves_no_triton_compile_to_decode(family, tmp_path):
    off = _probe(family, "off", tmp_path / "off")
    on = _probe(family, "on", tmp_path / "on")
    assert off.get("decode", 0) > 0, off  # the control: without the warm-up decode compiles its kernels
    assert on.get("decode", 0) == 0, on["decode_kernels"]
    assert on["warmup_seconds"] > 0 and off["warmup_seconds"] == 0
    assert on["tokens"] == off["tokens"]  # the warm-up's throwaway decode rows leave every cache as it was
