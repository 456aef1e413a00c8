"""The peak memory of a rank, start-up and training apart (the planner predicts both: docs/memory_model.md).

On CUDA the peak of torch's allocator (`torch.cuda.max_memory_allocated`: tensors only, no CUDA context
or cache), reset when start-up ends. On a CPU there is no allocator peak to read: the process's peak
resident set (VmHWM in /proc/self/status, what benchmarks/startup_memory.py and the tests measure), reset
to the current RSS by writing 5 to /proc/self/clear_refs (Linux 4.0 and later). It counts the Python
runtime and torch's libraries besides the tensors, so on a CPU it is reported, not set against the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def peak_bytes(device: torch.device) -> int | None:
    """The peak since the last reset: the allocator's on CUDA, the peak RSS on a CPU (None where /proc
    does not say)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def reset_peak(device: torch.device) -> None:
    """Start a new peak from what is held now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or a kernel before 4.0: the training peak then includes start-up
        pass


@dataclass
class Peaks:
    """A rank's start-up peak (from the process's start to the first step) and training peak (the steps,
    evaluation and checkpoints, without the end-of-run sample)."""

    device: torch.device
    startup_bytes: int | None = None
    train_bytes: int | None = None

    def startup_over(self) -> None:
        self.startup_bytes = peak_bytes(self.device)
        reset_peak(self.device)

    def training_over(self) -> None:
        self.train_bytes = peak_bytes(self.device)

    @property
    def measure(self) -> str:
        return "max_memory_allocated" if self.device.type == "cuda" else "peak_rss"

    def summary(self) -> dict:
        return {"measure": self.measure, "startup_peak_bytes": self.startup_bytes, "train_peak_bytes": self.train_bytes}

    def line(self) -> str:
        what = "allocated (torch's allocator)" if self.device.type == "cuda" else "resident (RSS, the whole process)"
        return (f"rank 0's peak memory {what}: start-up {_mib(self.startup_bytes)}, "
                f"training {_mib(self.train_bytes)}")


def _mib(n: int | None) -> str:
    return "not known" if n is None else f"{n / 2**20:,.1f} MiB"
