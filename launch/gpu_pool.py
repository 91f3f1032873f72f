"""Grid points side by side on a host with several GPUs: each point gets GPUs of its own (one, or
one per rank), so no two points share a GPU and every memory and time figure stays its own.

The scheduling half of hydra/launcher=gpu_pool (launch/plugins/ablate_launcher/launchers.py runs
each point as a local submitit job). submitit's local executor pins a job to the GPUs it is given
(CUDA_VISIBLE_DEVICES = the first `gpus_per_node` of `visible_gpus`) but keeps no account of which
are busy: every job of one executor gets the same ones. This keeps that account.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

from launch.nvml import visible_gpu_count

POLL_S = 0.2  # how often running jobs are checked for an end

J = TypeVar("J")  # a point's running job


@dataclass
class QueuedPoint:
    """A grid point as the pool schedules it (the launcher composes its config once, up front)."""

    idx: int  # Hydra's job number
    overrides: list[str]
    wants: int  # GPUs: gpus_wanted
    on_gpu: bool  # its worker runs on them (not device=cpu, not predict_only)
    label: str  # as the job's console names it: hydra.job.override_dirname
    run_dir: Path
    submitted: str = ""  # ISO time its job started: a row that began before it was found done


def host_gpus(listed: Sequence[int] | str | None = "auto") -> list[int]:
    """The GPU ids to share out: `listed` (hydra.launcher.gpus; the tests give fake ones), else
    those this process sees: CUDA_VISIBLE_DEVICES's entries, or every GPU NVML counts. Entries
    that are not indices (GPU or MIG UUIDs) give none: submitit pins by index, so such a host runs
    its points one at a time, as before."""
    if listed not in ("auto", None):
        return [int(i) for i in listed]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(visible_gpu_count()))
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return [int(e) for e in entries] if all(e.isdigit() for e in entries) else []


def gpus_wanted(distributed: bool, nproc: int | str, host: int) -> int:
    """GPUs a point takes on a host with `host` of them: 1, or one per rank (nproc=auto: all).
    A point that runs on the CPU (device=cpu, predict_only) takes its count too: a GPU is also the
    unit of how many points share the host's CPU at once (`packed` gives it all GPUs at most)."""
    if not distributed:
        return 1
    want = host if nproc == "auto" else nproc
    if not isinstance(want, int) or isinstance(want, bool) or want < 1:
        return 1  # a malformed nproc: the job's own check names it
    return want


@dataclass(frozen=True)
class Lease:
    """What a running point holds: a slot on each of its GPUs (distinct), and the host's CPUs that
    go with those slots (launch/cpus.plan; empty: no CPUs shared out)."""

    seats: tuple[tuple[int, int], ...]  # (GPU id, slot)
    cpus: tuple[int, ...] = ()

    @property
    def ids(self) -> list[int]:
        return [gpu for gpu, _ in self.seats]


class GpuPool:
    """The free GPU ids, handed out in the order the host lists them. Each GPU takes `per_gpu`
    points at once (hydra.launcher.points_per_gpu; 1: a GPU is a point's own), each in a slot of
    its own; a point's ranks always get distinct GPUs, the least busy first. With `cpus` (slot ->
    CPUs: launch/cpus.plan) a lease carries its slots' CPUs."""

    def __init__(self, ids: Sequence[int], per_gpu: int = 1, cpus: Mapping[tuple[int, int], list[int]] | None = None):
        self.order = list(ids)
        self.free = {i: list(range(per_gpu)) for i in ids}  # each GPU's free slots
        self.cpus = cpus or {}

    def take(self, n: int) -> Lease | None:
        """A slot on each of `n` distinct GPUs with room, or None when fewer than `n` have it."""
        ready = sorted((i for i in self.order if self.free[i]), key=lambda i: -len(self.free[i]))  # stable
        if n > len(ready):
            return None
        seats = tuple((i, self.free[i].pop(0)) for i in ready[:n])
        return Lease(seats, tuple(sorted({c for seat in seats for c in self.cpus.get(seat, ())})))

    def give(self, lease: Lease) -> None:
        for gpu, slot in lease.seats:
            self.free[gpu] = sorted([*self.free[gpu], slot])


def packed(points: Sequence[QueuedPoint], gpus: Sequence[int], start: Callable[[QueuedPoint, Lease], J],
           finished: Callable[[J], bool], stop: Callable[[J], None], poll_s: float = POLL_S, per_gpu: int = 1,
           cpus: Mapping[tuple[int, int], list[int]] | None = None) -> Iterator[tuple[QueuedPoint, J, Lease]]:
    """Start each point once the GPUs it wants are free (all of them at most) and yield (point,
    job, lease) as each job ends. Grid order, except that a point that fits starts before one that
    waits for more GPUs (a 1-GPU point takes a GPU a 2-GPU point cannot use yet); the one that
    waits starts once enough are free at once, at the latest when the rest of the grid has ended.

    Closed early (an exception in the caller, Ctrl-C), it `stop`s every job still running."""
    pool, waiting, running = GpuPool(gpus, per_gpu, cpus), list(points), []
    try:
        while waiting or running:
            for point in list(waiting):
                lease = pool.take(max(1, min(point.wants, len(gpus))))  # never more than there are
                if lease is not None:
                    waiting.remove(point)
                    running.append((point, start(point, lease), lease))
            for entry in [e for e in running if finished(e[1])]:
                running.remove(entry)
                pool.give(entry[2])
                yield entry
            if running:
                time.sleep(poll_s)
    finally:
        for _, job, _ in running:
            stop(job)
