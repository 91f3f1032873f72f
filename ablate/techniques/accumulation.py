"""accumulation group: split the effective batch into micro-batches, one backward each."""
from __future__ import annotations

import torch

from ablate.techniques import Invalid, Option, Plan


class Accumulation(Option):
    """Run `steps` micro-batches of batch_size / steps samples before each optimizer step.

    Spends: `steps` forward/backward launches per optimizer step. Saves: activations scale with the
    micro-batch, so activation memory drops by about `steps`x. steps=1 is the do-nothing option.
    """

    def __init__(self, steps: int = 1):
        self.steps = steps

    @property
    def label(self) -> str:  # the report writes the micro-batch split beside it, from the row's batch size
        return f"Gradient accumulation ({self.steps} steps)" if self.steps > 1 else "No gradient accumulation"

    def check(self, plan: Plan) -> None:
        if self.steps < 1:
            raise Invalid(f"accumulation.steps={self.steps} must be >= 1")
        if plan.batch_size % self.steps:
            raise Invalid(f"batch_size={plan.batch_size} is not divisible by accumulation.steps={self.steps}")

    def split(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(B, T) inputs and targets -> `steps` pairs of (B / steps, T)."""
        return list(zip(x.chunk(self.steps), y.chunk(self.steps)))
