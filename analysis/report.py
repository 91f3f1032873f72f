"""`python -m analysis.report PATH [PATH ...] [--out DIR]`: one table of every run below PATH.

Prints Markdown to stdout and writes report.md and runs.csv (every column) to --out
(default: <first PATH>/report/). Failed points stay in the table with their status.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from ablate.schema import GROUPS
from analysis.load import RUN_KEYS, load

# (column in the data, heading). Memory is the torch allocator's peak of allocated bytes, MiB.
METRICS = (
    ("peak_allocated_mib", "Peak allocated (MiB)"),
    ("iter_time_ms", "Iteration time (ms)"),
    ("tokens_per_s", "Tokens/s"),
    ("loss_final", "Final loss"),
    ("eval_loss", "Eval loss"),
)
FOOTNOTE = ("Peak allocated: the torch caching allocator's peak of allocated bytes during training "
            "(on CPU, the peak of live tensor bytes traced by torch's MemTracker). MiB = 2^20 bytes. "
            "Iteration time: median over the measured steps.")


def varied(df: pd.DataFrame) -> list[str]:
    """The group and run-key columns whose value differs between rows (at least `model`)."""
    cols = [c for c in (*GROUPS, *RUN_KEYS) if c in df and df[c].astype(str).nunique() > 1]
    return cols or ["model"]


def _cell(value, column: str) -> str:
    if value is None or pd.isna(value):
        return ""
    if column == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.4f}" if "loss" in column else f"{value:,.1f}"


def table(df: pd.DataFrame) -> pd.DataFrame:
    labels = varied(df)
    out = df[labels].copy()
    for column, heading in METRICS:
        values = df[column] if column in df else pd.Series([None] * len(df), index=df.index)
        out[heading] = [_cell(v, column) if s == "ok" else (s.upper() if column == METRICS[0][0] else "")
                        for v, s in zip(values, df["status"])]
    out["Status"] = [s if s == "ok" else f"{s}: {r}" for s, r in zip(df["status"], df["reason"])]
    return out.sort_values(labels, kind="stable").reset_index(drop=True)


def render(df: pd.DataFrame) -> str:
    t = table(df)
    align = ["left"] * len(varied(df)) + ["right"] * len(METRICS) + ["left"]
    return t.to_markdown(index=False, colalign=align, disable_numparse=True) + f"\n\n{FOOTNOTE}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="directories (searched recursively) or result.json files")
    parser.add_argument("--out", help="where report.md and runs.csv go (default: <PATH>/report)")
    args = parser.parse_args(argv)
    df = load(args.paths)
    if df.empty:
        print(f"no result.json found under {' '.join(args.paths)}", file=sys.stderr)
        return 1
    text = render(df)
    print(text)
    out = Path(args.out) if args.out else Path(args.paths[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    df.to_csv(out / "runs.csv", index=False)
    print(f"wrote {out / 'report.md'} and {out / 'runs.csv'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
