"""Where a single run's wall time goes outside training, as a user's first commands meet it.

    python benchmarks/point_overhead.py [--repeats N] [--results DIR] [--tree CHECKOUT --name NAME]
                                        [--command "model=gpt2-large steps=1 ..." ...]

runs each command below `--repeats` times (5), one after another, each into an out_dir of its own,
and writes `<results>/<device>/point_overhead.md`: per command, the median of the process's wall
time (this script's clock around `python -m ablate ...`), of its training (warm-up, traced and
measured steps: timing.phases_s), the share of the wall outside training, and each phase of the
worker. The goal for the first command (GOAL): under a quarter of the wall outside training.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT, device_dir

COMMANDS = [
    ["model=gpt2", "batch_size=2", "seq_len=32", "steps=2"],  # the first command of a new user
    ["model=gpt-nano", "steps=3", "device=cpu"],  # the per-point cost at cluster scale (docs/clusters.md)
]
TRAINING = ("warmup", "traced_step", "measured")
GOAL = 0.25  # for the first command: less than a quarter of the wall time outside training


def one_run(args: list[str], tree: Path) -> dict:
    """The command once, run in the checkout `tree`: its wall time (s) and its result."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ablate", *args, f"out_dir={out}"], cwd=tree,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{shlex.join(args)} failed:\n{proc.stderr[-3000:]}")
        (path,) = Path(out).rglob("result.json")
        return {"wall_s": wall, "result": json.loads(path.read_text())}


def summary(runs: list[dict]) -> dict:
    """Medians over the runs: wall, training, outside (s), outside's share, and each phase (s)."""
    phases = [r["result"]["timing"]["phases_s"] for r in runs]
    training = [sum(p[k] for k in TRAINING) for p in phases]
    outside = [r["wall_s"] - t for r, t in zip(runs, training)]
    return {"wall": statistics.median(r["wall_s"] for r in runs), "training": statistics.median(training),
            "outside": statistics.median(outside),
            "share": statistics.median(o / r["wall_s"] for o, r in zip(outside, runs)),
            "cli": statistics.median(r["wall_s"] - r["result"]["timing"]["wall_s"] for r in runs),
            "job": statistics.median(r["result"]["timing"]["wall_s"] - sum(p.values()) for r, p in zip(runs, phases)),
            "phases": {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}}


def page(results: dict[str, dict], runs: list[dict], repeats: int, load: tuple, command: str, goal: bool) -> str:
    env = runs[0]["result"]["env"]
    lines = ["# Where a single run's time goes", "",
             f"Recorded by `{command}`: every figure is a median over "
             f"{repeats} runs of each command, one after another, timed by the script around the process; "
             "the phases are the runs' own `timing.phases_s`.", "",
             f"- commit: `{env.get('git_sha')}`",
             f"- device: {env.get('gpu_name') or 'CPU'}, host `{env.get('hostname')}` ({os.cpu_count()} "
             f"{platform.machine()} CPUs), load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
             f"- torch {env.get('torch')}, Python {env.get('python')}",
             f"- finished: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| Command | Wall (s) | Training (s) | Outside training (s) | Outside share | CLI start (s) | "
             "Job beside its worker (s) | " + " | ".join(f"{k} (s)" for k in results[next(iter(results))]["phases"]) + " |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(results[next(iter(results))]["phases"])]
    for command, s in results.items():
        lines.append(f"| `{command}` | {s['wall']:.1f} | {s['training']:.1f} | {s['outside']:.1f} | "
                     f"{s['share']:.0%} | {s['cli']:.1f} | {s['job']:.1f} | " + " | ".join(f"{v:.2f}" for v in s["phases"].values())
                     + " |")
    first = results[next(iter(results))]
    lines += ["", "Training is the warm-up, traced and measured steps. CLI start is the process's wall less "
                  "the job's `timing.wall_s` (Python, Hydra's composition, the key check, and the exit); the job "
                  "beside its worker is `timing.wall_s` less the worker's phases (importing torch, validating "
                  "and predicting before the launch, writing the row after). The phases follow, from the launch "
                  "(`startup`: what is left of the worker's start then) to its end."
                  + (f" The goal for the first command, under {GOAL:.0%} outside training: "
                     f"{'met' if first['share'] < GOAL else 'not met'} ({first['share']:.0%})." if goal else ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="benchmarks/point_overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where <device>/ goes")
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose ablate runs (another commit's worktree, for a before and after)")
    parser.add_argument("--name", default="point_overhead", help="the page's name: <results>/<device>/<name>.md")
    parser.add_argument("--command", action="append", metavar="OVERRIDES",
                        help="one command's overrides in one string, instead of the two defaults (repeatable)")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    every, results = [], {}
    for command in [shlex.split(c) for c in args.command] if args.command else COMMANDS:
        runs = [one_run(command, args.tree) for _ in range(args.repeats)]
        every += runs
        results["python -m ablate " + shlex.join(command)] = summary(runs)
    out = Path(args.results) / device_dir(every[0]["result"]["env"].get("gpu_name"))
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{args.name}.md"
    command = shlex.join(["python", "benchmarks/point_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    md.write_text(page(results, every, args.repeats, load, command, goal=not args.command))
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
