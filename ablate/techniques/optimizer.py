"""optimizer group: which torch optimizer updates the weights, and so how much state it keeps."""
from __future__ import annotations

import torch
from torch import nn

from ablate.techniques import Option


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2), never biases or LayerNorm gains (GPT-2 practice)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class AdamW(Option):
    """Adam with decoupled weight decay; PyTorch picks its default (foreach) implementation.

    Spends two fp32 states per parameter (exp_avg, exp_avg_sq): 8 bytes/param.
    """

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1):
        self.lr, self.betas, self.weight_decay = lr, tuple(betas), weight_decay

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(model, self.weight_decay), lr=self.lr, betas=self.betas)


class SGD(Option):
    """Plain SGD: no state at momentum 0; one momentum buffer (4 bytes/param in fp32) otherwise."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0):
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups(model, self.weight_decay), lr=self.lr, momentum=self.momentum)
