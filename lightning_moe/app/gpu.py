"""The job's GPU: its CUDA index, the ``gpu_memory`` cap on torch's allocator, per-phase peak memory (the GPU's, and
the host's resident set)."""

from __future__ import annotations

import re
from typing import Optional

import torch


def cuda_index(device: str) -> int:
    """The CUDA device index of ``device`` ("cuda" is the current device, "cuda:N" is N). Raises ValueError for a
    device that is not CUDA."""
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


# the preset under a job's measured profile (its unmeasured fields; the whole profile where measuring fails), by a
# word of its CUDA device's name ("NVIDIA L4", "Tesla T4", "NVIDIA A100-SXM4-80GB"; an L40S matches none):
# datasheet rates of that card's family
PRESET_BY_DEVICE_NAME = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-40g"), ("l4", "l4"), ("t4", "t4"))


def device_name(device: str) -> Optional[str]:
    """The name torch gives a CUDA ``device`` (None on the CPU or without CUDA)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(cuda_index(device))
    return None


def preset_for_device_name(name: str) -> Optional[str]:
    """The preset of ``PRESET_BY_DEVICE_NAME`` whose word is in ``name`` (case-insensitive, whole words), or None."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    return next((preset for word, preset in PRESET_BY_DEVICE_NAME if word in words), None)


def use_device(device: str) -> None:
    """Make ``device`` this process's current CUDA device (nothing for a non-CUDA device). Work queued without an
    explicit device (Triton launches, ``torch.cuda.Event``, ``torch.cuda.Stream()``) goes to the current device, so
    a job on ``cuda:N`` sets it once before it allocates or launches anything."""
    if device.startswith("cuda"):
        torch.cuda.set_device(cuda_index(device))


def _nvml_free(idx: int) -> Optional[int]:
    """Free memory of CUDA device ``idx`` in bytes as NVML sees it (needs no CUDA context), or None when NVML
    (nvidia-ml-py) is unavailable or the device cannot be matched."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = "GPU-" + str(torch.cuda.get_device_properties(idx).uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).free)
    except Exception:  # noqa: BLE001 - no NVML is an ordinary configuration: the caller falls back
        return None


def _has_context(idx: int) -> bool:
    """Whether this process already holds a CUDA context on device ``idx`` (True when torch cannot say)."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return True if has is None else bool(has(idx))


def apply_gpu_cap(device: str, gpu_memory: Optional[int]) -> Optional[dict]:
    """Make this process's GPU behave like a ``gpu_memory``-byte card: cap the CUDA caching allocator at
    ``gpu_memory`` minus what this process holds outside it (its CUDA context), with
    ``torch.cuda.set_per_process_memory_fraction``.

    The context's size is NVML's free memory before creating it minus after; other processes on the device do not
    count against the cap, but the device must have the capped memory free. Where that cannot be measured (no NVML,
    or a context created earlier) everything the device holds outside this allocator counts as this process's.

    Returns ``{"cap_bytes", "outside_torch_bytes", "other_processes_bytes", "torch_limit_bytes", "fraction",
    "device_total_bytes"}`` (None when no cap or no CUDA; ``other_processes_bytes`` None when not measured). Raises
    ValueError when the cap exceeds the device's memory or its free memory, or leaves nothing to torch.
    """
    if not gpu_memory or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    idx = cuda_index(device)
    torch.cuda.init()
    before = None if _has_context(idx) else _nvml_free(idx)
    free, total = torch.cuda.mem_get_info(idx)  # creates the context
    if gpu_memory > total:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.1f} GiB exceeds the device's {total / 2**30:.1f} GiB")
    reserved = torch.cuda.memory_reserved(idx)
    held = max(0, total - free - reserved)  # everything on the device outside this process's allocator
    after = _nvml_free(idx) if before is not None else None
    own = max(0, before - after) if after is not None else None
    outside = min(own, held) if own is not None else held
    limit = gpu_memory - outside
    if limit <= 0:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.2f} GiB leaves nothing for tensors: "
                         f"{outside / 2**30:.2f} GiB of the device are already in use outside torch's allocator")
    if limit > free + reserved:
        raise ValueError(f"gpu_memory {gpu_memory / 2**30:.2f} GiB: the device has {free / 2**30:.2f} GiB free "
                         f"({(held - outside) / 2**30:.2f} GiB held by other processes)")
    frac = limit / total
    torch.cuda.set_per_process_memory_fraction(frac, idx)
    return {"cap_bytes": gpu_memory, "outside_torch_bytes": outside,
            "other_processes_bytes": held - outside if own is not None else None, "torch_limit_bytes": limit,
            "fraction": frac, "device_total_bytes": total}


def device_memory(device: str) -> Optional[int]:
    """Total memory of a CUDA ``device`` in bytes (None on the CPU or without CUDA)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(cuda_index(device)).total_memory
    return None


_STATUS_FIELDS = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def host_memory() -> dict[str, int]:
    """This process's resident memory now, bytes, from Linux's /proc/self/status: ``rss``, its parts ``anon``
    (heap, the page pool, the KV cache), ``file`` (mapped files: libraries, mmapped checkpoints; clean pages the
    kernel can reclaim) and ``shmem``, and ``peak_rss`` (VmHWM: the largest rss since the process started or since
    :func:`reset_host_peak`). Empty where /proc is unavailable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _STATUS_FIELDS:
                    out[_STATUS_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        return {}
    return out


def reset_host_peak() -> bool:
    """Restart the kernel's peak-rss counter (VmHWM) at the current rss (``5`` into /proc/self/clear_refs, Linux >=
    4.0); False where that is not possible (then a phase's ``peak_rss`` is the peak since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """Peak memory per phase of a run: the executor calls :meth:`enter` at each phase boundary ("load", "prefill",
    "decode", "scoring"); a phase seen again keeps its largest peak. GPU: allocated and reserved bytes (CUDA only).
    Host: the phase's peak resident set (``peak_rss``) and, at the phase's end, its ``anon`` and ``file`` parts
    (:func:`host_memory`); ``host_overall`` is the largest peak over the run, the time before the first phase too."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.idx = cuda_index(device) if self.cuda else None
        self.phase: Optional[str] = None
        self.peaks: dict[str, dict[str, int]] = {}
        self.host: dict[str, dict[str, int]] = {}
        self._host_before = 0  # the largest rss before the first phase (the peak counter restarts at each phase)

    def enter(self, phase: str) -> None:
        """Close the current phase and start ``phase`` (the allocator's and the host's peak counters restart)."""
        if self.phase is None:
            self._host_before = host_memory().get("peak_rss", 0)
        self.close()
        self.phase = phase
        reset_host_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.idx)

    def close(self) -> None:
        """Record the current phase's peaks."""
        if self.phase is None:
            return
        now = host_memory()
        if now:
            h = self.host.setdefault(self.phase, {"peak_rss": 0})
            h["peak_rss"] = max(h["peak_rss"], now.get("peak_rss", 0))
            h.update({k: now[k] for k in ("anon", "file") if k in now})  # at the phase's (last) end
        if not self.cuda:
            return
        p = self.peaks.setdefault(self.phase, {"allocated": 0, "reserved": 0})
        p["allocated"] = max(p["allocated"], torch.cuda.max_memory_allocated(self.idx))
        p["reserved"] = max(p["reserved"], torch.cuda.max_memory_reserved(self.idx))

    def overall(self, key: str) -> Optional[int]:
        """Largest peak of ``key`` ("allocated" | "reserved") over the phases (None without CUDA)."""
        return max((p[key] for p in self.peaks.values()), default=0) if self.cuda else None

    def host_overall(self) -> Optional[int]:
        """The run's peak resident set in bytes: the largest phase peak or the peak before the first phase; None
        where /proc is unavailable."""
        if not self.host and not self._host_before:
            return None
        return max([self._host_before] + [h["peak_rss"] for h in self.host.values()])
