"""The ladder sweeper (hydra/sweeper=ladder): ordered, cumulative override sets through the real CLI.
Most tests use predict_only=true: every point is composed, validated and predicted, none trained."""
from __future__ import annotations

import pytest

from analysis import report
from tests.helpers import FAST, results_under, run_cli

# The tests' tiny model, without FAST's batch_size: a key on the command line wins over every rung.
SMALL = [f for f in FAST if not f.startswith("batch_size=")]
LADDER = ["-m", "hydra/sweeper=ladder", "predict_only=true", *SMALL]


def by_rung(path) -> list[dict]:
    return sorted(results_under(path), key=lambda r: r["config"]["rung"])


def ladder_labels(path, capsys) -> list[str]:
    """The first column of the report's ladder table."""
    assert report.main([str(path), "--ladder", "--table", "setting"]) == 0
    table = capsys.readouterr().out.split("## Setting (ladder)")[1].split("\n\n")[1]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def test_a_cumulative_ladder_keeps_every_rung_above_and_reports_in_rung_order(tmp_path, capsys):
    rungs = "hydra.sweeper.rungs=[{batch_size:8},{accumulation:x2},{checkpoint:block},{optimizer:sgd}]"
    out = run_cli([*LADDER, rungs, f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False)
    assert out.returncode == 0, out.stderr
    runs = by_rung(tmp_path / "s")
    assert [r["config"]["rung"] for r in runs] == [0, 1, 2, 3]
    assert all(r["config"]["batch_size"] == 8 for r in runs)  # rung 0's key stays for all below it
    assert [r["config"]["accumulation"]["steps"] for r in runs] == [1, 2, 2, 2]
    assert [r["choices"]["checkpoint"] for r in runs] == ["none", "none", "block", "block"]
    assert [r["choices"]["optimizer"] for r in runs] == ["adamw", "adamw", "adamw", "sgd"]
    assert ladder_labels(tmp_path / "s", capsys) == [
        "Baseline (batch size = 8)", "+ Gradient accumulation (4 × 2 = 8)", "+ Block recompute", "+ SGD"]


def test_rungs_apart_sweep_within_a_rung_and_a_command_line_grid_runs_the_whole_ladder(tmp_path):
    rungs = "hydra.sweeper.rungs=[{},{checkpoint:block,batch_size:'2,4'}]"
    out = run_cli([*LADDER, rungs, "hydra.sweeper.cumulative=false", "optimizer=sgd,adamw",
                   f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False)
    assert out.returncode == 0, out.stderr
    runs = results_under(tmp_path / "s")
    got = sorted((r["choices"]["optimizer"], r["config"]["rung"], r["choices"]["checkpoint"], r["config"]["batch_size"])
                 for r in runs)
    assert got == [("adamw", 0, "none", 8), ("adamw", 1, "block", 2), ("adamw", 1, "block", 4),
                   ("sgd", 0, "none", 8), ("sgd", 1, "block", 2), ("sgd", 1, "block", 4)]
    launched = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if "] \t#" in line]
    assert [("optimizer=sgd" in line) for line in launched] == [True] * 3 + [False] * 3  # one ladder, then the next


def test_only_runs_the_rungs_it_names_as_they_are_in_the_whole_ladder(tmp_path):
    rungs = "hydra.sweeper.rungs=[{batch_size:8},{accumulation:x2},{checkpoint:block},{optimizer:sgd}]"
    out = run_cli([*LADDER, rungs, "hydra.sweeper.only=[3,1]", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False)
    assert out.returncode == 0, out.stderr
    runs = by_rung(tmp_path / "s")
    assert [r["config"]["rung"] for r in runs] == [1, 3]
    assert [(r["config"]["batch_size"], r["config"]["accumulation"]["steps"], r["choices"]["checkpoint"],
             r["choices"]["optimizer"]) for r in runs] == [(8, 2, "none", "adamw"), (8, 2, "block", "sgd")]


@pytest.mark.parametrize("only", ["[4]", "2"])
def test_only_names_the_rungs_it_can_take(tmp_path, only):
    rungs = "hydra.sweeper.rungs=[{batch_size:8},{accumulation:x2},{checkpoint:block},{optimizer:sgd}]"
    out = run_cli([*LADDER, rungs, f"hydra.sweeper.only={only}"], tmp_path, fast=False)
    assert out.returncode != 0
    assert "hydra.sweeper.only" in out.stderr and "each from 0 to 3" in out.stderr


def test_the_command_line_wins_over_a_rung(tmp_path):
    rungs = "hydra.sweeper.rungs=[{batch_size:8},{batch_size:16,checkpoint:block}]"
    out = run_cli([*LADDER, rungs, "batch_size=2", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False)
    assert out.returncode == 0, out.stderr
    assert [(r["config"]["batch_size"], r["choices"]["checkpoint"]) for r in by_rung(tmp_path / "s")] == [
        (2, "none"), (2, "block")]


@pytest.mark.parametrize("rungs, named", [
    ("hydra.sweeper.rungs=['batch_size=8']", "hydra.sweeper.rungs[0]"),
    ("hydra.sweeper.rungs=[]", "needs hydra.sweeper.rungs"),
])
def test_a_malformed_ladder_is_named(tmp_path, rungs, named):
    out = run_cli([*LADDER, rungs], tmp_path, fast=False)
    assert out.returncode != 0
    assert named in out.stderr


@pytest.mark.slow
def test_a_point_reused_from_another_sweep_takes_this_ladders_rung(tmp_path):
    first = run_cli(["-m", "hydra/sweeper=ladder", *SMALL, "hydra.sweeper.rungs=[{optimizer:sgd,batch_size:4}]",
                     f"hydra.sweep.dir={tmp_path}/a"], tmp_path, fast=False)
    assert first.returncode == 0, first.stderr
    second = run_cli(["-m", "hydra/sweeper=ladder", *SMALL, "hydra.sweeper.rungs=[{optimizer:sgd,batch_size:2},{batch_size:4}]",
                      f"hydra.sweep.dir={tmp_path}/b"], tmp_path, fast=False)
    assert second.returncode == 0, second.stderr
    (reused,) = [r for r in results_under(tmp_path / "b") if r["config"]["batch_size"] == 4]
    (original,) = results_under(tmp_path / "a")
    assert reused["run_id"] == original["run_id"] and reused["timing"] == original["timing"]  # not run again
    assert (original["config"]["rung"], reused["config"]["rung"]) == (0, 1)


def test_a_ladder_run_without_multirun_says_only_its_base_point_ran(tmp_path):
    out = run_cli(["experiment=layer_recompute", "predict_only=true", *SMALL], tmp_path, fast=False)
    assert out.returncode == 0, out.stderr
    assert "without -m only its base point runs" in out.stderr
    assert len(results_under(tmp_path)) == 1


def test_rung_values_are_written_in_hydras_override_grammar():
    from hydra_plugins.ablate_launcher.sweepers import _override_value

    assert [_override_value(v) for v in (["layernorm", "gelu"], True, None, 8, "8,16")] == [
        "[layernorm,gelu]", "true", "null", "8", "8,16"]
