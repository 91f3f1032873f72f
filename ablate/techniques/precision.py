"""precision group: the dtype of parameters and of the compute, and the loss scaler that goes with it."""
from __future__ import annotations

import contextlib

import torch

from ablate.techniques import Option


class FP32(Option):
    """Parameters, gradients, optimizer states and matmuls all in float32 (TF32 explicitly off)."""

    compute_dtype = "fp32"  # the column of the device peak table that MFU divides by
    param_dtype = torch.float32

    def setup(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type, enabled=False)
