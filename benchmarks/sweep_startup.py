"""What a sweep's points wait for their workers: the `startup` phase of its first point and of the rest.

    python benchmarks/sweep_startup.py [--sweep nano|llama-lora|ddp] [--repeats N] [--tree NAME=CHECKOUT ...]
                                       [--results DIR]

runs one of the sweeps below (`nano`: ablate's own GPT; `llama-lora`: a tiny Llama with LoRA
adapters, whose points import transformers' modeling code and peft; `ddp`: the GPT on two ranks,
whose startup is torchrun's and its ranks') `--repeats` times (3) in each
checkout (default: this one), one after another, and writes `<results>/<device>/sweep_startup.md`
(`sweep_startup_llama_lora.md`, `sweep_startup_ddp.md`): per checkout, its commit, the medians of the sweep's
wall time (this script's clock around the process) and CPU time (it and every process it started),
of the first point's `startup` (the worker's start left at its launch: the job started it while it
predicted) and of the later points' (forked from the same server: launch/warm_start.py), and of
each point's time outside its measured steps.
Two checkouts (`--tree before=<worktree of the old commit> --tree after=.`) give a before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT, device_dir

SWEEPS = {"nano": ["-m", "seed=0,1,2,3", "model=gpt-nano", "steps=3", "device=cpu"],
          "llama-lora": ["-m", "seed=0,1,2,3", "model=llama3.2-1b", "model.config.num_hidden_layers=2",
                         "model.config.hidden_size=64", "model.config.intermediate_size=128",
                         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                         "model.config.vocab_size=128", "data.vocab_size=128", "peft=lora", "batch_size=4",
                         "seq_len=16", "steps=3", "device=cpu"],
          "ddp": ["-m", "seed=0,1,2,3", "model=gpt-nano", "parallel=ddp", "parallel.nproc=2", "steps=3", "device=cpu"]}
SWEEP = SWEEPS["nano"]


def one_sweep(tree: Path, sweep: list[str] = SWEEP) -> dict:
    """The sweep once in the checkout `tree`: its wall time (s), its commit, and per point in the
    order they ran, (startup, outside the measured steps) in seconds."""
    with tempfile.TemporaryDirectory() as out:
        start, cpu = time.perf_counter(), _children_cpu_s()
        proc = subprocess.run([sys.executable, "-m", "ablate", *sweep, f"out_dir={out}",
                               f"hydra.sweep.dir={out}/sweep"], cwd=tree, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
        if proc.returncode != 0:
            sys.exit(f"{shlex.join(sweep)} failed in {tree}:\n{proc.stderr[-3000:]}")
        results = sorted((json.loads(p.read_text()) for p in Path(out, "sweep").rglob("result.json")),
                         key=lambda r: r["timing"]["started_at"])
    points = [(r["timing"]["phases_s"]["startup"], r["timing"]["wall_s"] - r["timing"]["phases_s"]["measured"])
              for r in results]
    return {"wall_s": wall, "cpu_s": cpu, "sha": results[0]["env"].get("git_sha"), "points": points}


def _children_cpu_s() -> float:
    """User and system CPU seconds of this process's finished children, and theirs (each worker is
    waited for by whoever started it, so a sweep's total reaches here)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(sweeps: list[dict]) -> dict:
    later = [s for sweep in sweeps for s, _ in sweep["points"][1:]]
    return {"sha": sweeps[0]["sha"], "wall": statistics.median(s["wall_s"] for s in sweeps),
            "cpu": statistics.median(s["cpu_s"] for s in sweeps),
            "first": statistics.median(sweep["points"][0][0] for sweep in sweeps),
            "later": statistics.median(later),
            "outside": statistics.median(o for sweep in sweeps for _, o in sweep["points"])}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="benchmarks/sweep_startup.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", choices=SWEEPS, default="nano")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=CHECKOUT",
                        help="a checkout to run the sweep in (repeatable; default: this one)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where <device>/ goes")
    args = parser.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    load = os.getloadavg()
    sweep = SWEEPS[args.sweep]
    rows = {name: summary([one_sweep(Path(path), sweep) for _ in range(args.repeats)]) for name, path in trees}
    command = shlex.join(["python", "benchmarks/sweep_startup.py", *(sys.argv[1:] if argv is None else argv)])
    lines = ["# What a sweep's points wait for their workers", "",
             f"Recorded by `{command}`: `python -m ablate {shlex.join(sweep)}`, {args.repeats} times per "
             "checkout, one after another; medians. Startup is the `timing.phases_s.startup` of a point: from "
             "its launch to its worker's first word, what was left of the worker's imports then. Outside: "
             "a point's `timing.wall_s` less its measured steps.", "",
             f"- device: CPU, host `{platform.node()}` ({os.cpu_count()} {platform.machine()} CPUs), load "
             f"average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
             f"- finished: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| Checkout | Commit | Sweep wall (s) | Sweep CPU, all processes (s) | First point's startup (s) | "
             "Later points' startup (s) | Outside the measured steps, per point (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, s in rows.items():
        lines.append(f"| {name} | `{(s['sha'] or '?')[:12]}` | {s['wall']:.1f} | {s['cpu']:.1f} | {s['first']:.2f} "
                     f"| {s['later']:.2f} | {s['outside']:.2f} |")
    out = Path(args.results) / device_dir(None)
    out.mkdir(parents=True, exist_ok=True)
    md = out / ("sweep_startup.md" if args.sweep == "nano" else f"sweep_startup_{args.sweep.replace('-', '_')}.md")
    md.write_text("\n".join(lines) + "\n")
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
