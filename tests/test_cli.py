"""End to end through the real CLI on CPU: a point, a 2-point multirun, skipping, the contract."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from ablate.build import check_config
from ablate.command_line import RUN_TYPES
from ablate.schema import GROUPS, options
from helpers import ROOT, compose_config, compose_spec, results_under, run_cli, run_report

# The result contract as docs/architecture.md lists it; results.py must produce exactly these keys
# (ablate adds loss_floor: the synthetic data's entropy floor; compile_s; skipped_steps).
TOP = {"schema", "run_id", "status", "reason", "choices", "config", "overrides", "metrics", "prediction",
       "env", "timing", "artifacts"}
METRICS = {"peak_allocated_mib", "peak_reserved_mib", "peak_active_mib", "nvml_peak_mib", "host_peak_rss_mib",
           "init_peak_allocated_mib", "peak_allocated_by_phase_mib", "breakdown_mib", "iter_time_ms", "iter_time_ms_p10", "iter_time_ms_p90",
           "train_latency_s", "tokens_per_s", "samples_per_s", "tflops", "mfu", "hfu", "gpu_util_pct_mean",
           "gpu_util_pct_std", "compile_s", "skipped_steps", "traced_step_oom", "diverged_at_step", "loss_scale", "loss_first", "loss_final", "eval_loss", "loss_floor",
           "losses", "per_rank", "max_batch_size", "predicted_max_batch_size", "find_batch", "max_seq_len",
           "predicted_max_seq_len", "find_seq", "params", "trainable_params"}
ENV = {"torch", "cuda", "gpu_name", "gpu_total_mib", "emulated_gpu_mib", "driver", "world_size", "hostname", "git_sha", "python",
       "slurm_job_id", "cuda_visible_devices", "cpus", "cpu_threads"}
CHOICES = set(GROUPS)  # one choice per group of the registry (ablate/groups.py)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    proc = run_cli(["-m", "optimizer=adamw,sgd", f"hydra.sweep.dir={out}/sweeps/first"], out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_multirun_writes_one_result_per_point(sweep):
    out, proc = sweep
    results = results_under(out / "sweeps" / "first")
    assert sorted(r["choices"]["optimizer"] for r in results) == ["adamw", "sgd"]
    assert all(r["status"] == "ok" for r in results)
    dirs = sorted(p.parent.name for p in (out / "sweeps" / "first").rglob("result.json"))
    assert [d for d in dirs if "optimizer=sgd" in d.split(",")] and all("seq_len=16" in d for d in dirs)
    assert len({r["run_id"] for r in results}) == 2
    # nothing printed, no file: Hydra's <job>.log is made at its first line, worker.log dropped empty
    assert not [p for p in (out / "sweeps" / "first").rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert proc.stdout.count("[     ok]") == 2  # one summary line per point
    assert proc.stdout.count("  eval...\n") == 2  # eval says so, whatever the terminal
    for r in results:  # each line says how much of the point's wall time was not its measured steps
        t = r["timing"]
        assert f"overhead {t['wall_s'] - t['phases_s']['measured']:.1f} of {t['wall_s']:.1f} s" in proc.stdout


def test_result_carries_every_contract_field(sweep):
    for r in results_under(sweep[0] / "sweeps" / "first"):
        assert set(r) == TOP and r["schema"] == "ablate.result/1"
        assert set(r["metrics"]) == METRICS and set(r["env"]) == ENV and set(r["choices"]) == CHOICES
        assert set(r["prediction"]) == {"peak_mib", "breakdown_mib", "method", "step_time_s"}
        assert r["prediction"]["method"] == "analytic" and r["prediction"]["peak_mib"] > 0
        assert set(r["timing"]) == {"started_at", "finished_at", "wall_s", "phases_s"}
        # Where the wall time went: every phase of the worker, in order, within the job's wall time.
        phases = r["timing"]["phases_s"]
        assert list(phases) == ["startup", "setup", "build", "warmup", "traced_step", "measured", "eval", "teardown"]
        assert all(s >= 0 for s in phases.values()) and sum(phases.values()) <= r["timing"]["wall_s"]
        # The timed steps are inside it. Phases are rounded to the ms (and read off time.time, the
        # steps off perf_counter): 3 nano steps of 4 ms once came out 0.3 ms above their phase.
        assert phases["measured"] >= r["metrics"]["train_latency_s"] - 0.002
        assert set(r["metrics"]["breakdown_mib"]) == {"params", "grads", "optimizer", "activations", "other"}
        assert r["metrics"]["traced_step_oom"] is False  # the breakdown is there: the traced step fit
        m = r["metrics"]
        for key in ("iter_time_ms", "tokens_per_s", "samples_per_s", "loss_first", "loss_final", "eval_loss",
                    "peak_allocated_mib", "host_peak_rss_mib", "tflops"):
            assert isinstance(m[key], float) and math.isfinite(m[key]) and m[key] > 0, key
        assert m["iter_time_ms_p10"] <= m["iter_time_ms"] <= m["iter_time_ms_p90"]
        assert len(m["losses"]) == 5  # warm-up 2 + measured 3
        # Not measurable on a CPU: null, never 0.
        for key in ("peak_reserved_mib", "peak_active_mib", "nvml_peak_mib", "peak_allocated_by_phase_mib", "mfu",
                    "gpu_util_pct_mean"):
            assert m[key] is None, key
        assert r["env"]["gpu_name"] is None and r["env"]["world_size"] == 1 and r["env"]["torch"]


@pytest.mark.slow  # two sweeps again: 15 s
def test_rerun_skips_finished_points_and_skip_existing_false_reruns(sweep):
    out, _ = sweep
    first = {r["run_id"]: r for r in results_under(out / "sweeps" / "first")}
    again = run_cli(["-m", "optimizer=adamw,sgd", f"hydra.sweep.dir={out}/sweeps/again"], out)
    assert again.returncode == 0, again.stderr
    # no worker started: none of a launch's files (its spec, its event log)
    assert again.stdout.count("[   skip]") == 2 and not [p for p in (out / "sweeps" / "again").rglob("*")
                                                          if p.name in ("spec.json", "events.jsonl", "worker.log")]
    for r in results_under(out / "sweeps" / "again"):  # the new sweep directory still gets every row,
        copied_from = Path(r.pop("reused_from"))  # naming the result it copies
        assert r == first[r["run_id"]] and copied_from.parent.parent == out / "sweeps" / "first"
    report = run_report([str(out / "sweeps" / "again")], timeout=120)
    assert report.returncode == 0, report.stderr
    setting = report.stdout.split("## Setting", 1)[1].split("\n\n")[1]  # its rows say they were measured before
    assert setting.count(" (reused) ") == 2 and "(reused): a row an earlier sweep measured" in report.stdout
    forced = run_cli(["-m", "optimizer=sgd", "skip_existing=false", f"hydra.sweep.dir={out}/sweeps/forced"], out)
    assert forced.returncode == 0, forced.stderr
    (rerun,) = results_under(out / "sweeps" / "forced")
    assert rerun["run_id"] in first and rerun["timing"]["started_at"] > first[rerun["run_id"]]["timing"]["started_at"]


def test_eval_steps_zero_turns_eval_off(tmp_path):
    proc = run_cli(["eval_steps=0"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (r,) = results_under(tmp_path)
    assert r["status"] == "ok" and r["metrics"]["eval_loss"] is None and r["metrics"]["loss_final"] > 0


def test_single_run_goes_under_outputs_runs_and_samples_sets_the_steps(tmp_path):
    proc = run_cli(["optimizer=sgd", "samples=9"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (result,) = results_under(tmp_path / "runs")
    assert result["status"] == "ok" and result["overrides"][:2] == ["optimizer=sgd", "samples=9"]
    m = result["metrics"]
    assert len(m["losses"]) == 2 + 3  # warm-up + ceil(9 samples / batch 4)
    assert m["samples_per_s"] * m["train_latency_s"] == pytest.approx(12)


def test_defaults_run_with_an_exact_params_breakdown(tmp_path):
    # No wall-clock bound here (CI machines are shared): benchmarks/ times the first command.
    proc = run_cli(["device=cpu"], tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr
    (result,) = results_under(tmp_path)
    m = result["metrics"]
    assert result["status"] == "ok" and math.isfinite(m["loss_final"]) and m["tokens_per_s"] > 0
    error = 100 * (result["prediction"]["peak_mib"] / m["peak_allocated_mib"] - 1)
    assert f"(predicted {result['prediction']['peak_mib']:.1f}, {error:+.1f}%)" in proc.stdout  # its own check
    n_params = instantiate(compose_config()["model"]).num_params()
    assert m["breakdown_mib"]["params"] == pytest.approx(n_params * 4 / 2**20, rel=1e-9)  # fp32


def test_report_of_a_real_sweep(sweep):
    out, _ = sweep
    proc = run_report([str(out / "sweeps" / "first")])
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| adamw") or ln.startswith("| sgd")]
    assert len(rows) == 2 and all(ln.rstrip().endswith("| ok       |") for ln in rows)
    assert (out / "sweeps" / "first" / "report" / "runs.csv").exists()


@pytest.mark.slow
def test_compile_reports_its_time_apart_and_keeps_the_losses(tmp_path):
    eager = run_cli(["optimizer=sgd", f"hydra.run.dir={tmp_path}/eager"], tmp_path)
    compiled = run_cli(["optimizer=sgd", "compile=true", f"hydra.run.dir={tmp_path}/compiled"], tmp_path)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr
    (e,) = results_under(tmp_path / "eager")
    (c,) = results_under(tmp_path / "compiled")
    assert c["status"] == "ok" and e["metrics"]["compile_s"] is None
    # Compilation is timed apart from the steps: were it inside the first measured step, the mean step
    # would hold a share of it. The bound is one step, not ten: load on the machine moves the ratio,
    # and how many steps a compile is worth is not the claim.
    assert c["metrics"]["compile_s"] > c["metrics"]["iter_time_ms"] / 1e3
    assert c["metrics"]["losses"] == pytest.approx(e["metrics"]["losses"], abs=1e-4)


@pytest.mark.slow
def test_submitit_local_runs_points_one_at_a_time(tmp_path):
    proc = run_cli(["-m", "hydra/launcher=submitit_local", "optimizer=adamw,sgd", f"hydra.sweep.dir={tmp_path}/s"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(results_under(tmp_path / "s"), key=lambda r: r["timing"]["started_at"])
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["timing"]["finished_at"] <= rows[1]["timing"]["started_at"]  # no overlap
    assert (tmp_path / "s" / ".submitit").is_dir()


def test_makefile_keeps_only_a_torch_as_new_as_pyproject_asks():
    """`make` keeps an installed torch when it meets pyproject's floor; the two floors must agree, and
    the Makefile's check must compare versions as numbers ('2.9.1' >= '2.11' as strings)."""
    import re
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomllib is 3.11's copy of tomli
        import tomli as tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (floor,) = [r.split(">=")[1] for r in pyproject["project"]["dependencies"] if r.startswith("torch>=")]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_FLOOR := (\S+)$", makefile, re.M).group(1) == floor
    check = re.search(r'\$\(PY\) -c "(import sys, importlib.*?)" 2>', makefile).group(1)
    for version, keep in [("2.9.1", False), ("2.10.0", False), (floor + ".0", True), ("2.13.0+cpu", True)]:
        code = check.replace("m.version('torch')", repr(version)).replace("$(TORCH_FLOOR)", floor)
        assert (subprocess.run([sys.executable, "-c", code]).returncode == 0) is keep, version


def test_help_says_what_ablate_is_and_its_examples_are_valid_points():
    """`--help` opens with what ablate does, lists the groups, and ends with examples; each example
    composes and passes the job's checks (a sweep's first value of each list standing in for it)."""
    proc = subprocess.run([sys.executable, "-m", "ablate", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ablate: ablation grids of memory-saving techniques")
    assert "== Examples ==" in proc.stdout
    # One line for each option and each run key, from the option's file and the schema's comments.
    lines = proc.stdout.splitlines()
    assert "  adamw                   torch.optim.AdamW with PyTorch's default implementation choice" in lines
    assert "  warmup_steps            Unmeasured steps (>= 2): the first allocates the optimizer state, the last is..." \
        in lines
    # A line too long ends at a clause or a whole word, never inside one (was: "the other gpt* options cha...")
    from ablate.help import WIDTH, _first_sentence, option_line
    assert option_line("model", "gpt2") == "ablate's own GPT-2 (ablate/models/gpt_module.py), 124M parameters"
    cut = _first_sentence(" ".join(f"word{i}" for i in range(40)))
    assert cut.endswith("...") and cut[:-3].split()[-1] in [f"word{i}" for i in range(40)]
    assert all(len(ln) <= WIDTH for ln in lines)
    for group in ("model", "optimizer", "checkpoint", "experiment"):
        listed = lines[lines.index(f"{group}:") + 1:]
        for option in options(group):
            assert any(ln.startswith(f"  {option} ") and len(ln.split()) > 2 for ln in listed[:40]), option
    for key in RUN_TYPES:
        assert any(ln.startswith(f"  {key} ") and len(ln.split()) > 1 for ln in lines), key
    examples = [ln.split()[3:] for ln in proc.stdout.splitlines() if ln.strip().startswith("python -m ablate")]
    assert len(examples) >= 4
    for args in examples:
        overrides = [a.split(",")[0] for a in args if a != "-m"]
        check_config(compose_spec(overrides))
