"""The worker: one process that builds, trains and measures one grid point, then reports.

Started by the job as `python -m ablate.worker <run_dir>/spec.json` (with `--wait` after it when
started ahead of its launch: launch/warm_start.py). It reports through
<run_dir>/events.jsonl (ablate/events.py), never through its exit code alone, so the job can tell
an OOM from a crash without reading logs.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from ablate import host
from ablate.artifacts import dump_oom_snapshot
from ablate.events import EventWriter
from ablate.runner import run
from ablate.techniques import Invalid
from launch import warm_start


def inject_fault(overrides: list[str], rank: int = 0) -> None:
    """Test hook: ABLATE_FAULT=oom|error|hang|kill[:substring][@rank] fails the points whose
    overrides contain the substring (all points without one), on one rank (rank 0 without one),
    the way a real failure would."""
    spec = os.environ.get("ABLATE_FAULT")
    if not spec:
        return
    spec, _, on_rank = spec.partition("@")
    kind, _, match = spec.partition(":")
    if (match and not any(match in o for o in overrides)) or rank != int(on_rank or 0):
        return
    if kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by ABLATE_FAULT)")
    if kind == "error":
        raise RuntimeError("injected by ABLATE_FAULT")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


# Allocation failures that do not arrive as torch.OutOfMemoryError: CUDA libraries that allocate
# outside the caching allocator (cuBLAS workspaces, the context). The host allocator's are judged
# by ablate/host.py: a process or cgroup limit's refusal measures nothing of the point.
_OOM_MESSAGES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def status_of(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running a point."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", text
    if isinstance(exc, RuntimeError) and host.refused(str(exc)):
        return host.refused(str(exc))
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES):
        return "oom", text
    if isinstance(exc, Invalid):
        return "invalid", text
    return "error", f"{type(exc).__name__}: {text}"


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))  # set by torchrun; a single worker is rank 0
    events = EventWriter(spec["run_dir"], rank)
    events.emit("started", pid=os.getpid(), host=socket.gethostname())
    try:
        inject = functools.partial(inject_fault, spec.get("overrides", []), rank)
        result = run(spec, events, before_first_step=inject)
        if result is not None:  # rank 0 reports for the group
            events.emit("result", **result)
        return 0
    except Exception as exc:  # every failure becomes a reported status; the traceback goes to the log
        traceback.print_exc()
        status, reason = status_of(exc)
        events.emit("failure", status=status, reason=reason)
        if status == "oom":  # the allocator's state at the OOM, if CUDA's observer caught one
            try:
                dump_oom_snapshot(spec["run_dir"], rank)
            except Exception:  # the row stands without it
                traceback.print_exc()
        return 1


def prepare(args: list[str]) -> None:
    """In a worker server, before it forks the process of the point `args` names: what that point's
    model and options import on first use (transformers' modeling code, peft), so that the point's
    process and every later one of the server start with them. Only on a host with no GPU in sight:
    torchao, which both import, asks at import whether CUDA is available, which sets CUDA's driver up
    in the server, and a GPU point it forked after that (even after a CPU point) could not use it."""
    from ablate.build import Techniques
    from ablate.spec import RunSpec
    from launch.nvml import visible_gpu_count

    if visible_gpu_count():
        return
    t = Techniques.of(RunSpec.of(json.loads(Path(args[0]).read_text())["config"]))
    for option in (t.model, *t.options().values()):
        option.imports()


if __name__ == "__main__":
    # SIGUSR1 writes every thread's Python stack to the log: the job sends it before it kills a
    # worker past timeout_s, so the timeout row can say where the worker was (launch/local.py).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = warm_start.arguments(sys.argv[1:], prepare)  # started warm: waits here, imported, for the go
    code = main(args[0]) if args else 0
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: tearing down a gloo process group while DDP's reducer is
    # being freed deadlocks (the reducer's destructor joins gloo threads that wait for the GIL).
    # Everything worth keeping is already in events.jsonl and the log.
    os._exit(code)
