"""NaN-filled workspaces for the expert-FFN tests (issue 41): a deterministic stand-in for uninitialized memory.

A kernel that reads a row it never wrote (a padded row of a GEMM operand, a skipped pair's row of a slot output)
meets garbage that is NaN only now and then, so a test that relies on ``torch.empty`` returning garbage fails at
random. These helpers make that garbage NaN every time:

* :func:`nan_empty` -- ``torch.empty`` / ``torch.empty_like`` return floating tensors filled with NaN (integer ones
  as they are), for every Python-level allocation of the kernels' wrappers, CPU or CUDA.
* :func:`finite_operand_mm` -- ``torch.mm`` that fails when its left operand holds a non-finite value: a GEMM that
  reads rows nobody wrote fails here even where the BLAS keeps rows apart (the CPU's oneDNN and cuBLAS do; a
  library that copies or packs rows need not, and then 0 x NaN = NaN reaches real rows).
* :func:`nan_tail_grouped_mm` -- torch's grouped GEMM whose output rows past the last group end are NaN (the CUDA
  kernel leaves them unwritten; the CPU fallback leaves whatever its allocation held), and which fails when an
  operand row it reads (before the last group end) is not finite.
"""

from __future__ import annotations

import torch


def nan_empty(monkeypatch) -> None:
    """Make ``torch.empty`` and ``torch.empty_like`` NaN-fill their floating results for the rest of the test."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_like(*a, **kw)))


def finite_operand_mm(monkeypatch) -> list:
    """Make ``torch.mm`` assert that both operands are finite; returns the list of left-operand row counts seen."""
    real, seen = torch.mm, []

    def mm(a, b, **kw):
        assert torch.isfinite(a).all(), f"torch.mm read a non-finite row of its {tuple(a.shape)} left operand"
        assert torch.isfinite(b).all(), f"torch.mm read a non-finite value of its {tuple(b.shape)} right operand"
        seen.append(a.shape[0])
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "mm", mm)
    return seen


def nan_tail_grouped_mm(monkeypatch, fm) -> list:
    """Make ``fm._grouped_mm_fn()`` (fm: the fused_moe module) a grouped GEMM whose rows past ``offs[-1]`` are NaN and
    which asserts that the operand rows before ``offs[-1]`` are finite; returns the list of ``offs[-1]`` seen."""
    real, seen = fm._grouped_mm_fn(), []

    def gmm(a, b, offs):
        end = int(offs[-1]) if offs.numel() else 0
        assert torch.isfinite(a[:end]).all(), "grouped_mm read a non-finite operand row before the last group end"
        out = real(a, b, offs=offs)
        out[end:] = float("nan")
        seen.append(end)
        return out

    monkeypatch.setattr(fm, "_grouped_mm_fn", lambda: gmm)
    return seen
