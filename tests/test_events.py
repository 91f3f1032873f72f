"""ablate/events.py: the events file a worker writes and its job reads, whole lines only."""
from __future__ import annotations

import time

import pytest

from ablate.events import EventReader, EventWriter


def test_event_reader_waits_for_complete_lines(tmp_path):
    writer, reader = EventWriter(tmp_path), EventReader(tmp_path)
    writer.emit("phase", phase="init", x=float("inf"))
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "prog')
    (event,) = reader.read_new()
    assert event.pop("t") == pytest.approx(time.time(), abs=60)  # when it was written: timing.phases_s
    assert event == {"event": "phase", "rank": 0, "phase": "init", "x": None}
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('ress"}\n')
    assert reader.read_new() == [{"event": "progress"}]
