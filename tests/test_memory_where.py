"""Where the memory went: memory_by_module.csv from a real CPU point, its shares adding up to the
traced peak, the report's module plot, and the snapshot links (CUDA snapshots: tests/test_gpu.py)."""
from __future__ import annotations

import io

import matplotlib.image as mpimg
import pandas as pd
import pytest
import torch

from ablate import artifacts, measure, results
from ablate.data import Synthetic
from ablate.train import train_step
from analysis.load import load
from analysis.report import main
from analysis.module_memory import SNAPSHOT_NOTE, folded, own_shares
from helpers import run_cli, train_nano


@pytest.fixture(scope="module")
def point(tmp_path_factory):
    """One gpt-nano point through the CLI on CPU: (its result, its run directory)."""
    out = tmp_path_factory.mktemp("out")
    proc = run_cli([], out)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.rglob(results.RESULT_FILE)
    return results.read(path), path.parent


def test_a_cpu_point_writes_memory_by_module_and_names_it(point):
    result, run_dir = point
    assert result["status"] == "ok", result["reason"]
    # the file is named; no CUDA allocator on a CPU, so no snapshot, and the key is there as null
    assert result["artifacts"] == {"memory_by_module": "memory_by_module.csv", "memory_snapshot": None,
                                   "oom_snapshot": None}
    rows = pd.read_csv(run_dir / result["artifacts"]["memory_by_module"])
    assert list(rows.columns) == list(artifacts.MODULE_COLUMNS)
    by_name = rows.set_index("module")
    blocks = [f"transformer.h.{i}" for i in range(result["config"]["model"]["n_layer"])]
    assert set(blocks) <= set(by_name.index) and by_name.loc["model", "depth"] == 0
    assert (by_name.loc[blocks, "depth"] == 3).all()
    assert (by_name.loc[blocks, ["fwd_peak_mib", "bwd_peak_mib", "at_peak_mib"]] > 0).all().all()


def test_the_root_row_is_the_traced_peak_and_its_breakdown(point):
    result, run_dir = point
    rows = pd.read_csv(run_dir / "memory_by_module.csv").set_index("module")
    # on a CPU the peak is the traced one
    peak, breakdown = result["metrics"]["peak_allocated_mib"], result["metrics"]["breakdown_mib"]
    assert rows.loc["model", "at_peak_mib"] == pytest.approx(peak, rel=1e-3)
    for key, mib in breakdown.items():
        assert rows.loc["model", f"at_peak_{key}_mib"] == pytest.approx(mib, rel=1e-3, abs=1e-3)
    # no module's window goes above the step's peak; the blocks' shares are parts of the breakdown's
    assert rows[["fwd_peak_mib", "bwd_peak_mib"]].max().max() <= peak * 1.001
    blocks = rows[rows.index.str.fullmatch(r"transformer\.h\.\d+")]
    assert blocks["at_peak_activations_mib"].sum() <= breakdown["activations"] + 1e-3
    assert blocks["at_peak_params_mib"].sum() < breakdown["params"]  # embeddings hold the rest


def test_own_shares_partition_the_peak_and_fold_repeated_layers(point):
    result, run_dir = point
    table = pd.read_csv(run_dir / "memory_by_module.csv")
    own = own_shares(table)
    cats = ["params", "grads", "optimizer", "activations", "other"]
    assert own[cats].to_numpy().sum() == pytest.approx(table.loc[table["module"] == "model", "at_peak_mib"].item(),
                                                       rel=1e-3)
    bars = folded(own)
    n_layer = result["config"]["model"]["n_layer"]
    assert bars.loc["transformer.h.*.mlp.c_fc", "count"] == n_layer and bars.loc["transformer.h.*.mlp.c_fc", "leaf"]
    assert not bars.loc["transformer.h.*", "leaf"] and bars.loc["model", "count"] == 1
    assert bars["total"].is_monotonic_decreasing


def test_the_report_draws_the_modules_and_lists_no_snapshot_on_cpu(point, tmp_path):
    _, run_dir = point
    assert main([str(run_dir), "--format", "html", "--out", str(tmp_path)]) == 0
    png = tmp_path / "memory_by_module.png"
    image = mpimg.imread(png)
    assert image.shape[0] > 200 and image.std() > 0.01  # drawn, not blank
    assert "![memory_by_module](memory_by_module.png)" in (tmp_path / "report.md").read_text()
    assert "memory_viz" not in (tmp_path / "report.html").read_text()  # nothing to open there


def test_each_panel_is_named_as_the_setting_table_names_its_run(point, tmp_path, monkeypatch):
    """Panel titles were bare values ("adamw / none / none / single / 32"), unlike every other plot."""
    import matplotlib.axes

    from analysis.compare import varied
    from analysis.load import load
    from analysis import module_memory
    from analysis.module_memory import module_breakdown

    _, run_dir = point
    titles, set_title = [], matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t) or set_title(ax, t, *a, **k))
    df = load([run_dir])
    assert module_breakdown(df, varied(df), tmp_path) is not None
    assert len(titles) == 1 and titles[0].startswith("Baseline (batch size = 4)\npeak "), titles
    # gpt2-xl's leanest combination (benchmarks/results/NVIDIA-H200/gpt2_xl_8gib.md): a one-line
    # title would run into its neighbour's, so the name wraps within TITLE_WIDTH
    long = ("+ 8-bit AdamW + Pure bf16 + Block recompute + Activation offload + Chunked cross-entropy "
            "+ 8 GiB card (emulated) + Optimizer step in backward")
    monkeypatch.setattr(module_memory, "setting_names", lambda df, *a: pd.Series(long, index=df.index))
    titles.clear()
    assert module_breakdown(df, varied(df), tmp_path) is not None
    name = titles[0].rsplit("\n", 1)[0]
    assert name.replace("\n", " ") == long and max(map(len, name.split("\n"))) <= module_memory.TITLE_WIDTH, titles


def test_a_row_naming_a_snapshot_is_linked_with_how_to_open_it(tmp_path):
    """Rendering only: a result that names snapshots (as a CUDA run's does) gets links in both pages."""
    named = {"memory_by_module": None, "memory_snapshot": "memory_snapshot.pickle", "oom_snapshot": None}
    r = results.make("abc123", "ok", None, {"model": "gpt-nano", "optimizer": "adamw"}, {"batch_size": 8}, [],
                     metrics={"peak_allocated_mib": 10.0}, artifacts=named)
    results.write_json(tmp_path / "runs" / "a" / "result.json", r)
    (row,) = load([tmp_path / "runs"]).to_dict("records")
    assert row["artifact_memory_snapshot"] == str(tmp_path / "runs" / "a" / "memory_snapshot.pickle")
    assert row["artifact_oom_snapshot"] is None
    out = tmp_path / "report"
    assert main([str(tmp_path / "runs"), "--format", "html", "--out", str(out)]) == 0
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "## Memory snapshots" in md and "[memory_snapshot.pickle](../runs/a/memory_snapshot.pickle)" in md
    assert SNAPSHOT_NOTE in md
    assert '<a href="../runs/a/memory_snapshot.pickle">memory_snapshot.pickle</a>' in page
    assert '<a href="https://pytorch.org/memory_viz">' in page


def test_results_name_the_files_a_worker_left_and_clear_old_ones(tmp_path):
    assert results.find_artifacts(tmp_path) == dict.fromkeys(results.ARTIFACTS)
    (tmp_path / "memory_by_module.csv").write_text("module\n")
    (tmp_path / "oom_snapshot.rank3.pickle").write_bytes(b"")
    (tmp_path / "oom_snapshot.rank1.pickle").write_bytes(b"")
    assert results.find_artifacts(tmp_path) == {"memory_by_module": "memory_by_module.csv", "memory_snapshot": None,
                                                 "oom_snapshot": "oom_snapshot.rank1.pickle"}
    results.clear_artifacts(tmp_path)  # a rerun in the same directory starts without them
    assert results.find_artifacts(tmp_path) == dict.fromkeys(results.ARTIFACTS)


def test_a_result_copied_to_another_sweep_brings_its_files(tmp_path):
    """skip_existing copies a finished point's row into the new sweep's directory, unchanged: the
    files it names come along (hard links), so its names hold there too."""
    from ablate.job import link_artifacts

    old, new = tmp_path / "first" / "p", tmp_path / "again" / "p"
    old.mkdir(parents=True)
    new.mkdir(parents=True)
    (old / "memory_by_module.csv").write_text("module\n")
    r = {"artifacts": {"memory_by_module": "memory_by_module.csv", "memory_snapshot": None, "oom_snapshot": None}}
    link_artifacts(r, old, new)
    assert (new / "memory_by_module.csv").read_text() == "module\n"
    assert results.find_artifacts(new) == r["artifacts"]
    link_artifacts({}, old, new)  # an older result names none


def test_a_result_linked_meanwhile_by_another_process_is_left_as_it_is(tmp_path, monkeypatch):
    """Two processes placing one reused result (a task on each node of a multi-node point) may
    both link its files: the one that loses the race finds the very file there, not an error."""
    import os

    from ablate import job

    old, new = tmp_path / "first" / "p", tmp_path / "again" / "p"
    old.mkdir(parents=True)
    new.mkdir(parents=True)
    (old / "memory_by_module.csv").write_text("module\n")
    link = os.link

    def raced(src, dst):  # the other process links first, between this one's unlink and link
        link(src, dst)
        link(src, dst)

    monkeypatch.setattr(job.os, "link", raced)
    job.link_artifacts({"artifacts": {"memory_by_module": "memory_by_module.csv"}}, old, new)
    assert os.path.samefile(old / "memory_by_module.csv", new / "memory_by_module.csv")


@pytest.mark.parametrize("overrides", [["checkpoint=block"], ["accumulation=x2"]])
def test_module_names_and_shares_hold_under_wrappers_and_micro_batches(overrides):
    """Block recompute wraps each block (its rows keep their names); accumulation runs the root's
    forward twice in the traced step. Either way the root's row is the traced peak, and at the
    peak (the optimizer step) each linear layer holds a gradient the size of its weights."""
    _, model, optimizer, t = train_nano(overrides, steps=1, batch_size=8, seq_len=16)
    data, device = Synthetic(vocab_size=128, train_samples=64).load(16), torch.device("cpu")
    scaler = t.precision.grad_scaler("cpu")
    trace = measure.traced_step(lambda: train_step(model, optimizer, scaler, t, data.train_batch(1, 8), device),
                                model, optimizer, device)
    rows = {r["module"]: r for r in artifacts.module_rows(trace, model)}
    assert "transformer.h.0.mlp.c_fc" in rows and not any("_checkpoint_wrapped_module" in n for n in rows)
    assert rows["model"]["at_peak_mib"] == pytest.approx(trace.peak_mib, rel=1e-6)
    fc = rows["transformer.h.0.mlp.c_fc"]
    assert fc["at_peak_grads_mib"] == pytest.approx(fc["at_peak_params_mib"], rel=1e-6) and fc["at_peak_params_mib"] > 0


@pytest.mark.parametrize("compile, warmup, recorded", [(False, 3, 2), (True, 3, 1), (True, 4, 2), (True, 2, 1)])
def test_the_snapshot_records_a_compiled_step_under_compile(monkeypatch, tmp_path, compile, warmup, recorded):
    """The traced step runs eagerly, so under compile=true memory_snapshot.pickle records the
    compiled warm-up step before it (never the first, which compiles); without compile, or with
    no such step (warmup_steps=2), the traced one, the last warm-up step. torch.compile is
    stubbed out: what is tested is which step the recording surrounds."""
    from ablate import runner
    from ablate.build import check_config
    from ablate.events import EventWriter
    from helpers import FAST, compose_spec

    spec = compose_spec([*FAST, f"compile={str(compile).lower()}", f"warmup_steps={warmup}", "steps=1"])
    t = check_config(spec, "cpu")
    calls = []

    class History:  # the allocator's recorder, as its calls among the steps
        def __init__(self, device):
            pass

        def start(self):
            calls.append("start")

        def stop(self, out=None):
            calls.append(f"stop -> {out.name}")

    real_trainer = runner.trainer

    def trainer(*args):
        model, optimizer, step = real_trainer(*args)
        return model, optimizer, lambda k: (calls.append(f"step{k}"), step(k))[1]

    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    monkeypatch.setattr(runner, "trainer", trainer)
    monkeypatch.setattr(artifacts, "AllocatorHistory", History)
    data = Synthetic(vocab_size=128, train_samples=64).load(16)
    runner.train(spec, t, data, torch.device("cpu"), EventWriter(tmp_path), run_dir=tmp_path)
    steps = [f"step{k}" for k in range(warmup + 1)]
    at = steps.index(f"step{recorded}")
    assert calls == [*steps[:at], "start", steps[at], f"stop -> {tmp_path.name}", *steps[at + 1:]]


def test_an_oom_in_the_traced_step_leaves_the_point_training_untraced(monkeypatch, tmp_path):
    """The traced step runs eagerly under MemTracker, and can hold more than the steps it looks
    into (compile=true; torchao's compiled optimizer step: the 4-bit gpt2-xl point on an 8 GiB card
    ran out of memory in it, benchmarks/results/NVIDIA-H200/gpt2_xl_8gib.md). Its OOM does not end
    the point: the measured
    steps run, the row says the breakdown is missing and why. (On a GPU the OOM is real; here it
    is raised where the tracer would have run.)"""
    from ablate import console, runner
    from ablate.build import check_config
    from ablate.events import EventWriter
    from helpers import FAST, compose_spec

    def traced_step(step, model, optimizer, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 308.00 MiB.")

    monkeypatch.setattr(measure, "traced_step", traced_step)
    spec = compose_spec([*FAST, "warmup_steps=2", "steps=3"])
    t = check_config(spec, "cpu")
    data = Synthetic(vocab_size=128, train_samples=64).load(16)
    _, run = runner.train(spec, t, data, torch.device("cpu"), EventWriter(tmp_path), run_dir=tmp_path)
    assert run.traced_step_oom and run.breakdown is None
    assert len(run.times_ms) == 3 and len(run.losses) == 1 + 3  # the first warm-up step and the measured ones
    m = runner.metrics(spec, t, run, [{"peaks": run.peaks, "times_ms": run.times_ms, "host_peak_rss_mib": None,
                                       "init_peak_mib": None, "host": "h"}], None, None, None)
    assert m["traced_step_oom"] is True and m["breakdown_mib"] is None
    # into result.json: a contract key, or the row would lose the flag there
    row = results.make("r", "ok", None, {}, spec.to_config(), [], metrics=m)
    assert row["metrics"]["traced_step_oom"] is True and results.problem(row) is None
    assert results.problem({**row, "metrics": {**row["metrics"], "mfu": True}}) is not None  # a flag where a number goes
    lines = io.StringIO()
    console.Progress("point", stream=lines).done(row, "x")
    assert "(traced step: OOM, no breakdown)" in lines.getvalue()


@pytest.mark.parametrize("in_backward", [False, True])
def test_an_oom_mid_backward_of_the_traced_step_frees_that_step_before_the_measured_ones(monkeypatch, tmp_path,
                                                                                         in_backward):
    """The risk of going on after the tracer's OOM (on a GPU the measured steps would OOM in turn):
    what the stopped step made must be gone before the next one. The OOM is raised from a block's
    backward inside the real traced step, as the allocator raises it mid-backward. At the first
    measured step, that step's activations are freed, no gradient is left (with the step in
    backward, some parameters had theirs), and MemTracker's global module hooks are removed."""
    import weakref

    from ablate import runner
    from ablate.build import check_config
    from ablate.events import EventWriter
    from helpers import FAST, compose_spec

    real, made, seen = measure.traced_step, [], {}
    hooks = torch.nn.modules.module

    def check(model, args) -> None:  # the first forward after the traced step's OOM
        if "alive" not in seen:
            seen["alive"] = sum(r() is not None for r in made)
            seen["grads"] = [n for n, p in model.named_parameters() if p.grad is not None]
            seen["hooks"] = len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks)

    def traced_step(step, model, optimizer, device):
        block = model.transformer.h[1]

        def boom(module, grad_in, grad_out):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

        keep = block.register_forward_hook(lambda m, a, out: made.append(weakref.ref(out)))
        stop = block.register_full_backward_hook(boom)
        before = len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks)
        try:
            return real(step, model, optimizer, device)
        finally:
            keep.remove(), stop.remove()
            seen["hooks_before"] = before
            model.register_forward_pre_hook(check)

    monkeypatch.setattr(measure, "traced_step", traced_step)
    spec = compose_spec([*FAST, "model.n_layer=3", f"optimizer.in_backward={str(in_backward).lower()}"])
    t = check_config(spec, "cpu")
    data = Synthetic(vocab_size=128, train_samples=64).load(16)
    _, run = runner.train(spec, t, data, torch.device("cpu"), EventWriter(tmp_path), run_dir=tmp_path)
    assert run.traced_step_oom and len(run.times_ms) == 3
    assert made and seen["alive"] == 0  # the block's output of the stopped step is gone
    assert seen["grads"] == []
    assert seen["hooks"] == seen["hooks_before"]


@pytest.mark.parametrize("traceable", [True, False])
def test_an_option_memtracker_cannot_follow_leaves_its_step_untraced(tmp_path, monkeypatch, traceable):
    """The traced warm-up step of a point with an untraceable option (FlexAttention on a GPU) runs
    as a plain step: no breakdown and no memory_by_module.csv, and the point goes on."""
    from ablate import runner
    from ablate.techniques.attention import Sdpa

    _, model, optimizer, t = train_nano(steps=1)
    monkeypatch.setattr(Sdpa, "traceable", traceable)
    stepped = []
    data = Synthetic(vocab_size=128, train_samples=64).load(16)

    def step():
        stepped.append(train_step(model, optimizer, t.precision.grad_scaler("cpu"), t, data.train_batch(1, 8),
                                  torch.device("cpu")))

    device = torch.device("cpu")
    breakdown, peak, _, oom, _ = runner.last_warmup_step(step, model, optimizer, t, device,
                                                      measure.DeviceMemory(device), None, tmp_path)
    assert len(stepped) == 1 and not oom
    assert (breakdown is not None, peak is not None) == (traceable, traceable)
    assert (tmp_path / "memory_by_module.csv").exists() == traceable


def test_the_allocators_peak_is_kept_per_phase_and_the_traced_steps_left_out_of_the_rows(tmp_path, monkeypatch):
    """On a GPU the allocator's peak counter says where a step peaked: the warm-up steps before the
    traced one, the traced step (its tracer's allocations too), the timed steps. A CPU has no such
    counter; here a stand-in's peaks are what each step says it allocated."""
    from ablate import runner
    from ablate.build import check_config
    from ablate.events import EventWriter
    from helpers import FAST, compose_spec

    class Counter:  # measure.DeviceMemory's peaks, set by the steps below
        peak = 0.0

        def __init__(self, device):
            pass

        def reset(self):
            Counter.peak = 0.0

        def peak_allocated_mib(self):
            return Counter.peak

        def peaks(self):
            return {"peak_allocated_mib": Counter.peak, "peak_reserved_mib": None, "peak_active_mib": None}

    allocated = {0: 50.0, 1: 40.0, 2: 20.0, 3: 25.0, 4: 15.0}  # per step: warm-up, traced, three timed
    real_trainer = runner.trainer

    def trainer(*args, **kwargs):
        model, optimizer, step = real_trainer(*args, **kwargs)

        def counted(k):
            Counter.peak = max(Counter.peak, allocated[k])
            return step(k)
        return model, optimizer, counted

    monkeypatch.setattr(measure, "DeviceMemory", Counter)
    monkeypatch.setattr(runner, "trainer", trainer)
    spec = compose_spec([*FAST, "warmup_steps=2", "steps=3"])
    t = check_config(spec, "cpu")
    data = Synthetic(vocab_size=128, train_samples=64).load(16)
    _, run = runner.train(spec, t, data, torch.device("cpu"), EventWriter(tmp_path), run_dir=tmp_path)
    assert run.phase_peaks == {"warmup": 50.0, "traced": 40.0, "timed": 25.0}
    assert run.peaks["peak_allocated_mib"] == 50.0  # warm-up and timed steps; the tracer's step is not training's
    ranks = [{"peaks": run.peaks, "times_ms": run.times_ms, "host_peak_rss_mib": None, "init_peak_mib": None,
              "host": h, "phase_peaks": p} for h, p in (("a", run.phase_peaks), ("b", {**run.phase_peaks, "timed": 30.0}))]
    m = runner.metrics(spec, t, run, ranks, None, None, None)
    assert m["peak_allocated_by_phase_mib"] == {"warmup": 50.0, "traced": 40.0, "timed": 30.0}  # the worst rank's
    row = results.make("r", "ok", None, {}, spec.to_config(), [], metrics=m)
    results.write_json(tmp_path / "result.json", row)
    loaded = load([tmp_path]).iloc[0]
    assert (loaded["peak_allocated_warmup_mib"], loaded["peak_allocated_traced_mib"],
            loaded["peak_allocated_timed_mib"]) == (50.0, 40.0, 30.0)
