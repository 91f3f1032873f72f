"""The host's CPUs shared out among points that run side by side (hydra/launcher=gpu_pool).

Each point is pinned to CPUs of its own, those near its GPUs where NVML says which are, so that
its host work (the initial draws, an offloaded optimizer's step on the CPU, a device=cpu point's
whole step) neither waits for a neighbour's nor runs more threads than it has cores. Pinning is
all it takes: torch sizes its thread pool by the CPUs a process may use (libgomp counts the
affinity mask), and launch/torchrun.threads_per_rank shares a point's CPUs among its ranks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

ENV = "ABLATE_CPUS"  # a point's CPUs, as the pool hands them to its job ("0-3,8"); the job pins itself
SYSFS = Path("/sys/devices/system/cpu")


def allowed() -> list[int]:
    """The CPUs this process may use (a SLURM allocation's, a taskset's); elsewhere all of them."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def by_core(cpus: Iterable[int], sysfs: Path = SYSFS) -> list[int]:
    """`cpus` ordered by socket, then physical core, so that a contiguous block keeps a core's
    hyperthreads together (Linux numbers siblings apart: 0 and 64 on a 64-core socket). Numeric
    order where sysfs does not say."""
    def key(cpu: int) -> tuple[int, int, int]:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()), cpu
        except (OSError, ValueError):
            return 0, cpu, cpu
    return sorted(cpus, key=key)


def blocks(cpus: Sequence[int], k: int) -> list[list[int]]:
    """`cpus` in k contiguous blocks, as even as can be; with fewer CPUs than blocks, one each in
    turn (points then share: there is no better)."""
    n = len(cpus)
    if k <= n:
        return [list(cpus[i * n // k:(i + 1) * n // k]) for i in range(k)]
    return [[cpus[i % n]] for i in range(k)]


def plan(gpus: Sequence[int], per_gpu: int, cpus: Sequence[int],
         near: Mapping[int, set[int]] | None = None) -> dict[tuple[int, int], list[int]]:
    """(GPU id, slot) -> the CPUs of a point in that slot: each GPU takes `per_gpu` points at once
    (launch/gpu_pool.GpuPool's slots). GPUs near the same CPUs (`near`, NVML's affinity: a NUMA
    node's) share those among their slots; a GPU near none of `cpus`, or not in `near`, shares
    all of them with the others like it."""
    near = near or {}
    local = {g: [c for c in cpus if c in near.get(g, ())] or list(cpus) for g in gpus}
    groups: dict[tuple[int, ...], list[int]] = {}
    for g in gpus:  # in the host's order
        groups.setdefault(tuple(local[g]), []).append(g)
    seats = {}
    for group_cpus, members in groups.items():
        share = blocks(by_core(group_cpus), len(members) * per_gpu)
        for i, g in enumerate(members):
            for slot in range(per_gpu):
                seats[g, slot] = sorted(share[i * per_gpu + slot])
    return seats


def fmt(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8" (taskset's list form)."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]."""
    cpus = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def pin_from_env() -> None:
    """In a point's job, before it starts any worker: keep to the CPUs the pool gave it (ENV),
    those of them this process may use. Every process it starts inherits the mask."""
    given = os.environ.get(ENV)
    if given and hasattr(os, "sched_setaffinity"):
        mine = set(parse(given)) & set(allowed())
        if mine:
            os.sched_setaffinity(0, mine)
