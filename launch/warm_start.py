"""Workers started before their point is known, imported once and forked for each point.

A worker's start is mostly imports: torch and MemTracker's (torch.distributed._tools), 2.3 s on a
CPU-only host and 4.6-7.1 s on a GPU host (benchmarks/results/NVIDIA-H200/README.md). So a worker
command is started with `--wait` after it and no point: it imports, then serves. A launch of the
same command and environment `take`s it and sends a point's arguments and log file; the server
forks, and the child runs the point with its output in the point's worker.log, while the server
waits for the child, reports how it ended, and then waits for the next point. A sweep's points,
one after the other, thus pay the imports once rather than once each. Each point still runs in a
process of its own: the child of a process that has done nothing but import, so its memory
figures are the point's alone, and no CUDA context is shared (the server never touches CUDA;
tests/test_warm.py checks that its imports ask nothing of it).

Two moments start one (`prestart`): the job, as soon as it has a point, while it validates and
predicts (the sweep's first point, or one whose command or environment differs from the last);
and the launch of a point, once that point's measured steps are done (`_prestart_next` in
launch/local.py), where no server waits for the next one. A launch that does not match starts a
fresh process as before, and the waiting server stays for a later one. One server waits at a time;
it goes when this process exits (its stdin closes).

`ps` shows such a worker (and each point forked from it) as its command, `--wait` and the fd it
replies on, without the point: the run's events.jsonl has the point's pid ("started"). Where a
process runs a single point (a submitit job) the job starts it with the spec path in its command
instead and `--wait once` (launch/local.py): the go sends no arguments, and it runs the point
itself, unforked, as before.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

WAIT_FLAG = "--wait"  # after the worker's command, then the reply pipe's fd (or ONCE): serve points from stdin
ONCE = "once"  # after WAIT_FLAG: run the one point sent, in this process (a job of one point)
REPLY_S = 600.0  # the longest a launch waits for a server still importing before it starts its own
# Variables torch's own imports set where they are unset (torch._dynamo sets its inductor cache
# directory to the default): a server started before its launcher imported them has the same value
# from its own imports, so a launch that differs from it only by gaining one is served.
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)


class _Lines:
    """Lines from a pipe read with a time limit (select), for the server's replies."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def next(self, timeout: float | None) -> str | None:
        """The next whole line; "" at the end of the pipe; None when none came in `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


class Forked:
    """A point's worker, forked by a server: what launch/local.py asks of a subprocess.Popen (pid,
    poll, wait, returncode). The server is its parent, so the server reports how it ended."""

    def __init__(self, server: Warm, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self.server.lines.next(timeout)
            if line == "":  # the server died without a word (killed): so did its child (PDEATHSIG)
                self.server.proc.wait()
                self.returncode = -signal.SIGKILL
            elif line is not None:
                self.returncode = int(line)
            if self.returncode is not None:
                self.server.busy = None
                if self.server.proc.stdin.closed:  # retired while this ran: it exits now
                    self.server.discard()
        return self.returncode


@dataclass
class Warm:
    proc: subprocess.Popen  # the server
    cmd: list[str]  # the command it was started as (a point's arguments come with the go)
    env: dict  # its whole environment, as that launch's
    lines: _Lines | None  # its replies: a point's pid, then how that point ended (None: it runs one itself)
    busy: Forked | None = None  # its point still running: it serves the next once that one ends

    def serves(self, cmd: list[str], env: dict) -> bool:
        gained = {k for k in SET_BY_IMPORTS if k in env and k not in self.env}
        return (self.cmd == cmd and self.env == {k: v for k, v in env.items() if k not in gained}
                and self.proc.poll() is None)

    def discard(self) -> None:
        """It goes, with whatever it started (its own session; a running point's child dies with
        it, PDEATHSIG)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        if self.lines is not None and self.lines.fd >= 0:  # once: the number may be another file's after
            os.close(self.lines.fd)
            self.lines.fd = -1

    def retire(self) -> None:
        """No more points: it goes now if idle, else once its running point has ended (its stdin
        closed, it exits after reporting), so that the point is not killed with it."""
        if self.busy is None or self.busy.returncode is not None:
            self.discard()
        else:
            self.proc.stdin.close()


_waiting: Warm | None = None  # this process's one waiting server


def prestart(cmd: list[str], env: dict, preexec_fn=None, once: bool = False) -> None:
    """A server for launches of `cmd` (with the whole environment `env`) waiting: the one already
    waiting where it serves them, else a new one (and the other goes). `once`: a process with one
    point to run (a submitit job's), which runs it itself, unforked, as a process started for it
    would."""
    global _waiting
    if _waiting is not None and _waiting.serves(cmd, env):
        return
    drop()
    # Replies come on a pipe of their own, not stdout, where an import may print.
    read, write = os.pipe() if not once else (None, None)
    try:
        proc = subprocess.Popen([*cmd, WAIT_FLAG, ONCE if once else str(write)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
                                preexec_fn=preexec_fn, pass_fds=() if once else (write,))
    except OSError:  # no process to be had (EAGAIN, ENOMEM, EACCES): only the head start is lost; the
        if not once:  # launch starts its own, and a failure there is the point's `launch failed` row
            os.close(read)
        return
    finally:
        if not once:
            os.close(write)
    _waiting = Warm(proc, list(cmd), dict(env), None if once else _Lines(read))


def take(cmd: list[str], args: list[str], env: dict, log: Path) -> Forked | subprocess.Popen | None:
    """The point's worker, forked by the waiting server to run `args` with its output into `log`
    (created anew), where the server was started as `cmd` with `env`, is not running a point and
    still serves (the server itself where it was started for one point); else None, and it stays
    for a later launch (one that died goes)."""
    global _waiting
    warm = _waiting
    if warm is not None and warm.busy is not None:
        warm.busy.poll()  # its last point ended, even where nobody waited for it
    if warm is None or not warm.serves(cmd, env) or warm.busy is not None:
        if warm is not None and warm.proc.poll() is not None:
            drop()
        return None
    try:
        warm.proc.stdin.write(json.dumps({"args": args, "log": str(log)}).encode() + b"\n")
        warm.proc.stdin.flush()
    except BrokenPipeError:  # it died between the poll and the write
        drop()
        return None
    if warm.lines is None:  # started for this one point: it runs it
        _waiting = None
        warm.proc.stdin.close()
        return warm.proc
    reply = warm.lines.next(REPLY_S)  # its child's pid, once its imports are done
    if not reply:  # it died, or is stuck importing: the launch starts its own
        drop()
        return None
    warm.busy = Forked(warm, int(reply))
    return warm.busy


def drop() -> None:
    """Let the waiting server go, if one waits (once its running point, if any, has ended)."""
    global _waiting
    warm, _waiting = _waiting, None
    if warm is not None:
        warm.retire()


atexit.register(drop)


def arguments(argv: list[str], prepare: Callable[[list[str]], None] | None = None) -> list[str] | None:
    """In the worker, once imported: its arguments. Started with `--wait FD`, it serves instead: for
    each go it forks, and returns in the child (its output sent to the point's log) with the go's
    arguments, replying on FD; the server itself returns None once its starter closes its stdin
    or goes away. Started with `--wait once`, it returns the one go's arguments itself.
    `prepare(arguments)`, called in the server before each fork, imports what that point needs
    beyond the worker's own imports (its model family's library), so that the server's later
    children have it already; it must not set CUDA up, and a failure there is the child's to meet."""
    if argv[-2:-1] != [WAIT_FLAG]:
        return argv
    mode, argv = argv[-1], argv[:-2]
    if mode == ONCE:
        line = sys.stdin.readline().strip()
        if not line:
            return None
        go = json.loads(line)
        _to_log(go["log"])
        return [*argv, *go["args"]]
    server, replies = os.getpid(), int(mode)
    while line := sys.stdin.readline().strip():
        go = json.loads(line)
        if prepare is not None:
            with contextlib.suppress(Exception):  # the child meets it again, and reports it as its point's
                prepare([*argv, *go["args"]])
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            return None  # a child cannot use CUDA after this: the launch starts its own worker
        sys.stdout.flush()
        sys.stderr.flush()
        # What the server holds lives as long as it does: frozen, a child's collections never walk it
        # (a full one over torch's and transformers' objects takes 0.5 s on 2 cores; the traced step
        # collects before it starts) nor write to its pages.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            return _child(argv, go, server)
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    return None


def _child(argv: list[str], go: dict, server: int) -> list[str]:
    """In the forked child: a session of its own (the launch kills its group), dead with the server
    (which dies with the launch), its output in the point's log, and the go's arguments."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != server:  # the server died before the line above: nobody waits for this point
        os._exit(1)
    _to_log(go["log"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's stdin is the launch's, not the point's
    os.close(null)
    return [*argv, *go["args"]]


def _to_log(log: str) -> None:
    """From here on, this process's output (and its children's) goes to the point's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # and torchrun's ranks, which inherit them
    os.dup2(fd, 2)
    os.close(fd)
