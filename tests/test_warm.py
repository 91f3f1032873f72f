"""Workers started ahead of their launch (launch/warm_start.py): the launch takes the process that
imported while the job, or the point before, worked; from the go its output is the run's
worker.log; a launch it does not serve starts a fresh process as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ablate.console import Progress
from launch import local, warm_start
from tests.helpers import FAST, ROOT, compose_spec, started_pids

# A stand-in worker: prints while it "imports", then, once told to go, the arguments it runs with.
STAND_IN = [sys.executable, "-c", "import sys; print('imported', flush=True); from launch import warm_start; "
                                  "print('running', warm_start.arguments(sys.argv[1:]))"]


@pytest.fixture(autouse=True)
def no_warm_worker_left():
    yield
    warm_start.drop()


def test_the_launch_takes_the_waiting_process_and_its_output_goes_to_worker_log(tmp_path):
    env, log = local.worker_env({}), tmp_path / "run" / local.LOG
    log.parent.mkdir()
    warm_start.prestart(STAND_IN, env)
    waiting = warm_start._waiting.proc
    assert warm_start.take(STAND_IN, ["spec.json"], env, log) is waiting and waiting.wait(timeout=60) == 0
    # what it printed while it waited went nowhere; from the go on, into the point's log
    assert log.read_text() == "running ['spec.json']\n"
    assert warm_start._waiting is None


def test_a_waiting_worker_serves_the_next_launch_of_its_command_and_environment():
    env = local.worker_env({})
    warm_start.prestart(STAND_IN, env)
    first = warm_start._waiting.proc
    warm_start.prestart(STAND_IN, env)  # the job of the next point finds it waiting
    assert warm_start._waiting.proc is first
    warm_start.prestart([*STAND_IN, "other"], env)  # another command: a new one, the old one gone
    assert warm_start._waiting.proc is not first and first.wait(timeout=60) is not None


@pytest.mark.parametrize("change", ["command", "environment", "died"])
def test_a_launch_it_does_not_serve_gets_a_fresh_process(tmp_path, change):
    """The waiting worker stays for a later launch it serves; one that died goes."""
    env = local.worker_env({})
    warm_start.prestart(STAND_IN if change != "died" else [sys.executable, "-c", "import sys; sys.exit(3)"], env)
    waiting = warm_start._waiting.proc
    if change == "died":
        waiting.wait(timeout=60)
    launch = [*STAND_IN, "torchrun"] if change == "command" else STAND_IN
    other_env = {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert warm_start.take(launch, ["spec.json"], other_env if change == "environment" else env, tmp_path / "log") is None
    if change == "died":
        assert warm_start._waiting is None
    else:
        assert warm_start._waiting.proc is waiting and waiting.poll() is None
    assert not (tmp_path / "log").exists()


def test_a_dropped_warm_worker_exits_without_running_and_leaves_no_log(tmp_path):
    """A worker no point takes (the sweep ends, an invalid or pruned point) writes nothing."""
    warm_start.prestart(STAND_IN, local.worker_env({}))
    waiting = warm_start._waiting.proc
    warm_start.drop()
    assert waiting.poll() is not None and not list(tmp_path.iterdir())


@pytest.mark.parametrize("submitit", [False, True])
def test_a_real_point_runs_in_its_prestarted_worker(tmp_path, monkeypatch, submitit):
    """The job's own path: a worker prestarted for the point, then launched: the worker that
    reports is the process started ahead (its pid), and the run is ok. In a submitit job (one
    point) it is started with the point's spec path in its command, for `ps` to show."""
    from ablate.outcome import launch

    if submitit:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    else:
        monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    spec, run_dir = compose_spec(FAST), tmp_path / "run"
    local.prestart(spec, run_dir / local.SPEC)
    pid = warm_start._waiting.proc.pid
    assert (str(run_dir / local.SPEC) in warm_start._waiting.cmd) == submitit
    outcome = launch(spec, run_dir, [], Progress("warm", stream=open(os.devnull, "w")))
    assert outcome.status == "ok", outcome.reason
    assert started_pids(run_dir) == [pid]
    assert 0 <= outcome.phases["startup"]  # from the launch: what was left of its imports


def test_a_launch_replaces_the_spec_whole_for_a_reader_on_another_node(tmp_path):
    """Every node of a multi-node point writes the same spec.json while the other node's launcher
    may be reading it: the file is replaced, never truncated under an open reader."""
    from ablate.outcome import launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / local.SPEC).write_text('{"written": "by the other node"}')
    with open(run_dir / local.SPEC) as reader:
        assert launch(compose_spec(FAST), run_dir, [], Progress("spec", stream=open(os.devnull, "w"))).status == "ok"
        assert json.loads(reader.read()) == {"written": "by the other node"}
    assert json.loads((run_dir / local.SPEC).read_text())["run_dir"] == str(run_dir)


def test_the_next_point_runs_in_the_worker_started_after_this_ones_measured_steps(tmp_path, monkeypatch):
    """A sweep's points one after the other: once a point's measured steps are done, a worker for
    the next starts importing, and the next launch runs in it. Not in a submitit job (one point)."""
    from ablate.outcome import launch

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    spec, quiet = compose_spec(FAST), Progress("warm", stream=open(os.devnull, "w"))
    assert launch(spec, tmp_path / "a", [], quiet).status == "ok"
    assert warm_start._waiting is not None
    pid = warm_start._waiting.proc.pid
    assert launch(spec, tmp_path / "b", [], quiet).status == "ok"
    assert started_pids(tmp_path / "b") == [pid]
    log = tmp_path / "b" / local.LOG  # kept only if the worker printed anything
    assert not log.exists() or "Traceback" not in log.read_text()

    warm_start.drop()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    assert launch(spec, tmp_path / "c", [], quiet).status == "ok"
    assert warm_start._waiting is None


def test_the_command_line_and_the_job_leave_torch_to_the_worker():
    """Nothing before the prestart imports torch: not the key check, not the job module (else its
    2 s on 2 cores would sit in front of the worker's start instead of beside it)."""
    code = ("import sys; from ablate.command_line import unknown_key; assert unknown_key(['batch_size=2']) is None; "
            "import ablate.job, ablate.__main__; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
