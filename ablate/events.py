"""The worker -> job channel: JSON lines appended to <run_dir>/events.jsonl.

A file rather than stdout so that it survives a crash (the job reads what was written before a
SIGKILL), and so that the worker's own stdout/stderr stay a plain log. Events:
  {"event": "phase", "phase": "init"|"train"|"trace"|"measure"|"eval"|"report"}
  {"event": "progress", "step": k, "steps": N, "loss": float|null, "elapsed_s": float}   (null: NaN or inf)
  {"event": "result", "metrics": {...}, "env": {...}, "diverged": str|null}   (null: the losses are finite)
  {"event": "failure", "status": "oom"|"invalid"|"error", "reason": str}   (from any rank)
  {"event": "started", "pid": int, "host": str}   (from every rank: lets the job attribute NVML
                                                   memory to ranks, and name a lost rank's node)
  {"event": "launcher", "host": str, "failures": [{"rank": r, "exitcode": int}, ...]}
                           (each node's failed ranks, in the order its launcher saw them end)
Every event carries "rank" and "t" (time.time() when it was written).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


def _clean(value):
    """JSON has no NaN/inf: a value that could not be measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


# Where a worker's wall time goes, between consecutive marks (result.json's timing.phases_s):
# the process start with its imports, setup (device, process group, data), building the model and
# optimizer, the warm-up steps, the traced step, the measured steps, eval, gathering and teardown.
PHASES = (("startup", "launched", "started"), ("setup", "started", "init"), ("build", "init", "train"),
          ("warmup", "train", "trace"), ("traced_step", "trace", "measure"), ("measured", "measure", "eval"),
          ("eval", "eval", "report"), ("teardown", "report", "ended"))


def phase_seconds(events: list[dict], launched: float, ended: float) -> dict:
    """{phase: seconds} from rank 0's events and the job's clock around the worker (time.time());
    a phase whose marks the worker never reached (it failed first) is left out."""
    marks = {"launched": launched, "ended": ended}
    for e in events:
        if e.get("rank", 0) == 0 and "t" in e:
            mark = e["phase"] if e["event"] == "phase" else e["event"]
            marks.setdefault(mark, e["t"])
    return {name: round(marks[end] - marks[start], 3) for name, start, end in PHASES
            if start in marks and end in marks}


class EventWriter:
    """Rank 0 speaks for the group; every rank reports its own failure (with its rank), so the job
    can say which rank failed and how. One short line per write: O_APPEND keeps lines whole."""

    def __init__(self, run_dir: str | Path, rank: int = 0):
        self.rank = rank
        self._file = open(Path(run_dir) / EVENTS_FILE, "a", encoding="utf-8")

    def emit(self, event: str, **fields) -> None:
        if self.rank != 0 and event not in ("failure", "started"):
            return
        # t: wall-clock seconds (time.time), comparable with the job's clock: timing.phases_s
        self._file.write(json.dumps(_clean({"event": event, "rank": self.rank, "t": time.time(), **fields})) + "\n")
        self._file.flush()


class EventReader:
    """Reads only complete lines, remembering where it stopped; safe while the writer appends."""

    def __init__(self, run_dir: str | Path):
        self._path = Path(run_dir) / EVENTS_FILE
        self._offset = 0

    def read_new(self) -> list[dict]:
        if not self._path.exists():
            return []
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a partly written last line waits for the next read
        self._offset += end
        events = []
        for line in chunk[:end].splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write carries nothing we can trust
        return events
