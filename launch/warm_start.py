"""Workers started before their point is known, so that their imports lie off the points' path.

A worker's start is mostly imports: torch and MemTracker's (torch.distributed._tools), 2.3 s on a
CPU-only host and 4.6-7.1 s on a GPU host (benchmarks/results/NVIDIA-H200/README.md). So a worker
command is started with `--wait` after it and no point: it imports, then blocks on stdin, its output
thrown away. A launch of the same command and environment `take`s it and sends it the point's
arguments and log file; only what is left of its start-up lies on the point's path. The process is
as fresh as one started then: nothing runs in it before the go, so its memory figures are the
point's alone, and from the go on its output goes to the point's worker.log.

Two moments start one (`prestart`): the job, as soon as it has a point, while it validates and
predicts (the sweep's first point, or one whose command or environment differs from the last);
and the launch of a point, once that point's measured steps are done (`prestart_next`), for the
next point of the sweep, so that its imports overlap this point's eval and teardown and the next
job's own work. Never beside measured steps: the imports would take CPU from them. A launch that
does not match starts a fresh process as before, and the waiting worker stays for a later one.
One waits at a time; it goes when this process exits (its stdin closes, and it exits unused).

`ps` shows such a worker as its command and `--wait`, without the point: the run's events.jsonl
has its pid ("started"). Where a process runs a single point (a submitit job) the job starts it
with the spec path in its command instead (launch/local.py), and the go sends no arguments.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WAIT_FLAG = "--wait"  # after the worker's command: wait for the point on stdin first


@dataclass
class Warm:
    proc: subprocess.Popen
    cmd: list[str]  # the command it was started as (a point's arguments come with the go)
    env: dict  # its whole environment, as that launch's

    def serves(self, cmd: list[str], env: dict) -> bool:
        return self.cmd == cmd and self.env == env and self.proc.poll() is None

    def discard(self) -> None:
        """Unused: it goes, with whatever it started (its own session). It has written nothing."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()


_waiting: Warm | None = None  # this process's one waiting worker


def prestart(cmd: list[str], env: dict, preexec_fn=None) -> None:
    """A worker for launches of `cmd` (with the whole environment `env`) waiting: the one already
    waiting where it serves them, else a new one (and the other goes)."""
    global _waiting
    if _waiting is not None and _waiting.serves(cmd, env):
        return
    drop()
    try:
        proc = subprocess.Popen([*cmd, WAIT_FLAG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, env=env, preexec_fn=preexec_fn)
    except OSError:  # no process to be had (EAGAIN, ENOMEM, EACCES): only the head start is lost; the
        return  # launch starts its own, and a failure there is the point's `launch failed` row
    _waiting = Warm(proc, list(cmd), dict(env))


def take(cmd: list[str], args: list[str], env: dict, log: Path) -> subprocess.Popen | None:
    """The waiting worker, told to run `args` with its output into `log` (created anew), where it
    was started as `cmd` with `env` and still waits; else None, and it stays for a later launch
    (one that died goes)."""
    global _waiting
    warm = _waiting
    if warm is None or not warm.serves(cmd, env):
        if warm is not None and warm.proc.poll() is not None:
            drop()
        return None
    _waiting = None
    try:
        warm.proc.stdin.write(json.dumps({"args": args, "log": str(log)}).encode() + b"\n")
        warm.proc.stdin.close()
    except BrokenPipeError:  # it died between the poll and the write
        warm.discard()
        return None
    return warm.proc


def drop() -> None:
    """Kill the waiting worker, if one waits."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is not None:
        warm.discard()


atexit.register(drop)


def arguments(argv: list[str]) -> list[str] | None:
    """In the worker, once imported: its arguments, after the go (which also sends its output to
    the point's log) where it was started waiting; None where its starter went away instead."""
    if argv[-1:] != [WAIT_FLAG]:
        return argv
    line = sys.stdin.readline()
    if not line.strip():
        return None
    go = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(go["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # and torchrun's ranks, which inherit them
    os.dup2(fd, 2)
    os.close(fd)
    return [*argv[:-1], *go["args"]]
