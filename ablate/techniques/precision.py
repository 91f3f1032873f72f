"""precision group: the dtype of parameters and of the compute, and the loss scaler that goes with it.

Every option also decides how the model is materialised (`init_on_device`): built in fp32 on the
host and then moved and cast (peak: a full fp32 host copy), or built on the meta device and
allocated directly on the target device in the parameter dtype (no host copy at all).
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable

import torch
from torch import nn

from ablate.models.gpt_module import on_meta
from ablate.models.meta_constants import initialise
from ablate.techniques import Invalid, Option, Plan, require_fp8_gpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision(Option):
    """Base: fp32 parameters, no autocast, no loss scaling. Subclasses change one thing each."""

    compute_dtype = "fp32"  # the column of the device peak table that MFU divides by
    param_dtype = "fp32"  # parameters, gradients and optimizer states
    autocast_dtype: str | None = None  # None: the forward runs in the parameter dtype
    scales_loss = False  # fp16 gradients underflow without a GradScaler
    allow_tf32 = False
    stochastic_rounding = False

    def __init__(self, init_on_device: bool = False):
        self.init_on_device = init_on_device

    def check(self, plan: Plan) -> None:
        needs_bf16 = "bf16" in (self.param_dtype, self.autocast_dtype)
        if needs_bf16 and plan.device == "cuda" and not torch.cuda.is_bf16_supported():
            raise Invalid(f"precision={type(self).__name__.lower()}: this GPU has no bf16 support (try fp16)")

    def setup(self) -> None:
        """Process-wide math flags; called once in the worker before anything is built."""
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=DTYPES[self.autocast_dtype])

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type, enabled=self.scales_loss)

    def convert(self, model: nn.Module, adapter) -> nn.Module:
        """Swap layers for ones computing in another format (fp8); the others keep the model as it is."""
        return model

    def fp8_weights(self, layer: nn.Module) -> int:
        """Elements of `layer`'s weights computed in float8 (autocast casts no 16-bit copy of them):
        the analytic predictor's question (ablate/predict/analytic.py)."""
        return 0

    def materialize(self, family, device: torch.device) -> nn.Module:
        """Build the model option `family` (an ablate.models.Family) and put it on `device` in the
        parameter dtype.

        Either way it is built on the meta device (shapes only) and initialised once: a plain build
        runs every layer's own initialiser and then the model's, drawing each weight twice (for
        gpt2-xl, 2 x 1.6 G random numbers on the host: seconds of every point's start).
        """
        dtype = DTYPES[self.param_dtype]
        with on_meta():  # shapes only: nothing allocated anywhere
            model = family.build()
        if not self.init_on_device:  # fp32 on the host first, then moved and cast
            return _initialised(model, torch.device("cpu"), family.constants).to(device=device, dtype=dtype)
        # allocated once, on the device, already in `dtype`
        return _initialised(model.to(dtype), device, family.constants)


def _initialised(model: nn.Module, device: torch.device, constants: Callable[[], nn.Module]) -> nn.Module:
    """A meta model given storage on `device` and its initial values there; a value no
    initialiser writes (a module's own constant) comes from `constants()` (ablate/models/meta_constants.py)."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every parameter new storage, which unties shared ones
    initialise(model, model.reset_parameters, constants)
    return model


class FP32(Precision):
    """Parameters, gradients, optimizer states and matmuls all in float32 (TF32 explicitly off)."""

    label = "fp32"


class TF32(Precision):
    """fp32 storage, matmuls on TF32 tensor cores (10-bit mantissa). Saves no memory; buys speed
    on Ampere and newer GPUs. On a CPU it is plain fp32."""

    label = "TF32"
    compute_dtype = "tf32"
    allow_tf32 = True


class FP16(Precision):
    """Autocast to float16 with fp32 master weights and a GradScaler. Spends: fp16 copies of weights
    and activations inside autocast. Saves: about half the activation memory; fp16 tensor-core speed.
    Steps whose gradients overflow are skipped by the scaler and counted in the result."""

    label = "fp16 AMP"
    compute_dtype = "fp16"
    autocast_dtype = "fp16"
    scales_loss = True


class BF16(Precision):
    """Autocast to bfloat16 with fp32 master weights; bf16's fp32-sized exponent needs no scaler.
    Saves about half the activation memory."""

    label = "bf16 AMP"
    compute_dtype = "bf16"
    autocast_dtype = "bf16"


class BF16Pure(Precision):
    """Parameters, gradients and optimizer states stored in bfloat16, no fp32 copy anywhere.
    Saves half of every parameter-sized tensor; costs update precision (small updates round away),
    which `stochastic_rounding` (torchao's AdamW) recovers in expectation."""

    label = "Pure bf16"
    compute_dtype = "bf16"
    param_dtype = "bf16"

    def __init__(self, init_on_device: bool = False, stochastic_rounding: bool = False):
        super().__init__(init_on_device)
        self.stochastic_rounding = stochastic_rounding


class FP8(BF16):
    """bf16 autocast, and the Linear layers of the repeated decoder layers in float8: torchao's
    float8 training with tensorwise scaling (one fp32 scale per tensor; e4m3 inputs and weights,
    e5m2 gradients), torch._scaled_mm on the GPU's fp8 tensor cores. Saves: autocast's bf16 copies
    of those layers' weights (a float8 layer casts the fp32 weight to fp8 per use and keeps the fp32
    one for backward), against bf16; activations are as under bf16 (it saves its bf16 input).
    Buys: about twice bf16's matmul throughput. The LM head, the attention and the norms stay in
    bf16 (torchtitan keeps the output layer out too), and so does any Linear whose sizes are not
    multiples of 16 (what _scaled_mm takes). MFU is against the bf16 peak, so a faster fp8 run
    reads as an MFU gain, not as a smaller denominator."""

    label = "fp8 matmuls (torchao)"

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.frozen_base:  # torchao would swap the adapters' own small Linears too, and the frozen
            # base gains nothing it keeps: refused rather than half applied
            raise Invalid("precision=fp8 converts the model's Linear layers to float8 for training them; "
                          "with adapters (peft) the base is frozen: use precision=bf16 or bf16_pure")
        require_fp8_gpu(plan, "precision=fp8")
        if importlib.util.find_spec("torchao") is None:
            raise Invalid("precision=fp8 needs torchao: pip install torchao")

    def fp8_weights(self, layer: nn.Module) -> int:
        """Each is cast to fp8 per use (a transient a quarter of its fp32 size), and its backward keeps
        the fp32 weight itself. Not yet measured on a GPU."""
        return sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear) and fp8_sized(m))

    def convert(self, model: nn.Module, adapter) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        inside = adapter.layers + "."
        return convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda m, fqn: fqn.startswith(inside) and fp8_sized(m))


def fp8_sized(linear: nn.Module) -> bool:
    """torch._scaled_mm's rule: both dimensions of the weight multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0
