"""The report's words for options: each option class's own `label` and `key_labels`
(ablate/techniques/), asked of the object its conf file builds."""
from __future__ import annotations

import functools

import pandas as pd

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


@functools.cache
def _label(col: str, value: str) -> str:
    option = built_option(col, value) if col in GROUPS else None
    return getattr(option, "label", "") or f"{col}={value}"
