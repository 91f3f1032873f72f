"""What every figure of the report shares: the runs' columns read as numbers, run names, the
card the runs were judged against, and saving a figure. The figures themselves are in
`analysis.plots`. Memory in MiB (2^20 bytes).
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the analysis machines; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ablate.results import not_run  # noqa: E402
from analysis import compare, tables# noqa: E402

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
    rows = df.reindex(columns=["status", "reason"]).to_dict("records")  # iterrows builds a Series of every column
    return pd.Series([not_run(row) for row in rows], index=df.index, dtype=bool)


def run_label(row: pd.Series, labels: list[str]) -> str:
    """Short run name: the label columns' values, e.g. "sgd / 8"."""
    cols = [c for c in labels if c in row.index and not ("." in c and pd.isna(row[c]))]  # a key its option lacks
    # values as typed: gpu_memory_gib 8 and null, not 8.0 and nan
    return " / ".join(compare.spelled(row[c]) for c in cols) if cols else compare.spelled(row.get("run_id"))


def on_device(df: pd.DataFrame) -> str:
    names = df["env_gpu_name"].dropna().unique() if "env_gpu_name" in df else []
    return f" on {names[0]}" if len(names) == 1 else ""


# Plots drawn side by side, on as many cores as there are up to 2: a report over 1,000 runs spends
# most of its time drawing (on 2 cores, 10 s alone, 6 s side by side).
PROCESSES = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _call(job):
    return job()


def drawn(jobs: list, meanwhile, first: list[int] = ()):
    """(meanwhile(), the paths the plot `jobs` returned in their order, None left out). The jobs run
    in PROCESSES forked processes while this one runs `meanwhile` (the tables): each draws a figure
    of its own, so on 2 cores the report takes about half as long. `first`: the jobs to start before
    the others, the slowest (each process takes the next job as it finishes one: the slowest last
    would leave one drawing alone). One after another where there is no fork."""
    if PROCESSES < 2 or len(jobs) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        paths = [job() for job in jobs]
        return meanwhile(), [p for p in paths if p is not None]
    order = [*first, *(i for i in range(len(jobs)) if i not in first)]
    with multiprocessing.get_context("fork").Pool(PROCESSES) as pool:
        pending = pool.map_async(_call, [jobs[i] for i in order], chunksize=1)
        result = meanwhile()
        done = dict(zip(order, pending.get()))  # a job's exception is raised here
    return result, [done[i] for i in range(len(jobs)) if done[i] is not None]


SLUG_CHARS = 96  # of a family in a plot's file name: file systems take 255 bytes; a hash keeps it unique


def family_file(stem: str, family: str | None) -> str:
    """A plot's file name: `stem`.png for the runs' one family, `stem`-<what the family holds fixed>.png
    for each of several ("pareto-gpt2-seq_len-64.png")."""
    if family is None:
        return f"{stem}.png"
    slug = re.sub(r'[^A-Za-z0-9._-]+', '-', family.replace('model=', ''))
    if len(slug) > SLUG_CHARS:  # a family that holds a whole model config fixed (model.config=...)
        slug = f"{slug[:SLUG_CHARS - 9]}-{hashlib.sha1(family.encode()).hexdigest()[:8]}"
    return f"{stem}-{slug}.png"


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
    text = as_text(df, others)
    for key, part in df.groupby([text[c] for c in others], sort=True):  # keys are tuples when grouping by a list
        yield " / ".join(k for k in key if k), part


def baselines(df: pd.DataFrame, labels: list[str], bases: pd.Series | None = None) -> pd.Series:
    """Each row's baseline row: `bases` (compare.baselines over these rows or more) where it names
    rows of `df`, else compare.baselines over `df` and the labels it has."""
    bases = bases.reindex(df.index) if bases is not None else None
    if bases is None or not bases.isin(df.index).all():
        bases = compare.baselines(df, [c for c in labels if c in df], None)
    return bases


def setting_names(df: pd.DataFrame, labels: list[str], bases: pd.Series | None = None) -> pd.Series:
    """Each row's name as the setting table writes it (tables.setting_label): what differs from its
    baseline row (`baselines`), 'Baseline (batch size = 8)', '+ Block recompute + bf16 AMP'. Rows
    without a batch size or status (nothing to name a baseline by) keep run_label's values."""
    if df.empty or "batch_size" not in df or "status" not in df:
        return pd.Series([run_label(r, labels) for _, r in df.iterrows()], index=df.index, dtype=object)
    bases, cols = baselines(df, labels, bases), [c for c in labels if c in df]
    base_rows = {i: df.loc[i] for i in bases.unique()}  # a df.loc per row costs a millisecond
    return pd.Series([tables.setting_label(row, base_rows[bases[i]], cols) for i, row in df.iterrows()],
                     index=df.index, dtype=object)


def changed(name: str) -> int:
    """How many changes a setting name lists ("+ SGD + bf16 AMP": 2, a baseline 0)."""
    return len(re.findall(r"(?:^| )[+−] ", name))


def table_order(names: pd.Series) -> list:
    """The index of `names` (setting_names) as the setting table lists its rows: the baseline, then
    the fewest changes first, ties in the order given."""
    return sorted(names.index, key=lambda i: changed(names[i]))


def change_name(row: pd.Series, base: pd.Series, labels: list[str]) -> str:
    """What `row` changes against `base` in `labels` alone, as the setting table writes it ("+ Block
    recompute + bf16 AMP"), or "Baseline" when nothing: a batch scan's line, every batch size at once."""
    parts = tables.changes(row, base, [c for c in labels if c in row.index and c in base.index])
    # a line spans batch sizes: the accumulation is its steps, not one batch's split ("8 × 4 = 32")
    parts = [re.sub(r"^Gradient accumulation \(\d+ × (\d+) = \d+\)$", r"Gradient accumulation (\1 steps)", p)
             for p in parts]
    return " ".join(p if p.startswith("− ") else "+ " + p for p in parts) if parts else "Baseline"


def wrap(name: str, width: int) -> str:
    """A setting name over lines of about `width` characters, broken before a "+ " or "− " where it
    can be (a technique's name stays on one line), else at spaces."""
    lines: list[str] = []
    for part in re.split(r" (?=[+−] )", name):
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += " " + part
        else:
            lines += textwrap.wrap(part, width, break_on_hyphens=False) or [part]
    return "\n".join(lines)
