"""Run one worker as a child process with a wall-clock limit, and tell how it ended.

The worker gets its own session (process group), so a timeout or Ctrl-C kills it and everything it
started (torchrun's ranks included), and never the sweep.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ablate.events import EventReader, phase_seconds
from ablate.spec import RunSpec
from launch import warm_start
from launch.nvml import NvmlSampler
from launch.worker_exit import Outcome, worker_outcome

SPEC, LOG = "spec.json", "worker.log"  # in the run directory: what the worker runs, what it prints
KILL_GRACE_S = 10.0  # SIGTERM first, so torchrun can stop its ranks; SIGKILL after this
STACK_DUMP_S = 1.0  # how long a worker past its timeout gets to write its stacks (SIGUSR1) before the kill


# Signals that stop a job from outside: SLURM sends SIGUSR2 `signal_delay_s` before its time limit
# (submitit's setting) and SIGTERM on scancel or preemption. The point still gets its row: the
# signal is held while the worker runs and passed on (`pass_on_stop`) once the row is written.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


def _die_with_parent() -> None:
    """In the child before exec: the kernel SIGKILLs it if the job process dies (e.g. SIGKILLed),
    so no orphaned worker keeps a GPU busy. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def pass_on_stop(outcome: Outcome) -> None:
    """Once the point's row is written, a stop signal held while its worker ran takes effect.

    Where the signal's handler is the default one, the job is the sweep's own process (the local
    launcher runs every point in it): the default action ends it, so a sweep told to stop stops,
    with every row written so far, instead of starting its next point. Under submitit, its handler
    had the signal before ours and each point is a task of its own: the job returns as usual and
    submitit's handling of the next signal (requeue, or the end of the task) is unchanged.
    """
    sig = outcome.stopped_by
    if sig and signal.getsignal(sig) == signal.SIG_DFL:
        signal.raise_signal(sig)


@contextlib.contextmanager
def _stop_signals(stopped: list):
    """While the worker runs, a stop signal is recorded (and acted on by the wait loop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda sig, frame: stopped.append(sig)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # gone already; a forked worker's server has reaped it, and
            with contextlib.suppress(subprocess.TimeoutExpired):  # how it ended is still to be read
                proc.wait(timeout=KILL_GRACE_S)
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _dump_stacks(proc: subprocess.Popen) -> None:
    """Ask a worker (or torchrun's ranks) for its Python stacks in the log (faulthandler on
    SIGUSR1, registered by ablate.worker), and give it a moment to write them."""
    try:
        os.killpg(proc.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return
    time.sleep(STACK_DUMP_S)


def worker_command(spec: RunSpec) -> tuple[list[str], int, dict]:
    """How a point's worker starts: its command, without the spec.json path that goes last (one
    worker, or torchrun's launcher for its ranks), its world size, and what it adds to the
    environment (the allocator settings it is measured under)."""
    parallel = spec.groups["parallel"]
    distributed = not parallel["_target_"].endswith(".Single")  # the others run their ranks under torchrun
    module = "launch.torchrun" if distributed else "ablate.worker"
    world = parallel["nproc"] * parallel["nodes"] if distributed else 1
    return [sys.executable, "-m", module], world, {"PYTORCH_CUDA_ALLOC_CONF": spec.alloc_conf} if spec.alloc_conf else {}


def worker_env(extra: dict | None) -> dict:
    """The whole environment of a worker that adds `extra` to this process's."""
    return {**os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1"}


def _one_point_here() -> bool:
    """This process runs one point (a submitit job: SLURM, or a GPU pool's), not the sweep's
    points one after the other (Hydra's basic launcher)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def prestart(spec: RunSpec, spec_path: Path) -> None:
    """A worker server for the point's launch of spec_path (where `launch` writes it), waiting
    (launch/warm_start.py): the one a point before started, else one started now. A submitit job's runs
    one point and is started as its launch, spec path and all, so that `ps` names the point (on a
    cluster the likeliest place to look for it); the sweep's own process starts one that gets it at
    the go, which serves every later point of the same command and environment too."""
    argv, _, extra = worker_command(spec)
    one = _one_point_here()
    warm_start.prestart([*argv, str(spec_path)] if one else argv, worker_env(extra), _die_with_parent, once=one)


def _prestart_next(cmd: list[str], env: dict) -> None:
    """A worker server for the next point's launch, if it is of the same command and environment,
    ready when it comes (launch/warm_start.py), unless one waits already; where this process has a
    next point."""
    if not _one_point_here():
        warm_start.prestart(cmd[:-1], env, _die_with_parent)


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen | warm_start.Forked:
    """A fork of the waiting server, where it serves this launch, else a new process; its output
    goes to `log`. (`cmd`'s last argument is the spec.json path: started without it, the server
    gets it at the go.)"""
    ready = warm_start.take(cmd, [], env, log) or warm_start.take(cmd[:-1], cmd[-1:], env, log)
    if ready:
        return ready
    with open(log, "w") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=_die_with_parent)


def _shown(on_event: Callable[[dict], None], event: dict) -> None:
    """Hand `event` to the display. A display that fails (an event it cannot format) costs that
    line, never the worker it shows: this loop also enforces the timeout and collects the result."""
    try:
        on_event(event)
    except Exception as exc:
        print(f"warning: could not show the worker's {event.get('event')} event ({type(exc).__name__}: {exc})",
              file=sys.stderr)


def run_worker(cmd: list[str], run_dir: Path, timeout_s: float, world_size: int = 1,
               on_event: Callable[[dict], None] = lambda e: None, env: dict | None = None,
               next_at: str = "eval") -> Outcome:
    """Start `cmd` (with `env` added to this process's environment), follow its events, sample
    NVML, enforce the time limit; never raises for the worker's own failures. At the worker's
    phase `next_at` a worker for the next launch starts importing: "eval", once the measured steps
    are done, where they time the CPU it would take; "measure" where they time a GPU, which it
    does not touch, so that its whole start hides behind them."""
    log = run_dir / LOG
    reader, events, timed_out, stopped = EventReader(run_dir), [], False, []
    env = worker_env(env)
    launched = time.time()  # the workers' event clock (events.py), for timing.phases_s
    proc = _start(cmd, log, env)
    with NvmlSampler(proc.pid) as sampler, _stop_signals(stopped):

        def follow() -> None:
            for event in reader.read_new():
                events.append(event)
                if event["event"] == "phase":
                    sampler.measuring = event["phase"] == "measure"
                    if event["phase"] == next_at:
                        _prestart_next(cmd, env)
                _shown(on_event, event)

        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                follow()
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if stopped:
                    break
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # a timeout, or Ctrl-C in the job: take the whole process group down
            if proc.poll() is None:
                if timed_out:
                    _dump_stacks(proc)
                _kill_group(proc)
        follow()
    ended = time.time()
    outcome = worker_outcome(proc.returncode, timed_out, timeout_s, events, log, world_size)
    if log.exists() and log.stat().st_size == 0:  # the worker printed nothing: no empty file beside its row
        log.unlink()
    if stopped and outcome.status != "ok":
        name = signal.Signals(stopped[0]).name
        outcome = Outcome("timeout" if stopped[0] == signal.SIGUSR2 else "error",
                          f"the job received {name} (a time limit, scancel, preemption or kill); worker killed")
    outcome.phases = phase_seconds(events, launched, ended)
    outcome.stopped_by = stopped[0] if stopped else None
    nvml = sampler.fields()
    outcome.env["driver"] = nvml.pop("driver")
    outcome.env["cuda_visible_devices"] = env.get("CUDA_VISIBLE_DEVICES")  # the GPUs it was pinned to, if any
    outcome.metrics.update(nvml)
    pids = {e["rank"]: e["pid"] for e in events if e["event"] == "started"}
    for row in outcome.metrics.get("per_rank") or []:
        row["nvml_peak_mib"] = sampler.peak_by_pid.get(pids.get(row["rank"]))
    return outcome
