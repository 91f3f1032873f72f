"""The batch-scan tables: one per combination of the other varied columns, a row per batch size up
to and including the first OOM (Batch Size | Memory | GPU Usage % | TFLOP/s | Iteration Time)."""
from __future__ import annotations

import pandas as pd

from analysis.table_cells import MEMORY, failed, flops, mib, num, spread


# What a batch table reads of a run: its rows are these columns as dicts, made once. Pandas per
# table and per row (groupby parts, iterrows over 200 columns) took seconds over 1,000 runs.
BATCH_COLUMNS = ("batch_size", "status", "reason", MEMORY, "predicted_peak_mib", "gpu_util_pct_mean",
                 "gpu_util_pct_std", "tflops", "iter_time_ms", "iter_time_ms_p10", "iter_time_ms_p90")


def batch(df: pd.DataFrame, labels: list[str]) -> dict[str, pd.DataFrame]:
    """Batch Size | Memory (MiB) | GPU Usage % | TFLOP/s | Iteration Time (ms), one table per
    combination of the other varied columns with two batch sizes or more (in the order the rows
    come: a ladder's rung order), rows up to and including the first OOM."""
    others = [c for c in labels if c != "batch_size"]
    cols = list(dict.fromkeys([*others, *(c for c in BATCH_COLUMNS if c in df)]))
    parts: dict[tuple, list[dict]] = {}  # as groupby(others, sort=False, dropna=False): nulls are one key
    for row in df[cols].to_dict("records"):
        parts.setdefault(tuple(None if pd.isna(row[c]) else row[c] for c in others), []).append(row)
    tables = {}
    for key, part in parts.items():
        if len(part) < 2:  # one batch size is no scan (a mixed outputs/ has many such)
            continue
        title = ", ".join(f"{c}={v}" for c, v in zip(others, key) if v is not None) or "all runs"  # null: unset
        part = sorted(part, key=lambda row: row["batch_size"])  # stable: ties keep the rows' order
        rate, rates = flops(pd.Series([r["tflops"] if r["status"] == "ok" else None for r in part], dtype=object))
        rows = []
        for row, flop_rate in zip(part, rates):
            rows.append(_batch_row(row, rate, flop_rate))
            if row["status"] == "oom":
                break  # larger batches are OOM too: the first one says it
        tables[title] = _filled(rows, keep=["Batch Size", "Memory (MiB)"])  # a plan measured nothing
    return tables


def _batch_row(row: dict, rate: str, flop_rate: str) -> dict:
    """One run's cells in a batch table (`rate`: the FLOP column's heading)."""
    ok = row["status"] == "ok"
    util = (f"{row['gpu_util_pct_mean']:.1f} +/- {row['gpu_util_pct_std']:.1f}"
            if ok and pd.notna(row.get("gpu_util_pct_mean")) and pd.notna(row.get("gpu_util_pct_std")) else "")
    return {"Batch Size": str(row["batch_size"]), "Memory (MiB)": mib(row[MEMORY]) if ok else failed(row),
            "GPU Usage %": util, rate: flop_rate,
            "Iteration Time (ms)": num(row["iter_time_ms"], ".2f") if ok else "",
            "p10–p90 (ms)": spread(row) if ok else ""}


def _filled(rows: list[dict], keep: list[str]) -> pd.DataFrame:
    """cells.filled on rows of display strings, before they become a table (a DataFrame per column
    check is the slow part of hundreds of small tables)."""
    return pd.DataFrame(rows, columns=[c for c in rows[0] if c in keep or any(r[c] for r in rows)])
