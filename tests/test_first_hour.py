"""What a new user meets in the first hour: the conventions a Python CLI user expects
(console scripts, exit statuses, shell completion), the libraries every technique needs installed
with ablate, and a SLURM start that fails where a script can see it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAST, ROOT, results_under, run_cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BIN = Path(sys.executable).parent  # the venv's console scripts sit beside its python


def test_console_scripts_run_ablate_and_its_report(tmp_path):
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {"ablate": "ablate.__main__:cli", "ablate-report": "analysis.report:cli"}
    # From another directory: the config is found from the package, not the working directory.
    run = subprocess.run([str(BIN / "ablate"), *FAST, f"out_dir={tmp_path}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "[     ok]" in run.stdout and len(results_under(tmp_path)) == 1
    report = subprocess.run([str(BIN / "ablate-report"), str(tmp_path)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("# ablate report: 1 run (1 ok)")


@pytest.mark.slow  # two CLI runs and a sweep: 22 s
def test_a_single_run_that_fails_exits_non_zero_and_a_sweep_does_not(tmp_path):
    """A script running one point notices it failed; a sweep that survives its failing points
    exits 0 (its rows say how each ended)."""
    invalid = run_cli(["accumulation.steps=3"], tmp_path / "a")  # batch_size=4 is not divisible by 3
    assert invalid.returncode == 1 and "[invalid]" in invalid.stdout
    assert run_cli(["accumulation.steps=3"], tmp_path / "a").returncode == 1  # checked again, still invalid
    error = run_cli(["seed=5"], tmp_path / "b", env={"ABLATE_FAULT": "error"})
    assert error.returncode == 1 and "[  error]" in error.stdout
    sweep = run_cli(["-m", "accumulation.steps=1,3", f"hydra.sweep.dir={tmp_path}/s"], tmp_path / "c")
    assert sweep.returncode == 0 and "1 ok, 1 invalid" in sweep.stdout
    plan = run_cli(["predict_only=true"], tmp_path / "d")
    assert plan.returncode == 0 and "[predicted]" in plan.stdout


def test_hydras_shell_completion_passes_the_key_check():
    proc = subprocess.run([sys.executable, "-m", "ablate", "--shell-completion", "install=bash"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # was: "unknown key 'install'"
    assert "hydra_bash_completion" in proc.stdout


def test_the_readmes_completion_line_completes_the_ablate_command():
    """docs/usage.md: `eval "$(ablate --shell-completion install=bash)"`, then `ablate optim<TAB>`."""
    script = ('eval "$(ablate --shell-completion install=bash)"; COMP_LINE="ablate optim"; COMP_POINT=12; '
              'COMP_CWORD=1; hydra_bash_completion; echo "${COMPREPLY[@]}"')
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.stdout.split() == ["optimizer.", "optimizer="], proc.stderr


def test_every_technique_library_installs_with_ablate():
    """bitsandbytes (8-bit AdamW) and torchao (low-bit AdamWs, stochastic rounding, optimizer
    offload) are dependencies, not extras: single_gpu_techniques's all-combined row was invalid on a
    fresh install. bitsandbytes has no macOS wheel: a marker keeps `pip install ablate` working there."""
    deps = {d.split(">")[0].split(";")[0].strip(): d for d in PYPROJECT["project"]["dependencies"]}
    assert deps["bitsandbytes"].endswith("platform_system != 'Darwin'") and "torchao" in deps
    assert not {"bnb", "ao"} & set(PYPROJECT["project"]["optional-dependencies"])


def test_a_slurm_start_that_fails_fails_the_eval_around_it(tmp_path):
    """`eval "$(start.sh)"` ignored a failing start (eval of nothing succeeds): start.sh now prints
    `false` when it fails, so the caller's eval (and a script's `set -e`) sees it."""
    taken = tmp_path / "taken"
    taken.mkdir()
    root = os.geteuid() == 0
    if root:  # another user's directory: start.sh refuses it before installing anything
        os.chown(taken, 65534, 65534)
    env = {**os.environ, "ABLATE_SLURM_DIR": str(taken)}
    proc = subprocess.run(["bash", "-c", 'eval "$(scripts/slurm/start.sh)" && echo started'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "started" not in proc.stdout
    # Not root, it stops one check earlier, the same way.
    assert (f"{taken} belongs to another user" if root else "run me as root") in proc.stderr


@pytest.mark.slow  # a plan through the CLI: 11 s
def test_a_plan_for_an_unnamed_device_on_a_cpu_host_says_it_plans_for_a_gpu(tmp_path):
    """predict_only with device=auto plans for the GPU the user means to run on (its CUDA context
    counted): on a host without one, one line says so and how to plan for this CPU instead."""
    out = run_cli(["-m", "model=gpt-nano", "predict_only=true", "seed=1,2", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False,
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0 and out.stdout.count("[predicted]") == 2, out.stderr
    assert out.stderr.count("plans for a CUDA GPU") == 1 and "device=cpu plans for this host's CPU" in out.stderr
    cpu = run_cli(["model=gpt-nano", "predict_only=true", "device=cpu"], tmp_path / "cpu", fast=False)
    assert "[predicted]" in cpu.stdout and "plans for a CUDA GPU" not in cpu.stderr


def test_importing_torchao_through_ablate_prints_no_developer_warnings():
    """Torch's deprecation of torchao's Enum registrations and torchao's prebuilt kernels for another
    Python would print in every worker that uses torchao: noise in each point's console lines."""
    code = "import ablate, torchao, torchao.optim, torchao.float8"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "register_constant" not in proc.stderr and "Failed to load" not in proc.stderr, proc.stderr
