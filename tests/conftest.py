"""Shared pytest hooks.

ABLATE_TEST_FAILURES=<file>: each failing test's report is appended to <file> the moment it fails,
not in the summary at the end. A GPU host's command is killed at its time limit (benchmarks/
gpu_host.sh), and pytest prints no summary then: this file keeps why the tests before it failed.
"""
from __future__ import annotations

import os


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
