"""GPU capacity: how much memory a point may use (real or emulated), and the largest micro-batch
that fits in it. Sizes in MiB.

`gpu_memory_gib=16` asks "would this fit on a 16 GiB card?" on any bigger GPU: the worker caps
its caching allocator at the card's size minus the CUDA context (which a real 16 GiB card also
loses to the driver) with torch.cuda.set_per_process_memory_fraction, so a point that would not
fit fails with a real CUDA OOM. On a CPU there is no allocator to cap: the traced peak is
compared with the same budget after the step, and a point over it is recorded as an oom too.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ablate.techniques import Invalid

MIB = 2**20
# Device memory the CUDA context, cuBLAS and NCCL handles take outside the caching allocator
# (typically 0.4-0.6 GiB on recent GPUs and drivers). An assumption, not a measurement: NVML's
# peak minus the allocator's reserved peak in result.json shows the real figure per run.
CUDA_CONTEXT_MIB = 512


def usable_mib(gpu_mib: float) -> float:
    """What the caching allocator can get on a GPU of `gpu_mib` total memory."""
    return gpu_mib - CUDA_CONTEXT_MIB


def host_free_mib() -> float | None:
    """Host memory the kernel says a new process can take now (MemAvailable, Linux), in MiB; None
    where /proc/meminfo does not say (macOS)."""
    return _meminfo("MemAvailable")


def host_total_mib() -> float | None:
    """The host's memory (MemTotal), in MiB; None where /proc/meminfo does not say."""
    return _meminfo("MemTotal")


def _meminfo(field: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields[field].split()[0]) / 1024  # kB
    except (OSError, KeyError, ValueError):
        return None


def capacity_mib(gpu_memory_gib: float | None, gpu_total_mib: float | None) -> float | None:
    """The allocator budget of one rank: the emulated card's (`gpu_memory_gib`), else that of the
    GPU the point runs on (`gpu_total_mib`, None for none, e.g. device=cpu). None: unknown."""
    if gpu_memory_gib:
        return usable_mib(gpu_memory_gib * 1024)
    return usable_mib(gpu_total_mib) if gpu_total_mib else None


class MemoryLimit:
    """The worker's side of gpu_memory_gib: cap the allocator (CUDA) or check the peak (CPU)."""

    def __init__(self, gpu_memory_gib: float | None, device: torch.device):
        self.gib, self.device = gpu_memory_gib, device
        if gpu_memory_gib is not None and gpu_memory_gib <= 0:  # 0 would read as no card at all: no limit
            raise Invalid(f"gpu_memory_gib={gpu_memory_gib} must be > 0 (GiB of the card to emulate; null: no limit)")
        self.mib = usable_mib(gpu_memory_gib * 1024) if gpu_memory_gib else None
        if self.mib is not None and self.mib <= 0:
            raise Invalid(f"gpu_memory_gib={gpu_memory_gib} leaves nothing after the "
                          f"{CUDA_CONTEXT_MIB} MiB CUDA context")

    def apply(self) -> None:
        """Before anything is allocated on the device."""
        if self.mib is None or self.device.type != "cuda":
            return
        # The cap wants a device index: the worker's device is plain "cuda" (its current GPU).
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory / MIB
        if self.gib * 1024 > total:
            raise Invalid(f"gpu_memory_gib={self.gib} is more than this GPU's {total / 1024:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(self.mib / total, index)

    def check(self, peak_mib: float | None) -> None:
        """After training: on a CPU the traced peak stands in for the allocator the cap would stop."""
        if self.mib is not None and self.device.type != "cuda" and peak_mib is not None and peak_mib > self.mib:
            raise torch.OutOfMemoryError(f"peak {peak_mib:.1f} MiB > {self.mib:.1f} MiB usable on the emulated "
                                         f"gpu_memory_gib={self.gib} card")

    def env(self) -> dict:
        return {"emulated_gpu_mib": self.gib * 1024 if self.gib else None}


def largest_fitting(candidates: list[int], fits: Callable[[int], bool], guess: int | None = None) -> int | None:
    """Binary search of sorted `candidates` for the largest one that fits, assuming that whatever
    is smaller than a fitting size fits too. None if even the smallest does not.

    `guess` (a candidate: the largest predicted to fit) is tried first, then its neighbour on the
    side its answer points to, before the search goes on in what is left: a right guess costs two
    probes (one at either end of the list), a wrong one at most two more than the plain search
    takes at worst."""
    lo, hi = -1, len(candidates)  # candidates[lo] fits (or lo = -1); candidates[hi] does not (or hi = len)

    def probe(i: int) -> None:
        nonlocal lo, hi
        if fits(candidates[i]):
            lo = i
        else:
            hi = i

    if guess in candidates:
        at = candidates.index(guess)
        probe(at)
        beside = at + 1 if lo == at else at - 1
        if lo < beside < hi:
            probe(beside)
    while hi - lo > 1:
        probe((lo + hi + 1) // 2)
    return candidates[lo] if lo >= 0 else None


def micro_batches(batch_size: int) -> list[int]:
    """The micro-batches that keep the effective batch: the divisors of batch_size, ascending."""
    return [m for m in range(1, batch_size + 1) if batch_size % m == 0]
