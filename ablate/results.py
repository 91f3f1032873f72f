"""result.json: the contract between a run and analysis/ (docs/architecture.md, "The result contract").

Every field is present in every file; what could not be measured is null. Files are written
atomically, so a reader never sees half a result.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

# Writing files that survive a full disk lives in ablate/disk.py, the point's identity in
# ablate/run_identity.py; results.write_json, results.run_id and the rest stay reachable here.
from ablate.disk import MIN_FREE_KIB, NO_SPACE, DiskFull, check_room, clear_path, free_kib, write_json  # noqa: F401
from ablate.run_identity import (INPUT_KEYS, MODULE_KEYS, SMALL_FILE, fingerprint, input_paths,  # noqa: F401
                                 module_source, run_id)

SCHEMA = "ablate.result/1"
RESULT_FILE = "result.json"
# predicted: predict_only=true. diverged: trained and measured, but its loss went non-finite (NaN or
# inf): its memory and time are measurements, its losses are not, so it is no one's baseline.
STATUSES = ("ok", "oom", "invalid", "error", "timeout", "predicted", "diverged")
# Outcomes that a rerun would repeat: skip_existing skips them (a diverged run diverges again). error and timeout may be transient
# (a node failure, a busy machine), so they run again; so do predictions (status "predicted", and an
# oom whose reason starts with PRUNED), which a later run without predict_only/prune must measure,
# and points a ladder skipped after a smaller one ran out of memory (NOT_RUN). So does `invalid`:
# its reason may be the host's or a file's (a package not installed, no GPU, a missing config.json,
# a bad value of a key outside the run_id such as timeout_s), which the user can mend, and checking
# again costs no training.
TERMINAL = ("ok", "oom", "diverged")
MEASURED = ("ok", "diverged")  # outcomes whose memory and time were measured in full
PRUNED = "predicted:"
NOT_RUN = "not run:"
# An error that measured nothing of the point (the host refused memory under a limit of this
# process): its batch search stops there, instead of reading it as "does not fit".
UNMEASURED = "not measured:"

METRIC_KEYS = (
    "peak_allocated_mib", "peak_reserved_mib", "peak_active_mib", "nvml_peak_mib", "host_peak_rss_mib",
    "init_peak_allocated_mib", "peak_allocated_by_phase_mib", "breakdown_mib", "iter_time_ms", "iter_time_ms_p10",
    "iter_time_ms_p90",
    "train_latency_s", "tokens_per_s", "samples_per_s", "tflops", "mfu", "hfu", "gpu_util_pct_mean",
    "gpu_util_pct_std", "compile_s", "skipped_steps", "traced_step_oom", "diverged_at_step", "loss_scale", "loss_first", "loss_final", "eval_loss", "loss_floor",
    "losses", "per_rank", "max_batch_size", "predicted_max_batch_size", "find_batch", "max_seq_len",
    "predicted_max_seq_len", "find_seq", "params", "trainable_params",
)
# Files a worker leaves beside result.json (ablate/artifacts.py), by the key that names them under
# "artifacts": each the file's path relative to result.json's directory, or null when not written.
ARTIFACTS = {"memory_by_module": "memory_by_module.csv",  # the traced step, per module (any device)
             "memory_snapshot": "memory_snapshot.pickle",  # CUDA allocator history of the traced (or compiled) step
             "oom_snapshot": "oom_snapshot.pickle"}  # CUDA allocator state at an OOM
ENV_KEYS = ("torch", "cuda", "gpu_name", "gpu_total_mib", "emulated_gpu_mib", "driver", "world_size", "hostname",
            "git_sha", "python", "slurm_job_id", "cuda_visible_devices", "cpus", "cpu_threads")


def make(run_id: str, status: str, reason: str | None, choices: dict, config: dict, overrides: list,
         metrics: dict | None = None, env: dict | None = None, prediction: dict | None = None,
         timing: dict | None = None, artifacts: dict | None = None) -> dict:
    """A complete result: every contract key present, unknown values null."""
    assert status in STATUSES, status
    metrics, env, artifacts = metrics or {}, env or {}, artifacts or {}
    return finite({
        "schema": SCHEMA,
        "run_id": run_id,
        "status": status,
        "reason": reason,
        "choices": choices,
        "config": config,
        "overrides": overrides,
        "metrics": {k: metrics.get(k) for k in METRIC_KEYS},
        "prediction": prediction or {"peak_mib": None, "breakdown_mib": None, "method": None, "step_time_s": None},
        "env": {k: env.get(k) for k in ENV_KEYS},
        "timing": {"started_at": None, "finished_at": None, "wall_s": None, "phases_s": None, **(timing or {})},
        "artifacts": {k: artifacts.get(k) for k in ARTIFACTS},
    })


def finite(value, keep=("config", "overrides")):
    """`value` with every NaN and inf made JSON's null, so that a row can always be written (JSON has
    neither); under the `keep` keys (what the user asked for) as the text typed ("inf"), not null,
    which would read as "not set"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _typed(v) if k in keep else finite(v, keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, keep) for v in value]
    return value


def _typed(value):
    """As `finite`, keeping a non-finite number as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_typed(v) for v in value]
    return value


def find_artifacts(run_dir: str | Path) -> dict:
    """The ARTIFACTS a worker left in run_dir, as result.json names them (null: not written).
    An OOM on rank r > 0 alone leaves oom_snapshot.rank<r>.pickle: the lowest rank's is named."""
    run_dir = Path(run_dir)
    found = {k: name if (run_dir / name).is_file() else None for k, name in ARTIFACTS.items()}
    if found["oom_snapshot"] is None:
        found["oom_snapshot"] = next((p.name for p in sorted(run_dir.glob("oom_snapshot.rank*.pickle"),
                                                                key=lambda p: len(p.name))), None)
    return found


def artifact_paths(run_dir: str | Path) -> list[Path]:
    """Where a worker's artifacts go in run_dir: ARTIFACTS' files (written or not) and the per-rank
    OOM snapshots it left."""
    run_dir = Path(run_dir)
    return [*(run_dir / name for name in ARTIFACTS.values()), *sorted(run_dir.glob("oom_snapshot.rank*.pickle"))]


def clear_artifacts(run_dir: str | Path) -> None:
    """Before a worker starts in run_dir: an earlier run's files must not pass for this one's."""
    for path in artifact_paths(run_dir):
        path.unlink(missing_ok=True)


# The contract's sections and their JSON types. `artifacts` came later under the same schema
# version, so an older file without it is still a result; a file missing any of these is not.
SECTIONS = {"run_id": str, "status": str, "choices": dict, "config": dict, "overrides": list,
            "metrics": dict, "prediction": dict, "env": dict, "timing": dict}
WHOLE_KEYS = ("batch_size",)  # config keys every report table counts by: whole numbers >= 1
_NUMBER = (int, float)
# traced_step_oom true: the traced step's OOM (no breakdown), not training's
_STRUCTURED = {"breakdown_mib": dict, "peak_allocated_by_phase_mib": dict, "losses": list, "per_rank": list,
               "find_batch": list, "find_seq": list, "traced_step_oom": bool}
# Times and throughputs, which like every size (a `*_mib` figure) a measurement never makes negative;
# one that is would become the baseline of the report's deltas. Losses may be anything finite.
_AT_LEAST_ZERO = ("iter_time_ms", "iter_time_ms_p10", "iter_time_ms_p90", "train_latency_s", "compile_s",
                  "tokens_per_s", "samples_per_s", "tflops", "mfu", "hfu")
COUNTS = ("params", "trainable_params")  # parameter elements, all and those that train: never negative either
_INF = float("inf")


def problem(obj) -> str | None:
    """Why `obj` is not a result this contract promises (None: it is one). The one check the job
    (is a point done?) and the report (is it a row?) both apply: a file that parses but lacks a
    field is treated like a corrupt one, not trusted half-way. So is one holding what the writer
    never writes (a NaN or inf, a negative size or time, a list where an option name goes): as a
    row it would crash the report or become the baseline of its deltas."""
    if not isinstance(obj, dict):
        return f"not a JSON object but a {type(obj).__name__}"
    if obj.get("schema") != SCHEMA:
        return f"schema is {obj.get('schema')!r}, not {SCHEMA!r}"
    missing = [k for k in (*SECTIONS, "reason") if k not in obj]
    if missing:
        return "missing " + ", ".join(missing)
    wrong = [k for k, kind in SECTIONS.items() if not isinstance(obj[k], kind)]
    if wrong:
        return ", ".join(f"{k} is a {type(obj[k]).__name__}, not a {SECTIONS[k].__name__}" for k in wrong)
    if obj["status"] not in STATUSES:
        return f"status {obj['status']!r} is not one of {', '.join(STATUSES)}"
    if not isinstance(obj["reason"], (str, type(None))):
        return f"reason is a {type(obj['reason']).__name__}, not a string"
    bad = [k for k in WHOLE_KEYS if not isinstance(obj["config"].get(k), int) or isinstance(obj["config"][k], bool)]
    if bad:
        return "config." + ", config.".join(bad) + " missing or not a whole number"
    small = [k for k in WHOLE_KEYS if obj["config"][k] < 1]
    if small:
        return ", ".join(f"config.{k} is {obj['config'][k]}, not a whole number >= 1" for k in small)
    odd = [k for k, v in obj["choices"].items() if not isinstance(v, (str, type(None)))]
    if odd:  # the job writes each group's option name (null: a group the run's config lacks)
        return ", ".join(f"choices.{k} is a {type(obj['choices'][k]).__name__}, not an option name or null"
                         for k in odd)
    metrics = obj["metrics"]
    for key, value in metrics.items():
        kind = _STRUCTURED.get(key, _NUMBER)
        if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
            return f"metrics.{key} is {value!r}, not a {'number' if kind is _NUMBER else kind.__name__} or null"
    where = _not_finite(obj)
    if where is not None:
        return f"{where[1:]} is not a finite number (JSON's NaN or Infinity, or beyond a float's range)"
    return _negative(metrics, obj["prediction"])


def _not_finite(value) -> str | None:
    """Where in `value` a number is NaN or infinite (".metrics.losses[3]"; "" for `value` itself), or
    None. Python's json reads the NaN and Infinity tokens, and turns a literal beyond a float's range
    (1e400) into inf; ablate's writer (allow_nan=False) never writes either."""
    if isinstance(value, float):
        return None if -_INF < value < _INF else ""  # False for NaN too
    if isinstance(value, list):
        try:  # a list of numbers (losses) at C speed: a NaN or inf makes the sum one
            if -_INF < sum(value) < _INF:
                return None
        except TypeError:  # nulls, strings, mappings: item by item
            pass
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = _not_finite(item)
        if where is not None:
            return (f"[{key}]" if isinstance(value, list) else f".{key}") + where
    return None


def _negative(metrics: dict, prediction: dict) -> str | None:
    """The first size (a `*_mib` figure: each part of breakdown_mib, each rank's, the predicted peak),
    time or throughput (_AT_LEAST_ZERO) or parameter count (COUNTS) below 0, or None. The predicted
    breakdown is left out: it is the predictor's split of its peak, whose parts it keeps no floor
    under (Timeline.free)."""
    places = [("metrics", metrics, False), ("metrics.breakdown_mib", metrics.get("breakdown_mib") or {}, True),
              ("metrics.peak_allocated_by_phase_mib", metrics.get("peak_allocated_by_phase_mib") or {}, True),
              ("prediction", {"peak_mib": prediction.get("peak_mib")}, True)]
    places += [(f"metrics.per_rank[{i}]", rank, False) for i, rank in enumerate(metrics.get("per_rank") or ())
               if isinstance(rank, dict)]
    for where, values, sizes in places:  # sizes: every number there is one
        for key, value in values.items():
            if isinstance(value, _NUMBER) and value < 0:
                size = sizes or key.endswith("_mib")
                if size or key in _AT_LEAST_ZERO or key in COUNTS:
                    kind = "size" if size else "count" if key in COUNTS else "time or throughput"
                    return f"{where}.{key} is {value!r}, not a {kind} >= 0"
    return None


def load(path: str | Path) -> tuple[dict | None, str | None]:
    """(result, None) for a result this contract promises; (None, why not) for anything else: a
    file missing or unreadable, not JSON, foreign, or lacking a field."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        return None, exc.strerror or str(exc)
    except ValueError as exc:  # UnicodeDecodeError included
        return None, f"not JSON ({exc})"
    why = problem(obj)
    return (None, why) if why else (obj, None)


def read(path: str | Path) -> dict | None:
    """A result of this contract, or None if the file is missing, unreadable, foreign or incomplete."""
    return load(path)[0]


def predicted_oom(result) -> bool:
    """An oom that never ran: its prediction did not fit (prune, or a plan with a capacity).
    `result` is a result dict or a report row (anything with .get)."""
    return result.get("status") == "oom" and str(result.get("reason") or "").startswith(PRUNED)


def not_run(result) -> bool:
    """An oom a ladder recorded without running it, because a smaller point ran out of memory first
    (hydra.sweeper.stop_after_oom): nothing was measured, not even an OOM. Dict or report row."""
    return result.get("status") == "oom" and str(result.get("reason") or "").startswith(NOT_RUN)


def is_terminal(result: dict) -> bool:
    """A measured outcome that a rerun would repeat (not a prediction, not a transient failure)."""
    return result.get("status") in TERMINAL and not predicted_oom(result) and not not_run(result)


class Index:
    """<out_dir>/index/<run_id>: the path of the newest result.json of each run_id.

    Lets a new sweep find finished points of earlier sweeps in O(1) instead of scanning outputs/.
    One small file per run_id, so concurrent SLURM array tasks never write the same file.
    """

    def __init__(self, out_dir: str | Path):
        self.root = Path(out_dir) / "index"

    def claim_path(self, run_id: str) -> Path:
        """The lock a point is claimed by while it runs (ablate/point_claim.py)."""
        return self.root / f"{run_id}.claim"

    def record(self, run_id: str, result_path: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{run_id}.{os.getpid()}.tmp"
        try:
            tmp.write_text(str(Path(result_path).resolve()))
            clear_path(self.root / run_id)  # a directory in its place: os.replace cannot replace one
            os.replace(tmp, self.root / run_id)
        except BaseException:  # a full disk: no temporary left behind
            tmp.unlink(missing_ok=True)
            raise

    def terminal(self, run_id: str, warn=lambda line: None) -> tuple[Path, dict] | None:
        """The recorded result of run_id if it still exists, is a result by the contract and is
        terminal. A recorded file that is not one (corrupt, truncated, missing fields) is named
        through `warn` with the reason: its point runs again."""
        entry = self.root / run_id
        if not entry.exists() and not entry.is_symlink():  # never recorded
            return None
        try:
            path = Path(entry.read_text(encoding="utf-8").strip())
            if not path.is_absolute() or "\0" in str(path):  # record() writes an absolute path
                raise ValueError(f"not a path to a result: {str(path)[:80]!r}")
        except (OSError, ValueError) as exc:  # a directory, unreadable, not text: mended, not fatal
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:120]
            warn(f"note: the index entry {entry} is not one ({why}): running its point again, "
                 "which replaces it")
            clear_path(entry)
            return None
        if not path.exists():
            return None
        result, why = load(path)
        if result is None:
            warn(f"note: {path} is not a result ({why}): running its point again")
            return None
        if result["run_id"] == run_id and is_terminal(result):
            return path, result
        return None
