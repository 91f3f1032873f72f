"""optimizer group: which torch optimizer updates the weights, and so how much state it keeps.

Every option names its optimizer class and constructor kwargs once (`optimizer_class()`,
`optimizer_kwargs()`); `make` builds from them here, and offload=optimizer hands the same two to
torchao's CPUOffloadOptimizer. With `in_backward: true` any option steps each parameter inside
backward instead (InBackward), so no full set of gradients is ever alive.
"""
from __future__ import annotations

import abc
import functools
import importlib.util
import math

import torch
from torch import nn

from ablate.models.layout import bare_name
from ablate.techniques import Invalid, Option, Plan, Unmodelled


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2), never biases or LayerNorm gains (GPT-2 practice)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _installed(package: str) -> bool:
    # Looked up, not imported: the job process checks too, and these imports are heavy.
    return importlib.util.find_spec(package) is not None


class Composite(torch.optim.Optimizer):
    """Several optimizers the train loop holds as one (Muon for the layers' matrices beside AdamW
    for the rest). `state` and `param_groups` are theirs (shared, live), so MemTracker labels
    every state "optimizer", GradScaler unscales every gradient and an lr change reaches them all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        for o in optimizers:
            o.state = self.state  # one dict keyed by parameter: the union of all their states

    def step(self, closure=None) -> None:
        for o in self.optimizers:
            o.step()


class InBackward(Composite):
    """What the train loop holds when every parameter is stepped inside backward.

    One optimizer per parameter steps from a post-accumulate-grad hook, then drops that gradient
    (p.grad = None). Saves: the full set of gradients (4 bytes/param in fp32): at most the
    gradients of the parameters still in flight are alive. Spends: one small step per tensor.
    step() has nothing left to do, so GradScaler(enabled=False).step(opt) and step hooks still work.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], hooks: list):
        super().__init__(optimizers)
        self.hooks = hooks

    def step(self, closure=None) -> None:
        """Every parameter was already stepped in backward."""


@functools.cache
def _empty_list_error() -> str:
    """What torch's Optimizer says when given no parameters (asked, not copied, so it cannot drift)."""
    try:
        torch.optim.Optimizer([], {})
    except ValueError as exc:
        return str(exc)
    return ""


class TorchOptimizer(Option, abc.ABC):
    """Base: subclasses name their optimizer class and kwargs; this builds it, in backward or not."""

    supports_stochastic_rounding = False  # only AdamW can update bf16 parameters with stochastic rounding
    key_labels = {("in_backward", "True"): "Optimizer step in backward"}

    def __init__(self, lr: float, weight_decay: float, in_backward: bool = False):
        self.lr, self.weight_decay, self.in_backward = lr, weight_decay, in_backward

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    @abc.abstractmethod
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch optimizer this option builds."""

    @abc.abstractmethod
    def optimizer_kwargs(self) -> dict:
        """Constructor kwargs besides the parameters (their groups carry the weight decay)."""

    def param_groups(self, model: nn.Module) -> list[dict]:
        return param_groups(model, self.weight_decay)  # the module function above

    def in_layers(self, name: str, shape: tuple) -> bool:
        """Whether a parameter is a matrix of the decoder's repeated layers (`name`: the bare model's,
        as the layout and `bare_name` give it): what Muon orthogonalises and GaLore and APOLLO
        project, while the embeddings, head, norms and biases take AdamW's step."""
        if self.family is None:
            raise RuntimeError(f"optimizer={self.name} needs the model family (set by ablate.build.Techniques)")
        return len(shape) == 2 and name.startswith(self.family.adapter.layers + ".")

    def layer_matrices(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(the layers' matrices, the other trainable parameters) of `model`, bare or wrapped, each in
        the model's order."""
        matrices, rest = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (matrices if self.in_layers(bare_name(name, model), tuple(p.shape)) else rest).append(p)
        return matrices, rest

    def make(self, groups: list[dict]) -> torch.optim.Optimizer:
        return self.optimizer_class()(groups, **self.optimizer_kwargs())

    def check_values(self) -> None:
        """torch's own checks of the hyperparameters ("Invalid learning rate: -1"), in the job
        process, so that a bad value is an invalid row that starts no worker. With no parameters:
        each torch optimizer checks its values before the base class refuses the empty list, and
        one built with a parameter imports torch._dynamo (about a second per job process)."""
        try:
            self.optimizer_class()([], **self.optimizer_kwargs())
        except ValueError as exc:
            if str(exc) != _empty_list_error():
                raise Invalid(f"optimizer={self.name}: {exc}") from None  # the message says it all

    def check(self, plan: Plan) -> None:
        self.check_values()
        if plan.stochastic_rounding and not self.supports_stochastic_rounding:
            raise Invalid(f"precision.stochastic_rounding=true needs optimizer=adamw (torchao's AdamW), "
                          f"not optimizer={self.name}")
        if not self.in_backward:
            return
        if plan.accumulation_steps > 1:
            raise Invalid("optimizer.in_backward=true needs accumulation=none: "
                          "the step would run on the first micro-batch's gradient")
        if plan.grad_scaler:
            raise Invalid("optimizer.in_backward=true with a loss-scaling precision (fp16): "
                          "the GradScaler cannot unscale/skip steps inside backward")
        if plan.world_size > 1:
            raise Invalid("optimizer.in_backward=true needs parallel=single: "
                          "DDP/FSDP reduce gradients after the hook has already stepped")

    # The analytic predictor's questions (ablate/predict/analytic.py), in bytes. `shape` is one
    # parameter tensor's (its shard's under FSDP: torch keeps a DTensor's states in its local
    # shape), `name` its name in the bare model (the layout's), `d` the bytes of the parameters' dtype, `groups` each parameter group's tensor sizes
    # (elements) in the order the step visits them, `device` "cpu" or "cuda".
    reads_values = False  # its step reads tensor values (.item()), which the fake-tensor trace must answer
    # In backward, a parameter is stepped when the next parameter's gradient arrives (a tensor hook
    # that runs before its own gradient is kept, as lomo-optim's), the last one by step(): each
    # gradient lives until the next one exists. Else each is stepped as soon as it is whole.
    steps_on_next_gradient = False

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        """Optimizer state kept on the device for one parameter tensor."""
        raise Unmodelled(f"no memory model for optimizer option {type(self).__name__}")

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        """The step's temporaries at their largest."""
        raise Unmodelled(f"no memory model for optimizer option {type(self).__name__}")

    def step_temp(self, groups: list[list[tuple]], d: int, device: str) -> float:
        """The step's temporaries at their largest, given each tensor's shape (what the predictor
        asks): from their element counts, unless the option needs the shapes (Muon's Gram matrices)."""
        return self.step_temp_bytes([[math.prod(s) for s in g] for g in groups], d, device)

    def shared_state_bytes(self, largest: int) -> float:
        """State shared by every tensor (a quantisation map), given the largest tensor's elements."""
        return 0.0

    def before_trace(self) -> None:
        """What must exist, of real values, before the fake-tensor trace runs this optimizer."""

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        if not self.in_backward:
            return self.make(self.param_groups(model))
        optimizers, hooks = [], []
        for group in self.param_groups(model):
            for p in group["params"]:
                opt = self.make([{**group, "params": [p]}])  # keeps the group's weight decay
                optimizers.append(opt)
                hooks.append(p.register_post_accumulate_grad_hook(_step_and_free(opt)))
        return InBackward(optimizers, hooks)


def host_step_bytes(device: str, fused: bool = False) -> int:
    """torch keeps Adam's and Adafactor's `step` a 0-d fp32 tensor on the host unless fused: on a CPU
    the host is the device. One per parameter tensor, whole on every rank."""
    return 4 if device == "cpu" or fused else 0


def for_loop_temp_bytes(groups: list[list[int]], d: int, per_tensor: int) -> float:
    """Temporaries of a for-loop step: `per_tensor` tensor-sized ones for the current parameter,
    plus the previous parameter's last one, which a loop variable keeps until reassigned."""
    return max((prev + per_tensor * cur) * d for g in groups for prev, cur in zip([0, *g], g))


def _step_and_free(opt: torch.optim.Optimizer):
    def hook(p: torch.Tensor) -> None:
        opt.step()
        p.grad = None  # freed now, before the rest of backward allocates more
    return hook


IMPLEMENTATIONS = {"default": {}, "forloop": {"foreach": False}, "foreach": {"foreach": True},
                   "fused": {"fused": True}}


class AdamW(TorchOptimizer):
    """Adam with decoupled weight decay. Spends two fp32 states per parameter (exp_avg,
    exp_avg_sq): 8 bytes/param. `implementation` changes speed and temporaries, not the math:
    forloop steps one tensor at a time (temporaries of one tensor), foreach batches tensors into
    few kernels (temporaries of a whole group), fused is one kernel per group (no temporaries).
    Under precision.stochastic_rounding, torchao's AdamW rounds the bf16 update stochastically."""

    supports_stochastic_rounding = True

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 implementation: str = "default", in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.betas, self.implementation = tuple(betas), implementation
        self._round_stochastically = False  # set by check(plan), which always runs before build

    @property
    def label(self) -> str:
        return {"default": "AdamW", "forloop": "AdamW for-loop"}.get(self.implementation,
                                                                   f"AdamW {self.implementation}")

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if self.implementation not in IMPLEMENTATIONS:
            raise Invalid(f"optimizer.implementation={self.implementation!r} is not one of "
                          f"{', '.join(IMPLEMENTATIONS)}")
        if self.implementation == "fused" and plan.device not in ("cpu", "cuda", "auto"):
            raise Invalid(f"optimizer.implementation=fused has kernels for cpu and cuda only, not device={plan.device}")
        if plan.stochastic_rounding:
            if self.implementation != "default":
                raise Invalid("precision.stochastic_rounding=true runs torchao's AdamW: "
                              f"optimizer.implementation={self.implementation} must be default")
            if not _installed("torchao"):
                raise Invalid("precision.stochastic_rounding=true needs torchao: pip install torchao")
        self._round_stochastically = plan.stochastic_rounding

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        return 2 * math.prod(shape) * d + host_step_bytes(device, self.implementation == "fused")

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        if self.implementation == "fused":
            return 0.0
        if self.implementation == "foreach" or (self.implementation == "default" and device == "cuda"):
            return max(sum(g) for g in groups) * d  # sqrt(exp_avg_sq) for a whole group at once (CUDA's default)
        return for_loop_temp_bytes(groups, d, 2)  # sqrt(exp_avg_sq) and its quotient

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        if self._round_stochastically:
            from torchao.optim import _AdamW  # optional: only needed for stochastic rounding

            return _AdamW
        return torch.optim.AdamW

    def optimizer_kwargs(self) -> dict:
        kwargs = {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay}
        if self._round_stochastically:
            return {**kwargs, "bf16_stochastic_round": True}
        return {**kwargs, **IMPLEMENTATIONS.get(self.implementation, {})}


class SGD(TorchOptimizer):
    """Plain SGD: no state at momentum 0; one momentum buffer (4 bytes/param in fp32) otherwise."""

    label = "SGD"

    def __init__(self, lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0, in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.momentum = momentum

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        return math.prod(shape) * d if self.momentum else 0

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        return for_loop_temp_bytes(groups, d, 1) if self.weight_decay else 0.0  # grad + wd * param

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.SGD

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
