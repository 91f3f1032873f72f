"""The report's memory-vs-speed plot: peak memory against iteration time per ok run, the Pareto front
as a step line, OOMs at the card's capacity. Each point is named as the setting table names its row
(what differs from the baseline): beside its marker when few points leave room, else by a number
with "number  name" listed beside the plot. Memory is the torch allocator's peak of allocated bytes,
MiB = 2^20 bytes; times in ms.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from analysis.table_cells import MEMORY
from analysis.plot_common import (DPI, card, changed, family_file, is_status, num, on_device, plt, save, setting_names,
                             skipped, table_order, wrap)
from analysis.point_labels import box, numbered, place

DIRECT = 6  # up to this many points (OOMs included) are named beside their markers; more are numbered
# Final losses whose spread is below this fraction of the loss count as one: techniques that keep the
# math (recompute, offload, accumulation, DDP/FSDP) end within float reordering of each other, about
# 1e-6 relative in fp32 and up to 1e-4 with TF32 or non-deterministic kernels over a short run, while a
# change of optimizer, precision or batch moves the loss by 0.1% and more. A colour scale over less
# would stretch numerics over the whole bar.
LOSS_SPREAD = 1e-3
RING, DOT, CROSS = math.sqrt(160) / 2, math.sqrt(50) / 2, math.sqrt(60) / 2  # marker radii (points): s is an area
FONT = 7.5  # points, labels and key
KEY_WIDTH = 48  # characters per line of a name in the key
LINE_IN = FONT * 1.45 / 72  # inches per line of the key, its spacing included
KEY_LINES = 75  # lines of the key in one column (about 11 inches); two columns past that
# Past this many points only the Pareto front's are numbered and listed, the others drawn as dots: a
# key of hundreds of names is read by no one (the setting table lists every run), and placing a
# number for each took minutes at 500 points.
LISTED = 40
LISTED_OOMS = 10  # OOMs named in the key; past that they are counted


def pareto_front(points) -> list[int]:
    """Indices of the (x, y) points no other point beats in both (lower is better), sorted by x."""
    pts = [(float(x), float(y)) for x, y in points]
    front = [i for i, (x, y) in enumerate(pts)
             if not any(a <= x and b <= y and (a < x or b < y) for a, b in pts)]
    return sorted(front, key=lambda i: pts[i])


def _capacity(df: pd.DataFrame, oom: pd.DataFrame, peaks: pd.Series) -> tuple[float, str]:
    """Where the OOMs sit on the memory axis (MiB) and the legend's words for it: the card they ran
    out of (`gpu_memory_gib=8,null`: the 8 GiB card, not the whole GPU the other runs had), else
    the rows' one card, else just past the data, saying the card is unknown."""
    known = card(oom) or card(df)
    if known:
        return known[0], f"OOM: {known[1]}"
    return 1.05 * float(peaks.max()), "OOM (card unknown)"


def loss_differs(loss: np.ndarray) -> bool:
    """Whether the known final losses differ by more than LOSS_SPREAD of their size."""
    loss = loss[np.isfinite(loss)]
    return len(loss) > 1 and np.ptp(loss) > LOSS_SPREAD * np.abs(np.median(loss))


def _points(fig, ax, x, y, loss, front) -> None:
    """The front as a staircase (nothing on it beats another in both), its runs ringed (one run still
    shows), each run coloured by its final loss where those differ (loss_differs), else one colour."""
    ax.step(x[front], y[front], where="post", color="0.2", lw=1.2, zorder=1)
    ax.scatter(x[front], y[front], s=RING ** 2 * 4, facecolors="none", edgecolors="0.2", linewidths=1.2,
               zorder=2, label="Pareto front")
    has = np.isfinite(loss)
    style = dict(s=DOT ** 2 * 4, edgecolors="k", linewidths=0.5, zorder=3)
    if loss_differs(loss):
        sc = ax.scatter(x[has], y[has], c=loss[has], cmap="viridis", **style)
        fig.colorbar(sc, ax=ax, label="final loss", fraction=0.04, aspect=30)
    elif has.any():  # one loss for all: a colour scale would invent a spread
        spread = np.ptp(loss[has])
        ax.scatter(x[has], y[has], color=plt.get_cmap("viridis")(0.5), **style,
                   label=f"final loss {np.median(loss[has]):.4f} (every run"
                         + (f", spread {spread:.1g})" if spread else ")"))
    if (~has).any():
        ax.scatter(x[~has], y[~has], color="0.7", **style, label="no final loss")


def _oom(ax, df: pd.DataFrame, ok: pd.DataFrame, oom: pd.DataFrame) -> tuple[float, float] | None:
    """The capacity line and a red x per OOM at its height; returns where the x is (data), or None."""
    if oom.empty:
        return None
    (cap, text), y = _capacity(df, oom, ok[MEMORY]), float(ok["iter_time_ms"].median())
    ax.axvline(cap, color="red", ls="--", lw=1, label=text)
    ax.scatter([cap], [y], marker="x", color="red", s=CROSS ** 2 * 4, zorder=4)
    if cap > 4 * ok[MEMORY].max() and ok[MEMORY].min() > 0:
        # a whole GPU next to small runs would squash them against the y-axis
        ax.set_xscale("log")
        ax.set_xlim(ok[MEMORY].min() / 1.5, cap * 1.5)
    else:  # a small card's OOMs beside an uncapped baseline: the axis still reaches the baseline
        ax.set_xlim(0, max(cap, float(ok[MEMORY].max())) * 1.05)
    return cap, y


def _legend(fig, ax, key: list[tuple[object, str]], cols: int = 1):
    """One legend outside the axes, right of the colour bar (it hides no point): what the marks mean,
    then `key`'s (handle or None, text) entries, in `cols` columns."""
    handles, texts = ax.get_legend_handles_labels()
    blank = Line2D([], [], ls="none")
    handles += [h or blank for h, _ in key]
    texts += [t for _, t in key]
    return fig.legend(handles, texts, loc="outside right upper", fontsize=FONT, handlelength=1.6, ncols=cols)


def _key(names: list[str], oom_names: list[str], unlisted: int = 0) -> list[tuple[object, str]]:
    """'number  name' per point (the name wrapped, its later lines indented), a line for the
    `unlisted` points, and each OOM by name (counted past LISTED_OOMS)."""
    cross = Line2D([], [], ls="none", marker="x", color="red")
    indent = "\n" + " " * 6
    key = [(None, f"{k:>2}  " + wrap(n, KEY_WIDTH).replace("\n", indent)) for k, n in enumerate(names, 1)]
    if unlisted:
        key.append((None, wrap(f"numbered: the baseline and the Pareto front; {unlisted} other runs are the "
                               "dots without a number (the setting table lists every run)", KEY_WIDTH)))
    if len(oom_names) > LISTED_OOMS:
        return key + [(cross, wrap(f"{len(oom_names)} runs out of memory (the setting table names them)", KEY_WIDTH))]
    return key + [(cross, wrap(n, KEY_WIDTH) + " (OOM)") for n in oom_names]


def _item(name: str, bullet: bool) -> str:
    """One OOM's name under the red x. Among several, each starts with a bullet and its later lines
    are indented: a setting name's lines each start with "+ ", so two names ran together."""
    lines = wrap(name, 32).split("\n")
    return "\n".join(("• " if i == 0 else "  ") + line for i, line in enumerate(lines)) if bullet else "\n".join(lines)


def _name_beside(ax, pts, names, radii, oom_at, oom_names) -> bool:
    """Each name beside its point, the OOMs' beside the red x; False (nothing drawn) where one finds no room."""
    oom_anns: list = []
    if oom_at is not None:
        text = "OOM:\n" + "\n".join(_item(n, len(oom_names) > 1) for n in oom_names)
        oom_anns, failed = place(ax, [oom_at], [text], [CROSS], over_markers=False, fontsize=FONT, color="red")
        if failed is not None:
            return False
    renderer = ax.figure.canvas.get_renderer()
    _, failed = place(ax, pts, [wrap(n, 32) for n in names], radii, [box(a, renderer) for a in oom_anns],
                      over_markers=False, fontsize=FONT)  # a name over another point: number them instead
    if failed is not None:
        for a in oom_anns:
            a.remove()
    return failed is None


def pareto(df: pd.DataFrame, labels: list[str], out: str | Path, name: str = "pareto.png",
           bases: pd.Series | None = None, family: str | None = None) -> Path | None:
    """Peak memory vs iteration time per ok run, the Pareto front, OOMs at capacity, each point
    named by its setting label (`bases`: each row's baseline, compare.baselines; None: computed).
    `family`: what the runs share, for the title ("model=gpt2, seq_len=64")."""
    if df.empty:
        return None
    ok = df[is_status(df, "ok")]
    ok = ok.assign(**{c: num(ok, c) for c in (MEMORY, "iter_time_ms", "loss_final")})
    ok = ok[np.isfinite(ok[MEMORY]) & np.isfinite(ok["iter_time_ms"])]
    if ok.empty:
        return None
    names = setting_names(df, labels, bases)
    ok = ok.loc[table_order(names[ok.index])]  # numbered as the setting table lists its rows
    oom = df[is_status(df, "oom") & ~skipped(df)]  # a point a ladder never ran is no OOM
    x, y = ok[MEMORY].to_numpy(), ok["iter_time_ms"].to_numpy()
    front = pareto_front(zip(x, y))
    fig, ax = plt.subplots(figsize=(9.5, 5), layout="constrained", dpi=DPI)
    _points(fig, ax, x, y, ok["loss_final"].to_numpy(), front)
    oom_at = _oom(ax, df, ok, oom)
    ax.margins(x=0.1, y=0.1)  # room for the labels beside the outermost points
    ax.set_xlabel("peak allocated memory (MiB" + (", log scale)" if ax.get_xscale() == "log" else ")"))
    ax.set_ylabel("iteration time (ms, median)")
    model = f" of {df['model'].iloc[0]}" if "model" in df and df["model"].nunique() == 1 else ""
    ax.set_title(f"Memory vs. speed{model}{on_device(df)}\n({family + '; ' if family else ''}lower-left is better)",
                 fontsize=11)
    ax.grid(alpha=0.3)
    pts, radii = list(zip(x, y)), [RING if i in front else DOT for i in range(len(x))]
    point_names, oom_names = list(names[ok.index]), list(names[oom.index])
    if len(pts) + len(oom_names) <= DIRECT:
        legend = _legend(fig, ax, [])
        fig.draw_without_rendering()  # the layout: where each point is drawn
        if _name_beside(ax, pts, point_names, radii, oom_at, oom_names):
            return save(fig, out, name)
        legend.remove()
    # past LISTED points, the baseline's and the front's alone, in the setting table's order
    base = {i for i, n in enumerate(point_names) if changed(n) == 0}
    listed = list(range(len(pts))) if len(pts) <= LISTED else sorted(base | set(front))[:LISTED]
    _number(fig, ax, pts, radii, point_names, oom_at, oom_names, listed)
    return save(fig, out, name)


def _number(fig, ax, pts, radii, names: list[str], oom_at, oom_names: list[str], listed: list[int]) -> None:
    """Numbers beside the `listed` points, "number  name" in the legend (the figure grows to hold
    it); the other points' markers kept clear of where they can be."""
    rest = sorted(set(range(len(pts))) - set(listed))
    key = _key([names[i] for i in listed], oom_names, len(rest))
    lines = [1] * 4 + [t.count("\n") + 1 for _, t in key]  # per entry, the marks' own four at most first
    cols = 1 if sum(lines) <= KEY_LINES else 2  # side by side past KEY_LINES: the plot would grow thin and tall
    per = math.ceil(len(lines) / cols)  # entries per column, as the legend splits them
    tallest = max(sum(lines[i:i + per]) for i in range(0, len(lines), per))
    fig.set_size_inches(9.5 + cols * KEY_WIDTH * FONT * 0.5 / 72, max(5.0, tallest * LINE_IN + 1.0))
    _legend(fig, ax, key, cols)
    fig.draw_without_rendering()  # the layout: where each point is drawn
    avoid = []
    if oom_at is not None:
        avoid = [box(a, fig.canvas.get_renderer())
                 for a in place(ax, [oom_at], ["OOM"], [CROSS], fontsize=FONT, color="red")[0]]
    numbered(ax, [pts[i] for i in listed], [radii[i] for i in listed], avoid, fontsize=FONT, fontweight="bold",
             others=([pts[i] for i in rest], [radii[i] for i in rest]))


def paretos(df: pd.DataFrame, labels: list[str], out: str | Path,
            bases: pd.Series | None = None) -> list[Path | None]:
    """One Pareto plot per family of comparable runs (compare.families: one per model, seq_len, ...),
    pareto-<family>.png when there are several: a small model beats a large one in both memory and
    time, so a shared front would say nothing about the techniques."""
    return [job() for job in pareto_jobs(df, labels, out, bases)]


def pareto_jobs(df: pd.DataFrame, labels: list[str], out: str | Path, bases: pd.Series | None = None) -> list:
    """paretos' plots as calls to make (functools.partial), one per family."""
    from analysis.compare import families

    return [functools.partial(pareto, part, part_labels, out, family_file("pareto", title), bases, title)
            for title, part, part_labels in families(df, labels)]
