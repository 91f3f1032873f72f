"""No input and no fault loses a row, second pass: a run that diverges, non-finite numbers on the
command line, an output directory that cannot be written, a host memory limit that is not the
point's, index entries and worker starts that break, and a plan that must refuse what its run would.

Through the real CLI where the fault lies on the CLI's path (a diverged sweep and its report, an
unwritable directory, a process limit, a broken index entry); in process where one function
decides (the command-line check, the display, a worker's start, the host's refusal)."""
from __future__ import annotations

import errno
import json
import math
import os
import resource
import subprocess
import sys

import pytest

from ablate import host, outcome, results
from ablate.build import check_config
from ablate.console import Progress
from ablate.keytypes import fits
from ablate.runner import Trained
from ablate.command_line import unknown_key
from ablate.techniques import Invalid
from analysis.report import main as report
from helpers import FAST, ROOT, compose_spec, results_under, run_cli, slow_except
from launch import local, warm_start

DIVERGES = "optimizer.lr=1e6"  # AdamW at this rate makes the weights NaN within two steps


# A diverged run: a terminal row that says where, marked in the report and no one's baseline.

def test_a_diverged_run_is_a_terminal_row_saying_from_which_step(tmp_path):
    run = run_cli([DIVERGES], tmp_path)
    assert run.returncode == 1, run.stderr  # a single run that did not train: a script notices
    (row,) = results_under(tmp_path)
    assert row["status"] == "diverged" and "Traceback" not in run.stderr
    step = row["metrics"]["diverged_at_step"]
    assert isinstance(step, int) and 1 <= step <= len(row["metrics"]["losses"])
    assert f"(step {step} of {len(row['metrics']['losses'])}, warm-up included)" in row["reason"]
    assert row["metrics"]["losses"][step - 1] is None  # NaN is JSON's null, the status says why
    assert row["metrics"]["peak_allocated_mib"] > 0 and row["metrics"]["iter_time_ms"] > 0  # still measured
    assert "[diverged]" in run.stdout and "loss non-finite" in run.stdout
    again = run_cli([DIVERGES], tmp_path)  # terminal: never trained again
    assert "[   skip]" in again.stdout and len(list(tmp_path.rglob("events.jsonl"))) == 1


@pytest.mark.slow  # a sweep: 10 s
def test_a_sweep_with_a_diverged_point_reports_one_ok_and_one_diverged_row(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    run = run_cli(["-m", "optimizer.lr=1e-3,1e6", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"2 results under {sweep}: 1 ok, 1 diverged" in run.stdout
    assert report([str(sweep), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    setting = md.split("## Setting", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in setting.splitlines() if ln.startswith("| ")][1:]  # past the heading
    assert "0.001" in lines[0] and "Baseline" in lines[0]  # the ok run is the baseline, whatever the order
    (diverged,) = [ln for ln in lines if "1000000" in ln]
    assert "(diverged at step" in diverged and "%" not in diverged  # marked, and no delta against it


def test_a_diverged_runs_reason_under_fp16_names_the_loss_scale():
    run = Trained(steps=3, times_ms=[1.0] * 3, losses=[9.0, 8.0, math.inf, math.nan, math.nan], peaks={},
                  warmup=2, loss_scale=0.125, skipped_steps=3)
    assert run.diverged_at == 3
    why = run.divergence()
    assert why.startswith("the loss was inf at measured step 1 (step 3 of 5, warm-up included)")
    assert "the fp16 loss scale ended at 0.125 with 3 optimizer steps skipped" in why
    assert Trained(steps=1, times_ms=[1.0], losses=[9.0, 8.0, 7.0], peaks={}).divergence() is None


def test_a_display_that_fails_costs_a_line_never_the_worker(tmp_path):
    lines = []
    Progress("p", stream=type("S", (), {"isatty": lambda s: False, "write": lines.append, "flush": lambda s: 0})())(
        {"event": "progress", "step": 3, "steps": 3, "loss": None, "elapsed_s": 1.0})
    assert "loss non-finite" in lines[0]
    worker = ("import json, sys; f = open(sys.argv[1] + '/events.jsonl', 'a'); "
              "f.write(json.dumps({'event': 'progress', 'step': 1, 'steps': 1, 'loss': 1.0, 'elapsed_s': 0}) + '\\n');"
              "f.write(json.dumps({'event': 'result', 'metrics': {}, 'env': {}}) + '\\n')")

    def broken(event):
        raise TypeError("unsupported format string passed to NoneType.__format__")
    out = local.run_worker([sys.executable, "-c", worker, str(tmp_path)], tmp_path, 60, on_event=broken)
    assert out.status == "ok"


# Non-finite numbers: refused on the command line, and no row can fail to serialise.

@pytest.mark.parametrize("arg", ["timeout_s=nan", "gpu_memory_gib=nan", "gpu_memory_gib=inf", "optimizer.lr=inf",
                                 "peak_tflops=nan", "prune_margin=nan", "optimizer.lr=1e-3,-inf",
                                 "optimizer.betas=[0.9,nan]", "optimizer.lr=1e400"])
def test_a_non_finite_number_is_refused_on_the_command_line_naming_its_key(arg):
    error = unknown_key([arg])
    assert error and error.splitlines()[0].startswith(arg.split("=")[0] + "=") and "finite" in error


def test_a_non_finite_float_fails_an_option_keys_type_and_a_zero_card_is_refused():
    assert not fits(math.nan, float) and not fits(math.inf, float) and fits(3, float) and fits(0.5, float)
    with pytest.raises(Invalid, match=r"gpu_memory_gib=0.0 must be > 0 .*null: no limit"):
        check_config(compose_spec([*FAST, "gpu_memory_gib=0"]))


def test_a_row_holding_nan_or_inf_is_written_with_nulls_and_the_values_typed(tmp_path):
    row = results.make("abc", "ok", None, {"optimizer": "adamw"}, {"batch_size": 4, "optimizer": {"lr": math.inf}},
                       ["optimizer.lr=inf"], metrics={"loss_final": math.nan, "losses": [1.0, math.nan]})
    results.write_json(tmp_path / "result.json", row)
    back = json.loads((tmp_path / "result.json").read_text())
    assert back["config"]["optimizer"]["lr"] == "inf" and back["metrics"]["loss_final"] is None
    assert back["metrics"]["losses"] == [1.0, None] and results.problem(back) is None


# An output directory that cannot be written: one line before anything runs.

def test_an_out_dir_under_a_file_is_one_line_before_anything_runs(tmp_path):
    (tmp_path / "afile").write_text("")
    for args in ([], ["-m", "seed=1,2"]):
        run = run_cli(args, tmp_path / "afile" / "out")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.strip().splitlines() == [
            f"error: cannot write under out_dir={tmp_path / 'afile' / 'out'}: {tmp_path / 'afile'} is a file, not a "
            "directory. Nothing ran; give out_dir=DIR a directory you can write (or run from one)."]


@pytest.fixture
def read_only(tmp_path):
    """A directory no one can write in: root writes anywhere a mode allows nothing, so for root it
    is made immutable (chattr +i, ext4 and the like), for anyone else read-only by its mode."""
    where = tmp_path / "ro"
    where.mkdir()
    root = os.geteuid() == 0
    if root:
        subprocess.run(["chattr", "+i", str(where)], check=True)
    else:
        where.chmod(0o555)
    yield where
    subprocess.run(["chattr", "-i", str(where)], check=False) if root else where.chmod(0o755)


def test_a_read_only_working_directory_is_one_line_before_anything_runs(read_only):
    run = subprocess.run([sys.executable, "-m", "ablate", *FAST], cwd=read_only, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("error: cannot write under out_dir=outputs: ") and "Nothing ran" in line
    assert not list(read_only.iterdir())


# Host memory refused under a limit of the process: not a measurement.

@pytest.mark.slow  # two runs under a limit (14 s); a refusal's row is tested in-process above
def test_an_allocation_refused_under_ulimit_is_not_measured_and_runs_again(tmp_path):
    limit = 6 * 2**30  # the worker's logits alone take more (gpt-nano, 256 x 64 tokens of a 50k vocabulary)

    def ulimit_v():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    args = ["model=gpt-nano", "batch_size=256", "seq_len=64", "steps=1", "warmup_steps=2", "device=cpu"]
    cmd = [sys.executable, "-m", "ablate", *args, f"out_dir={tmp_path}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=ulimit_v)
    (row,) = results_under(tmp_path)
    assert row["status"] == "error" and row["reason"].startswith(results.UNMEASURED), (row["reason"], run.stderr)
    assert f"under ulimit -v of {limit / 2**20:,.0f} MiB" in row["reason"] and not results.is_terminal(row)


def test_the_hosts_refusal_is_the_points_only_above_what_is_available_under_no_limit(monkeypatch):
    asked = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes. Error code 12"
    monkeypatch.setattr(host, "process_limit", lambda: None)
    monkeypatch.setattr(host, "cgroup_limit", lambda: None)
    monkeypatch.setattr(host, "host_free_mib", lambda: 1024.0)
    assert host.refused(asked) == ("oom", f"{host.REFUSED}: asked for 4,096 MiB with 1,024 MiB available on this host")
    monkeypatch.setattr(host, "host_free_mib", lambda: 20000.0)  # others held it for a while
    status, why = host.refused(asked)
    assert status == "error" and why.startswith(results.UNMEASURED) and "20,000 MiB available" in why
    monkeypatch.setattr(host, "cgroup_limit", lambda: ("the cgroup's memory.max", 2048.0))
    assert "under the cgroup's memory.max of 2,048 MiB" in host.refused(asked)[1]
    assert host.refused("CUDA error: an illegal memory access") is None


def test_a_cgroup_limit_counts_only_below_the_hosts_memory(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    assert host.cgroup_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    assert host.cgroup_limit(tmp_path) == ("the cgroup's memory.max", 1024.0)
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host.cgroup_limit(tmp_path) is None


def test_a_batch_search_stops_at_an_unmeasured_probe(tmp_path):
    from ablate import find_batch
    from launch.worker_exit import Outcome

    probes = []

    def run(spec, where):
        probes.append(where)
        return Outcome("error", f"{results.UNMEASURED} the host refused 10 MiB under ulimit -v of 100 MiB")
    out = find_batch.measured(compose_spec([*FAST, "batch_size=8"]), None, tmp_path, run)
    assert out.status == "error" and out.reason.startswith(results.UNMEASURED) and len(probes) == 1


# Bookkeeping that breaks: an index entry that is not one, a worker that cannot be started.

@pytest.mark.parametrize("damage", slow_except(["directory", "binary"], "directory"))
def test_a_broken_index_entry_is_named_replaced_and_its_point_run_again(tmp_path, damage):
    assert run_cli([], tmp_path).returncode == 0
    (entry,) = [p for p in (tmp_path / "index").iterdir() if "." not in p.name]
    entry.unlink()
    entry.mkdir() if damage == "directory" else entry.write_bytes(bytes(range(256)))
    run = run_cli([], tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert f"note: the index entry {entry} is not one" in run.stdout
    assert entry.is_file() and results.Index(tmp_path).terminal(entry.name) is not None
    assert "[   skip]" in run_cli([], tmp_path).stdout


@pytest.mark.parametrize("code", [errno.EAGAIN, errno.ENOMEM, errno.EACCES])
def test_a_worker_that_cannot_be_started_is_a_launch_failed_row(tmp_path, monkeypatch, code):
    def no_process(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(warm_start.subprocess, "Popen", no_process)
    monkeypatch.setattr(local.subprocess, "Popen", no_process)
    spec = compose_spec(FAST)
    warm_start.prestart([sys.executable, "-m", "ablate.worker"], dict(os.environ))  # no head start, and no raise
    got = outcome.run_once(spec, tmp_path, [], Progress("p"))
    assert got.status == "error" and got.reason.startswith("launch failed: ") and os.strerror(code) in got.reason


# A plan refuses what its run would.

def test_a_cpu_plan_over_the_hosts_free_memory_is_the_oom_its_run_would_be(tmp_path, monkeypatch):
    monkeypatch.setattr(outcome, "host_free_mib", lambda: 1.0)  # MiB: under gpt-nano's 2.5
    spec = compose_spec([*FAST, "predict_only=true"])
    planned, prediction = outcome.outcome_of(spec, tmp_path, [], Progress("p"))
    assert prediction is not None and planned.status == "oom"
    assert planned.reason.startswith(f"{results.PRUNED} ") and "MiB free on this host" in planned.reason
    ran, _ = outcome.outcome_of(compose_spec(FAST), tmp_path, [], Progress("p"))  # the run's own rule
    assert (ran.status, ran.reason) == (planned.status, planned.reason)
