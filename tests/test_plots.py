"""analysis.plots: each figure is a real, non-blank PNG, or None when the runs have nothing to show."""
from __future__ import annotations

import math

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest

from ablate import results
from analysis import figure, plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


def _run(optimizer: str, batch: int, status: str = "ok", precision: str = "fp32") -> dict:
    """One load()-shaped row: memory grows with batch size, adamw holds 2 states per parameter."""
    row = {"run_id": f"{optimizer}-{precision}-{batch}", "status": status, "reason": None, "path": "x",
           "model": "gpt-nano", "optimizer": optimizer, "precision": precision, "batch_size": batch,
           "seq_len": 64, "env_gpu_name": None, "env_gpu_total_mib": None}
    if status != "ok":
        return row | {"reason": "CUDA out of memory", "peak_allocated_mib": NAN, "iter_time_ms": NAN,
                      "tflops": NAN, "loss_final": NAN, "losses": None}
    params, states = 50.0, (100.0 if optimizer == "adamw" else 0.0)
    acts = 12.0 * batch
    steps = np.arange(20)
    decay = 0.10 if optimizer == "adamw" else 0.05
    losses = list(5.0 * np.exp(-decay * steps) + 1.0 + 0.01 * batch)
    return row | {
        "peak_allocated_mib": params * 2 + states + acts + 8.0, "peak_reserved_mib": 400.0,
        "iter_time_ms": (18.0 + 1.2 * batch) if optimizer == "adamw" else (20.0 + 1.5 * batch),
        "tflops": (0.6 if optimizer == "adamw" else 0.5) * math.log2(batch),
        "loss_final": losses[-1], "losses": losses,
        "breakdown_params_mib": params, "breakdown_grads_mib": params, "breakdown_optimizer_mib": states,
        "breakdown_activations_mib": acts, "breakdown_other_mib": 8.0}


@pytest.fixture
def runs() -> pd.DataFrame:
    """optimizer x batch size; adamw at 32 ran out of memory."""
    return pd.DataFrame([_run(o, b, "oom" if (o, b) == ("adamw", 32) else "ok")
                         for o in ("adamw", "sgd") for b in (8, 16, 32)])


LABELS = ["optimizer", "batch_size"]


def _assert_real_png(path, name: str) -> None:
    assert path is not None and path.name == name and path.exists()
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)[..., :3]  # (H, W, RGB) floats in [0, 1]
    assert img.shape[0] > 300 and img.shape[1] > 300
    assert img.std() > 0.05  # not a blank canvas
    colours = np.unique((img.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)
    assert len(colours) > 50  # markers, lines, colormap and text, not a flat fill


@pytest.mark.parametrize("plot, name", [(plots.pareto, "pareto.png"), (plots.breakdown, "breakdown.png"),
                                        (plots.batch_scan, "batch_scan.png"),
                                        (plots.loss_curves, "loss_curves.png")])
def test_each_plot_writes_a_real_png(runs, tmp_path, plot, name):
    _assert_real_png(plot(runs, LABELS, tmp_path / "figs"), name)


def test_all_plots_returns_the_four_paths(runs, tmp_path):
    paths = plots.all_plots(runs, LABELS, tmp_path)
    assert sorted(p.name for p in paths) == ["batch_scan.png", "breakdown.png", "loss_curves.png",
                                             "pareto.png"]
    assert all(p.parent == tmp_path for p in paths)


def test_pareto_front_keeps_only_undominated_points_sorted_by_memory():
    # (memory MiB, time ms): 1 is beaten by 0 in both, 3 by 2 in time at equal memory, 5 by 4.
    points = [(100, 50), (120, 60), (200, 30), (200, 35), (400, 10), (500, 10)]
    assert plots.pareto_front(points) == [0, 2, 4]
    assert plots.pareto_front([(1, 1)]) == [0]
    assert plots.pareto_front([]) == []
    assert plots.pareto_front([(5, 5), (5, 5)]) == [0, 1]  # ties: neither beats the other


def test_loss_group_picks_the_largest_group_of_at_least_two(runs):
    extra = pd.DataFrame([_run("adamw", 16, precision="bf16")])
    df = pd.concat([runs, extra], ignore_index=True)
    group = plots.loss_group(df, ["optimizer", "precision", "batch_size"])
    # batch 8: 2 curves, batch 16: 3 (adamw fp32/bf16, sgd), batch 32: 1 (adamw OOM has none)
    assert sorted(group["run_id"]) == ["adamw-bf16-16", "adamw-fp32-16", "sgd-fp32-16"]


def test_loss_group_uses_every_run_when_only_precision_or_optimizer_vary(runs):
    df = runs[runs["batch_size"] == 8]
    assert sorted(plots.loss_group(df, ["optimizer"])["run_id"]) == ["adamw-fp32-8", "sgd-fp32-8"]


def test_nothing_to_show_returns_none_and_writes_nothing(runs, tmp_path):
    all_oom = pd.DataFrame([_run(o, b, "oom") for o in ("adamw", "sgd") for b in (8, 16)])
    for plot in (plots.pareto, plots.breakdown, plots.batch_scan, plots.loss_curves):
        assert plot(all_oom, LABELS, tmp_path) is None
        assert plot(pd.DataFrame(), LABELS, tmp_path) is None
    one_batch = runs[runs["batch_size"] == 8]
    assert plots.batch_scan(one_batch, ["optimizer"], tmp_path) is None
    single_curve = runs.assign(losses=[None, None, None, [3.0, 2.5], None, None])
    assert plots.loss_curves(single_curve, LABELS, tmp_path) is None
    no_breakdown = runs.drop(columns=[c for c in runs if c.startswith("breakdown_")])
    assert plots.breakdown(no_breakdown, LABELS, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_plan_that_ran_nothing_gets_its_predicted_breakdown(runs, tmp_path):
    measured = [c for c in runs if c.startswith("breakdown_") or c in ("peak_allocated_mib", "iter_time_ms")]
    plan = runs.assign(status="predicted", **{c: NAN for c in measured},  # predict_only: nothing measured
                       **{f"predicted_{c}": runs[c] for c in runs if c.startswith("breakdown_")})
    drawn = plots.breakdown(plan, LABELS, tmp_path / "plan")
    _assert_real_png(drawn, "breakdown.png")
    assert plots.breakdown(plan.drop(columns=[c for c in plan if c.startswith("predicted_")]),
                           LABELS, tmp_path / "none") is None  # no prediction breakdown: nothing to draw
    # With one run measured, only measured breakdowns are drawn: the ok run's bar alone, a shorter figure.
    mixed = plots.breakdown(pd.concat([plan, runs.iloc[[0]]], ignore_index=True), LABELS, tmp_path / "mixed")
    assert mpimg.imread(mixed).shape[0] < mpimg.imread(drawn).shape[0] / 1.2  # 1 bar against 5 (415 px, 559)


def test_a_plan_that_ran_nothing_gets_its_predicted_batch_scan(runs, tmp_path):
    ok = runs["status"] == "ok"
    plan = runs.assign(status=runs["status"].where(~ok, "predicted"), peak_allocated_mib=NAN, tflops=NAN,
                       predicted_peak_mib=runs["peak_allocated_mib"])  # adamw 32 stays a (predicted) oom
    drawn = plots.batch_scan(plan, LABELS, tmp_path / "plan")
    _assert_real_png(drawn, "batch_scan.png")
    measured = plots.batch_scan(runs, LABELS, tmp_path / "measured")
    assert mpimg.imread(drawn).shape[1] < mpimg.imread(measured).shape[1] / 1.5  # memory alone: no TFLOP/s panel
    assert plots.batch_scan(plan.drop(columns="predicted_peak_mib"), LABELS, tmp_path / "none") is None


def test_the_card_is_the_emulated_one_else_the_gpu_and_none_when_rows_span_several(runs):
    assert figure.card(runs) is None  # CPU runs: no card
    h100 = runs.assign(env_gpu_total_mib=81559.0)
    assert figure.card(h100) == (81559.0, "GPU memory (81,559 MiB)")
    # a plan has no worker to report env: gpu_memory_gib alone names the card
    assert figure.card(runs.assign(gpu_memory_gib=16.0)) == (16384.0, "16 GiB card (emulated)")
    assert figure.card(h100.assign(gpu_memory_gib=16.0)) == (16384.0, "16 GiB card (emulated)")
    assert figure.card(h100.assign(gpu_memory_gib=[16.0, 24.0] * 3)) is None  # two cards: no one line
    # the pareto plot's OOM line on an emulated card sits at that card, not at the whole H100
    assert plots._capacity(h100.assign(gpu_memory_gib=0.5), runs["peak_allocated_mib"]) == 512.0


def test_the_batch_scan_draws_the_card_it_was_judged_against(runs, tmp_path, monkeypatch):
    """A plan for a 16 GiB card shows that card's line; a card far above every point (an 80 GB GPU
    behind runs of a few hundred MiB) is left out rather than squash the lines flat."""
    lines = []
    axhline = plots.plt.Axes.axhline
    monkeypatch.setattr(plots.plt.Axes, "axhline", lambda ax, y, **k: lines.append((y, k["label"])) or axhline(ax, y, **k))
    ok = runs["status"] == "ok"
    plan = runs.assign(status=runs["status"].where(~ok, "predicted"), peak_allocated_mib=NAN, tflops=NAN,
                       predicted_peak_mib=runs["peak_allocated_mib"], gpu_memory_gib=0.5)  # peaks up to 492 MiB
    _assert_real_png(plots.batch_scan(plan, LABELS, tmp_path / "plan"), "batch_scan.png")
    assert lines == [(512.0, "0.5 GiB card (emulated)")]
    plots.batch_scan(runs.assign(env_gpu_total_mib=81559.0), LABELS, tmp_path / "h100")
    assert len(lines) == 1
    plots.batch_scan(runs.assign(env_gpu_total_mib=900.0), LABELS, tmp_path / "small")  # peaks up to 492
    assert lines[1:] == [(900.0, "GPU memory (900 MiB)")]


def test_a_size_that_never_ran_is_not_drawn_as_an_oom(runs, tmp_path, monkeypatch):
    """A ladder skips the sizes above one that ran out of memory ("not run"): the batch scan gives
    them their own mark and word, not the red OOM x (an OOM of any series at a size wins that size's
    mark), and the pareto plot does not list them among its OOMs."""
    words, text = [], plots.plt.Axes.text
    monkeypatch.setattr(plots.plt.Axes, "text", lambda ax, x, y, s, **k: words.append((x, s, k.get("color")))
                        or text(ax, x, y, s, **k))
    titles, set_title = [], plots.plt.Axes.set_title
    monkeypatch.setattr(plots.plt.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t) or set_title(ax, t, *a, **k))
    skipped = [_run(o, 64, "oom") | {"reason": f"{results.NOT_RUN} an OOM at batch_size=32 before it"}
               for o in ("adamw", "sgd")]
    also_oom = _run("sgd", 32, "oom") | {"reason": f"{results.NOT_RUN} ..."}  # adamw 32 really ran out
    scan = pd.concat([runs, pd.DataFrame(skipped + [also_oom])], ignore_index=True)
    _assert_real_png(plots.batch_scan(scan, LABELS, tmp_path), "batch_scan.png")
    assert sorted(w for w in words if w[1] in ("OOM", "not run")) == [(32, "OOM", "red"), (64, "not run", "0.5")]
    assert titles == ["Peak memory (x = OOM, o = not run)", "Throughput (x on axis = OOM, o on axis = not run)"]
    notes, annotate = [], plots.plt.Axes.annotate
    monkeypatch.setattr(plots.plt.Axes, "annotate", lambda ax, t, *a, **k: notes.append(t) or annotate(ax, t, *a, **k))
    plots.pareto(scan, LABELS, tmp_path)
    assert [t for t in notes if t.startswith("OOM")] == ["OOM:\nadamw / 32"]  # the pareto lists only what ran out


def test_odd_data_is_drawn_without_raising(runs, tmp_path):
    one = runs.iloc[[0]]
    assert plots.pareto(one, ["optimizer"], tmp_path / "one").exists()
    gappy = runs.assign(loss_final=NAN, tflops=NAN, env_gpu_total_mib=81559.0)
    gappy.loc[1, "iter_time_ms"] = None
    assert plots.pareto(gappy, LABELS, tmp_path / "gappy").exists()
    assert plots.batch_scan(gappy, LABELS, tmp_path / "gappy").exists()
    bare = runs[["run_id", "status", "batch_size", "peak_allocated_mib"]]
    written = plots.all_plots(bare, ["missing_column"], tmp_path / "bare")
    assert [p.name for p in written] == ["batch_scan.png"]  # no times, breakdown or curves: the rest skip


def test_several_models_get_a_pareto_plot_each(runs, tmp_path):
    """A small model beats a big one in both memory and time: one shared front would hide every
    technique of the big one. Each model gets its own plot, labelled by what varies within it."""
    big = runs.assign(model="gpt2-xl", peak_allocated_mib=runs["peak_allocated_mib"] * 30,
                      iter_time_ms=runs["iter_time_ms"] * 30)
    paths = plots.paretos(pd.concat([runs, big], ignore_index=True), ["model", *LABELS], tmp_path)
    assert [p.name for p in paths] == ["pareto-gpt-nano.png", "pareto-gpt2-xl.png"]
    for path in paths:
        _assert_real_png(path, path.name)
    assert [p.name for p in plots.paretos(runs, LABELS, tmp_path / "one")] == ["pareto.png"]


def test_pareto_colours_by_loss_only_where_losses_differ(runs, tmp_path, monkeypatch):
    """Recompute, offload, DDP/FSDP keep the math: every run ends at the same loss, and a colour
    bar would stretch float noise over a whole scale. One colour then, the loss in the legend."""
    bars = []
    monkeypatch.setattr(plots.plt.Figure, "colorbar", lambda self, *a, **k: bars.append(k.get("label")))
    plots.pareto(runs, LABELS, tmp_path / "differ")
    assert bars == ["final loss"]
    _assert_real_png(plots.pareto(runs.assign(loss_final=2.5), LABELS, tmp_path / "same"), "pareto.png")
    assert bars == ["final loss"]  # no second colour bar


def test_runs_whose_option_lacks_a_labelled_key_stay_in_the_plots(runs):
    """`optimizer.momentum` names sgd runs, `checkpoint.types` one layer-type run; the others have no
    such key (null). pandas 3 keeps the null through astype(str) and a groupby drops null keys: those
    runs vanished from the batch-scan lines and from the loss-curve groups."""
    df = runs.assign(**{"optimizer.momentum": [None if o == "adamw" else "0.9" for o in runs["optimizer"]],
                        "checkpoint.types": [None] * 4 + ["gelu", None]})  # sgd at 16 recomputes GELUs
    ok = df[df["status"] == "ok"]
    series = dict(figure.series(ok, ["optimizer", "optimizer.momentum"]))
    assert sorted(series) == ["adamw", "sgd / 0.9"] and len(series["adamw"]) == 2
    # an optimizer's own key belongs to the optimizer: runs differing in both still share a plot
    group = plots.loss_group(df, ["optimizer", "optimizer.momentum", "checkpoint.types", "batch_size"])
    assert sorted(group["run_id"]) == ["adamw-fp32-8", "sgd-fp32-8"]
