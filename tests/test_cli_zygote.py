"""The tests' `python -m ablate` (tests/cli_zygote.py, a child forked from a process that did the
command's imports) is the command: the same exit status, output and run as a fresh interpreter's,
and subprocess.run's timeout. Its point's worker server, a spare forked as the command starts,
ends as a started one does, and two threads' commands at once each run forked."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import yaml

from tests import cli_zygote
from tests.helpers import ROOT, fast_defaults, results_under


def fresh(args: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ablate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_refused_command_line_exits_1_with_the_same_words():
    env = dict(os.environ)
    a, b = (cli(["optimizer=adamx"], env, ROOT, 300) for cli in (fresh, cli_zygote.run))
    assert a.returncode == b.returncode == 1
    assert b.stderr == a.stderr and "adamw" in b.stderr
    assert b.stdout == a.stdout


def test_a_run_is_the_same_run_with_the_same_status_and_hydra_job(tmp_path):
    """A point whose worker fails: exit status 1 from both, the same run_id (the same composed
    config), and Hydra saw the same job (its name comes from how ablate/__main__.py was run)."""
    env = {**os.environ, "ABLATE_FAULT": "error"}
    a, b = (cli([f"out_dir={tmp_path / name}", f"hydra.run.dir={tmp_path / name / 'run'}", *fast_defaults([])],
                env, ROOT, 300) for name, cli in (("fresh", fresh), ("forked", cli_zygote.run)))
    assert a.returncode == b.returncode == 1, b.stderr
    (ra,), (rb,) = results_under(tmp_path / "fresh"), results_under(tmp_path / "forked")
    assert ra["status"] == rb["status"] == "error" and ra["reason"] == rb["reason"]
    assert ra["run_id"] == rb["run_id"]  # out_dir is not in it
    hydra = [yaml.safe_load((tmp_path / n / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
             for n in ("fresh", "forked")]
    assert hydra[0]["job"] == hydra[1]["job"]
    assert hydra[0]["runtime"]["choices"] == hydra[1]["runtime"]["choices"]
    assert hydra[0]["runtime"]["config_sources"] == hydra[1]["runtime"]["config_sources"]
    assert [ln for ln in b.stdout.splitlines() if "[  error]" in ln]


def test_a_command_past_its_timeout_is_killed_and_raises_as_subprocess_run_does(tmp_path):
    args = [f"out_dir={tmp_path}", "timeout_s=600", *fast_defaults([])]
    with pytest.raises(subprocess.TimeoutExpired):
        cli_zygote.run(args, {**os.environ, "ABLATE_FAULT": "hang"}, ROOT, timeout=3)
    # the command's process is gone, and with it its worker (PR_SET_PDEATHSIG)
    assert not [c for s in cli_zygote._servers for c in psutil.Process(s.proc.pid).children(recursive=True)]


def test_a_commands_worker_is_forked_from_its_spare_and_ends_as_a_started_one_would(tmp_path):
    """The command's point worker server is its spare (the hung point's stacks, written on the
    timeout, run through it), and it ends as a started server does: a timeout row naming where the
    point hung, and no process of it left once the command has exited."""
    proc = cli_zygote.run([f"out_dir={tmp_path}", "timeout_s=4", *fast_defaults([])],
                          {**os.environ, "ABLATE_FAULT": "hang"}, ROOT, 300)
    assert proc.returncode == 1, proc.stderr
    (row,) = results_under(tmp_path)
    assert row["status"] == "timeout" and "in inject_fault" in row["reason"]
    stacks = next(tmp_path.rglob("worker.log")).read_text()
    assert "tests/cli_zygote.py" in stacks and " in _wait" in stacks, stacks
    assert not spares_left()


def test_two_threads_commands_at_once_each_run_in_a_fork(tmp_path):
    """A test that runs two commands at once (a pool of two threads) gets a second server: both
    commands, each holding its point past a timeout, run forked, workers and all."""
    def hung(name: str) -> subprocess.CompletedProcess:
        return cli_zygote.run([f"out_dir={tmp_path / name}", "timeout_s=4", *fast_defaults([])],
                              {**os.environ, "ABLATE_FAULT": "hang"}, ROOT, 300)
    with ThreadPoolExecutor(2) as pool:
        assert [p.returncode for p in pool.map(hung, ["a", "b"])] == [1, 1]
    assert len(cli_zygote._servers) == 2
    for name in ("a", "b"):
        assert [r["status"] for r in results_under(tmp_path / name)] == ["timeout"]
        assert " in _wait" in next((tmp_path / name).rglob("worker.log")).read_text()
    assert not spares_left()


def test_a_spare_no_server_was_asked_of_goes_with_its_command(tmp_path):
    proc = cli_zygote.run([f"out_dir={tmp_path}", "predict_only=true", *fast_defaults([])], dict(os.environ), ROOT, 300)
    assert proc.returncode == 0, proc.stderr
    assert [r["status"] for r in results_under(tmp_path)] == ["predicted"]
    assert not spares_left()


def test_a_report_is_the_same_report_and_starts_no_spare(tmp_path):
    """`python -m analysis.report` forked gives a fresh interpreter's output and exit status, on a
    planned point and on a directory without results."""
    proc = cli_zygote.run([f"out_dir={tmp_path}", "predict_only=true", *fast_defaults([])], dict(os.environ), ROOT, 300)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "empty").mkdir()
    for where, code, says in ((tmp_path, 0, "# ablate report: 1 run (1 predicted)"),
                              (tmp_path / "empty", 1, "no result.json")):
        a = subprocess.run([sys.executable, "-m", "analysis.report", str(where)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        b = cli_zygote.run([str(where)], dict(os.environ), ROOT, 300, module="analysis.report")
        assert a.returncode == b.returncode == code, b.stderr
        assert (b.stdout, b.stderr) == (a.stdout, a.stderr) and says in b.stdout + b.stderr
    assert not spares_left()


def spares_left(wait_s: float = 30) -> list:
    """The spares still alive `wait_s` after the last command (none, at once, where all went)."""
    zygotes = {s.proc.pid for s in cli_zygote._servers}
    deadline = time.monotonic() + wait_s
    while spares(zygotes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return spares(zygotes)


def spares(zygotes: set[int]) -> list:
    """This test process's live forks of its zygotes other than the zygotes themselves: a spare
    shares their command line and their environment as they started."""
    mine = os.environ.get("PYTEST_XDIST_WORKER")
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if (p.pid not in zygotes and "tests.cli_zygote" in " ".join(p.info["cmdline"] or [])
                    and p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("PYTEST_XDIST_WORKER") == mine):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found
