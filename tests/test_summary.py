"""launch/summary.py: the sweep's closing lines, from the result.json files below its directory."""
from __future__ import annotations

from ablate import results
from launch.summary import SHOWN, summary


def _write(root, name, status, reason=None):
    r = results.make(name, status, reason, {"optimizer": "adamw"}, {"batch_size": 4}, [])
    results.write_json(root / name / "result.json", r)


def test_counts_by_status_and_names_each_failed_point(tmp_path):
    _write(tmp_path, "a", "ok")
    _write(tmp_path, "b", "invalid", "optimizer.in_backward=true needs accumulation=none\nmore detail")
    _write(tmp_path, "c", "timeout")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "result.json").write_text("{ half-written")  # skipped, not fatal
    assert summary(tmp_path).splitlines() == [
        f"3 results under {tmp_path}: 1 ok, 1 invalid, 1 timeout",
        "  invalid: b: optimizer.in_backward=true needs accumulation=none",
        "  timeout: c: no reason given",
        f"report: python -m analysis.report {tmp_path}"]


def test_a_long_list_of_failures_is_cut_and_counted(tmp_path):
    for i in range(SHOWN + 3):
        _write(tmp_path, f"p{i:02d}", "oom", "CUDA out of memory")
    lines = summary(tmp_path).splitlines()
    assert len(lines) == 1 + SHOWN + 1 + 1 and lines[-2] == "  ... and 3 more failed points"


def test_an_empty_sweep_says_so(tmp_path):
    assert summary(tmp_path) == f"no result.json under {tmp_path}"
