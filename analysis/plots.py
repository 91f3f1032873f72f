"""Figures for the report, one function per plot.

Each takes the loaded runs (`analysis.load.load`), the columns whose values name a run (`labels`, e.g.
`report.varied(df)`) and an output directory; it writes one PNG and returns its Path, or None when the
data has nothing to show. Memory is the torch allocator's peak of allocated bytes, MiB = 2^20 bytes.
"""
from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from analysis.compare import families, spelled, varies
from analysis.plot_common import (DPI, as_text, family_file, is_status, num, on_device, plt, run_label, save,
                             setting_names, skipped, table_order, wrap)
from analysis.pareto import pareto, pareto_front, pareto_jobs, paretos  # noqa: F401  (the report's plots, one import)
from analysis.batch_scan import batch_scan  # noqa: F401  (the report's plots, one import)

# (breakdown component, legend text), stacked in this order: what the model owns, then what training adds.
COMPONENTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
              ("activations", "activations"), ("other", "other"))
LOSS_VARIANTS = ("precision", "optimizer")  # runs that differ only in these should train alike
BAR_NAME_WIDTH = 64  # characters per line of a run's name beside a bar: two lines hold most names
# Bars of the breakdown: the first this many in the setting table's order (fewest changes first), the
# title counting the rest. Hundreds make a figure tens of thousands of pixels tall that no one reads,
# drawn in minutes; the tables and runs.csv hold them all.
MAX_BARS = 40


def breakdown(df: pd.DataFrame, labels: list[str], out: str | Path, bases: pd.Series | None = None,
              family: str | None = None) -> Path | None:
    """Stacked bars of where each ok run's peak memory went (MiB), total at the end of each bar, each
    run named by its setting label (`bases`: as in setting_names). A plan that ran nothing
    (predict_only) gets its predicted peaks split the same way. `family`: what the runs share, when
    the report has several families (its title, and breakdown-<family>.png)."""
    if df.empty:
        return None
    ok, prefix, title = df[is_status(df, "ok")], "breakdown", "Memory breakdown per run"
    if ok.empty:  # never measured and predicted side by side: one figure, one kind of number
        ok, prefix, title = df[is_status(df, "predicted")], "predicted_breakdown", "Predicted memory breakdown per run"
    cols = [f"{prefix}_{k}_mib" for k, _ in COMPONENTS]
    parts = pd.DataFrame({c: num(ok, c) for c in cols}, index=ok.index)
    keep = parts.notna().any(axis=1)  # a run with no breakdown at all is skipped, a missing part is 0
    ok, parts = ok[keep], parts[keep].fillna(0.0)
    if ok.empty:
        return None
    named = setting_names(df, labels, bases)[ok.index]
    order = table_order(named)  # top to bottom as the setting table lists the runs
    title += f" (the first {MAX_BARS} of {len(order)} in the setting table's order)" if len(order) > MAX_BARS else ""
    order = order[:MAX_BARS]
    ok, parts, names = ok.loc[order], parts.loc[order], [wrap(named[i], BAR_NAME_WIDTH) for i in order]
    lines = max(n.count("\n") + 1 for n in names)
    bar_in = max(0.4, lines * 8 * 1.25 / 72 + 0.15)  # inches per bar: its name's lines at 8 pt, and a gap
    fig, ax = plt.subplots(figsize=(11, max(2.5, bar_in * len(ok) + 1.2)), layout="constrained", dpi=DPI)
    rows, left = np.arange(len(ok)), np.zeros(len(ok))
    for (_, text), col, colour in zip(COMPONENTS, cols, plt.cm.tab10.colors):
        if not (parts[col] > 0).any():  # no bar anywhere (SGD's optimizer state): no legend entry either
            continue
        ax.barh(rows, parts[col], left=left, color=colour, label=text, height=0.7)
        left += parts[col].to_numpy()
    for i, total in enumerate(left):
        ax.annotate(f"{total:,.0f}", (total, i), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(rows, names, fontsize=8)
    ax.set_ylim(len(ok) - 0.5, -0.5)  # first run on top, like the table; no empty rows at the ends
    ax.set_xlim(0, left.max() * 1.15 if left.max() > 0 else 1)
    ax.set_xlabel("memory at peak (MiB)")
    ax.set_title(f"{title}{on_device(df)}" + (f"\n({family})" if family else ""))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides a bar
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out, family_file("breakdown", family))


def _curve(value) -> list[float] | None:
    """A per-step loss list as floats, or None when the value is not a non-empty list."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        return None
    return [float(v) if v is not None else np.nan for v in value]


def measured_curve(row: pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
    """(optimizer step numbers, losses) of a run's measured steps, or None. metrics.losses holds
    every optimizer step from the first, warm-up included (ablate/runner.py): the measured steps are
    those after the run's warmup_steps, numbered as the run took them (step 1 is the first warm-up
    step). A result without warmup_steps shows every step."""
    y = _curve(row.get("losses"))
    warmup = pd.to_numeric(row.get("warmup_steps"), errors="coerce")
    warmup = int(warmup) if pd.notna(warmup) and warmup >= 0 else 0
    if y is None or warmup >= len(y):
        return None
    return np.arange(warmup + 1, len(y) + 1), np.asarray(y[warmup:])


def _with_curves(df: pd.DataFrame) -> pd.DataFrame:
    """The ok runs with a measured step's loss (measured_curve)."""
    if df.empty or "losses" not in df:
        return df.iloc[0:0]
    rows = df.reindex(columns=["losses", "warmup_steps"]).to_dict("records")  # not a Series of every column each
    curves = pd.Series([measured_curve(r) is not None for r in rows], index=df.index, dtype=bool)
    return df[is_status(df, "ok") & curves]


def loss_group(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """The largest set (>= 2) of ok runs with curves that differ only in precision/optimizer; may be empty."""
    runs = _with_curves(df)
    keys = [c for c in labels if c in runs and c.split(".")[0] not in LOSS_VARIANTS]  # optimizer.lr is the optimizer's
    if not keys:
        return runs if len(runs) >= 2 else runs.iloc[0:0]
    # ties go to the group met first in the data (the sweep's order)
    groups = [part.index for _, part in as_text(runs, keys).groupby(keys, sort=False)]
    best = max(groups, key=len, default=[])
    return runs.loc[best] if len(best) >= 2 else runs.iloc[0:0]


def left_out(df: pd.DataFrame, group: pd.DataFrame, labels: list[str]) -> str:
    """What the loss plot leaves out, "not shown: 12 runs that differ in checkpoint / batch size;
    4 without a loss curve (2 oom, 1 error, 1 not run)", or ""."""
    rest = _with_curves(df).drop(group.index)
    fixed = [c for c in labels if c in group and c.split(".")[0] not in LOSS_VARIANTS]
    differ = [c.replace("_", " ") for c in fixed if (as_text(rest, [c])[c] != as_text(group, [c])[c].iloc[0]).any()]
    bare = df.drop(_with_curves(df).index)
    parts = [f"{len(rest)} run{'s' if len(rest) != 1 else ''} that differ{'s' if len(rest) == 1 else ''} in "
             + " / ".join(differ)] if len(rest) else []
    if len(bare):
        status = bare["status"].where(~skipped(bare), "not run") if "status" in bare else pd.Series("?", bare.index)
        counts = status.value_counts()
        parts.append(f"{len(bare)} without a loss curve ({', '.join(f'{n} {s}' for s, n in counts.items())})")
    return "not shown: " + ";\n".join(parts) if parts else ""


def loss_curves(df: pd.DataFrame, labels: list[str], out: str | Path) -> Path | None:
    """Training loss per measured step of the runs that differ only in precision and/or optimizer
    (loss_group); the title names the runs left out."""
    group = loss_group(df, labels)
    if len(group) < 2:
        return None
    named = [c for c in labels if c in group and c.split(".")[0] in LOSS_VARIANTS and varies(group[c])]
    fixed = [c for c in labels if c in group and c.split(".")[0] not in LOSS_VARIANTS]
    # Many runs (an optimizer comparison): the legend goes below in two columns, so the plot keeps
    # the figure's width, and 20 colours instead of 10, so no two runs share a colour and a dash.
    many = len(group) > 8
    fig, ax = plt.subplots(figsize=(11, 6 + 0.2 * len(group)) if many else (9, 4.5), layout="constrained", dpi=DPI)
    colours = plt.get_cmap("tab20").colors if many else plt.rcParams["axes.prop_cycle"].by_key()["color"]
    first = []
    for i, (_, row) in enumerate(group.iterrows()):
        steps, y = measured_curve(row)
        # dashes apart: precision changes often move a loss by less than a line's width
        ax.plot(steps, y, lw=1.2, ls=("-", "--", ":", "-.")[i % 4], marker="." if len(steps) < 30 else None,
                color=colours[i % len(colours)], label=run_label(row, named))
        first.append(steps[0])
    last = max(line.get_xdata()[-1] for line in ax.get_lines())
    ax.set_xlim(min(first), max(last, min(first) + 1))  # from the first measured step: warm-up is not shown
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    warm = min(first) - 1
    ax.set_xlabel("optimizer step" + (f" (measured steps; warm-up steps 1–{warm} not shown)" if warm > 1 else
                                      " (measured steps; warm-up step 1 not shown)" if warm == 1 else ""))
    ax.set_ylabel("training loss (cross-entropy, nats)")
    where = ", ".join(f"{c}={spelled(group[c].iloc[0])}" for c in fixed)
    note = left_out(df, group, labels)
    title = [f"Training loss{on_device(df)}", *textwrap.wrap(f"runs with {where}" if where else "", 100),
             *(line for part in note.split("\n") for line in textwrap.wrap(part, 100))]
    ax.set_title("\n".join(title), fontsize=10)
    if many:
        ax.legend(title=" / ".join(named) or None, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    else:
        ax.legend(title=" / ".join(named) or None, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    return save(fig, out, "loss_curves.png")


def all_plots(df: pd.DataFrame, labels: list[str], out: str | Path, bases: pd.Series | None = None) -> list[Path]:
    """Every plot that has something to show; returns the PNGs written. `bases`: each row's
    baseline (compare.baselines), which names the runs as the setting table does; None: computed."""
    return [p for p in (job() for job in plot_jobs(df, labels, out, bases)) if p is not None]


# The figures that take longest over 1,000 runs (2.1, 1.6 and 1.3 s on a CPU, against 1.0 s
# per Pareto plot and 0.5 s for the loss curves): drawn first when drawn side by side.
SLOWEST = ("module_breakdown", "batch_scan", "breakdown")


def slowest_first(jobs: list) -> list[int]:
    """The indices of plot_jobs' SLOWEST jobs, slowest first (figure.drawn's `first`)."""
    return [i for name in SLOWEST for i, job in enumerate(jobs) if job.func.__name__ == name]


def plot_jobs(df: pd.DataFrame, labels: list[str], out: str | Path, bases: pd.Series | None = None) -> list:
    """all_plots' plots as calls to make (functools.partial), in the report's order: each draws one
    figure of its own, so they can be drawn side by side (figure.drawn)."""
    from analysis.module_memory import module_breakdown  # reads the runs' memory_by_module.csv files

    # One breakdown and one batch scan per family of comparable runs, as the Pareto plots: bars and
    # lines of different models side by side would carry the same labels ("Baseline" three times).
    parts = families(df, labels)
    per_family = [functools.partial(plot, part, part_labels, out, bases, title)
                  for plot in (breakdown, batch_scan) for title, part, part_labels in parts]
    return [*pareto_jobs(df, labels, out, bases), *per_family, functools.partial(loss_curves, df, labels, out),
            functools.partial(module_breakdown, df, labels, out, bases)]
