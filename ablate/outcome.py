"""A grid point's outcome, once the job has its typed spec: validate, predict, then run the worker
once, as a batch or length search, or not at all (a plan, a pruned point). Never touches CUDA itself.

validate -> predict -> (prune | plan | launch the worker -> its outcome) -> Outcome (+ Prediction)
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import replace
from pathlib import Path

from ablate import find_batch, find_seq, results
from ablate.build import Techniques, check_config
from ablate.capacity import capacity_mib, host_free_mib
from ablate.console import Progress
from ablate.events import EVENTS_FILE
from ablate.models import param_change
from ablate.predict import Prediction, predict
from ablate.predict.step_time import step_time_s
from ablate.predict.timeline import Unmodelled
from ablate.spec import RunSpec
from ablate.techniques import Invalid
from launch.local import SPEC, run_worker, worker_command
from launch.worker_exit import Outcome
from launch.nvml import gpu_total_mib, visible_gpu_count


def launch(spec: RunSpec, run_dir: Path, overrides: list[str], progress: Progress) -> Outcome:
    """Start the worker (or torchrun) on run_dir/spec.json: the resolved config it rebuilds the spec from."""
    run_dir.mkdir(parents=True, exist_ok=True)  # find_batch's and find_seq's probes run in subdirectories
    spec_path = run_dir / SPEC
    # Atomic: every node of a multi-node point writes the same spec here, while the other node's
    # launcher may be reading it (a plain write truncates first, and the reader would see nothing).
    results.write_json(spec_path, {"config": spec.to_config(), "run_dir": str(run_dir), "overrides": overrides})
    (run_dir / EVENTS_FILE).unlink(missing_ok=True)  # a rerun in the same directory starts clean
    results.clear_artifacts(run_dir)
    argv, world, env = worker_command(spec)
    on_gpu = spec.device != "cpu" and visible_gpu_count() > 0  # the measured steps time a GPU, not this host
    return run_worker([*argv, str(spec_path)], run_dir, spec.timeout_s, world_size=world, on_event=progress, env=env,
                      next_at="measure" if on_gpu else "eval")


def validate(spec: RunSpec) -> Outcome | None:
    """An `invalid` outcome for a combination that cannot run; None if it can."""
    if spec.groups["parallel"]["nproc"] == "auto":  # left so by resolve_nproc: device=cuda, no GPU here
        return Outcome("invalid", "parallel.nproc=auto counts the GPUs in sight, and with device=cuda this "
                                  "machine has none: give parallel.nproc=N, the GPUs per node to plan "
                                  "(predict_only=true) or run for")
    try:
        check_config(spec)
    except Exception as exc:  # Invalid, or an option rejecting its keys (instantiate's TypeError)
        cause = exc.__cause__ or exc  # instantiate wraps what the option's constructor raised
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""  # a reason is one line
        # An Invalid's message names its key itself; anything else at least names what was raised.
        return Outcome("invalid", text if isinstance(cause, Invalid) else f"{type(cause).__name__}: {text}")
    return None


def run_once(spec: RunSpec, run_dir: Path, overrides: list[str], progress: Progress) -> Outcome:
    """Validate, then run. An invalid combination never starts a worker."""
    invalid = validate(spec)
    if invalid:
        return invalid
    try:
        return launch(spec, run_dir, overrides, progress)
    except Exception as exc:  # our own failure to launch is still a row, never a lost point
        return Outcome("error", f"launch failed: {type(exc).__name__}: {exc}")


def predicted(spec: RunSpec) -> Prediction | None:
    """The point's predicted memory and step time; a method that fails falls back to the analytic
    model, one the analytic model has no sizes for (a model family it does not describe) to the
    trace, and a prediction that cannot be made is a warning, never a lost point."""
    methods = [] if spec.predict == "none" else list(dict.fromkeys([spec.predict, "analytic"]))
    if spec.device == "auto" and not spec.predict_only and not visible_gpu_count():
        spec = spec.replace(device="cpu")  # this point is about to run here, on the CPU
    for method in methods:
        try:
            prediction = predict(spec, method)
            # The same time whatever the method: the time model reads sizes, never a trace.
            prediction.step_time_s = step_time_s(spec, None if spec.device == "cpu" else seen_gpu())
            return prediction
        except Unmodelled as exc:  # e.g. a model family it has no layer sizes for: the trace runs any
            print(f"note: {exc}; predicting with predict=trace instead", file=sys.stderr)
            if "trace" not in methods:
                methods.append("trace")  # the loop reaches it next
        except Exception as exc:  # e.g. an option the fake-tensor trace cannot follow
            print(f"warning: predict={method} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return None


def seen_gpu() -> str | None:
    """The name of the first GPU a worker started from here would see, as torch.cuda names it
    ("NVIDIA H100 80GB HBM3"), read from NVML without initialising CUDA; None without one."""
    if not visible_gpu_count():
        return None
    try:
        import pynvml  # nvidia-ml-py, which launch/nvml.py reads the GPUs with

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(visible))
        name = pynvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # no driver, an odd CUDA_VISIBLE_DEVICES entry: the card is not known
        return None


def _over_the_host(spec: RunSpec, prediction: Prediction | None, gpu_mib: float | None) -> str | None:
    """An oom's reason for a point that would train in host memory (a CPU) and is predicted to need
    more of it than the host has free (a GPU preset without scale=cpu: gpt2-large's 22 GiB on a
    host of 23 GiB); None when it fits or cannot be told. Not run: on a CPU nothing caps the allocator,
    so the kernel's OOM killer would pick a process, perhaps not this point's."""
    on_host = spec.device == "cpu" or (spec.device == "auto" and not gpu_mib)
    free = host_free_mib() if on_host and prediction else None
    ranks = spec.groups["parallel"].get("nproc")
    need = prediction.peak_mib * (ranks if isinstance(ranks, int) else 1) if free else 0
    if not free or need <= free * (1 - find_batch.MARGIN):
        return None
    return (f"{results.PRUNED} {need:,.0f} MiB of host memory > {free:,.0f} MiB free on this host; not run "
            f"(on a CPU the OOM killer would end it, or another process: scale=cpu scales a preset down)")


LONG_S = 120.0  # a point predicted to take longer than this here says so before it starts


def _say_if_long(spec: RunSpec, prediction: Prediction | None, progress: Progress, on_gpu: bool) -> None:
    """A point predicted to take minutes on this machine (a GPU-sized point on a CPU) says so, with its
    predicted peak and step time, before its first step, instead of sitting silent at `init...`."""
    step = prediction.step_time_s if prediction else None
    if step is None:
        return
    steps = (spec.samples // max(spec.batch_size, 1) if spec.samples else spec.steps) + spec.warmup_steps
    if step * steps < LONG_S:
        return
    where = "this GPU" if on_gpu else "this CPU"
    progress.note(f"predicted: {step:,.1f} s a step on {where} and a peak of {prediction.peak_mib:,.0f} MiB, so "
                  f"about {step * steps / 60:,.0f} min for its {steps} steps; predict_only=true plans it in "
                  f"seconds, scale=cpu scales a preset down")


@functools.cache
def _note_once(line: str) -> None:
    """A note printed once per process (a sweep's points share one), not once per point."""
    print(line, file=sys.stderr)


def plan_outcome(prediction: Prediction | None, capacity: float | None) -> Outcome:
    """A predict_only point: `predicted`, or, where a capacity is known (gpu_memory_gib, else this
    machine's GPU) and the prediction does not fit it by find_batch's rule, an `oom` that never ran
    (reason PRUNED, so a later real sweep measures it). One rule, so a plan's rows and its
    find_batch answers agree, and a batch scan's plan stops where the run would."""
    if prediction is None or find_batch.under_margin(prediction.peak_mib, capacity):
        return Outcome("predicted", None)
    room = capacity * (1 - find_batch.MARGIN)
    return Outcome("oom", f"{results.PRUNED} {prediction.peak_mib:,.0f} MiB > {room:,.0f} MiB "
                          f"({1 - find_batch.MARGIN:.0%} of {capacity:,.0f} MiB usable); not run (predict_only)")


def outcome_of(spec: RunSpec, run_dir: Path, overrides: list[str],
               progress: Progress) -> tuple[Outcome, Prediction | None]:
    """Validate, predict, then (unless predict_only or pruned) run, once or as a batch or length
    search (under predict_only, a search of predictions). A row no worker ran (a plan, a pruned point)
    carries the parameter counts the worker would have (`counted`)."""
    outcome, prediction = _decided(spec, run_dir, overrides, progress)
    if outcome.status == "predicted" or results.predicted_oom({"status": outcome.status, "reason": outcome.reason}):
        outcome = counted(spec, outcome)
    return outcome, prediction


def counted(spec: RunSpec, outcome: Outcome) -> Outcome:
    """`outcome` with `params` and `trainable_params` of the model the point's techniques make,
    read off its meta layout (what a worker counts on the model it builds); as it was where they
    cannot be read, with a warning: a count is no reason to lose a row."""
    try:
        t = Techniques.of(spec)
        total, trainable = t.model.param_counts(param_change(t))
    except Exception as exc:
        print(f"warning: parameters not counted: {type(exc).__name__}: {exc}", file=sys.stderr)
        return outcome
    return replace(outcome, metrics={**outcome.metrics, "params": total, "trainable_params": trainable})


def _decided(spec: RunSpec, run_dir: Path, overrides: list[str],
             progress: Progress) -> tuple[Outcome, Prediction | None]:
    """outcome_of's outcome, before its counts: validate, predict, then prune, plan or run.

    A batch search is pruned only when its smallest micro-batch is predicted not to fit, and its
    prediction is of the micro-batch its row measures (the largest that fits), so that predicted
    and measured peaks compare like with like; a length search (find_seq) likewise, from seq_len 1."""
    invalid = validate(spec)
    if invalid:
        return invalid, None
    gpu_mib = gpu_total_mib() if spec.device != "cpu" else None
    capacity = capacity_mib(spec.gpu_memory_gib, gpu_mib)
    lengths = find_seq.searching(spec)
    refused = find_seq.refused(spec, capacity) if lengths else None
    if refused:
        return refused, None
    # A row no worker ran still names the card it was judged against (as a worker's env would).
    judged = {"gpu_total_mib": gpu_mib,
              "emulated_gpu_mib": spec.gpu_memory_gib * 1024 if spec.gpu_memory_gib else None}

    def runnable(probe: RunSpec) -> bool:  # a micro-batch this point can run at (find_batch searches those)
        return validate(probe) is None

    micros = find_batch.candidates(spec, runnable) if spec.find_batch else None  # validated once
    if spec.predict_only and spec.device == "auto" and not gpu_mib:
        _note_once("note: predict_only with device=auto and no GPU here plans for a CUDA GPU (its context "
                   "and workspace included); device=cpu plans for this host's CPU")
    if spec.predict_only and spec.find_batch:
        outcome, prediction = find_batch.planned(spec, capacity, predicted, micros)
        return replace(outcome, env=judged), prediction
    if spec.predict_only and lengths:
        outcome, prediction = find_seq.planned(spec, capacity, predicted, find_seq.limit_of(spec))
        return replace(outcome, env=judged), prediction
    if spec.predict_only:
        prediction = predicted(spec)
        # A plan for this host's CPU refuses what its run would: more than the host has free.
        too_big = _over_the_host(spec, prediction, gpu_mib) if spec.device == "cpu" else None
        outcome = Outcome("oom", too_big) if too_big else plan_outcome(prediction, capacity)
        return replace(outcome, env=judged), prediction
    searched = spec.find_batch
    smallest = micros[0] if searched else None
    first = spec.with_micro_batch(smallest) if searched else find_seq.at_seq_len(spec, 1) if lengths else spec
    prediction = predicted(first)
    if spec.prune and prediction and capacity and prediction.peak_mib > capacity * (1 + spec.prune_margin):
        at = f" at micro-batch {smallest}" if searched else " at seq_len 1" if lengths else ""
        return Outcome("oom", f"{results.PRUNED} {prediction.peak_mib:,.0f} MiB{at} > {capacity:,.0f} MiB usable "
                              f"(+{spec.prune_margin:.0%} margin); not run", env=judged), prediction
    too_big = _over_the_host(spec, prediction, gpu_mib)
    if too_big:
        return Outcome("oom", too_big, env=judged), prediction
    _say_if_long(spec, prediction, progress, on_gpu=bool(gpu_mib) and spec.device != "cpu")
    if lengths:
        probe = lambda at, where: run_once(at, where, overrides, progress)  # noqa: E731
        outcome, at_best = find_seq.searched(spec, capacity, run_dir, probe, predicted)
        return outcome, at_best or prediction
    if not searched:
        return run_once(spec, run_dir, overrides, progress), prediction
    # The search starts where the predictions say the largest micro-batch that fits is: when
    # they are right, two probes (it and the next larger) settle it.
    plan, at_guess = find_batch.planned(spec, capacity, predicted, micros) if capacity else (None, None)
    guess = plan.metrics.get("max_batch_size") if plan else None
    outcome = find_batch.measured(spec, capacity, run_dir,
                                  lambda probe, where: run_once(probe, where, overrides, progress), micros, guess)
    best = outcome.metrics.get("max_batch_size")
    if best and best != smallest:
        prediction = at_guess if best == guess else predicted(spec.with_micro_batch(best))
    return outcome, prediction
