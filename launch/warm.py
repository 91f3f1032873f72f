"""A worker started before its point is ready, so that its imports overlap the job's own work.

A worker's start is mostly imports: torch and MemTracker's (torch.distributed._tools) take about
4 s on 2 cores, and the job, meanwhile, composes, imports torch itself, validates and predicts. The
job `prestarted`s its point's worker command as soon as it knows the point will run (after the skip
check). The worker (`--wait PRELOG`) imports, then blocks on stdin; `take` hands it its spec.json's
path when the job launches, so only what is left of its start-up lies on the point's path. The
process is as fresh as one started then: nothing runs in it before the spec arrives, so its memory
figures are the point's alone, and its environment is checked against the launch's.

Any launch that does not match (another command or environment, a find_batch probe after the first
launch, a worker that died waiting) starts a fresh process as before: one warm worker at a time.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

WAIT_FLAG = "--wait"


@dataclass
class Warm:
    proc: subprocess.Popen
    argv: list[str]  # the command without its spec path
    env: dict  # its whole environment, as a fresh launch would have it
    prelog: Path  # its output until it knows its run directory (the imports' warnings, a traceback)

    def settle(self, log: Path) -> None:
        """Once it has ended: what it printed before it moved its output to `log` (it does, with
        the spec) lands there if nothing else did, e.g. an import's traceback; then the prelog goes."""
        if self.prelog.exists() and not log.exists():
            shutil.copyfile(self.prelog, log)
        self.prelog.unlink(missing_ok=True)

    def discard(self) -> None:
        """Unused: the process (and anything it started) goes, and its prelog with it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()
        self.prelog.unlink(missing_ok=True)


_waiting: Warm | None = None  # this job process's one warm worker


def prestart(argv: list[str], env: dict, preexec_fn=None) -> None:
    """Start `argv` (a worker command without its spec path) with the whole environment `env`,
    waiting for its spec on stdin."""
    global _waiting
    drop()
    fd, prelog = tempfile.mkstemp(prefix="ablate-worker-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        proc = subprocess.Popen([*argv, WAIT_FLAG, prelog], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env, preexec_fn=preexec_fn)
    _waiting = Warm(proc, list(argv), dict(env), Path(prelog))


def take(cmd: list[str], env: dict) -> Warm | None:
    """The warm worker, handed cmd's spec path (its last element), where it was started as
    cmd[:-1] with the same environment and is still waiting; else None, and it is gone."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is None:
        return None
    if warm.argv != cmd[:-1] or warm.env != env or warm.proc.poll() is not None:
        warm.discard()
        return None
    try:
        warm.proc.stdin.write(f"{cmd[-1]}\n".encode())
        warm.proc.stdin.close()
    except BrokenPipeError:  # it died between the poll and the write
        warm.discard()
        return None
    return warm


def drop() -> None:
    """Discard the warm worker, if one waits."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is not None:
        warm.discard()


@contextlib.contextmanager
def prestarted(argv: list[str] | None, env: dict, preexec_fn=None):
    """A warm worker for the block's first launch (none where argv is None); gone after it."""
    if argv is not None:
        prestart(argv, env, preexec_fn)
    try:
        yield
    finally:
        drop()


def spec_path(argv: list[str]) -> str | None:
    """In the worker, once imported: its spec's path, from argv (`SPEC`) or, started warm
    (`--wait PRELOG`), from stdin, this process's output then moved to the run's worker.log after
    what it printed so far. None where the job hung up without one (the warm worker was dropped)."""
    if argv[0] != WAIT_FLAG:
        return argv[0]
    prelog = Path(argv[1])
    spec_path = sys.stdin.readline().strip()
    if not spec_path:
        return None
    log = Path(json.loads(Path(spec_path).read_text())["run_dir"]) / "worker.log"
    sys.stdout.flush()
    sys.stderr.flush()
    shutil.copyfile(prelog, log)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    prelog.unlink(missing_ok=True)
    return spec_path
