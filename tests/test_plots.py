"""analysis.plots: each figure is a real, non-blank PNG, or None when the runs have nothing to show."""
from __future__ import annotations

import itertools
import math
import re
from unittest import mock

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text

from ablate import results
from analysis import compare, plot_common, pareto, plots, tables

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
    rgb = (img.reshape(-1, 3) * 255).round().astype(np.uint32)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])  # one number per colour: fast on big images
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
    assert plot_common.card(runs) is None  # CPU runs: no card
    h100 = runs.assign(env_gpu_total_mib=81559.0)
    assert plot_common.card(h100) == (81559.0, "GPU memory (81,559 MiB)")
    # a plan has no worker to report env: gpu_memory_gib alone names the card
    assert plot_common.card(runs.assign(gpu_memory_gib=16.0)) == (16384.0, "16 GiB card (emulated)")
    assert plot_common.card(h100.assign(gpu_memory_gib=16.0)) == (16384.0, "16 GiB card (emulated)")
    assert plot_common.card(h100.assign(gpu_memory_gib=[16.0, 24.0] * 3)) is None  # two cards: no one line
    # the pareto plot's OOM line on an emulated card sits at that card, not at the whole H100
    peaks = runs["peak_allocated_mib"]
    half = h100.assign(gpu_memory_gib=0.5)
    assert pareto._capacity(half, half, peaks) == (512.0, "OOM: 0.5 GiB card (emulated)")
    # gpu_memory_gib=8,null: the OOMs came on the 8 GiB card, the other runs had the whole GPU (the
    # line sits at the card, not just past the uncapped baseline labelled as a capacity)
    mixed = h100.assign(gpu_memory_gib=[8.0, NAN] * 3)
    assert plot_common.card(mixed) is None
    assert pareto._capacity(mixed, mixed.iloc[::2], peaks) == (8192.0, "OOM: 8 GiB card (emulated)")
    assert pareto._capacity(runs, runs, peaks) == (1.05 * peaks.max(), "OOM (card unknown)")  # CPU rows


def test_several_oom_names_under_the_red_x_stay_apart():
    """Each setting name's lines start with "+ ", so two OOMs' names would run together: each starts
    with a bullet, its later lines indented."""
    long = "+ 4-bit AdamW + Pure bf16 + Block recompute + Activation offload + Chunked cross-entropy"
    text = pareto._item(long, bullet=True).split("\n")
    assert text[0].startswith("• + 4-bit AdamW") and len(text) > 1 and all(t.startswith("  + ") for t in text[1:])
    assert pareto._item("+ 8 GiB card (emulated)", bullet=False) == "+ 8 GiB card (emulated)"  # one OOM: as named


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
    assert [t for t in notes if t.startswith("OOM")] == ["OOM:\n+ batch size = 32"]  # only what ran out


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
    series = dict(plot_common.series(ok, ["optimizer", "optimizer.momentum"]))
    assert sorted(series) == ["adamw", "sgd / 0.9"] and len(series["adamw"]) == 2
    # an optimizer's own key belongs to the optimizer: runs differing in both still share a plot
    group = plots.loss_group(df, ["optimizer", "optimizer.momentum", "checkpoint.types", "batch_size"])
    assert sorted(group["run_id"]) == ["adamw-fp32-8", "sgd-fp32-8"]


# Plots past a handful of points: a technique sweep of 2, 10 and 30 runs on an 8 GiB card,
# each plot drawn once (module-scoped), its PNG read back and every text it shows measured.

CARD_MIB = 8192.0
GRID = dict(optimizer=("adamw", "sgd", "adamw8bit"), precision=("fp32", "bf16"), accumulation=("none", "x4"),
            checkpoint=("none", "block"), offload=("none", "activations"), compile=(False, True),
            batch=(8, 16, 32, 64))
WARMUP = 2  # warm-up steps before the 10 measured ones: losses hold all 12 (ablate/runner.py)


def _point(i: int, optimizer="adamw", precision="fp32", accumulation="none", checkpoint="none", offload="none",
           compile=False, batch=8, status=None) -> dict:
    """One load()-shaped row of a gpt2 run: memory (MiB) and time (ms) follow the techniques roughly as
    on a GPU; a run whose peak passes the card is an OOM; losses per step, warm-up included."""
    steps = {"none": 1, "x4": 4}[accumulation]
    row = {"run_id": f"r{i:02d}", "status": "ok", "reason": None, "path": "x", "model": "gpt2", "data": "synthetic",
           "optimizer": optimizer, "precision": precision, "accumulation": accumulation, "checkpoint": checkpoint,
           "offload": offload, "parallel": "single", "loss": "standard", "batch_size": batch, "seq_len": 1024,
           "steps": 10, "warmup_steps": WARMUP, "compile": compile, "accumulation_steps": steps, "rung": None,
           "env_gpu_name": "NVIDIA A10G", "env_gpu_total_mib": CARD_MIB, "env_world_size": 1,
           "finished_at": f"2026-01-01T00:00:{i:02d}"}
    params, states = 475.0, {"adamw": 950.0, "sgd": 0.0, "adamw8bit": 240.0}[optimizer]
    acts = (300.0 * batch / steps * {"none": 1, "block": 0.2}[checkpoint] * {"fp32": 1, "bf16": 0.6}[precision]
            * {"none": 1, "activations": 0.3}[offload])
    peak = 2 * params + states + acts + 60.0
    status = status or ("oom" if peak > CARD_MIB else "ok")
    if status != "ok":
        return row | {"status": status, "reason": {"oom": "CUDA out of memory", "error": "RuntimeError: boom",
                                                    "invalid": "fp16 needs a GPU"}[status]}
    ms = (12.0 * batch * {"none": 1, "block": 1.33}[checkpoint] * {"fp32": 1, "bf16": 0.55}[precision]
          * {"none": 1, "activations": 1.6}[offload] * (0.85 if compile else 1.0))
    k = np.arange(WARMUP + 10)
    decay = {"adamw": 0.25, "sgd": 0.08, "adamw8bit": 0.24}[optimizer]
    curve = 8.0 * np.exp(-decay * k) + 3.0 + 0.03 * np.sin(k) + (0.004 if precision == "bf16" else 0)
    losses = [float(v) for v in curve]
    return row | {"peak_allocated_mib": peak, "peak_reserved_mib": peak * 1.1, "iter_time_ms": ms,
                  "train_latency_s": ms / 100, "tflops": 20 * batch / ms, "loss_final": losses[-1], "losses": losses,
                  "breakdown_params_mib": params, "breakdown_grads_mib": params, "breakdown_optimizer_mib": states,
                  "breakdown_activations_mib": acts, "breakdown_other_mib": 60.0}


def _sweep(n: int, second: dict | None = None) -> pd.DataFrame:
    """n runs: the baseline, `second` (default + bf16 AMP), then grid points drawn at random (seeded);
    from 10 runs on one crashed, from 30 one is invalid and one a ladder never ran."""
    grid = [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())]
    rng = np.random.default_rng(40)
    picks = [{}, second or dict(precision="bf16")] + [grid[i] for i in rng.choice(np.arange(1, len(grid)), n - 2,
                                                                                    replace=False)]
    rows = [_point(i, **p) for i, p in enumerate(picks)]
    if n >= 10:
        rows[3] = _point(3, **picks[3], status="error")
    if n >= 30:
        rows[5] = _point(5, **picks[5], status="invalid")
        rows[7] = _point(7, **picks[7], status="oom") | {"reason": f"{results.NOT_RUN} an OOM at a smaller batch"}
    return pd.DataFrame(rows)


def _render(plot, df: pd.DataFrame, out):
    """Draw `plot` of `df` into `out`: (the PNG, its figure, [(text, its box in the PNG's pixels)] for
    every text the PNG shows: ticks, labels, titles, legends, annotations, the colour bar's)."""
    passes = []  # per figure draw: savefig's last is the one written
    draw_figure, draw_text, draw_axes = Figure.draw, Text.draw, Axes.draw

    def figure_draw(fig, renderer):
        passes.append((fig, []))
        return draw_figure(fig, renderer)

    def text_draw(text, renderer):
        draw_text(text, renderer)
        if text.get_visible() and text.get_text().strip() and passes:
            passes[-1][1].append((text, Text.get_window_extent(text, renderer)))

    def axes_draw(ax, renderer):
        ax.drawn_frame = ax.get_window_extent(renderer).frozen()  # the axes' box in this pass
        return draw_axes(ax, renderer)

    with (mock.patch.object(Figure, "draw", figure_draw), mock.patch.object(Text, "draw", text_draw),
          mock.patch.object(Axes, "draw", axes_draw)):
        path = plot(df, compare.varied(df), out)
    return (path, *passes[-1]) if path is not None else (None, None, [])


PLOTS = {"pareto": plots.pareto, "breakdown": plots.breakdown, "batch_scan": plots.batch_scan,
         "loss_curves": plots.loss_curves}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """(plot name, runs) -> _render's answer for _sweep(runs), drawn once per module."""
    done = {}

    def get(name: str, n: int):
        if (name, n) not in done:
            second = dict(batch=16) if (name, n) == ("batch_scan", 2) else None  # a scan needs two sizes
            done[name, n] = _render(PLOTS[name], _sweep(n, second), tmp_path_factory.mktemp(f"{name}-{n}"))
        return done[name, n]
    return get


def _clash(a, b, slack: float = 0.5) -> bool:
    """Two boxes share more than `slack` pixels each way."""
    return min(a.x1, b.x1) - max(a.x0, b.x0) > slack and min(a.y1, b.y1) - max(a.y0, b.y0) > slack


def _flat(text: str) -> str:
    """A wrapped name on one line again."""
    return re.sub(r"\s*\n\s*", " ", text)


@pytest.mark.parametrize("n", (2, 10, 30))
@pytest.mark.parametrize("name", PLOTS)
def test_no_two_texts_overlap_at_2_10_and_30_runs(rendered, name, n):
    """Every text of the PNG (tick labels, axis labels, titles, legend entries, point labels, OOM
    notes, the colour bar's label) has its own pixels, all of it lies inside the image, and what is
    written in a plot (point labels, OOM notes, totals) inside its frame."""
    path, fig, texts = rendered(name, n)
    _assert_real_png(path, f"{name}.png")
    height, width = mpimg.imread(path).shape[:2]
    shown = {id(t) for t, _ in texts}
    assert shown & {id(t) for t in fig.axes[0].get_yticklabels()}, "tick labels are among the texts checked"
    legends = [lg for lg in [*fig.legends, *(a.get_legend() for a in fig.axes)] if lg is not None]
    assert shown & {id(t) for lg in legends for t in lg.get_texts()}, "legend texts are among the texts checked"
    for t, b in texts:
        assert -1 <= b.x0 and b.x1 <= width + 1 and -1 <= b.y0 and b.y1 <= height + 1, f"{t.get_text()!r} is cut off"
        if t.axes is not None and t in t.axes.texts:  # a label, note or total in the plot: inside its frame
            frame = t.axes.drawn_frame
            assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1, t.get_text()
    clashes = [(a.get_text(), b.get_text()) for (a, ab), (b, bb) in itertools.combinations(texts, 2) if _clash(ab, bb)]
    assert not clashes


@pytest.mark.parametrize("n", (2, 10, 30))
def test_pareto_names_points_as_the_setting_table_does(rendered, n):
    """A point's name says what differs from the baseline, as the setting table's row does. Two runs:
    beside their markers; more: a number beside each marker, "number  name" in the legend, the OOMs
    there by name too (and a ladder's never-run point nowhere)."""
    df = _sweep(n)
    labels, bases = compare.varied(df), compare.baselines(df, compare.varied(df), None)
    named = {i: tables.setting_label(row, df.loc[bases[i]], labels) for i, row in df.iterrows()}
    ok, oom = df.index[df["status"] == "ok"], df.index[(df["status"] == "oom") & ~plot_common.skipped(df)]
    _, fig, _ = rendered("pareto", n)
    notes = [_flat(t.get_text()) for t in fig.axes[0].texts]
    key = [_flat(t.get_text()) for t in fig.legends[0].get_texts()]
    assert not any(" / " in t for t in notes + key)  # no bare value tuples
    if n == 2:
        assert sorted(notes) == sorted(named[i] for i in ok) and not len(oom)
        return
    numbers = sorted(int(k) for t in notes if t != "OOM" for k in t.split(", "))
    assert numbers == list(range(1, len(ok) + 1))  # each point once, coinciding ones sharing a label
    listed = dict(re.fullmatch(r"\s*(\d+)  (.*)", t).groups() for t in key if re.fullmatch(r"\s*\d+  .*", t))
    assert sorted(listed.values()) == sorted(named[i] for i in ok)
    assert listed["1"].startswith("Baseline")  # listed as the setting table lists its rows
    assert sorted(t for t in key if t.endswith(" (OOM)")) == sorted(f"{named[i]} (OOM)" for i in oom)
    assert ("OOM" in notes) == bool(len(oom))


def test_pareto_draws_a_colour_bar_only_where_final_losses_differ_beyond_noise(rendered, tmp_path):
    """Optimizers end 0.1% and more apart: a colour bar. Techniques that keep the math end within float
    noise (below LOSS_SPREAD of the loss): one colour, the loss in the legend, no bar."""
    _, fig, texts = rendered("pareto", 10)
    assert len(fig.axes) == 2 and "final loss" in {t.get_text() for t, _ in texts}
    df = _sweep(10)
    alike = df.assign(loss_final=3.2 + 2e-5 * np.arange(len(df)))  # 3e-5 relative spread among the ok runs
    _, fig, texts = _render(plots.pareto, alike, tmp_path)
    shown = {t.get_text() for t, _ in texts}
    assert len(fig.axes) == 1 and "final loss" not in shown
    assert "final loss 3.2001 (every run, spread 0.0002)" in shown
    assert pareto.loss_differs(np.array([3.2, 3.2 * (1 + 2e-3), NAN]))
    assert not pareto.loss_differs(np.array([3.2, 3.2 * (1 + 5e-4)]))


def test_the_breakdown_legend_lists_only_components_with_a_bar(rendered, tmp_path):
    _, fig, _ = rendered("breakdown", 10)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [t for _, t in plots.COMPONENTS]
    ok = _sweep(10)["status"] == "ok"
    sgd = _sweep(10).assign(optimizer="sgd", breakdown_optimizer_mib=np.where(ok, 0.0, NAN), breakdown_other_mib=NAN)
    _, fig, _ = _render(plots.breakdown, sgd, tmp_path)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["parameters", "gradients", "activations"]


def test_loss_curves_start_at_the_first_measured_step_and_name_the_runs_left_out(rendered):
    """metrics.losses holds every optimizer step from the first warm-up step on: the curves show the
    measured ones at their own step numbers (3 to 12 after 2 warm-up steps), and the title says
    which runs are not drawn and why."""
    df = _sweep(30)
    labels = compare.varied(df)
    group = plots.loss_group(df, labels)
    _, fig, _ = rendered("loss_curves", 30)
    ax = fig.axes[0]
    assert len(ax.get_lines()) == len(group) >= 2
    for line, (_, row) in zip(ax.get_lines(), group.iterrows()):
        assert list(line.get_xdata()) == list(range(WARMUP + 1, WARMUP + 11))
        assert list(line.get_ydata()) == row["losses"][WARMUP:]
    assert ax.get_xlim()[0] == WARMUP + 1 and "warm-up steps 1–2 not shown" in ax.get_xlabel()
    curves = df[(df["status"] == "ok") & df["losses"].notna()]
    differ = [c.replace("_", " ") for c in labels if c not in ("optimizer", "precision")
              and (curves.drop(group.index)[c].astype(str) != str(group[c].iloc[0])).any()]
    failed = df["status"].where(~plot_common.skipped(df), "not run")[df["status"] != "ok"].value_counts()
    title = _flat(ax.get_title())
    assert f"not shown: {len(curves) - len(group)} runs that differ in {' / '.join(differ)}" in title
    assert f"{failed.sum()} without a loss curve ({', '.join(f'{k} {s}' for s, k in failed.items())})" in title


def test_a_curve_is_its_measured_steps_numbered_from_the_first_warm_up_step():
    steps, losses = plots.measured_curve(pd.Series({"losses": [9.0, 8.0, 7.0, 6.5], "warmup_steps": 2}))
    assert list(steps) == [3, 4] and list(losses) == [7.0, 6.5]
    steps, _ = plots.measured_curve(pd.Series({"losses": [9.0, 8.0]}))  # no warm-up recorded: every step
    assert list(steps) == [1, 2]
    assert plots.measured_curve(pd.Series({"losses": [9.0, 8.0], "warmup_steps": 2})) is None  # nothing measured


def test_the_batch_scan_names_its_lines_by_what_they_change(rendered):
    _, fig, _ = rendered("batch_scan", 30)
    names = [_flat(t.get_text()) for t in fig.legends[0].get_texts()]
    assert names[0] == "Baseline" and fig.legends[0].get_title().get_text() == "against the baseline"
    assert all(n.startswith(("+ ", "− ")) for n in names[1:-1]) and names[-1] == "GPU memory (8,192 MiB)"
    assert any("Gradient accumulation (4 steps)" in n for n in names)  # a line spans batch sizes: its steps,
    assert not any("×" in n for n in names)  # not one batch's split ("8 × 4 = 32")


def test_plots_name_runs_against_the_baselines_they_are_given(tmp_path, monkeypatch):
    """all_plots takes the report's bases: the bf16 run as the baseline names the other '+ fp32'."""
    df = _sweep(2)
    notes, ticks = [], []
    annotate, set_yticks = plots.plt.Axes.annotate, plots.plt.Axes.set_yticks
    monkeypatch.setattr(plots.plt.Axes, "annotate",
                        lambda ax, t, *a, **k: notes.append(_flat(t)) or annotate(ax, t, *a, **k))
    monkeypatch.setattr(plots.plt.Axes, "set_yticks", lambda ax, y, labels=None, **k: ticks.append(labels)
                        or set_yticks(ax, y, labels, **k))
    written = plots.all_plots(df, compare.varied(df), tmp_path, bases=pd.Series(1, index=df.index))
    assert sorted(p.name for p in written) == ["breakdown.png", "loss_curves.png", "pareto.png"]
    assert {"+ fp32", "Baseline (batch size = 8): bf16 AMP"} <= set(notes)  # the pareto's points
    assert ticks == [["Baseline (batch size = 8): bf16 AMP", "+ fp32"]]  # the breakdown's bars, baseline on top


@pytest.mark.parametrize("scale, unit", [(1.0, "TFLOP/s"), (1e-3, "GFLOP/s")])
def test_the_batch_scans_throughput_is_in_the_tables_unit(tmp_path, scale, unit):
    """A CPU at toy sizes reaches a few GFLOP/s: its axis says GFLOP/s with readable values, as the
    tables do (was: 'TFLOP/s' over 0.002-0.05)."""
    df = _sweep(10)
    df["tflops"] = pd.to_numeric(df["tflops"]) * scale
    _, fig, _ = _render(plots.batch_scan, df, tmp_path)
    throughput = fig.axes[1]
    assert throughput.get_ylabel() == f"{unit} (model FLOPs per device)"
    drawn = np.concatenate([line.get_ydata() for line in throughput.get_lines()])
    shown = df.loc[df["status"] == "ok", "tflops"] * (1e3 if unit == "GFLOP/s" else 1)
    assert np.nanmax(drawn) == pytest.approx(shown.max())
