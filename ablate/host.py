"""Whether an allocation the host refused measured the point, or only this process's surroundings.

On a CPU a point's memory is host memory, and an allocation can fail for reasons that are not the
point's: a process limit (`ulimit -v`, `ulimit -d`), a cgroup's limit below the host's memory (a
container, a SLURM job's --mem), or other processes holding the host's memory at that moment. Such
a failure is not an `oom` measurement (which a rerun would skip as done, and a batch search would
read as "does not fit"): it becomes an `error` whose reason starts with results.UNMEASURED and
names the limit, so the point is measured again once the limit is gone. A refusal of more than the
host has available, under no limit, is the point's: an `oom`. Sizes in MiB.
"""
from __future__ import annotations

import re
import resource
from pathlib import Path

from ablate.capacity import host_free_mib, host_total_mib
from ablate.results import UNMEASURED

MIB = 2**20
REFUSED = "DefaultCPUAllocator: can't allocate memory"  # torch's host allocator, in its error's text
_ASKED = re.compile(r"tried to allocate (\d+) bytes")


def process_limit() -> tuple[str, float] | None:
    """(what, MiB) of the process limit on its address space or data, if one is set."""
    for which, name in ((resource.RLIMIT_AS, "ulimit -v"), (resource.RLIMIT_DATA, "ulimit -d")):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            return name, soft / MIB
    return None


def cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> tuple[str, float] | None:
    """(what, MiB) of this process's cgroup memory limit where it is below the host's memory
    (cgroup v2's memory.max, else v1's memory.limit_in_bytes, which says "no limit" with a
    number near 2**63); None without one, or where it cannot be read."""
    total = host_total_mib()
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) / MIB < total):
            return f"the cgroup's {path.name}", int(text) / MIB
    return None


def refused(text: str) -> tuple[str, str] | None:
    """(status, reason) for the host allocator's refusal whose error text is `text`; None for any
    other error. `oom` where the point asked for more than the host has available under no limit;
    an unmeasured `error` naming the limit, or the memory that was available, otherwise."""
    if REFUSED not in text:
        return None
    found = _ASKED.search(text)
    asked = int(found[1]) / MIB if found else None
    size = f"{asked:,.0f} MiB" if asked is not None else "an allocation"
    limit = process_limit() or cgroup_limit()
    if limit:
        what, mib = limit
        return "error", (f"{UNMEASURED} the host refused {size} under {what} of {mib:,.0f} MiB, a limit of this "
                         f"process, not of the point: run it again without the limit to measure it")
    free = host_free_mib()
    if asked is not None and free is not None and asked < free:
        return "error", (f"{UNMEASURED} the host refused {size} with {free:,.0f} MiB available now: other "
                         f"processes held the memory when it asked; run it again to measure it")
    available = f" with {free:,.0f} MiB available on this host" if free is not None else ""
    return "oom", f"{REFUSED}: asked for {size}{available}"
