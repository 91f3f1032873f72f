"""Load every result.json below some paths into one pandas DataFrame: one row per run."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from ablate import results
from ablate.results import ARTIFACTS, RESULT_FILE
from ablate.schema import GROUPS

# Top-level run keys that can differ between runs and so may label a row.
RUN_KEYS = ("batch_size", "seq_len", "steps", "warmup_steps", "eval_steps", "samples", "seed", "device", "compile",
            "gpu_memory_gib", "alloc_conf")


def result_files(paths: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += [p] if p.is_file() else sorted(p.rglob(RESULT_FILE))
    return files


# What a result from before a group existed ran: its rows compare with the newer ones.
LEGACY = {"loss": "standard"}


def _row(result: dict, path: Path) -> dict:
    metrics = result.get("metrics") or {}
    row = {"run_id": result["run_id"], "status": result["status"], "reason": result.get("reason"),
           "path": str(path)}
    row.update({g: (result.get("choices") or {}).get(g, LEGACY.get(g)) for g in GROUPS})
    config = result.get("config") or {}
    row.update({k: config.get(k) for k in RUN_KEYS})
    row["accumulation_steps"] = (config.get("accumulation") or {}).get("steps")
    row["rung"] = config.get("rung")
    for group in GROUPS:  # every option key as "group.key" (strings: they are labels, and mixed types sort)
        row.update({f"{group}.{k}": text(v) for k, v in (config.get(group) or {}).items() if k != "_target_"})
    row.update({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))})
    row["losses"] = metrics.get("losses") or None  # per-step list, for loss curves
    prediction = result.get("prediction") or {}
    row["predicted_peak_mib"] = prediction.get("peak_mib")
    for prefix, parts in (("breakdown", metrics.get("breakdown_mib")),
                          ("predicted_breakdown", prediction.get("breakdown_mib"))):
        row.update({f"{prefix}_{k}_mib": v for k, v in (parts or {}).items()})
    row.update({f"env_{k}": v for k, v in (result.get("env") or {}).items()})
    row["finished_at"] = (result.get("timing") or {}).get("finished_at")
    named = result.get("artifacts") or {}  # relative to result.json's directory; older results have none
    row.update({f"artifact_{k}": str(path.parent / named[k]) if named.get(k) else None for k in ARTIFACTS})
    return row


def text(value) -> str:
    """An option's value as a label: lists joined by commas ("layernorm,gelu")."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def load(paths: list[str | Path]) -> pd.DataFrame:
    """One row per run_id (the newest wins). Files that are not results by the contract
    (ablate.results.problem: unreadable, foreign, missing fields) are named on stderr and skipped."""
    rows = []
    for path in result_files(paths):
        result, why = results.load(path)  # the job's own test of a result: what it would rerun, the report skips
        if result is None:
            print(f"skipping {path}: not a result ({why})", file=sys.stderr)
        else:
            rows.append(_row(result, path))
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df = df.sort_values("finished_at", na_position="first").drop_duplicates("run_id", keep="last")
    return df.reset_index(drop=True)
