"""One self-contained HTML page for a report: tables and PNG plots, no external resources.

`page(title, sections, images)` returns an HTML5 document with inline CSS and the images embedded
as base64 data URIs, so the file opens offline and can be mailed or attached as it is.
"""
from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

# Non-ok run statuses (ablate.results.STATUSES): these three are expected outcomes of a sweep.
WARN = ("oom", "invalid", "diverged")
ERROR = ("error", "timeout")

CSS = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --head: #f0f3f6; --zebra: #f6f8fa;
  --warn-bg: #fff4d6; --warn-fg: #7a4a00; --err-bg: #ffe3e1; --err-fg: #a40e26; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); background: #fff; line-height: 1.45;
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { padding: 20px 32px 14px; border-bottom: 1px solid var(--line); background: var(--head); }
header h1 { margin: 0; font-size: 1.6em; font-weight: 600; }
header p.about { margin: 4px 0 0; color: var(--muted); font-size: 0.9em; }
code { font: 0.92em ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
main { padding: 8px 32px 40px; max-width: 1400px; }
h2 { margin: 28px 0 10px; font-size: 1.2em; font-weight: 600; }
.scroll { display: inline-block; max-width: 100%; overflow-x: auto; vertical-align: top;
  border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; font-size: 0.92em; }
th, td { padding: 6px 14px; border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; }
th { position: sticky; top: 0; background: var(--head); font-weight: 600; }
tbody tr:nth-child(even) { background: var(--zebra); }
tbody tr:hover { background: #eaeef2; }
tbody tr:last-child td { border-bottom: none; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
td.warn { background: var(--warn-bg); color: var(--warn-fg); font-weight: 600; }
td.err { background: var(--err-bg); color: var(--err-fg); font-weight: 600; }
td.warn:not(.num), td.err:not(.num) { white-space: normal; width: 32ch; min-width: 32ch; }
p.note { color: var(--muted); font-size: 0.88em; margin: 6px 2px 0; max-width: 110ch; }
.figures { display: flex; flex-wrap: wrap; gap: 20px; margin-top: 12px; }
figure { margin: 0; padding: 10px; border: 1px solid var(--line); border-radius: 6px; background: #fff; }
figure img { display: block; max-width: 100%; height: auto; }
figcaption { color: var(--muted); font-size: 0.88em; text-align: center; margin-top: 6px; }
"""


@dataclass
class Section:
    """One <h2> heading, its table (cells shown as their str()) and an optional note under it."""
    title: str
    table: pd.DataFrame
    footnote: str = ""


def is_number(text: str) -> bool:
    """'1,234.5', '-3%', '+12', '12.5 ± 0.3' count as numbers; 'nan', 'inf' and '' do not."""
    parts = text.replace(",", "").replace("%", "").replace("+", " ").replace("±", " ").split()
    try:
        return bool(parts) and all(abs(float(p)) < float("inf") for p in parts)
    except ValueError:
        return False


def status_class(text: str) -> str:
    """'warn' for 'OOM' / 'OOM (predicted ~N)' / 'oom: ...' / 'invalid: ...' / 'diverged: ...' and a
    diverged run's measured memory ('104 (diverged at step 2)'), 'err' for error and timeout, else ''."""
    head = re.split(r"[:(\s]", text.strip(), maxsplit=1)[0].lower()  # "OOM (predicted ~20,236)" -> "oom"
    return "warn" if head in WARN or "(diverged" in text else "err" if head in ERROR else ""


def _text(value) -> str:
    if value is None or (not isinstance(value, (list, tuple, dict)) and pd.isna(value)):
        return ""
    return str(value)


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")  # a Markdown link, "[name](relative/path)"


def _cell(text: str) -> str:
    """A cell's HTML: escaped text, a Markdown link (the report writes them for files) as <a>."""
    link = _LINK.fullmatch(text)
    if link:
        return f'<a href="{html.escape(link[2])}">{html.escape(link[1])}</a>'
    return html.escape(text)


def _cls(name: str) -> str:
    return f' class="{name}"' if name else ""


def table_html(df: pd.DataFrame) -> str:
    rows = [[_text(v) for v in row] for row in df.itertuples(index=False, name=None)]
    # A column is numeric when every cell that is neither empty nor a status is a number.
    numeric = [bool(cells) and all(is_number(c) for c in cells)
               for cells in ([c for c in col if c and not status_class(c)] for col in zip(*rows))]
    numeric += [False] * (len(df.columns) - len(numeric))
    head = "".join(f"<th{_cls('num' if n else '')}>{html.escape(str(c))}</th>"
                   for c, n in zip(df.columns, numeric))
    body = []
    for row in rows:
        cells = []
        for text, num in zip(row, numeric):
            cls = " ".join(c for c in (status_class(text), "num" if num or is_number(text) else "") if c)
            cells.append(f"<td{_cls(cls)}>{_cell(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n'
            + "\n".join(body) + "\n</tbody></table></div>")


def figure_html(image: Path) -> str:
    data = base64.b64encode(Path(image).read_bytes()).decode("ascii")
    stem = html.escape(Path(image).stem)
    return (f'<figure><img alt="{stem}" src="data:image/png;base64,{data}">'
            f"<figcaption>{stem}</figcaption></figure>")


def _about(name: str, value: str) -> str:
    """One line under the title: "<b>Device:</b> CPU", a `command` as <code>."""
    value = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(value))
    return f'<p class="about">{f"<b>{html.escape(name)}:</b> " if name else ""}{value}</p>'


def page(title: str, sections: list[Section], images: list[Path], about: list[tuple[str, str]] = ()) -> str:
    """One HTML5 document: header (the title and the `about` lines: (name, value), a value in
    backticks as code), each section as <h2> + table + note, then the figures."""
    lines = "".join(_about(name, value) for name, value in about)
    parts = []
    for s in sections:
        parts += [f"<section>\n<h2>{html.escape(s.title)}</h2>", table_html(s.table)]
        if s.footnote:  # an address in it is a link (memory_viz, under the snapshots)
            note = re.sub(r"https?://[^\s<>\"]*[^\s<>\".,:;)]", lambda m: f'<a href="{m[0]}">{m[0]}</a>',
                          html.escape(s.footnote))
            parts.append(f'<p class="note">{note}</p>')
        parts.append("</section>")
    if images:
        parts += ['<section>\n<h2>Plots</h2>\n<div class="figures">',
                  *(figure_html(p) for p in images), "</div>\n</section>"]
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<header><h1>{html.escape(title)}</h1>{lines}</header>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def write(path: str | Path, text: str) -> Path:
    """Write the page as UTF-8 (creating parent folders) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
