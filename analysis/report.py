"""Every result.json below the paths -> the tables and plots memory studies publish.

Prints Markdown to stdout; writes report.md (tables and plots), runs.csv (one row per run, every
column) and the PNGs to --out (default <first PATH>/report/), and with --format html report.html,
whose path it prints.
Failed points stay in every table, as OOM / invalid / error / timeout cells.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ablate.results import STATUSES
from analysis import batch_table, compare, provenance, recommend, table_cells, tables
from analysis.load import load

TABLES = ("setting", "batch", "full")
TEXT_COLUMNS = ("Setting", "Group", "Option", "Against", "Status", "Card", "Recommended", "Runners-up")


def _parse_baseline(text: str | None) -> dict[str, str] | None:
    if not text:
        return None
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--baseline {text!r}: expected key=value[,key=value...]")
    return dict(pairs)


def sections(df: pd.DataFrame, labels: list[str], bases: pd.Series, which: tuple[str, ...],
             ladder: bool, families: list) -> list[tuple[str, pd.DataFrame]]:
    """(title, table) in reading order. `bases`: each row's baseline row (compare.baselines); the
    setting and batch tables come once per family of comparable runs (compare.families), titled by
    what the family holds fixed."""
    out = []
    for title, part, part_labels in families:
        suffix = f": {title}" if title else ""
        if "setting" in which and recommend.spans_cards(part):  # a plan over cards: the answer, then by card
            for work, rows, work_labels in recommend.workloads(part, part_labels):
                named = ": ".join(t for t in (title, work) if t)
                out.append(("Recommended" + (f": {named}" if named else ""), recommend.recommendation(rows, work_labels)))
                out.append(("Setting by card" + (f": {named}" if named else ""), recommend.by_card(rows, work_labels)))
        elif "setting" in which:
            heading = "Setting (ladder)" if ladder else "Setting"
            out.append((heading + suffix, tables.setting(part, part_labels, bases[part.index[0]], ladder=ladder)))
        if "batch" in which and "batch_size" in part_labels:
            out += [(f"Batch size scan{suffix}: {t}" if title else f"Batch size scan: {t}", table)
                    for t, table in batch_table.batch(part, part_labels).items()]
    if "full" in which:
        out.append(("All runs", tables.full(df, labels, bases)))
        effects = tables.marginal(df, labels)
        if not effects.empty and (effects["Pairs"] != "0").any():
            out.append(("Marginal effects (median change against each column's do-nothing value)", effects))
    return out


def markdown(table: pd.DataFrame, labels: list[str]) -> str:
    align = ["left" if c in labels or c in TEXT_COLUMNS else "right"
             for c in table.columns]
    return table.to_markdown(index=False, colalign=align, disable_numparse=True)


def render(title: str, about: list[str], parts: list[tuple[str, pd.DataFrame]], labels: list[str],
           images: list[Path], notes: dict[str, str], footnote: str) -> str:
    """The Markdown report: the title, what it is of (`about` lines), each table with the note of
    its heading (`notes`), the units (`footnote`) and the plots."""
    text = [f"# {title}", "", *about, ""]
    for heading, table in parts:
        text += [f"## {heading}", "", markdown(table, labels), ""]
        if notes.get(heading):
            text += [notes[heading], ""]
    text += [footnote, ""]
    text += [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(text) + "\n"


def run_labels(df: pd.DataFrame, by: list[str] | None, varied: list[str]) -> list[str]:
    """The columns that name a run: --by's, else every varied one (compare.varied). Names on stderr
    any varied column --by leaves out; ValueError for a column that does not exist."""
    labels = list(dict.fromkeys(by)) if by else varied  # `--by seed seed`: one seed column
    unknown = [c for c in labels if c not in df]
    if unknown:
        raise ValueError(f"--by {' '.join(unknown)}: no such column (valid: {', '.join(varied)})")
    hidden = [c for c in varied if c not in labels]
    if hidden:  # else two runs a hidden column tells apart read as "Baseline (repeat)" with no hint why
        verb = "varies" if len(hidden) == 1 else "vary"
        print(f"note: {', '.join(hidden)} also {verb} between these runs but not in --by's labels; runs that "
              f"differ only there read alike", file=sys.stderr)
    return labels


def in_reading_order(df: pd.DataFrame, labels: list[str], ladder: bool) -> pd.DataFrame:
    """Rows sorted by their labels; an experiment's rungs (hydra/sweeper=ladder) in the order it
    lists them; a --ladder without rungs in the order its runs finished. Index 0..n-1."""
    df = df.sort_values(labels, kind="stable")
    if df["rung"].notna().any():
        df = df.sort_values("rung", kind="stable")
    elif ladder:
        df = df.sort_values("finished_at", kind="stable")
    return df.reset_index(drop=True)


_FIGURE = re.compile(r"[+-]?[\d,]*\.?\d+%?")  # "41,766", "-0.7%", "+12.0%": a number as the tables print it


def numbers(table: pd.DataFrame) -> pd.DataFrame:
    """The table with its figures as a spreadsheet or pandas reads them: no thousands separators,
    and a column of percentages as numbers under a "(%)" heading ("-0.7%" -> -0.7). Text cells
    (labels, statuses, spreads such as "11.6–13.0") stay as they are."""
    out = {}
    for col in table.columns:
        cells = table[col].astype(str)
        figures = cells[cells != ""].map(lambda c: bool(_FIGURE.fullmatch(c)))
        if figures.empty or not figures.all():
            out[col] = table[col]
            continue
        percent = cells[cells != ""].str.endswith("%").all()
        plain = cells.str.replace(",", "").str.rstrip("%").str.lstrip("+")
        out[f"{col} (%)" if percent else col] = plain
    return pd.DataFrame(out, index=table.index)


def is_ladder(families: list) -> bool:
    """Whether each family's rows, in reading order, add to the row above (a ladder); says on stderr
    why not where a row drops what the row above had: `--ladder` would label it "+ X − Y"."""
    for _, part, part_labels in families:
        why = tables.not_a_ladder(part, part_labels)
        if why:
            print(f"--ladder: these runs are not a ladder ({why}); each row is compared with the baseline "
                  f"instead", file=sys.stderr)
            return False
    return True


def title(df: pd.DataFrame) -> str:
    """'ablate report: 11 runs (9 ok, 1 oom, 1 error)': what failed, before any table is read."""
    counts = df["status"].value_counts()
    by_status = ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts)
    return f"ablate report: {len(df)} run{'s' if len(df) != 1 else ''} ({by_status})"


def _parser() -> argparse.ArgumentParser:
    intro, more = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=intro, epilog=more)
    parser.add_argument("paths", nargs="*", default=["outputs"],
                        help="directories (searched recursively) or result.json files (default: outputs, "
                             "where python -m ablate writes)")
    parser.add_argument("--by", nargs="+", help="columns that label a run (default: every column that varies)")
    parser.add_argument("--baseline", help="pick the baseline among the runs with these values, e.g. "
                                           "parallel=fsdp or optimizer=adamw,batch_size=32")
    parser.add_argument("--ladder", action="store_true", help="rows are cumulative: also Δ vs previous row")
    parser.add_argument("--table", choices=TABLES, action="append", help="only these tables (repeatable; default: all)")
    parser.add_argument("--format", choices=("md", "csv", "html"), default="md",
                        help="what stdout gets: the Markdown report, the full table as CSV, or the path of "
                             "report.html (written beside report.md)")
    parser.add_argument("--out", help="where report.md, runs.csv and the plots go (default: <PATH>/report)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"no such file or directory: {' '.join(missing)}", file=sys.stderr)
        return 1
    df = load(args.paths)
    if df.empty:
        print(f"no result.json found under {' '.join(args.paths)}", file=sys.stderr)
        return 1
    try:
        view = compare_runs(df, args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    first = Path(args.paths[0])
    out = Path(args.out) if args.out else (first.parent if first.is_file() else first) / "report"
    try:
        return write_report(view, args, out)
    except OSError as exc:  # --out unwritable, a full disk: one line, not a traceback
        print(f"cannot write the report to {out}: {exc.strerror or exc} ({exc.filename or out})", file=sys.stderr)
        return 1


@dataclass
class View:
    """The runs as the report compares them."""
    df: pd.DataFrame  # in reading order, index 0..n-1
    labels: list[str]  # the columns that name a run
    families: list  # compare.families: (title, runs, labels) per family of comparable runs
    bases: pd.Series  # each row's baseline row
    ladder: bool  # rows add to the row above (--ladder, where they do)
    about: list[tuple[str, str]]  # provenance.about, and the families line under it

    @property
    def title(self) -> str:
        return title(self.df)


def compare_runs(df: pd.DataFrame, args: argparse.Namespace) -> View:
    """Labels, families, baselines: ValueError for a --by or --baseline that names nothing."""
    varied = compare.varied(df)  # a pass over the rows per option key: once
    labels = run_labels(df, args.by, varied)
    df = in_reading_order(df, labels, args.ladder)
    keys = compare.family_keys(df, varied)
    families = compare.families(df, labels, keys)
    ladder = args.ladder and is_ladder(families)
    bases = (pd.concat([pd.Series(part.index[0], index=part.index) for _, part, _ in families]).loc[df.index]
             if ladder else compare.baselines(df, labels, _parse_baseline(args.baseline), families))
    split = provenance.families_line([t for t, _, _ in families], keys)
    return View(df, labels, families, bases, ladder, provenance.about(df) + ([("", split)] if split else []))


def tables_of(view: View, args: argparse.Namespace, out: Path) -> tuple[list[tuple[str, pd.DataFrame]], dict]:
    """(sections, the notes under their headings): the tables asked for, and the memory snapshots."""
    from analysis.module_memory import SNAPSHOT_NOTE, snapshot_table

    parts = sections(view.df, view.labels, view.bases, tuple(args.table or TABLES), view.ladder, view.families)
    snapshots = snapshot_table(view.df, view.labels, out)
    notes = {t: recommend.BY_CARD_NOTE for t, _ in parts if t.startswith("Setting by card")}
    notes.update({t: recommend.NOTE for t, _ in parts if t.startswith("Recommended")})
    if not snapshots.empty:  # CUDA runs: their allocator snapshots, linked
        parts.append(("Memory snapshots", snapshots))
        notes["Memory snapshots"] = SNAPSHOT_NOTE
    return parts, notes


def write_report(view: View, args: argparse.Namespace, out: Path) -> int:
    """The files under `out` and the chosen format on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    from analysis.option_names import imported
    from analysis.plot_common import drawn  # matplotlib only when plotting
    from analysis.plots import plot_jobs, slowest_first

    df, labels = view.df, view.labels
    jobs = plot_jobs(df, labels, out, view.bases)
    imported(df)  # the options' classes, once here rather than in each plotting process
    (parts, notes), images = drawn(jobs, lambda: tables_of(view, args, out), first=slowest_first(jobs))
    stale(out, images)
    footnote = table_cells.footnote(table_cells.on_cpu(df))
    about = [f"- {name}: {value}" if name else f"\n{value}" for name, value in view.about]
    text = render(view.title, about, parts, labels, images, notes, footnote)
    (out / "report.md").write_text(text)
    df.to_csv(out / "runs.csv", index=False)
    if args.format == "html":
        from analysis.html import Section, page, write

        # the units, once, under the first table; a section's own note under it
        footnotes = [notes.get(t) or (footnote if i == 0 else "") for i, (t, _) in enumerate(parts)]
        html = page(view.title, [Section(t, tab, note) for (t, tab), note in zip(parts, footnotes)], images,
                    about=view.about)
        write(out / "report.html", html)
        print(out / "report.html")  # a page of plots inlined runs to megabytes: its path, not the page
    elif args.format == "csv":  # the full table, as written above when it was asked for
        full = dict(parts).get("All runs")
        numbers(tables.full(df, labels, view.bases) if full is None else full).to_csv(sys.stdout, index=False)
    else:
        print(text)
    print(f"wrote {out}/report.md, runs.csv{', report.html' if args.format == 'html' else ''} and "
          f"{len(images)} plot{'s' if len(images) != 1 else ''}", file=sys.stderr)
    return 0


PLOTS = ("breakdown", "pareto", "batch_scan", "loss_curves", "memory_by_module")  # the stems of the plots it draws


def stale(out: Path, images: list[Path]) -> None:
    """Remove the plots an earlier report left in `out` that this one did not draw (another family,
    a table no longer asked for): report.md would not show them, a reader of the folder would. Only
    files named as the report names its plots; anything else in `out` stays."""
    drawn = {p.name for p in images}
    for path in out.glob("*.png"):
        if path.name not in drawn and (path.stem in PLOTS or path.stem.split("-", 1)[0] in PLOTS):
            path.unlink(missing_ok=True)


def cli() -> None:
    """`ablate-report ARGS` (the console script), the same as `python -m analysis.report ARGS`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
