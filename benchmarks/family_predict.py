"""Benchmark: the analytic prediction against MemTracker's peak of a real CPU step, for every
Hugging Face family the analytic model describes, at its tiny size (tests/test_families.py's
TINY_FAMILIES: 2 layers, hidden 64, the family's own structure) × checkpoint (none, block,
attention, layers, ops) × precision and accumulation (fp32, bf16_pure, bf16 autocast; fp32 with 4
micro-steps): the grid test_analytic_matches_memtracker_on_tiny_families checks, as one page.

    python benchmarks/family_predict.py  ->  benchmarks/results/cpu/family_predict.md
"""
from __future__ import annotations

import itertools
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ablate.predict.analytic import analytic  # noqa: E402
from tests.helpers import compose_spec  # noqa: E402
from tests.test_families import TINY_FAMILIES, tiny  # noqa: E402
from tests.test_predict import measured  # noqa: E402

FAMILIES = TINY_FAMILIES  # the shipped families, the mixtures of experts, the brought Llama-like ones
CHECKPOINTS = ["none", "block", "attention", "layers", "ops"]
PRECISIONS = [("fp32", "none"), ("bf16_pure", "none"), ("bf16", "none"), ("fp32", "x4")]
BASE = ["device=cpu", "batch_size=8", "seq_len=32"]


def point(family: str, checkpoint: str, precision: str, accumulation: str) -> tuple[float, float]:
    """(measured, predicted) peak MiB of one grid point."""
    overrides = [*tiny(family), "data.vocab_size=128", "optimizer=adamw_foreach", f"checkpoint={checkpoint}",
                 f"precision={precision}", f"accumulation={accumulation}"]
    return measured(overrides, BASE).peak_mib, analytic(compose_spec([*BASE, *overrides])).peak_mib


def main() -> None:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows, errors = [], []
    for family, checkpoint, (precision, accumulation) in itertools.product(FAMILIES, CHECKPOINTS, PRECISIONS):
        real, pred = point(family, checkpoint, precision, accumulation)
        errors.append((pred / real - 1) * 100)
        rows.append(f"| {family} | {checkpoint} | {precision} | {accumulation} | {real:,.3f} | {pred:,.3f} | "
                    f"{errors[-1]:+.2f}% |")
    size = [abs(e) for e in errors]
    lines = ["# Model families: the predicted peak against MemTracker's on a CPU", "",
             "`python benchmarks/family_predict.py` on the 2-core CPU VM (no GPU), torch "
             f"{torch.__version__}, Python {platform.python_version()}, commit {sha}. Each row: one real training "
             "step (AdamW, batch 8 × 32 tokens) of the family's tiny config traced by MemTracker, against the "
             "analytic prediction.", "",
             f"**{len(errors)} points: median |error| {statistics.median(size):.2f}%, the largest "
             f"{max(size):.2f}%; {sum(e > 1 for e in size)} outside 1%, {sum(e > 2 for e in size)} outside 2%.**", "",
             "| model | checkpoint | precision | accumulation | measured (MiB) | predicted (MiB) | error |",
             "|---|---|---|---|---:|---:|---:|", *rows]
    out = ROOT / "benchmarks" / "results" / "cpu" / "family_predict.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
