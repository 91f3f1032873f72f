"""Measuring a training run: step times, allocator peaks, host memory, and the category breakdown.

Sizes are MiB (2**20 bytes), times ms. Anything a device cannot report is None (null in result.json).
"""
from __future__ import annotations

import resource
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

MIB = 2**20


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
_CATEGORY = {
    _MemRefType.PARAM: "params", _MemRefType.GRAD: "grads", _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations", _MemRefType.BUFFER: "other", _MemRefType.TEMP: "other",
    _MemRefType.OTH: "other",
}
BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "other")


@dataclass
class Trace:
    """One traced training step, in MiB. MemTracker labels optimizer-step temporaries "optimizer"
    while they live, so `after` (the steady state once the step is over) holds the states alone."""

    peak_mib: float
    at_peak: dict  # breakdown_mib at the moment of the peak total (what result.json reports)
    category_max: dict  # each category's own maximum over the step (they peak at different times)
    after: dict  # breakdown_mib when the step has finished


class _CategoryTracker(MemTracker):
    """MemTracker reduced to what a Trace reports: the peak total with the breakdown at it, plus
    each category's own maximum, which torch's tracker does not keep.

    torch updates its peaks after every op, and there also walks every module seen so far to keep
    per-module peak snapshots (for display_modulewise_snapshots): O(ops x modules), about 85% of a
    gpt2-xl trace (~50k ops x ~580 modules). Nothing here reads per-module figures, so this keeps
    only the global part, with torch's own rule: a new peak when the total strictly exceeds it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.category_max: dict[torch.device, dict] = {}

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():  # snap: bytes by _MemRefType, plus "Total"
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)  # int values: a shallow copy is a copy
            seen = self.category_max.setdefault(dev, {})
            for kind, nbytes in snap.items():
                seen[kind] = max(seen.get(kind, 0), nbytes)


def _breakdown(snapshot: dict, device: torch.device) -> dict:
    """A MemTracker per-device snapshot (bytes by _MemRefType) -> breakdown_mib for `device`'s type."""
    per_device = next((v for d, v in snapshot.items() if d.type == device.type), {})
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for kind, nbytes in per_device.items():
        if kind in _CATEGORY:
            breakdown[_CATEGORY[kind]] += nbytes / MIB
    return breakdown


def traced_step(step, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Trace:
    """Run `step()` once under torch's MemTracker and return what it saw on `device`.

    MemTracker follows every tensor through a dispatch mode, so it works on CPU as on GPU (and on
    fake tensors, for predictions), and labels each byte as parameter, gradient, optimizer state
    or activation. It slows the step down, so the caller runs it outside the timed steps.
    """
    tracker = _CategoryTracker()
    tracker.track_external(model, optimizer)

    def next_micro_step(module, args) -> None:
        # MemTracker refuses a second forward of the root module (it takes it for a new iteration);
        # under gradient accumulation that is the next micro-batch. Its per-module stats are not
        # used here, so they are cleared; the global peak snapshot is kept.
        if module is model and module in tracker.memory_tracking:
            tracker.reset_mod_stats()

    # Registered before MemTracker's own global hooks, so it runs first.
    hook = torch.nn.modules.module.register_module_forward_pre_hook(next_micro_step)
    try:
        with tracker, warnings.catch_warnings():
            # With optimizer.in_backward the gradient is freed by our hook before MemTracker's own
            # post-accumulate hook looks at it; it warns and carries on, with the breakdown intact.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            step()
            after = tracker.get_tracker_snapshot()
    finally:
        hook.remove()
    peak = tracker.get_tracker_snapshot("peak")
    total = next((v.get(_TOTAL_KEY, 0) for d, v in peak.items() if d.type == device.type), 0)
    return Trace(peak_mib=total / MIB, at_peak=_breakdown(peak, device),
                 category_max=_breakdown(tracker.category_max, device), after=_breakdown(after, device))
