"""What a report compares and says it is of: comparable families with a baseline each, a time delta
inside the runs' own spread marked as noise, a header naming the device, torch, commit, date and
command, and a CPU's memory column named for what it is."""
from __future__ import annotations

import pandas as pd
import yaml

from ablate import results
from analysis import table_cells
from analysis.plot_common import family_file
from analysis.report import main

CHOICES = {"model": "gpt-nano", "data": "synthetic", "optimizer": "adamw", "precision": "fp32", "accumulation": "none",
           "checkpoint": "none", "offload": "none", "parallel": "single", "loss": "standard"}
CPU = {"torch": "2.13.0+cpu", "gpu_name": None, "git_sha": "0123456789abcdef", "world_size": 1}


def _sweep(root, name: str, task: list[str], own: tuple[str, ...] = ()):
    """A sweep directory as Hydra leaves it: multirun.yaml with the sweep's command-line overrides
    (`task`) and Hydra's own (`own`, after the hydra.mode=MULTIRUN that -m sets)."""
    (root / name).mkdir(parents=True)
    overrides = {"hydra": ["hydra.mode=MULTIRUN", *own], "task": task}
    (root / name / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": overrides}}))
    return root / name


def _run(where, name, peak=100.0, p50=50.0, spread=(45.0, 55.0), seq_len=64, steps=10, vocab=512,
         tflops=0.004, env=CPU, finished="2026-11-25T01:00:00+00:00", accumulation_steps=1, batch_size=8, rung=None, **choices):
    metrics = {"peak_allocated_mib": peak, "iter_time_ms": p50, "iter_time_ms_p10": spread[0],
               "iter_time_ms_p90": spread[1], "train_latency_s": p50 * steps / 1e3, "tflops": tflops,
               "loss_final": 4.0, "losses": [5.0, 4.0]}
    config = {"batch_size": batch_size, "seq_len": seq_len, "steps": steps, "device": "cpu", "rung": rung,
              "accumulation": {"steps": accumulation_steps},
              "model": {"vocab_size": vocab}}
    r = results.make(name, "ok", None, {**CHOICES, **choices}, config, [f"seq_len={seq_len}"], metrics=metrics,
                     env=env, timing={"started_at": None, "finished_at": finished, "wall_s": 1.0})
    results.write_json(where / name / "result.json", r)


def _report(tmp_path, *args) -> str:
    md = tmp_path / "out"
    assert main([str(tmp_path / "runs"), "--out", str(md), *args]) == 0
    return (md / "report.md").read_text()


def _firsts(md: str, heading: str) -> list[str]:
    table = md.split(f"## {heading}\n\n", 1)[1].split("\n\n", 1)[0]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def test_runs_that_differ_in_shape_or_length_get_a_table_and_baseline_each(tmp_path):
    """A demo sweep (vocab 512, seq 64, 200 steps) beside a default run (seq 32, 3 steps): two
    families, a table and baseline each, not one table with a row "+ seq len = 64 + steps = 200 +
    model.vocab_size=512 | −94.7%"."""
    demo = _sweep(tmp_path / "runs", "demo", ["experiment=demo", "optimizer=adamw,sgd"])
    _run(demo, "a", steps=200)
    _run(demo, "s", steps=200, peak=80.0, optimizer="sgd")
    _run(tmp_path / "runs" / "single", "d", peak=1900.0, seq_len=32, steps=3, vocab=50257)
    md = _report(tmp_path)
    assert "These runs form 2 families of comparable runs" in md and "they differ in seq_len, steps" in md
    # titled by the first key that tells the families apart: steps and vocab_size follow seq_len here
    assert _firsts(md, "Setting: seq_len=64") == ["Baseline (batch size = 8)", "+ SGD"]
    assert _firsts(md, "Setting: seq_len=32") == ["Baseline (batch size = 8)"]
    assert "seq len =" not in md  # no row is labelled by what only tells families apart


def test_an_axis_a_sweep_varied_stays_in_one_table(tmp_path):
    """`seq_len=64,128` asks how memory grows with the sequence: one family, one baseline."""
    scan = _sweep(tmp_path / "runs", "scan", ["seq_len=64,128"])
    _run(scan, "short")
    _run(scan, "long", seq_len=128, peak=190.0)
    md = _report(tmp_path)
    assert "families" not in md
    assert _firsts(md, "Setting") == ["Baseline (batch size = 8)", "+ seq len = 128"]


def test_a_time_delta_inside_the_runs_spread_is_marked_as_noise(tmp_path):
    runs = _sweep(tmp_path / "runs", "grid", ["precision=fp32,tf32", "checkpoint=none,block"])
    _run(runs, "base", p50=50.0, spread=(40.0, 90.0))
    _run(runs, "tf32", p50=42.0, spread=(30.0, 60.0), precision="tf32")  # -16% on paper, inside the spread
    _run(runs, "block", p50=75.0, spread=(70.0, 80.0), peak=60.0, checkpoint="block")  # +50%: inside it too
    _run(runs, "both", p50=150.0, spread=(140.0, 160.0), peak=60.0, checkpoint="block", precision="tf32")
    md = _report(tmp_path)
    table = md.split("## Setting\n\n", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    header = [c.strip() for c in table.splitlines()[0].split("|")[2:-1]]
    at = {h: i for i, h in enumerate(header)}
    assert rows["+ TF32"][at["Δ time vs baseline"]] == table_cells.NOISE
    assert rows["+ TF32"][at["Iteration p10–p90 (ms)"]] == "30.0–60.0"
    assert rows["+ TF32 + Block recompute"][at["Δ time vs baseline"]] == "+200.0%"  # 150 vs 40–90: real
    assert rows["+ Block recompute"][at["Δ memory vs baseline"]] == "-40.0%"  # memory is never noise-marked
    assert f"{table_cells.NOISE} in a Δ time column: one run's median iteration time lies inside the other's" in md


def test_the_report_opens_with_device_torch_commit_date_and_command(tmp_path):
    runs = _sweep(tmp_path / "runs", "demo", ["experiment=demo", "optimizer=adamw,sgd"])
    _run(runs, "a", finished="2026-11-25T01:02:00+00:00")
    _run(runs, "s", optimizer="sgd", finished="2026-11-25T01:07:00+00:00")
    md = _report(tmp_path, "--format", "html")
    assert md.splitlines()[:8] == [
        "# ablate report: 2 runs (2 ok)", "", "- Device: CPU", "- torch: 2.13.0+cpu", "- Commit: 0123456",
        "- Date: 2026-11-25 01:02 – 01:07 UTC", "- Command: `python -m ablate -m experiment=demo optimizer=adamw,sgd`",
        ""]
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<b>Device:</b> CPU" in html and "<code>python -m ablate -m experiment=demo optimizer=adamw,sgd</code>" in html
    # rows that say how many threads torch ran (env.cpu_threads): the CPU is named with them
    _run(runs, "a", env={**CPU, "cpu_threads": 2})
    _run(runs, "s", optimizer="sgd", env={**CPU, "cpu_threads": 1})
    assert "- Device: CPU: 2 threads (1 run), CPU: 1 thread (1 run)" in _report(tmp_path).splitlines()


def test_the_reports_command_keeps_hydras_own_overrides(tmp_path):
    """A ladder given on the command line: without its hydra/sweeper and rungs the command runs
    one point (was: `python -m ablate -m experiment=demo steps=5`)."""
    runs = _sweep(tmp_path / "runs", "ladder", ["experiment=demo", "steps=5"],
                  own=("hydra/sweeper=ladder", "hydra.sweeper.rungs=[{},{optimizer: sgd}]"))
    _run(runs, "a")
    md = _report(tmp_path)
    assert ("- Command: `python -m ablate -m experiment=demo steps=5 hydra/sweeper=ladder "
            "'hydra.sweeper.rungs=[{},{optimizer: sgd}]'`") in md.splitlines()


def test_a_cpu_report_names_its_memory_traced_and_its_flops_readable(tmp_path):
    runs = _sweep(tmp_path / "runs", "grid", ["optimizer=adamw,sgd"])
    _run(runs, "a", tflops=0.0081)
    _run(runs, "s", tflops=0.0361, optimizer="sgd")
    md = _report(tmp_path)
    assert "| Peak memory (MiB) |" in md.replace("  ", " ").replace("  ", " ") and "GPU Memory Peak" not in md
    assert "on a CPU, traced: the peak of live tensor bytes" in md
    full = md.split("## All runs\n\n", 1)[1].split("\n\n", 1)[0]
    assert "GFLOP/s" in full and "TFLOP/s" not in full and "36.10" in full and "0.00" not in full


def test_a_gpu_report_keeps_the_published_headings():
    gpu = pd.DataFrame({"env_torch": ["2.11.0"], "env_gpu_name": ["NVIDIA H100 80GB HBM3"], "device": ["auto"]})
    assert table_cells.memory_heading(gpu) == "GPU Memory Peak (MiB)"
    assert table_cells.flops(pd.Series([312.4]))[0] == "TFLOP/s"
    plan = pd.DataFrame({"env_torch": [None], "env_gpu_name": [None], "device": ["cuda"]})  # predict_only for a GPU
    assert table_cells.memory_heading(plan) == "GPU Memory Peak (MiB)"


def test_ladder_on_runs_that_are_not_a_ladder_says_so(tmp_path, capsys):
    """single_gpu_techniques is one technique at a time against a base (cumulative: false): read as
    a ladder, its third row would be "+ Block recompute − Gradient accumulation"."""
    runs = _sweep(tmp_path / "runs", "techniques", ["experiment=single_gpu_techniques"])
    _run(runs, "base", finished="2026-11-25T01:00:00+00:00")
    _run(runs, "accum", accumulation="x4", accumulation_steps=4, peak=70.0, finished="2026-11-25T01:01:00+00:00")
    _run(runs, "block", checkpoint="block", peak=60.0, finished="2026-11-25T01:02:00+00:00")
    md = _report(tmp_path, "--ladder")
    assert "these runs are not a ladder ('− Gradient accumulation (2 × 4 = 8) + Block recompute' drops Gradient " \
        "accumulation" in capsys.readouterr().err
    assert "## Setting\n" in md and "Setting (ladder)" not in md and "−" not in md


def test_csv_on_stdout_is_the_full_table_whichever_tables_are_written(tmp_path, capsys):
    runs = _sweep(tmp_path / "runs", "grid", ["optimizer=adamw,sgd"])
    _run(runs, "a")
    _run(runs, "s", optimizer="sgd", peak=80.0)
    printed = []
    for tables in ([], ["--table", "setting"]):  # the full table reused, and made for stdout alone
        _report(tmp_path, "--format", "csv", *tables)
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]
    assert printed[0].splitlines()[0].startswith("optimizer,Peak allocated (MiB)") and len(printed[0].splitlines()) == 3


def test_ladder_notices_a_row_that_goes_back_to_the_baselines_value(tmp_path, capsys):
    """A row that returns to the first row's optimizer and batch size drops them, though no "− "
    label says so (was: "+ SGD + batch size = 8" after batch size 16, read as additions); a value
    changed again (batch 16, then 32) is a rung."""
    runs = _sweep(tmp_path / "runs", "grid", ["optimizer=adamw,sgd", "batch_size=8,16"])
    _run(runs, "a8", finished="2026-11-25T01:00:00+00:00")
    _run(runs, "a16", finished="2026-11-25T01:01:00+00:00", batch_size=16)
    _run(runs, "s8", optimizer="sgd", finished="2026-11-25T01:02:00+00:00")
    _report(tmp_path, "--ladder")
    assert "these runs are not a ladder ('+ SGD + batch size = 8' drops batch size = 16, which the row above " \
        "has)" in capsys.readouterr().err
    (tmp_path / "runs" / "grid" / "s8").rename(tmp_path / "s8")  # out of the report
    _run(runs, "a32", finished="2026-11-25T01:02:00+00:00", batch_size=32)
    md = _report(tmp_path, "--ladder")
    assert "not a ladder" not in capsys.readouterr().err and "Setting (ladder)" in md


def test_each_family_gets_its_own_breakdown_and_batch_scan(tmp_path):
    """As the Pareto plots: a breakdown or batch scan over two models would show "Baseline" twice,
    bars of 10 and 1,200 MiB on one axis (was: one breakdown.png and batch_scan.png for all)."""
    from analysis import plots
    from analysis.compare import families, varied
    from analysis.load import load

    for name, steps, vocab in (("demo", 200, 512), ("default", 3, 50257)):
        runs = _sweep(tmp_path / "runs", name, ["batch_size=8,16", "optimizer=adamw,sgd"])
        for batch, optimizer in ((8, "adamw"), (16, "adamw"), (8, "sgd")):
            _run(runs, f"{name}{batch}{optimizer}", steps=steps, vocab=vocab, batch_size=batch, optimizer=optimizer,
                 peak=batch * 10.0)
    df = load([tmp_path / "runs"])
    titles = [title for title, _, _ in families(df, varied(df))]
    assert len(titles) == 2 and None not in titles
    jobs = [j for j in plots.plot_jobs(df, varied(df), tmp_path / "out") if j.func in (plots.breakdown, plots.batch_scan)]
    assert sorted((j.func.__name__, j.args[-1]) for j in jobs) == sorted(
        (plot, t) for plot in ("batch_scan", "breakdown") for t in titles)
    written = sorted(p.name for p in (j() for j in jobs) if p is not None)  # no breakdown columns in these rows
    assert written == sorted(family_file("batch_scan", t) for t in titles) and "steps-200" in written[0] + written[1]


def test_a_time_delta_of_runs_that_timed_two_steps_is_noise(tmp_path):
    """scale=cpu times 2 steps: their p10–p90 is no spread, and on a loaded CPU a pair of them read
    as a -94% "speedup" of gradient accumulation. Fewer than 5 timed steps: `~`."""
    runs = _sweep(tmp_path / "runs", "grid", ["optimizer=adamw,sgd"])
    _run(runs, "a", steps=2, p50=1000.0, spread=(990.0, 1010.0))
    _run(runs, "s", steps=2, p50=60.0, spread=(59.0, 61.0), optimizer="sgd")
    md = _report(tmp_path)
    table = md.split("## Setting\n\n", 1)[1].split("\n\n", 1)[0]
    sgd = next(line for line in table.splitlines() if line.startswith("| + SGD"))
    header = [c.strip() for c in table.splitlines()[0].split("|")[2:-1]]
    assert [c.strip() for c in sgd.split("|")[2:-1]][header.index("Δ time vs baseline")] == table_cells.NOISE
    assert "or one of them timed fewer than 5 steps" in md


def test_a_report_of_invalid_rows_alone_is_not_called_a_plan(tmp_path):
    runs = _sweep(tmp_path / "runs", "bad", ["accumulation.steps=3"])
    r = results.make("bad", "invalid", "batch_size=8 is not divisible by accumulation.steps=3", CHOICES,
                     {"batch_size": 8, "seq_len": 64, "steps": 10, "device": "cpu"}, [], env={})
    results.write_json(runs / "bad" / "result.json", r)
    md = _report(tmp_path)
    assert "- Device: none ran" in md.splitlines() and "a plan" not in md.split("- torch")[0]


def test_csv_on_stdout_reads_as_numbers(tmp_path, capsys):
    """`--format csv` is for a spreadsheet or pandas: no "41,766" strings or "+0.0%" cells."""
    import io

    runs = _sweep(tmp_path / "runs", "grid", ["optimizer=adamw,sgd"])
    _run(runs, "a", peak=12345.6)
    _run(runs, "s", optimizer="sgd", peak=80.0)
    _report(tmp_path, "--format", "csv")
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert table["Peak allocated (MiB)"].tolist() == [12345.6, 80.0]
    assert pd.api.types.is_numeric_dtype(table["Δ loss vs baseline (%)"])
    assert table["optimizer"].tolist() == ["adamw", "sgd"] and table["Status"].tolist() == ["ok", "ok"]


def test_a_presets_rungs_keep_their_order_in_the_setting_table(tmp_path):
    """leanest (cumulative: false) lists its host-memory rung last; sorted by how many changes each
    row makes it came second. docs/report.md: the report lists rows in rung order."""
    runs = _sweep(tmp_path / "runs", "lean", ["experiment=leanest"])
    _run(runs, "r0", rung=0)
    _run(runs, "r1", rung=1, checkpoint="block", optimizer="sgd", peak=50.0)
    _run(runs, "r2", rung=2, checkpoint="block", optimizer="sgd", precision="bf16", peak=40.0)
    _run(runs, "r3", rung=3, offload="params", peak=30.0)
    md = _report(tmp_path)
    assert _firsts(md, "Setting") == ["Baseline (batch size = 8)", "+ SGD + Block recompute",
                                      "+ SGD + bf16 AMP + Block recompute", "+ Parameter offload"]


def test_a_family_of_a_whole_model_config_gets_a_plot_file_the_file_system_takes():
    """Two MoE models with their configs overridden (Mixtral and OLMoE, as in
    benchmarks/results/NVIDIA-H200/moe.md) are families named by the whole model.config: a plot's
    file name of 420 characters fails with "File name too long", so long names are cut and end in
    a hash of the family."""
    config = ", ".join(f"'key_{i}': {i}" for i in range(40))
    one, two = (f"model=mixtral-8x7b, model.config={{{config}, 'experts': {n}}}" for n in (4, 8))
    names = [family_file("breakdown", f) for f in (one, two)]
    assert all(len(n.encode()) <= 255 and n.startswith("breakdown-mixtral-8x7b-model.config-key_0-0") for n in names)
    assert names[0] != names[1] and names == [family_file("breakdown", f) for f in (one, two)]  # distinct, stable
    assert family_file("pareto", "gpt2, seq_len=64") == "pareto-gpt2-seq_len-64.png"  # a short one as before


def test_two_models_with_overridden_configs_are_named_by_the_keys_set_not_by_whole_configs(tmp_path):
    """MoE rows as in benchmarks/results/NVIDIA-H200/moe.md: Mixtral with model.config.hidden_size=1024
    and friends beside OLMoE. As one column holding each transformers config whole, model.config
    would put all of it in each family's title (and each plot's title, 6,000 pixels wide). Each key
    is a column; a key shows where it varies and some run set it away from its model's default."""
    from ablate.schema import option_defaults

    for model, changed in (("mixtral-8x7b", {"hidden_size": 1024, "intermediate_size": 2048}),
                           ("olmoe-1b-7b", {})):  # a sweep each, as they ran
        runs = _sweep(tmp_path / "runs", model, [f"model={model}", "precision=fp32,bf16"])
        hf = {**option_defaults("model", model)["config"], **changed, "num_hidden_layers": 2}
        for precision in ("fp32", "bf16"):
            name = f"{model}-{precision}"
            metrics = {"peak_allocated_mib": 100.0, "iter_time_ms": 50.0, "loss_final": 4.0, "losses": [5.0, 4.0]}
            config = {"batch_size": 8, "seq_len": 64, "steps": 10, "device": "cpu", "model": {"config": hf}}
            r = results.make(name, "ok", None, {**CHOICES, "model": model, "precision": precision}, config, [],
                             metrics=metrics, env=CPU)
            results.write_json(runs / name / "result.json", r)
    md = _report(tmp_path)
    assert "they differ in model, model.config.hidden_size, model.config.intermediate_size," in md
    assert "'model_type'" not in md and "{" not in md.split("## All runs", 1)[1].split("\n\n")[1]
    shown = sorted(p.name for p in (tmp_path / "out").glob("pareto-*.png"))
    assert shown == ["pareto-mixtral-8x7b.png", "pareto-olmoe-1b-7b.png"]  # the model alone tells them apart
