"""Benchmark: loss beside bytes. Every optimizer option trains gpt-mini for 500 steps on a CPU
(conf/experiment/optimizers.yaml) on the synthetic data and on text, and the page puts each one's
eval loss against AdamW's beside its optimizer-state bytes per parameter.

    python benchmarks/optimizers.py  ->  benchmarks/results/cpu/optimizers.md, optimizers_text.md (+ their folders)

The text is generated, not shipped: the docstrings of a fixed list of Python standard-library
modules, ASCII only (about 0.4 MB; it differs a little between Python versions, which the page names).
State bytes come from one traced step per option on the same model (MemTracker's optimizer
category once the step is over), divided by the trainable parameters.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` without installing the project
    sys.path.insert(0, str(ROOT))

from bench import run  # noqa: E402

MODULES = ("abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "codecs", "collections", "contextlib",
           "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fnmatch", "fractions",
           "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http", "inspect", "io", "ipaddress",
           "itertools", "json", "locale", "logging", "math", "operator", "os", "pathlib", "pickle", "pprint", "queue",
           "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string",
           "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "typing", "unittest",
           "urllib", "uuid", "warnings", "weakref", "xml", "zipfile")
LAST = 20  # the final train loss: the mean of the last LAST steps' losses


def write_text(path: Path) -> Path:
    """The standard library's docstrings (each module's, its public members' and their methods'), ASCII only."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member, obj in sorted(vars(module).items()):
            if not member.startswith("_") and getattr(obj, "__module__", None) == name:
                parts.append(inspect.getdoc(obj) or "")
                if inspect.isclass(obj):  # and its own public methods'
                    parts += [inspect.getdoc(f) or "" for m, f in sorted(vars(obj).items())
                              if not m.startswith("_") and inspect.isfunction(f)]
    text = "\n\n".join(p for p in parts if p)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(ch for ch in text if ch == "\n" or 32 <= ord(ch) < 127))
    return path


def state_bytes(optimizer_keys: list[str], base: list[str]) -> float:
    """Optimizer-state bytes once a traced step is over (MemTracker), the run's model and keys."""
    from tests.test_predict import MIB, measured

    return measured(optimizer_keys, base=base).after["optimizer"] * MIB


def table(sweep: Path, base: list[str]) -> list[str]:
    """One row per run, in the ladder's order: the eval loss against AdamW's (its authors' run)."""
    # rglob: a run's folder is named by its overrides, and data.path's slashes nest it
    runs = sorted((json.loads(p.read_text()) for p in sweep.rglob("result.json")),
                  key=lambda r: int(r["config"].get("rung") or 0))
    reference = [r for r in runs if r["choices"]["optimizer"] == "adamw" and r["status"] == "ok"]
    ref_eval = reference[0]["metrics"]["eval_loss"] if reference else math.nan
    lines = ["| optimizer | keys set | state bytes / param | final train loss | eval loss | vs AdamW | status |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in runs:
        keys = [o for o in r["overrides"] if o.startswith("optimizer.")]
        name, shown = r["choices"]["optimizer"], " ".join(keys) or "(authors')"
        m = r["metrics"] or {}
        if r["status"] != "ok":
            lines.append(f"| {name} | {shown} | | | | | {r['status']}: {r['reason'] or ''} |")
            continue
        final = sum(m["losses"][-LAST:]) / len(m["losses"][-LAST:])
        per_param = state_bytes([f"optimizer={name}", *keys], base) / m["trainable_params"]
        lines.append(f"| {name} | {shown} | {per_param:.2f} | {final:.4f} | {m['eval_loss']:.4f} | "
                     f"{100 * (m['eval_loss'] / ref_eval - 1):+.1f}% | ok |")
    return lines


def main(argv: list[str]) -> None:
    """`--report-only`: render the pages of sweeps that already ran (bench.run's flag)."""
    text = write_text(ROOT / "outputs" / "benchmarks" / "optimizers" / "stdlib_docs.txt")
    datasets = {"optimizers": [], "optimizers_text": ["data=chars", f"data.path={text}", "model.vocab_size=128"]}
    for page, overrides in datasets.items():
        sweep = ROOT / "outputs" / "benchmarks" / page
        md = run("optimizers", report_args=["--table", "full"], argv=["--sweep-dir", str(sweep), *argv, *overrides],
                 page=page)
        vocab = 128 if overrides else 512  # the traced step's tokens are random: only the shapes matter
        base = ["model=gpt-mini", "batch_size=16", "seq_len=64", "device=cpu", f"model.vocab_size={vocab}",
                f"data.vocab_size={vocab}"]
        about = ["## Loss beside bytes", "",
                 f"Eval loss after 500 steps against AdamW's (its authors' hyperparameters), and each option's "
                 f"optimizer state once a step is over (one MemTracker-traced step of the same model: "
                 f"`{shlex.join(base)}`), in bytes per trainable parameter. Final train loss: the mean of the "
                 f"last {LAST} steps.", ""]
        body = md.read_text()
        first_section = body.index("\n## ")
        md.write_text(body[:first_section] + "\n" + "\n".join([*about, *table(sweep, base)]) + "\n"
                      + body[first_section:])
        print(f"wrote {md}")


if __name__ == "__main__":
    main(sys.argv[1:])
