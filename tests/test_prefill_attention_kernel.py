"""kernels.prefill_attention on the CPU: the mode variable, the varlen path's refusals, its torch reference against
per-sequence attention (fp32, 1e-5 relative; awkward lengths, GQA, a sliding window, a custom scale), and packed
prefill attention under every mode (on the CPU always the padded SDPA call). The varlen kernel itself runs on CUDA
only: tests/gpu/test_prefill_attention_gpu.py."""

import contextlib

import pytest
import torch

from lightning_moe.kernels import prefill_attention as PA
from lightning_moe.model.layers import prefill_attention, prefill_attention_packed


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MOE_PREFILL_ATTENTION", raising=False)
    assert PA.prefill_attention_mode() == "auto"
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", " Efficient ")
    assert PA.prefill_attention_mode() == "efficient"
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="LIGHTNING_MOE_PREFILL_ATTENTION='cudnn'.*auto, varlen, triton, efficient, sdpa"):
        PA.prefill_attention_mode()


def test_varlen_refused_on_the_cpu_and_use_varlen_follows_the_mode():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    assert PA.varlen_unsupported(q, k, v, None, None) == "not on CUDA"
    assert not any(PA.use_varlen(q, k, v, None, None, m) for m in PA.MODES)
    with pytest.raises(ValueError, match="attention_varlen: not on CUDA"):
        PA.attention_varlen(q, k, v, torch.tensor([0, 5], dtype=torch.int32), 5)


def test_sdpa_backends_change_nothing_on_the_cpu_or_in_sdpa_mode():
    assert isinstance(PA.sdpa_backends(torch.device("cpu"), "auto"), contextlib.nullcontext)
    assert isinstance(PA.sdpa_backends(torch.device("cuda"), "sdpa"), contextlib.nullcontext)
    assert not isinstance(PA.sdpa_backends(torch.device("cuda"), "efficient"), contextlib.nullcontext)


@pytest.mark.parametrize("window,scale", [(None, None), (3, None), (None, 0.3), (5, 0.2)])
@pytest.mark.parametrize("lens", [[1], [5, 1, 9], [2, 11, 0, 4], [17]])
def test_varlen_reference_equals_per_sequence(lens, window, scale):
    g = torch.Generator().manual_seed(sum(lens) * 7 + (window or 0))
    T, Hq, Hkv, hd = sum(lens), 6, 2, 16
    q, k, v = (torch.randn(T, h, hd, generator=g) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = PA.attention_varlen_reference(q, k, v, cu, window, scale)
    b = cu.tolist()
    ref = torch.cat([_per_sequence(q[s:e], k[s:e], v[s:e], window, scale) for s, e in zip(b[:-1], b[1:]) if e > s])
    assert out.shape == (T, Hq, hd)
    assert ((out.reshape(T, -1) - ref).norm() / ref.norm()).item() < 1e-5


def _per_sequence(q, k, v, window, scale):
    if scale is None:
        return prefill_attention(q, k, v, window)
    return prefill_attention(q * (scale * q.shape[-1] ** 0.5), k, v, window)  # the same logits as scale


@pytest.mark.parametrize("mode", PA.MODES)
def test_packed_attention_under_every_mode_on_the_cpu(monkeypatch, mode):
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", mode)
    g = torch.Generator().manual_seed(2)
    lens = [3, 1, 12, 5]
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g) for h in (4, 2, 2))
    ends = torch.tensor(lens).cumsum(0).tolist()
    spans = [(e - n, e) for e, n in zip(ends, lens)]
    out = prefill_attention_packed(q, k, v, spans, 4)
    ref = torch.cat([prefill_attention(q[s:e], k[s:e], v[s:e], 4) for s, e in spans])
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_a_bad_mode_stops_the_job_before_anything_is_written(monkeypatch, tmp_path):
    from lightning_moe.app.engine import run_job
    from lightning_moe.config import ConfigError, job_from_dict

    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    job = job_from_dict({"model": "tiny-mixtral", "data": {"source": "jsonl", "path": str(data)},
                         "output": {"path": str(out)}, "device": "cpu"}, "job.yaml")
    monkeypatch.setenv("LIGHTNING_MOE_PREFILL_ATTENTION", "flash3")
    with pytest.raises(ConfigError, match="job.yaml.*LIGHTNING_MOE_PREFILL_ATTENTION='flash3'"):
        run_job(job, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
