"""Where the memory went, from the files runs leave beside result.json (ablate/artifacts.py): a plot
of the modules that hold the most memory at the traced step's peak (memory_by_module.csv), and the
table of CUDA allocator snapshots to open in memory_viz. Memory in MiB (2^20 bytes).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.plot_common import on_device, plt, run_label, save, setting_names, wrap

TOP = 10  # modules per run
MAX_RUNS = 8  # panels: the first runs in the report's order (a seven-rung ladder whole)
TITLE_WIDTH = 90  # characters per line of a panel title (9 pt over a 7.5-inch panel)
SNAPSHOT_NOTE = ("A snapshot opens in https://pytorch.org/memory_viz: drag the .pickle file onto the page "
                 "(it is read in the browser, nothing is uploaded).")
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")  # memory_by_module.csv's at_peak_<c>_mib


def _parent(name: str) -> str | None:
    """memory_by_module.csv's names: "transformer.h.0" -> "transformer.h"; "lm_head" -> "model"."""
    return None if name == "model" else name.rsplit(".", 1)[0] if "." in name else "model"


def own_shares(modules: pd.DataFrame) -> pd.DataFrame:
    """memory_by_module.csv -> each module's own share of the peak (MiB by category, columns
    CATEGORIES): its at_peak figures less its direct children's, so what its own ops allocated
    plus the parameters it holds itself, with their gradients and optimizer state. The shares
    partition the peak: they add up to the row "model", and no byte is in two of them. Column
    `leaf`: the module has no submodules."""
    inclusive = modules.set_index("module")[[f"at_peak_{c}_mib" for c in CATEGORIES]].astype(float)
    inclusive.columns = list(CATEGORIES)
    at, left = inclusive.to_numpy(), inclusive.to_numpy(copy=True)  # arrays: a .loc per module took 0.1 s a run
    row = {name: i for i, name in enumerate(inclusive.index)}
    for i, name in enumerate(inclusive.index):
        if (parent := row.get(_parent(name))) is not None:
            left[parent] -= at[i]
    own = pd.DataFrame(left, index=inclusive.index, columns=inclusive.columns)
    own = own.clip(lower=0)  # rounding in the CSV (1e-4 MiB) must not draw negative slivers
    own["leaf"] = ~own.index.isin([_parent(n) for n in inclusive.index])
    return own


def folded(own: pd.DataFrame) -> pd.DataFrame:
    """Repeated layers as one bar: numbered path parts become "*" ("transformer.h.*.mlp.c_fc"),
    their shares summed (all alive at the same moment, so they add up). Adds `count` (layers
    folded) and `total`; sorted by total, largest first."""
    key = [re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) for name in own.index]
    out = own.groupby(key, sort=False).agg({**dict.fromkeys(CATEGORIES, "sum"), "leaf": "all"})
    out["count"] = pd.Series(key).value_counts().reindex(out.index).to_numpy()
    out["total"] = out[list(CATEGORIES)].sum(axis=1)
    return out.sort_values("total", ascending=False, kind="stable")


def _bar_label(name: str, count: int, leaf: bool) -> str:
    text = name if leaf else f"{name} (own ops)"  # a parent's share: what it did outside its submodules
    return f"{text} ×{count}" if count > 1 else text


def _read(path) -> pd.DataFrame | None:
    if not isinstance(path, str) or not path:
        return None
    try:
        return pd.read_csv(path)
    except (OSError, ValueError) as exc:
        print(f"skipping {path}: {exc}", file=sys.stderr)
        return None


def _first_tables(df: pd.DataFrame, n: int) -> tuple[list, int]:
    """([(row, its memory_by_module.csv)] of the first n runs whose table reads and is not empty,
    how many runs have one). The runs after the n-th are counted by the file their result names,
    not read: a report over 1,000 runs would read 1,000 files to draw 6."""
    named = df[[isinstance(p, str) and bool(p) for p in df["artifact_memory_by_module"]]]
    runs: list = []
    for k, (_, row) in enumerate(named.iterrows()):
        if len(runs) == n:
            return runs, n + len(named) - k
        if (table := _read(row["artifact_memory_by_module"])) is not None and not table.empty:
            runs.append((row, table))
    return runs, len(runs)


def module_breakdown(df: pd.DataFrame, labels: list[str], out: str | Path,
                     bases: pd.Series | None = None) -> Path | None:
    """Per run (the first MAX_RUNS with a memory_by_module.csv), horizontal stacked bars of the TOP
    modules by their own share of the traced step's peak, coloured by category. Every module
    counts, parents by what they allocated outside their submodules ("own ops"; the root's is the
    loss and the optimizer step), so the bars never count a byte twice and answer "which layer
    holds the memory" at any depth. Each panel is named as the setting table names its run (`bases`:
    each row's baseline, as in setting_names)."""
    from analysis.plots import COMPONENTS  # the breakdown plot's colours and names (plots imports this module)

    if "artifact_memory_by_module" not in df:
        return None
    shown, with_table = _first_tables(df, MAX_RUNS)
    if not shown:
        return None
    names = setting_names(df, labels, bases)
    cols = 1 if len(shown) == 1 else 2
    grid = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(7.5 * cols, 4.2 * grid), squeeze=False)
    for ax, (row, table) in zip(axes.flat, shown):
        own = own_shares(table)
        bars = folded(own).head(TOP)
        y, left = np.arange(len(bars)), np.zeros(len(bars))
        for (key, text), colour in zip(COMPONENTS, plt.cm.tab10.colors):
            ax.barh(y, bars[key], left=left, color=colour, label=text, height=0.7)
            left += bars[key].to_numpy()
        peak = float(own[list(CATEGORIES)].to_numpy().sum())
        for i, total in enumerate(left):
            ax.annotate(f"{total:,.1f}" if total < 100 else f"{total:,.0f}", (total, i), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=7)
        ax.set_yticks(y, [_bar_label(n, int(c), lf) for n, c, lf in zip(bars.index, bars["count"], bars["leaf"])],
                      fontsize=8)
        ax.invert_yaxis()  # largest on top
        ax.set_xlim(0, left.max() * 1.18 if left.max() > 0 else 1)
        status = "" if row.get("status") == "ok" else f" [{row.get('status')}]"
        share = f"{left.sum() / peak:.0%} of the peak" if peak > 0 else ""
        # a leanest combination's name is ~200 characters: wrapped, or two panels' titles overlap
        ax.set_title(f"{wrap(names[row.name] + status, TITLE_WIDTH)}\npeak {peak:,.1f} MiB, top {len(bars)} hold {share}",
                     fontsize=9)
        ax.set_xlabel("own share of the traced step's peak (MiB)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    more = f" (first {len(shown)} of {with_table} runs)" if with_table > len(shown) else ""
    fig.suptitle(f"Where the memory was at the traced step's peak, by module{on_device(df)}{more}", fontsize=11)
    fig.tight_layout()
    return save(fig, out, "memory_by_module.png")


def _link(path, out: Path) -> str:
    """A Markdown link to `path` from the report's directory ("" for none): the HTML page renders it too."""
    if not isinstance(path, str) or not path:
        return ""
    return f"[{Path(path).name}]({Path(os.path.relpath(path, out)).as_posix()})"


def snapshot_table(df: pd.DataFrame, labels: list[str], out: str | Path) -> pd.DataFrame:
    """One row per run that left a CUDA allocator snapshot: links to it (the traced step's, the
    one at an OOM) and to its memory_by_module.csv. Empty when no run has one (a CPU sweep)."""
    cols = {"artifact_memory_snapshot": "Traced step", "artifact_oom_snapshot": "At the OOM",
            "artifact_memory_by_module": "Per module"}
    if not any(c in df and df[c].notna().any() for c in list(cols)[:2]):
        return pd.DataFrame()
    rows = []
    for _, row in df.iterrows():
        if not any(isinstance(row.get(c), str) for c in list(cols)[:2]):
            continue
        rows.append({"Run": run_label(row, labels), "Status": row["status"],
                     **{title: _link(row.get(c), Path(out)) for c, title in cols.items()}})
    return pd.DataFrame(rows)
