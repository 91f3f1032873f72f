"""Load every result.json below some paths into one pandas DataFrame: one row per run."""
from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

import pandas as pd
import yaml

from ablate import results
from ablate.groups import OFF
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


# What a result from before a group existed ran, its do-nothing option: its rows compare with the newer ones.
LEGACY = OFF


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
        row.update({f"{group}.{k}": text(v) for k, v in flat(config.get(group) or {}) if k != "_target_"})
    row.update({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))})
    row["losses"] = metrics.get("losses") or None  # per-step list, for loss curves
    prediction = result.get("prediction") or {}
    row["predicted_peak_mib"] = prediction.get("peak_mib")
    row["predicted_step_time_s"] = prediction.get("step_time_s")  # results before the time model: none
    for prefix, parts in (("breakdown", metrics.get("breakdown_mib")),
                          ("predicted_breakdown", prediction.get("breakdown_mib"))):
        row.update({f"{prefix}_{k}_mib": v for k, v in (parts or {}).items()})
    # where in the step the allocator peaked: peak_allocated_warmup_mib, _traced_mib, _timed_mib
    row.update({f"peak_allocated_{k}_mib": v for k, v in (metrics.get("peak_allocated_by_phase_mib") or {}).items()})
    row.update({f"env_{k}": v for k, v in (result.get("env") or {}).items()})
    row["finished_at"] = (result.get("timing") or {}).get("finished_at")
    row["reused_from"] = result.get("reused_from")  # a skipped point's copy of a result measured elsewhere
    row["sweep"], row["command"] = origin(path, result.get("overrides") or [])
    named = result.get("artifacts") or {}  # relative to result.json's directory; older results have none
    row.update({f"artifact_{k}": str(path.parent / named[k]) if named.get(k) else None for k in ARTIFACTS})
    return row


def origin(path: Path, overrides: list) -> tuple[str, str]:
    """(the sweep a result belongs to, the command that made it). A multirun's results lie one
    directory below the sweep's multirun.yaml, whose task overrides are the sweep's own command line
    (`optimizer=adamw,sgd`); any other result (a single run, a copied file) is a sweep of its own."""
    sweep = path.parent.parent
    task = _sweep_task(sweep) if (sweep / "multirun.yaml").is_file() else None
    if task is None:
        return str(path.parent), shlex.join(["python", "-m", "ablate", *map(str, overrides)])
    return str(sweep), shlex.join(["python", "-m", "ablate", "-m", *task])


@functools.cache
def _sweep_task(sweep: Path) -> list[str] | None:
    """The sweep's command line from its multirun.yaml, read once per sweep (None: unreadable): the
    task overrides, then Hydra's own (`hydra/sweeper=ladder 'hydra.sweeper.rungs=[...]'`, without
    which the command runs another sweep) less the `hydra.mode=MULTIRUN` that -m itself sets."""
    try:
        overrides = yaml.safe_load((sweep / "multirun.yaml").read_text())["hydra"]["overrides"]
        task, own = overrides["task"], overrides.get("hydra") or []
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(task, list) or not isinstance(own, list):
        return None
    return [str(t) for t in task] + [str(h) for h in own if not str(h).startswith("hydra.mode=")]


def flat(options: dict, prefix: str = ""):
    """An option's keys, a mapping's own keys each in turn ("config.hidden_size": a model's
    transformers config is a mapping): a column per key that can differ, not one for the whole
    config, which named a family by all of its keys (MoE models with overridden configs, as in
    benchmarks/results/NVIDIA-H200/moe.md)."""
    for key, value in options.items():
        if isinstance(value, dict) and value:
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def text(value) -> str:
    """An option's value as a label: lists joined by commas ("layernorm,gelu")."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def load(paths: list[str | Path]) -> pd.DataFrame:
    """One row per run_id and machine (one_per_machine). Files that are not results by the contract
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
    # oldest first, one_per_machine keeps the last: of a result and its reused copies, the one measured here
    df = df.assign(_copy=df["reused_from"].notna()).sort_values(["finished_at", "_copy"], ascending=[True, False],
                                                                 na_position="first", kind="stable")
    return one_per_machine(df).drop(columns="_copy").reset_index(drop=True)


def one_per_machine(df: pd.DataFrame) -> pd.DataFrame:
    """Of the rows of one run_id, the last (df is sorted oldest first) of each machine: the same
    point measured again on the same machine supersedes the earlier result, which is named on
    stderr beside the one kept; measured on two machines, both stay, two measurements, each with
    `measured_on` saying where (the tables mark the row, as they mark a reused one). A reused copy
    (`_copy`) goes without a note: its figures are those of the result it names."""
    df = df.assign(measured_on=None)
    twice = df["run_id"].duplicated(keep=False)
    dropped = []
    for _, part in df[twice].groupby("run_id", sort=False):
        kept = []
        for i, row in reversed(list(part.iterrows())):  # newest first
            twin = next((k for k in kept if same_machine(part.loc[k], row)), None)
            if twin is None:
                kept.append(i)
                continue
            dropped.append(i)
            if not row["_copy"] and Path(row["path"]).resolve() != Path(part.loc[twin, "path"]).resolve():
                print(f"note: dropping {row['path']}: run {row['run_id']} measured again on the same machine, "
                      f"in {part.loc[twin, 'path']}, which is kept", file=sys.stderr)
        if len(kept) > 1:  # where each ran: the host, or the GPU where the hosts are alike
            hosts = part.loc[kept, "env_hostname"] if "env_hostname" in part else pd.Series(None, index=kept)
            where = hosts if hosts.nunique(dropna=False) > 1 else part.loc[kept].get("env_gpu_name", hosts)
            df.loc[kept, "measured_on"] = where.fillna("an unnamed machine").astype(str)
    return df.drop(index=dropped)


def same_machine(a: pd.Series, b: pd.Series) -> bool:
    """Whether two rows ran on the same machine: the same env hostname and GPU name, a null (a run
    that never reached a device, an older file) matching any."""
    return not any(pd.notna(a.get(k)) and pd.notna(b.get(k)) and a.get(k) != b.get(k)
                   for k in ("env_hostname", "env_gpu_name"))
