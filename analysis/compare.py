"""What a report compares: the columns that vary between runs (they name each row), each group's
reference option, the families of runs that compare, and the baseline row every delta is taken
against (one per family)."""
from __future__ import annotations

import math

import pandas as pd

from ablate.groups import FALLBACK, OFF
from ablate.schema import GROUPS, option_defaults
from analysis.load import RUN_KEYS, flat, text

# The do-nothing option of each technique group: a run's label lists only what differs from these.
# A grid without one is compared against the group's FALLBACK options (ablate/groups.py).
BASELINE = OFF
# Run keys whose null (or false) is the plain run: a sweep over them is measured against it.
OFF_KEYS = ("compile", "alloc_conf", "gpu_memory_gib")


def varied(df: pd.DataFrame) -> list[str]:
    """Group, run-key and GPU columns whose value differs between rows (at least `model`), and the
    option keys ("parallel.backward_prefetch") that differ between rows because a run set them:
    they differ between runs of the same option, or some run has one away from its option's
    default (leanest's `optimizer.in_backward: true` on adamw8bit, against a baseline adamw). An
    option's own defaults (sgd's lr 0.1 against adamw's 6e-4) are part of choosing the option."""
    cols = [c for c in (*GROUPS, *RUN_KEYS) if c in df and varies(df[c])]
    cols += ["env_gpu_name"] if "env_gpu_name" in df and varies(devices(df)) else []
    keys = [c for c in df.columns if c.split(".")[0] in GROUPS and "." in c and varies(df[c])]
    cols += [c for c in keys if (df.groupby(c.split(".")[0], dropna=False)[c].nunique() > 1).any()
             or away_from_default(df, c).any()]
    return cols or ["model"]


def devices(df: pd.DataFrame) -> pd.Series:
    """The GPU each run that reached a worker ran on ("CPU": none). A run that never did (invalid,
    a job SLURM lost) has no GPU name: it ran on no other device, so it makes no GPU column."""
    gpu = df["env_gpu_name"]
    cpu = gpu.isna() & (df["env_torch"].notna() if "env_torch" in df else False)
    return gpu.where(~cpu, "CPU").dropna()


def varies(column: pd.Series) -> bool:
    """More than one value, a null against a value included (pandas 3's str dtype keeps nulls
    through astype(str), and nunique drops them by default)."""
    return column.astype(str).nunique(dropna=False) > 1


UNLABELLED_KEYS = ("parallel.nproc", "parallel.nodes")  # the parallel label names the processes already


def set_away_from_default(row: pd.Series, col: str) -> bool:
    """Whether the row's option key `col` ("optimizer.in_backward") is set away from its option's default."""
    if col in UNLABELLED_KEYS:
        return False
    group, key = col.split(".", 1)
    defaults = option_defaults(group, str(row[group]))
    return pd.notna(row[col]) and key in defaults and row[col] != text(defaults[key])


def away_from_default(df: pd.DataFrame, col: str) -> pd.Series:
    """set_away_from_default of every row, one option at a time (a row at a time is a second per
    key at 1,000 runs)."""
    out = pd.Series(False, index=df.index, dtype=bool)
    if col in UNLABELLED_KEYS:
        return out
    group, key = col.split(".", 1)
    options = df[group].astype(str)
    for option in options.unique():
        defaults = dict(flat(option_defaults(group, option)))
        if key in defaults:
            rows = options == option
            values = df.loc[rows, col]
            out[rows] = (values.notna() & (values != text(defaults[key]))).to_numpy(dtype=bool)
    return out


def references(df: pd.DataFrame, labels: list[str]) -> dict[str, str]:
    """Each varied group's reference option among the runs: its do-nothing option, else the first
    of its FALLBACK options present; a group with neither has no reference."""
    refs = {}
    for group in (g for g in labels if g in BASELINE):
        present = set(df[group].astype(str))
        ref = next((o for o in (BASELINE[group], *FALLBACK.get(group, ())) if o in present), None)
        if ref is not None:
            refs[group] = ref
    return refs


def do_nothing(df: pd.DataFrame, labels: list[str]) -> dict[str, tuple[pd.Series, str]]:
    """Each varied column that has a do-nothing value -> (which rows have it, how to name it): a
    group at its reference option (references()), an option key at its option's default
    (`optimizer.in_backward` at False), a run key off (OFF_KEYS). `model`, `batch_size` and the
    like have none: no value of theirs is the plain run. A run whose option lacks a key (SGD has no
    betas) counts as at that key's default."""
    out = {group: (df[group].astype(str) == ref, ref) for group, ref in references(df, labels).items()}
    for col in labels:
        if col in OFF_KEYS:
            out[col] = (df[col].isna() | (df[col].astype(str) == "False"), "off")
        elif "." in col and col.split(".")[0] in GROUPS:
            at = ~away_from_default(df, col)
            defaults = set(df.loc[at & df[col].notna(), col].astype(str))
            out[col] = (at, defaults.pop() if len(defaults) == 1 else "its option's default")
    return out


def baseline_index(df: pd.DataFrame, labels: list[str], baseline: dict[str, str] | None) -> int:
    """The row every delta is taken against: the run with the most varied groups at their reference
    option (all of them, where such a run exists), then the most varied option keys at their
    option's default (`parallel.sync_each_micro_step=true,false` is measured against true) and run
    keys off (OFF_KEYS), then the ok runs, then the smallest batch: the first in row order. A run
    that diverged is the baseline only where every candidate did.
    `--baseline key=value,...` narrows the candidates first, and the same rule picks among them:
    `--baseline parallel=fsdp` over `parallel=fsdp,ddp checkpoint=none,block` is FSDP without
    recompute, whatever order the rows come in."""
    candidates = _matching(df, labels, baseline) if baseline else df
    at = {col: mask[candidates.index].astype(int) for col, (mask, _) in do_nothing(df, labels).items()}
    at_reference = sum(n for col, n in at.items() if col in GROUPS)  # groups at their reference option
    at_default = sum(n for col, n in at.items() if col not in GROUPS)  # option keys at default, run keys off
    ok = (candidates["status"] == "ok").astype(int)
    sane = (candidates["status"] != "diverged").astype(int)  # its losses are no reference, even at the defaults
    score = pd.DataFrame({"sane": sane, "refs": at_reference, "defaults": at_default, "ok": ok}, index=candidates.index)
    return score.sort_values(["sane", "refs", "defaults", "ok"], ascending=False, kind="stable").index[0]


def spelled(value) -> str:
    """A value as a command line writes it, so `--baseline gpu_memory_gib=null` and `=8` find the
    runs whose column holds NaN and 8.0 (a numeric column with a null in it is float, and pandas 3's
    astype(str) keeps NaN): null, true/false, integral numbers without ".0"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    text = str(value)
    if text.lower() in ("true", "false", "null"):
        return text.lower()
    try:
        number = float(text)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else text


def _matching(df: pd.DataFrame, labels: list[str], baseline: dict[str, str]) -> pd.DataFrame:
    """The runs with every `--baseline` key=value (values compared as a command line spells them);
    a ValueError naming the key and what the runs have otherwise."""
    match, given = df, []
    for key, value in baseline.items():
        if key not in df:
            raise ValueError(f"--baseline {key}={value}: no run has a column {key!r}; the columns that vary "
                             f"here are {', '.join(labels)}")
        cells = match[key].map(spelled)
        narrowed = match[cells == spelled(value)]
        if narrowed.empty:
            present = sorted(set(cells))
            where = f" among the runs with {', '.join(given)}" if given else ""
            raise ValueError(f"--baseline {key}={value}: no run matches; {key} is one of "
                             f"{', '.join(present)}{where}")
        match, given = narrowed, [*given, f"{key}={value}"]
    return match


# Columns whose values stay comparable in one table whatever the sweep: the techniques (the
# groups with a do-nothing option and their option keys, run keys with an off value), the batch
# (the batch table's axis), the seed (a repeat), and the steps outside the measured ones. Any
# other column that differs between runs (the model's shape, seq_len, steps, the device) splits
# them into families, unless a sweep varied it.
COMPARABLE = (*OFF_KEYS, "batch_size", "seed", "warmup_steps", "eval_steps")


def comparable(col: str) -> bool:
    return col.split(".")[0] in BASELINE or col in COMPARABLE


def family_keys(df: pd.DataFrame, cols: list[str]) -> list[str]:
    """The columns among `cols` (the varied ones) that split runs into families: not a technique,
    and not an axis some sweep varied within itself (`seq_len=256,512` asks for that comparison).
    `model` always does: a delta between two models says nothing about a technique."""
    swept = set()
    if "sweep" in df:
        for _, part in df.groupby("sweep", sort=False):
            swept |= {c for c in cols if varies(part[c])}
    return [c for c in cols if (c == "model" or not (comparable(c) or c in swept)) and c in df and varies(df[c])]


def families(df: pd.DataFrame, labels: list[str], keys: list[str] | None = None
             ) -> list[tuple[str | None, pd.DataFrame, list[str]]]:
    """(title, its runs, the labels that vary within them) per family of comparable runs, in the
    order the families first appear; the title names what the family holds fixed ("model=gpt2,
    seq_len=64"). One part (title None, the labels as given) when all runs compare. `keys`: the
    columns that split them (default: family_keys of every varied column)."""
    keys = family_keys(df, varied(df)) if keys is None else keys
    if not keys:
        return [(None, df, labels)]
    parts = []
    named = naming_keys(df, keys)
    for key, part in df[keys].fillna("").astype(str).groupby(keys, sort=False):
        part = df.loc[part.index]
        title = ", ".join(f"{c}={v}" for c, v in zip(keys, key) if v != "" and c in named)
        rest = [c for c in labels if c not in keys]
        parts.append((title, part, [c for c in rest if varies(part[c])] or rest or labels))
    return parts


def naming_keys(df: pd.DataFrame, keys: list[str]) -> list[str]:
    """The fewest of `keys`, in their order, that still tell every family apart: a key that adds no
    family to those before it (a model's hidden size beside its name) stays out of the titles, which
    over a mixed outputs/ would otherwise name nine keys each."""
    text = df[keys].fillna("").astype(str)
    kept, count = [], 1
    for key in keys:
        n = len(text[[*kept, key]].drop_duplicates())
        if n > count:
            kept, count = [*kept, key], n
    return kept


def baselines(df: pd.DataFrame, labels: list[str], baseline: dict[str, str] | None,
              parts: list | None = None) -> pd.Series:
    """Each row's baseline row (an index of df): one per family (`parts`: families(df, labels),
    computed when not given). `--baseline` picks it in every family that has a matching run, and
    must match some run."""
    if baseline:
        _matching(df, labels, baseline)  # raises if no run at all matches
    out = pd.Series(0, index=df.index)
    for _, part, part_labels in families(df, labels) if parts is None else parts:
        try:
            out[part.index] = baseline_index(part, part_labels, baseline)
        except ValueError:  # this family has no run like that: its own default baseline
            out[part.index] = baseline_index(part, part_labels, None)
    return out
