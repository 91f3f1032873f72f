"""What a submitit job (a grid point under hydra/launcher=slurm, submitit_local or gpu_pool) left
when it left no result: the reason its `error` row gives."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def log_tail(job: Any) -> str:
    """The last line of a submitit job's stderr (its traceback's last line, where it raised
    before it could write a result), or ""."""
    try:
        lines = [line for line in Path(job.paths.stderr).read_text(errors="replace").splitlines() if line.strip()]
    except (OSError, AttributeError):
        return ""
    return lines[-1].strip()[:300] if lines else ""


EXITED = ("FINISHED", "COMPLETED", "FAILED")  # a job's states (local, SLURM) when it exited on its own, unkilled


def no_result(job: Any, what: str, killed: str) -> str:
    """The reason of a job that left no result: for one that exited on its own (e.g. it could not
    unpickle its function: submitit writes no result then), its log's last line; for one killed
    (a signal, a time limit), `killed`, the likely causes."""
    state = job.state
    tail = log_tail(job) if state in EXITED else ""
    return (f"{what} {job.job_id} ended {state} without a result: {tail} (its log: {job.paths.stderr})"
            if tail else f"{what} {job.job_id} ended {state} without a result ({killed})")
