"""Set recorded runs against the analytic memory model and the step-time model as they are now:
per ok run of each benchmark's runs.csv, the measured peak, the prediction the run recorded, and
the current model's; the measured step time (median iter_time_ms) and the current model's for the
GPU the run names; per page, how many rows are within TIME_TOLERANCE of their measured time, and
for those that are not, which kind of row each is and why the model misses it (`MISSES`).

    python benchmarks/repredict.py benchmarks/results/<device>   ->  benchmarks/results/<device>/repredict.md

The measurements are the recorded ones: nothing runs on a device. Each row's config is composed
again from the preset (the folder's name), the row's options, its run keys and every option key
it set away from the option's own default, so a model change can be checked against a GPU's
numbers on a machine without one.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/repredict.py` without installing the project
    sys.path.insert(0, str(ROOT))

from ablate.job import git_sha  # noqa: E402  (needs ROOT on the path)
from ablate.predict.analytic import analytic, sized  # noqa: E402
from ablate.predict.step_time import device_of, parts, seconds, work_of  # noqa: E402
from ablate.spec import RunSpec  # noqa: E402
from ablate.techniques import Unmodelled  # noqa: E402
from ablate.schema import CONF, GROUPS, option_defaults  # noqa: E402
from analysis.load import LEGACY, flat  # noqa: E402
from tests.composed import composed  # noqa: E402  (rows of a page share their choice of configs)

# compile: on CUDA the model plays the compiled loss, and the key tells a compiled row from its
# eager twin in the table.
RUN_KEYS = ("batch_size", "seq_len", "steps", "warmup_steps", "samples", "device", "compile", "gpu_memory_gib")
TIME_TOLERANCE = 0.2  # a predicted step time within 20% of the measured one
SPREAD = 0.1  # timed steps whose p10 and p90 lie further apart than 10% of their median: a disturbed run
MISS = "Time miss"  # the table's column of each row's kind of miss (MISSES), None where it is within


@dataclass
class Miss:
    """A kind of row the step-time model misses, and why, in a sentence or two for the page."""

    kind: str
    why: str
    test: Callable  # (row, work, parts, arch) -> bool


# In order: a row is of the first kind it fits.
MISSES = [
    Miss("mixture-of-experts samples",
         "The model's FLOPs, bytes and launches account for a quarter to 70% of their measured time; the "
         "rest is most likely the host launching transformers' routing (a sort, a histogram, gathers and "
         "scatters per layer), which the model counts as a dense layer's launches.",
         lambda row, work, split, arch: arch is not None and arch.experts > 0),
    Miss("an optimizer stepping in backward that reads values",
         "Each tensor's step waits for the device, so the model adds host time to device time; the host's "
         "share is one machine's, and another host waits less or more (offload rows move their "
         "activations over the host link besides).",
         lambda row, work, split, arch: work.host_waits),
    Miss("host-bound points",
         "The model's host time (Python launching kernels) exceeds its device time for so few tokens; how "
         "fast a host launches differs between machines, by up to 2x between the recorded ones, and the "
         "model holds one figure for it.",
         lambda row, work, split, arch: split["host"] > split["device"]),
    Miss("disturbed runs",
         f"Their own timed steps spread by more than {SPREAD:.0%} of the median between p10 and p90, so "
         "the median is the machine's at that moment more than the point's.",
         lambda row, work, split, arch: _set(row.get("iter_time_ms_p90")) and _set(row.get("iter_time_ms_p10"))
         and row["iter_time_ms_p90"] - row["iter_time_ms_p10"] > SPREAD * row["iter_time_ms"]),
]


def miss_of(row: pd.Series, spec: RunSpec, work, split: dict) -> str:
    """The kind of a row whose predicted time misses (MISSES), "unexplained" if none fits."""
    try:
        arch = sized(spec)[1].arch
    except Exception:  # a family without the analytic model's sizes
        arch = None
    return next((m.kind for m in MISSES if m.test(row, work, split, arch)), "unexplained")


def overrides(preset: str | None, row: pd.Series) -> list[str]:
    """The command line that composes `row`'s config again."""
    out = [f"experiment={preset}"] if preset else []
    for group in GROUPS:
        option = row[group] if group in row and _set(row[group]) else LEGACY[group]  # a group newer than the record
        out.append(f"{group}={option}")
        for key, default in flat(option_defaults(group, option)):  # "config.hidden_size" too
            value = row.get(f"{group}.{key}")
            if not str(key).startswith("_") and _set(value) and not _same(value, default):
                out.append(f"{group}.{key}={value}")
    return out + [f"{k}={_plain(row[k])}" for k in RUN_KEYS if k in row and _set(row[k])]


def _same(value, default) -> bool:
    """A CSV cell against a YAML default: lists are written "0.9,0.95", numbers in any form."""
    if isinstance(default, list):
        default = ",".join(map(str, default))
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == str(default)


def _set(value) -> bool:
    return not (value is None or (isinstance(value, float) and math.isnan(value)))


def _plain(value):
    """5.0 -> 5: pandas reads an integer column with gaps as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def preset_of(runs_csv: Path, df: pd.DataFrame) -> str | None:
    """The experiment the runs came from: the folder's name where it is a preset, else the one the
    runs' command named (gpt2_throughput_padded/ ran experiment=gpt2_throughput ...), else None: a
    plain command line (gpt2_xl_8gib/), composed from the defaults."""
    if (CONF / "experiment" / f"{runs_csv.parent.name}.yaml").exists():
        return runs_csv.parent.name
    named = df["command"].dropna().str.extract(r"experiment=(\S+)")[0].dropna().unique() if "command" in df else []
    return named[0] if len(named) == 1 else None


def _error(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%" if _set(predicted) else "n/a"


def repredict(runs_csv: Path) -> pd.DataFrame:
    """The page's table for one runs.csv, with the kind of each row whose predicted time misses."""
    df = pd.read_csv(runs_csv)
    preset = preset_of(runs_csv, df)
    rows = []
    for _, row in df[df["status"] == "ok"].iterrows():
        line = overrides(preset, row)
        spec = RunSpec.of(composed(line))
        measured, then = row["peak_allocated_mib"], row["predicted_peak_mib"]
        try:
            now = analytic(spec).peak_mib
        except Unmodelled as e:  # an option the layer model does not follow (its run said so too)
            rows.append({"Setting": " ".join(line[1:] if preset else line), "Measured (MiB)": measured,
                         "Recorded prediction (MiB)": then, "Recorded error": _error(then, measured),
                         "Prediction now (MiB)": None, "Error now": f"unmodelled: {str(e).split(':')[0]}",
                         "Measured (ms)": row["iter_time_ms"], "Predicted (ms)": None, "Time error": "n/a",
                         MISS: None})
            continue
        # The time on the GPU the run names (as the worker would see it), from the same sizes.
        dev, work = device_of(spec, row.get("env_gpu_name")), work_of(spec)
        predicted_s = seconds(work, dev) if dev else None
        ms = row["iter_time_ms"]
        error = predicted_s * 1e3 / ms - 1 if predicted_s and _set(ms) else None
        rows.append({"Setting": " ".join(line[1:] if preset else line), "Measured (MiB)": measured,
                     "Recorded prediction (MiB)": then, "Recorded error": _error(then, measured),
                     "Prediction now (MiB)": now, "Error now": f"{100 * (now / measured - 1):+.1f}%",
                     "Measured (ms)": ms, "Predicted (ms)": predicted_s * 1e3 if predicted_s else None,
                     "Time error": f"{100 * error:+.1f}%" if error is not None else "n/a",
                     MISS: miss_of(row, spec, work, parts(work, dev))
                     if error is not None and abs(error) > TIME_TOLERANCE else None})
    return pd.DataFrame(rows)


def within(table: pd.DataFrame) -> str:
    """"n of m rows": the rows with a predicted time within TIME_TOLERANCE of the measured."""
    timed = int((table["Time error"] != "n/a").sum())
    return f"{timed - int(table[MISS].notna().sum())} of {timed} {'row' if timed == 1 else 'rows'}"


def time_lines(table: pd.DataFrame) -> list[str]:
    """The page's lines under a table: how many rows are within TIME_TOLERANCE, and why the others
    miss, one line per kind."""
    lines = [f"Step time within {TIME_TOLERANCE:.0%} of the measured: {within(table)}.", ""]
    misses = list(table[MISS].dropna())
    for m in [*MISSES, Miss("unexplained", "No kind above fits: the model misses it.", lambda *a: True)]:
        n = misses.count(m.kind)
        if n:
            lines.append(f"- {n} {'row' if n == 1 else 'rows'} missing: {m.kind}. {m.why}")
    return lines + ([""] if misses else [])


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="benchmarks/results/<device>: its */runs.csv are read")
    args = parser.parse_args(argv)
    shown = args.results.resolve().relative_to(ROOT) if args.results.resolve().is_relative_to(ROOT) else args.results
    lines = [f"# Recorded runs on {args.results.name} against the memory and step-time models at this commit", "",
             f"- command: `python benchmarks/repredict.py {shown}`",
             f"- model at commit: `{git_sha()}`; measured: each preset's runs.csv beside this file, "
             "recorded by its benchmark (commit and device in its .md)",
             "- step time: the step-time model (ablate/predict/step_time.py) for the GPU each run names, "
             "against the run's median step (iter_time_ms)"]
    tables = {runs_csv.parent.name: repredict(runs_csv) for runs_csv in sorted(args.results.glob("*/runs.csv"))}
    tables = {name: table for name, table in tables.items() if len(table)}
    if tables:
        lines.append(f"- step time within {TIME_TOLERANCE:.0%} of the measured: {within(pd.concat(tables.values()))}")
    lines.append("")
    for name, table in tables.items():
        lines += [f"## {name}", "", table.fillna({MISS: ""}).to_markdown(index=False, floatfmt=",.1f"), "",
                  *time_lines(table)]
    out = args.results / "repredict.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
