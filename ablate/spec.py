"""One grid point, typed: what the entry point makes of the resolved Hydra config and hands down.

Only the entry point (ablate/job.py) touches the Hydra config. It turns the resolved config into a
`RunSpec` once; the checks, the predictors, the batch search and the worker read its typed fields
and build the options from its `groups` (each group's option node, `_target_` included, as Hydra
composed it). `to_config()` gives the resolved config back, for result.json and the worker's
spec.json, so a point is the same point on both sides of a process boundary.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ablate.schema import GROUPS


@dataclass(frozen=True)
class RunSpec:
    """The run keys of ablate/schema.py's Config, typed, and every group's option node."""

    groups: dict[str, dict]  # group -> its option node (plain data, `_target_` included)
    batch_size: int  # samples per optimizer step per rank
    seq_len: int
    steps: int
    warmup_steps: int
    eval_steps: int
    samples: int | None
    seed: int
    compile: bool
    device: str  # auto | cpu | cuda
    peak_tflops: float | None
    timeout_s: float
    alloc_conf: str | None
    predict: str  # analytic | trace | none
    predict_only: bool
    gpu_memory_gib: float | None
    prune: bool
    prune_margin: float
    find_batch: bool
    find_seq: bool = False  # a config written before the length search has no such key
    extra: dict[str, Any] = field(default_factory=dict)  # keys only the job reads: out_dir, skip_existing, rung

    @classmethod
    def of(cls, config: dict) -> "RunSpec":
        """From a resolved config (enums as strings)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"groups", "extra"}
        return cls(groups={g: copy.deepcopy(config[g]) for g in GROUPS},
                   **{k: config[k] for k in names if k in config},  # a defaulted key may be absent
                   extra={k: v for k, v in config.items() if k not in names and k not in GROUPS})

    def to_config(self) -> dict:
        """The resolved config this spec was made from (with any change made since)."""
        run = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("groups", "extra")}
        return {**copy.deepcopy(self.groups), **run, **self.extra}

    def replace(self, **changes) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    def with_micro_batch(self, micro: int, steps: int | None = None) -> "RunSpec":
        """This point training its batch_size in micro-batches of `micro` (accumulation raised to
        match, so the effective batch and its loss curve stay), not searching again; `steps`
        replaces steps (and samples) for a short probe."""
        groups = copy.deepcopy(self.groups)
        groups["accumulation"]["steps"] = self.batch_size // micro
        more = {"steps": steps, "samples": None} if steps else {}
        return self.replace(groups=groups, find_batch=False, **more)
