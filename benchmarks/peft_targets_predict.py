"""Benchmark: the analytic prediction of adapters at hidden 256 against MemTracker's peak of a real CPU
step, over what a user varies: the adapter (lora, dora, qlora), which Linears it targets, dropout on
its input, every recompute option and each precision. Tiny Llama (tests/test_families.py's widths),
4 x 128 tokens; the points the analytic model has no model for are predicted by the trace.

    python benchmarks/peft_targets_predict.py  ->  benchmarks/results/cpu/peft_targets_predict.md
"""
from __future__ import annotations

import itertools
import multiprocessing
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CHECKPOINTS = ["none", "attention", "mlp", "block", "every2", "layers", "ops"]
PRECISIONS = ["fp32", "bf16", "bf16_pure"]
GRID = [(peft, targets, 0.0, checkpoint, precision)
        for peft, targets, checkpoint, precision
        in itertools.product(["lora", "dora", "qlora"], ["all", "attention", "mlp"], CHECKPOINTS, PRECISIONS)]
GRID += [("lora", targets, 0.1, checkpoint, precision)
         for targets, checkpoint, precision
         in itertools.product(["all", "attention", "mlp"], ["none", "attention", "mlp", "block", "layers"],
                              PRECISIONS)]


def row(point: tuple) -> tuple[str, float | None]:
    """One point's table row, and its error in percent where the analytic model predicted it."""
    from ablate.build import check_config
    from ablate.predict import predict
    from ablate.predict.analytic import analytic
    from ablate.predict.trace import Untraceable
    from ablate.techniques import Invalid, Unmodelled
    from tests.helpers import compose_spec
    from tests.test_families import _PHI3, tiny
    from tests.test_predict import measured

    peft, targets, dropout, checkpoint, precision = point
    full = [*tiny("llama3.2-1b", *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", f"peft={peft}",
            f"peft.targets={targets}", f"peft.dropout={dropout}", f"checkpoint={checkpoint}", f"precision={precision}"]
    base = ["device=cpu", "batch_size=4", "seq_len=128"]
    spec = compose_spec([*base, *full])
    head = f"| {peft} | {targets} | {dropout:g} | {checkpoint} | {precision} |"
    try:
        check_config(spec, "cpu")
    except Invalid:
        return f"{head} invalid | | | |", None
    real = measured(full, base)
    try:
        pred, method = analytic(spec), "analytic"
    except Unmodelled:
        try:
            pred, method = predict(spec, "trace"), "trace"
        except Untraceable as e:  # neither model: the point is planned by running it
            return f"{head} {real.peak_mib:,.3f} | none | | {e} |", None
    error = (pred.peak_mib / real.peak_mib - 1) * 100
    return f"{head} {real.peak_mib:,.3f} | {pred.peak_mib:,.3f} | {error:+.2f}% | {method} |", \
        error if method == "analytic" else None


def main() -> None:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # two processes (the VM's cores): each point is one process's own step, traced on its own
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        rows = pool.map(row, GRID, chunksize=1)
    errors = [e for _, e in rows if e is not None]
    close = sum(abs(e) <= 0.3 for e in errors)
    lines = ["# Adapters by target, dropout, recompute and precision: the predicted peak against MemTracker's", "",
             "`python benchmarks/peft_targets_predict.py` on the 2-core CPU VM (no GPU), torch "
             f"{torch.__version__}, Python {platform.python_version()}, commit {sha}. Each row: one real training "
             "step of tiny Llama at hidden 256 (tests/test_families.py's widths, 2 layers, 4 x 128 tokens) traced "
             "by MemTracker, against the analytic prediction, or the trace's where the analytic model says it has "
             "none. qlora is refused under autocast (bf16): it computes in the parameters' dtype.", "",
             f"Analytic points within 0.3%: {close} of {len(errors)}; the largest error {max(errors, key=abs):+.2f}%.",
             "", "| peft | targets | dropout | checkpoint | precision | measured (MiB) | predicted (MiB) | error | method |",
             "|---|---|---:|---|---|---:|---:|---:|---|"]
    lines += [r for r, _ in rows]
    out = ROOT / "benchmarks" / "results" / "cpu" / "peft_targets_predict.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
