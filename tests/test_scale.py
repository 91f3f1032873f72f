"""scale=cpu (conf/scale/cpu.yaml): every preset scaled down for a CPU, each technique's memory
effect pointing the same way as on a GPU.

The GPU's direction is the analytic predictor's at full size (predict_only=true device=cuda): on
the H100 the predictor is within 2% of the allocator's measured peak (benchmarks/results/
NVIDIA-H100-80GB-HBM3/gpt2_large_ladder.md: -0.2% to -1.8%). The CPU's is the traced peak of real
scaled-down runs (MemTracker: metrics.peak_allocated_mib), or, in the default suite, the
predictor at scale=cpu on the CPU (within 1.5% of those runs' traced peaks for 63 of 70 runs, at
most 12%: leanest's leanest rungs) and one preset run.

A technique point's direction is the sign of its peak against its baseline's: the point of the
preset's baseline setting (its first rung, or the first value of each swept key) at the same sizes
(model, batch, card), else, in a cumulative ladder, the rung above it at those sizes. Points that
differ from the baseline in size alone (a batch scan) are checked apart: a larger batch never
uses less memory.

A preset with a benchmark script (benchmarks/<preset>.py, what a GPU host runs) has its page
rendered from the scaled-down run (`--report-only`), so that one run checks both.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from hydra import compose, initialize_config_dir

from ablate.results import PRUNED
from tests.helpers import CONF, ROOT, results_under, run_cli

# Presets scale=cpu cannot stand for, with why.
UNSCALED = {
    # Adapters keep their rank while the width shrinks: at scale=cpu's width of 64, LoRA's rank 64 is
    # the size of the model it adapts, and LoRA costs memory where on Llama 8B it saves 42%.
    "fit_llama_8b",
    # Already a CPU's size (gpt-mini, 500 steps): it compares losses, which a smaller model would not keep.
    "optimizers",
    # GaLore's rank 1024 and APOLLO's ranks are not scaled with the width: at scale=cpu's width of 64
    # they project nothing, and GaLore's states outgrow AdamW's, where on an 8B model they save most.
    "full_7b",
    # find_seq searches the longest sequence under a card's capacity; scale=cpu runs on the host, which
    # has none to search under (its points are invalid rows saying so).
    "long_context",
    # A check of the predictor on a GPU's kernels and allocator, not of a technique's direction: a
    # CPU runs its rungs on a tiny Llama instead (tests/test_presets.py), the GPU-only ones invalid.
    "groups_check",
}
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml") if p.stem not in UNSCALED)
# A change under 2% of the baseline's peak has no direction. MemTracker's peaks are byte counts of
# live tensors, the same in every run of a point (tf32 and in_backward equal the baseline to the
# byte), so this is not run-to-run noise: it is the predictor's own error on the GPU side (up to
# 1.8% on the H100), within which a predicted change cannot be told from none.
NOISE = 0.02
# What a point is measured at, not a technique applied to it.
SIZES = ("model", "batch_size", "seq_len", "gpu_memory_gib")
# Technique points whose effect cannot show on a CPU, with why: (preset, point) -> the CPU's direction.
CPU_ONLY = {
    # save_on_cpu copies every saved tensor to host memory: on a CPU that is the device's own, so
    # nothing is saved there (on a GPU, -46%).
    ("single_gpu_techniques", "offload=activations rung=9"): 0,
}
# What a preset's check leaves out or shrinks, on both sides: preset -> overrides. torch.compile on a
# CPU is inductor's C++ build of every kernel, two thirds of gpt2_throughput's run on two cores; a
# compiled point's traced step runs eagerly anyway (MemTracker cannot follow compiled code), so its
# CPU peak would be its eager twin's. tests/test_cli.py compiles a point through the CLI. Its batch of
# 512 sequences: find_batch meets no card on a CPU, so each point ran all 512 at once (45 s a point);
# at 64 pure bf16 still halves the weights and states against autocast's fp32 ones.
LEFT_OUT = {"gpt2_throughput": ["compile=false", "batch_size=64"]}
# Points that do not run on a CPU at scale=cpu: (preset, point) -> words of their reason. None:
# find_batch searches only the micro-batches a point can run at, so fit_llama_1b's in-backward
# rungs run too.
NOT_RUN: dict[tuple[str, str], str] = {}

# Presets whose CPU runs have no traced peak: FSDP1 wraps parameters in flat views that MemTracker
# cannot follow (docs/clusters.md). Their CPU direction is the prediction each run records for itself.
UNTRACED = {"gpt2_xl_fsdp_batch_scan"}


def _value(v) -> str:
    """A value as the override grammar writes it (the ladder's rungs and results' overrides)."""
    if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig":
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v).lower() if isinstance(v, bool) or str(v) in ("True", "False") else str(v)


def preset_ladder(preset: str) -> tuple[dict, bool]:
    """The preset's baseline setting (its first rung's technique keys, or the first value of each
    swept key) and whether its ladder is cumulative."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    if "rungs" in sweeper:
        return {k: _value(v) for k, v in sweeper.rungs[0].items() if k not in SIZES}, bool(sweeper.cumulative)
    params = sweeper.get("params") or {}
    return {k: _value(str(v).split(",")[0]) for k, v in params.items() if k not in SIZES}, False


def sweep(preset: str, tmp, *args: str) -> dict[str, dict]:
    """Run `python -m ablate -m experiment=<preset> ARGS`: each point's result under the overrides
    that set it apart (its rung and swept values, "key=value ..." sorted; "" for a lone point)."""
    out = run_cli(["-m", f"experiment={preset}", f"hydra.sweep.dir={tmp}/s", *args], tmp, fast=False, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    given = {a.split("=")[0] for a in args} | {"experiment", "out_dir"}
    runs = results_under(tmp / "s")
    points = {name([o for o in r["overrides"] if o.split("=")[0] not in given]): r for r in runs}
    assert len(points) == len(runs)
    return points


def name(overrides: list[str]) -> str:
    return " ".join(sorted(o.split("=")[0] + "=" + _value(o.split("=", 1)[1]) for o in overrides))


def parse(point: str) -> dict:
    return dict(o.split("=", 1) for o in point.split())


def peak(result: dict) -> float | None:
    """The measured peak, else (predict_only) the predicted one, in MiB."""
    measured = (result.get("metrics") or {}).get("peak_allocated_mib")
    return measured if measured is not None else (result.get("prediction") or {}).get("peak_mib")


def planned(result: dict) -> bool:
    """A plan's row: predicted, or an oom by prediction alone (its peak is the predicted one)."""
    return result["status"] == "predicted" or (result["status"] == "oom"
                                               and (result["reason"] or "").startswith(PRUNED))


def ran(result: dict) -> bool:
    """Whether a point ran (or was planned) and has a peak: an invalid one carries only a prediction."""
    return (result["status"] == "ok" or planned(result)) and peak(result) is not None


def baseline(point: str, points, base: dict, cumulative: bool) -> str | None:
    """The point `point`'s technique is measured against (see the module's docstring); None for a
    point of the baseline setting itself."""
    p = parse(point)
    sizes = {k: v for k, v in p.items() if k in SIZES}
    techniques = {k: v for k, v in p.items() if k not in SIZES and k != "rung"}
    if techniques == base:
        return None
    for q in points:
        d = parse(q)
        if {k: v for k, v in d.items() if k in SIZES} == sizes:
            if {k: v for k, v in d.items() if k not in SIZES and k != "rung"} == base:
                return q
    rung = int(p.get("rung", 0))
    above = [q for q in points if cumulative and parse(q).get("rung") == str(rung - 1)
             and {k: v for k, v in parse(q).items() if k in SIZES} == sizes]
    return above[0] if above else None


def direction(peak_mib: float, base_mib: float) -> int:
    change = (peak_mib - base_mib) / base_mib
    return 0 if abs(change) < NOISE else (1 if change > 0 else -1)


def directions(preset: str, points: dict[str, dict]) -> dict[str, tuple[int, float]]:
    """Each technique point -> (its direction, its change against its baseline), for the points
    that ran (ok or predicted) with a baseline that ran."""
    base, cumulative = preset_ladder(preset)
    out = {}
    for point, result in points.items():
        against = baseline(point, points, base, cumulative)
        if against is None or not all(ran(r) for r in (result, points[against])):
            continue
        out[point] = (direction(peak(result), peak(points[against])), peak(result) / peak(points[against]) - 1)
    return out


def scans(points: dict[str, dict]) -> dict[str, list[float]]:
    """The points that differ in batch size alone -> their peaks in increasing batch order."""
    groups: dict[str, list[tuple[int, float]]] = {}
    for point, result in points.items():
        p = parse(point)
        if "batch_size" in p and ran(result):
            rest = name([f"{k}={v}" for k, v in p.items() if k not in ("batch_size", "rung")])
            groups.setdefault(rest, []).append((int(p["batch_size"]), peak(result)))
    return {k: [mib for _, mib in sorted(v)] for k, v in groups.items() if len(v) > 1}


def gpu_args(preset: str) -> list[str]:
    """The full-size plan's command line: a multi-process preset (parallel.nproc=auto) planned at
    the 2 processes it runs as on a CPU, since FSDP's per-rank peak depends on the count. Each
    point at its whole batch (find_batch=false): a search on a full-size card gives each point its
    own micro-batch (fit_llama_1b's in-backward rungs cannot accumulate, so theirs is the whole 16, predicted
    at 55 GiB, against the other rungs' 1 to 4), and a technique's effect is read at one size. Scaled down, every micro-batch
    fits the card, so the CPU's search ends at the whole batch too."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        nproc = compose(config_name="config", overrides=[f"experiment={preset}"]).parallel.get("nproc")
    return ["predict_only=true", "device=cuda", "find_batch=false", *(["parallel.nproc=2"] if nproc == "auto" else [])]


def check(preset: str, gpu: dict[str, dict], cpu: dict[str, dict]) -> list[str]:
    """What points another way on the CPU than on the GPU, as lines (none: []). The CPU's points
    are the GPU's, and those that did not run on the CPU are NOT_RUN's (a measured sweep's)."""
    assert set(cpu) == set(gpu), (sorted(set(gpu) - set(cpu)), sorted(set(cpu) - set(gpu)))
    assert all(planned(r) for r in gpu.values())
    not_run = {p: r["reason"] for p, r in cpu.items() if not (r["status"] == "ok" or planned(r))}
    measured = any(not planned(r) for r in cpu.values())
    expected = {p: why for (name_, p), why in NOT_RUN.items() if name_ == preset and measured}
    assert set(not_run) == set(expected), not_run
    assert all(expected[p] in why for p, why in not_run.items()), not_run
    untraced = {p for p, r in cpu.items() if r["status"] == "ok" and r["metrics"].get("peak_allocated_mib") is None}
    assert untraced == ({p for p, r in cpu.items() if r["status"] == "ok"} if preset in UNTRACED else set())
    on_gpu, on_cpu = directions(preset, gpu), directions(preset, cpu)
    assert set(on_cpu) == set(on_gpu) - set(not_run)
    wrong = []
    for point, (cpu_way, cpu_change) in sorted(on_cpu.items()):
        if cpu_way != CPU_ONLY.get((preset, point), on_gpu[point][0]):
            wrong.append(f"{preset} {point}: GPU {on_gpu[point][1]:+.1%}, CPU {cpu_change:+.1%}")
    for rest, peaks in scans(cpu).items():
        if any(b < a * (1 - NOISE) for a, b in zip(peaks, peaks[1:])):
            wrong.append(f"{preset} {rest}: a larger batch used less memory on the CPU: {peaks}")
    return wrong


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    """preset -> its grid at full size, predicted for a GPU (each preset planned once)."""
    planned: dict[str, dict] = {}

    def get(preset: str) -> dict[str, dict]:
        if preset not in planned:
            planned[preset] = sweep(preset, tmp_path_factory.mktemp(preset), *gpu_args(preset),
                                    *LEFT_OUT.get(preset, []))
        return planned[preset]
    return get


def side_by_side(preset: str, gpu_plan, tmp_path, *cpu_args: str) -> tuple[dict, dict]:
    """The GPU plan and the CPU sweep (`cpu_args`), as two processes at once: each is mostly one
    process's start-up and one core's work."""
    with ThreadPoolExecutor(2) as pool:
        gpu = pool.submit(gpu_plan, preset)
        cpu = pool.submit(sweep, preset, tmp_path, *cpu_args, *LEFT_OUT.get(preset, []))
        return gpu.result(), cpu.result()


def test_scale_cpu_is_a_group_of_its_own_not_a_technique():
    """scale=cpu composes over any preset, replaces its model's width and vocabulary (data's too),
    and is no result column: run_id changes with it, choices do not name it."""
    from ablate.command_line import unknown_key
    from ablate.schema import GROUPS
    from tests.helpers import compose_config

    llama = compose_config(["experiment=fit_llama_1b", "scale=cpu"])
    assert llama["model"]["_target_"].endswith("GPT2") and llama["model"]["vocab_size"] == 512
    assert llama["data"]["vocab_size"] == 512 and llama["device"] == "cpu" and llama["model"]["block_size"] == 64
    xl = compose_config(["experiment=leanest", "scale=cpu", "model=gpt2-xl"])  # a model named wins, shrunk
    assert (xl["model"]["name"], xl["model"]["n_layer"], xl["model"]["n_embd"]) == ("gpt2-xl", 48, 64)
    assert "scale" not in GROUPS and "scale" not in llama
    assert unknown_key(["-m", "experiment=leanest", "scale=cpu"]) is None
    assert "did you mean 'cpu'" in unknown_key(["scale=cpux"])
    assert unknown_key(["experiment=fit_llama_1b", "scale=cpu", "model.n_layer=2"]) is None  # scale's model
    # A Hugging Face model named with it: one line naming scale=cpu and the model (was: "model.n_embd
    # is not a key of HFCausalLM", a key the user never typed)
    hf = unknown_key(["model=llama3.2-1b", "scale=cpu"])
    assert hf.startswith("scale=cpu sets model.n_embd, model.n_head, model.vocab_size, model.block_size, which "
                         "model=llama3.2-1b does not take") and "model.config.num_hidden_layers=2" in hf
    assert unknown_key(["model=gpt2-xl", "scale=cpu"]) is None


def test_scale_cpu_predicts_every_technique_as_on_a_gpu(gpu_plan, tmp_path):
    """The predictor at scale=cpu on the CPU against the predictor at full size on a GPU: the
    default suite's stand-in for the runs below (-m slow), which check every preset's measured peaks."""
    preset = "demo"
    gpu, cpu = side_by_side(preset, gpu_plan, tmp_path, "scale=cpu", "predict_only=true")
    assert check(preset, gpu, cpu) == []


@pytest.mark.slow
def test_single_gpu_techniques_run_at_scale_cpu_point_as_on_a_gpu(gpu_plan, tmp_path):
    """single_gpu_techniques run at scale=cpu with its ladder cut to the baseline, block recompute
    and the step in backward, plus 8-bit AdamW (the GPU's smallest saving, -3.5%): each traced peak
    points as the GPU plan's. (At `model=gpt-nano seq_len=32 steps=3` block recompute saves 1.2% and
    the step in backward nothing: too small to show.) The whole ladder runs in the slow test."""
    rungs = "[{},{checkpoint:block},{optimizer.in_backward:true},{optimizer:adamw8bit}]"
    gpu, cpu = side_by_side("single_gpu_techniques", gpu_plan, tmp_path, "scale=cpu",
                            f"hydra.sweeper.rungs={rungs}")
    assert {r["status"] for r in cpu.values()} == {"ok"}

    def by_technique(ways: dict) -> dict:  # rung numbers differ between the cut ladder and the whole
        return {" ".join(o for o in p.split() if not o.startswith("rung=")): w for p, w in ways.items()}
    on_cpu = by_technique(directions("single_gpu_techniques", cpu))
    on_gpu = by_technique(directions("single_gpu_techniques", gpu))
    assert {p: w[0] for p, w in on_cpu.items()} == {p: on_gpu[p][0] for p in on_cpu}, (on_cpu, on_gpu)
    assert sorted(on_cpu) == ["checkpoint=block", "optimizer.in_backward=true", "optimizer=adamw8bit"]
    assert on_cpu["checkpoint=block"][1] < -0.3  # a third of the peak and more, as on the GPU (-43%)


def page(preset: str, tmp, *overrides: str) -> str:
    """benchmarks/<preset>.py's page, rendered from the sweep under tmp/s (run with `overrides`)."""
    out = subprocess.run([sys.executable, f"benchmarks/{preset}.py", "--report-only", "--sweep-dir", str(tmp / "s"),
                          "--results", str(tmp / "results"), *overrides],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    md = (tmp / "results" / "cpu" / f"{preset}.md").read_text()
    assert md.startswith(f"# {preset} on CPU") and "- commit: `" in md and "torch " in md
    for image in (tmp / "results" / "cpu" / preset).glob("*.png"):
        assert f"]({preset}/{image.name})" in md  # every plot is linked from the page
    return md


def rows(md: str, heading: str) -> list[str]:
    """The first cells of the table under `## heading`."""
    table = md.split(f"## {heading}\n\n", 1)[1].split("\n\n", 1)[0]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


# The tables a preset's page must show: preset -> {heading: the first cells of its rows}.
PAGE_ROWS = {
    "gpt2_large_ladder": {"Setting (ladder)": [
        "Baseline (batch size = 32)", "+ batch size = 64", "+ batch size = 128",
        "+ Gradient accumulation (32 × 4 = 128)", "+ Block recompute", "+ AdamW for-loop", "+ FSDP (2 processes)"]},
    "gpt2_xl_fsdp_batch_scan": {  # one table per stage, each over its own batch sizes
        "Batch size scan: checkpoint=none, parallel.backward_prefetch=post": ["1", "2", "4", "7", "8", "9"],
        "Batch size scan: checkpoint=block, parallel.backward_prefetch=post": ["8", "16", "32", "64"],
        "Batch size scan: checkpoint=block, parallel.backward_prefetch=pre": ["8", "16", "32", "64"]},
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_at_scale_cpu_as_on_a_gpu(preset, gpu_plan, tmp_path):
    """Every preset run scaled down: each technique's traced peak points as the GPU plan's, the
    points that do not run are NOT_RUN's, and its benchmark page renders from the run."""
    gpu, cpu = side_by_side(preset, gpu_plan, tmp_path, "scale=cpu")
    assert check(preset, gpu, cpu) == []
    if (ROOT / "benchmarks" / f"{preset}.py").exists():
        md = page(preset, tmp_path, "scale=cpu")
        assert "## Setting" in md or "## All runs" in md
        for heading, first_cells in PAGE_ROWS.get(preset, {}).items():
            assert rows(md, heading) == first_cells, heading
