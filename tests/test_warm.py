"""A point's worker started ahead of its launch (launch/warm.py): the worker it hands the spec to
is the one that imported while the job worked, its output lands in the run's worker.log, and any
launch it does not fit starts a fresh process as before, leaving nothing behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ablate.console import Progress
from launch import local, warm
from tests.helpers import FAST, ROOT, compose_spec

# A stand-in worker: prints while it "imports", then what it was handed, to show where each went.
STAND_IN = [sys.executable, "-c", "import sys; print('imported', flush=True); from launch import warm; "
                                  "print('handed', warm.spec_path(sys.argv[1:]))"]


def spec_file(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    return run_dir / "spec.json"


@pytest.fixture(autouse=True)
def no_warm_worker_left():
    yield
    warm.drop()


def test_the_launch_takes_the_prestarted_process_and_its_output_lands_in_worker_log(tmp_path):
    env = local.worker_env({})
    warm.prestart(STAND_IN, env)
    waiting = warm._waiting
    spec = spec_file(tmp_path / "run")
    taken = warm.take([*STAND_IN, str(spec)], env)
    assert taken is waiting and taken.proc.wait(timeout=60) == 0
    taken.settle(tmp_path / "run" / "worker.log")
    # What it printed before it had a run directory comes first, then the rest, in one log.
    assert (tmp_path / "run" / "worker.log").read_text() == f"imported\nhanded {spec}\n"
    assert not taken.prelog.exists() and warm._waiting is None


@pytest.mark.parametrize("change", ["command", "environment", "died"])
def test_a_launch_it_does_not_fit_gets_a_fresh_process_and_the_warm_one_goes(tmp_path, change):
    env = local.worker_env({})
    warm.prestart(STAND_IN if change != "died" else [sys.executable, "-c", "import sys; sys.exit(3)"], env)
    waiting = warm._waiting
    if change == "died":
        waiting.proc.wait(timeout=60)
    cmd = [sys.executable, "-c", "pass", "spec.json"] if change == "command" else [*STAND_IN, "spec.json"]
    assert warm.take(cmd, {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
                     if change == "environment" else env) is None
    assert waiting.proc.poll() is not None and not waiting.prelog.exists()


def test_a_dropped_warm_worker_exits_and_leaves_no_file(tmp_path):
    warm.prestart(STAND_IN, local.worker_env({}))
    waiting = warm._waiting
    warm.drop()
    assert waiting.proc.poll() is not None and not waiting.prelog.exists()


def test_a_real_point_runs_in_its_prestarted_worker(tmp_path):
    """The job's own path: prestarted for the point, then launched: the worker that reports is the
    process started ahead (its pid), the run is ok, and worker.log and no prelog remain."""
    from ablate.outcome import launch

    spec = compose_spec(FAST)
    run_dir = tmp_path / "run"
    with local.prestarted(spec):
        pid = warm._waiting.proc.pid
        prelog = warm._waiting.prelog
        outcome = launch(spec, run_dir, [], Progress("warm", stream=open(os.devnull, "w")))
    assert outcome.status == "ok", outcome.reason
    started = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["pid"] for e in started if e["event"] == "started"] == [pid]
    assert (run_dir / "worker.log").exists() and not prelog.exists()
    assert outcome.phases["startup"] >= 0  # from the launch: what was left of its imports


def test_the_command_line_and_the_job_leave_torch_to_the_worker():
    """Nothing before the prestart imports torch: the key check and the job module (else its 2 s
    on 2 cores would sit in front of the worker's start instead of beside it)."""
    code = ("import sys; from ablate.schema import unknown_key; assert unknown_key(['batch_size=2']) is None; "
            "import ablate.job, ablate.__main__; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
