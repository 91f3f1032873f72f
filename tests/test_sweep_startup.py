"""benchmarks/sweep_startup.py: the page of what a sweep's points wait for their workers."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_the_page_has_a_row_per_checkout_with_its_startups(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/sweep_startup.py", "--repeats", "1", "--results", str(tmp_path),
                           "--tree", f"here={ROOT}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "cpu" / "sweep_startup.md").read_text()
    assert "python -m ablate -m seed=0,1,2,3 model=gpt-nano steps=3 device=cpu" in page
    (row,) = [line for line in page.splitlines() if line.startswith("| here |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    wall, cpu, first, later, outside = map(float, cells[2:])
    assert wall > 0 and first >= 0 and later >= 0 and outside > later  # outside a point's steps: its startup too
    assert cpu > 0.5 * wall  # the sweep's process and its points' workers, busy most of the sweep
