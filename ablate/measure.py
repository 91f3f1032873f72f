"""Measuring a training run: step times, allocator peaks, host memory, and the category breakdown.

Sizes are MiB (2**20 bytes), times ms. Anything a device cannot report is None (null in result.json).
"""
from __future__ import annotations

import resource
import statistics
import time

import torch

from ablate.memtrace import _CATEGORY, BREAKDOWN_KEYS, MIB, Trace, traced_step  # noqa: F401  (measuring's API)


class StepTimer:
    """Per-step wall time. CUDA events on GPU (read once at the end, so timing adds no sync);
    perf_counter on CPU after a synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple] = []
        self._times: list[float] = []

    def start(self) -> None:
        if self.cuda:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            torch.cpu.synchronize()
            self._times.append((time.perf_counter() - self._t0) * 1e3)

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self._events]
        return list(self._times)


def seconds_since(start: float, device: torch.device) -> float:
    """Wall seconds since perf_counter() `start`, after the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


class StepCounter:
    """Counts optimizer steps actually taken, without a device sync: a GradScaler skips step()
    when gradients overflowed, so steps asked minus steps taken are the skipped ones."""

    def __init__(self, optimizer):
        self.count: int | None = None  # None: this optimizer has no step hooks to count with
        if isinstance(optimizer, torch.optim.Optimizer):
            self.count = 0
            optimizer.register_step_post_hook(self._hook)

    def _hook(self, *args) -> None:
        self.count += 1


def percentiles(times_ms: list[float]) -> dict:
    if not times_ms:
        return {"iter_time_ms": None, "iter_time_ms_p10": None, "iter_time_ms_p90": None}
    if len(times_ms) == 1:
        return {"iter_time_ms": times_ms[0], "iter_time_ms_p10": times_ms[0], "iter_time_ms_p90": times_ms[0]}
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    return {"iter_time_ms": statistics.median(times_ms), "iter_time_ms_p10": deciles[0],
            "iter_time_ms_p90": deciles[-1]}


class DeviceMemory:
    """The caching allocator's peaks since the last reset. CPU has no such allocator: all None."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_allocated_mib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / MIB if self.cuda else None

    def peaks(self) -> dict:
        if not self.cuda:
            return {"peak_allocated_mib": None, "peak_reserved_mib": None, "peak_active_mib": None}
        stats = torch.cuda.memory_stats()
        return {
            "peak_allocated_mib": stats["allocated_bytes.all.peak"] / MIB,
            "peak_reserved_mib": stats["reserved_bytes.all.peak"] / MIB,
            "peak_active_mib": stats["active_bytes.all.peak"] / MIB,
        }


def host_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# torch's MemTracker categories -> the result contract's breakdown keys.
