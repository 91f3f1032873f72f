"""Shared pytest hooks.

ABLATE_TEST_FAILURES=<file>: each failing test's report is appended to <file> the moment it fails,
not in the summary at the end. A GPU host's command is killed at its time limit (benchmarks/
gpu_host.sh), and pytest prints no summary then: this file keeps why the tests before it failed.
"""
from __future__ import annotations

import os
import sys


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs `-n auto`), each worker and the processes its tests start
    get a share of the cores for torch's threads, unless OMP_NUM_THREADS says otherwise: torch's
    OpenMP threads spin while they wait, so two workers with a thread per core each fight over the
    cores. Measured on two cores, a default suite of 887 tests: one process 938 s, two workers with
    two threads each 939 s; of 798 tests: two workers with one thread each 394 s, one process 604 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cpus // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch at import, here and in children
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("ABLATE_TEST_FAILURES")
    # Under pytest-xdist the controller gets every worker's reports too: it alone writes them.
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{'=' * 30} {report.nodeid} ({report.when}, {report.duration:.1f} s) {'=' * 30}\n")
        f.write(report.longreprtext + "\n")
        for name, text in report.sections:  # what the test printed: its captured stdout and stderr
            f.write(f"{'-' * 10} {name} {'-' * 10}\n{text}\n")
