"""`python -m ablate` for the tests, without its imports each time: a process that has imported what
every run of the CLI imports, and forks a child for each command line it is sent.

A run of a tiny point through the CLI costs some 11 CPU-seconds on two cores, of which the training
is half a second; the command's own imports (torch, Hydra, ablate's job and prediction modules) are
about 4 of them. `make test` runs the CLI some ninety times, `make test-slow` more, so
`helpers.run_cli` sends its command lines here instead. Each child runs the command as `python -m ablate` does (`runpy`, with the
module as `__main__`, the arguments in `sys.argv`, the environment, working directory and output
files of the call) and exits as that interpreter would: its exit status and output are the
command's. It differs from a fresh interpreter only in what the imports did before the fork: no
threads, no CUDA, no Hydra state (composition starts in the child).

`run` is the tests' side: one server per test process, started on first use and gone with that
process (its stdin closes). A call made while another thread's command runs, one whose environment
differs in what an interpreter reads as it starts (a sitecustomize on PYTHONPATH), and every call
under ABLATE_TEST_CLI=fresh, start a fresh interpreter instead. Protocol: a JSON line per command on the
server's stdin ({"args", "env", "cwd", "out", "err"}); its reply pipe (fd given on its command line)
gets the child's pid, then its exit code as subprocess reports one (negative: the signal that
ended it).
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from launch.warm_start import SET_BY_IMPORTS, _Lines

ROOT = Path(__file__).resolve().parent.parent


# Read as an interpreter starts or as torch is imported (a sitecustomize on PYTHONPATH, a preloaded
# library, torch's logging and thread settings): a command that sets one otherwise than the server
# started with gets a fresh interpreter. Torch's imports set TORCHINDUCTOR_CACHE_DIR to its default.
_AT_START = ("PYTHON", "LD_", "TORCH", "OMP_", "MKL_")


class _Server:
    def __init__(self) -> None:
        self.env = dict(os.environ)
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

    def run(self, args: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ablate", *args]
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = {"args": args, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = int(self.line(None))
            code = self.line(timeout)
            if code is None:  # as subprocess.run does at its timeout: kill, wait, raise
                os.kill(pid, signal.SIGKILL)
                self.line(None)
                raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(), stderr=err.read_text())
            return subprocess.CompletedProcess(cmd, int(code), out.read_text(), err.read_text())


_server: _Server | None = None
_lock = threading.Lock()


def run(args: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m ablate ARGS` in `cwd` with the whole environment `env`, its output captured as
    text; subprocess.run's result, and its TimeoutExpired."""
    global _server
    if os.environ.get("ABLATE_TEST_CLI") != "fresh" and _lock.acquire(blocking=False):
        try:
            if _server is None or _server.proc.poll() is not None:
                _server = _Server()
            if _server.starts_alike(env):
                return _server.run(args, env, cwd, timeout)
        finally:
            _lock.release()
    return subprocess.run([sys.executable, "-m", "ablate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _preload() -> None:
    """What every run of the CLI imports, and Hydra's plugin scan, which each run would repeat."""
    import hydra  # noqa: F401
    from hydra.core.plugins import Plugins

    import ablate.job  # noqa: F401  (torch, the results, the launch of a worker)
    import ablate.outcome  # noqa: F401  (validation, prediction, the batch search)
    import launch  # noqa: F401  (ablate's launchers and sweepers, found by the scan)
    from ablate.command_line import unknown_key  # noqa: F401

    Plugins.instance()


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


def _become(request: dict) -> None:
    """This process is now `python -m ablate ARGS` run in `cwd` with `env`, its output in files."""
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


if __name__ == "__main__":
    _preload()
    command = _serve(int(sys.argv[1]))
    if command is None:
        sys.exit(0)
    _become(command)
    # What `python -m ablate` runs: ablate/__main__.py as the __main__ module. A SystemExit or an
    # exception leaves through the interpreter's own exit, as from that command.
    runpy._run_module_as_main("ablate")
