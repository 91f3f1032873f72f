"""Points that span two nodes, on a real two-node SLURM cluster (scripts/slurm/start.sh --nodes 2):
two network namespaces on this machine, each a node with its own hostname, address and slurmd, so
the ranks of one point meet through torchrun's c10d rendezvous and talk gloo across a network.

slow: every point starts six Pythons with torch (two submitit tasks, two torchruns, four ranks) on
this machine's cores. The module starts the cluster and stops it at the end, and checks that the stop
leaves no daemon, namespace or bridge behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import FAST, ROOT, results_under, run_cli

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "scripts" / "slurm"
SLURM_DIR = Path(os.environ.get("ABLATE_SLURM_DIR", "/tmp/ablate-slurm"))
ENV = {"SLURM_CONF": str(SLURM_DIR / "slurm.conf"), "PATH": f"{SCRIPTS / 'bin'}{os.pathsep}{os.environ['PATH']}"}
NODES = ["ablate-n1", "ablate-n2"]
# Four gloo ranks, two per node, 4 samples each: the global batch of one process with batch_size=16.
# SGD: the same math in another reduction order stays within float noise (tests/test_parallel.py).
TWO_NODES = ["-m", "hydra/launcher=slurm", "parallel=fsdp", "parallel.nodes=2", "parallel.nproc=2",
             "optimizer=sgd", "batch_size=4"]
DAEMONS = ("slurmctld", "slurmd", "slurmstepd")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("ablate-n")]


def _daemons() -> list[str]:
    return [p.info["name"] for p in psutil.process_iter(["name"]) if p.info["name"] in DAEMONS]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("network namespaces and SLURM's daemons need root")
    if shutil.which("ip") is None or (shutil.which("slurmctld") is None and shutil.which("apt-get") is None):
        pytest.skip("needs iproute2's ip, and SLURM or apt-get to install it with")
    if _daemons() and not (SLURM_DIR / "slurm.conf").is_file():
        pytest.skip("a SLURM that scripts/slurm/start.sh did not start runs here")
    start = subprocess.run([SCRIPTS / "start.sh", "--nodes", "2"], capture_output=True, text=True, timeout=900)
    if start.returncode != 0:  # leave no half-started daemon or namespace behind
        subprocess.run([SCRIPTS / "stop.sh"], capture_output=True, timeout=120)
        pytest.fail(f"scripts/slurm/start.sh --nodes 2 failed:\n{start.stderr}")
    assert sorted(_namespaces()) == NODES
    yield
    stop = subprocess.run([SCRIPTS / "stop.sh"], capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert _namespaces() == [] and _daemons() == []
    bridge = subprocess.run(["ip", "link", "show", "ablate-br"], capture_output=True, text=True)
    assert bridge.returncode != 0, "the bridge outlived stop.sh"
    assert not (SLURM_DIR / "munged.pid").exists()  # a munged start.sh started is gone too


def test_a_point_on_two_nodes_trains_as_one_process_with_the_global_batch(cluster, tmp_path):
    single = run_cli(["batch_size=16", "optimizer=sgd"], tmp_path / "single")
    assert single.returncode == 0, single.stderr
    (reference,) = results_under(tmp_path / "single")

    proc = run_cli([*TWO_NODES, f"hydra.sweep.dir={tmp_path}/s"], tmp_path / "out", env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path / "s")
    assert row["status"] == "ok", row["reason"]
    assert row["env"]["world_size"] == 4 and row["env"]["hostname"] == "ablate-n1"  # the first node writes it
    assert row["metrics"]["losses"] == pytest.approx(reference["metrics"]["losses"], abs=1e-5)
    ranks = row["metrics"]["per_rank"]
    assert [(r["rank"], r["host"]) for r in ranks] == [(0, "ablate-n1"), (1, "ablate-n1"), (2, "ablate-n2"),
                                                        (3, "ablate-n2")]
    assert all(r["peak_allocated_mib"] > 0 for r in ranks)
    assert row["metrics"]["peak_allocated_mib"] == max(r["peak_allocated_mib"] for r in ranks)


def _run_dir(sweep: Path, override: str) -> Path | None:
    """The run directory of the point with `override` (its name is cut short: read spec.json)."""
    for spec in sweep.glob("*/spec.json"):
        if override in json.loads(spec.read_text()).get("overrides", []):
            return spec.parent
    return None


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_until(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {condition.__doc__}")


def _lose_node(namespace: str, run_dir: Path) -> list[int]:
    """SIGKILL every process of the point on one node (its torchrun and its ranks) at once, as a
    node that vanishes: nothing of it reports. The node's slurmd and the job's task stay."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    victims = []
    for pid in map(int, pids):
        try:
            if str(run_dir) in " ".join(psutil.Process(pid).cmdline()):
                victims.append(pid)
        except psutil.NoSuchProcess:
            continue
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    return victims


def test_a_lost_node_is_an_error_row_naming_it_and_a_rerun_retrains_only_that_point(cluster, tmp_path):
    sweep = tmp_path / "s"
    cmd = [sys.executable, "-m", "ablate", *TWO_NODES, "seed=1,2,3", f"hydra.sweep.dir={sweep}",
           f"out_dir={tmp_path}/out", *[a for a in FAST if not a.startswith("batch_size=")]]
    # Rank 2 of seed=2 stops at its first step, so that the point is caught training: its peers
    # wait for it in their first collective. ABLATE_FAULT reaches the ranks through sbatch.
    env = {**os.environ, **ENV, "ABLATE_FAULT": "hang:seed=2@2"}
    sweeper = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def training() -> Path | None:
            """seed=2's four ranks started, and rank 0 in its training steps"""
            run_dir = _run_dir(sweep, "seed=2")
            events = _events(run_dir) if run_dir else []
            started = {e["rank"] for e in events if e["event"] == "started"}
            train = any(e["event"] == "phase" and e["phase"] == "train" for e in events)
            return run_dir if started == {0, 1, 2, 3} and train else None

        run_dir = _wait_until(training, timeout=300)
        assert len(_lose_node("ablate-n2", run_dir)) == 3  # torchrun and ranks 2, 3
        _, stderr = sweeper.communicate(timeout=600)
    finally:
        if sweeper.poll() is None:
            sweeper.kill()
            sweeper.communicate()
    assert sweeper.returncode == 0, stderr[-2000:]
    rows = {r["config"]["seed"]: r for r in results_under(sweep)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["status"] == rows[3]["status"] == "ok"
    lost = rows[2]
    assert lost["status"] == "error"
    assert lost["reason"].startswith("node ablate-n2 lost: ranks 2, 3 stopped without a word; rank "), lost["reason"]

    # The same command again, the node back to health: only the lost point trains.
    rerun = run_cli([*TWO_NODES, "seed=1,2,3", f"hydra.sweep.dir={tmp_path}/again"], tmp_path / "out", env=ENV,
                    timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    again = {r["config"]["seed"]: r for r in results_under(tmp_path / "again")}
    assert {s: r["status"] for s, r in again.items()} == {1: "ok", 2: "ok", 3: "ok"}
    assert [s for s, r in sorted(again.items()) if r.get("reused_from")] == [1, 3]
    assert again[2]["run_id"] == lost["run_id"] and again[2]["env"]["world_size"] == 4
