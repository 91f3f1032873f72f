"""optimizer=lomo, adalomo: lomo-optim's Lomo and AdaLomo, which update each parameter inside backward.

The package registers a tensor hook on every trainable parameter (`p.register_hook(grad_func)`).
A hook fires when that parameter's gradient has been computed, before autograd accumulates it into
`.grad`, and walks the model: every parameter whose `.grad` is set by then (the ones whose
gradients arrived before) is updated in place and its `.grad` dropped. The parameter whose
gradient arrives last (the input embedding) is left for after backward: the package's
`fused_backward(loss, lr)` is `loss.backward()` and then one more `grad_func(0)`.

ablate's train loop calls `backward()` and `optimizer.step()` and names no technique, so the
package's object is held in `InBackwardUpdate`, a torch Optimizer whose `step()` is that last
`grad_func(0)` (and AdaLomo's step count). Its `state` holds AdaLomo's second moments keyed by
parameter, so MemTracker labels them "optimizer".

How this composes with `in_backward`: the option always steps in backward (not a key), so its
`in_backward` reads True, the rules that go with it hold (no accumulation; find_batch tries the
whole batch only). The package's hook order keeps a gradient a little longer than a post-accumulate
hook would: a tensor hook runs before its own gradient is accumulated and steps the ones before it,
so each gradient lives until the next parameter's arrives (the last until `step()`), and under
16-bit parameters its fp32 copy and the parameter's sit beside them: the predictor plays that
(`steps_on_next_gradient`). Where the activations make the peak the prediction is within 2% of
MemTracker's; where a step of a few tokens peaks in backward, in fp32 or under AdaLomo, it is short
by about one gradient matrix (tests/test_lomo.py has both cases).
"""
from __future__ import annotations

import math
from unittest import mock

import torch
from torch import nn

from ablate.models.layout import bare_name
from ablate.techniques import Invalid, Plan
from ablate.techniques.adam_mini import device_bytes, import_package
from ablate.techniques.optimizer import TorchOptimizer, _installed

PACKAGE = "lomo-optim==0.1.1"  # the release pyproject pins and this glue was read against


class Trainable:
    """The model as the package walks it (`named_parameters()`, `parameters()`, in its constructor
    and in every hook): the trainable parameters under their bare names. A frozen parameter then
    gets no state (AdaLomo makes one for every parameter it is shown) and no visit from each hook."""

    def __init__(self, model: nn.Module):
        self.named = [(bare_name(n, model), p) for n, p in model.named_parameters() if p.requires_grad]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named]


class InBackwardUpdate(torch.optim.Optimizer):
    """The package's optimizer as the train loop holds it: its hooks update every parameter but the
    last inside backward; `step()` updates that one (`grad_func(0)`, what `fused_backward` does
    after backward) and counts the step for the next backward's hooks. `param_groups` are the
    package's; `state` holds the tensors it keeps per parameter, so MemTracker counts them as
    optimizer state. With GradScaler(enabled=False), `scaler.step(opt)` is `opt.step()`, and
    `zero_grad` finds every `.grad` already None. The package's hooks read its own `lr` attribute,
    set when it is built, not the groups' (ablate schedules no learning rate)."""

    def __init__(self, inner: torch.optim.Optimizer, state: dict, counts_steps: bool):
        super().__init__(inner.param_groups[0]["params"], dict(inner.defaults))
        self.inner, self.counts_steps = inner, counts_steps
        self.param_groups = inner.param_groups
        self.state.update(state)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.inner.grad_func(0)  # the argument is a placeholder the hook hands back
        if self.counts_steps:  # AdaLomo's fused_backward counts before backward: its hooks read it
            self.inner.step_num += 1


class FusedUpdate(TorchOptimizer):
    """Base of lomo and adalomo: the package's optimizer, built on the trainable parameters and
    stepped inside backward (`in_backward` is always True: not a key)."""

    key_labels: dict = {}
    package_class = ""  # the class in lomo_optim
    steps_on_next_gradient = True
    counts_steps = False

    def __init__(self, lr: float, weight_decay: float, clip_grad_norm: float | None, clip_grad_value: float | None):
        super().__init__(lr, weight_decay, in_backward=True)
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value

    def check(self, plan: Plan) -> None:
        key = f"optimizer={self.name}"
        if not _installed("lomo_optim"):
            raise Invalid(f"{key} needs {PACKAGE}: pip install {PACKAGE}")
        if not _installed("transformers"):
            raise Invalid(f"{key} needs transformers, which {PACKAGE} imports: pip install 'transformers>=5,<6'")
        self.check_values()
        if plan.accumulation_steps > 1:
            raise Invalid(f"{key} needs accumulation=none: it updates each parameter inside backward, so every "
                          "micro-batch would take a step of its own gradient")
        if plan.grad_scaler:
            raise Invalid(f"{key} with precision=fp16: GradScaler cannot unscale or skip an update made inside "
                          "backward, and the package's own loss scaling needs its fused_backward, which ablate's "
                          "train step does not call; use precision=bf16, bf16_pure or fp32")
        if plan.world_size > 1 or plan.sharded:
            raise Invalid(f"{key} needs parallel=single and no offload=params: it updates each parameter inside "
                          "backward, before DDP or FSDP could reduce its gradient (its distributed path is "
                          "DeepSpeed ZeRO-3's)")
        if plan.states_on_host:
            raise Invalid(f"{key} with offload=optimizer: its updates run inside backward on the device, "
                          "where torchao's CPUOffloadOptimizer steps on the host after it; use offload=none")
        if plan.stochastic_rounding:
            raise Invalid(f"precision.stochastic_rounding=true needs optimizer=adamw (torchao's AdamW): {key} "
                          "rounds its fp32 update to the parameters' dtype to nearest")

    def check_values(self) -> None:
        """Made here without importing the package (the job process checks too)."""
        if self.clip_grad_norm is not None:
            raise Invalid(f"optimizer.clip_grad_norm={self.clip_grad_norm}: {PACKAGE} clips by the global norm "
                          "with a second backward pass (its grad_norm(loss)) before the one that updates, which "
                          "ablate's train step does not make; use optimizer.clip_grad_value, or null")
        if self.clip_grad_value is not None and not self.clip_grad_value > 0:
            raise Invalid(f"optimizer.clip_grad_value={self.clip_grad_value} must be > 0 (or null: no clipping)")
        if not self.lr >= 0:
            raise Invalid(f"optimizer.lr={self.lr} must be >= 0")
        if not self.weight_decay >= 0:
            raise Invalid(f"optimizer.weight_decay={self.weight_decay} must be >= 0")

    def param_groups(self, model: nn.Module) -> list[dict]:
        """One group, the trainable parameters in the model's order (the package takes the model)."""
        return [{"params": Trainable(model).parameters()}]

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return getattr(import_package(self.name, "lomo_optim", PACKAGE), self.package_class)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        view = Trainable(model)
        device = view.parameters()[0].device
        # AdaLomo makes its second moments with .cuda(): on the parameters' device instead (a CPU
        # run has no CUDA device, a GPU rank's may not be the current one). Lomo makes none.
        with mock.patch.object(torch.Tensor, "cuda", lambda t, *args, **kwargs: t.to(device)):
            inner = self.optimizer_class()(view, **self.optimizer_kwargs())
        return InBackwardUpdate(inner, self.states(inner, view), self.counts_steps)

    def make(self, groups: list[dict]) -> torch.optim.Optimizer:
        raise TypeError(f"optimizer={self.name} is built from the model (build), not from groups")

    def states(self, inner, view: Trainable) -> dict:
        """{parameter: {name: tensor}} of what the package keeps per parameter."""
        return {}


class Lomo(FusedUpdate):
    """LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
    Resources"): plain SGD, fused into backward. Saves: every optimizer state (none) and the whole
    set of gradients: each is applied to its parameter and dropped as the next parameter's arrives,
    so one or two gradients are alive at a time. Spends: a walk over the parameters per hook, an
    fp32 copy of the gradient and of the parameter while a 16-bit one is updated (precision=
    bf16_pure), and no accumulation, loss scaling or data parallelism."""

    label = "LOMO"
    name, package_class = "lomo", "Lomo"

    def __init__(self, lr: float = 0.03, weight_decay: float = 0.0, clip_grad_norm: float | None = None,
                 clip_grad_value: float | None = None):
        super().__init__(lr, weight_decay, clip_grad_norm, clip_grad_value)

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay, "clip_grad_value": self.clip_grad_value}

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        return 0.0

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        """A 16-bit parameter is updated through fp32 copies of it and of its gradient; an fp32 one
        in place (`.to(torch.float32)` returns the tensor itself)."""
        return 0.0 if d == 4 else 8 * max(n for g in groups for n in g)


class AdaLomo(FusedUpdate):
    """AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with Adaptive Learning Rate"):
    LOMO with Adafactor's factored second moment and update normalisation. Saves: what LOMO saves,
    but keeps fp32 row and column means of each matrix's squared gradient (4·(rows+cols) bytes per
    matrix, ~0 bytes/param) and a full one per vector (4 bytes/param). Spends: three fp32 tensors
    of one parameter's size while it is updated (its gradient's fp32 copy, the squared gradient and
    the update), LOMO's walk per hook, and LOMO's refusals.

    The package's loss scaling (loss_scale: the loss times 2**10 in its fused_backward, each
    gradient divided back in its hooks) is off: ablate's train step does the backward, unscaled."""

    label = "AdaLomo"
    name, package_class = "adalomo", "AdaLomo"
    counts_steps = True
    reads_values = True  # max(eps, RMS of the parameter) compares a tensor with a float

    def __init__(self, lr: float = 1e-3, eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8, weight_decay: float = 0.0, clip_grad_norm: float | None = None,
                 clip_grad_value: float | None = None):
        super().__init__(lr, weight_decay, clip_grad_norm, clip_grad_value)
        self.eps, self.clip_threshold, self.decay_rate = tuple(eps), clip_threshold, decay_rate

    def check(self, plan: Plan) -> None:
        super().check(plan)
        odd = [n for n, s in self.family.layout.shapes.items() if len(s) not in (1, 2)] if self.family else []
        if odd:
            raise Invalid(f"optimizer=adalomo factors matrices and keeps vectors whole; {odd[0]} is "
                          f"{len(self.family.layout.shapes[odd[0]])}-D (experts stacked in one tensor), which "
                          f"its row and column means do not fit: use optimizer=lomo or adafactor")

    def check_values(self) -> None:
        super().check_values()
        if not self.clip_threshold > 0:
            raise Invalid(f"optimizer.clip_threshold={self.clip_threshold} must be > 0")
        if not self.decay_rate <= 0:  # beta2 = 1 - t**decay_rate: in [0, 1) for t >= 1
            raise Invalid(f"optimizer.decay_rate={self.decay_rate} must be <= 0")

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "loss_scale": 0, "eps": self.eps, "clip_threshold": self.clip_threshold,
                "decay_rate": self.decay_rate, "weight_decay": self.weight_decay,
                "clip_grad_value": self.clip_grad_value}

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().build(model)
        opt.inner.step_num = 1  # what fused_backward sets before the first backward's hooks read it
        return opt

    def states(self, inner, view: Trainable) -> dict:
        tables = {"exp_avg_sq": inner.exp_avg_sq, "exp_avg_sq_row": inner.exp_avg_sq_row,
                  "exp_avg_sq_col": inner.exp_avg_sq_col}
        return {p: {k: t[n] for k, t in tables.items() if n in t} for n, p in view.named}

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        """fp32 whatever the parameters' dtype: a vector's whole, a matrix's row and column means."""
        parts = (math.prod(shape),) if len(shape) == 1 else shape[:2]
        return sum(device_bytes(k * 4, device) for k in parts)

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        """Updating a tensor of n elements holds three fp32 tensors of its size at once (the
        gradient or its fp32 copy, beside the squared gradient plus eps, then beside the old and
        the new update, or the update and the parameter's fp32 copy): 12·n bytes. The predictor
        asks this per tensor, as each is stepped in backward, holding its gradient (d bytes per
        element) beside: the rest is (12 - d)·n (a 16-bit gradient is dropped once copied)."""
        return (12 - d) * max((n for g in groups for n in g), default=0)
