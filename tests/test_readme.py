"""README.md does what it says: each command of its tour runs as written (the GPU-sized one as a
plan, with predict_only=true added), and each table it prints from a plan is the table the tool
prints. The measured tables it shows come from recorded pages (benchmarks/results/), whose
figures it must match."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import ROOT, results_under

README = (ROOT / "README.md").read_text()
# Each tour command, as written, and how this file runs it: "plan" adds predict_only=true (a GPU-
# sized point), "run" trains on the CPU (slow), "check" runs nothing.
TOUR = {
    "python -m ablate": "run",
    "python -m ablate model=gpt2 batch_size=16 seq_len=1024 steps=50": "plan",
    "python -m ablate -m optimizer=sgd,adamw": "run",
    "python -m ablate -m optimizer=sgd,adamw batch_size=8,16,32": "run",
    "python -m ablate --help": "check",
    "python -m ablate --cfg job optimizer=sgd": "check",
    "python -m ablate optimizer=adamx": "check",
    "python -m ablate batch_sz=16 optimizer.lrr=1e-3": "check",
    "python -m ablate optimizer.lr=abc": "check",
    "python -m analysis.report outputs/": "run",
}


def tour() -> list[tuple[str, str]]:
    """(command, its comment) per line of the tour's code block."""
    block = README.split("## A short tour", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #", 1) for line in block.splitlines() if line.startswith("python ")]
    return [(cmd.strip(), comment[0].strip() if comment else "") for cmd, *comment in lines]


def shell(command: str, out_dir, *extra: str) -> subprocess.CompletedProcess:
    """The command as a user types it, with `outputs/` (where results go by default) under out_dir."""
    args = command.split()[1:]
    if args[:2] == ["-m", "ablate"] and not {"--help", "--cfg"} & set(args):
        args.append(f"out_dir={out_dir}")
    args = [str(out_dir) if a == "outputs/" else a for a in args]
    return subprocess.run([sys.executable, *args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_this_file_runs_every_tour_command():
    assert [c for c, _ in tour()] == list(TOUR)


def test_the_tour_commands_that_train_nothing(tmp_path):
    comments = dict(tour())
    out = {c: shell(c, tmp_path) for c, how in TOUR.items() if how == "check"}
    helped = out["python -m ablate --help"]
    assert helped.returncode == 0 and "== Examples ==" in helped.stdout
    assert all(f"\n{group}:\n" in helped.stdout for group in ("optimizer", "checkpoint", "offload", "parallel"))
    cfg = out["python -m ablate --cfg job optimizer=sgd"]
    assert cfg.returncode == 0 and "optimizer:" in cfg.stdout and "momentum" in cfg.stdout
    typo = out["python -m ablate optimizer=adamx"]
    assert typo.returncode == 1 and "adamw" in typo.stderr and "sgd" in typo.stderr  # the valid options
    keys = out["python -m ablate batch_sz=16 optimizer.lrr=1e-3"]
    assert keys.returncode == 1 and "batch_size" in keys.stderr  # the closest key
    bad = out["python -m ablate optimizer.lr=abc"]
    quoted = re.search(r'"(.+)"', comments["python -m ablate optimizer.lr=abc"])[1]  # what the README says it prints
    assert bad.returncode == 1 and quoted in bad.stdout + bad.stderr and "[invalid]" in bad.stdout
    plan = shell("python -m ablate model=gpt2 batch_size=16 seq_len=1024 steps=50", tmp_path / "plan",
                 "predict_only=true")
    assert plan.returncode == 0, plan.stderr
    (point,) = results_under(tmp_path / "plan")
    assert point["status"] == "predicted" and point["config"]["seq_len"] == 1024


@pytest.mark.slow
def test_the_tour_trains_and_reports_as_written(tmp_path):
    """The tour's training commands in order into one outputs/: the grid reuses the points the
    earlier commands measured, and the report reads them all."""
    runs = [c for c, how in TOUR.items() if how == "run"]
    done = {c: shell(c, tmp_path) for c in runs}
    for command, proc in done.items():
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
    assert done["python -m ablate -m optimizer=sgd,adamw batch_size=8,16,32"].stdout.count("[   skip]") == 2
    statuses = {(r["choices"]["optimizer"], r["config"]["batch_size"]): r["status"] for r in results_under(tmp_path)}
    assert len(statuses) == 6 and set(statuses.values()) == {"ok"}
    report = done["python -m analysis.report outputs/"].stdout
    assert report.startswith("# ablate report: 6 runs (6 ok)")


def table_after(text: str, anchor: str) -> list[str]:
    """The lines of the first Markdown table after `anchor` in text."""
    rest = text.split(anchor, 1)[1]
    start = rest.index("\n|") + 1
    return [line for line in rest[start:].split("\n\n", 1)[0].splitlines() if line.startswith("|")]


def cells(table: list[str], drop: tuple[str, ...] = ()) -> list[list[str]]:
    """A table's cells, less the columns named in `drop`, and less the alignment row."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    keep = [i for i, name in enumerate(rows[0]) if name not in drop]
    return [[r[i] for i in keep] for r in rows if not set("".join(r)) <= set(":-")]


# (README text just before the table, the sweep's command, the report's options, the report's
# heading, columns the README leaves out)
PLANS = [
    ("marked\n`~` (nothing ran, so it has no latency columns):",
     "-m parallel=fsdp,ddp checkpoint=none,block device=cuda parallel.nproc=8 model=gpt2-xl batch_size=8 "
     "seq_len=1024 predict_only=true", ["--table", "setting"], "## Setting", ()),
    ("`python -m analysis.report <sweep dir> --table batch` (2-core CPU VM, 3 s):",
     "-m experiment=batch_scan predict_only=true device=cuda gpu_memory_gib=16", ["--table", "batch"],
     "## Batch size scan", ()),
    ("less its Predicted peak and Status columns, which repeat the prediction and say `predicted`):",
     "-m predict_only=true find_batch=true device=cuda model=gpt2-large precision=bf16 batch_size=64 seq_len=1024 "
     "checkpoint=none,block gpu_memory_gib=24,40,80", ["--table", "full"], "## All runs",
     ("Predicted peak (MiB)", "Status")),
]


@pytest.mark.parametrize("anchor,command,options,heading,drop",
                         [PLANS[0], *(pytest.param(*p, marks=pytest.mark.slow) for p in PLANS[1:])],
                         ids=["setting", "batch", "find_batch"])
def test_the_readmes_plan_tables_are_what_the_tool_prints(tmp_path, anchor, command, options, heading, drop):
    sweep = subprocess.run([sys.executable, "-m", "ablate", *command.split(), f"hydra.sweep.dir={tmp_path}/s",
                            f"out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stderr
    report = subprocess.run([sys.executable, "-m", "analysis.report", f"{tmp_path}/s", *options], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr
    assert cells(table_after(README, anchor)) == cells(table_after(report.stdout, heading), drop)


def test_the_readmes_demo_table_is_the_recorded_demo_report():
    """The demo's measured table cannot be rerun to the digit: it is the recorded page's."""
    recorded = (ROOT / "benchmarks" / "results" / "cpu-demo" / "report.md").read_text()
    assert table_after(README, "From `make demo`") == table_after(recorded, "## Setting")
