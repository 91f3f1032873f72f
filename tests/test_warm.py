"""A point's worker started ahead of its launch (launch/warm.py): the launch takes the process
that imported while the job worked, its output stays in the run's worker.log, and a launch it does
not fit starts a fresh process as before, the warm one killed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ablate.console import Progress
from launch import local, warm
from tests.helpers import FAST, ROOT, compose_spec

# A stand-in worker: prints while it "imports", then, once told to go, the arguments it runs with.
STAND_IN = [sys.executable, "-c", "import sys; print('imported', flush=True); from launch import warm; "
                                  "print('running', warm.arguments(sys.argv[1:]))"]


@pytest.fixture(autouse=True)
def no_warm_worker_left():
    yield
    warm.drop()


def test_the_launch_takes_the_prestarted_process_and_its_output_stays_in_worker_log(tmp_path):
    env, log = local.worker_env({}), tmp_path / "run" / local.LOG
    cmd = [*STAND_IN, "spec.json"]
    warm.prestart(cmd, env, log)
    waiting = warm._waiting.proc
    assert warm.take(cmd, env) is waiting and waiting.wait(timeout=60) == 0
    assert log.read_text() == "imported\nrunning ['spec.json']\n"  # its arguments, less --wait
    assert warm._waiting is None


@pytest.mark.parametrize("change", ["command", "environment", "died"])
def test_a_launch_it_does_not_fit_gets_a_fresh_process_and_the_warm_one_goes(tmp_path, change):
    env, cmd = local.worker_env({}), [*STAND_IN, "spec.json"]
    warm.prestart(cmd if change != "died" else [sys.executable, "-c", "import sys; sys.exit(3)"], env,
                  tmp_path / local.LOG)
    waiting = warm._waiting.proc
    if change == "died":
        waiting.wait(timeout=60)
    launch = [*STAND_IN, "probe/spec.json"] if change == "command" else cmd
    assert warm.take(launch, {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
                     if change == "environment" else env) is None
    assert waiting.poll() is not None and warm._waiting is None


def test_a_dropped_warm_worker_exits_without_running_and_leaves_no_log(tmp_path):
    """A point that never launches (invalid, pruned) has no worker output, as before."""
    warm.prestart([*STAND_IN, "spec.json"], local.worker_env({}), tmp_path / local.LOG)
    waiting = warm._waiting.proc
    warm.drop()
    assert waiting.poll() is not None and not (tmp_path / local.LOG).exists()


def test_a_real_point_runs_in_its_prestarted_worker(tmp_path):
    """The job's own path: prestarted for the point, then launched: the worker that reports is the
    process started ahead (its pid), and the run is ok."""
    from ablate.outcome import launch

    spec, run_dir = compose_spec(FAST), tmp_path / "run"
    with local.prestarted(spec, run_dir / local.SPEC):
        pid = warm._waiting.proc.pid
        outcome = launch(spec, run_dir, [], Progress("warm", stream=open(os.devnull, "w")))
    assert outcome.status == "ok", outcome.reason
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["pid"] for e in events if e["event"] == "started"] == [pid]
    assert 0 <= outcome.phases["startup"]  # from the launch: what was left of its imports


def test_the_command_line_and_the_job_leave_torch_to_the_worker():
    """Nothing before the prestart imports torch: not the key check, not the job module (else its
    2 s on 2 cores would sit in front of the worker's start instead of beside it)."""
    code = ("import sys; from ablate.schema import unknown_key; assert unknown_key(['batch_size=2']) is None; "
            "import ablate.job, ablate.__main__; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
