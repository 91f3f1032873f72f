"""offload group: which tensors live in host memory instead of on the training device."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ablate.techniques import Invalid, Option, Plan


class NoOffload(Option):
    """Keep activations, parameters and optimizer states on the training device."""

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        """Wraps the forward pass, where the tensors saved for backward are packed."""
        return contextlib.nullcontext()

    def build_optimizer(self, optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """`optimizer` is the optimizer group's option; by default it builds where the params are."""
        return optimizer.build(model)


class Activations(NoOffload):
    """Copy every tensor saved for backward to host memory in forward and back in backward
    (torch.autograd.graph.save_on_cpu, pinned on CUDA so the copies are asynchronous).
    Saves: nearly all activation memory on the device. Spends: two PCIe transfers per tensor, host RAM."""

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda")


class OptimizerState(NoOffload):
    """Keep optimizer states (and with `gradients`, gradients too) in host memory and run the
    optimizer step on the CPU (torchao's CPUOffloadOptimizer). Saves: 8 bytes/param of AdamW state
    on the device (+4 with gradients). Spends: device<->host copies of grads and params each step."""

    def __init__(self, gradients: bool = False):
        self.gradients = gradients

    def check(self, plan: Plan) -> None:
        if plan.device == "cpu":
            raise Invalid("offload=optimizer needs a CUDA device: on the CPU everything is already in host memory")
        if plan.sharded:
            raise Invalid("offload=optimizer with a sharded parallel option: use offload=params (FSDP's own offload)")
        if plan.in_backward:
            raise Invalid("offload=optimizer with optimizer.in_backward=true: the offloaded step runs after backward")
        try:
            import torchao.optim  # noqa: F401
        except ImportError as e:  # not installed, or built for another torch
            raise Invalid(f"offload=optimizer needs torchao ({e}): pip install 'ablate[ao]'") from None

    def build_optimizer(self, optimizer, model: nn.Module) -> torch.optim.Optimizer:
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(optimizer.param_groups(model), optimizer.optimizer_class(),
                                   offload_gradients=self.gradients, **optimizer.optimizer_kwargs())


class Params(NoOffload):
    """Parameters, gradients and optimizer states in host memory, streamed to the device layer by
    layer through FSDP's CPUOffloadPolicy. Saves: all model state on the device. Spends: host<->
    device traffic every forward and backward, and the optimizer step on the CPU."""

    def check(self, plan: Plan) -> None:
        if not plan.sharded:
            raise Invalid("offload=params needs parallel=fsdp (it is FSDP's CPU offload policy)")
        if plan.device == "cpu":
            raise Invalid("offload=params needs a CUDA device: on the CPU everything is already in host memory")

    def cpu_offload_policy(self):
        """What the FSDP option passes to fully_shard(offload_policy=...)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=True)
