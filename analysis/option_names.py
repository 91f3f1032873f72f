"""The report's words for options: each option class's own `label` and `key_labels`
(ablate/techniques/), asked of the object its conf file builds."""
from __future__ import annotations

import functools

import pandas as pd
import yaml

from ablate.schema import GROUPS, built_option


def label(col: str, value) -> str:
    """The report's name for a group's option ("Block recompute") or for an option key set on its
    own in a preset ("Optimizer step in backward"): the option class's `label` and `key_labels`
    (ablate/techniques/); `col=value` for one that has none."""
    return _label(col, str(value))


def key_label(row: pd.Series, col: str) -> str:
    group, key = col.split(".", 1)
    option = built_option(group, str(row[group])) if pd.notna(row.get(group)) else None
    return getattr(option, "key_labels", {}).get((key, str(row[col])), f"{col}={row[col]}")


def imported(df: pd.DataFrame) -> None:
    """Build the option each row names, once: its class imported (torch with it) and its label kept,
    before the report forks its plotting processes, which would otherwise each import them again."""
    for group in GROUPS:
        if group in df:
            for value in df[group].dropna().unique():
                label(group, value)


@functools.cache
def _label(col: str, value: str) -> str:
    option = built_option(col, value) if col in GROUPS else None
    return getattr(option, "label", "") or f"{col}={value}"


def option_label(row: pd.Series, group: str, cols: list[str]) -> tuple[str, set[str]]:
    """The name of `row`'s option of `group` built with the keys of it among `cols` that `row`
    sets ("LoRA r=64"), and those of the keys its name already says (dropping one changes it)."""
    keys = {c: row[c] for c in cols if c.startswith(group + ".") and pd.notna(row.get(c))}
    name = _keyed(group, str(row[group]), tuple(sorted((c.split(".", 1)[1], str(v)) for c, v in keys.items())))
    said = {c for c in keys if _keyed(group, str(row[group]), tuple(sorted(
        (k.split(".", 1)[1], str(v)) for k, v in keys.items() if k != c))) != name}
    return name or label(group, row[group]), said


@functools.cache
def _keyed(group: str, value: str, keys: tuple) -> str:
    option = built_option(group, value, tuple((k, yaml.safe_load(v)) for k, v in keys)) if group in GROUPS else None
    return getattr(option, "label", "") or ""
