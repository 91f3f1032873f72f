"""A sweep's config loader that composes each point once (the default launcher's, gpu_pool)."""
from __future__ import annotations

import copy
from typing import Any


class ComposeOnce:
    """The sweep's config loader, composing each point once. Hydra composes every point twice: the
    sweeper first checks that each point of a batch composes, so that a bad one stops the sweep
    before any runs, then the launcher composes the point it starts. A composition is close to
    half of a planned point's time (the YAML of some 27 config files read and merged), so the
    launcher's takes a copy the check kept. A pickled launcher (a pool's job, in a process of its
    own) keeps none: it composes its one point."""

    HELD = 512  # points kept at once; a longer batch composes the rest twice, as Hydra does

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._held: dict = {}

    def load_sweep_config(self, master_config: Any, sweep_overrides: list[str]) -> Any:
        key = (id(master_config), tuple(sweep_overrides))
        if key in self._held:
            return self._held.pop(key)
        config = self._loader.load_sweep_config(master_config, sweep_overrides)
        if len(self._held) < self.HELD:  # a copy: the caller may change its own (the job's number)
            self._held[key] = copy.deepcopy(config)
        return config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unpickling looks for hooks before _loader is set
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __getstate__(self) -> dict:
        return {"_loader": self._loader, "_held": {}}
