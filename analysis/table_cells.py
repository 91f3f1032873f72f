"""The report's cells: numbers rounded as published tables print them, failures as words, the
spread of iteration times and the "~" that marks a time delta inside it, FLOP rates in a unit that
reads, parameter counts as model cards write them, and the memory column named for the device that
measured it. Memory in MiB (2^20 bytes)."""
from __future__ import annotations

import math

import pandas as pd

from ablate.results import not_run, predicted_oom

MEMORY = "peak_allocated_mib"
NOISE = "~"  # a time delta no larger than the runs' own step-to-step variation


def num(value, fmt: str, unit: str = "") -> str:
    """A rounded number, or "" when it was not measured."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:{fmt}}{unit}"


def mib(value) -> str:
    """Memory as published tables print it: whole MiB, one decimal below 100 MiB (CPU-sized runs)."""
    return num(value, ",.0f" if value is not None and not pd.isna(value) and value >= 100 else ".1f")


def delta(value, base) -> str:
    """Signed change in percent: "+12.3%"."""
    if value is None or base is None or pd.isna(value) or pd.isna(base) or not base:
        return ""
    return f"{100 * (value - base) / base:+.1f}%"


def filled(table: pd.DataFrame, keep: list[str]) -> pd.DataFrame:
    """`table` less the columns (other than `keep`) that no row has a value in: they say nothing."""
    return table[[c for c in table if c in keep or table[c].astype(bool).any()]]


def failed(row: pd.Series) -> str:
    """The cell a failed (or only predicted) run shows where a number would be. An OOM that was
    only predicted (prune, or a plan with a capacity) says so: it never ran out of anything."""
    predicted = row.get("predicted_peak_mib")
    if row["status"] == "predicted" and pd.notna(predicted):
        return f"~{predicted:,.0f} (predicted)"
    if predicted_oom(row) and pd.notna(predicted):
        return f"OOM (predicted ~{predicted:,.0f})"
    if not_run(row):  # a ladder stopped before it: it never ran out of anything either
        return "not run"
    if row["status"] == "diverged":  # its memory is a measurement; marked, so no one reads it as a plain run
        peak, step = row.get(MEMORY), row.get("diverged_at_step")
        return " ".join(filter(None, [mib(peak), "(diverged" + (f" at step {step:.0f})" if pd.notna(step) else ")")]))
    return "OOM" if row["status"] == "oom" else row["status"]


def _timed_steps(row: pd.Series) -> float:
    """How many steps a run timed: its losses less the warm-up ones (a `samples` preset sets its
    steps from the data), else its `steps`; infinite where the row cannot tell."""
    losses, warmup = row.get("losses"), pd.to_numeric(row.get("warmup_steps"), errors="coerce")
    if hasattr(losses, "__len__") and not isinstance(losses, str) and len(losses) and pd.notna(warmup):
        return len(losses) - float(warmup)
    steps = pd.to_numeric(row.get("steps"), errors="coerce")
    return float(steps) if pd.notna(steps) else float("inf")


def _p10_p90(row: pd.Series) -> tuple[float, float] | None:
    lo, hi = row.get("iter_time_ms_p10"), row.get("iter_time_ms_p90")
    return None if lo is None or hi is None or pd.isna(lo) or pd.isna(hi) else (float(lo), float(hi))


def spread(row: pd.Series) -> str:
    """The measured steps' iteration times from p10 to p90 in ms ("26.2–31.0"): how far a step strays."""
    p = _p10_p90(row)
    return "" if p is None else f"{p[0]:,.1f}–{p[1]:,.1f}"


MIN_TIMED_STEPS = 5  # fewer measured steps show no spread to judge a time difference against


def within_noise(row: pd.Series, base: pd.Series) -> bool:
    """Whether one run's median iteration time lies inside the other's p10–p90: the difference is
    then no larger than that run's own variation from step to step (a loaded CPU, a GPU's clocks),
    so it is not shown as an effect of what differs. So is any difference where a run timed fewer
    than MIN_TIMED_STEPS steps (scale=cpu's 2: a p10–p90 of two values is no spread; on a loaded
    CPU such pairs read as -94% "speedups"). Unknown (no spread recorded) is not noise."""
    if any(_timed_steps(r) < MIN_TIMED_STEPS for r in (row, base)):
        return True
    a, b = _p10_p90(row), _p10_p90(base)
    if a is None or b is None or pd.isna(row.get("iter_time_ms")) or pd.isna(base.get("iter_time_ms")):
        return False
    return b[0] <= row["iter_time_ms"] <= b[1] or a[0] <= base["iter_time_ms"] <= a[1]


def time_delta(row: pd.Series, base: pd.Series, col: str = "train_latency_s") -> str:
    """Δ time against `base` in percent, or NOISE where it lies inside the runs' own spread."""
    change = delta(row[col], base[col])
    return NOISE if change and row.name != base.name and within_noise(row, base) else change


def flops(values: pd.Series) -> tuple[str, list[str]]:
    """(heading, cells) of a FLOP-rate column: TFLOP/s, or GFLOP/s where no run reaches 0.1 TFLOP/s
    (a CPU at toy sizes), where every cell would read 0.00."""
    rate = pd.to_numeric(values, errors="coerce")
    if rate.notna().any() and rate.max() < 0.1:
        return "GFLOP/s", [num(v * 1e3, ".2f") for v in rate]
    return "TFLOP/s", [num(v, ".2f") for v in rate]


def count(n) -> str:
    """A parameter count as model cards write it, three significant digits: "8.03 B", "3.41 M",
    "205 K"; "" when unknown."""
    if n is None or pd.isna(n):
        return ""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def trainable(row) -> str:
    """The parameters a run trains, of all of them: "3.41 M of 8.03 B (0.0424%)"; "" where the row
    has no counts (a run that never built its model, an older result)."""
    n, of = row.get("trainable_params"), row.get("params")
    if n is None or of is None or pd.isna(n) or pd.isna(of) or not of:
        return ""
    return f"{count(n)} of {count(of)} ({100 * n / of:.3g}%)"


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether the rows' memory figures are a CPU's: every row that tells (one that ran, or one
    planned for a named device) ran, or was planned, without a GPU."""
    ran = df["env_torch"].notna() if "env_torch" in df else pd.Series(False, index=df.index)
    no_gpu = df["env_gpu_name"].isna() if "env_gpu_name" in df else pd.Series(True, index=df.index)
    device = df["device"].astype(str) if "device" in df else pd.Series("", index=df.index)
    cpu = (ran & no_gpu) | (~ran & (device == "cpu"))
    tells = ran | device.isin(["cpu", "cuda"])
    return bool(tells.any() and cpu[tells].all())


def memory_heading(df: pd.DataFrame) -> str:
    """The setting table's memory column: a GPU's allocator peak, or a CPU's traced peak."""
    return "Peak memory (MiB)" if on_cpu(df) else "GPU Memory Peak (MiB)"


def footnote(cpu: bool) -> str:
    """What the tables' figures are, once under the first table."""
    memory = ("Peak memory / Memory (MiB): on a CPU, traced: the peak of live tensor bytes that torch's "
              "MemTracker saw over training (no caching allocator, no GPU)" if cpu else
              "GPU Memory Peak / Memory (MiB): the torch caching allocator's peak of allocated bytes over "
              "training; reserved adds cached free blocks; NVML is what the driver sees (CUDA context included)")
    return (f"{memory}. MiB = 2^20 bytes. Iteration time: median of the measured steps, and its p10–p90 "
            f"spread. Training latency: all measured steps. {NOISE} in a Δ time column: one run's median "
            "iteration time lies inside the other's p10–p90, or one of them timed fewer than "
            f"{MIN_TIMED_STEPS} steps, so the difference is noise, not an effect. (reused): a row "
            "an earlier sweep measured (the same run_id), not run again.")
