"""A grid point is claimed before it runs, so that two sweeps (or a requeued SLURM task and its
first try) meeting one point never measure it twice at once, each timing the other's load.

The claim is an OS lock (flock) on `<out_dir>/index/<run_id>.claim`: keyed by run_id, it also
covers the same point reached through two sweep directories. The kernel releases it when its
holder exits in any way (SIGKILL included), so a dead sweep never leaves a point claimed; on NFS,
Linux maps flock onto the server's byte-range locks. The file stays (removing it could let a
waiter hold a lock on an unlinked file while a third process locks a new one); it only says who
held it last.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def claimed(path: Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold the claim at `path` for the block. If another process holds it, `waiting` gets a line
    naming the holder, then this waits until the holder is done (its row written, or it died)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            waiting(f"waiting: this point is being run by {holder}; its row will be used when it is done")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:  # who holds it, for a waiter's message; the lock itself needs no space on a full disk
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                    f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}\n")
            f.flush()
        except OSError:
            pass
        yield  # the lock goes with the file's close
