"""optimizer=muon: torch's Muon for the decoder layers' matrices, AdamW for everything else."""
from __future__ import annotations

import math

import torch
from torch import nn

from ablate.techniques import Invalid, Plan
from ablate.techniques.optimizer import AdamW, Composite, TorchOptimizer, host_step_bytes

ADJUST_LR = (None, "original", "match_rms_adamw")  # torch's Muon's rules for scaling lr by a matrix's shape


class Muon(TorchOptimizer):
    """torch.optim.Muon on each 2-D weight of the repeated layers, whose update is the momentum
    orthogonalised by a few Newton-Schulz iterations; AdamW on the embeddings, the head, norms and
    biases, as Muon's authors prescribe (an orthogonal update suits a matrix mapping hidden states,
    not a lookup table or the logits).

    Saves: one momentum buffer per matrix (4 bytes/param in fp32) instead of AdamW's two (8).
    Spends: five Newton-Schulz iterations per matrix and step, each two matmuls over its shorter
    side (in bf16), and AdamW's 8 bytes/param for the rest (for an 8B Llama, the embedding and the
    head: 1 B parameters).

    Defaults are the authors' (Keller Jordan's GPT-2 speedrun): lr 0.02 with torch's "original"
    shape scaling, momentum 0.95 with Nesterov, 5 steps, no decay; AdamW's part takes
    `adamw_lr`. With `adjust_lr_fn: match_rms_adamw` (Moonshot's rule) the update is scaled to
    AdamW's RMS, so AdamW's own lr and decay serve both parts.
    """

    label = "Muon"

    def __init__(self, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None, weight_decay: float = 0.0, adamw_lr: float = 6e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_weight_decay: float = 0.1,
                 in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.momentum, self.nesterov, self.ns_steps, self.adjust_lr_fn = momentum, nesterov, ns_steps, adjust_lr_fn
        self.adamw = AdamW(lr=adamw_lr, betas=adamw_betas, weight_decay=adamw_weight_decay)

    def check(self, plan: Plan) -> None:
        if self.adjust_lr_fn not in ADJUST_LR:
            raise Invalid(f"optimizer.adjust_lr_fn={self.adjust_lr_fn!r} is not one of null, "
                          f"{', '.join(a for a in ADJUST_LR if a)}")
        super().check(plan)
        self.adamw.check_values()
        if plan.sharded:
            raise Invalid("optimizer=muon orthogonalises whole matrices, which FSDP shards "
                          "(parallel=fsdp, fsdp_grad_op, fsdp1 and offload=params) split across ranks: "
                          "use parallel=ddp or single")
        if plan.states_on_host:
            raise Invalid("optimizer=muon with offload=optimizer: torchao's CPUOffloadOptimizer builds one "
                          "optimizer class for every group, and Muon's matrices and AdamW's rest need two")

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.Muon

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov, "ns_steps": self.ns_steps,
                "adjust_lr_fn": self.adjust_lr_fn, "weight_decay": self.weight_decay}

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The layers' matrices (tagged `muon`), then AdamW's decayed (dim >= 2) and undecayed rest."""
        matrices, rest = self.layer_matrices(model)
        wd = self.adamw.weight_decay
        return [{"params": matrices, "weight_decay": self.weight_decay, "muon": True},
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd, "muon": False},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "muon": False}]

    def make(self, groups: list[dict]) -> torch.optim.Optimizer:
        muon = [g for g in groups if g["muon"] and g["params"]]
        adamw = [g for g in groups if not g["muon"] and g["params"]]
        optimizers = ([torch.optim.Muon(muon, **self.optimizer_kwargs())] if muon else []) + \
                     ([self.adamw.make(adamw)] if adamw else [])
        return optimizers[0] if len(optimizers) == 1 else Composite(optimizers)

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        if self.in_layers(name, shape):
            return math.prod(shape) * d  # momentum_buffer, zeros_like the gradient
        return 2 * math.prod(shape) * d + host_step_bytes(device)  # AdamW's

    def step_temp(self, groups: list[list[tuple]], d: int, device: str) -> float:
        """Each matrix is stepped alone (a for-loop; torch's Muon has no foreach form): the Nesterov
        update (its size, in the gradient's dtype) alive through the orthogonalisation, which holds
        two bf16 iterates of its size and two (k, k) bf16 Gram terms (k its shorter side); then
        AdamW's step over the rest."""
        def muon_temp(shape: tuple) -> float:
            rows, cols = shape
            return rows * cols * ((d if self.nesterov else 0) + 2 * 2) + 2 * min(rows, cols) ** 2 * 2
        muon = [s for g, tag in zip(groups, self._tags(groups)) if tag for s in g]
        rest = [g for g, tag in zip(groups, self._tags(groups)) if not tag]
        return max([muon_temp(s) for s in muon] + [self.adamw.step_temp(rest, d, device) if any(rest) else 0.0])

    @staticmethod
    def _tags(groups: list[list[tuple]]) -> list[bool]:
        """Which of `param_groups`' groups are Muon's: the first of three."""
        return [i == 0 for i in range(len(groups))]
