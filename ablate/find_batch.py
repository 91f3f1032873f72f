"""find_batch=true: the largest micro-batch of a point that fits, keeping its effective batch.

The micro-batches searched are the divisors of batch_size (capacity.micro_batches); accumulation
is raised to match, so a point's effective batch, and with it its loss curve, never changes. The
job hands in how to run or predict one config, so the same search serves a measured sweep (short
probe runs) and predict_only (each micro-batch judged by its prediction). Sizes in MiB.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

from ablate.capacity import largest_fitting, micro_batches
from ablate.predict import Prediction
from launch.local import Outcome

MARGIN = 0.05  # a probe must stay 5% under the capacity to count as fitting


def under_margin(peak_mib: float | None, capacity: float | None) -> bool:
    """The rule for probes and predictions alike: a micro-batch fits when its peak stays MARGIN
    under the capacity (a longer run fragments the cache further). An unknown capacity or peak
    does not count against it."""
    return not (capacity and peak_mib and peak_mib > capacity * (1 - MARGIN))


def with_micro_batch(config: dict, micro: int, steps: int | None = None) -> dict:
    """`config` training its batch_size in micro-batches of `micro` (accumulation raised to match)."""
    cfg = copy.deepcopy(config)
    cfg["accumulation"]["steps"] = cfg["batch_size"] // micro
    cfg["find_batch"] = False
    if steps:
        cfg["steps"], cfg["samples"] = steps, None
    return cfg


def planned(config: dict, capacity: float | None,
            predict: Callable[[dict], Prediction | None]) -> tuple[Outcome, Prediction | None]:
    """The search under predict_only: each micro-batch judged by its prediction, nothing run.
    Plans a card with gpu_memory_gib."""
    if not capacity:
        reason = "find_batch needs a capacity to search against: set gpu_memory_gib (no GPU memory applies here)"
        return Outcome("predicted", reason), predict(config)
    seen: dict[int, Prediction | None] = {}

    def fits(micro: int) -> bool:
        seen[micro] = predict(with_micro_batch(config, micro))
        return seen[micro] is not None and under_margin(seen[micro].peak_mib, capacity)

    best = largest_fitting(micro_batches(config["batch_size"]), fits)
    if best is None:
        return Outcome("predicted", f"no micro-batch of batch_size={config['batch_size']} is predicted to fit "
                                    f"{capacity:,.0f} MiB usable"), seen[1]
    return Outcome("predicted", None, {"max_batch_size": best}), seen[best]


class _Stopped(Exception):
    """A probe ended by a stop signal; carries its outcome, which becomes the point's."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.reason)
        self.outcome = outcome


def measured(config: dict, capacity: float | None, run_dir: Path,
             run: Callable[[dict, Path], Outcome]) -> Outcome:
    """Binary-search the largest micro-batch that fits with one-step probe runs, each in its own
    directory under run_dir (any rank failing fails the probe), then run the point at that
    micro-batch in run_dir. A probe's peak (reserved, else allocated) must stay under_margin.
    Every probe is listed in metrics.find_batch, the answer in metrics.max_batch_size."""
    probes: list[dict] = []

    def fits(micro: int) -> bool:
        out = run(with_micro_batch(config, micro, steps=1), run_dir / "find_batch" / f"micro_{micro}")
        peak = out.metrics.get("peak_reserved_mib") or out.metrics.get("peak_allocated_mib")
        ok = out.status == "ok" and under_margin(peak, capacity)
        probes.append({"micro_batch": micro, "status": out.status, "reason": out.reason, "peak_mib": peak, "fits": ok})
        if out.stopped_by:  # the job was told to stop: no further probe starts
            raise _Stopped(out)
        return ok

    try:
        best = largest_fitting(micro_batches(config["batch_size"]), fits)
    except _Stopped as stop:
        stop.outcome.metrics = {**stop.outcome.metrics, "find_batch": probes}
        return stop.outcome
    found = {"find_batch": probes, "max_batch_size": best}
    if best is None:
        # The search starts in the middle: the smallest micro-batch is the last probe, not the
        # first, and its failure is the point's (a larger one may have failed otherwise).
        smallest = min(probes, key=lambda p: p["micro_batch"])
        status = smallest["status"] if smallest["status"] in ("invalid", "error", "timeout") else "oom"
        return Outcome(status, f"no micro-batch of batch_size={config['batch_size']} fits: micro-batch "
                               f"{smallest['micro_batch']}: {smallest['reason'] or 'over the capacity margin'}", found)
    out = run(with_micro_batch(config, best), run_dir)
    out.metrics = {**out.metrics, **found}
    return out
