"""A cluster-sized sweep's bookkeeping, simulated on one machine (tests/test_cluster_scale.py; docs/clusters.md,
"A 1,000-point sweep over 64 nodes"): the tasks of a SLURM array all writing to one shared out_dir.

Many processes record their points at once through the job's own path (the claim, skip_existing
through the index, results.make, the atomic write, Index.record), some points twice: a requeued
task meeting its first try (the claim serialises them: a finished point is not measured again, an
error or timeout is), and two tries racing with no claim between them (a mount where flock is
local to each node).

Nothing trains: ablate.job.prestarted_outcome, the one step that would start a worker, hands back each
point's canned outcome and leaves the files a worker would. Memory in MiB (an 80 GB H100 holds
81,559), times in ms.
"""
from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import os
import time
from pathlib import Path
from unittest import mock

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ablate import job, results
from ablate.point_claim import claimed
from ablate.console import Progress
from ablate.predict import Prediction
from ablate.schema import GROUPS, identity, short_dirname
from analysis.module_memory import CATEGORIES
from launch.worker_exit import Outcome
from tests.helpers import CONF  # helpers registers the config schema

# 2 × 5 × 5 × 2 × 2 × 5 = 1,000 points: two models (two families of 500), the batch the last axis.
GRID = {"model": ("gpt2", "gpt2-medium"), "optimizer": ("adamw", "sgd", "adamw8bit", "adafactor", "adamw_foreach"),
        "checkpoint": ("none", "block", "every2", "attention", "mlp"), "precision": ("fp32", "bf16"),
        "accumulation": ("none", "x4"), "batch_size": (8, 16, 32, 64, 128)}
CARD_MIB = 81559.0
WORKERS = 12  # processes writing at once: several per core, as 64 nodes would be against one file server
STEPS, WARMUP = 20, 2  # metrics.losses holds all 22 (warm-up included)
N_LAYER = {"gpt2": 12, "gpt2-medium": 24}
N_PARAMS = {"gpt2": 124e6, "gpt2-medium": 355e6}
PARAMS_MIB = {"gpt2": 475.0, "gpt2-medium": 1354.0}  # fp32 weights
ACTS_MIB = {"gpt2": 640.0, "gpt2-medium": 1700.0}  # per sample at seq_len 1024, fp32, nothing recomputed
MS_PER_SAMPLE = {"gpt2": 15.0, "gpt2-medium": 45.0}  # fp32, about 50 TFLOP/s; bf16 takes 0.3 of it
STATE = {"adamw": 2.0, "adamw_foreach": 2.0, "sgd": 0.0, "adamw8bit": 0.5, "adafactor": 0.02}  # × params
KEPT = {"none": 1.0, "block": 0.15, "every2": 0.55, "attention": 0.7, "mlp": 0.6}  # activations kept
SLOWER = {"none": 1.0, "block": 1.33, "every2": 1.16, "attention": 1.1, "mlp": 1.12}  # recompute's cost
# Points that fail whatever their memory, by index in the sweep: (every, offset, status, reason).
FAILURES = ((131, 5, "invalid", "optimizer=adamw8bit needs bitsandbytes, which is not installed"),
            (149, 11, "error", "SLURM job 4242_{i} ended NODE_FAIL without a result (time limit, scancel, "
                               "out-of-memory kill or node failure)"),
            (211, 17, "timeout", "worker still running after timeout_s=1800 s; killed"))
REQUEUED = (50, 11)  # every 50th point from the 11th runs twice, through the claim
RACING = (97, 3)  # every 97th point from the 3rd runs twice at once, with no claim between the tries
# conf/config.yaml's options, for the groups a sweep leaves alone (Hydra's runtime.choices)
DEFAULTS = {"model": "gpt-mini", "data": "synthetic", "optimizer": "adamw", "precision": "fp32", "accumulation": "none",
            "checkpoint": "none", "offload": "none", "parallel": "single", "loss": "standard"}
LAYER_MODULES = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.gelu", "mlp.c_proj")


def option_configs(grid: dict) -> dict[tuple[str, str], dict]:
    """(group, option) -> the option's resolved config, and ("", "") -> the whole default config:
    composed once each from conf/, so the results carry the real config's keys."""
    def resolved(overrides):
        return OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True,
                                      enum_to_str=True)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        out = {("", ""): resolved(["device=cuda", f"steps={STEPS}", f"warmup_steps={WARMUP}", "seq_len=1024"])}
        out.update({(g, o): resolved([f"{g}={o}"])[g] for g, options in grid.items() if g in GROUPS for o in options})
    return out


def points_of(grid: dict) -> list[dict]:
    """The sweep's points as {group or key: value}, in Hydra's order (the last axis fastest)."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def make_point(values: dict, options: dict, out_dir: Path, sweep: Path) -> job.ResolvedPoint:
    """A job.ResolvedPoint as ResolvedPoint.of makes it inside the point's own task (no RunSpec: nothing runs)."""
    config = json.loads(json.dumps(options[("", "")]))  # a deep copy
    config.update({g: options[(g, v)] for g, v in values.items() if g in GROUPS})
    config.update(batch_size=values["batch_size"], out_dir=str(out_dir))
    overrides = [f"{k}={v}" for k, v in values.items()]
    name = ",".join(sorted(overrides))  # Hydra's override_dirname
    rid = results.run_id(identity(config))
    choices = {**DEFAULTS, **{g: v for g, v in values.items() if g in GROUPS}}
    return job.ResolvedPoint(config, None, choices, overrides, rid, sweep / short_dirname(name), name)


def canned(i: int, values: dict) -> tuple[Outcome, Prediction]:
    """Point i's outcome as a worker would report it on an 80 GB card: memory from the techniques,
    an OOM past the card, FAILURES by index; the prediction within 1.2% of what it measures."""
    model, batch, half = values["model"], values["batch_size"], values["precision"] == "bf16"
    micro = batch / (4 if values["accumulation"] == "x4" else 1)
    parts = {"params": PARAMS_MIB[model], "grads": PARAMS_MIB[model],
             "optimizer": PARAMS_MIB[model] * STATE[values["optimizer"]],
             "activations": ACTS_MIB[model] * micro * KEPT[values["checkpoint"]] * (0.55 if half else 1.0),
             "other": 320.0}
    peak = sum(parts.values())
    prediction = Prediction(peak * (1 - 0.002 * (i % 7)), {k: v * 0.99 for k, v in parts.items()}, parts, "analytic")
    env = {"torch": "2.9.0+cu128", "cuda": "12.8", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_total_mib": CARD_MIB,
           "driver": "570.86", "world_size": 1}  # what a worker reports once it has started
    for every, offset, status, reason in FAILURES:
        if i % every == offset:  # an invalid point starts no worker; SLURM's row for a lost job knows none
            return Outcome(status, reason.format(i=i), env=env if status == "timeout" else {}), prediction
    if peak > CARD_MIB:
        return Outcome("oom", f"CUDA out of memory. Tried to allocate {peak - CARD_MIB:,.0f} MiB", env=env), prediction
    ms = MS_PER_SAMPLE[model] * batch * SLOWER[values["checkpoint"]] * (0.3 if half else 1.0)
    losses = [3.2 + 7.8 * 0.82 ** k + 0.001 * (i % 13) for k in range(STEPS + WARMUP)]
    metrics = {"peak_allocated_mib": peak, "peak_reserved_mib": peak * 1.08, "peak_active_mib": peak,
               "nvml_peak_mib": peak * 1.08 + 520, "host_peak_rss_mib": 3100.0, "breakdown_mib": parts,
               "iter_time_ms": ms, "iter_time_ms_p10": ms * 0.98, "iter_time_ms_p90": ms * 1.03,
               "train_latency_s": ms * STEPS / 1000, "tokens_per_s": batch * 1024 / ms * 1000,
               "samples_per_s": batch / ms * 1000, "tflops": 6 * N_PARAMS[model] * batch * 1024 / ms / 1e9,
               "mfu": 0.31, "hfu": 0.35, "gpu_util_pct_mean": 97.0, "gpu_util_pct_std": 1.5,
               "loss_first": losses[WARMUP], "loss_final": losses[-1], "eval_loss": losses[-1] + 0.02,
               "losses": losses, "per_rank": [{"rank": 0, "peak_allocated_mib": peak}]}
    phases = {"startup": 4.1, "setup": 0.4, "build": 1.2, "warmup": 2.0, "traced_step": 1.1,
              "measured": ms * STEPS / 1000, "eval": 0.6, "teardown": 0.2}
    return Outcome("ok", None, metrics, env, phases=phases), prediction


def module_table(parts: dict, n_layer: int) -> str:
    """memory_by_module.csv as a worker writes it (ablate/artifacts.py): the peak's `parts` (MiB)
    split evenly over the blocks' modules, each parent holding the sum of its children."""
    leaves = [f"transformer.h.{i}.{m}" for i in range(n_layer) for m in LAYER_MODULES]
    rows: dict[str, dict] = {}
    for leaf in leaves:
        for name in ["model"] + [".".join(leaf.split(".")[:k]) for k in range(1, leaf.count(".") + 2)]:
            row = rows.setdefault(name, dict.fromkeys(CATEGORIES, 0.0))
            for c in CATEGORIES:
                row[c] += parts[c] / len(leaves)
    lines = ["module,depth,fwd_peak_mib,bwd_peak_mib,at_peak_mib," + ",".join(f"at_peak_{c}_mib" for c in CATEGORIES)]
    lines += [f"{name},{0 if name == 'model' else name.count('.') + 1},,,{sum(row.values()):.4f},"
              + ",".join(f"{row[c]:.4f}" for c in CATEGORIES) for name, row in rows.items()]
    return "\n".join(lines) + "\n"


def leave_artifacts(run_dir: Path, outcome: Outcome, n_layer: int) -> None:
    """The files a worker leaves beside result.json (results.ARTIFACTS): the traced step's memory by
    module and a stand-in for its allocator snapshot, or one for the snapshot at an OOM. Each
    written whole (a temporary renamed): two racing tries may write them at once."""
    files = ({"memory_by_module.csv": module_table(outcome.metrics["breakdown_mib"], n_layer),
              "memory_snapshot.pickle": "a stand-in: the report only links it"} if outcome.status == "ok" else
             {"oom_snapshot.pickle": "a stand-in"} if outcome.status == "oom" else {})
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        tmp = run_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, run_dir / name)


def measure(outcome: tuple, log: Path, meet: bool, spec, run_dir: Path, overrides: list, progress):
    """prestarted_outcome for a point that trains nothing: notes that it was measured (a line per try,
    O_APPEND), leaves the worker's files, hands back the canned outcome. With `meet` (a racing
    pair), waits for the other try to get here too, so that both passed the skip check before
    either wrote: they race."""
    leave_artifacts(run_dir, outcome[0], N_LAYER[dict(o.split("=", 1) for o in overrides)["model"]])
    line = f"{run_dir.name}\n".encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line)
    os.close(fd)
    deadline = time.monotonic() + 60  # never forever: a lost partner leaves the test to fail on its count
    while meet and log.read_bytes().count(line) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.005)  # a worker takes minutes; a few ms keep the tries of a requeued point overlapping
    return outcome


def record(task: tuple) -> None:
    """One try of one point, in a worker process, as the job's run_point runs it: claimed (unless
    `claim` is false: a flock that does not hold across nodes), then run_claimed."""
    point, outcome, claim, log = task
    with open(os.devnull, "w") as quiet, \
            mock.patch.object(job, "prestarted_outcome", functools.partial(measure, outcome, log, not claim)):
        progress = Progress(point.label, stream=quiet)
        if claim:
            with claimed(results.Index(point.config["out_dir"]).claim_path(point.run_id), progress.note):
                job.run_claimed(point, progress)
        else:
            job.run_claimed(point, progress)


def is_requeued(i: int) -> bool:
    return i % REQUEUED[0] == REQUEUED[1]


def is_racing(i: int) -> bool:
    return i % RACING[0] == RACING[1]


def tries(points: list, outcomes: list, log: Path) -> list[tuple]:
    """Every try to run: each point once, the requeued ones twice through the claim and the racing
    ones twice without it, each second try right after its first (so that the two meet)."""
    out = []
    for i, (point, outcome) in enumerate(zip(points, outcomes)):
        out += [(point, outcome, not is_racing(i), log)] * (2 if is_racing(i) or is_requeued(i) else 1)
    return out


def write_sweep(root: Path, grid: dict = GRID) -> dict:
    """The sweep over `grid` recorded under root/out (the shared out_dir) by WORKERS processes at
    once. Returns {"sweep": its directory, "out_dir", "points", "outcomes" (canned), "log" (a line
    per point measured)}."""
    out_dir = root / "out"
    sweep = out_dir / "sweeps" / "2026-11-25_03-00-00"
    sweep.mkdir(parents=True)
    task = [f"{k}={','.join(map(str, v))}" for k, v in grid.items()]  # the sweep's command line
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}}}))
    options = option_configs(grid)
    values = points_of(grid)
    points = [make_point(v, options, out_dir, sweep) for v in values]
    outcomes = [canned(i, v) for i, v in enumerate(values)]
    log = root / "measured.log"
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        pool.map(record, tries(points, outcomes, log), chunksize=1)  # a pair's two tries in two processes
    return {"sweep": sweep, "out_dir": out_dir, "points": points, "outcomes": outcomes, "log": log}
