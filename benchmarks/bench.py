"""Run one experiment preset on this machine and record its report, with where it came from.

    python benchmarks/<preset>.py [--results DIR] [hydra overrides ...]

runs `python -m ablate -m experiment=<preset> ...`, renders its report and writes
`<results>/<device>/<preset>.md` (the tables, with the exact commands, commit, torch / CUDA
versions and device on top) beside `<results>/<device>/<preset>/` (runs.csv and the PNGs).
<device> is the GPU's name as the workers saw it ("NVIDIA-H100-80GB-HBM3"), or "cpu". Every
figure in those files comes from the sweep's result.json files: nothing is typed in.

A GPU host without network needs only torch: bring the other packages as wheels (docs/benchmarks.md,
"Running a preset at full size").
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` without installing the project
    sys.path.insert(0, str(ROOT))

from analysis.load import load  # noqa: E402  (needs ROOT on the path)


def device_dir(gpu_name: str | None) -> str:
    """A folder name for a device: "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", gpu_name).strip("-") if gpu_name else "cpu"


def header(preset: str, commands: list[list[str]], sweep: Path, here: bool = True) -> tuple[str, str]:
    """(device folder, Markdown provenance) from the sweep's own result.json files. here: the sweep
    ran on this machine (its CPU count is the host's)."""
    df = load([sweep])

    def env(key: str):
        """The first run's env.<key> that was recorded (runs that never started have none)."""
        values = df[f"env_{key}"].dropna() if f"env_{key}" in df else []
        return values.iloc[0] if len(values) else None

    gpu = env("gpu_name")
    lines = [f"# {preset} on {gpu or 'CPU'}", "",
             "Recorded by `python benchmarks/" + preset + ".py`; every figure below comes from the sweep's "
             "result.json files, rendered by analysis.report unedited.", ""]
    lines += [f"- command: `{shlex.join(c)}`" for c in commands]
    lines += [f"- commit: `{env('git_sha')}`", f"- device: {gpu or 'CPU'} ({env('gpu_total_mib') or '-'} MiB), "
              f"driver {env('driver') or '-'}, host `{env('hostname')}`"
              + (f" ({os.cpu_count()} {platform.machine()} CPUs)" if here else ""),
              f"- torch {env('torch')}, CUDA {env('cuda') or '-'}, Python {env('python')}",
              f"- finished: {df['finished_at'].max()}", ""]
    return device_dir(gpu), "\n".join(lines)


def left_behind(body: str, sweep: str) -> str:
    """The report's links into its sweep (each CUDA run's allocator snapshot and per-module CSV,
    `](../<run>/...)` from the sweep's report/) point at files that stay with the sweep, not beside
    the recorded page, where they were dead links: written as their paths in the sweep instead."""
    return re.sub(r"\[[^\]]*\]\(\.\./([^)]+)\)", lambda m: f"`{sweep}/{m.group(1)}`", body)


def run(preset: str, report_args: list[str], defaults: tuple[str, ...] = (), argv: list[str] | None = None,
        page: str | None = None) -> Path:
    """Run `preset`'s sweep with `defaults` and the overrides in argv (which replace a default of the
    same key); returns the written Markdown file, `<page>.md` (default: the preset's name)."""
    parser = argparse.ArgumentParser(prog=f"benchmarks/{preset}.py", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where <device>/ goes")
    parser.add_argument("--sweep-dir", help="the sweep's directory (default outputs/benchmarks/<preset>/<time>)")
    parser.add_argument("--report-only", action="store_true",
                        help="render the report of a sweep that already ran (--sweep-dir, with the overrides it "
                             "ran with), e.g. one a GPU host handed back unfinished: nothing runs again")
    parser.add_argument("--page", default=page or preset,
                        help="the page's name (default: the preset's): a preset measured in parts, a page each")
    args, given = parser.parse_known_args(argv)
    page = args.page
    if args.report_only and not args.sweep_dir:
        parser.error("--report-only needs --sweep-dir, the sweep that ran")
    overrides = [*(o for o in defaults if o.split("=")[0] not in {g.split("=")[0] for g in given}), *given]
    default_sweep = ROOT / "outputs" / "benchmarks" / preset / time.strftime("%Y-%m-%d_%H-%M-%S")
    sweep = Path(args.sweep_dir or default_sweep).resolve()
    shown = sweep.relative_to(ROOT) if sweep.is_relative_to(ROOT) else sweep  # as typed in the repository
    sweep_cmd = ["python", "-m", "ablate", "-m", f"experiment={preset}", f"hydra.sweep.dir={shown}", *overrides]
    if not args.report_only:
        subprocess.run([sys.executable, *sweep_cmd[1:]], cwd=ROOT, check=True)

    staging = sweep / "report"
    report_cmd = ["python", "-m", "analysis.report", str(shown), *report_args, "--out", str(shown / "report")]
    subprocess.run([sys.executable, *report_cmd[1:]], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    device, top = header(preset, [sweep_cmd, report_cmd], sweep, here=not args.report_only)
    if args.report_only:
        top += ("\nThe sweep ran on the device named above; its report was rendered afterwards from the "
                "result.json files it handed back (`--report-only`), where a run it did not finish is a row "
                "with its reason.\n")

    out = Path(args.results) / device
    files = out / page
    files.mkdir(parents=True, exist_ok=True)
    body = (staging / "report.md").read_text()
    for item in sorted(staging.iterdir()):  # runs.csv and the PNGs, linked from <preset>.md
        if item.suffix in (".png", ".csv"):
            (files / item.name).write_bytes(item.read_bytes())
            body = body.replace(f"]({item.name})", f"]({page}/{item.name})")
    body = body.replace("# ablate report", "## Report", 1)
    body = left_behind(body, str(shown))
    md = out / f"{page}.md"
    md.write_text(top + "\n" + body)
    print(f"wrote {md}")
    return md
