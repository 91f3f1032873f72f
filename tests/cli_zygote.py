"""`python -m ablate` for the tests, without its imports each time: a process that has imported what
every run of the CLI imports, and forks a child for each command line it is sent. The same for the
report (`python -m analysis.report`), which imports torch and ablate's options to name them: two
thirds of a fresh report's time.

A run of a tiny point through the CLI costs some 11 CPU-seconds on two cores, of which the training
is half a second; the command's own imports (torch, Hydra, ablate's job and prediction modules) are
about 4 of them, its point worker's (torch again, and MemTracker's modules) about 6. `make test`
runs the CLI some ninety times, `make test-slow` more, so `helpers.run_cli` sends its command lines
here instead. Each child runs the command as `python -m ablate` does (`runpy`, with the module as
`__main__`, the arguments in `sys.argv`, the environment, working directory and output files of
the call) and exits as that interpreter would: its exit status and output are the command's. It
differs from a fresh interpreter only in what the imports did before the fork (no threads, no
CUDA, no Hydra state: composition starts in the child), and in leaving its heap to the kernel as
it exits (`_run_and_exit`).

The command's worker server (launch/warm_start.py) is such a fork too: as the command starts, before
it does anything, it forks a spare (`_Spare`), which waits; the first `prestart` that would start
`python -m <worker module> --wait FD` hands the spare that command line, its environment and its
pipes instead, and the spare runs the module as that interpreter would, its imports done. Like a
started server it is the command's child, in a session of its own, with its output nowhere, and
dies with the command. A second server (another environment), a submitit job's one-point worker,
and any start the spare cannot stand for start a fresh interpreter, as they would anyway.

`run` is the tests' side: a server per test process, started on first use and gone with that
process (its stdin closes), and a second while two of its threads run commands at once. A call
whose environment differs in what an interpreter reads as it starts (a sitecustomize on
PYTHONPATH), one made while both servers are busy, and every call under ABLATE_TEST_CLI=fresh
start a fresh interpreter instead. Protocol: a JSON line per command on the server's stdin
({"module", "args", "env", "cwd", "out", "err"}); its reply pipe (fd given on its command line) gets the
child's pid, then its exit code as subprocess reports one (negative: the signal that ended it).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

from launch.warm_start import SET_BY_IMPORTS, _Lines

ROOT = Path(__file__).resolve().parent.parent


# Read as an interpreter starts or as torch is imported (a sitecustomize on PYTHONPATH, a preloaded
# library, torch's logging and thread settings): a command that sets one otherwise than the server
# started with gets a fresh interpreter. Torch's imports set TORCHINDUCTOR_CACHE_DIR to its default.
_AT_START = ("PYTHON", "LD_", "TORCH", "OMP_", "MKL_")


class _Server:
    def __init__(self) -> None:
        self.env, self.busy = dict(os.environ), False
        read, write = os.pipe()
        self.log = tempfile.TemporaryFile()  # what the server itself printed, for a server that died
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", str(write)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, pass_fds=(write,))
        os.close(write)
        self.replies = _Lines(read)  # the warm worker's reader: lines from a pipe, with a time limit

    def starts_alike(self, env: dict) -> bool:
        keys = {k for k in (*env, *self.env) if k.startswith(_AT_START) and k not in SET_BY_IMPORTS}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def line(self, timeout: float | None) -> str | None:
        """The next reply; None when none came within `timeout` s."""
        reply = self.replies.next(timeout)
        if reply == "":
            self.log.seek(0)
            raise RuntimeError(f"the CLI test server died: {self.log.read()[-3000:].decode(errors='replace')}")
        return reply

    def run(self, args: list[str], env: dict, cwd: Path, timeout: float,
            module: str = "ablate") -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, *args]
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "out": str(out),
                       "err": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = int(self.line(None))
            code = self.line(timeout)
            if code is None:  # as subprocess.run does at its timeout: kill, wait, raise
                os.kill(pid, signal.SIGKILL)
                self.line(None)
                raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(), stderr=err.read_text())
            return subprocess.CompletedProcess(cmd, int(code), out.read_text(), err.read_text())


# This test process's servers: a second starts only while a thread of it runs a command beside
# another's (a test that runs two at once), and stays for the next such test.
_servers: list[_Server] = []
_lock = threading.Lock()
MOST = 2


def _idle_server(env: dict) -> _Server | None:
    """A server of this process's environment, idle, for a command with `env`, marked busy (one
    started where none is idle and fewer than MOST run); None where the command's start differs
    from theirs."""
    with _lock:
        _servers[:] = [s for s in _servers if s.proc.poll() is None]
        server = next((s for s in _servers if not s.busy), None)
        if server is None and len(_servers) < MOST:
            server = _Server()
            _servers.append(server)
        if server is None or not server.starts_alike(env):
            return None
        server.busy = True
        return server


def run(args: list[str], env: dict, cwd: Path, timeout: float, module: str = "ablate") -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (ablate's CLI, or the report) in `cwd` with the whole environment `env`,
    its output captured as text; subprocess.run's result, and its TimeoutExpired."""
    server = _idle_server(env) if os.environ.get("ABLATE_TEST_CLI") != "fresh" else None
    if server is None:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    try:
        return server.run(args, env, cwd, timeout, module)
    finally:
        server.busy = False


def _preload() -> None:
    """What every run of the CLI imports, and Hydra's plugin scan, which each run would repeat."""
    import hydra  # noqa: F401
    from hydra.core.plugins import Plugins

    import ablate.job  # noqa: F401  (torch, the results, the launch of a worker)
    import ablate.outcome  # noqa: F401  (validation, prediction, the batch search)
    import ablate.worker  # noqa: F401  (the point's worker and MemTracker's modules, for _Spare)
    import launch.torchrun  # noqa: F401  (the ranks' launcher, a worker too)
    import launch  # noqa: F401  (ablate's launchers and sweepers, found by the scan)
    from ablate.command_line import unknown_key  # noqa: F401
    # pandas: every sweep's summary compares its rows; the report reads them too (not the report
    # itself: a module run as __main__ that is imported already is run twice, and runpy warns so)
    from analysis import compare, load, recommend  # noqa: F401

    Plugins.instance()
    # Frozen, what the imports made is never walked by a child's collections, nor written to by them
    # (which would copy its pages into every child), as the worker server does before it forks.
    gc.collect()
    gc.freeze()


def _serve(reply: int) -> dict | None:
    """Fork a child per command line; the child returns its command, the server None at the end."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(reply)
            return request
        os.write(reply, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(reply, f"{os.waitstatus_to_exitcode(status)}\n".encode())


class _Adopted:
    """What warm_start asks of the subprocess.Popen of a server, for the spare that became one: it
    is this process's child, so it is waited for as a started one is."""

    def __init__(self, args: list[str], pid: int, stdin) -> None:
        self.args, self.pid, self.stdin, self.returncode = args, pid, stdin, None
        self._ended = os.pidfd_open(pid)  # readable once the process has exited

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                os.close(self._ended)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._ended], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()  # it has exited: reaped now


class _Spare:
    """A child of the command, forked before the command does anything, that becomes the worker
    server the command's first `prestart` would start as `python -m MODULE ... --wait FD`."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            self._wait(theirs)  # never returns
        theirs.close()
        self.sock, self.used = ours, False

    def stands_for(self, args: list[str], kwargs: dict) -> bool:
        """Whether the server `subprocess.Popen(args, **kwargs)` starts is one this spare becomes:
        a module of this interpreter with a reply pipe (not a one-point worker), to start in a
        session of its own with output nowhere, with an environment that starts alike."""
        from launch.local import _die_with_parent  # what the spare does itself as it starts
        from launch.warm_start import WAIT_FLAG

        env = kwargs.get("env") or {}
        keys = {k for k in (*env, *self.env) if k.startswith(_AT_START)} - {"PYTHONUNBUFFERED", *SET_BY_IMPORTS}
        return (not self.used and args[:2] == [sys.executable, "-m"] and len(kwargs.get("pass_fds", ())) == 1
                and args[-2:] == [WAIT_FLAG, str(kwargs["pass_fds"][0])] and kwargs.get("start_new_session")
                and kwargs.get("preexec_fn") in (None, _die_with_parent)
                and kwargs.get("stdin") == subprocess.PIPE and kwargs.get("stdout") == subprocess.DEVNULL
                and kwargs.get("stderr") == subprocess.DEVNULL and all(env.get(k) == self.env.get(k) for k in keys))

    def start(self, args: list[str], kwargs: dict) -> _Adopted:
        self.used = True
        read, write = os.pipe()
        go = {"args": args, "env": kwargs["env"], "cwd": os.getcwd()}
        socket.send_fds(self.sock, [json.dumps(go).encode()], [read, kwargs["pass_fds"][0]])
        os.close(read)
        self.sock.close()
        return _Adopted(args, self.pid, os.fdopen(write, "wb"))

    @staticmethod
    def _wait(sock: socket.socket) -> None:
        """In the spare: from the start what a started server is to the command (a session of its
        own, its output nowhere, dead with the command), it waits for the go or the command's end,
        then runs the server's module."""
        os.setsid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        chunks, fds = [], []
        while True:
            data, got, _, _ = socket.recv_fds(sock, 1 << 20, 2)
            fds += got
            if not data:
                break
            chunks.append(data)
        if not fds:  # the command ended without wanting a server
            os._exit(0)
        go = json.loads(b"".join(chunks))
        stdin, reply = fds
        os.dup2(stdin, 0)
        os.close(stdin)
        # A fresh interpreter's standard streams under PYTHONUNBUFFERED, which the worker's environment sets
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.chdir(go["cwd"])
        os.environ.clear()
        os.environ.update(go["env"])
        module, *rest = go["args"][2:]
        sys.argv = ["-m", *rest[:-1], str(reply)]  # runpy puts the module's path in argv[0], as -m does
        os._exit(_run(module) & 0xFF)  # the worker's own exit skips the teardown too (ablate/worker.py)


def _with_spare() -> None:
    """This command's first worker server, when it is one the spare stands for, is the spare."""
    from launch import warm_start

    spare, popen = _Spare(), subprocess.Popen

    def start(args, **kwargs):
        return spare.start(list(args), kwargs) if spare.stands_for(list(args), kwargs) else popen(args, **kwargs)
    warm_start.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": start})


def _become(request: dict) -> None:
    """This process is now `python -m MODULE ARGS` run in `cwd` with `env`, its output in files."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's path in argv[0], as -m does


def _run(module: str) -> int:
    """`python -m MODULE` in this process (runpy, the module as __main__): the exit status the
    interpreter would give it for a SystemExit or an exception (its traceback printed), and
    -SIGINT for Ctrl-C."""
    try:
        runpy._run_module_as_main(module)
        return 0
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _run_and_exit(module: str) -> None:
    """Run `python -m MODULE` and exit as that interpreter would: its threads joined, its atexit
    functions run, its output flushed, and its exit status. What it skips is the teardown of the
    heap, which a process's exit leaves to the kernel: the zygote's imports (torch's,
    transformers', MemTracker's), walked and freed object by object at every command's exit, each
    object's page copied from the zygote's before it is freed."""
    code = _run(module)
    threading._shutdown()  # what the interpreter's own exit does first: private, but its own
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # and what C code printed through libc's buffers
        ctypes.CDLL(None).fflush(None)
    if code == -signal.SIGINT:  # as the interpreter ends after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    _preload()
    command = _serve(int(sys.argv[1]))
    if command is None:
        sys.exit(0)
    _become(command)
    if command["module"] == "ablate":  # a report starts no worker
        _with_spare()
    _run_and_exit(command["module"])
