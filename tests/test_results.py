"""ablate/results.py: a row with every key, the atomic JSON write and its file mode, stable run ids,
the index of finished results, and docs/results.md's field table for every key of the contract."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ablate import results


def test_make_fills_every_key_with_null():
    r = results.make("abc", "timeout", "slow", {}, {}, [])
    assert all(v is None for v in r["metrics"].values()) and all(v is None for v in r["env"].values())
    with pytest.raises(AssertionError):
        results.make("abc", "crashed", None, {}, {}, [])


def test_the_docs_explain_every_field_of_the_result_contract():
    """Users read result.json through docs/results.md's field table: a metric, env key or status
    added to the contract without a line there fails here."""
    page = (Path(__file__).parents[1] / "docs" / "results.md").read_text()
    section = page.split("## What each number means", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9_.]+)`", section))
    named |= {n.split(".", 1)[1] for n in named if n.count(".") == 1}  # `env.emulated_gpu_mib`
    named |= {n + suffix for n in named for suffix in ("_p10", "_p90")}  # "`iter_time_ms` (+ `_p10`, `_p90`)"
    missing = [k for k in (*results.METRIC_KEYS, *results.STATUSES, "emulated_gpu_mib") if k not in named]
    assert not missing, f"docs/results.md's 'What each number means' does not explain {missing}"


def test_write_json_is_atomic_and_rejects_nan(tmp_path):
    path = tmp_path / "result.json"
    results.write_json(path, {"a": 1})
    with pytest.raises(ValueError):
        results.write_json(path, {"a": float("nan")})
    assert json.loads(path.read_text()) == {"a": 1}  # the old file survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary left behind


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_result_is_as_readable_as_any_other_file_the_umask_allows(tmp_path, umask):
    """mkstemp makes 0600 files: a teammate's report on a shared directory could not read them."""
    old = os.umask(umask)
    try:
        results.write_json(tmp_path / "result.json", {"a": 1})
        (tmp_path / "other.txt").write_text("x")
    finally:
        os.umask(old)
    mode = (tmp_path / "result.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "other.txt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_run_id_is_stable_and_order_independent():
    assert results.run_id({"a": 1, "b": [1, 2]}) == results.run_id({"b": [1, 2], "a": 1})
    assert results.run_id({"a": 1}) != results.run_id({"a": 2})


def test_index_returns_only_terminal_existing_results(tmp_path):
    index = results.Index(tmp_path)
    for rid, status in (("ok1", "ok"), ("err1", "error"), ("oom1", "oom")):
        path = tmp_path / rid / "result.json"
        results.write_json(path, results.make(rid, status, None, {}, {"batch_size": 4, "seq_len": 16}, []))
        index.record(rid, path)
    assert index.terminal("ok1")[1]["status"] == "ok" and index.terminal("oom1")
    assert index.terminal("err1") is None  # errors may be transient: run again
    assert index.terminal("missing") is None
    (tmp_path / "ok1" / "result.json").unlink()
    assert index.terminal("ok1") is None
