"""optimizer=adafactor: torch's Adafactor, whose factored second moment keeps a row and a column
vector per matrix instead of AdamW's two full states."""
from __future__ import annotations

import math

import torch

from ablate.techniques import Invalid, Plan
from ablate.techniques.optimizer import TorchOptimizer, for_loop_temp_bytes, host_step_bytes


class Adafactor(TorchOptimizer):
    """torch.optim.Adafactor: no first moment, and the second moment of an (n, m) matrix factored
    into a row and a column vector. Spends 4·(n+m) bytes per matrix (about 0 bytes/param for large
    ones) and 4 bytes/param for vectors; saves nearly all of AdamW's 8 bytes/param.
    Its lr is a relative step cap (step = min(lr, 1/sqrt(t)) × the parameter's RMS), and weight
    decay multiplies weights by (1 - lr·weight_decay) per step."""

    label = "Adafactor"

    def __init__(self, lr: float = 1e-2, beta2_decay: float = -0.8, d: float = 1.0, weight_decay: float = 0.0,
                 in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.beta2_decay, self.d = beta2_decay, d

    def check(self, plan: Plan) -> None:
        super().check(plan)
        # Its factoring needs each matrix whole. FSDP2's DTensor shards fail in step() (the column
        # variance squares a partial norm in place: aten.pow_ on _NormPartial); FSDP1 hands it flat
        # 1-D shards, so it runs but keeps an unfactored second moment and takes per-shard RMS:
        # another optimizer (its losses part from DDP's from the second step).
        if plan.sharded:
            raise Invalid("optimizer=adafactor needs whole parameters: parallel=fsdp/fsdp_grad_op (FSDP2) "
                          "fail on its in-place pow_ of a sharded norm, and parallel=fsdp1 gives it flat "
                          "1-D shards it cannot factor; use parallel=ddp (or fsdp1 with sharding=no_shard)")

    reads_values = True

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        if len(shape) < 2:
            return math.prod(shape) * d + host_step_bytes(device)
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return (rows + cols) * d + host_step_bytes(device)

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        return for_loop_temp_bytes(groups, d, 1)  # the row x col variance estimate, scaled in place

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.Adafactor

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "beta2_decay": self.beta2_decay, "d": self.d, "weight_decay": self.weight_decay}
