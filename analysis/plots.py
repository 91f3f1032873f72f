"""Figures for the report, one function per plot.

Each takes the loaded runs (`analysis.load.load`), the columns whose values name a run (`labels`, e.g.
`report.varied(df)`) and an output directory; it writes one PNG and returns its Path, or None when the
data has nothing to show. Memory is the torch allocator's peak of allocated bytes, MiB = 2^20 bytes.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from analysis.compare import varies
from analysis.figure import as_text, card, fmt, is_status, num, on_device, plt, run_label, save, series, skipped

MEMORY = "peak_allocated_mib"
# (breakdown component, legend text), stacked in this order: what the model owns, then what training adds.
COMPONENTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
              ("activations", "activations"), ("other", "other"))
LOSS_VARIANTS = ("precision", "optimizer")  # runs that differ only in these should train alike


def pareto_front(points) -> list[int]:
    """Indices of the (x, y) points no other point beats in both (lower is better), sorted by x."""
    pts = [(float(x), float(y)) for x, y in points]
    front = [i for i, (x, y) in enumerate(pts)
             if not any(a <= x and b <= y and (a < x or b < y) for a, b in pts)]
    return sorted(front, key=lambda i: pts[i])


def _capacity(df: pd.DataFrame, peaks: pd.Series) -> float:
    """Where an OOM sits on the memory axis: the card's memory (MiB) when known, else just past the data."""
    known = card(df)
    return known[0] if known else 1.05 * float(peaks.max())


def _pareto_oom(ax, df: pd.DataFrame, ok: pd.DataFrame, labels: list[str]) -> None:
    oom = df[is_status(df, "oom") & ~skipped(df)]  # a point a ladder never ran is no OOM
    if oom.empty:
        return
    cap, y = _capacity(df, ok[MEMORY]), float(ok["iter_time_ms"].median())
    ax.axvline(cap, color="red", ls="--", lw=1, label=f"OOM (capacity {cap:,.0f} MiB)")
    ax.scatter([cap] * len(oom), [y] * len(oom), marker="x", color="red", s=60, zorder=4)
    names = "\n".join(run_label(r, labels) for _, r in oom.iterrows())
    ax.annotate(f"OOM:\n{names}", (cap, y), xytext=(-6, 0), textcoords="offset points",
                ha="right", va="center", fontsize=7, color="red")
    if cap > 4 * ok[MEMORY].max() and ok[MEMORY].min() > 0:
        # a whole GPU next to small runs would squash them against the y-axis
        ax.set_xscale("log")
        ax.set_xlim(ok[MEMORY].min() / 1.5, cap * 1.5)
    else:
        ax.set_xlim(0, cap * 1.05)


def pareto(df: pd.DataFrame, labels: list[str], out: str | Path, name: str = "pareto.png") -> Path | None:
    """Peak memory vs iteration time per ok run, the Pareto front as a step line, OOMs at capacity."""
    if df.empty:
        return None
    ok = df[is_status(df, "ok")]
    ok = ok.assign(**{c: num(ok, c) for c in (MEMORY, "iter_time_ms", "loss_final")})
    ok = ok[np.isfinite(ok[MEMORY]) & np.isfinite(ok["iter_time_ms"])]
    if ok.empty:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    x, y, loss = ok[MEMORY].to_numpy(), ok["iter_time_ms"].to_numpy(), ok["loss_final"].to_numpy()
    front = pareto_front(zip(x, y))
    # the front as a staircase (nothing on it beats another in both), its runs ringed: one run still shows
    ax.step(x[front], y[front], where="post", color="0.2", lw=1.2, zorder=1)
    ax.scatter(x[front], y[front], s=160, facecolors="none", edgecolors="0.2", linewidths=1.2, zorder=2,
               label="Pareto front")
    has_loss = np.isfinite(loss)
    if has_loss.any() and np.ptp(loss[has_loss]) > 1e-6 * np.abs(loss[has_loss]).max():
        sc = ax.scatter(x[has_loss], y[has_loss], c=loss[has_loss], cmap="viridis", s=50,
                        edgecolors="k", linewidths=0.5, zorder=3)
        fig.colorbar(sc, ax=ax, label="final loss")
    elif has_loss.any():  # one loss for all (techniques that keep the math): a colour scale would invent a spread
        ax.scatter(x[has_loss], y[has_loss], color=plt.get_cmap("viridis")(0.5), s=50, edgecolors="k",
                   linewidths=0.5, zorder=3, label=f"final loss {loss[has_loss][0]:.4f} (every run)")
    if (~has_loss).any():
        ax.scatter(x[~has_loss], y[~has_loss], color="0.7", s=50, edgecolors="k", linewidths=0.5,
                   zorder=3, label="no final loss")
    for (_, row), xi, yi in zip(ok.iterrows(), x, y):
        ax.annotate(run_label(row, labels), (xi, yi), xytext=(4, 4), textcoords="offset points", fontsize=7)
    _pareto_oom(ax, df, ok, labels)
    ax.margins(x=0.12, y=0.08)  # room for the run labels written to the right of each marker
    ax.set_xlabel("peak allocated memory (MiB" + (", log scale)" if ax.get_xscale() == "log" else ")"))
    ax.set_ylabel("iteration time (ms, median)")
    model = f" of {df['model'].iloc[0]}" if "model" in df and df["model"].nunique() == 1 else ""
    ax.set_title(f"Memory vs. speed{model}{on_device(df)} (lower-left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save(fig, out, name)


def paretos(df: pd.DataFrame, labels: list[str], out: str | Path) -> list[Path | None]:
    """One Pareto plot per model (pareto-<model>.png when there are several): a small model beats a
    large one in both memory and time, so a shared front would say nothing about the techniques."""
    from analysis.compare import by_model

    return [pareto(part, part_labels, out,
                   "pareto.png" if model is None else f"pareto-{re.sub(r'[^A-Za-z0-9._-]+', '-', str(model))}.png")
            for model, part, part_labels in by_model(df, labels)]


def breakdown(df: pd.DataFrame, labels: list[str], out: str | Path) -> Path | None:
    """Stacked bars of where each ok run's peak memory went (MiB), total at the end of each bar.
    A plan that ran nothing (predict_only) gets its predicted peaks split the same way."""
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
    names = [run_label(r, labels) for _, r in ok.iterrows()]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.45 * len(ok) + 1.5)))
    rows, left = np.arange(len(ok)), np.zeros(len(ok))
    for (_, text), col, colour in zip(COMPONENTS, cols, plt.cm.tab10.colors):
        ax.barh(rows, parts[col], left=left, color=colour, label=text, height=0.7)
        left += parts[col].to_numpy()
    for i, total in enumerate(left):
        ax.annotate(f"{total:,.0f}", (total, i), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(rows, names, fontsize=8)
    ax.invert_yaxis()  # first run on top, like the table
    ax.set_xlim(0, left.max() * 1.15 if left.max() > 0 else 1)
    ax.set_xlabel("memory at peak (MiB)")
    ax.set_title(f"{title}{on_device(df)}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides a bar
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out, "breakdown.png")


def _mark_oom(ax, sizes, unrun, y: float, text: bool) -> None:
    """Red x per OOM batch size at height y in axes coordinates (0 = x-axis, 1 = top); a grey hollow
    circle per size that never ran because a smaller one ran out of memory (a ladder's "not run")."""
    tr = ax.get_xaxis_transform()  # x in data, y in axes fraction
    marks = [(b, dict(marker="x", color="red", mew=2), "OOM") for b in sizes]
    marks += [(b, dict(marker="o", color="0.5", mfc="none", mew=1.5), "not run") for b in unrun]
    for b, style, word in marks:
        ax.plot([b], [y], ms=9, transform=tr, clip_on=False, zorder=5, **style)
        if text:
            ax.text(b, y - 0.05, word, color=style["color"], ha="center", va="top", fontsize=8, transform=tr)


def _oom_key(oom, unrun, word: str, where: str = "") -> str:
    """The title's key to the marks: ' (x = OOM, o = not run)', or '' with none drawn."""
    keys = ([f"x{where} = {word}"] if oom else []) + ([f"o{where} = not run"] if unrun else [])
    return f" ({', '.join(keys)})" if keys else ""


def batch_scan(df: pd.DataFrame, labels: list[str], out: str | Path) -> Path | None:
    """Peak memory and TFLOP/s vs batch size, one line per combination of the other labels. A plan
    that ran nothing (predict_only) gets its predicted peaks alone, with the OOMs it predicted."""
    if df.empty or "batch_size" not in df:
        return None
    df = df.assign(**{c: num(df, c) for c in ("batch_size", MEMORY, "tflops", "predicted_peak_mib")})
    df = df[np.isfinite(df["batch_size"])]
    ok, memory = df[is_status(df, "ok") & (np.isfinite(df[MEMORY]) | np.isfinite(df["tflops"]))], MEMORY
    plan = ok.empty
    if plan:  # never measured and predicted in one figure (as in breakdown): the plan's own numbers
        ok, memory = df[is_status(df, "predicted") & np.isfinite(df["predicted_peak_mib"])], "predicted_peak_mib"
    if df["batch_size"].nunique() < 2 or ok.empty:
        return None
    others = [c for c in labels if c in df and c != "batch_size"]
    fig, axes = plt.subplots(1, 1 if plan else 2, figsize=(6 if plan else 11, 4.5), sharex=True,
                             squeeze=False)
    mem, tfl = axes[0][0], (None if plan else axes[0][1])
    panels = [(mem, memory)] + ([] if plan else [(tfl, "tflops")])
    for (name, rows), colour in zip(series(ok, others), plt.cm.tab10.colors * 10):
        rows = rows.sort_values("batch_size")
        for ax, col in panels:
            r = rows[np.isfinite(rows[col])]
            ax.plot(r["batch_size"], r[col], "o--" if plan else "o-", color=colour, label=name)
    never = skipped(df)
    oom = sorted(df.loc[is_status(df, "oom") & ~never, "batch_size"].unique())
    unrun = sorted(set(df.loc[never, "batch_size"]) - set(oom))  # an OOM of any series wins the size's mark
    known = card(df)
    line = None
    if known and known[0] <= 2 * ok[memory].max():  # a far bigger card would squash the lines flat
        line = mem.axhline(known[0], color="red", ls=":", lw=1, label=known[1])
    mem.set_ylim(0, mem.get_ylim()[1] * 1.15)  # headroom for the OOM marks at the top
    _mark_oom(mem, oom, unrun, 1.0, text=True)
    sizes = sorted(df["batch_size"].unique())
    if sizes[0] > 0:
        mem.set_xscale("log", base=2)  # batch sizes are usually doublings
    mem.set_xticks(sizes, [fmt(s) for s in sizes])
    mem.minorticks_off()
    predicted = "predicted " if plan else ""
    mem.set(xlabel="batch size (samples per step)", ylabel=f"{predicted}peak allocated memory (MiB)",
            title=f"{predicted}peak memory".capitalize() + _oom_key(oom, unrun, f"{predicted}OOM"))
    mem.grid(alpha=0.3)
    if plan and (others or line):
        mem.legend(title=" / ".join(others) or None, fontsize=8)
    elif line:  # measured runs are named in the TFLOP/s panel's legend
        mem.legend(handles=[line], fontsize=8)
    if tfl is not None:
        tfl.set_ylim(bottom=0)
        if not np.isfinite(ok["tflops"]).any():
            tfl.text(0.5, 0.5, "no TFLOP/s measured", transform=tfl.transAxes, ha="center", color="0.4")
        _mark_oom(tfl, oom, unrun, 0.0, text=False)
        tfl.set(xlabel="batch size (samples per step)", ylabel="TFLOP/s (model FLOPs per device)",
                title="Throughput" + _oom_key(oom, unrun, "OOM", " on axis"))
        tfl.grid(alpha=0.3)
        if tfl.get_legend_handles_labels()[0]:  # no TFLOP/s line (CPU runs without them): no empty legend
            tfl.legend(title=" / ".join(others) or None, fontsize=8)
    fig.suptitle(f"Batch-size scan{' plan (nothing ran)' if plan else ''}{on_device(df)}")
    return save(fig, out, "batch_scan.png")


def _curve(value) -> list[float] | None:
    """A per-step loss list as floats, or None when the value is not a non-empty list."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        return None
    return [float(v) if v is not None else np.nan for v in value]


def loss_group(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """The largest set (>= 2) of ok runs with curves that differ only in precision/optimizer; may be empty."""
    if df.empty or "losses" not in df:
        return df.iloc[0:0]
    runs = df[is_status(df, "ok") & df["losses"].map(lambda v: _curve(v) is not None)]
    keys = [c for c in labels if c in runs and c.split(".")[0] not in LOSS_VARIANTS]  # optimizer.lr is the optimizer's
    if not keys:
        return runs if len(runs) >= 2 else runs.iloc[0:0]
    # ties go to the group met first in the data (the sweep's order)
    groups = [part.index for _, part in as_text(runs, keys).groupby(keys, sort=False)]
    best = max(groups, key=len, default=[])
    return runs.loc[best] if len(best) >= 2 else runs.iloc[0:0]


def loss_curves(df: pd.DataFrame, labels: list[str], out: str | Path) -> Path | None:
    """Per-step training loss of runs that differ only in precision and/or optimizer."""
    group = loss_group(df, labels)
    if len(group) < 2:
        return None
    named = [c for c in labels if c in group and c.split(".")[0] in LOSS_VARIANTS and varies(group[c])]
    fixed = [c for c in labels if c in group and c.split(".")[0] not in LOSS_VARIANTS]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for _, row in group.iterrows():
        y = _curve(row["losses"])
        ax.plot(np.arange(1, len(y) + 1), y, lw=1.2, label=run_label(row, named))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    where = ", ".join(f"{c}={fmt(group[c].iloc[0])}" for c in fixed)
    ax.set_title(f"Training loss{on_device(df)}" + (f" ({where})" if where else ""))
    ax.legend(title=" / ".join(named) or None, fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, out, "loss_curves.png")


def all_plots(df: pd.DataFrame, labels: list[str], out: str | Path) -> list[Path]:
    """Every plot that has something to show; returns the PNGs written."""
    from analysis.where import module_breakdown  # reads the runs' memory_by_module.csv files

    paths = [*paretos(df, labels, out),
             *(plot(df, labels, out) for plot in (breakdown, batch_scan, loss_curves, module_breakdown))]
    return [p for p in paths if p is not None]
