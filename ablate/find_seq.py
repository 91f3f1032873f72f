"""find_seq=true: the longest seq_len of a point that fits, its batch (and micro-batch) as given.

The search is find_batch's (ablate/find_batch.py) over lengths instead of micro-batches: planned
from the predictions, then confirmed by one-step probe runs, each a worker launch of its own from
the job (every rank of a distributed point runs each probe; any rank failing fails it), under the
same MARGIN rule. The lengths tried never pass the model's positions (Family.max_seq_len):

1. powers of two: the largest predicted to fit first, then the next one up (or down), then a
   binary search of the rest (capacity.largest_fitting), until a power P that fits is known whose
   double does not fit or lies past the model's positions;
2. between P and 2P, lengths in steps of min(1024, P/8), at least 1: multiples of 1,024 from
   P = 8,192 up, eighths of P below (where steps of 1,024 would leave three lengths or none to
   try, and a tiny CPU model's P is under 1,024), plus the model's maximum where it lies there.
   A second binary search, from the predicted answer.

So a right prediction costs four probes at most, and the answer is within 1,024 tokens or an
eighth of P of the longest length that fits. The row's config.seq_len stays what was asked; its
metrics are those of the longest length that fit (metrics.max_seq_len), run in the point's own
directory. Sizes in MiB.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ablate import results
from ablate.capacity import largest_fitting
from ablate.find_batch import Stopped, prober, under_margin
from ablate.predict import Prediction
from ablate.spec import RunSpec
from launch.worker_exit import Outcome

STEP = 1024  # tokens: the refinement's coarsest step, the granularity long contexts are quoted in
EIGHTHS = 8  # a shorter power's step is P/8, so a short answer is as precise, relatively, as a long one


def searching(spec: RunSpec) -> bool:
    """Whether the point asks for the search (the job's: a worker is handed its point with it unset)."""
    return spec.find_seq


def at_seq_len(spec: RunSpec, seq_len: int, steps: int | None = None) -> RunSpec:
    """This point at `seq_len`, not searching again; `steps` replaces steps (and samples) for a probe."""
    more = {"steps": steps, "samples": None} if steps else {}
    return spec.replace(seq_len=seq_len, find_seq=False, **more)


def limit_of(spec: RunSpec) -> int:
    """The longest sequence the model takes: GPT-2's block_size, a transformers config's
    max_position_embeddings (Family.max_seq_len)."""
    from hydra.utils import instantiate

    return int(instantiate(spec.groups["model"]).max_seq_len)


def refused(spec: RunSpec, capacity: float | None) -> Outcome | None:
    """An `invalid` outcome for a search that cannot be made; None if it can."""
    if spec.find_batch:  # each search holds the other's axis fixed: together, neither has a fixed point to answer for
        return Outcome("invalid", "find_seq=true and find_batch=true: one search at a time (find_seq keeps the "
                                  "micro-batch, find_batch the seq_len); run find_seq=true at the micro-batch you want")
    if not capacity and not spec.predict_only:  # only the model's positions, or the host's OOM killer, would end it
        return Outcome("invalid", "find_seq=true needs a capacity to search against: set gpu_memory_gib (GiB of "
                                  "the card to fit), or run on a GPU")
    return None


def powers(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    return [2**i for i in range(max(limit, 1).bit_length()) if 2**i <= limit]


def between(power: int, limit: int) -> list[int]:
    """The lengths the refinement tries above a fitting `power` whose double does not fit (or lies past `limit`)."""
    step = max(1, min(STEP, power // EIGHTHS))
    lengths = list(range(power + step, min(2 * power - 1, limit) + 1, step))
    if power < limit < 2 * power and limit not in lengths:  # the model's own maximum, off the grid
        lengths.append(limit)
    return lengths


def search(fits: Callable[[int], bool], limit: int, guess: int | None = None) -> int | None:
    """The longest length up to `limit` that `fits`, assuming that whatever is shorter than a
    fitting length fits too: the powers of two from the one at or below `guess` (None: a plain
    binary search), then the lengths `between` from `guess` itself. None if not even 1 fits."""
    start = 1 << (guess.bit_length() - 1) if guess else None
    power = largest_fitting(powers(limit), fits, start)
    if power is None:
        return None
    lengths = between(power, limit)
    # A guess that is a power itself says the next length up does not fit: that one is tried first.
    return largest_fitting(lengths, fits, lengths[0] if lengths and guess == power else guess) or power


def bounded(best: int | None, limit: int) -> str | None:
    """The reason of a row whose search the model's positions ended, not the memory."""
    if best != limit:
        return None
    return f"find_seq: stopped at the model's {limit:,} positions (its longest sequence), not by memory"


def planned(spec: RunSpec, capacity: float | None, predict: Callable[[RunSpec], Prediction | None],
            limit: int) -> tuple[Outcome, Prediction | None]:
    """The search under predict_only, each length judged by `predict` (the job's predictor),
    nothing run. Plans a card with gpu_memory_gib. The answer is both the row's max_seq_len (as
    find_batch's plan gives max_batch_size) and its predicted_max_seq_len."""
    if not capacity:
        reason = "find_seq needs a capacity to search against: set gpu_memory_gib (no GPU memory applies here)"
        return Outcome("predicted", reason), predict(spec)
    seen: dict[int, Prediction | None] = {}

    def fits(seq_len: int) -> bool:
        seen[seq_len] = predict(at_seq_len(spec, seq_len))
        return seen[seq_len] is not None and under_margin(seen[seq_len].peak_mib, capacity)

    best = search(fits, limit)
    if best is None:  # an oom that never ran, as a plan's point that does not fit is (outcome.plan_outcome)
        return Outcome("oom", f"{results.PRUNED} no seq_len at batch_size={spec.batch_size} is predicted to fit "
                              f"{capacity:,.0f} MiB usable; not run (predict_only)"), seen[min(seen)]
    return Outcome("predicted", bounded(best, limit), {"max_seq_len": best, "predicted_max_seq_len": best}), seen[best]


def measured(spec: RunSpec, capacity: float | None, run_dir: Path, run: Callable[[RunSpec, Path], Outcome],
             limit: int, guess: int | None = None) -> Outcome:
    """The search with one-step probe runs, each in run_dir/find_seq/seq_<n>, starting at `guess`
    (`planned`'s answer; None: a plain binary search), then the point at the longest length that
    fits, in run_dir. A probe's peak (reserved, else allocated) must stay under_margin. Every probe
    is listed in metrics.find_seq, the answer in metrics.max_seq_len, the guess in
    metrics.predicted_max_seq_len."""
    probes: list[dict] = []
    fits = prober(run, capacity, probes, "seq_len",
                  lambda seq_len: (at_seq_len(spec, seq_len, steps=1), run_dir / "find_seq" / f"seq_{seq_len}"))
    try:
        best = search(fits, limit, guess)
    except Stopped as stop:
        stop.outcome.metrics = {**stop.outcome.metrics, "find_seq": probes, "predicted_max_seq_len": guess}
        return stop.outcome
    found = {"find_seq": probes, "max_seq_len": best, "predicted_max_seq_len": guess}
    if best is None:
        # Length 1 is the last probe of a search that found nothing, and its failure is the point's
        # (a longer one may have failed otherwise).
        shortest = min(probes, key=lambda p: p["seq_len"])
        status = shortest["status"] if shortest["status"] in ("invalid", "error", "timeout") else "oom"
        return Outcome(status, f"no seq_len at batch_size={spec.batch_size} fits: seq_len {shortest['seq_len']}: "
                               f"{shortest['reason'] or 'over the capacity margin'}", found)
    out = run(at_seq_len(spec, best), run_dir)
    out.metrics = {**out.metrics, **found}
    note = bounded(best, limit)
    if note and out.status in results.MEASURED:  # a diverged row keeps its own reason first
        out.reason = f"{out.reason}; {note}" if out.reason else note
    return out


def searched(spec: RunSpec, capacity: float | None, run_dir: Path, run: Callable[[RunSpec, Path], Outcome],
             predict: Callable[[RunSpec], Prediction | None]) -> tuple[Outcome, Prediction | None]:
    """The measured search as the job makes it: the plan's answer as the guess, the probes, and the
    prediction of the length the row measured (None where it measured none)."""
    limit = limit_of(spec)
    plan, at_guess = planned(spec, capacity, predict, limit)
    guess = plan.metrics.get("predicted_max_seq_len")
    outcome = measured(spec, capacity, run_dir, run, limit, guess)
    best = outcome.metrics.get("max_seq_len")
    if not best:
        return outcome, None
    return outcome, at_guess if best == guess else predict(at_seq_len(spec, best))
