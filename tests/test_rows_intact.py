"""No fault and no input loses or corrupts a row: a result.json that parses but lacks fields, an
invalid row mended and rerun, two sweeps into one directory (the claim), a full disk, an unknown
experiment or a config that cannot mean what it says, and errors that name what is wrong.

Through the real CLI where the CLI's path decides (a rerun, two sweeps at once, a full disk), in
process where a function decides (the validator, the config checks, the report)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ablate import results
from ablate.build import check_config
from ablate.command_line import unknown_key
from ablate.techniques import Invalid
from analysis.report import main as report
from helpers import FAST, ROOT, compose_spec, results_under, run_cli


def _result_file(sweep) -> tuple:
    (path,) = sorted(sweep.rglob("result.json"))
    return path, json.loads(path.read_text())


# 1. A result.json that parses but lacks fields.

@pytest.mark.parametrize("damage, why", [
    (lambda r: {"schema": r["schema"], "run_id": r["run_id"], "status": "ok"}, "missing choices, config"),
    (lambda r: {**r, "metrics": None}, "metrics is a NoneType, not a dict"),
    (lambda r: {**r, "status": "done"}, "status 'done' is not one of"),
    (lambda r: {**r, "config": {**r["config"], "batch_size": None}}, "config.batch_size missing or not a whole number"),
    (lambda r: {**r, "metrics": {**r["metrics"], "peak_allocated_mib": "big"}}, "metrics.peak_allocated_mib is 'big'"),
    (lambda r: {**r, "schema": "ablate.result/0"}, "schema is 'ablate.result/0'"),
    (lambda r: [r], "not a JSON object"),
])
def test_the_validator_names_what_a_result_lacks(damage, why):
    good = results.make("abc", "ok", None, {"optimizer": "adamw"}, {"batch_size": 4}, [],
                        metrics={"peak_allocated_mib": 10.0, "losses": [3.0], "breakdown_mib": {"params": 1.0},
                                 "per_rank": [{"rank": 0}], "find_batch": [{"micro_batch": 8, "fits": True}],
                                 "max_batch_size": 8})
    assert results.problem(good) is None
    assert why in results.problem(damage(good))


def test_a_result_missing_fields_is_named_rerun_and_left_out_of_the_report(tmp_path, capsys):
    sweep = tmp_path / "s"
    assert run_cli(["-m", "seed=1", f"hydra.sweep.dir={sweep}"], tmp_path).returncode == 0
    path, good = _result_file(sweep)
    path.write_text(json.dumps({"schema": results.SCHEMA, "run_id": good["run_id"], "status": "ok"}))
    # The report: the file is named with its reason and skipped, beside a good one (was: KeyError,
    # or "cannot convert float NaN to integer").
    other = tmp_path / "other" / "result.json"
    results.write_json(other, good)
    assert report([str(path), str(other), "--out", str(tmp_path / "report")]) == 0
    err = capsys.readouterr().err
    assert f"skipping {path}: not a result (missing choices, config" in err
    assert report([str(path), "--out", str(tmp_path / "report")]) == 1  # alone: nothing to report
    # The sweep: not counted as done; the point runs again (was: KeyError: 'metrics', no summary).
    again = run_cli(["-m", "seed=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{path} is not a result (missing choices" in again.stdout and "running its point again" in again.stdout
    assert "[     ok]" in again.stdout and "1 results under" not in again.stdout
    assert results.problem(_result_file(sweep)[1]) is None


@pytest.mark.slow
def test_what_made_a_row_invalid_or_an_input_file_can_be_mended_and_the_rerun_runs(tmp_path):
    """An `invalid` row is checked again (a bad timeout_s, outside the run_id, then a good one),
    and an edited input file is a new point, not the old file's row skipped as done."""
    bad = run_cli(["timeout_s=0"], tmp_path)
    assert "[invalid]" in bad.stdout and "timeout_s=0.0 must be > 0" in bad.stdout
    good = run_cli(["timeout_s=300"], tmp_path)
    assert good.returncode == 0 and "[     ok]" in good.stdout, good.stdout  # was: [   skip] ... invalid
    text = tmp_path / "input.txt"
    text.write_text("abcdefgh " * 200)
    chars = ["data=chars", f"data.path={text}", "data.eval_samples=8", "model=gpt-nano", "batch_size=4",
             "seq_len=16", "steps=3", "warmup_steps=2", "device=cpu"]
    first, same = (run_cli(chars, tmp_path, fast=False).stdout for _ in range(2))
    assert "[     ok]" in first and "[   skip]" in same and "skip_existing=false runs it again" in same
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    edited = run_cli(chars, tmp_path, fast=False).stdout
    assert "[     ok]" in edited and "[   skip]" not in edited, edited  # was: the old file's row, skipped


# 2. Two sweeps into one directory.

@pytest.mark.slow  # two sweeps: 11 s
def test_two_sweeps_into_one_directory_run_each_point_once(tmp_path):
    sweep = tmp_path / "s"
    cmd = [sys.executable, "-m", "ablate", "-m", "seed=1,2", f"hydra.sweep.dir={sweep}", f"out_dir={tmp_path}", *FAST]
    env = {k: v for k, v in os.environ.items() if k != "ABLATE_FAULT"}
    both = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    rows = results_under(sweep)
    assert sorted(r["config"]["seed"] for r in rows) == [1, 2] and {r["status"] for r in rows} == {"ok"}
    for events in sweep.rglob("events.jsonl"):  # one worker per point (was: two, timing each other's load)
        started = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "started"]
        assert len(started) == 1, events
    # Each point was run by one sweep and skipped by the other.
    assert sum(out.count("[     ok]") for out in outs) == 2 and sum(out.count("[   skip]") for out in outs) == 2


def test_a_claimed_point_waits_for_its_holder_and_says_who(tmp_path):
    from ablate.point_claim import claimed

    lock = tmp_path / "index" / "abc.claim"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from ablate.point_claim import claimed
        with claimed(Path({str(lock)!r}), print):
            print("held", flush=True)
            sys.stdin.readline()
        """)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    heard, got = [], threading.Event()

    def wait_for_it():
        with claimed(lock, heard.append):
            got.set()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    assert not got.wait(timeout=2)  # held: the waiter waits, having said for whom
    assert heard and heard[0].startswith(f"waiting: this point is being run by pid {holder.pid} on ")
    holder.stdin.close()  # the holder lets go; the waiter gets the claim then
    assert holder.wait(timeout=30) == 0
    waiter.join(timeout=30)
    assert got.is_set()


def test_a_dead_holders_claim_is_free(tmp_path):
    from ablate.point_claim import claimed

    lock = tmp_path / "abc.claim"
    code = f"import os; from pathlib import Path; from ablate.point_claim import claimed\n" \
           f"with claimed(Path({str(lock)!r}), print): os._exit(9)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 9
    heard = []
    with claimed(lock, heard.append):  # the kernel released it with the process: no wait
        pass
    assert heard == []


# 3. A full disk.

# Loaded by every Python process of the run (PYTHONPATH): the disk fills where the test says.
SITECUSTOMIZE = '''
import errno, os
if os.environ.get("TEST_ENOSPC") == "result":  # the row's rename fails after its temporary is written
    _replace = os.replace
    def replace(src, dst, *a, **k):
        if str(dst).endswith("result.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return _replace(src, dst, *a, **k)
    os.replace = replace
if os.environ.get("TEST_FREE_KIB"):  # the file system reports this much free
    import ablate.disk
    ablate.disk.free_kib = lambda path: float(os.environ["TEST_FREE_KIB"])
'''


def _full_disk_env(tmp_path, **env) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}


@pytest.mark.slow
def test_a_full_disk_stops_the_sweep_with_one_line_and_keeps_the_measurement(tmp_path):
    sweep = tmp_path / "s"
    proc = run_cli(["-m", "seed=1,2", f"hydra.sweep.dir={sweep}"], tmp_path,
                   env=_full_disk_env(tmp_path, TEST_ENOSPC="result"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no space left on device writing ")
    assert "KiB free under" in proc.stderr
    kept = [ln for ln in proc.stdout.splitlines() if "not written: {" in ln]
    assert len(kept) == 1  # the sweep stopped at its first point: seed=2 never started
    assert json.loads(kept[0].split("not written: ", 1)[1])["metrics"]["peak_allocated_mib"] > 0
    assert not list(sweep.rglob("result.json")) and not list(sweep.rglob("*.tmp"))  # nothing half-written
    assert len(list(sweep.glob("*seed=*"))) == 1
    assert not [p for p in (tmp_path / "index").iterdir() if not p.name.endswith(".claim")]  # not marked done
    again = run_cli(["-m", "seed=1,2", f"hydra.sweep.dir={sweep}"], tmp_path)  # space again: it runs
    assert again.returncode == 0 and [r["status"] for r in results_under(sweep)] == ["ok", "ok"]


@pytest.mark.parametrize("args", [["-m", "seed=1,2"], ["seed=1"]])
def test_no_room_before_hydras_first_write_is_one_line(tmp_path, args):
    proc = run_cli([*args, f"hydra.sweep.dir={tmp_path}/s", f"hydra.run.dir={tmp_path}/r"], tmp_path,
                   env=_full_disk_env(tmp_path, TEST_FREE_KIB="30"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: no room to start the {'sweep' if '-m' in args else 'run'}: 30 KiB free under "
        f"{tmp_path}/{'s' if '-m' in args else 'r'}. The sweep stops; free some space and run the same "
        "command again (finished points are skipped)."]
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()  # not even multirun.yaml


# 4. Silent wrong answers.

def test_an_unknown_experiment_is_an_error_naming_the_choices(tmp_path):
    assert unknown_key(["experiment=leanst"]).startswith(
        "unknown experiment 'leanst' (did you mean 'leanest'?). Valid experiment options: batch_scan, demo,")
    assert "unknown experiment 'nonexistent'." in unknown_key(["-m", "experiment=leanest,nonexistent"])
    proc = run_cli(["experiment=leanst"], tmp_path)
    assert proc.returncode == 1 and "did you mean 'leanest'?" in proc.stderr
    assert not list(tmp_path.rglob("result.json"))  # was: an ok row of the default config


def test_a_missing_experiment_fails_composition_too():
    """Behind the command-line check (a sweeper's params reach Hydra directly): not `optional`."""
    from hydra.errors import MissingConfigException

    from helpers import compose_config

    with pytest.raises(MissingConfigException, match="experiment/leanst"):
        compose_config(["experiment=leanst"])


@pytest.mark.parametrize("overrides, message", [
    (["warmup_steps=0"], "warmup_steps=0 must be >= 2"),  # was: an ok row with no peak
    (["warmup_steps=1"], "warmup_steps=1 must be >= 2"),  # was: a CPU peak without the optimizer state
    (["model.n_layer=0"], "model.n_layer=0 must be >= 1"),
    (["model.n_head=0"], "model.n_head=0 must be >= 1"),
    (["model.n_layer=999999999999"], "model.n_layer=999999999999 is more than 100,000 layers"),  # was: a stall
    (["model=smollm2-135m", "model.config.num_hidden_layers=200000"],
     "model.config.num_hidden_layers=200000 is more than 100,000 layers"),
    (["model=smollm2-135m", "model.config.num_hidden_layers=0"], "model.config.num_hidden_layers=0 must be >= 1"),
    (["model=smollm2-135m", "model.config.num_attention_heads=0"], "model.config.num_attention_heads=0 must be >= 1"),
])
def test_a_config_that_cannot_mean_what_it_says_is_invalid(overrides, message):
    with pytest.raises(Invalid, match=message):
        check_config(compose_spec(overrides))


# 5. Messages that name nothing.

def test_a_key_of_another_option_names_where_it_belongs():
    error = unknown_key(["optimizer.momentum=0.9"])  # Hydra's: "Key 'momentum' is not in struct"
    assert error.startswith("optimizer.momentum: not a key of optimizer=adamw (momentum is a key of optimizer=muon, "
                            "optimizer=sgd). Its keys: optimizer.betas, optimizer.implementation, ")
    assert unknown_key(["optimizer=sgd", "optimizer.momentum=0.9"]) is None
    # Following Hydra's advice (`+optimizer.momentum`) was a TypeError from AdamW.__init__.
    with pytest.raises(Invalid, match=r"optimizer.momentum is not a key of AdamW \(momentum is a key of "
                                      r"optimizer=muon, optimizer=sgd\). Its keys: optimizer.lr, "):
        check_config(compose_spec(["+optimizer.momentum=0.9"]))


def test_report_errors_are_one_line(tmp_path, capsys):
    for seed in (1, 2):
        good = results.make(f"abc{seed}", "ok", None, {"optimizer": "adamw"}, {"batch_size": 4, "seed": seed}, [],
                            metrics={"peak_allocated_mib": 10.0})
        results.write_json(tmp_path / "runs" / f"s{seed}" / "result.json", good)
    assert report([str(tmp_path / "runs"), "--out", "/proc/forbidden"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cannot write the report to /proc/forbidden: ")
    assert report([str(tmp_path / "runs"), "--by", "seed", "seed", "--out", str(tmp_path / "r")]) == 0
    (header,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| seed ")]
    assert header.count("seed") == 1  # one seed column (was: a pandas traceback)
    # A result.json given as the path: the report goes beside it (was: NotADirectoryError).
    assert report([str(tmp_path / "runs" / "s1" / "result.json")]) == 0
    assert (tmp_path / "runs" / "s1" / "report" / "report.md").is_file()
