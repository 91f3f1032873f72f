"""The contract check (ablate.results.problem) against what ablate's writer never produces, and the
report over such files and over one run_id measured twice.

A file that parses but holds a NaN or an inf (JSON's NaN / Infinity tokens, a literal beyond a
float's range), a list or a mapping where an option name goes, a negative size, time or throughput,
or a batch size below 1 is not a result: problem() names the field, and the report skips the file
with that reason instead of crashing or taking it as a baseline. A result the writer makes, a
diverged one with null losses included, passes. The same run_id measured again on the same machine
keeps one row and names the file it drops; measured on two machines, both rows stay, each marked
with the machine it ran on."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from ablate import results
from analysis.load import load
from analysis.report import main as report

RAW = "__raw__"  # a placeholder value, replaced in the JSON text by a token json.dumps will not write
CHOICES = {"model": "gpt2", "optimizer": "adamw", "precision": "fp32", "accumulation": "none",
           "checkpoint": "none", "offload": "none", "parallel": "single", "data": "synthetic"}


def _good(run_id: str = "abc", status: str = "ok", host: str = "node1", peak: float = 100.0,
          finished: str = "2026-01-01T00:00:00", **metrics) -> dict:
    """A result as the job writes it, with every kind of figure the check looks into."""
    metrics = {"peak_allocated_mib": peak, "peak_reserved_mib": peak + 20, "iter_time_ms": 12.5,
               "iter_time_ms_p10": 12.0, "iter_time_ms_p90": 13.0, "train_latency_s": 1.25, "tokens_per_s": 800.0,
               "samples_per_s": 8.0, "tflops": 1.5, "mfu": 0.01, "loss_first": 4.0, "loss_final": 3.0,
               "losses": [4.0, 3.0], "breakdown_mib": {"params": 10.0, "grads": 10.0, "activations": 50.0},
               "per_rank": [{"rank": 0, "peak_allocated_mib": peak, "peak_reserved_mib": peak + 20,
                             "nvml_peak_mib": None},
                            {"rank": 1, "peak_allocated_mib": peak, "peak_reserved_mib": peak + 20,
                             "nvml_peak_mib": None}], **metrics}
    config = {"batch_size": 8, "seq_len": 64, "accumulation": {"steps": 1}, "optimizer": {"lr": 6e-4}}
    return results.make(run_id, status, None, CHOICES, config, [], metrics=metrics,
                        env={"hostname": host, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_total_mib": 81559.0,
                             "torch": "2.5.0", "world_size": 2},
                        prediction={"peak_mib": 110.0, "breakdown_mib": {"params": 10.0}, "method": "analytic",
                                    "step_time_s": 0.0125},
                        timing={"finished_at": finished, "wall_s": 2.0})


def _set(result: dict, place: str, value) -> dict:
    """`result` with the field at `place` ("metrics.per_rank.1.peak_reserved_mib") set to `value`."""
    result = json.loads(json.dumps(result))
    *parents, last = place.split(".")
    node = result
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return result


def _json(place: str, value) -> str:
    """A good result's JSON text with `value` written as it stands (NaN, 1e400) at `place`."""
    return json.dumps(_set(_good(), place, RAW)).replace(f'"{RAW}"', value)


# (place, what the JSON text holds there, the reason problem() gives)
NOT_FINITE = [
    ("metrics.peak_allocated_mib", "1e400", "metrics.peak_allocated_mib is not a finite number"),
    ("metrics.loss_final", "NaN", "metrics.loss_final is not a finite number"),
    ("metrics.losses.1", "Infinity", "metrics.losses[1] is not a finite number"),
    ("metrics.breakdown_mib.activations", "-Infinity", "metrics.breakdown_mib.activations is not a finite number"),
    ("prediction.peak_mib", "NaN", "prediction.peak_mib is not a finite number"),
    ("prediction.step_time_s", "Infinity", "prediction.step_time_s is not a finite number"),
    ("config.optimizer.lr", "Infinity", "config.optimizer.lr is not a finite number"),
    ("env.gpu_total_mib", "-1e400", "env.gpu_total_mib is not a finite number"),
]
# (place, the value written there, the reason problem() gives)
IMPOSSIBLE = [
    ("choices.optimizer", ["adamw", "sgd"], "choices.optimizer is a list, not an option name or null"),
    ("choices.checkpoint", {"name": "block"}, "choices.checkpoint is a dict, not an option name or null"),
    ("metrics.peak_allocated_mib", -5, "metrics.peak_allocated_mib is -5, not a size >= 0"),
    ("metrics.breakdown_mib.activations", -1.5, "metrics.breakdown_mib.activations is -1.5, not a size >= 0"),
    ("metrics.per_rank.1.peak_reserved_mib", -2.0, "metrics.per_rank[1].peak_reserved_mib is -2.0, not a size >= 0"),
    ("prediction.peak_mib", -3.0, "prediction.peak_mib is -3.0, not a size >= 0"),
    ("metrics.iter_time_ms", -12.5, "metrics.iter_time_ms is -12.5, not a time or throughput >= 0"),
    ("metrics.train_latency_s", -1.0, "metrics.train_latency_s is -1.0, not a time or throughput >= 0"),
    ("metrics.tokens_per_s", -800.0, "metrics.tokens_per_s is -800.0, not a time or throughput >= 0"),
    ("config.batch_size", 0, "config.batch_size is 0, not a whole number >= 1"),
    ("config.batch_size", -8, "config.batch_size is -8, not a whole number >= 1"),
]
# (a file's JSON text, the reason the report gives for skipping it)
BAD = [(_json(place, token), why) for place, token, why in NOT_FINITE] + \
      [(json.dumps(_set(_good(), place, value)), why) for place, value, why in IMPOSSIBLE]


@pytest.mark.parametrize("place, text, why", NOT_FINITE, ids=[f"{p}={t}" for p, t, _ in NOT_FINITE])
def test_a_nan_or_an_inf_anywhere_is_not_a_result(tmp_path, place, text, why):
    path = tmp_path / "result.json"
    path.write_text(_json(place, text))
    assert json.loads(path.read_text()) is not None  # Python's json reads it: the check must refuse it
    result, reason = results.load(path)
    assert result is None and reason.startswith(why), reason


@pytest.mark.parametrize("place, value, why", IMPOSSIBLE, ids=[f"{p}={v}" for p, v, _ in IMPOSSIBLE])
def test_an_option_that_is_no_name_or_a_figure_below_its_floor_is_not_a_result(place, value, why):
    assert results.problem(_set(_good(), place, value)) == why


def test_a_result_the_writer_makes_passes_a_diverged_one_with_null_losses_included(tmp_path):
    diverged = _good(status="diverged", losses=[4.0, None], loss_final=None)
    oom = results.make("abc", "oom", "CUDA out of memory", CHOICES, {"batch_size": 8}, [])  # every figure null
    for result in (_good(), diverged, oom):
        path = tmp_path / result["status"] / "result.json"
        results.write_json(path, result)
        assert results.load(path) == (result, None)


def test_a_prediction_has_its_four_keys_null_when_nothing_was_predicted_and_the_report_reads_its_time(tmp_path):
    nothing = results.make("abc", "error", "launch failed", CHOICES, {"batch_size": 8}, [])
    assert nothing["prediction"] == {"peak_mib": None, "breakdown_mib": None, "method": None, "step_time_s": None}
    results.write_json(tmp_path / "result.json", _good())
    assert list(load([tmp_path])["predicted_step_time_s"]) == [0.0125]


def test_the_report_skips_each_impossible_file_with_its_reason_and_reports_the_rest(tmp_path, capsys):
    results.write_json(tmp_path / "good" / "result.json", _good(run_id="good"))
    for i, (text, _) in enumerate(BAD):
        (tmp_path / f"bad{i}").mkdir()
        (tmp_path / f"bad{i}" / "result.json").write_text(text.replace('"run_id": "abc"', f'"run_id": "bad{i}"'))
    assert report([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    err = capsys.readouterr().err
    for i, (_, why) in enumerate(BAD):
        assert f"skipping {tmp_path / f'bad{i}' / 'result.json'}: not a result ({why}" in err
    assert list(pd.read_csv(tmp_path / "report" / "runs.csv")["run_id"]) == ["good"]


def test_one_run_measured_on_two_machines_keeps_both_rows_each_marked_with_its_host(tmp_path, capsys):
    results.write_json(tmp_path / "a" / "result.json", _good(host="node1", peak=100.0))
    results.write_json(tmp_path / "b" / "result.json", _good(host="node2", peak=140.0,
                                                              finished="2026-01-02T00:00:00"))
    df = load([tmp_path])
    assert sorted(zip(df["measured_on"], df["peak_allocated_mib"])) == [("node1", 100.0), ("node2", 140.0)]
    assert report([str(tmp_path), "--out", str(tmp_path / "report"), "--table", "setting", "--table", "full"]) == 0
    out, err = capsys.readouterr()
    assert "(on node1)" in out and "(on node2)" in out and "dropping" not in err


def test_one_run_measured_again_on_the_same_machine_keeps_the_newer_and_names_the_dropped_file(tmp_path, capsys):
    old, new = tmp_path / "old" / "result.json", tmp_path / "new" / "result.json"
    results.write_json(old, _good(peak=100.0, finished="2026-01-01T00:00:00"))
    results.write_json(new, _good(peak=140.0, finished="2026-01-02T00:00:00"))
    df = load([tmp_path])
    assert list(df["peak_allocated_mib"]) == [140.0] and df["measured_on"].isna().all()
    err = capsys.readouterr().err
    assert err.count("note: dropping") == 1
    assert f"note: dropping {old}: run abc measured again on the same machine, in {new}, which is kept" in err
