"""Benchmark: what one `python -m ablate` of the tests costs through tests/cli_zygote.py (the way
`helpers.run_cli` runs it), for a command that plans and one that trains a point.

    python benchmarks/test_command_cost.py [--runs 6]

Each kind runs `--runs` times one after the other, after one command that starts the zygote; a
tiny point of `helpers.FAST` (nano GPT, 3 steps) with a new seed each time. Prints, per kind, the
CPU-seconds of the whole machine (from /proc/stat, so the zygote, the command, its worker server
and the point's process all count) and the wall seconds per command. Meant for a machine with
nothing else running.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import results_under, run_cli  # noqa: E402

KINDS = {"predict_only=true": ["predict_only=true"], "a point trained": []}


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy since boot (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:7])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    run_cli(["predict_only=true"], tmp / "start")  # the zygote's own start, not counted
    print("| command | CPU-s each | wall s each |\n|---|---:|---:|")
    for k, (kind, extra) in enumerate(KINDS.items()):
        cpu, wall = busy_cpu_s(), time.monotonic()
        for i in range(args.runs):
            out_dir = tmp / f"kind{k}" / str(i)  # no '=' in a path an override carries
            out = run_cli([f"seed={i}", *extra], out_dir)
            assert out.returncode == 0, out.stderr[-2000:]
            assert [r["status"] for r in results_under(out_dir)] == ["predicted" if extra else "ok"]
        print(f"| `{kind}` | {(busy_cpu_s() - cpu) / args.runs:.2f} | {(time.monotonic() - wall) / args.runs:.2f} |")


if __name__ == "__main__":
    main()
