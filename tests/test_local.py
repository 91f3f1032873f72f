"""launch/local.py's worker_outcome: a worker's exit, the events it reported and its log -> the row's
status and reason, for one process, the ranks of one node, and ranks across nodes (a lost node)."""
from __future__ import annotations

import signal

from launch.worker_exit import worker_outcome


def test_outcome_classification(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("Traceback...\nValueError: boom\n")
    ok = [{"event": "result", "metrics": {"iter_time_ms": 1.0}, "env": {}}]
    assert worker_outcome(0, False, 10, ok, log).status == "ok"
    assert worker_outcome(0, True, 10, ok, log).status == "timeout"  # the limit wins over anything reported
    oom = [{"event": "failure", "status": "oom", "reason": "CUDA out of memory"}]
    assert (worker_outcome(1, False, 10, oom, log).status, worker_outcome(1, False, 10, oom, log).reason) == \
        ("oom", "CUDA out of memory")
    killed = worker_outcome(-signal.SIGKILL, False, 10, [], log)
    assert killed.status == "error" and "SIGKILL" in killed.reason
    crashed = worker_outcome(3, False, 10, [], log)
    assert crashed.status == "error" and "code 3" in crashed.reason and "ValueError: boom" in crashed.reason


def test_rank_failures_name_the_root_cause(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("")
    gloo = {"event": "failure", "rank": 0, "status": "error", "reason": "RuntimeError: Connection closed by peer"}
    launcher = {"event": "launcher", "failures": [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": -9},
                                                   {"rank": 2, "exitcode": -15}]}
    killed = worker_outcome(1, False, 10, [gloo, launcher], log, world_size=3)
    assert (killed.status, killed.reason) == ("error", "rank 1 killed by SIGKILL (the host's out-of-memory "
                                                       "killer sends SIGKILL)")
    oom = {"event": "failure", "rank": 1, "status": "oom", "reason": "CUDA out of memory"}
    assert worker_outcome(1, False, 10, [gloo, oom, launcher], log, world_size=3).reason == "rank 1: CUDA out of memory"
    crashed = worker_outcome(1, False, 10, [gloo, {"event": "launcher", "failures": [{"rank": 0, "exitcode": 1}]}], log,
                       world_size=2)
    assert crashed.reason == "rank 0: RuntimeError: Connection closed by peer"
    # A rank that exits with a code of its own, reporting nothing: its exit and the log's last line.
    exited = {"event": "launcher", "failures": [{"rank": 1, "exitcode": 3}]}
    assert worker_outcome(1, False, 10, [exited], log, world_size=2).reason == "rank 1 ended with exit code 3 without a result"
    log.write_text("SystemExit: bad rank\n\n")
    assert worker_outcome(1, False, 10, [exited], log, world_size=2).reason == \
        "rank 1 ended with exit code 3 without a result: SystemExit: bad rank"
    assert worker_outcome(3, False, 10, [], tmp_path / "no.log").reason == "worker exited with code 3 without a result"


def test_a_lost_node_is_named_by_its_ranks_hosts(tmp_path):
    """Two nodes of two ranks each; the second node vanishes (its torchrun with it): only the first
    node's ranks and launcher speak, and their peers' address is all their errors name."""
    log = tmp_path / "worker.log"
    log.write_text("")
    started = [{"event": "started", "rank": r, "pid": 100 + r, "host": f"n{1 + r // 2}"} for r in range(4)]
    gloo = {"event": "failure", "rank": 0, "status": "error", "reason": "RuntimeError: Connection closed by peer [10.0.0.2]"}
    n1 = {"event": "launcher", "host": "n1", "failures": [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": 1}]}
    lost = worker_outcome(1, False, 10, [*started, gloo, n1], log, world_size=4)
    assert (lost.status, lost.reason) == ("error", "node n2 lost: ranks 2, 3 stopped without a word; "
                                                   "rank 0: RuntimeError: Connection closed by peer [10.0.0.2]")
    # The second node's torchrun survived and saw its rank killed: that rank, as on one node.
    n2 = {"event": "launcher", "host": "n2", "failures": [{"rank": 3, "exitcode": -9}]}
    assert worker_outcome(1, False, 10, [*started, gloo, n1, n2], log, world_size=4).reason.startswith("rank 3 killed by SIGKILL")
    # One node: its launcher spoke, so no rank of it is lost, even one it did not list.
    one = [e for e in started if e["host"] == "n1"]
    assert worker_outcome(1, False, 10, [*one, gloo, {**n1, "failures": [{"rank": 0, "exitcode": 1}]}], log,
                    world_size=2).reason == "rank 0: RuntimeError: Connection closed by peer [10.0.0.2]"
