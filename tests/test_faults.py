"""Fault injection through the real CLI: every failure becomes a row, and the sweep goes on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from helpers import FAST, ROOT, results_under, run_cli


def _by_optimizer(path):
    return {r["choices"]["optimizer"]: r for r in results_under(path)}


def test_simulated_oom_is_a_row_and_the_sweep_continues(tmp_path):
    proc = run_cli(["-m", "optimizer=sgd,adamw", f"hydra.sweep.dir={tmp_path}/s"], tmp_path,
                   env={"ABLATE_FAULT": "oom:optimizer=sgd"})
    assert proc.returncode == 0, proc.stderr
    rows = _by_optimizer(tmp_path / "s")
    assert rows["sgd"]["status"] == "oom" and "out of memory" in rows["sgd"]["reason"]
    assert rows["sgd"]["metrics"]["iter_time_ms"] is None  # never measured: null, not 0
    assert rows["adamw"]["status"] == "ok"  # the point after the OOM still ran


def test_sigkilled_worker_gives_an_error_row(tmp_path):
    proc = run_cli(["-m", "optimizer=sgd,adamw", f"hydra.sweep.dir={tmp_path}/s"], tmp_path,
                   env={"ABLATE_FAULT": "kill:optimizer=sgd"})
    assert proc.returncode == 0, proc.stderr
    rows = _by_optimizer(tmp_path / "s")
    assert rows["sgd"]["status"] == "error" and "SIGKILL" in rows["sgd"]["reason"]
    assert rows["adamw"]["status"] == "ok"


def test_crash_gives_an_error_row_with_the_exception(tmp_path):
    run_cli(["optimizer=sgd"], tmp_path, env={"ABLATE_FAULT": "error"})
    (row,) = results_under(tmp_path)
    assert row["status"] == "error" and row["reason"] == "RuntimeError: injected by ABLATE_FAULT"
    assert "Traceback" in next(tmp_path.rglob("worker.log")).read_text()


def test_hung_worker_times_out_and_leaves_no_process(tmp_path):
    proc = run_cli(["timeout_s=4"], tmp_path, env={"ABLATE_FAULT": "hang"})
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path)
    assert row["status"] == "timeout" and "timeout_s=4" in row["reason"]
    assert row["timing"]["wall_s"] < 30
    spec = str(next(tmp_path.rglob("spec.json")))
    assert not [p for p in psutil.process_iter(["cmdline"]) if spec in (p.info["cmdline"] or [])]


def test_invalid_combination_is_a_row_and_starts_no_worker(tmp_path):
    proc = run_cli(["-m", "accumulation.steps=1,3", f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]["accumulation"]["steps"]: r for r in results_under(tmp_path / "s")}
    assert rows[3]["status"] == "invalid"
    assert rows[3]["reason"] == "batch_size=4 is not divisible by accumulation.steps=3"
    assert rows[1]["status"] == "ok"
    assert len(list((tmp_path / "s").rglob("worker.log"))) == 1


def _job_with_a_hung_worker(tmp_path) -> subprocess.Popen:
    env = {**os.environ, "ABLATE_FAULT": "hang"}
    job = subprocess.Popen([sys.executable, "-m", "ablate", f"out_dir={tmp_path}", *FAST], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not any('"train"' in p.read_text() for p in tmp_path.rglob("events.jsonl")):
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.2)
    return job


def _workers_of(tmp_path) -> list:
    spec = str(next(tmp_path.rglob("spec.json")))
    return [p for p in psutil.process_iter(["cmdline"]) if spec in (p.info["cmdline"] or [])]


def test_a_job_stopped_by_sigterm_still_writes_its_row(tmp_path):
    job = _job_with_a_hung_worker(tmp_path)
    job.send_signal(signal.SIGTERM)  # what scancel sends
    assert job.wait(timeout=60) == 0
    (row,) = results_under(tmp_path)
    assert row["status"] == "error" and "received SIGTERM" in row["reason"]
    assert not _workers_of(tmp_path)


def test_a_sigkilled_job_takes_its_worker_along(tmp_path):
    job = _job_with_a_hung_worker(tmp_path)
    job.kill()  # nothing can run in the job now: the kernel ends the worker (PR_SET_PDEATHSIG)
    job.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _workers_of(tmp_path):
        assert time.monotonic() < deadline, "the worker outlived its job"
        time.sleep(0.2)
