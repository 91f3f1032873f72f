"""offload group: which tensors live in host memory instead of on the training device."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ablate.techniques import Invalid, Option, Plan


class NoOffload(Option):
    """Keep activations, parameters and optimizer states on the training device."""

    label = "No offload"
    shards_params = False  # whether parameters become FSDP's DTensor shards, even in one process
    # Where the analytic predictor (ablate/predict/analytic.py) puts the bytes: on the host, off the
    # training device (on a CPU the host is the device, and nothing moves).
    params_on_host = False  # parameters, their gradients and optimizer states
    states_on_host = False  # optimizer states
    grads_on_host = False  # gradients
    activations_on_host = False  # every tensor saved for backward
    layers_ahead = -1  # ... copied on a side stream, and this many layers fetched back ahead in backward
    fsdp_mixed_precision = False  # FSDP gathers the parameters in the compute dtype (no autocast copies)

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        """Wraps the forward pass, where the tensors saved for backward are packed."""
        return contextlib.nullcontext()

    def apply(self, model: nn.Module, adapter) -> nn.Module:
        """Hooks on the bare model's layers, before any wrapper hides them (ablate/build.py)."""
        return model

    def build_optimizer(self, optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """`optimizer` is the optimizer group's option; by default it builds where the params are."""
        return optimizer.build(model)

    def place(self, model: nn.Module, adapter, precision) -> nn.Module:
        """Where one process keeps the whole model's parameters (parallel=single): on the device."""
        return model


class Activations(NoOffload):
    """Copy every tensor saved for backward to host memory in forward and back in backward
    (torch.autograd.graph.save_on_cpu, pinned on CUDA so the copies are asynchronous).
    Saves: nearly all activation memory on the device. Spends: two PCIe transfers per tensor, host RAM."""

    label = "Activation offload"
    activations_on_host = True

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda")


class OptimizerState(NoOffload):
    """Keep optimizer states (and with `gradients`, gradients too) in host memory and run the
    optimizer step on the CPU (torchao's CPUOffloadOptimizer). Saves: 8 bytes/param of AdamW state
    on the device (+4 with gradients). Spends: device<->host copies of grads and params each step."""

    label = "Optimizer offload"
    states_on_host = True

    def __init__(self, gradients: bool = False):
        self.gradients = gradients

    @property
    def grads_on_host(self) -> bool:
        return self.gradients

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
            raise Invalid(f"offload=optimizer needs torchao ({e}): pip install torchao") from None

    def build_optimizer(self, optimizer, model: nn.Module) -> torch.optim.Optimizer:
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(optimizer.param_groups(model), optimizer.optimizer_class(),
                                   offload_gradients=self.gradients, **optimizer.optimizer_kwargs())


class Params(NoOffload):
    """Parameters, gradients and optimizer states in host memory, streamed to the device layer by
    layer through FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU. Saves: all model state
    on the device (what stays is one layer's parameters, gathered in the compute dtype, and the
    activations). Spends: host<->device copies of every layer in forward and backward, of every
    gradient after it, and the optimizer step at host speed.

    With parallel=fsdp it is FSDP's own offload. With parallel=single, one process is FSDP over a
    process group of one rank (`place`): the same streaming, nothing to shard with."""

    label = "Parameter offload"
    shards_params = params_on_host = fsdp_mixed_precision = True

    def check(self, plan: Plan) -> None:
        if plan.in_backward:
            raise Invalid("offload=params with optimizer.in_backward=true: FSDP reduces gradients and "
                          "copies them to the host after the hook would have stepped")

    def cpu_offload_policy(self):
        """What the FSDP option passes to fully_shard(offload_policy=...). Pinned host memory
        makes the copies asynchronous; a CPU run has no such copies (and no pinning without CUDA)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())

    def place(self, model: nn.Module, adapter, precision) -> nn.Module:
        """FSDP2 over a process group of this one process (gloo on a CPU, NCCL on a GPU, a store in
        memory: no rendezvous), unless one exists (predict=trace's fake one)."""
        from ablate.techniques.parallel import FSDP

        device = next(model.parameters()).device
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
        return FSDP(nproc=1).wrap(model, adapter, precision, self)
