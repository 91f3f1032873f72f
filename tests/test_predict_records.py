"""The analytic model against real GPU measurements, on a machine without a GPU: every ok run a
benchmark recorded under benchmarks/results/<gpu>/ is predicted again from its config and set
against the allocator's peak it measured (benchmarks/repredict.py)."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import repredict  # noqa: E402

RECORDS = sorted((ROOT / "benchmarks" / "results").glob("NVIDIA-*/*/runs.csv"))


@pytest.mark.parametrize("runs_csv", RECORDS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_every_recorded_gpu_run_is_predicted_within_2_percent(runs_csv):
    table = repredict.repredict(runs_csv)
    assert len(table) > 0
    errors = (table["Prediction now (MiB)"] / table["Measured (MiB)"] - 1).abs()
    assert errors.max() <= 0.02, table.loc[errors.idxmax()].to_dict()


def test_there_are_gpu_records_to_check():
    assert len(RECORDS) >= 4  # predict_check, leanest, the batch scan, the ladder (an H100, 2026-11-22)

