"""The last lines of a sweep: how many points ended how, which failed and why, and the command that
reports them. A Hydra callback (conf/config.yaml, hydra.callbacks), so it runs once in the sweep's
own process whichever launcher ran the points (local, submitit_local or SLURM)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ablate.results import RESULT_FILE, STATUSES, load

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
    failed = [(point, status, reason) for point, status, reason in results if status in FAILED]
    lines += [f"  {status}: {point}: {reason.splitlines()[0] if reason else 'no reason given'}"
              for point, status, reason in failed[:SHOWN]]
    if len(failed) > SHOWN:
        lines.append(f"  ... and {len(failed) - SHOWN} more failed points")
    lines.append(f"report: python -m analysis.report {sweep_dir}")
    return "\n".join(lines)


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print(summary(Path(str(config.hydra.sweep.dir))), flush=True)
