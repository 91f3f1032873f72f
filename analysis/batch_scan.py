"""The report's batch-size scan: peak memory (and, for measured runs, model TFLOP/s) against batch
size, one line per combination of the other labels, each named as the setting table names it (what
it changes against the baseline); OOMs and points a ladder never ran marked at their batch size. A
plan (predict_only) shows its predicted peaks alone. Memory is the torch allocator's peak of
allocated bytes, MiB = 2^20 bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.table_cells import MEMORY, flops
from analysis.compare import spelled
from analysis.plot_common import (DPI, baselines, card, change_name, changed, family_file, is_status, num, on_device,
                             plt, save, series, skipped, wrap)
from analysis.point_labels import drop_crowded, thin_ticks

NAME_WIDTH = 48  # characters per line of a run's name in a legend
# (marker, line style) per ten series, tab10's colours repeating within each: 40 series stay apart
STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))
# The first this many lines in the setting table's order (fewest changes first), the title counting
# the rest: hundreds make a figure no one reads; the tables and runs.csv hold them all.
MAX_LINES = len(STYLES) * 10


def _mark_oom(ax, sizes, unrun, y: float, text: bool) -> list:
    """Red x per OOM batch size at height y in axes coordinates (0 = x-axis, 1 = top); a grey hollow
    circle per size that never ran because a smaller one ran out of memory (a ladder's "not run").
    With `text`, the word under each mark; returns those words."""
    tr = ax.get_xaxis_transform()  # x in data, y in axes fraction
    marks = [(b, dict(marker="x", color="red", mew=2), "OOM") for b in sizes]
    marks += [(b, dict(marker="o", color="0.5", mfc="none", mew=1.5), "not run") for b in unrun]
    words = []
    for b, style, word in marks:
        ax.plot([b], [y], ms=9, transform=tr, clip_on=False, zorder=5, **style)
        if text:
            words.append(ax.text(b, y - 0.05, word, color=style["color"], ha="center", va="top", fontsize=8,
                                 transform=tr))
    return words


def _oom_key(oom, unrun, word: str, where: str = "") -> str:
    """The title's key to the marks: ' (x = OOM, o = not run)', or '' with none drawn."""
    keys = ([f"x{where} = {word}"] if oom else []) + ([f"o{where} = not run"] if unrun else [])
    return f" ({', '.join(keys)})" if keys else ""


def _series(df: pd.DataFrame, ok: pd.DataFrame, others: list[str], labels: list[str], bases) -> list:
    """(name, rows) per combination of the other labels, named by what it changes against the
    baseline (change_name: "Baseline", "+ Block recompute"), fewest changes first."""
    if not others or "status" not in df:
        return list(series(ok, others))
    base_of = baselines(df, labels, bases)
    parts = [rows for _, rows in series(ok, others)]
    first = [rows.index[0] for rows in parts]
    runs = dict(df.loc[list(dict.fromkeys([*first, *base_of[first]]))].iterrows())  # each row once, not a .loc each
    named = [(change_name(runs[i], runs[base_of[i]], others), rows) for i, rows in zip(first, parts)]
    return sorted(named, key=lambda s: (changed(s[0]), s[0]))


def _scan_lines(panels, named: list, plan: bool) -> None:
    """One line per series in each (axes, column) panel; tab10's colours, then other markers and dashes."""
    for i, (name, rows) in enumerate(named):
        marker, ls = STYLES[i // 10 % len(STYLES)]
        rows = rows.sort_values("batch_size")
        for ax, col in panels:
            r = rows[np.isfinite(rows[col])]
            ax.plot(r["batch_size"], r[col], marker=marker, ls="--" if plan else ls, color=plt.cm.tab10.colors[i % 10],
                    label=wrap(name, NAME_WIDTH))


def batch_scan(df: pd.DataFrame, labels: list[str], out: str | Path, bases: pd.Series | None = None,
               family: str | None = None) -> Path | None:
    """Peak memory and TFLOP/s vs batch size, one line per combination of the other labels (named as
    in _series; `bases` as in setting_names). A plan that ran nothing (predict_only) gets its
    predicted peaks alone, with the OOMs it predicted. `family` as in breakdown."""
    if df.empty or "batch_size" not in df:
        return None
    raw, df = df, df.assign(**{c: num(df, c) for c in ("batch_size", MEMORY, "tflops", "predicted_peak_mib")})
    df = df[np.isfinite(df["batch_size"])]
    ok, memory = df[is_status(df, "ok") & (np.isfinite(df[MEMORY]) | np.isfinite(df["tflops"]))], MEMORY
    plan = ok.empty
    if plan:  # never measured and predicted in one figure (as in breakdown): the plan's own numbers
        ok, memory = df[is_status(df, "predicted") & np.isfinite(df["predicted_peak_mib"])], "predicted_peak_mib"
    if df["batch_size"].nunique() < 2 or ok.empty:
        return None
    unit = flops(ok["tflops"])[0]  # the tables' unit: GFLOP/s where no run reaches 0.1 TFLOP/s
    ok = ok.assign(flop_rate=ok["tflops"] * (1e3 if unit == "GFLOP/s" else 1.0))
    others = [c for c in labels if c in df and c != "batch_size"]
    named = _series(raw, ok, others, labels, bases)  # named from the rows as loaded (batch sizes as ints)
    shown = f"\n(the first {MAX_LINES} of {len(named)} lines, fewest changes first)" if len(named) > MAX_LINES else ""
    named = named[:MAX_LINES]
    lines = sum(n.count("\n") + 1 for n in (wrap(n, NAME_WIDTH) for n, _ in named)) + 2
    fig, axes = plt.subplots(1, 1 if plan else 2, figsize=((6 if plan else 11) + 3, max(4.5, lines * 0.16 + 1.5)),
                             sharex=True, squeeze=False, layout="constrained", dpi=DPI)
    mem, tfl = axes[0][0], (None if plan else axes[0][1])
    _scan_lines([(mem, memory)] + ([] if plan else [(tfl, "flop_rate")]), named, plan)
    never = skipped(df)
    oom = sorted(df.loc[is_status(df, "oom") & ~never, "batch_size"].unique())
    unrun = sorted(set(df.loc[never, "batch_size"]) - set(oom))  # an OOM of any series wins the size's mark
    _memory_panel(mem, df, ok, memory, oom, unrun, plan)
    if tfl is not None:
        _throughput_panel(tfl, ok, oom, unrun, unit)
    handles, texts = mem.get_legend_handles_labels()  # the same series in both panels: one legend
    if others or len(handles) > len(named):  # series worth naming, or the card's line
        fig.legend(handles, texts, loc="outside right upper", fontsize=8,
                   title="against the baseline" if others and "status" in df else None, title_fontsize=8)
    fig.suptitle(f"Batch-size scan{' plan (nothing ran)' if plan else ''}{on_device(df)}{shown}"
                 + (f"\n({family})" if family else ""))
    fig.draw_without_rendering()  # the layout, then what would collide in it
    renderer = fig.canvas.get_renderer()
    thin_ticks(mem.xaxis, renderer)
    _inside(mem, renderer)
    drop_crowded(mem.texts, renderer)  # "OOM" / "not run" words of neighbouring sizes: the title keys the marks
    return save(fig, out, family_file("batch_scan", family))


def _inside(ax, renderer) -> None:
    """A word under a mark at the axes' edge ends there instead of crossing it (ha right or left)."""
    frame = ax.get_window_extent(renderer)
    for word in ax.texts:
        b = word.get_window_extent(renderer)
        if b.x1 > frame.x1 or b.x0 < frame.x0:
            word.set_horizontalalignment("right" if b.x1 > frame.x1 else "left")


def _memory_panel(mem, df: pd.DataFrame, ok: pd.DataFrame, memory: str, oom, unrun, plan: bool) -> None:
    """The memory panel's card line, OOM marks, log-2 batch axis and titles."""
    known = card(df)
    if known and known[0] <= 2 * ok[memory].max():  # a far bigger card would squash the lines flat
        mem.axhline(known[0], color="red", ls=":", lw=1, label=known[1])
    mem.set_ylim(0, mem.get_ylim()[1] * 1.15)  # headroom for the OOM marks at the top
    _mark_oom(mem, oom, unrun, 1.0, text=True)
    sizes = sorted(df["batch_size"].unique())
    if sizes[0] > 0:
        mem.set_xscale("log", base=2)  # batch sizes are usually doublings
    mem.set_xticks(sizes, [spelled(s) for s in sizes])
    mem.minorticks_off()
    predicted = "predicted " if plan else ""
    mem.set(xlabel="batch size (samples per step)", ylabel=f"{predicted}peak allocated memory (MiB)",
            title=f"{predicted}peak memory".capitalize() + _oom_key(oom, unrun, f"{predicted}OOM"))
    mem.grid(alpha=0.3)


def _throughput_panel(tfl, ok: pd.DataFrame, oom, unrun, unit: str) -> None:
    tfl.set_ylim(bottom=0)
    if not np.isfinite(ok["tflops"]).any():
        tfl.text(0.5, 0.5, "no FLOP/s measured", transform=tfl.transAxes, ha="center", color="0.4")
    _mark_oom(tfl, oom, unrun, 0.0, text=False)
    tfl.set(xlabel="batch size (samples per step)", ylabel=f"{unit} (model FLOPs per device)",
            title="Throughput" + _oom_key(oom, unrun, "OOM", " on axis"))
    tfl.grid(alpha=0.3)
