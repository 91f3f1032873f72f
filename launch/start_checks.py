"""Before a sweep (or a single run) writes anything: can it write, and is there room for it? A
Hydra callback (conf/config.yaml, hydra.callbacks), because Hydra's own first writes
(multirun.yaml, a point's .hydra/ files) come before any of ablate's code runs, and on a full disk
or an unwritable directory they fail with tracebacks. Between points the job checks the room after
each row (ablate/job.py)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ablate.results import check_room


def check_writable(where: str, key: str) -> None:
    """Stop with one line when the directory `where` (the value of `key`) could not be made or
    written in: a file in its path, no permission, a read-only file system. Nothing is made: the
    nearest directory that exists takes a temporary file, which goes at once."""
    path = Path(where).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        why = f"{existing} is a file, not a directory"
    else:
        try:
            with tempfile.TemporaryFile(dir=existing):  # a directory can exist and still refuse files
                return
        except OSError as exc:
            why = f"{exc.strerror or exc} ({existing})"
    raise SystemExit(f"error: cannot write under {key}={where}: {why}. Nothing ran; give {key}=DIR a "
                     "directory you can write (or run from one).")


class RoomToWrite(Callback):
    """out_dir first (it holds every point's index entry, and the run and sweep directories are
    under it unless set apart), then the directory Hydra writes first; then the room in it."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir", str(config.hydra.sweep.dir), "no room to start the sweep")

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir", str(config.hydra.run.dir), "no room to start the run")

    @staticmethod
    def _check(config: Any, key: str, where: str, no_room: str) -> None:
        check_writable(str(config.out_dir), "out_dir")
        check_writable(where, key)
        check_room(where, no_room)
