"""checkpoint group: which activations are recomputed in backward instead of stored."""
from __future__ import annotations

from torch import nn

from ablate.techniques import Option


class NoCheckpoint(Option):
    """Store every activation for backward: fastest, most activation memory."""

    recompute_fraction = 0.0  # share of the forward pass run again in backward (for HFU)

    def apply(self, model: nn.Module) -> nn.Module:
        return model
