"""Benchmark: the analytic prediction of adapters (peft=lora, dora, qlora) against MemTracker's
peak of a real CPU step, on tiny Llama, Qwen2 and GPT-2 under no and block recompute in fp32, bf16
and pure bf16: the grid tests/test_peft.py checks, as one page.

    python benchmarks/peft_predict.py  ->  benchmarks/results/cpu/peft_predict.md
"""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ablate.build import check_config  # noqa: E402
from ablate.predict import predict  # noqa: E402
from ablate.predict.analytic import analytic  # noqa: E402
from ablate.techniques import Invalid, Unmodelled  # noqa: E402
from tests.helpers import compose_spec  # noqa: E402
from tests.test_peft import BASE, GRID, TINY  # noqa: E402
from tests.test_predict import measured  # noqa: E402


def row(family: str, peft: str, checkpoint: str, precision: str) -> str:
    base, overrides = [*TINY[family], *BASE], [f"peft={peft}", f"checkpoint={checkpoint}", f"precision={precision}"]
    spec = compose_spec([*base, *overrides])
    try:
        check_config(spec, "cpu")
    except Invalid as e:
        return f"| {family} | {peft} | {checkpoint} | {precision} | invalid: {e} | | | |"
    real = measured(overrides, base=base)
    try:
        pred, method = analytic(spec), "analytic"
    except Unmodelled:
        pred, method = predict(spec, "trace"), "trace"
    error = (pred.peak_mib / real.peak_mib - 1) * 100
    return (f"| {family} | {peft} | {checkpoint} | {precision} | {real.peak_mib:,.3f} | {pred.peak_mib:,.3f} | "
            f"{error:+.1f}% | {method} |")


def main() -> None:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["# Adapters: the predicted peak against MemTracker's on a CPU", "",
             "`python benchmarks/peft_predict.py` on the 2-core CPU VM (no GPU), torch "
             f"{torch.__version__}, Python {platform.python_version()}, commit {sha}. Each row: one real training "
             "step of the tiny model (tests/test_peft.py's TINY sizes) traced by MemTracker, against the "
             "analytic prediction (the trace's where the analytic model says it has none).", "",
             "| model | peft | checkpoint | precision | measured (MiB) | predicted (MiB) | error | method |",
             "|---|---|---|---|---:|---:|---:|---|"]
    lines += [row(*point) for point in GRID]
    out = ROOT / "benchmarks" / "results" / "cpu" / "peft_predict.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
