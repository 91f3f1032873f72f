"""A sweep's config loader that reads and merges each choice of config files once (the default
launcher's, gpu_pool).

Hydra composes a point in two stages: its group overrides (`model=gpt2`, `optimizer=adamw`)
choose the config files, which are read and merged (the defaults list and the merge: some 95% of
a composition, a few hundred ms); then its value overrides (`batch_size=4`) are set on the merged
config, in a few ms. A sweep's points share their choices more often than not (a grid over
`gpu_memory_gib`, `batch_size` or `seed` chooses the same files at every value), and Hydra composes
every point twice besides: its sweeper checks that each point of a batch composes, so that a bad
one stops the sweep before any runs, and the launcher composes it again to start it. Here the
first stage is done once for each choice and kept; each point is a copy of it with the second
stage applied by Hydra's own function, and the `hydra` node's record of the point's overrides set
as Hydra sets it. A point that this cannot take as Hydra would (a sweep or `hydra.` override of
its own, a line Hydra refuses) is composed by Hydra whole, so that its errors are Hydra's own."""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

# Hydra's two stages have no public names: ConfigLoaderImpl applies a composition's value overrides
# with this function and records them with the other; tests/test_compose_once.py and
# tests/test_composed.py hold what is composed here to Hydra's whole compositions.
from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname


def in_two_stages(lines: Sequence[str], chooses: Callable[[Any], bool], merged: Callable[[tuple], Any],
                  whole: Callable[[], Any], record: Callable[[Any, list], None] = lambda config, parsed: None) -> Any:
    """The config `lines` compose to: a copy of `merged(choices)` (the lines that name a config
    group, in their order) with the other lines set on it by Hydra, and `record(config, parsed)`
    done. A line this cannot take as Hydra would (a sweep, a `hydra.` override, one Hydra refuses)
    leaves the composition to `whole()`, Hydra's own, so that its errors are Hydra's."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(lines))
    except Exception:  # noqa: BLE001 - Hydra's whole composition words the error
        return whole()
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):
        return whole()
    try:
        picks = [chooses(o) for o in parsed]
        config = copy.deepcopy(merged(tuple(o.input_line for o, c in zip(parsed, picks) if c)))
        ConfigLoaderImpl._apply_overrides_to_config([o for o, c in zip(parsed, picks) if not c], config)
        record(config, parsed)
        return config
    except Exception:  # noqa: BLE001 - composed whole, the error is worded as Hydra words it
        return whole()


class ComposeOnce:
    """The sweep's config loader, merging each choice of config files once (module docstring). A
    pickled launcher (a pool's job, in a process of its own) keeps nothing: it composes its one
    point."""

    HELD = 512  # choices kept at once, the least recently used let go; one is about a config's size

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._master: Any = None  # the sweep whose choices are held
        self._repo: Any = None  # its config repository, which says what names a config group
        self._held: dict = {}

    def load_sweep_config(self, master_config: Any, sweep_overrides: list[str]) -> Any:
        if master_config is not self._master:
            self._master, self._repo, self._held = master_config, None, {}
        return in_two_stages(sweep_overrides, self._chooses, self._merged, record=self._record,
                             whole=lambda: self._loader.load_sweep_config(master_config, sweep_overrides))

    @staticmethod
    def _record(config: Any, parsed: list) -> None:
        """The `hydra` node's record of the point's overrides, as Hydra's whole composition sets it."""
        job = config.hydra.job
        with open_dict(config.hydra):
            config.hydra.overrides.task = [o.input_line for o in parsed]
            job.override_dirname = get_overrides_dirname(
                overrides=parsed, kv_sep=job.config.override_dirname.kv_sep,
                item_sep=job.config.override_dirname.item_sep,
                exclude_keys=job.config.override_dirname.exclude_keys)

    def _chooses(self, override: Any) -> bool:
        """Whether `override` names a config group, on the repository Hydra composes this sweep's
        points from. Hydra takes a group given a dict as a value: as a choice here it is merged by
        Hydra whole, the same either way."""
        if self._repo is None:
            hydra_lines = list(OmegaConf.to_container(self._master.hydra.overrides.hydra))
            _, self._repo = self._loader._parse_overrides_and_create_caching_repo(
                self._master.hydra.job.config_name, hydra_lines)
        return self._repo.group_exists(override.key_or_group)

    def _merged(self, choices: tuple[str, ...]) -> Any:
        """Hydra's whole composition of `choices` (kept: callers copy it before changing it)."""
        if choices in self._held:
            self._held[choices] = self._held.pop(choices)  # the most recently used last
        else:
            while len(self._held) >= self.HELD:
                del self._held[next(iter(self._held))]
            self._held[choices] = self._loader.load_sweep_config(self._master, list(choices))
        return self._held[choices]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unpickling looks for hooks before _loader is set
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __getstate__(self) -> dict:
        return {"_loader": self._loader, "_master": None, "_repo": None, "_held": {}}
