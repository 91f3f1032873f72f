"""The job: one grid point's orchestrator, inside the Hydra process. It never touches CUDA itself.

resolve config -> run_id -> claim -> skip if done -> outcome (ablate/outcome.py) -> result.json
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ablate import results
from ablate.point_claim import claimed
from ablate.console import Progress
from ablate.predict import Prediction
from ablate.schema import GROUPS, identity
from ablate.spec import RunSpec
from launch.local import SPEC, pass_on_stop, prestart
from launch.nvml import visible_gpu_count

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    """The commit the code ran at: the one ABLATE_GIT_SHA names when set (a copy of the tree shipped
    to a host that cannot reach the repository, whose .git may be missing, or stale: it would name
    an older commit than the one that ran), else git's, with '+dirty' when the work tree has
    changes; None outside git."""
    if os.environ.get("ABLATE_GIT_SHA"):
        return os.environ["ABLATE_GIT_SHA"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def job_env() -> dict:
    """Provenance the job knows without touching a device; the worker adds torch, CUDA and GPU."""
    slurm = os.environ.get("SLURM_ARRAY_JOB_ID")
    slurm = f"{slurm}_{os.environ['SLURM_ARRAY_TASK_ID']}" if slurm else os.environ.get("SLURM_JOB_ID")
    return {"hostname": socket.gethostname(), "git_sha": git_sha(), "slurm_job_id": slurm,
            "python": sys.version.split()[0]}


def resolve_alloc_conf(config: dict) -> None:
    """alloc_conf=null -> the PYTORCH_CUDA_ALLOC_CONF the worker would inherit, so that a row (and
    its run_id) says which allocator settings it was measured under."""
    if config["alloc_conf"] is None:
        config["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None


def resolve_nproc(config: dict) -> None:
    """parallel.nproc=auto -> every visible GPU, or 2 gloo processes where there is none (so a
    DDP/FSDP sweep runs anywhere). Written into the config: the run_id names the real count.
    device=cuda with no GPU in sight leaves it auto, for validate() to reject: 2 would be a guess
    at the cluster a user plans for (predict_only) and start ranks that cannot run (a real run)."""
    parallel = config["parallel"]
    if parallel["nproc"] == "auto":
        gpus = visible_gpu_count() if config["device"] != "cpu" else 0
        if gpus or config["device"] != "cuda":
            parallel["nproc"] = gpus or 2


@dataclass
class ResolvedPoint:
    """One grid point as the job and the launcher see it, before anything runs."""

    config: dict  # resolved, without the hydra node: what result.json records and run_id hashes
    spec: RunSpec  # the same, typed: what everything below the job reads
    choices: dict  # group -> option name
    overrides: list[str]
    run_id: str
    run_dir: Path
    label: str

    @classmethod
    def of(cls, cfg: DictConfig, hydra: DictConfig, run_dir: Path) -> "ResolvedPoint":
        if "hydra" in cfg:  # the launcher's sweep config: resolve the run config only
            cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        resolve_nproc(config)
        resolve_alloc_conf(config)
        rid = results.run_id(identity(config))
        choices = {g: hydra.runtime.choices.get(g) for g in GROUPS}
        return cls(config, RunSpec.of(config), choices, list(hydra.overrides.task), rid, run_dir,
                   hydra.job.override_dirname or "defaults")

    def record(self, status: str, reason: str | None, metrics: dict | None = None, env: dict | None = None,
               timing: dict | None = None, prediction: Prediction | None = None,
               artifacts: dict | None = None) -> dict:
        """Write this point's result.json (and its index entry); returns the result."""
        result = results.make(self.run_id, status, reason, self.choices, self.config, self.overrides,
                              metrics=metrics, env={**job_env(), **(env or {})}, timing=timing,
                              prediction=prediction.to_result() if prediction else None, artifacts=artifacts)
        self.write(result, index=True)
        return result

    def write(self, result: dict, index: bool) -> None:
        """result.json in the run directory (and, with `index`, the index entry that marks the point
        done). On a full disk the sweep stops (DiskFull) with the result kept on stdout."""
        path = self.run_dir / results.RESULT_FILE
        try:
            results.write_json(path, result)  # atomic: whole, or nothing left behind
            if index:
                results.Index(self.config["out_dir"]).record(self.run_id, path)
        except OSError as exc:
            if exc.errno not in results.NO_SPACE:
                raise
            # The measurement outlives the disk on stdout (the terminal, SLURM's .out file); unindexed,
            # the point runs again on the next try.
            print(f"result of {self.label}, not written: {json.dumps(result)}", flush=True)
            raise results.DiskFull(path.parent, f"no space left on device writing {path}") from None


def warn_unswept(hc: DictConfig) -> None:
    """An experiment that sweeps (rungs or params) run without -m is one point of it: say so."""
    from hydra.types import RunMode

    if hc.mode == RunMode.RUN and (hc.sweeper.get("rungs") or hc.sweeper.get("params")):
        print("note: this config defines a sweep (hydra.sweeper); without -m only its base point runs. "
              "Add -m to run them all.", file=sys.stderr)


def record_unlaunched(hydra_context, master_config: DictConfig, overrides: list[str], status: str,
                      reason: str) -> dict:
    """The row of a point that a launcher or sweeper ends without running its job (a SLURM job
    killed outside Python, a ladder point after an OOM): its config composed as the job's would be."""
    cfg = hydra_context.config_loader.load_sweep_config(master_config, list(overrides))
    run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return ResolvedPoint.of(cfg, cfg.hydra, run_dir).record(status, reason)


def link_artifacts(result: dict, old_dir: Path, new_dir: Path) -> None:
    """The files a result names, into new_dir beside its copy, so that the copy names them as the
    original does: hard links (the same out_dir, no second copy of a snapshot), else copies."""
    for name in filter(None, (result.get("artifacts") or {}).values()):
        src, dst = old_dir / name, new_dir / name
        if not src.is_file() or src.resolve() == dst.resolve():
            continue
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except FileExistsError:  # linked meanwhile by another process placing the same result
            if not os.path.samefile(src, dst):
                raise
        except OSError:  # another filesystem, or none that links
            shutil.copy2(src, dst)


def prestarted_outcome(spec: RunSpec, run_dir: Path, overrides: list[str], progress: Progress):
    """ablate/outcome.py's outcome of the point, its worker started first (launch/warm_start.py), unless
    the point before left one waiting: the worker imports while this process imports torch (for
    the prediction), validates and predicts. A point found done never imports torch here."""
    if not spec.predict_only:
        prestart(spec, run_dir / SPEC)
    from ablate import outcome

    return outcome.outcome_of(spec, run_dir, overrides, progress)


def first_node() -> bool:
    """Whether this task is a point's first node's (or the point's only one): every node of a
    multi-node point runs its job; the first node's claims the point and writes its row."""
    return int(os.environ.get("SLURM_PROCID", 0)) == 0


def run_point(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    warn_unswept(hc)
    point = ResolvedPoint.of(cfg, hc, Path(hc.runtime.output_dir))
    progress = Progress(point.label)
    # Claimed while it runs, by the first node's task only: every node of a multi-node point runs it.
    with claimed(results.Index(point.config["out_dir"]).claim_path(point.run_id), progress.note) if first_node() \
            else contextlib.nullcontext():
        result = run_claimed(point, progress)
    if result:  # before the next point's Hydra writes its files there (which would fail with a traceback)
        results.check_room(point.run_dir.parent)
    return result


def run_claimed(point: ResolvedPoint, progress: Progress) -> dict:
    """The point once it is this process's: skipped if done (perhaps by whoever held it before),
    else run and recorded."""
    result_path = point.run_dir / results.RESULT_FILE
    found = (results.Index(point.config["out_dir"]).terminal(point.run_id, warn=progress.note)
             if point.config["skip_existing"] else None)
    if found:
        path, result = found
        if not first_node():
            return {}  # multi-node: the first node's task places the row, as it writes a new one
        if path != result_path.resolve():  # this sweep's directory gets the earlier result too,
            # placed at this sweep's rung (a run key outside run_id: the same point in another ladder)
            # and says where it came from: the report marks a row measured elsewhere as reused
            result = {**result, "config": {**result["config"], "rung": point.config["rung"]},
                      "reused_from": str(path)}
            link_artifacts(result, path.parent, result_path.parent)
            point.write(result, index=False)
        progress.done(result, str(path), skipped=True)
        return result

    started, t0 = datetime.now(timezone.utc), time.monotonic()
    outcome, prediction = prestarted_outcome(point.spec, point.run_dir, point.overrides, progress)
    timing = {"started_at": started.isoformat(), "finished_at": datetime.now(timezone.utc).isoformat(),
              "wall_s": time.monotonic() - t0, "phases_s": outcome.phases or None}
    if not first_node():
        return {}  # multi-node: every node ran its ranks; the first node's task writes the row
    result = point.record(outcome.status, outcome.reason, outcome.metrics, outcome.env, timing, prediction,
                          results.find_artifacts(point.run_dir))
    progress.done(result, str(result_path))
    pass_on_stop(outcome)  # a sweep told to stop ends here, its row written, before the next point
    return result
