"""tests/conftest.py's failure log: a failing test's report lands in ABLATE_TEST_FAILURES at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_failure_is_written_down_when_it_happens(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_fails():\n    print('the step printed this')\n    assert 1 == 2, 'the reason'\n\n"
        "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    # Not an xdist worker's environment: there the hook leaves the writing to xdist's controller.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           "PYTHONPATH": str(TESTS), "ABLATE_TEST_FAILURES": str(log)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_sample.py")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = log.read_text()
    assert "test_sample.py::test_fails (call" in text and "AssertionError: the reason" in text
    assert "the step printed this" in text  # its captured output too
    assert "test_passes" not in text
