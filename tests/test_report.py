"""analysis.report: every result.json below a path -> one Markdown table and a CSV."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd

from ablate import results
from analysis.load import load
from analysis.report import main, render
from helpers import ROOT


def _write(path, run_id, status, optimizer, peak=None, finished="2026-01-01T00:00:00", reason=None):
    metrics = {"peak_allocated_mib": peak, "iter_time_ms": 12.5 if peak else None,
               "tokens_per_s": 1234.0 if peak else None, "loss_final": 3.25 if peak else None}
    choices = {"model": "gpt-nano", "optimizer": optimizer}
    r = results.make(run_id, status, reason, choices, {"batch_size": 8}, [], metrics=metrics,
                     timing={"started_at": None, "finished_at": finished, "wall_s": 1.0})
    results.write_json(path / run_id / "result.json", r)


def test_report_shows_failures_and_varied_groups_only(tmp_path, capsys):
    _write(tmp_path, "a", "ok", "adamw", peak=100.0)
    _write(tmp_path, "b", "oom", "sgd", reason="CUDA out of memory")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].split("|")[1].strip() == "optimizer"  # the only varied group leads
    assert "model" not in lines[0]  # not varied: not a column
    adamw, sgd = lines[2], lines[3]
    assert "100.0" in adamw and "12.5" in adamw and "1,234" in adamw and "3.2500" in adamw
    assert "OOM" in sgd and "oom: CUDA out of memory" in sgd
    csv = pd.read_csv(tmp_path / "report" / "runs.csv")
    assert sorted(csv["run_id"]) == ["a", "b"] and "peak_allocated_mib" in csv
    assert (tmp_path / "report" / "report.md").read_text().startswith("| optimizer")


def test_bad_files_are_named_and_skipped(tmp_path, capsys):
    _write(tmp_path, "a", "ok", "adamw", peak=100.0)
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "result.json").write_text('{"schema": "ablate.res')
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "result.json").write_text('{"hello": 1}')
    df = load([tmp_path])
    err = capsys.readouterr().err
    assert list(df["run_id"]) == ["a"]
    assert "trunc/result.json" in err and "foreign/result.json" in err


def test_duplicate_run_ids_keep_the_newest(tmp_path):
    _write(tmp_path / "old", "a", "ok", "adamw", peak=100.0, finished="2026-01-01T00:00:00")
    _write(tmp_path / "new", "a", "ok", "adamw", peak=200.0, finished="2026-02-01T00:00:00")
    df = load([tmp_path])
    assert len(df) == 1 and df["peak_allocated_mib"].iloc[0] == 200.0
    assert "200.0" in render(df)


def test_empty_directory_exits_1_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "no result.json found" in proc.stderr
