"""The worker -> job channel: JSON lines appended to <run_dir>/events.jsonl.

A file rather than stdout so that it survives a crash (the job reads what was written before a
SIGKILL), and so that the worker's own stdout/stderr stay a plain log. Events:
  {"event": "phase", "phase": "init"|"train"|"measure"|"eval"}
  {"event": "progress", "step": k, "steps": N, "loss": float, "elapsed_s": float}
  {"event": "result", "metrics": {...}, "env": {...}}
  {"event": "failure", "status": "oom"|"invalid"|"error", "reason": str}   (from any rank)
  {"event": "started", "pid": int}   (from every rank: lets the job attribute NVML memory to ranks)
  {"event": "launcher", "failures": [{"rank": r, "exitcode": int}, ...]}   (torchrun's failed ranks)
Every event carries "rank".
"""
from __future__ import annotations

import json
import math
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


class EventWriter:
    """Rank 0 speaks for the group; every rank reports its own failure (with its rank), so the job
    can say which rank failed and how. One short line per write: O_APPEND keeps lines whole."""

    def __init__(self, run_dir: str | Path, rank: int = 0):
        self.rank = rank
        self._file = open(Path(run_dir) / EVENTS_FILE, "a", encoding="utf-8")

    def emit(self, event: str, **fields) -> None:
        if self.rank != 0 and event not in ("failure", "started"):
            return
        self._file.write(json.dumps(_clean({"event": event, "rank": self.rank, **fields})) + "\n")
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
