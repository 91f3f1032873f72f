"""find_batch=true: the largest micro-batch of a point that fits, keeping its effective batch.

The micro-batches searched are the divisors of batch_size (capacity.micro_batches) at which the
point can run at all (`candidates`); accumulation is raised to match (RunSpec.with_micro_batch), so
a point's effective batch, and with it its loss curve, never changes. The job hands in how to run
or predict one point, so the same search serves a measured sweep (short probe runs; the largest
micro-batch is tried by the point's own run) and predict_only (each micro-batch judged by its
prediction). Sizes in MiB.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ablate import results
from ablate.capacity import largest_fitting, micro_batches
from ablate.predict import Prediction
from ablate.spec import RunSpec
from ablate.events import EVENTS_FILE
from launch.local import LOG, SPEC
from launch.worker_exit import Outcome

MARGIN = 0.05  # a probe must stay 5% under the capacity to count as fitting


def under_margin(peak_mib: float | None, capacity: float | None) -> bool:
    """The rule for probes and predictions alike: a micro-batch fits when its peak stays MARGIN
    under the capacity (a longer run fragments the cache further). An unknown capacity or peak
    does not count against it."""
    return not (capacity and peak_mib and peak_mib > capacity * (1 - MARGIN))


def candidates(spec: RunSpec, valid: Callable[[RunSpec], bool]) -> list[int]:
    """The divisors of batch_size whose micro-batch the point can run with, ascending: an option
    that cannot accumulate (optimizer.in_backward) leaves only the whole batch. Never empty for a
    valid point: the whole batch is the point itself."""
    return [m for m in micro_batches(spec.batch_size) if valid(spec.with_micro_batch(m))] or [spec.batch_size]


def planned(spec: RunSpec, capacity: float | None, predict: Callable[[RunSpec], Prediction | None],
            micros: list[int] | None = None) -> tuple[Outcome, Prediction | None]:
    """The search under predict_only over `micros` (`candidates`; None: every divisor), each
    judged by `predict` (the job's predictor), nothing run. Plans a card with gpu_memory_gib."""
    if not capacity:
        reason = "find_batch needs a capacity to search against: set gpu_memory_gib (no GPU memory applies here)"
        return Outcome("predicted", reason), predict(spec)
    seen: dict[int, Prediction | None] = {}

    def fits(micro: int) -> bool:
        seen[micro] = predict(spec.with_micro_batch(micro))
        return seen[micro] is not None and under_margin(seen[micro].peak_mib, capacity)

    micros = micros or micro_batches(spec.batch_size)
    best = largest_fitting(micros, fits)
    if best is None:  # an oom that never ran, as a plan's point that does not fit is (outcome.plan_outcome)
        return Outcome("oom", f"{results.PRUNED} no micro-batch of batch_size={spec.batch_size} is predicted "
                              f"to fit {capacity:,.0f} MiB usable; not run (predict_only)"), seen[micros[0]]
    return Outcome("predicted", None, {"max_batch_size": best}), seen[best]


class Stopped(Exception):
    """A probe ended by a stop signal, or one that measured nothing; carries its outcome, which
    becomes the point's."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.reason)
        self.outcome = outcome


def prober(run: Callable[[RunSpec, Path], Outcome], capacity: float | None, probes: list[dict], key: str,
           place: Callable[[int], tuple[RunSpec, Path]], outcomes: dict[int, Outcome] | None = None
           ) -> Callable[[int], bool]:
    """A search's question, "does the point fit at this value of `key`?", answered by running
    `place(value)`'s (spec, folder): a short probe in a folder of its own. It fits when it measured
    and its peak (reserved, else allocated) stays under_margin (a diverged probe fits too). Each
    probe is appended to `probes`, its outcome kept in `outcomes` by value. Raises Stopped when
    the job was told to stop or the probe measured nothing (a limit of this process refused host
    memory): no further probe starts, and a smaller value is not read as the answer."""
    def fits(value: int) -> bool:
        out = run(*place(value))
        peak = out.metrics.get("peak_reserved_mib") or out.metrics.get("peak_allocated_mib")
        ok = out.status in results.MEASURED and under_margin(peak, capacity)
        probes.append({key: value, "status": out.status, "reason": out.reason, "peak_mib": peak, "fits": ok})
        if outcomes is not None:
            outcomes[value] = out
        if out.stopped_by or (out.status == "error" and str(out.reason).startswith(results.UNMEASURED)):
            raise Stopped(out)
        return ok
    return fits


def set_aside(run_dir: Path, into: Path) -> None:
    """The files of the run in run_dir (its spec, log, events and artifacts) into `into`, so that
    the next run there starts clean and this one stays readable where a probe's would be."""
    into.mkdir(parents=True, exist_ok=True)
    for path in [*(run_dir / name for name in (SPEC, LOG, EVENTS_FILE)), *results.artifact_paths(run_dir)]:
        if path.is_file():
            path.replace(into / path.name)


def measured(spec: RunSpec, capacity: float | None, run_dir: Path, run: Callable[[RunSpec, Path], Outcome],
             micros: list[int] | None = None, guess: int | None = None) -> Outcome:
    """Binary-search the largest micro-batch of `micros` (`candidates`; None: every divisor) that
    fits, starting at `guess` (`planned`'s answer, when a capacity is known; without one, at the
    whole batch), then run the point at that micro-batch in run_dir. Each micro-batch is tried
    by a one-step probe in run_dir/find_batch/micro_<m> (any rank failing fails it), except the
    largest: nothing larger can be the answer, so it is tried by the point's own run, which is
    kept when it fits (a point whose whole batch fits runs once) and set aside to where its probe
    would have been when it does not. A run's peak (reserved, else allocated) must stay
    under_margin. Every micro-batch tried is listed in metrics.find_batch, the answer in
    metrics.max_batch_size and the guess in metrics.predicted_max_batch_size."""
    probes: list[dict] = []
    outcomes: dict[int, Outcome] = {}
    micros = micros or micro_batches(spec.batch_size)
    largest = micros[-1]
    folder = run_dir / "find_batch"

    def place(micro: int) -> tuple[RunSpec, Path]:
        if micro == largest:
            return spec.with_micro_batch(micro), run_dir
        return spec.with_micro_batch(micro, steps=1), folder / f"micro_{micro}"

    probe = prober(run, capacity, probes, "micro_batch", place, outcomes)

    def fits(micro: int) -> bool:
        ok = probe(micro)
        if micro == largest and not ok:
            set_aside(run_dir, folder / f"micro_{micro}")
        return ok

    try:
        # Without a capacity (a CPU, no gpu_memory_gib) only a failing run stops a micro-batch:
        # the whole batch goes first, and the point's own run settles a point that runs.
        best = largest_fitting(micros, fits, guess if capacity else largest)
    except Stopped as stop:
        stop.outcome.metrics = {**stop.outcome.metrics, "find_batch": probes, "predicted_max_batch_size": guess}
        return stop.outcome
    found = {"find_batch": probes, "max_batch_size": best, "predicted_max_batch_size": guess}
    if best is None:
        # The search starts above the smallest micro-batch (at the guess, the whole batch or the
        # middle): the smallest is the last probe, and its failure is the point's (a larger one
        # may have failed otherwise).
        smallest = min(probes, key=lambda p: p["micro_batch"])
        status = smallest["status"] if smallest["status"] in ("invalid", "error", "timeout") else "oom"
        return Outcome(status, f"no micro-batch of batch_size={spec.batch_size} fits: micro-batch "
                               f"{smallest['micro_batch']}: {smallest['reason'] or 'over the capacity margin'}", found)
    out = outcomes[best] if best == largest else run(spec.with_micro_batch(best), run_dir)
    out.metrics = {**out.metrics, **found}
    return out
