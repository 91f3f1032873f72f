"""Files a sweep writes, written so a full disk or a crash never leaves half of one: an atomic JSON
write, the room check before a point starts, and the stop that names a full disk."""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota
MIN_FREE_KIB = 1024  # below this a point cannot write its files (.hydra/, spec.json, logs, result.json)


def free_kib(path: str | Path) -> float:
    """KiB free to this user on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free / 1024


class DiskFull(SystemExit):
    """A sweep that has run out of disk space stops with one line naming where and how much is
    left. A SystemExit passes through Hydra's job and sweep loops (which catch Exception and would
    print a traceback, or go on to the next point, which cannot write either)."""

    def __init__(self, where: str | Path, what: str):
        super().__init__(f"error: {what}: {free_kib(where):,.0f} KiB free under {where}. The sweep stops; free some "
                         "space and run the same command again (finished points are skipped).")


def check_room(where: str | Path, what: str = "no room left for the next point") -> None:
    """Raise DiskFull when less than MIN_FREE_KIB is free under `where`."""
    if free_kib(where) < MIN_FREE_KIB:
        raise DiskFull(where, what)


def write_json(path: str | Path, obj: dict) -> None:
    """Atomic: a temporary file in the same directory, fsynced, then renamed over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes its file 0600; a result is read by teammates' reports on a shared directory,
        # so it gets what open() would give any other file: 0666 less the umask.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it, so set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def clear_path(path: Path) -> None:
    """Remove whatever is at `path` (a file, a link, a directory tree); nothing if nothing is."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
