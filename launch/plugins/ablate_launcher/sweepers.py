"""The ladder sweeper: an ordered list of override sets ("rungs"), not a Cartesian grid.

Published memory studies are ladders: "baseline; + gradient accumulation; + block recompute; +
for-loop AdamW", each rung keeping everything above it. Hydra's basic sweeper can only multiply
lists, so `hydra/sweeper=ladder` (conf/hydra/sweeper/ladder.yaml) adds one list of rungs:

    hydra:
      sweeper:
        cumulative: true            # false: every rung is applied to the base config on its own
        rungs:
          - {batch_size: 32}
          - {accumulation: x4}      # + accumulation, still batch 32
          - {checkpoint: block}     # + accumulation + block recompute
          - {batch_size: "8,16,32"} # a rung may sweep: one point per value, in this order

A rung is a mapping of override key -> value, the same syntax as `hydra.sweeper.params`. The
command line (and `params`) still forms a grid, and every point of that grid runs the whole
ladder; where the command line and a rung set the same key, the command line wins. Each job gets
`rung=<index>` (a run key left out of run_id), which the report's `--ladder` orders rows by.
`stop_after_oom: true` ends a rung's own sweep at its first OOM (see `sweep`). `only: [4, 5]` runs
just those rungs, each as it is in the whole ladder (a cumulative rung keeps the rungs above it) and
under its own index: a long ladder measured in parts, or the rows that matter first.
Lives in `hydra_plugins.ablate_launcher` because Hydra takes sweeper classes from that namespace only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobStatus
from omegaconf import DictConfig, ListConfig, OmegaConf


def _override_value(value: Any) -> str:
    """A YAML value as Hydra's override grammar writes it: [a,b] for lists, true/false, null."""
    if value is None:
        return "null"
    if isinstance(value, (list, ListConfig)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _by_key(overrides: List[str]) -> dict:
    """key -> "key=value" for the sweeper's expanded overrides (keys never contain '=')."""
    return {text.split("=", 1)[0]: text for text in overrides}


class LadderSweeper(BasicSweeper):
    def __init__(self, rungs: Optional[List[Any]] = None, cumulative: bool = True, stop_after_oom: bool = False,
                 max_batch_size: Optional[int] = None, params: Optional[dict] = None,
                 only: Optional[List[int]] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        rungs = OmegaConf.to_container(rungs) if isinstance(rungs, (DictConfig, ListConfig)) else rungs
        if not rungs:
            raise ValueError("hydra/sweeper=ladder needs hydra.sweeper.rungs: a list of {key: value} mappings")
        for i, rung in enumerate(rungs):
            if not isinstance(rung, dict):
                raise ValueError(f"hydra.sweeper.rungs[{i}] = {rung!r}: each rung is a mapping of key: value")
        self.rungs = [{str(k): _override_value(v) for k, v in rung.items()} for rung in rungs]
        self.cumulative, self.stop_after_oom = cumulative, stop_after_oom
        only = OmegaConf.to_container(only) if isinstance(only, ListConfig) else only
        if only is not None and (not isinstance(only, list) or not only or
                                 not all(type(i) is int and 0 <= i < len(rungs) for i in only)):
            raise ValueError(f"hydra.sweeper.only={only!r}: a list of rung indices, each from 0 to {len(rungs) - 1} "
                             f"(hydra.sweeper.rungs has {len(rungs)} rungs)")
        self.only = None if only is None else set(only)

    def settings(self) -> Iterator[dict]:
        """Each rung's overrides (key -> value): with everything above it when cumulative."""
        above: dict = {}
        for rung in self.rungs:
            above = {**above, **rung} if self.cumulative else rung
            yield above

    def ladder(self, overrides: List[Override]) -> List[List[List[str]]]:
        """The jobs, one list per rung per point of the `overrides` grid (a rung's own sweep in order)."""
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        groups = []
        for point in BasicSweeper.split_arguments(overrides, None)[0]:
            for index, setting in enumerate(self.settings()):
                if self.only is not None and index not in self.only:
                    continue
                rung = parser.parse_overrides([f"{k}={v}" for k, v in setting.items()])
                groups.append([[*{**_by_key(combo), **_by_key(point)}.values(), f"rung={index}"]  # command line wins
                               for combo in BasicSweeper.split_arguments(rung, None)[0]])
        return groups

    def split_arguments(self, overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        """BasicSweeper.sweep's one hook: every job of the ladder, in batches for the launcher."""
        jobs = [job for group in self.ladder(overrides) for job in group]
        return list(self.split_overrides_to_chunks(jobs, max_batch_size))

    def sweep(self, arguments: List[str]) -> Any:
        """With stop_after_oom, one job at a time: once a point of a rung's sweep runs out of memory
        (or is pruned as predicted to), the rest of that sweep is recorded as oom, not run. Its
        values must therefore grow in memory (batch sizes in increasing order)."""
        if not self.stop_after_oom:
            return super().sweep(arguments)
        assert self.hydra_context is not None and self.config is not None and self.launcher is not None
        from ablate.job import record_unlaunched
        from ablate.results import NOT_RUN, predicted_oom

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        groups = self.ladder(parser.parse_overrides([*self._parse_config(), *arguments]))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, launched = [], 0
        for group in groups:
            cause = None  # "batch_size=7 ran out of memory": the first out-of-memory point, by what sets it apart
            for job in group:
                if cause:
                    reason = f"{NOT_RUN} {cause} before it (hydra.sweeper.stop_after_oom)"
                    record_unlaunched(self.hydra_context, self.config, job, "oom", reason)
                    continue
                self.validate_batch_is_legal([job])
                (ret,) = self.launcher.launch([job], initial_job_idx=launched)
                launched += 1
                returns.append(ret)
                # a FAILED job's return_value raises its exception: it did not run out of memory
                result = (ret.return_value or {}) if ret.status == JobStatus.COMPLETED else {}
                if result.get("status") == "oom":
                    cause = " ".join(o for o in job if any(o not in other for other in group)) + (
                        " was predicted to run out of memory" if predicted_oom(result) else " ran out of memory")
        return [returns]
