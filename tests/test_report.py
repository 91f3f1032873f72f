"""analysis.report: result trees -> tables checked cell by cell (labels, deltas, OOM cells, order,
rounding), robustness to bad files, and the command's options."""
from __future__ import annotations

import pandas as pd
import pytest

from ablate import results
from analysis import batch_table, compare, plot_common, tables
from analysis.load import load
from analysis.report import main
from helpers import run_report

BASE = {"optimizer": "adamw", "precision": "fp32", "accumulation": "none", "checkpoint": "none", "offload": "none",
        "parallel": "single", "model": "gpt2-large", "data": "synthetic"}


def _write(root, name, status="ok", peak=None, latency=None, batch=128, steps=1, finished="2026-01-01T00:00:00",
           reason=None, gpu="NVIDIA H100 80GB HBM3", util=None, loss=3.0, tflops=10.0, predicted=None, config=None,
           **choices):
    metrics = {"peak_allocated_mib": peak, "train_latency_s": latency, "iter_time_ms": latency and latency * 10,
               "tokens_per_s": latency and 1000 / latency, "tflops": tflops if peak else None,
               "loss_final": loss if peak else None, "gpu_util_pct_mean": util and util[0],
               "gpu_util_pct_std": util and util[1], "losses": [4.0, loss] if peak else []}
    config = {"batch_size": batch, "accumulation": {"steps": steps}, **(config or {})}
    r = results.make(name, status, reason, {**BASE, **choices}, config, [], metrics=metrics,
                     env={"gpu_name": gpu, "world_size": 1},
                     prediction={"peak_mib": predicted, "breakdown_mib": None} if predicted else None,
                     timing={"started_at": None, "finished_at": finished, "wall_s": 1.0})
    results.write_json(root / name / "result.json", r)


@pytest.fixture
def ladder(tmp_path):
    """The published gpt2-large ladder's shape: each row adds a technique."""
    _write(tmp_path, "a", peak=17022, latency=45.5, finished="2026-01-01T00:00:01")
    _write(tmp_path, "b", peak=11736, latency=54.8, steps=4, accumulation="x4", finished="2026-01-01T00:00:02")
    _write(tmp_path, "c", peak=9800, latency=60.1, steps=4, accumulation="x4", checkpoint="block",
           finished="2026-01-01T00:00:03")
    _write(tmp_path, "d", status="oom", reason="CUDA out of memory", steps=4, accumulation="x4", checkpoint="block",
           optimizer="sgd", finished="2026-01-01T00:00:04")
    return tmp_path


def _setting(root, **kw):
    df = load([root])
    labels = compare.varied(df)
    return tables.setting(df, labels, compare.baseline_index(df, labels, None), **kw)


def test_setting_table_labels_deltas_and_oom(ladder):
    t = _setting(ladder)
    assert list(t.columns) == ["Setting", "GPU Memory Peak (MiB)", "Training Latency (s)", "Δ memory vs baseline",
                               "Δ time vs baseline"]
    rows = {r["Setting"]: r for _, r in t.iterrows()}
    base = rows["Baseline (batch size = 128)"]
    assert (base["GPU Memory Peak (MiB)"], base["Training Latency (s)"], base["Δ memory vs baseline"]) == \
        ("17,022", "45.50", "+0.0%")
    acc = rows["+ Gradient accumulation (32 × 4 = 128)"]
    assert (acc["GPU Memory Peak (MiB)"], acc["Δ memory vs baseline"], acc["Δ time vs baseline"]) == \
        ("11,736", "-31.1%", "+20.4%")
    assert rows["+ Gradient accumulation (32 × 4 = 128) + Block recompute"]["Δ memory vs baseline"] == "-42.4%"
    oom = rows["+ SGD + Gradient accumulation (32 × 4 = 128) + Block recompute"]
    assert (oom["GPU Memory Peak (MiB)"], oom["Training Latency (s)"], oom["Δ memory vs baseline"]) == ("OOM", "", "")


def test_ladder_adds_delta_vs_previous_row_in_run_order(ladder, capsys):
    assert main([str(ladder), "--ladder", "--table", "setting"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ablate report: 4 runs (3 ok, 1 oom)\n")  # what failed, before any table
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")][1:]
    assert [ln.split("|")[1].strip() for ln in lines] == [  # each rung names what it adds
        "Baseline (batch size = 128)", "+ Gradient accumulation (32 × 4 = 128)", "+ Block recompute", "+ SGD"]
    assert lines[2].split("|")[6].strip() == "-16.5%"  # 9800 vs 11736 MiB


def test_batch_table_stops_at_the_first_oom_and_shows_usage_mean_std(tmp_path):
    for b, peak in ((1, 3000), (2, 4100), (4, 6500), (7, 14736), (8, 15900)):
        _write(tmp_path, f"b{b}", peak=peak, latency=b * 0.75, batch=b, util=(86.2, 9.7))
    for b in (9, 16):
        _write(tmp_path, f"b{b}", status="oom", reason="CUDA out of memory", batch=b)
    df = load([tmp_path])
    (title, t), = batch_table.batch(df, compare.varied(df)).items()
    assert list(t["Batch Size"]) == ["1", "2", "4", "7", "8", "9"]  # 16 is past the first OOM
    assert t.iloc[3].tolist() == ["7", "14,736", "86.2 +/- 9.7", "10.00", "52.50"]
    assert t.iloc[5].tolist() == ["9", "OOM", "", "", ""]


def test_a_combination_run_at_one_batch_size_gets_no_batch_table_of_one_row(tmp_path):
    for b, peak in ((8, 3000), (16, 5000)):
        _write(tmp_path, f"adamw{b}", peak=peak, latency=1.0, batch=b)
    _write(tmp_path, "sgd8", peak=2000, latency=1.0, batch=8, optimizer="sgd")  # one batch size: no scan
    df = load([tmp_path])
    assert list(batch_table.batch(df, compare.varied(df))) == ["optimizer=adamw"]


def test_a_report_again_removes_the_plots_it_no_longer_draws_and_nothing_else(ladder, tmp_path):
    out = tmp_path / "report"
    assert main([str(ladder), "--out", str(out)]) == 0
    drawn = sorted(p.name for p in out.glob("*.png"))
    (out / "pareto-seq_len-64.png").write_bytes(b"an earlier report's family")
    (out / "breakdown-old.png").write_bytes(b"another")
    (out / "my-notes.png").write_bytes(b"the user's own")
    assert main([str(ladder), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == sorted([*drawn, "my-notes.png"])


def test_a_plans_batch_table_shows_predicted_peaks_and_the_oom_it_predicted(tmp_path):
    """A plan with a capacity (predict_only gpu_memory_gib=...): no measured column is left empty,
    and the OOM row says it is a prediction, with its figure, not a measured out-of-memory."""
    for b, peak in ((1, 2660), (8, 10862)):
        _write(tmp_path, f"b{b}", status="predicted", batch=b, predicted=peak)
    _write(tmp_path, "b16", status="oom", batch=16, predicted=20236,
           reason=f"{results.PRUNED} 20,236 MiB > 15,078 MiB (95% of 15,872 MiB usable); not run (predict_only)")
    _write(tmp_path, "b32", status="oom", batch=32, reason=f"{results.NOT_RUN} batch_size=16 was predicted to ...")
    df = load([tmp_path])
    (_, t), = batch_table.batch(df, compare.varied(df)).items()
    assert t.values.tolist() == [["1", "~2,660 (predicted)"], ["8", "~10,862 (predicted)"],
                                 ["16", "OOM (predicted ~20,236)"]]
    assert list(t.columns) == ["Batch Size", "Memory (MiB)"]
    assert tables.failed(df[df["batch_size"] == 32].iloc[0]) == "not run"  # as the ladder and full tables show it
    measured_oom = df.iloc[0].copy()
    measured_oom[["status", "reason"]] = ["oom", "CUDA out of memory"]  # has a prediction, but ran and failed
    assert tables.failed(measured_oom) == "OOM"


def test_full_table_and_marginal_effects_of_a_grid(tmp_path):
    for opt, ckpt, peak, time_s, loss in (("adamw", "none", 1000, 10, 3.0), ("sgd", "none", 600, 9, 3.3),
                                          ("adamw", "block", 700, 13, 3.0), ("sgd", "block", 300, 12, 3.3)):
        _write(tmp_path, f"{opt}-{ckpt}", peak=peak, latency=time_s, loss=loss, optimizer=opt, checkpoint=ckpt)
    _write(tmp_path, "err", status="error", reason="worker killed by SIGKILL", optimizer="adafactor")
    df = load([tmp_path])
    labels = compare.varied(df)
    assert labels == ["optimizer", "checkpoint"]
    df = df.sort_values(labels).reset_index(drop=True)
    full = tables.full(df, labels, compare.baseline_index(df, labels, None))  # adamw / none
    # No empty columns: no find_batch run, and nothing measured reserved or NVML memory.
    assert not {"Max micro-batch", "Peak reserved (MiB)", "NVML peak (MiB)"} & set(full) and "TFLOP/s" in full
    err = full[full["optimizer"] == "adafactor"].iloc[0]
    assert err["Peak allocated (MiB)"] == "error" and err["Status"] == "error: worker killed by SIGKILL"
    sgd = full[(full["optimizer"] == "sgd") & (full["checkpoint"] == "none")].iloc[0]
    assert (sgd["Peak allocated (MiB)"], sgd["Final loss"], sgd["Δ loss vs baseline"]) == ("600.0", "3.3000", "+10.0%")
    m = tables.marginal(df, labels).set_index(["Group", "Option"])
    # sgd vs adamw: memory -40% (none) and -57.1% (block), time -10% and -7.7%: medians of the 2 pairs
    assert m.loc[("optimizer", "sgd")].tolist() == ["adamw", "-48.6%", "-8.8%", "+10.0%", "2", "0"]
    assert m.loc[("checkpoint", "block")]["Δ memory (median)"] == "-40.0%"
    assert m.loc[("optimizer", "adafactor")]["Not ok"] == "1"


def test_marginal_effects_cover_option_keys_and_run_keys(tmp_path):
    """`optimizer.in_backward=false,true compile=null,true`: neither is a group, yet each is a
    technique with a do-nothing value (the option's default, off) and gets its row."""
    for in_backward, compile_, peak, time_s in ((False, None, 1000, 10), (True, None, 800, 11),
                                                (False, True, 950, 8), (True, True, 750, 9)):
        _write(tmp_path, f"{in_backward}-{compile_}", peak=peak, latency=time_s,
               config={"optimizer": {"in_backward": in_backward}, "compile": compile_})
    df = load([tmp_path])
    labels = compare.varied(df)
    assert set(labels) == {"compile", "optimizer.in_backward"}
    m = tables.marginal(df, labels).set_index(["Group", "Option"])
    # in_backward: -20% and -21.1% memory, +10% and +12.5% time; compile: -5% and -6.25%, -20% and -18.2%
    assert m.loc[("optimizer.in_backward", "True")].tolist() == ["False", "-20.5%", "+11.2%", "+0.0%", "2", "0"]
    assert m.loc[("compile", "True")].tolist() == ["off", "-5.6%", "-19.1%", "+0.0%", "2", "0"]
    assert len(m) == 2
    assert set(_setting(tmp_path)["Setting"]) == {
        "Baseline (batch size = 128)", "+ Optimizer step in backward", "+ torch.compile",
        "+ torch.compile + Optimizer step in backward"}


def test_an_emulated_card_reads_as_one(tmp_path):
    for name, gib, peak in (("a", None, 900.0), ("b", 16.0, 800.0)):
        _write(tmp_path, name, peak=peak, latency=1.0, config={"gpu_memory_gib": gib})
    assert list(_setting(tmp_path)["Setting"]) == ["Baseline (batch size = 128)", "+ 16 GiB card (emulated)"]


def test_a_grid_without_a_do_nothing_option_is_compared_with_the_groups_reference(tmp_path, capsys):
    """`-m parallel=fsdp,ddp checkpoint=none,block` has no single-process run: DDP is the reference,
    the baseline is none+ddp (not whichever row sorts first), the Setting table opens with it and
    names it DDP, and single changes come before their combination."""
    for par, ckpt, peak in (("ddp", "none", 1000), ("fsdp", "none", 800), ("ddp", "block", 600),
                            ("fsdp", "block", 400)):
        _write(tmp_path, f"{par}-{ckpt}", peak=peak, latency=10.0, parallel=par, checkpoint=ckpt)
    assert main([str(tmp_path), "--table", "setting", "--table", "full"]) == 0
    out = capsys.readouterr().out
    settings = [ln.split("|")[1:4] for ln in out.split("## All runs")[0].splitlines() if ln.startswith("| ")][1:]
    assert [[c.strip() for c in row] for row in settings] == [
        ["Baseline (batch size = 128): DDP (1 process)", "1,000", "10.00"], ["+ Block recompute", "600", "10.00"],
        ["+ FSDP (1 process)", "800", "10.00"], ["+ Block recompute + FSDP (1 process)", "400", "10.00"]]
    m = tables.marginal(load([tmp_path]), ["checkpoint", "parallel"]).set_index(["Group", "Option"])
    assert m.loc[("parallel", "fsdp")].tolist() == ["ddp", "-26.7%", "+0.0%", "+0.0%", "2", "0"]  # -20%, -33%
    assert m.loc[("checkpoint", "block")][["Against", "Pairs"]].tolist() == ["none", "2"]


def test_a_value_never_paired_and_never_failing_gets_no_marginal_row(tmp_path):
    """`optimizer.lr=1e-3,3e-4` never runs the default 6e-4: a row "1e-3 against 6e-4, 0 pairs" says
    nothing (a report of MoE models with model.config keys set away from their file's values would
    have them: benchmarks/results/NVIDIA-H200/moe.md). An unpaired value that failed keeps its row:
    its "Not ok" is the finding."""
    for lr in (1e-3, 3e-4):
        for ckpt in ("none", "block"):
            _write(tmp_path, f"{lr}-{ckpt}", peak=100 / (2 if ckpt == "block" else 1), latency=10.0,
                   checkpoint=ckpt, optimizer="adamw", config={"optimizer": {"lr": lr}})
    _write(tmp_path, "bad-none", status="oom", checkpoint="none", optimizer="adamw", config={"optimizer": {"lr": 0.1}})
    m = tables.marginal(load([tmp_path]), ["checkpoint", "optimizer.lr"])
    rows = set(zip(m["Group"], m["Option"], m["Pairs"], m["Not ok"]))
    assert rows == {("checkpoint", "block", "2", "0"), ("optimizer.lr", "0.1", "0", "1")}, m.to_dict("records")


def test_baseline_option_narrows_the_runs_and_the_usual_rule_picks_among_them(tmp_path, capsys):
    """`--baseline parallel=fsdp` over the mission's 2 x 2 grid is FSDP without recompute whatever
    order the rows load in, and a key or value no run has is a message naming what there is."""
    for par, ckpt, peak in (("fsdp", "block", 400), ("ddp", "none", 1000), ("fsdp", "none", 800),
                            ("ddp", "block", 600)):
        _write(tmp_path, f"{par}-{ckpt}", peak=peak, latency=10.0, parallel=par, checkpoint=ckpt)
    assert main([str(tmp_path), "--table", "setting", "--baseline", "parallel=fsdp"]) == 0
    settings = [ln.split("|")[1:3] for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][1:]
    assert [[c.strip() for c in row] for row in settings][:2] == [
        ["Baseline (batch size = 128): FSDP (1 process)", "800"], ["+ Block recompute", "400"]]
    # A baseline with recompute: the runs without it drop a technique, they add none.
    assert main([str(tmp_path), "--table", "setting", "--baseline", "parallel=fsdp,checkpoint=block"]) == 0
    settings = [ln.split("|")[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][1:]
    assert [c.strip() for c in settings] == [
        "Baseline (batch size = 128): Block recompute + FSDP (1 process)", "+ DDP (1 process)",
        "− Block recompute", "− Block recompute + DDP (1 process)"]
    assert main([str(tmp_path), "--baseline", "parallel=fsdp,checkpoint=every2"]) == 2
    assert "--baseline checkpoint=every2: no run matches; checkpoint is one of block, none among the runs " \
           "with parallel=fsdp" in capsys.readouterr().err
    assert main([str(tmp_path), "--baseline", "optimiser=sgd"]) == 2
    assert "no run has a column 'optimiser'; the columns that vary here are checkpoint, parallel" in \
        capsys.readouterr().err

def test_baseline_values_match_as_the_command_line_spells_them(tmp_path):
    """`gpu_memory_gib=8,null` loads as a float column (8.0, NaN): `--baseline gpu_memory_gib=null`
    and `=8` find those runs (not a TypeError from sorting NaN among text for null, nor no match for
    8), and a miss lists the values as typed."""
    _write(tmp_path, "capped", status="oom", reason="CUDA out of memory", config={"gpu_memory_gib": 8})
    _write(tmp_path, "whole", peak=9000, latency=10.0, config={"gpu_memory_gib": None})
    _write(tmp_path, "lean", peak=6000, latency=4.0, optimizer="sgd", config={"gpu_memory_gib": 8, "compile": True})
    df = load([tmp_path])
    assert list(df.loc[compare._matching(df, [], {"gpu_memory_gib": "null"}).index, "run_id"]) == ["whole"]
    assert sorted(df.loc[compare._matching(df, [], {"gpu_memory_gib": "8"}).index, "run_id"]) == ["capped", "lean"]
    assert list(df.loc[compare._matching(df, [], {"compile": "true"}).index, "run_id"]) == ["lean"]
    with pytest.raises(ValueError, match="gpu_memory_gib is one of 8, null$"):
        compare._matching(df, [], {"gpu_memory_gib": "6"})
    assert compare.spelled("none") == "none" and compare.spelled(0.5) == "0.5"  # an option named none stays one
    labels = {r["run_id"]: plot_common.run_label(r, ["gpu_memory_gib"]) for _, r in df.iterrows()}
    assert labels == {"capped": "8", "whole": "null", "lean": "8"}  # a plot's or snapshot table's run name
    full = tables.full(df, ["gpu_memory_gib", "compile"], 0).set_axis(df["run_id"])
    assert full.loc[["capped", "whole", "lean"], "gpu_memory_gib"].tolist() == ["8", "null", "8"]  # not 8.0 and ""
    assert full.loc["lean", "compile"] == "true"


def test_the_baseline_is_the_run_most_at_reference_then_an_ok_one(tmp_path):
    def base(*labels):
        df = load([tmp_path]).sort_values(list(labels)).reset_index(drop=True)
        return df.loc[compare.baseline_index(df, list(labels), None), "run_id"]

    _write(tmp_path, "a", status="oom", reason="CUDA out of memory", optimizer="adamw", precision="fp32")
    _write(tmp_path, "b", peak=100, latency=1.0, optimizer="sgd", precision="fp32")
    _write(tmp_path, "c", status="oom", reason="CUDA out of memory", optimizer="adamw", precision="bf16")
    assert base("optimizer", "precision") == "a"  # the reference itself, even though it ran out of memory
    (tmp_path / "a" / "result.json").unlink()
    assert base("optimizer", "precision") == "b"  # b and c each have one reference option; b is ok


def test_status_cell_gives_a_reason_only_when_there_is_one(tmp_path):
    _write(tmp_path, "p", status="predicted", optimizer="adamw")
    _write(tmp_path, "o", status="oom", reason="CUDA out of memory", optimizer="sgd")
    _write(tmp_path, "k", peak=100, latency=1.0, optimizer="adafactor")
    df = load([tmp_path]).sort_values("optimizer").reset_index(drop=True)
    full = tables.full(df, ["optimizer"], 0)
    assert list(full["Status"]) == ["ok", "predicted", "oom: CUDA out of memory"]  # adafactor, adamw, sgd


def test_runs_of_several_models_get_a_setting_table_and_a_baseline_each(tmp_path, capsys):
    """`python -m analysis.report outputs/` over sweeps of two models: no delta crosses models."""
    for model, opt, peak, loss in (("gpt2", "adamw", 1000, 3.0), ("gpt2", "sgd", 600, 3.3),
                                   ("gpt2-xl", "adamw", 9000, 2.0), ("gpt2-xl", "sgd", 4500, 2.5)):
        _write(tmp_path, f"{model}-{opt}", peak=peak, latency=10.0, loss=loss, model=model, optimizer=opt)
    assert main([str(tmp_path), "--table", "setting", "--table", "full"]) == 0
    out = capsys.readouterr().out
    assert "## Setting: model=gpt2\n" in out and "## Setting: model=gpt2-xl\n" in out
    xl = out.split("## Setting: model=gpt2-xl")[1].split("##")[0]
    rows = [[c.strip() for c in ln.split("|")[1:5]] for ln in xl.splitlines() if ln.startswith("| ")][1:]
    assert rows == [["Baseline (batch size = 128)", "9,000", "10.00", "+0.0%"], ["+ SGD", "4,500", "10.00", "-50.0%"]]
    df = load([tmp_path]).sort_values(["model", "optimizer"]).reset_index(drop=True)
    bases = compare.baselines(df, ["model", "optimizer"], None)
    assert list(tables.full(df, ["model", "optimizer"], bases)["Δ loss vs baseline"]) == \
        ["+0.0%", "+10.0%", "+0.0%", "+25.0%"]
    # --baseline picks the run in every model that has one, and must match somewhere.
    bases = compare.baselines(df, ["model", "optimizer"], {"optimizer": "sgd"})
    assert list(df.loc[bases, "optimizer"]) == ["sgd"] * 4
    with pytest.raises(ValueError, match="no run matches"):
        compare.baselines(df, ["model", "optimizer"], {"optimizer": "lion"})
    # A model without a matching run keeps its own baseline rather than losing its deltas.
    bases = compare.baselines(df, ["model", "optimizer"], {"model": "gpt2", "optimizer": "sgd"})
    assert list(df.loc[bases, "run_id"]) == ["gpt2-sgd"] * 2 + ["gpt2-xl-adamw"] * 2


def test_a_predict_only_plan_shows_predicted_deltas_and_never_mixes_them_with_measured(tmp_path):
    for ckpt, predicted in (("none", 1000.0), ("block", 400.0)):
        _write(tmp_path, ckpt, status="predicted", predicted=predicted, checkpoint=ckpt)
    df = load([tmp_path]).sort_values("checkpoint").reset_index(drop=True)
    t = tables.setting(df, ["checkpoint"], compare.baseline_index(df, ["checkpoint"], None))
    assert t.values.tolist() == [  # nothing ran: no latency columns, empty in every row
        ["Baseline (batch size = 128)", "~1,000 (predicted)", "~+0.0%"],
        ["+ Block recompute", "~400 (predicted)", "~-60.0%"]]
    ladder = tables.setting(df, ["checkpoint"], compare.baseline_index(df, ["checkpoint"], None), ladder=True)
    assert list(ladder["Δ memory vs previous"]) == ["", "~+150.0%"]  # rows in order: block, then none
    assert list(tables.full(df, ["checkpoint"], 0).columns) == [
        "checkpoint", "Peak allocated (MiB)", "Predicted peak (MiB)", "Status"]  # no measured column
    _write(tmp_path, "none", peak=900, latency=1.0, predicted=1000.0, checkpoint="none")  # the baseline ran
    df = load([tmp_path]).sort_values("checkpoint").reset_index(drop=True)
    t = tables.setting(df, ["checkpoint"], compare.baseline_index(df, ["checkpoint"], None))
    assert list(t["Δ memory vs baseline"]) == ["+0.0%", ""]  # a prediction is not compared with a measurement
    ladder = tables.setting(df, ["checkpoint"], compare.baseline_index(df, ["checkpoint"], None), ladder=True)
    assert "Δ memory vs previous" not in ladder  # empty in every row: ok after predicted, neither compared


def test_gpu_name_becomes_a_column_when_it_varies(tmp_path):
    _write(tmp_path, "h100", peak=100, latency=1.0)
    _write(tmp_path, "a100", peak=100, latency=2.0, gpu="NVIDIA A100-SXM4-40GB")
    assert "env_gpu_name" in compare.varied(load([tmp_path]))


def test_bad_files_are_named_and_skipped(tmp_path, capsys):
    _write(tmp_path, "a", peak=100.0, latency=1.0)
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "result.json").write_text('{"schema": "ablate.res')
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "result.json").write_text('{"hello": 1}')
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "result.json").write_text('{"schema": "ablate.result/0", "run_id": "x"}')
    assert main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    for name in ("trunc", "foreign", "old"):
        assert f"{name}/result.json" in err
    assert list(pd.read_csv(tmp_path / "report" / "runs.csv")["run_id"]) == ["a"]


def test_duplicate_run_ids_keep_the_newest(tmp_path):
    _write(tmp_path / "old", "a", peak=100.0, latency=1.0, finished="2026-01-01T00:00:00")
    _write(tmp_path / "new", "a", peak=200.0, latency=1.0, finished="2026-02-01T00:00:00")
    df = load([tmp_path])
    assert len(df) == 1 and df["peak_allocated_mib"].iloc[0] == 200.0


def test_command_writes_report_md_csv_and_plots(ladder, capsys):
    assert main([str(ladder), "--out", str(ladder / "out")]) == 0
    md = (ladder / "out" / "report.md").read_text()
    assert "## Setting" in md and "## All runs" in md and "![pareto](pareto.png)" in md
    assert (ladder / "out" / "pareto.png").exists() and (ladder / "out" / "runs.csv").exists()
    assert main([str(ladder), "--baseline", "optimizer=lion"]) == 2


def test_without_a_path_it_reads_outputs_where_ablate_writes(tmp_path, monkeypatch, capsys):
    _write(tmp_path / "outputs", "a", peak=17022, latency=45.5)
    monkeypatch.chdir(tmp_path)
    assert main(["--table", "setting"]) == 0
    assert "Baseline (batch size = 128)" in capsys.readouterr().out


def test_empty_directory_exits_1_with_a_message(tmp_path):
    proc = run_report([str(tmp_path)])
    assert proc.returncode == 1 and "no result.json found" in proc.stderr


def test_a_misspelt_path_is_named_as_missing_not_as_empty(tmp_path, capsys):
    """`outptus/` is a typo, not a directory without results: the message says which."""
    report = tmp_path / "r"
    code = main([str(tmp_path), str(tmp_path / "outptus"), "--out", str(report)])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == f"no such file or directory: {tmp_path / 'outptus'}"
    assert not report.exists()


def test_option_keys_that_vary_within_an_option_become_labelled_columns(tmp_path):
    """checkpoint=layers with different `types`, and an optimizer key, are told apart; keys that
    only differ because the option differs (sgd's lr vs adamw's) are not columns."""
    def write(name, checkpoint, rung, **keys):
        config = {"batch_size": 8, "rung": rung, "accumulation": {"steps": 1},
                  "checkpoint": {"_target_": "x", **({"types": keys["types"]} if "types" in keys else {})},
                  "optimizer": {"_target_": "y", "lr": keys.get("lr", 6e-4), "in_backward": keys.get("ib", False)}}
        r = results.make(name, "ok", None, {**BASE, "checkpoint": checkpoint, "optimizer": keys.get("opt", "adamw")},
                         config, [], metrics={"peak_allocated_mib": 100.0 - rung, "train_latency_s": 1.0})
        results.write_json(tmp_path / name / "result.json", r)

    write("a", "none", 0)
    write("b", "layers", 1, types=["gelu"])
    write("c", "layers", 2, types=["layernorm", "gelu"])
    write("d", "none", 3, ib=True)
    write("e", "none", 4, opt="sgd", lr=0.1)
    df = load([tmp_path])
    labels = compare.varied(df)
    assert labels == ["optimizer", "checkpoint", "optimizer.in_backward", "checkpoint.types"]
    assert main([str(tmp_path), "--table", "setting"]) == 0
    t = _setting(tmp_path)
    assert list(t["Setting"]) == ["Baseline (batch size = 8)", "+ Layer-type recompute (gelu)",
                                  "+ Layer-type recompute (layernorm, gelu)", "+ Optimizer step in backward", "+ SGD"]


def test_an_option_key_set_away_from_its_default_is_labelled_even_on_another_option(tmp_path):
    """leanest's rungs: adamw8bit and adafactor, each with in_backward=true, against a baseline
    adamw without it. The key never varies within one option, but the runs set it: the rows say so."""
    for name, opt, ib, parallel, nproc in (("a", "adamw", False, "single", 1), ("b", "adamw8bit", True, "single", 1),
                                           ("c", "adafactor", True, "ddp", 2)):
        config = {"batch_size": 8, "accumulation": {"steps": 1}, "parallel": {"_target_": "p", "nproc": nproc},
                  "optimizer": {"_target_": "o", "lr": {"adafactor": 0.01}.get(opt, 6e-4), "in_backward": ib}}
        r = results.make(name, "ok", None, {**BASE, "optimizer": opt, "parallel": parallel}, config, [],
                         metrics={"peak_allocated_mib": 100.0, "train_latency_s": 1.0})
        results.write_json(tmp_path / name / "result.json", r)
    df = load([tmp_path])
    # lr differs only with the option (each file's default); ddp's nproc=2 is away from its
    # default (auto), but the parallel label counts the processes itself.
    assert compare.varied(df) == ["optimizer", "parallel", "optimizer.in_backward"]
    assert list(_setting(tmp_path)["Setting"]) == [
        "Baseline (batch size = 8)", "+ 8-bit AdamW + Optimizer step in backward",
        "+ Adafactor + DDP (2 processes) + Optimizer step in backward"]


def test_an_option_key_sweep_is_measured_against_the_keys_default(tmp_path):
    """`-m parallel=fsdp parallel.sync_each_micro_step=true,false`: the baseline is the run with the
    key at its default (true), not the run that sorts first."""
    for name, sync, peak in (("a", False, 324.0), ("b", True, 300.0)):
        config = {"batch_size": 8, "accumulation": {"steps": 4},
                  "parallel": {"_target_": "p", "nproc": 2, "sync_each_micro_step": sync}}
        r = results.make(name, "ok", None, {**BASE, "accumulation": "x4", "parallel": "fsdp"}, config, [],
                         metrics={"peak_allocated_mib": peak, "train_latency_s": 1.0})
        results.write_json(tmp_path / name / "result.json", r)
    df = load([tmp_path])
    assert compare.varied(df) == ["parallel.sync_each_micro_step"]
    t = _setting(tmp_path)
    assert t[["Setting", "Δ memory vs baseline"]].values.tolist() == [
        ["Baseline (batch size = 8)", "+0.0%"], ["+ Gradient sync on the last micro-step only", "+8.0%"]]


def test_an_allocator_sweep_is_measured_against_the_default_settings(tmp_path):
    """`-m alloc_conf=null,expandable_segments:True`: null (the default) is the baseline though it
    sorts last, and the other row names the setting as users would export it."""
    for name, conf, peak in (("a", "expandable_segments:True", 300.0), ("b", None, 340.0)):
        r = results.make(name, "ok", None, BASE, {"batch_size": 8, "accumulation": {"steps": 1}, "alloc_conf": conf},
                         [], metrics={"peak_allocated_mib": peak, "train_latency_s": 1.0})
        results.write_json(tmp_path / name / "result.json", r)
    assert compare.varied(load([tmp_path])) == ["alloc_conf"]
    assert _setting(tmp_path)[["Setting", "Δ memory vs baseline"]].values.tolist() == [
        ["Baseline (batch size = 8)", "+0.0%"], ["+ PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "-11.8%"]]


def test_by_names_the_varied_columns_it_leaves_out(tmp_path, capsys):
    """`--by checkpoint` over an optimizer x checkpoint grid labels two runs alike per checkpoint
    option: stderr says which varied column the labels leave out, and a full default label says nothing."""
    for opt, ckpt, peak in (("adamw", "none", 1000), ("sgd", "none", 800), ("adamw", "block", 600),
                            ("sgd", "block", 400)):
        _write(tmp_path, f"{opt}-{ckpt}", peak=peak, latency=10.0, optimizer=opt, checkpoint=ckpt)
    assert main([str(tmp_path), "--table", "setting", "--by", "checkpoint"]) == 0
    assert "note: optimizer also varies between these runs but not in --by's labels" in capsys.readouterr().err
    assert main([str(tmp_path), "--table", "setting"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_label_names_an_option_key_only_where_the_option_does_not_imply_it(tmp_path):
    """One run sets adamw's lr, so `optimizer.lr` labels rows. SGD at its own default lr reads
    "+ SGD" (it read "+ SGD + optimizer.lr=0.1"), SGD at another lr names it, and against a baseline
    with layer-type recompute the runs without it (no `types` key) drop it, with no "types=nan"."""
    def write(name, opt, lr, checkpoint="none"):
        config = {"batch_size": 8, "accumulation": {"steps": 1}, "optimizer": {"_target_": "o", "lr": lr},
                  "checkpoint": {"_target_": "c", **({"types": ["gelu"]} if checkpoint == "layers" else {})}}
        r = results.make(name, "ok", None, {**BASE, "optimizer": opt, "checkpoint": checkpoint}, config, [],
                         metrics={"peak_allocated_mib": 100.0, "train_latency_s": 1.0})
        results.write_json(tmp_path / name / "result.json", r)

    write("a", "adamw", 6e-4)
    write("b", "adamw", 1e-3)
    write("c", "sgd", 0.1)
    write("d", "sgd", 0.5)
    assert list(_setting(tmp_path)["Setting"]) == [
        "Baseline (batch size = 8)", "+ optimizer.lr=0.001", "+ SGD", "+ SGD + optimizer.lr=0.5"]
    write("e", "adamw", 6e-4, checkpoint="layers")
    assert main([str(tmp_path), "--table", "setting", "--baseline", "checkpoint=layers"]) == 0
    df = load([tmp_path])
    labels = compare.varied(df)
    t = tables.setting(df, labels, compare.baseline_index(df, labels, {"checkpoint": "layers"}))
    assert list(t["Setting"])[:2] == ["Baseline (batch size = 8): Layer-type recompute (gelu)",
                                      "− Layer-type recompute"]
