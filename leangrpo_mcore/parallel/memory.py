"""A peak-memory meter that measures, on CUDA and on CPU.

Usage::

    with MemoryMeter() as meter:
        ...
    meter.peak_bytes   # highest live allocation above the level at entry
    meter.end_bytes    # live allocation at exit above the level at entry

- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` of the current device (the peak
  statistics are reset on entry).
- CPU: the allocator's own reports. The torch profiler is run with ``profile_memory=True``; CPU tensor
  storage goes through c10's CPU allocator, which then reports every allocation and free (with its size)
  of this thread to the profiler. The running sum of those events is the live byte count, and its maximum
  the peak. Only storage allocated inside the block is counted, so frees of older tensors do not make
  the level negative. It measures what the allocator really held — activations, saved tensors,
  gradient buffers, kernel scratch — not an estimate. It costs profiler overhead; CPU meters cannot be
  nested (one profiler per thread).
"""

from __future__ import annotations

from typing import Optional

import torch


class MemoryMeter:
    """Context manager measuring the peak of live tensor memory inside its block."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.peak_bytes = 0
        """Maximum live bytes above the entry level seen inside the block."""
        self.end_bytes = 0
        """Live bytes above the entry level at exit."""
        self._profiler: Optional[torch.profiler.profile] = None
        self._start = 0

    def __enter__(self) -> "MemoryMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        if self.device.type != "cpu":
            raise ValueError(f"MemoryMeter supports cuda and cpu devices, not {self.device.type!r}")
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False
        )
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes, self.end_bytes = _cpu_peak(self._profiler)
        self._profiler = None

    @property
    def peak_mib(self) -> float:
        """:attr:`peak_bytes` in MiB."""
        return self.peak_bytes / 2**20


def _cpu_peak(profiler: torch.profiler.profile) -> tuple[int, int]:
    """(peak, end) of the running sum of the CPU allocator's [memory] events, in time order."""
    events = [e for e in profiler.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return peak, level
