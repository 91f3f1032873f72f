"""parallel group: how many processes train, and how model state is replicated or sharded."""
from __future__ import annotations

import contextlib

from torch import nn

from ablate.techniques import Option


class Single(Option):
    """One process on one device: the whole model, its gradients and optimizer states on it."""

    nproc = 1
    shards_params = False  # parameters are whole on every rank

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Wraps forward + backward of a micro-step; gradient all-reduce only where it is the last."""
        return contextlib.nullcontext()
