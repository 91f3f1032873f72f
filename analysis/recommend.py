"""The answer to "what should I run on my card?": per card, the fastest combination that fits.

A card is a `gpu_memory_gib` cap (an emulated card, as a plan over cards sweeps it) or, without one,
the GPU a row ran on. Of the rows that fit it (measured ok, or predicted to fit), the recommended
one trains a sample fastest: by its measured step time where it ran, by its predicted one
otherwise; combinations within TIE of the fastest count as equally fast, and of those the one with
the fewest techniques wins (less to go wrong). Without any step time (results from before the time
model, a device it does not know) the fewest techniques win, then the largest micro-batch. Where
find_seq searched each row's longest sequence, the question is how long: the longest context wins,
then the fewest techniques.
"""
from __future__ import annotations

import pandas as pd

from analysis import tables
from analysis.table_cells import MEMORY, num

TIE = 0.02  # step times this close are the model's noise, not a reason to add a technique
RUNNERS_UP = 2
CARD = "gpu_memory_gib"


def spans_cards(df: pd.DataFrame) -> bool:
    """Whether the rows ask the question: a plan (predicted rows), or a sweep over card sizes."""
    capped = CARD in df and df[CARD].notna().any()
    planned = df["status"].eq("predicted").any() or df["reason"].fillna("").str.startswith("predicted").any()
    return capped and (planned or df[CARD].nunique() > 1)


# What a user trains, not how: a plan over cards answers each of them apart (time per sample at
# seq 8192 is no rival of one at 2048).
WORKLOAD = ("batch_size", "seq_len")


def workloads(df: pd.DataFrame, labels: list[str]) -> list[tuple[str, pd.DataFrame, list[str]]]:
    """(title, its rows, the labels left) per workload (WORKLOAD values) of a plan over cards, in the
    order they first appear; one untitled part where it trains one workload."""
    keys = [k for k in WORKLOAD if k in df and df[k].astype(str).nunique() > 1]
    if not keys:
        return [("", df, labels)]
    rest = [c for c in labels if c not in keys]
    return [(", ".join(f"{k}={v}" for k, v in zip(keys, key)), df.loc[part.index], rest)
            for key, part in df[keys].astype(str).groupby(keys, sort=False)]


def card_of(row: pd.Series) -> tuple[str, float | None]:
    """(the card's name, its memory in MiB): '24 GiB card' for a cap, else the GPU's name."""
    if pd.notna(row.get(CARD)):
        return f"{float(row[CARD]):g} GiB card", float(row[CARD]) * 1024
    gpu = row.get("env_gpu_name")
    total = row.get("env_gpu_total_mib")
    return (str(gpu) if pd.notna(gpu) else "this device"), (float(total) if pd.notna(total) else None)


def split_of(row: pd.Series) -> tuple[int, int]:
    """(micro-batch, micro-steps per optimizer step): find_batch's micro-batch where it searched one
    (accumulation keeps batch_size), else the configured split."""
    batch = int(row["batch_size"])
    found = row.get("max_batch_size")
    if pd.notna(found) and int(found) > 0:
        micro = int(found)
    else:
        micro = batch // max(int(row.get("accumulation_steps") or 1), 1)
    return micro, max(batch // max(micro, 1), 1)


def fits(row: pd.Series) -> bool:
    return row["status"] in ("ok", "predicted")  # a diverged run's memory fit, its training did not


def peak_of(row: pd.Series) -> tuple[float | None, bool]:
    """(peak MiB, measured): the allocator's peak where it ran, else the prediction."""
    if row["status"] == "ok" and pd.notna(row.get(MEMORY)):
        return float(row[MEMORY]), True
    value = row.get("predicted_peak_mib")
    return (float(value) if pd.notna(value) else None), False


def step_of(row: pd.Series) -> tuple[float | None, bool]:
    """(seconds per optimizer step, measured)."""
    if row["status"] == "ok" and pd.notna(row.get("iter_time_ms")):
        return float(row["iter_time_ms"]) / 1000, True
    value = row.get("predicted_step_time_s")
    return (float(value) if pd.notna(value) else None), False


def ranked(rows: pd.DataFrame, labels: list[str]) -> list[pd.Series]:
    """The rows that fit one card, best first (see the module's docstring)."""
    fit = [row for _, row in rows.iterrows() if fits(row)]

    def per_sample(row):
        step, _ = step_of(row)
        return step / int(row["batch_size"]) if step is not None else None

    def techniques(row):
        return len(tables.combination(row, labels))

    def context(row):
        value = row.get("max_seq_len")
        return int(value) if value is not None and pd.notna(value) else 0

    if any(context(r) for r in fit):  # find_seq asked how long a sequence fits: the longest wins,
        return sorted(fit, key=lambda r: (-context(r), techniques(r), step_of(r)[0] or 0.0))  # then the simplest
    timed = [r for r in fit if per_sample(r) is not None]
    if len(timed) < len(fit):  # no time to rank by for some: the simplest, then the largest micro-batch
        return sorted(fit, key=lambda r: (techniques(r), -split_of(r)[0], peak_of(r)[0] or 0.0))
    timed.sort(key=per_sample)
    if not timed:
        return []
    fastest = per_sample(timed[0])
    tied = [r for r in timed if per_sample(r) <= fastest * (1 + TIE)]
    best = min(tied, key=lambda r: (techniques(r), per_sample(r)))
    return [best] + [r for r in timed if r is not best]


def named(row: pd.Series, labels: list[str]) -> str:
    parts = tables.combination(row, labels)
    return " + ".join(parts) if parts else "the plain run (no technique)"


def _split(row: pd.Series) -> str:
    micro, steps = split_of(row)
    return f"{micro} × {steps}"


def _peak(row: pd.Series, capacity: float | None) -> str:
    value, measured = peak_of(row)
    text = num(value, ",.0f") if measured else f"~{num(value, ',.0f')}"
    return text + (f" of {capacity:,.0f}" if capacity else "") + ("" if measured else " (predicted)")


def _step(row: pd.Series) -> str:
    value, measured = step_of(row)
    if value is None:
        return ""
    return num(value, ".2f") if measured else f"~{num(value, '.2f')} (predicted)"


def answers(df: pd.DataFrame, labels: list[str]) -> list[tuple[str, float | None, list[pd.Series], pd.DataFrame]]:
    """Per card, the largest first: (card, its MiB, the rows that fit it best first, all its rows)."""
    cards: dict = {}
    for i, row in df.iterrows():
        cards.setdefault(card_of(row), []).append(i)
    return [(card, capacity, ranked(df.loc[index], labels), df.loc[index])
            for (card, capacity), index in sorted(cards.items(), key=lambda kv: -(kv[0][1] or 0))]


def recommendation(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """One row per card, the largest first: the recommended combination, its micro-batch ×
    micro-steps, its longest context (find_seq's answer, where searched), its peak against the
    card, its step time, and the runners-up."""
    out = []
    for card, capacity, best, rows in answers(df, labels):
        if not best:
            out.append({"Card": card, "Recommended": "nothing fits" + leanest(rows, labels, capacity),
                        "Micro-batch × steps": "", "Longest context": "", "Peak (MiB)": "", "Step time (s)": "",
                        "Runners-up": ""})
            continue
        top = best[0]
        out.append({"Card": card, "Recommended": named(top, labels), "Micro-batch × steps": _split(top),
                    "Longest context": num(top.get("max_seq_len"), ",.0f"),
                    "Peak (MiB)": _peak(top, capacity), "Step time (s)": _step(top),
                    "Runners-up": "; ".join(briefly(r, labels) for r in best[1:1 + RUNNERS_UP])})
    table = pd.DataFrame(out)
    empty = [c for c in ("Longest context", "Step time (s)", "Runners-up") if not table[c].astype(bool).any()]
    return table.drop(columns=empty)


def cell(row: pd.Series) -> str:
    """'4 × 4, ~12,290 MiB, ~0.91 s': a fitting row's split (find_seq's longest context where it
    searched one), peak and step time (~: predicted)."""
    peak, measured = peak_of(row)
    step, timed = step_of(row)
    longest = row.get("max_seq_len")
    split = f"{num(longest, ',.0f')} tokens" if longest is not None and pd.notna(longest) else _split(row)
    text = f"{split}, {'' if measured else '~'}{num(peak, ',.0f')} MiB"
    return text + (f", {'' if timed else '~'}{num(step, '.2f')} s" if step is not None else "")


def briefly(row: pd.Series, labels: list[str]) -> str:
    """'Pure bf16 + Block recompute (4 × 4, ~12,290 MiB, ~0.91 s)'."""
    return f"{named(row, labels)} ({cell(row)})"


def leanest(rows: pd.DataFrame, labels: list[str], capacity: float | None) -> str:
    """'; the leanest tried, X, needs ~7,351 MiB: over the 7,296 MiB a point may use there': how far
    the card is from any of them, by the rule that judged them (ablate/find_batch.py)."""
    from ablate.capacity import usable_mib  # torch: only for a card where nothing fits
    from ablate.find_batch import MARGIN

    peaks = [(peak_of(r)[0], r) for _, r in rows.iterrows() if peak_of(r)[0] is not None]
    if not peaks:
        return ""
    value, row = min(peaks, key=lambda p: p[0])
    limit = f": over the {usable_mib(capacity) * (1 - MARGIN):,.0f} MiB a point may use there" if capacity else ""
    return f"; the leanest tried, {named(row, labels)}, needs ~{value:,.0f} MiB{limit}"


def by_card(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """The setting table of a sweep over cards: a row per combination, a column per card (micro-batch
    × micro-steps, peak, step time where it fits; OOM and its predicted peak where it does not). The
    card is never a technique in a row's label."""
    own = [c for c in labels if c != CARD]
    cards = sorted({card_of(r) for _, r in df.iterrows()}, key=lambda c: -(c[1] or 0))
    rows: dict[str, dict] = {}
    for _, row in df.iterrows():
        card, capacity = card_of(row)
        cells = rows.setdefault(named(row, own), {"Setting": named(row, own)})
        if fits(row):
            cells[card] = cell(row)
        else:
            cells[card] = tables.failed(row)
    table = pd.DataFrame(list(rows.values()), columns=["Setting", *(c for c, _ in cards)]).fillna("")
    return table


NOTE = ("Per card, the combination that trains a sample fastest among those that fit it (measured step time "
        "where it ran, predicted otherwise; within 2% the fewest techniques win), then the runners-up; "
        "where find_seq searched the longest sequence, the longest context wins. "
        "Micro-batch × steps: samples per micro-step × micro-steps per optimizer step.")
BY_CARD_NOTE = ("Each card's cell: micro-batch × micro-steps per optimizer step, the peak and the step time "
                "where it fits (~: predicted, not measured); OOM and its predicted peak where it does not.")
