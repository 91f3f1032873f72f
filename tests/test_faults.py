"""Fault injection through the real CLI: every failure becomes a row, and the sweep goes on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import FAST, ROOT, results_under, run_cli, started_pids


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
    # The sweep's last lines say what failed and how to report it.
    last = proc.stdout.splitlines()[-3:]
    assert last[0] == f"2 results under {tmp_path}/s: 1 ok, 1 oom"
    assert last[1].startswith("  oom: ") and "optimizer=sgd" in last[1] and "out of memory" in last[1]
    assert last[2] == f"report: python -m analysis.report {tmp_path}/s"


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
    assert proc.returncode == 1, proc.stderr  # a single run's timeout row, and a non-zero exit
    (row,) = results_under(tmp_path)
    assert row["status"] == "timeout" and "timeout_s=4" in row["reason"]
    # where it hung, from the stacks it wrote on SIGUSR1 before the kill
    assert "worker.py:" in row["reason"] and "in inject_fault" in row["reason"], row["reason"]
    assert row["timing"]["wall_s"] < 30
    assert started_pids(tmp_path) and not _workers_of(tmp_path)


def test_invalid_combination_is_a_row_and_runs_no_worker(tmp_path):
    """Its worker, started ahead while the job validates (launch/warm_start.py), is killed unused and
    leaves no log; no process of it remains."""
    proc = run_cli(["-m", "accumulation.steps=1,3", f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]["accumulation"]["steps"]: r for r in results_under(tmp_path / "s")}
    assert rows[3]["status"] == "invalid"
    assert rows[3]["reason"] == "batch_size=4 is not divisible by accumulation.steps=3"
    assert rows[1]["status"] == "ok"
    # the ok point's worker printed nothing (no empty log is kept); the invalid one's never ran
    assert not list((tmp_path / "s").rglob("worker.log"))
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


def _as_at_a_terminal() -> None:
    """In the job before exec: SIGINT at its default, as in a shell at a terminal. A suite run
    from a background shell (`make test &`, a CI runner) hands its children SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler: the Ctrl-C test would wait on a job that
    never heard it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def hung_job(tmp_path):
    """start(*args, fault=...): a job whose worker hangs in training; whatever a failing test leaves
    running is killed at teardown (its worker follows: PR_SET_PDEATHSIG)."""
    jobs = []

    def start(*args: str, fault: str = "hang") -> subprocess.Popen:
        # PYTHONFAULTHANDLER: a job that does not end is sent SIGABRT and prints every thread's stack
        env = {**os.environ, "ABLATE_FAULT": fault, "PYTHONFAULTHANDLER": "1"}
        jobs.append(subprocess.Popen([sys.executable, "-m", "ablate", *args, f"out_dir={tmp_path}", *FAST],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_as_at_a_terminal))
        deadline = time.monotonic() + 60
        while not any('"train"' in p.read_text() for p in tmp_path.rglob("events.jsonl")):
            assert time.monotonic() < deadline and jobs[-1].poll() is None
            time.sleep(0.2)
        return jobs[-1]

    yield start
    for job in jobs:
        if job.poll() is None:
            job.kill()


def _exit_status(job: subprocess.Popen, timeout: float = 60) -> int:
    """The job's exit status once it ends; if it has not within `timeout` s, an assertion error
    showing where each of its threads was (faulthandler's dump on SIGABRT) and what it printed."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.send_signal(signal.SIGABRT)
        raise AssertionError(f"the job was still running {timeout} s later:\n{job.communicate(timeout=30)[0][-6000:]}")


def _workers_of(tmp_path) -> list:
    """The live workers of the points under tmp_path, by the pids their events name (a worker
    started ahead has no point in its command line: launch/warm_start.py)."""
    return [p for p in map(_process, started_pids(tmp_path)) if p is not None]


def _process(pid: int):
    try:
        proc = psutil.Process(pid)
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def test_a_sweep_stopped_by_sigterm_writes_the_points_row_and_starts_no_other(tmp_path, hung_job):
    job = hung_job("-m", "optimizer=sgd,adamw", f"hydra.sweep.dir={tmp_path}/s",
                   fault="hang:optimizer=sgd")
    job.send_signal(signal.SIGTERM)  # what scancel or `timeout` sends
    assert _exit_status(job) == -signal.SIGTERM, job.stdout.read()  # ended by it, once the row was written
    (row,) = results_under(tmp_path / "s")  # adamw, the next point, never started
    assert row["choices"]["optimizer"] == "sgd"
    assert row["status"] == "error" and "received SIGTERM" in row["reason"]
    assert not _workers_of(tmp_path)


def test_sigusr2_is_a_timeout_row_and_a_find_batch_search_stops_at_it(tmp_path, hung_job):
    job = hung_job("batch_size=8", "find_batch=true")
    job.send_signal(signal.SIGUSR2)  # SLURM's warning before its time limit (submitit's setting)
    assert _exit_status(job) == -signal.SIGUSR2, job.stdout.read()
    (row,) = results_under(tmp_path)
    assert row["status"] == "timeout" and "received SIGUSR2" in row["reason"]
    assert len(row["metrics"]["find_batch"]) == 1  # the stopped probe, and no probe after it
    assert len(list(tmp_path.rglob("spec.json"))) == 1


def test_ctrl_c_stops_the_sweep_with_a_message_and_no_traceback(tmp_path, hung_job):
    job = hung_job("-m", "optimizer=sgd,adamw", f"hydra.sweep.dir={tmp_path}/s", fault="hang:optimizer=sgd")
    job.send_signal(signal.SIGINT)
    assert _exit_status(job) == -signal.SIGINT  # ended by it, as a calling shell loop needs to see
    output = job.stdout.read()
    assert "interrupted: finished points keep their rows" in output and "Traceback" not in output
    assert not results_under(tmp_path / "s")  # no row for the interrupted point, and no next point
    assert not _workers_of(tmp_path)


def test_a_sigkilled_job_takes_its_worker_along(tmp_path, hung_job):
    job = hung_job()
    job.kill()  # nothing can run in the job now: the kernel ends the worker (PR_SET_PDEATHSIG)
    job.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _workers_of(tmp_path):
        assert time.monotonic() < deadline, "the worker outlived its job"
        time.sleep(0.2)


@pytest.mark.slow
def test_alloc_conf_reaches_the_worker_and_an_exported_one_is_recorded(tmp_path, hung_job, monkeypatch):
    """alloc_conf is the worker's PYTORCH_CUDA_ALLOC_CONF (read by the caching allocator when CUDA
    starts, so it must be in the worker's environment from its start); left null, the one the
    job inherits is recorded in the row, and so in its run_id."""
    job = hung_job("alloc_conf=expandable_segments:True", "timeout_s=60")
    (worker,) = _workers_of(tmp_path)
    assert worker.environ()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    job.kill()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    proc = run_cli([], tmp_path / "exported")
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path / "exported")
    assert row["status"] == "ok" and row["config"]["alloc_conf"] == "max_split_size_mb:64"


def test_a_timeout_names_the_library_frame_and_ablates_own_below_it(tmp_path):
    """A worker stuck inside a library (a collective, a kernel wait): the row names that frame and
    the innermost frame of ablate's code that called it, from faulthandler's dump in the log."""
    from launch.worker_exit import _hung_at

    log = tmp_path / "worker.log"
    assert _hung_at(log) == ""  # no log
    log.write_text("step 1\n")
    assert _hung_at(log) == ""  # no dump
    log.write_text(
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.12/threading.py", line 359 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/site/torch/distributed/distributed_c10d.py", line 4200 in barrier\n'
        '  File "/repo/ablate/runner.py", line 180 in all_ranks\n'
        '  File "/repo/ablate/worker.py", line 76 in main\n')
    assert _hung_at(log) == " at distributed/distributed_c10d.py:4200 in barrier, from ablate/runner.py:180 in all_ranks"
