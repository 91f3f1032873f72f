"""Set recorded runs against the analytic memory model as it is now: per ok run of each
benchmark's runs.csv, the measured peak, the prediction the run recorded, and the current model's.

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
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/repredict.py` without installing the project
    sys.path.insert(0, str(ROOT))

from ablate.job import git_sha  # noqa: E402  (needs ROOT on the path)
from ablate.predict.analytic import analytic  # noqa: E402
from ablate.spec import RunSpec  # noqa: E402
from ablate.schema import CONF, GROUPS, option_defaults, register  # noqa: E402
from analysis.load import LEGACY, flat  # noqa: E402

# compile: on CUDA the model plays the compiled loss, and the key tells a compiled row from its
# eager twin in the table.
RUN_KEYS = ("batch_size", "seq_len", "steps", "warmup_steps", "samples", "device", "compile", "gpu_memory_gib")


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


def repredict(runs_csv: Path) -> pd.DataFrame:
    df = pd.read_csv(runs_csv)
    preset = preset_of(runs_csv, df)
    rows = []
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for _, row in df[df["status"] == "ok"].iterrows():
            line = overrides(preset, row)
            cfg = OmegaConf.to_container(compose(config_name="config", overrides=line), resolve=True, enum_to_str=True)
            now = analytic(RunSpec.of(cfg)).peak_mib
            measured, then = row["peak_allocated_mib"], row["predicted_peak_mib"]
            rows.append({"Setting": " ".join(line[1:] if preset else line), "Measured (MiB)": measured,
                         "Recorded prediction (MiB)": then, "Recorded error": f"{100 * (then / measured - 1):+.1f}%",
                         "Prediction now (MiB)": now, "Error now": f"{100 * (now / measured - 1):+.1f}%"})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="benchmarks/results/<device>: its */runs.csv are read")
    args = parser.parse_args(argv)
    shown = args.results.resolve().relative_to(ROOT) if args.results.resolve().is_relative_to(ROOT) else args.results
    lines = [f"# Recorded runs on {args.results.name} against the analytic model at this commit", "",
             f"- command: `python benchmarks/repredict.py {shown}`",
             f"- model at commit: `{git_sha()}`; measured: each preset's runs.csv beside this file, "
             "recorded by its benchmark (commit and device in its .md)", ""]
    for runs_csv in sorted(args.results.glob("*/runs.csv")):
        table = repredict(runs_csv)
        if len(table):
            lines += [f"## {runs_csv.parent.name}", "", table.to_markdown(index=False, floatfmt=",.1f"), ""]
    out = args.results / "repredict.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
