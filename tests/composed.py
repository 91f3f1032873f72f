"""conf/ composed by Hydra as `hydra.compose` composes it, with the choice of configs kept.

Hydra composes in two stages: the group overrides (`model=gpt2`, `+experiment=...`) choose the
config files, which are read and merged (some 180 ms on one core, most of it building the defaults
list, Hydra's own hydra/ groups included); then the value overrides (`batch_size=4`) are set on the
merged config (about 4 ms). The tests and the benchmarks compose close to a thousand override lists,
and about half of them choose configs another has chosen already: here each choice is merged once,
and a list's values are set on a copy of it by Hydra's own function for that second stage.

Anything the second stage cannot take as Hydra would (a sweep, a hydra/ override, a value Hydra
refuses) is composed by Hydra whole, so that its errors are Hydra's own."""
from __future__ import annotations

import functools
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from ablate.schema import register
from launch.compose_once import in_two_stages

CONF = Path(__file__).resolve().parent.parent / "conf"

register()  # the typed schema conf/config.yaml names, and its resolvers


def composed(overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The config `overrides` compose to, resolved, as plain data (a new one for each call)."""
    return _plain(in_two_stages(overrides, _chooses, _hydra, whole=lambda: _hydra(tuple(overrides))))


def _chooses(override) -> bool:
    """Whether `override` names a config group. Hydra takes a few of those as values too (a dict
    value): composed whole with the choices, they still come out as Hydra sets them."""
    return (CONF / override.key_or_group).is_dir()


@functools.lru_cache(maxsize=1024)
def _hydra(overrides: tuple[str, ...]) -> DictConfig:
    """Hydra's whole composition (kept: callers copy it before changing it)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
