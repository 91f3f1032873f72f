"""The train loop. It names no technique: it calls the built options' shared interface."""
from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from ablate.build import Techniques
from ablate.data import Batch, TokenData


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               t: Techniques, batch: Batch, device: torch.device) -> torch.Tensor:
    """One optimizer step on a (B, T) batch; returns its mean loss as a detached 0-d tensor."""
    x, y = (b.to(device, non_blocking=True) for b in batch)
    micro = t.accumulation.split(x, y)
    total = torch.zeros((), device=device)
    for i, (xb, yb) in enumerate(micro):
        # The attention kernel for forward and backward both: a recompute in backward runs the same one.
        with t.parallel.sync(model, last_micro_step=i == len(micro) - 1), t.attention.context(device.type):
            with t.precision.autocast(device.type), t.offload.context(device.type):
                loss = model(xb, yb)[1]  # logits (B, T, vocab) are not kept alive through backward
            loss = loss / len(micro)  # gradients of the micro-steps add up to the batch mean
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model: nn.Module, data: TokenData, batch_size: int, t: Techniques,
             device: torch.device, batches: int) -> float | None:
    """Mean loss over the first `batches` held-out batches of `batch_size`, in eval mode; None
    without any.

    Each batch runs in the training's micro-batches: eval holds what a micro-step held, without
    its saved activations, so a point that trained on the card also evaluates on it. (A whole
    batch at once, 512 x 1024 tokens of gpt2, made 130 GB of logits.) A compiled model runs eagerly
    here: eval mode without gradients is another graph, and compiling it took 11-15 s on gpt2 for a
    few batches that run in well under one. Both figures: benchmarks/results/NVIDIA-H200/README.md."""
    model.eval()
    total, count = 0.0, 0
    with torch.compiler.set_stance("force_eager"):
        for x, y in itertools.islice(data.eval_batches(batch_size), batches):
            for xb, yb in t.accumulation.split(x, y):
                with t.precision.autocast(device.type), t.attention.context(device.type):
                    _, loss = model(xb.to(device), yb.to(device))
                total += loss.item() * len(xb)
                count += len(xb)
    model.train()
    return total / count if count and math.isfinite(total) else None
