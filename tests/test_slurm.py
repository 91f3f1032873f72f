"""Sweeps on a real one-node SLURM (scripts/slurm/start.sh): every grid point is one array task.

The module starts the cluster (installing SLURM with apt-get the first time) and stops it at the end
if it started it. Without accounting, submitit sees a job's state only through scripts/slurm/bin/sacct,
so these tests run with that directory first on PATH, as a user would after `eval "$(start.sh)"`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import FAST, ROOT, results_under, run_cli, run_report

SCRIPTS = ROOT / "scripts" / "slurm"
SLURM_DIR = Path(os.environ.get("ABLATE_SLURM_DIR", "/tmp/ablate-slurm"))
ENV = {"SLURM_CONF": str(SLURM_DIR / "slurm.conf"), "PATH": f"{SCRIPTS / 'bin'}{os.pathsep}{os.environ['PATH']}"}
SWEEP = ["-m", "hydra/launcher=slurm"]


def _slurm(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=30)


def _cluster_up() -> bool:
    """start.sh's cluster answers (asked only when its slurmctld runs: sinfo waits ~10 s for a dead one)."""
    try:
        if not psutil.pid_exists(int((SLURM_DIR / "slurmctld.pid").read_text())):
            return False
        return _slurm("sinfo", "-h", "-o", "%t").stdout.strip().startswith(("idle", "mix", "alloc", "comp"))
    except (OSError, ValueError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="module")
def cluster():
    was_up = _cluster_up()
    if not was_up and shutil.which("apt-get") is None:
        pytest.skip("no apt-get to install SLURM with: start a cluster yourself (scripts/slurm/README.md)")
    if not was_up and os.geteuid() != 0:
        pytest.skip("starting SLURM needs root: run `sudo scripts/slurm/start.sh` first")
    start = subprocess.run([SCRIPTS / "start.sh"], capture_output=True, text=True, timeout=900)
    if start.returncode != 0:  # leave no half-started daemon behind
        subprocess.run([SCRIPTS / "stop.sh"], capture_output=True, timeout=120)
        pytest.fail(f"scripts/slurm/start.sh failed:\n{start.stderr}")
    assert f"export PATH={SCRIPTS / 'bin'}:$PATH" in start.stdout  # what a user must export
    yield was_up
    if not was_up:  # a cluster someone else started stays up
        stop = subprocess.run([SCRIPTS / "stop.sh"], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr


def _by_optimizer(path: Path) -> dict[str, dict]:
    return {r["choices"]["optimizer"]: r for r in results_under(path)}


def _array_task(result: dict) -> tuple[str, int]:
    """(array job id, task id) from env.slurm_job_id, which the job reads from SLURM's environment."""
    match = re.fullmatch(r"(\d+)_(\d+)", result["env"]["slurm_job_id"] or "")
    assert match, result["env"]["slurm_job_id"]
    return match[1], int(match[2])


@pytest.mark.slow  # starts a SLURM cluster (30 s)
def test_each_point_is_one_array_task_and_the_report_reads_them(cluster, tmp_path):
    proc = run_cli([*SWEEP, "optimizer=adamw,sgd", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, env=ENV,
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = _by_optimizer(tmp_path / "s")
    assert set(rows) == {"adamw", "sgd"} and all(r["status"] == "ok" for r in rows.values())
    tasks = sorted(_array_task(r) for r in rows.values())
    assert [t for _, t in tasks] == [0, 1] and tasks[0][0] == tasks[1][0]  # one array job, two tasks
    assert (tmp_path / "s" / ".submitit" / f"{tasks[0][0]}_0").is_dir()  # submitit's logs in the sweep dir
    report = run_report([str(tmp_path / "s")], timeout=120)
    assert report.returncode == 0, report.stderr
    table = [ln for ln in report.stdout.splitlines() if ln.startswith(("| adamw", "| sgd"))]
    assert len(table) == 2 and all(ln.rstrip().endswith("| ok       |") for ln in table)


@pytest.mark.slow
def test_a_killed_worker_is_an_error_row_and_the_sweep_returns(cluster, tmp_path):
    # ABLATE_FAULT reaches the worker through sbatch, which exports the submitting environment.
    proc = run_cli([*SWEEP, "optimizer=adamw,adafactor,sgd", f"hydra.sweep.dir={tmp_path}/s"], tmp_path,
                   env={**ENV, "ABLATE_FAULT": "kill:optimizer=sgd"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = _by_optimizer(tmp_path / "s")
    assert set(rows) == {"adamw", "adafactor", "sgd"}
    assert rows["sgd"]["status"] == "error" and "SIGKILL" in rows["sgd"]["reason"]
    assert rows["adamw"]["status"] == rows["adafactor"]["status"] == "ok"
    assert sorted(_array_task(r)[1] for r in rows.values()) == [0, 1, 2]


@pytest.mark.slow
def test_a_job_killed_outside_python_still_gets_its_row(cluster, tmp_path):
    """The job process itself dies (as under the host's OOM killer) and writes no result. submitit
    learns that the job ended only from sacct (without one that answers it would wait forever);
    launch/slurm.py then writes the point's error row and the sweep finishes."""
    sweep = tmp_path / "s"
    cmd = [sys.executable, "-m", "ablate", *SWEEP, "optimizer=adamw,sgd", f"hydra.sweep.dir={sweep}",
           f"out_dir={tmp_path}", *FAST]
    env = {**os.environ, **ENV, "ABLATE_FAULT": "hang:optimizer=sgd"}
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = _wait_for_worker(f"{sweep}/", "optimizer=sgd", timeout=120)
        job = worker.parent()
        assert "submitit.core._submit" in " ".join(job.cmdline())
        job.kill()
        assert _wait_until(lambda: not worker.is_running(), timeout=10)  # it dies with its job
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-2000:]
    rows = _by_optimizer(sweep)
    assert rows["adamw"]["status"] == "ok"
    # The state sacct gave is in the row: FAILED. Without it submitit says UNKNOWN and never returns.
    assert rows["sgd"]["status"] == "error" and re.search(r"SLURM job \d+_\d+ ended FAILED", rows["sgd"]["reason"])
    assert _wait_until(lambda: _slurm("squeue", "-h").stdout.strip() == "", timeout=30)  # the array job is over


def _wait_for_worker(*parts: str, timeout: float) -> psutil.Process:
    """The worker process whose command line contains every one of `parts`, once it is running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if "ablate.worker" in line and all(part in line for part in parts):
                return p
        time.sleep(0.1)
    raise AssertionError(f"no worker with {parts} within {timeout} s")


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.slow
def test_a_cluster_started_again_after_its_daemons_died_drops_the_jobs_it_lost(cluster):
    """The daemons and a running job die together (a killed session, a rebooted machine) and the state
    directory stays. start.sh brings the cluster back without that job: recovered as running, it
    would hold the only node until slurmctld gave up on it, minutes later, and new jobs would wait."""
    if cluster:  # was up before this module: someone's own, whose daemons and jobs are not ours to kill
        pytest.skip("kills the cluster's daemons: runs only on a cluster this module started")
    job = _slurm("sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 600").stdout.strip()
    assert _wait_until(lambda: _slurm("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING", 30)
    daemons = [p for p in psutil.process_iter(["name"]) if p.info["name"] in ("slurmctld", "slurmd", "slurmstepd")]
    for p in [*daemons, *(c for p in daemons for c in p.children(recursive=True))]:
        p.kill()
    start = subprocess.run([SCRIPTS / "start.sh"], capture_output=True, text=True, timeout=300)
    assert start.returncode == 0, start.stderr
    after = _slurm("sbatch", "--parsable", "--output=/dev/null", "--wait", "--wrap", "true")  # 30 s at most
    assert after.returncode == 0, after.stderr
    assert f"cancelling jobs left from the cluster that stopped: {job}" in start.stderr
