"""A worker started before its point is ready, so that its imports overlap the job's own work.

A worker's start is mostly imports: torch and MemTracker's (torch.distributed._tools), 2.3 s on
the 2-core VM. The job meanwhile imports torch itself, validates and predicts. So the job starts its
point's worker command (`prestarted`) as soon as it knows the point will run, with `--wait` after
it: the worker imports, then blocks on stdin. The launch with the same command and environment
`take`s it and says go; only what is left of its start-up lies on the point's path. The process is
as fresh as one started then: nothing runs in it before the go, so its memory figures are the
point's alone, and its output goes to the same worker.log.

A launch that does not match (a changed environment, a batch search's probe in a directory of its
own) starts a fresh process as before; a warm worker not taken (that launch, or none: an invalid or
pruned point) is killed before it has run anything. One warm worker at a time.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WAIT_FLAG = "--wait"  # after the worker's own arguments: wait for the go on stdin first


@dataclass
class Warm:
    proc: subprocess.Popen
    cmd: list[str]  # the launch it will serve, exactly
    env: dict  # its whole environment, as that launch's
    log: Path  # its output: the run's worker.log

    def discard(self) -> None:
        """Unused: it goes, with whatever it started (its own session) and the log it began: a
        point that never launched (invalid, pruned) has no worker output."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        self.log.unlink(missing_ok=True)


_waiting: Warm | None = None  # this job process's one warm worker


def prestart(cmd: list[str], env: dict, log: Path, preexec_fn=None) -> None:
    """Start the launch `cmd` (with the whole environment `env`, output to `log`) now, waiting for
    its go."""
    global _waiting
    drop()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, WAIT_FLAG], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, preexec_fn=preexec_fn)
    _waiting = Warm(proc, list(cmd), dict(env), log)


def take(cmd: list[str], env: dict) -> subprocess.Popen | None:
    """The warm worker, told to go, where it was started as this launch and still waits; else
    None, and it is gone."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is None:
        return None
    if warm.cmd != cmd or warm.env != env or warm.proc.poll() is not None:
        warm.discard()
        return None
    try:
        warm.proc.stdin.write(b"go\n")
        warm.proc.stdin.close()
    except BrokenPipeError:  # it died between the poll and the write
        warm.discard()
        return None
    return warm.proc


def drop() -> None:
    """Kill the warm worker, if one waits."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is not None:
        warm.discard()


@contextlib.contextmanager
def prestarted(cmd: list[str], env: dict, log: Path, preexec_fn=None):
    """A warm worker for the block's launch of `cmd`; gone after the block if not taken."""
    prestart(cmd, env, log, preexec_fn)
    try:
        yield
    finally:
        drop()


def arguments(argv: list[str]) -> list[str] | None:
    """In the worker, once imported: its arguments, after the go where it was started warm; None
    where the job hung up instead (it dropped this worker)."""
    if argv[-1:] != [WAIT_FLAG]:
        return argv
    return argv[:-1] if sys.stdin.readline().strip() == "go" else None
