"""How a worker ended, as a row's status and reason: from its exit code or signal, the events its
ranks wrote (a result, a rank's own OOM, a lost node) and the last lines of its log."""
from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Outcome:
    status: str  # one of ablate.results.STATUSES
    reason: str | None
    metrics: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    stopped_by: int | None = None  # a stop signal the job received while the worker ran (deferred)
    phases: dict = field(default_factory=dict)  # seconds per phase of the worker (events.PHASES)


def _hung_at(log: Path) -> str:
    """Where the log's last stack dump (faulthandler's format, innermost frame first) had its
    thread: ` at <file>:<line> in <function>`, with the innermost frame of ablate's own code after
    it (`, from ...`) when the innermost is in a library. Empty without a dump."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Current thread ")]
    if not starts:
        return ""
    frames = []
    for ln in lines[starts[-1] + 1:]:
        m = re.match(r'\s+File "(.+)", line (\d+) in (.+)', ln)
        if not m:
            break
        frames.append((m[1], m[2], m[3]))
    if not frames:
        return ""

    def where(frame: tuple[str, str, str]) -> str:
        path = Path(frame[0])
        short = "/".join(path.parts[-2:]) if len(path.parts) > 1 else frame[0]
        return f"{short}:{frame[1]} in {frame[2]}"

    ours = next((f for f in frames if f"{os.sep}ablate{os.sep}" in f[0] or f"{os.sep}launch{os.sep}" in f[0]), None)
    text = f" at {where(frames[0])}"
    return text + (f", from {where(ours)}" if ours and ours != frames[0] else "")


def _without_a_result(log: Path) -> str:
    """"without a result", with the log's last line (the likeliest cause of a silent exit) if any."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"without a result: {lines[-1].strip()[:300]}" if lines else "without a result"


def _signal_name(code: int) -> str:
    return signal.Signals(-code).name if code < 0 else f"exit code {code}"


def _killed_by(code: int) -> str:
    name = _signal_name(code)
    hint = " (the host's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


def _lost_ranks(events: list[dict], failures: list[dict]) -> str | None:
    """"node N lost: ranks r, s stopped without a word", for ranks that started on a node whose
    launcher never reported, and said nothing themselves: the node is gone (or its torchrun and ranks
    were killed together). Only their peers' broken connections tell, and those name an address, not
    a rank. None where every node's launcher, or every rank, spoke."""
    started = {e["rank"]: e.get("host") for e in events if e["event"] == "started"}
    launchers = {e.get("host") for e in events if e["event"] == "launcher"}
    spoke = {e["rank"] for e in failures}
    silent = sorted(r for r, host in started.items() if host not in launchers and r not in spoke)
    if not silent:
        return None
    hosts = ", ".join(sorted({started[r] or "?" for r in silent}))
    return f"node {hosts} lost: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped without a word"


def worker_outcome(returncode: int, timed_out: bool, timeout_s: float, events: list[dict], log: Path,
             world_size: int = 1) -> Outcome:
    """Status and reason from how the worker (or torchrun's group) ended and what it reported."""
    if timed_out:
        return Outcome("timeout", f"worker still running after timeout_s={timeout_s:g} s; killed{_hung_at(log)} "
                                  f"(every thread's stack: {log.name})")
    result = next((e for e in events if e["event"] == "result"), None)
    if result and returncode == 0:  # a run whose loss went non-finite measured all but its losses
        diverged = result.get("diverged")
        return Outcome("diverged" if diverged else "ok", diverged, result["metrics"], result["env"])
    failures = [e for e in events if e["event"] == "failure"]
    named = (lambda e: f"rank {e['rank']}: {e['reason']}") if world_size > 1 else (lambda e: e["reason"])
    # A rank's own OOM or invalid report is the root cause; the others then fail on its absence.
    for e in failures:
        if e["status"] in ("oom", "invalid"):
            return Outcome(e["status"], named(e))
    # A rank killed by a signal reports nothing itself, and its peers then fail on the broken
    # connection: the launcher's list of failed ranks names the one that died silently.
    died = [f for e in events if e["event"] == "launcher" for f in e["failures"]]  # one launcher per node
    lost = _lost_ranks(events, failures)
    if lost and failures:
        return Outcome("error", f"{lost}; {named(failures[0])}")
    silent = [f for f in died if f["exitcode"] < 0 and f["rank"] not in {e["rank"] for e in failures}]
    silent.sort(key=lambda f: f["exitcode"] == -signal.SIGTERM)  # torchrun SIGTERMs the survivors
    if silent:
        return Outcome("error", f"rank {silent[0]['rank']} {_killed_by(silent[0]['exitcode'])}")
    if failures:
        return Outcome(failures[0]["status"], named(failures[0]))
    if died:
        return Outcome("error", f"rank {died[0]['rank']} ended with {_signal_name(died[0]['exitcode'])} "
                                f"{_without_a_result(log)}")
    if returncode < 0:
        return Outcome("error", f"worker {_killed_by(returncode)} without a result")
    return Outcome("error", f"worker exited with code {returncode} {_without_a_result(log)}")
