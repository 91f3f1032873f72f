"""What a report is of: the lines its Markdown and HTML open with, naming the device, torch, commit,
dates and commands behind its runs, and how many families of comparable runs it holds."""
from __future__ import annotations

import pandas as pd

from ablate.results import predicted_oom

MAX_COMMANDS = 3  # a report over many sweeps lists the first few commands and counts the rest


def _distinct(values: pd.Series) -> list[str]:
    """The values in order of first appearance, nulls left out."""
    return list(dict.fromkeys(str(v) for v in values if v is not None and not pd.isna(v)))


def _counted(values: pd.Series) -> str:
    """'CPU', or 'NVIDIA H100 80GB HBM3 (10 runs), CPU (2 runs)' when they differ."""
    counts = values.value_counts(sort=False)
    if len(counts) == 1:
        return str(counts.index[0])
    return ", ".join(f"{v} ({n} run{'s' if n != 1 else ''})" for v, n in counts.items())


def _when(finished: pd.Series) -> str:
    """'2026-11-25 02:33 UTC', or a span '2026-11-25 02:33 – 2026-11-26 10:02 UTC'."""
    times = pd.to_datetime(finished.dropna(), utc=True, errors="coerce", format="ISO8601").dropna()
    if times.empty:
        return "unknown"
    first, last = (t.strftime("%Y-%m-%d %H:%M") for t in (times.min(), times.max()))
    if first == last:
        return f"{first} UTC"
    return f"{first} – {last[11:] if last[:10] == first[:10] else last} UTC"  # one day: its date once


def _cpu(ran: pd.DataFrame) -> pd.Series:
    """"CPU: 2 threads" per row (torch's threads: what a CPU run's times depend on); "CPU" where
    the row does not say (written before env.cpu_threads was)."""
    threads = ran["env_cpu_threads"] if "env_cpu_threads" in ran else pd.Series(None, index=ran.index, dtype=object)
    return threads.map(lambda n: "CPU" if n is None or pd.isna(n) else f"CPU: {int(n)} thread{'s' if n != 1 else ''}")


def about(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(name, value) lines: device, torch, commit, date, command(s). A run that never reached a
    worker (invalid, predicted) names no device or torch, so those come from the runs that did."""
    ran = df[df["env_torch"].notna()] if "env_torch" in df else df.iloc[0:0]
    # a plan: nothing ran, by design (predict_only), as opposed to rows that all failed
    plan = any(r.get("status") == "predicted" or predicted_oom(r) for r in df.to_dict("records"))
    device = (("none ran (a plan: predicted, not measured)" if plan else "none ran") if ran.empty
              else _counted(ran["env_gpu_name"].where(ran["env_gpu_name"].notna(), _cpu(ran))))
    commits = [c[:7] + ("+dirty" if c.endswith("+dirty") else "") for c in _distinct(df.get("env_git_sha", []))]
    commands = _distinct(df["command"]) if "command" in df else []
    shown = [f"`{c}`" for c in commands[:MAX_COMMANDS]]
    if len(commands) > MAX_COMMANDS:
        shown.append(f"and {len(commands) - MAX_COMMANDS} more (runs.csv's command column)")
    return [("Device", device),
            ("torch", ", ".join(_distinct(ran["env_torch"])) if not ran.empty else "none ran"),
            ("Commit", ", ".join(commits) or "unknown (not run from a git checkout)"),
            ("Date", _when(df["finished_at"]) if "finished_at" in df else "unknown"),
            ("Command" if len(commands) <= 1 else "Commands", "; ".join(shown) or "unknown")]


def families_line(titles: list[str | None], keys: list[str]) -> str | None:
    """The line that says how many families of comparable runs the report holds, and what tells
    them apart; None for one family."""
    if len(titles) <= 1:
        return None
    return (f"These runs form {len(titles)} families of comparable runs, each with its own tables and baseline: "
            f"they differ in {', '.join(keys)}, which is neither a technique nor an axis any sweep varied.")
