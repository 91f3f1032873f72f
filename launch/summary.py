"""The last lines of a sweep: how many points ended how, which failed and why, and the command that
reports them. A Hydra callback (conf/config.yaml, hydra.callbacks), so it runs once in the sweep's
own process whichever launcher ran the points (local, submitit_local or SLURM)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ablate.results import PRUNED, RESULT_FILE, STATUSES, load

FAILED = tuple(s for s in STATUSES if s not in ("ok", "predicted"))  # oom, invalid, error, timeout, diverged
SHOWN = 20  # failed points listed by name; the rest are counted


def summary(sweep_dir: Path) -> str:
    """'11 results under DIR: 9 ok, 1 oom, 1 error', a line per failed point, the report command."""
    results = []
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        result, _ = load(path)  # not a result by the contract: the report names it; the summary skips it
        if result is not None:
            results.append((path.parent.relative_to(sweep_dir), result["status"], result["reason"]))
    if not results:
        return f"no result.json under {sweep_dir}"
    counts = {s: sum(status == s for _, status, _ in results) for s in STATUSES}
    lines = [f"{len(results)} result{'s' if len(results) != 1 else ''} under {sweep_dir}: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    answer = per_card(sweep_dir)
    lines += answer
    failed = [(point, status, reason) for point, status, reason in results if status in FAILED
              and not (answer and (reason or "").startswith(PRUNED))]  # a plan's misfits are in its answer
    lines += [f"  {status}: {point}: {reason.splitlines()[0] if reason else 'no reason given'}"
              for point, status, reason in failed[:SHOWN]]
    if len(failed) > SHOWN:
        lines.append(f"  ... and {len(failed) - SHOWN} more failed points")
    lines.append(f"report: python -m analysis.report {sweep_dir}")
    return "\n".join(lines)


def per_card(sweep_dir: Path) -> list[str]:
    """For a plan or a sweep over card sizes, per card: the recommended combination and what else
    fits (the report's Recommended table, analysis/recommend.py); [] for any other sweep."""
    try:  # pandas and the report's code: only at the sweep's end, and never at the summary's cost
        from analysis import compare, recommend
        from analysis.load import load as load_rows

        df = load_rows([sweep_dir])
        if df.empty or not recommend.spans_cards(df):
            return []
        lines = []
        for work, part, labels in recommend.workloads(df, compare.varied(df)):
            lines += [f" {work}:"] if work else []
            for card, capacity, best, rows in recommend.answers(part, labels):
                if not best:
                    lines.append(f"  {card}: nothing fits{recommend.leanest(rows, labels, capacity)}")
                    continue
                lines.append(f"  {card}: {recommend.briefly(best[0], labels)}")
                lines += [f"    also fits: {recommend.briefly(r, labels)}" for r in best[1:]]
        return ["recommended, per card:", *lines] if lines else []
    except Exception as exc:  # a result the report cannot read: the counts above still stand
        return [f"  (no recommendation: {type(exc).__name__}: {exc})"]


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print(summary(Path(str(config.hydra.sweep.dir))), flush=True)
