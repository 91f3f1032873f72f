"""hydra/launcher=gpu_pool (the default): points side by side on a host with several GPUs, one per
free GPU, each pinned with CUDA_VISIBLE_DEVICES. On CPU with a fake list of devices
(hydra.launcher.gpus): the pool and its schedule, then one real sweep through the CLI."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from helpers import FAST, ROOT, results_under, run_cli
from launch import cpus, gpu_pool
from launch.gpu_pool import GpuPool, QueuedPoint, gpus_wanted, host_gpus, packed


def test_host_gpus_reads_the_list_then_cuda_visible_devices_then_nvml(monkeypatch):
    assert host_gpus([3, 1]) == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert host_gpus() == [2, 3]
    for hidden in ("", "-1", "GPU-5c3e1d2a-0000"):  # none, or ids submitit cannot pin by: not packed
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert host_gpus("auto") == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(gpu_pool, "visible_gpu_count", lambda: 4)
    assert host_gpus() == [0, 1, 2, 3]


def test_a_point_wants_one_gpu_per_rank():
    assert gpus_wanted(False, 1, 4) == 1
    assert gpus_wanted(True, 2, 4) == 2
    assert gpus_wanted(True, "auto", 4) == 4  # every GPU, as the job resolves it
    assert gpus_wanted(True, 8, 4) == 8  # more than there are: the launcher's to refuse (or cap, on a CPU)
    assert gpus_wanted(True, 0, 4) == gpus_wanted(True, "x", 4) == 1  # the job's own check names it


def test_the_pool_hands_out_free_ids_in_the_hosts_order():
    pool = GpuPool([0, 1, 2, 3])
    first, second = pool.take(1), pool.take(2)
    assert first.ids == [0] and second.ids == [1, 2]
    assert pool.take(2) is None  # one left
    pool.give(second)
    assert pool.take(3).ids == [1, 2, 3]


def test_points_per_gpu_lets_points_share_a_gpu_and_a_points_ranks_stay_on_distinct_ones():
    pool = GpuPool([0, 1], per_gpu=2)
    one, two = pool.take(1), pool.take(1)
    assert one.ids == [0] and two.ids == [1]  # the least busy first
    pair = pool.take(2)
    assert pair.seats == ((0, 1), (1, 1))  # a 2-rank point: two GPUs, never one twice; each GPU's other slot
    assert pool.take(1) is None
    pool.give(two)
    assert pool.take(2) is None and pool.take(1).seats == ((1, 0),)  # the slot given back
    points = [QueuedPoint(i, [f"p={i}"], 1, True, f"p={i}", None) for i in range(5)]
    started, most = [], 0
    for point, _, _ in packed(points, [0], lambda p, lease: started.append((p.idx, lease.ids)) or FakeJob(p, 2),
                                FakeJob.done, lambda job: None, poll_s=0, per_gpu=3):
        most = max(most, len(started))
        started = [s for s in started if s[0] != point.idx]
    assert most == 3  # three at once on GPU 0, then the other two


class FakeJob:
    """Ends after `polls` checks."""

    def __init__(self, point: QueuedPoint, polls: int):
        self.point, self.polls, self.stopped = point, polls, False

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def schedule(wants: list[int], gpus: list[int], polls: int = 3):
    """Run fake points through `packed`; returns (start order with ids, end order, most running at once)."""
    points = [QueuedPoint(i, [f"p={i}"], w, True, f"p={i}", None) for i, w in enumerate(wants)]
    busy: set[int] = set()
    started, ended, most = [], [], 0

    def start(point, lease):
        nonlocal most
        ids = lease.ids
        assert not busy & set(ids), f"{point.label} got GPUs {ids} while {sorted(busy)} were busy"
        busy.update(ids)
        started.append((point.idx, ids))
        most = max(most, len(started) - len(ended))
        return FakeJob(point, polls)

    for point, _, lease in packed(points, gpus, start, FakeJob.done, lambda job: None, poll_s=0):
        busy.difference_update(lease.ids)
        ended.append(point.idx)
    return started, ended, most


def test_points_run_side_by_side_each_on_gpus_of_its_own():
    started, ended, most = schedule([1, 2, 1, 2, 1, 1], [0, 1, 2, 3])
    assert sorted(ended) == list(range(6))  # every point ran, once
    assert [len(ids) for _, ids in sorted(started)] == [1, 2, 1, 2, 1, 1]  # nproc=k: k GPUs
    assert started[:3] == [(0, [0]), (1, [1, 2]), (2, [3])]  # the grid fills the host at once
    assert most == 3


def test_a_point_that_fits_passes_one_that_waits_and_the_wide_one_runs_alone():
    started, _, _ = schedule([1, 4, 1, 1], [0, 1, 2, 3])
    assert [idx for idx, _ in started][:3] == [0, 2, 3]  # the 4-GPU point waits for the host to empty
    assert started[3] == (1, [0, 1, 2, 3])
    started, _, most = schedule([1, 8], [0, 1])  # a CPU point wanting more than there are: all, alone
    assert started[1] == (1, [0, 1]) and most == 1


def test_with_one_gpu_points_run_one_at_a_time_in_grid_order():
    started, ended, most = schedule([1, 1, 1], [0])
    assert started == [(0, [0]), (1, [0]), (2, [0])] and ended == [0, 1, 2] and most == 1


def test_a_sweep_stopped_midway_stops_its_running_jobs():
    points = [QueuedPoint(i, [], 1, True, str(i), None) for i in range(3)]
    checks, stopped = [], []

    def finished(job):
        checks.append(job)
        if len(checks) == 3:
            raise KeyboardInterrupt  # Ctrl-C (or SIGTERM, which the launcher turns into it) while polling
        return False

    with pytest.raises(KeyboardInterrupt):
        for _ in packed(points, [0, 1], lambda point, lease: point, finished, stopped.append, poll_s=0):
            pass
    assert stopped == points[:2]  # the two running; the third never started


def test_one_gpu_or_none_is_hydras_basic_launcher_as_before(monkeypatch, tmp_path):
    from hydra_plugins.ablate_launcher import launchers

    calls = []

    class Basic:
        def setup(self, **kwargs):
            calls.append(("setup", sorted(kwargs)))

        def launch(self, job_overrides, initial_job_idx):
            calls.append(("launch", job_overrides, initial_job_idx))
            return ["ran in the sweep's process"]

    monkeypatch.setattr(launchers, "BasicLauncher", Basic)
    monkeypatch.setattr(launchers.LocalLauncher, "_submit", lambda *a: pytest.fail("a submitit job"))
    for gpus in ([0], [], "auto"):  # "auto" on this CPU machine: none
        calls.clear()
        launcher = launchers.GpuPoolLauncher(gpus=gpus, submitit_folder=str(tmp_path))
        assert launcher.launch([["optimizer=sgd"]], 0) == ["ran in the sweep's process"]
        assert calls == [("setup", ["config", "hydra_context", "task_function"]), ("launch", [["optimizer=sgd"]], 0)]


@pytest.mark.slow  # a real sweep of pooled submitit jobs (20 s); the packing itself is tested above
def test_a_real_sweep_packs_points_of_one_and_two_gpus_and_refuses_one_wanting_more(tmp_path):
    """Three rungs on three fake GPUs: one process, two DDP ranks (gloo), and eight ranks."""
    rungs = ("hydra.sweeper.rungs=[{parallel: single},{parallel: ddp, parallel.nproc: 2},"
             "{parallel: ddp, parallel.nproc: 8, device: cuda}]")
    small = [f for f in FAST if not f.startswith("device=")] + ["steps=2", "data.train_samples=32"]
    proc = run_cli(["-m", "hydra/launcher=gpu_pool", "hydra.launcher.gpus=[0,1,2]", "hydra/sweeper=ladder",
                    "hydra.sweeper.cumulative=false", rungs, f"hydra.sweep.dir={tmp_path}/s", *small],
                   tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, ddp, wide = sorted(results_under(tmp_path / "s"), key=lambda r: r["config"]["rung"])
    assert (single["status"], ddp["status"], wide["status"]) == ("ok", "ok", "invalid"), wide["reason"]
    assert wide["reason"].startswith("parallel.nproc=8 > 3 GPUs on this host")
    # Pinned, as recorded inside each point: GPUs of its own, one per rank.
    assert single["env"]["cuda_visible_devices"] == "0" and ddp["env"]["cuda_visible_devices"] == "1,2"
    assert (single["env"]["world_size"], ddp["env"]["world_size"]) == (1, 2)
    # CPUs of their own, as launch/cpus plans them (on a 2-CPU host, 3 slots: the DDP pair shares)
    seats = cpus.plan([0, 1, 2], 1, cpus.allowed())
    pair = sorted(set(seats[1, 0]) | set(seats[2, 0]))
    assert (single["env"]["cpus"], ddp["env"]["cpus"]) == (cpus.fmt(seats[0, 0]), cpus.fmt(pair))
    assert (single["env"]["cpu_threads"], ddp["env"]["cpu_threads"]) == (len(seats[0, 0]), max(1, len(pair) // 2))
    # Side by side: both started before either ended.
    times = [(datetime.fromisoformat(r["timing"]["started_at"]), datetime.fromisoformat(r["timing"]["finished_at"]))
             for r in (single, ddp)]
    assert max(s for s, _ in times) < min(f for _, f in times)
    # The console names each point's GPUs, as it starts and as it ends.
    lines = proc.stdout.splitlines()
    running = [i for i, ln in enumerate(lines) if ln.startswith("[running]")]
    done = [i for i, ln in enumerate(lines) if ln.startswith("[     ok]")]
    assert len(running) == len(done) == 2 and max(running) < min(done)
    assert re.search(rf"parallel=single.*  GPU 0  CPUs {single['env']['cpus']}$", lines[running[0]])
    assert re.search(rf"parallel.nproc=2,parallel=ddp.*  GPU 1,2  CPUs {ddp['env']['cpus']}$", lines[running[1]])
    assert any("parallel=single" in lines[i] and "  GPU 0  peak" in lines[i] for i in done)
    assert any(ln.startswith("[invalid]") and "parallel.nproc=8 > 3 GPUs" in ln for ln in lines)
    assert "3 results under" in proc.stdout and "2 ok, 1 invalid" in proc.stdout


@pytest.mark.slow
def test_a_sweep_told_to_stop_stops_its_running_points_and_leaves_nothing_behind(tmp_path):
    """The default launcher: SIGTERM while two points train side by side (both hang). submitit's
    local jobs outlive the process that started them unless it ends them."""
    env = {**os.environ, "ABLATE_FAULT": "hang"}
    cmd = [sys.executable, "-m", "ablate", "-m", "hydra.launcher.gpus=[0,1]", "optimizer=sgd,adamw",
           f"out_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/s", *FAST]
    # SIGINT at its default, as at a terminal (a suite run in the background hands it ignored)
    sweep = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while sum('"train"' in p.read_text() for p in tmp_path.rglob("events.jsonl")) < 2:
            assert time.monotonic() < deadline and sweep.poll() is None, sweep.stdout.read()[-3000:]
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=60) == -signal.SIGTERM  # ended by it, as under the basic launcher
    finally:
        if sweep.poll() is None:
            sweep.kill()
    output = sweep.stdout.read()
    assert "[running]" in output and "Traceback" not in output
    time.sleep(1)
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left  # no submitit job, no worker
    assert not results_under(tmp_path / "s")  # no row for a stopped point: the next sweep runs it


@pytest.mark.slow
def test_points_per_gpu_runs_a_sweeps_points_side_by_side_on_one_gpu(tmp_path):
    """For a sweep that measures memory only (tests/test_gpu_predict.py): two points at once on the
    one (fake) GPU, both pinned to it; 0 is refused, naming the key."""
    small = [f for f in FAST if not f.startswith("device=")] + ["steps=2", "data.train_samples=32"]
    proc = run_cli(["-m", "hydra.launcher.gpus=[0]", "hydra.launcher.points_per_gpu=2", "optimizer=adamw,sgd",
                    f"hydra.sweep.dir={tmp_path}/s", *small], tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "up to 2 at once on each GPU" in proc.stdout
    rows = results_under(tmp_path / "s")
    assert [r["status"] for r in rows] == ["ok", "ok"] and {r["env"]["cuda_visible_devices"] for r in rows} == {"0"}
    # one GPU's two slots: the host's CPUs halved between them, torch's threads one per CPU
    halves = cpus.plan([0], 2, cpus.allowed()).values()
    assert sorted(r["env"]["cpus"] for r in rows) == sorted(cpus.fmt(c) for c in halves)
    assert all(r["env"]["cpu_threads"] == len(cpus.parse(r["env"]["cpus"])) for r in rows)
    times = [(datetime.fromisoformat(r["timing"]["started_at"]), datetime.fromisoformat(r["timing"]["finished_at"]))
             for r in rows]
    assert max(s for s, _ in times) < min(f for _, f in times)
    bad = run_cli(["-m", "hydra.launcher.gpus=[0]", "hydra.launcher.points_per_gpu=0", "optimizer=adamw,sgd",
                   f"hydra.sweep.dir={tmp_path}/bad", *small], tmp_path, fast=False)
    assert bad.returncode != 0 and "hydra.launcher.points_per_gpu=0 must be a positive integer" in bad.stderr


def test_a_job_unpickles_its_launcher_where_ablate_is_not_installed(tmp_path):
    """A pool job unpickles the launcher in a fresh process. On a GPU host without network the
    checkout runs from PYTHONPATH, not installed, where a job that cannot find the plugin ends on
    `No module named 'hydra_plugins.ablate_launcher'` before it starts. `python -S` here: the
    packages on PYTHONPATH as there, without the editable install's finder (a .pth file)."""
    import sysconfig

    import cloudpickle  # what submitit pickles a job's function with

    from hydra_plugins.ablate_launcher import launchers

    for launcher in (launchers.GpuPoolLauncher(points_per_gpu=2, submitit_folder=str(tmp_path)),
                     launchers.SlurmLauncher(submitit_folder=str(tmp_path))):
        (tmp_path / "job.pkl").write_bytes(cloudpickle.dumps(launcher))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([sysconfig.get_paths()["purelib"], str(ROOT)])}
        code = ("import pickle, sys; job = pickle.load(open('job.pkl', 'rb')); "
                "print(type(job).__module__, type(job).__name__, sorted(job.params))")
        out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split(maxsplit=2)[:2] == ["hydra_plugins.ablate_launcher.launchers", type(launcher).__name__]
        assert out.stdout.split(maxsplit=2)[2].strip() == str(sorted(launcher.params))


def test_a_job_that_left_no_result_is_a_row_naming_why(tmp_path):
    """Exited on its own (submitit writes no result where the job could not even load its
    function): the last line of its log. Killed (a signal; SLURM's time limit): the likely causes."""
    from launch.jobs import no_result

    class Job:
        job_id = "17"

        def __init__(self, state, log):
            self.state, self.paths = state, type("Paths", (), {"stderr": log})()

    log = tmp_path / "17_0_log.err"
    log.write_text("submitit ERROR - Submitted job triggered an exception\nTraceback (most recent call last):\n"
                   "ModuleNotFoundError: No module named 'hydra_plugins.ablate_launcher'\n\n")
    exited = no_result(Job("FINISHED", log), "local submitit job", "killed")
    assert exited == (f"local submitit job 17 ended FINISHED without a result: ModuleNotFoundError: No module "
                      f"named 'hydra_plugins.ablate_launcher' (its log: {log})")
    assert no_result(Job("INTERRUPTED", log), "local submitit job", "killed: OOM?") == \
        "local submitit job 17 ended INTERRUPTED without a result (killed: OOM?)"
    assert no_result(Job("FINISHED", tmp_path / "none.err"), "local submitit job", "killed") == \
        "local submitit job 17 ended FINISHED without a result (killed)"


@pytest.mark.slow  # a copied checkout's sweep: 8 s
def test_a_pool_sweep_runs_from_a_checkout_that_is_not_installed(tmp_path):
    """The GPU host's set-up, end to end: a Python that has the packages but not ablate's install
    (a venv whose site-packages names this one's in a .pth: no editable finder), the checkout on
    PYTHONPATH. Without the launcher pickled through `launch`, both points would be `error` rows, as
    predict_check's 16 were (benchmarks/results/NVIDIA-H200/README.md)."""
    import sysconfig

    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    python = bare / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([python, "-c", "import hydra_plugins.ablate_launcher"], env=env, cwd=tmp_path,
                          capture_output=True).returncode != 0  # as on the GPU host: importable only via launch
    small = [f for f in FAST if f not in ("steps=3",)] + ["steps=2", "data.train_samples=32"]
    proc = subprocess.run([python, "-m", "ablate", "-m", "hydra.launcher.gpus=[0]", "hydra.launcher.points_per_gpu=2",
                           "optimizer=adamw,sgd", f"hydra.sweep.dir={tmp_path}/s", *small],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["status"] for r in results_under(tmp_path / "s")] == ["ok", "ok"], proc.stdout[-3000:]
