"""Memory techniques: one module per config group, one small class per option.

Every option is built by Hydra from its `_target_` node and exposes a small fixed interface that
the build function (ablate/build.py) and the train loop (ablate/train.py) call without knowing
which option they hold. "Off" is always a real do-nothing object.
"""
from __future__ import annotations

from dataclasses import dataclass


class Invalid(Exception):
    """This combination cannot run (the grid point becomes a row with status 'invalid')."""


class Unmodelled(Exception):
    """An option (or a whole group) the analytic predictor has no memory model for: the point is
    predicted by the fake-tensor trace instead (ablate/outcome.py), never left out silently. An
    option gives its model by answering the predictor's questions (its group's methods below and in
    its module: an optimizer's state bytes, a checkpoint option's kept bytes, ...)."""


@dataclass(frozen=True)
class Plan:
    """What an option may check itself against before anything is built."""

    device: str  # "cpu", "cuda", or "auto" while the job has not yet seen the worker's device
    batch_size: int  # samples per optimizer step per rank
    seq_len: int
    world_size: int = 1
    accumulation_steps: int = 1  # micro-batches per optimizer step
    grad_scaler: bool = False  # the precision option scales the loss (fp16)
    param_dtype: str = "fp32"  # dtype parameters are stored in: fp32 | bf16
    stochastic_rounding: bool = False  # bf16 parameters updated with stochastic rounding
    sharded: bool = False  # parameters are FSDP's shards (parallel=fsdp; offload=params, even in one process)
    in_backward: bool = False  # the optimizer steps each parameter inside backward
    chunked_loss: bool = False  # the loss option takes the model's hidden states and head (not its logits)
    frozen_base: bool = False  # the base weights train not: adapters beside them do (peft)
    autocast: bool = False  # the precision option computes under autocast (its parameters stay fp32)
    states_on_host: bool = False  # offload=optimizer: torchao's CPUOffloadOptimizer builds the optimizer


class Option:
    # The report's name for this option ("Block recompute", "8-bit AdamW"): a setting's label in
    # analysis/tables.py is the labels of what it changes. An option whose name depends on its keys
    # makes this a property.
    label = ""
    # The report's names for this option's keys set on their own in a preset: {(key, value as
    # text): name}, e.g. {("in_backward", "True"): "Optimizer step in backward"}.
    key_labels: dict[tuple[str, str], str] = {}

    # True where all this option changes in memory is the parameters change_params leaves, which the
    # analytic predictor reads off its meta model: then its group needs no memory model of its own.
    memory_in_params = False

    # False where torch's MemTracker, a dispatch mode, cannot follow this option's step. A real run
    # then leaves its traced step untraced (no breakdown, no memory_by_module.csv) and
    # predict=trace falls back to the analytic model.
    traceable = True

    # The model family (ablate/models/), set by ablate.build.Techniques: its adapter says where the
    # layers, embedding and head are. None for an option made on its own.
    family = None

    def check(self, plan: Plan) -> None:
        """Raise Invalid with a reason naming the key if this option cannot run under `plan`."""

    def imports(self) -> None:
        """Import the libraries this option's build imports on first use (peft, transformers'
        modeling code), nothing more: a worker server on a host without a GPU calls it before it
        forks a point's process (ablate/worker.py prepare), so that its later points start with them."""

    def change_params(self, model, adapter):
        """Freeze, add or replace parameters of the bare model (`adapter`: where its parts are,
        ablate/models/). The build calls it once the weights are loaded, before any wrapper; the
        predictor calls it on its meta model, so both count the same parameters. Returns the model."""
        return model

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


FP8_GPU = "a CUDA GPU of compute capability >= 8.9 (Ada/Hopper: L4, L40S, H100)"  # fp8 tensor cores, sm89


def require_fp8_gpu(plan: Plan, key: str) -> None:
    """Raise Invalid for `key` (an fp8 option) unless the plan's device has fp8 hardware; the job
    (device auto) leaves it to the worker, which checks again with its device."""
    if plan.device not in ("cuda", "auto"):
        raise Invalid(f"{key} needs {FP8_GPU}; device={plan.device} has none")
    # Here, not at the top: the command line's key check (ablate/keytypes.py) imports Invalid from
    # this package before any point runs, and a torch imported there (2 s on 2 cores) would be in
    # the CLI's path instead of beside the prestarted worker's import (launch/warm_start.py).
    import torch

    if plan.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise Invalid(f"{key} needs {FP8_GPU}; {torch.cuda.get_device_name()} is {major}.{minor}")
