"""Run one worker as a child process with a wall-clock limit, and classify how it ended.

The worker gets its own session (process group), so a timeout or Ctrl-C kills it and everything it
started (torchrun's ranks included), and never the sweep.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ablate.events import EventReader
from launch.nvml import NvmlSampler

KILL_GRACE_S = 10.0  # SIGTERM first, so torchrun can stop its ranks; SIGKILL after this


@dataclass
class Outcome:
    status: str  # ok | oom | invalid | error | timeout
    reason: str | None
    metrics: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_log_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def classify(returncode: int, timed_out: bool, timeout_s: float, events: list[dict], log: Path) -> Outcome:
    """Status and reason from how the worker ended and what it reported before."""
    if timed_out:
        return Outcome("timeout", f"worker still running after timeout_s={timeout_s:g} s; killed")
    final = next((e for e in reversed(events) if e["event"] in ("result", "failure")), None)
    if final and final["event"] == "result" and returncode == 0:
        return Outcome("ok", None, final["metrics"], final["env"])
    if final and final["event"] == "failure":
        return Outcome(final["status"], final["reason"])
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the host's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
        return Outcome("error", f"worker killed by {name}{hint} without a result")
    return Outcome("error", f"worker exited with code {returncode} without a result: {_last_log_line(log)}")


def run_worker(cmd: list[str], run_dir: Path, timeout_s: float,
               on_event: Callable[[dict], None] = lambda e: None) -> Outcome:
    """Start `cmd`, follow its events, sample NVML, enforce the time limit; never raises for the
    worker's own failures."""
    log = run_dir / "worker.log"
    reader, events, timed_out = EventReader(run_dir), [], False
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    with NvmlSampler(proc.pid) as sampler:

        def follow() -> None:
            for event in reader.read_new():
                events.append(event)
                if event["event"] == "phase":
                    sampler.measuring = event["phase"] == "measure"
                on_event(event)

        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                follow()
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # a timeout, or Ctrl-C in the job: take the whole process group down
            if proc.poll() is None:
                _kill_group(proc)
        follow()
    outcome = classify(proc.returncode, timed_out, timeout_s, events, log)
    nvml = sampler.fields()
    outcome.env["driver"] = nvml.pop("driver")
    outcome.metrics.update(nvml)
    return outcome
