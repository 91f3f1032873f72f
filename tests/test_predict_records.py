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


TOLERANCE = 0.02
# Records with a run the model is known to miss by more, each with its bound and why (the pages say
# more). Kept strict: once the model comes within 2% there, the entry must go.
KNOWN = {
    # gpt2 at micro-batch 64 x 1024, bf16 autocast, loss=fused, compile=true, -4.0% (1,115 MiB):
    # measured before the fused loss let each slice's logits go before the next slice's were made
    # (ablate/techniques/loss.py _slice_loss), which is 785 MiB at this size (2 bytes per logit of
    # one slice of 8,192 tokens x 50,257). The other 330 MiB: no snapshot came back. To be measured again.
    "NVIDIA-H100-80GB-HBM3/gpt2_throughput": 0.041,
    # gpt2-xl with its parameters offloaded (FSDP over one rank, CPU offload), block recompute,
    # +2.8% (61 MiB): the model's peak is the last layer's MLP backward after its recompute, with
    # FSDP's GELU term (fitted on traced CPU ranks, where it holds under block recompute too: 100
    # MiB here); the traced step's breakdown puts the peak at another moment (activations 1,451
    # MiB against the model's 1,576, other 437 against 442). No snapshot of it came back.
    "NVIDIA-H200/gpt2_xl_8gib_lean": 0.03,
    # Llama 3.1 8B QLoRA at 2 x 2048 with the recomputed layers' inputs offloaded, -6.8% (488 MiB):
    # the traced step's "other" at the peak is 1,442 MiB against the model's 384 (its activations 1
    # against 722). What the offload's copies keep on the card there is not modelled; no
    # memory_by_module.csv came back to say which tensors they are.
    "NVIDIA-H200/fit_llama_8b": 0.069,
}


def _name(runs_csv) -> str:
    return f"{runs_csv.parent.parent.name}/{runs_csv.parent.name}"


@pytest.mark.parametrize("runs_csv", RECORDS, ids=_name)
def test_every_recorded_gpu_run_is_predicted_within_2_percent(runs_csv):
    table = repredict.repredict(runs_csv)
    assert len(table) > 0
    # A row the layer model does not follow now was not predicted when it ran either
    unmodelled = table[table["Prediction now (MiB)"].isna()]
    assert unmodelled["Recorded prediction (MiB)"].isna().all(), unmodelled["Setting"].tolist()
    errors = (table["Prediction now (MiB)"] / table["Measured (MiB)"] - 1).abs()
    bound = KNOWN.get(_name(runs_csv), TOLERANCE)
    assert errors.max() <= bound, table.loc[errors.idxmax()].to_dict()
    if bound > TOLERANCE:
        assert errors.max() > TOLERANCE, f"{_name(runs_csv)} is within 2% now: take it out of KNOWN"


def test_there_are_gpu_records_to_check():
    # predict_check, leanest, the batch scan, the ladder (benchmarks/results/NVIDIA-H100-80GB-HBM3/)
    assert len(RECORDS) >= 4

