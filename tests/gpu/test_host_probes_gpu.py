"""GPU test of the profile's host issue probes per family and expert format (profiler.measure_host_issue(probe=KEY)).

Run on a CUDA host: ``python -m pytest tests/gpu/test_host_probes_gpu.py -m gpu``. Skipped without CUDA. The probes
were written and tested on the CPU (tests/test_host_probes.py), where the expert FFN is the torch loop; on CUDA each
runs its family's grouped kernel (Triton, the MXFP4 kernel, the int4 dequantize-then-grouped path, or the torch loop
where the grouped kernels refuse the family: gpt-oss's biased experts), which only a GPU run checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.pipeline.profiler import host_probe_keys, measure_host_issue

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("probe", ("generic",) + host_probe_keys())
def test_every_host_probe_runs_cgopipe_decode_on_cuda(probe):
    """Each probe's CGOPipe decode runs on CUDA (both placements) and gives host seconds per micro-batch-layer that
    are positive, finite and below 1 s (a tiny model: anything near a second is a sync or a compile inside the timed
    steps)."""
    h_c, h_g = measure_host_issue(device="cuda", layers=2, mu=8, steps=2, probe=probe)
    for h in (h_c, h_g):
        assert math.isfinite(h) and 0 < h < 1.0, (probe, h_c, h_g)


def test_a_jobs_probe_runs_in_a_child_process_and_leaves_this_one_as_it_was(monkeypatch):
    """app.measure_child on CUDA: the probe runs in a child process on the card (its seconds come back; this
    process's probe is replaced by one that fails) and this process's allocator holds what it held before (cached
    blocks emptied first: measured here, the probe's executor would leave its blocks cached)."""
    from lightning_moe.app.measure_child import measure
    from lightning_moe.pipeline import profiler

    def here(*a, **kw):
        raise AssertionError("measured in this process")

    monkeypatch.setattr(profiler, "measure_host_issue", here)
    torch.cuda.init()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    h_c, h_g = measure("host_issue", "cuda", probe="generic", layers=2, mu=8, steps=2)
    for h in (h_c, h_g):
        assert math.isfinite(h) and 0 < h < 1.0, (h_c, h_g)
    assert torch.cuda.memory_reserved() == before
