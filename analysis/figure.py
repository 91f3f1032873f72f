"""What every figure of the report shares: the runs' columns read as numbers, run names, the
card the runs were judged against, and saving a figure. The figures themselves are in
`analysis.plots`. Memory in MiB (2^20 bytes).
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the analysis machines; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ablate.results import not_run  # noqa: E402

DPI = 150


def num(df: pd.DataFrame, col: str) -> pd.Series:
    """A column as floats; missing columns and non-numbers become NaN."""
    if col not in df:
        return pd.Series(np.nan, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce").astype(float)


def is_status(df: pd.DataFrame, status: str) -> pd.Series:
    return df["status"] == status if "status" in df else pd.Series(False, index=df.index)


def skipped(df: pd.DataFrame) -> pd.Series:
    """The oom rows a ladder recorded without running them (results.not_run): no OOM was seen."""
    return pd.Series([not_run(row) for _, row in df.iterrows()], index=df.index, dtype=bool)


def fmt(value) -> str:
    if isinstance(value, float):
        return "?" if math.isnan(value) else f"{value:g}"
    return "?" if value is None else str(value)


def run_label(row: pd.Series, labels: list[str]) -> str:
    """Short run name: the label columns' values, e.g. "sgd / 8"."""
    cols = [c for c in labels if c in row.index and not ("." in c and pd.isna(row[c]))]  # a key its option lacks
    return " / ".join(fmt(row[c]) for c in cols) if cols else fmt(row.get("run_id"))


def on_device(df: pd.DataFrame) -> str:
    names = df["env_gpu_name"].dropna().unique() if "env_gpu_name" in df else []
    return f" on {names[0]}" if len(names) == 1 else ""


def save(fig, out: str | Path, name: str) -> Path:
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)  # keep memory flat across many plots
    return path


def card(df: pd.DataFrame) -> tuple[float, str] | None:
    """The one card the rows ran or were planned on, as (memory in MiB, legend text): the card
    gpu_memory_gib emulates (from the config: a plan has no worker to report it), else the GPU's
    total. None when unknown (CPU) or when the rows span several cards."""
    emulated = num(df, "gpu_memory_gib") * 1024
    cards = emulated.where(np.isfinite(emulated), num(df, "env_gpu_total_mib")).dropna().unique()
    if len(cards) != 1:
        return None
    mib = float(cards[0])
    return mib, (f"{mib / 1024:g} GiB card (emulated)" if np.isfinite(emulated).any()
                 else f"GPU memory ({mib:,.0f} MiB)")


def as_text(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """`cols` as text to group by, "" for an option key the run's option lacks: pandas 3's
    astype(str) keeps nulls, and a groupby drops null keys, which dropped those runs from plots."""
    return df[cols].fillna("").astype(str)


def series(df: pd.DataFrame, others: list[str]):
    """(legend text, rows) per combination of the other label columns."""
    if not others:
        yield "all runs", df
        return
    for key, part in as_text(df, others).groupby(others, sort=True):  # keys are tuples when grouping by a list
        yield " / ".join(k for k in key if k), df.loc[part.index]
