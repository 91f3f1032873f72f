"""optimizer=galore, galore8bit: galore-torch's GaLore, Adam over gradients projected onto a few
directions of each decoder-layer matrix (the shared base: ablate/techniques/projected.py).

What each option keeps and makes per step is read off the package's code (galore-torch 1.0:
galore_torch/adamw.py, adamw8bit.py, galore_projector.py) and given in bytes to the analytic
predictor: `state_bytes` for the states, `step_temp` for the step's temporaries, played as the
package's step loop runs them (`StepLoop`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import types
from unittest import mock

import torch

from ablate.techniques import Invalid, Plan
from ablate.techniques.projected import Projected, StepLoop, showing_projectors


class GaLore(Projected):
    """galore-torch's GaLoreAdamW: each decoder-layer matrix's gradient is projected onto `rank`
    directions (the top singular vectors of its gradient, remade every `update_proj_gap` steps by
    an SVD), Adam runs there, and the update is projected back and scaled by `scale`.

    Saves: Adam's two states of an (m, n) matrix shrink to two of max(m, n) x rank (std
    projection), so 8 bytes/param becomes 8·rank/min(m, n) (Llama 8B's 4096-wide matrices at
    rank 128: 0.25 bytes/param). Spends: the projector, rank·min(m, n) per matrix in 16-bit
    parameters' dtype, but with fp32 gradients (fp32 or autocast parameters) a view that keeps the
    SVD's whole min(m, n)² factor alive: 4·min/max bytes/param, 4 for a square matrix, half of
    what Adam's states would take; an SVD per matrix every update_proj_gap steps; per step two
    matmuls per matrix and a full-size update (two during the back-projection). The embeddings,
    head, norms and biases keep Adam's 8 bytes/param.

    Defaults are the authors' (README, LLaMA 60M-1B on C4): rank 128, update_proj_gap 200,
    scale 0.25, lr 0.01, no weight decay; betas and eps are the package's."""

    name = "galore"
    package, version, module = "galore-torch", "1.0", "galore_torch"

    def __init__(self, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int = 128, update_proj_gap: int = 200, scale: float = 0.25,
                 proj_type: str = "std", in_backward: bool = False):
        super().__init__(lr, betas, eps, weight_decay, rank, update_proj_gap, scale, proj_type, in_backward)

    @property
    def label(self) -> str:
        return f"GaLore r={self.rank}"

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return showing_projectors(self.imported("GaLoreAdamW"))

    def optimizer_kwargs(self) -> dict:
        # correct_bias: the package's default (True); its deprecation warning is transformers' AdamW's.
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "no_deprecation_warning": True}

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        if self.in_layers(name, shape):
            return 2 * self.low_rank(shape) * d + self.projector_bytes(shape, d)
        return 2 * math.prod(shape) * d

    def step_temp(self, groups: list[list[tuple]], d: int, device: str) -> float:
        """adamw.py's loop over every group (one per tensor in backward): grad = its projection
        (low-rank; remaking the projector first where the step does), Adam's denom and norm_grad,
        then norm_grad = project_back(norm_grad): the full-size product and its scaled copy alive
        together, the low-rank three still bound."""
        loop, remake = StepLoop(), self.remakes_projector(device)
        for group, projected in zip(groups, self.projected_groups(groups)):
            for shape in group:
                numel = math.prod(shape)
                loop.set("grad", 0.0)  # p.grad itself
                if projected:
                    if remake:
                        loop.made(self.svd_temp(shape, d))
                    loop.set("grad", self.low_rank(shape) * d)
                self.adam_step(loop, self.low_rank(shape) if projected else numel, d)
                if projected:
                    loop.set("norm_grad", numel * d, inside=numel * d)
        return loop.peak


class GaLore8bit(GaLore):
    """galore-torch's GaLoreAdamW8bit: GaLore's projection around bitsandbytes' 8-bit Adam. Saves:
    the projected states in 8 bits, 2 bytes per projected element plus a 4-byte absmax per 256
    (Llama 8B's matrices at rank 128: about 0.07 bytes/param), and the same for the embeddings
    and head; tensors under `min_8bit_size` elements (projected size) keep two fp32 states.
    Spends: GaLore's projector, SVDs and back-projection, and per projected matrix a copy of the
    parameter each step, which then replaces it (the package swaps `p.data`).

    Two fixes to the package as released, both glue: galore-torch 1.0 passes bitsandbytes'
    arguments by position, and bitsandbytes 0.50, which no longer takes percentile_clipping and
    block_wise there, reads them as max_unorm=100 and skip_zeros=True (each update clipped to
    100x the norm of a parameter the step has just zeroed: a matrix with fp32 states never
    moves), so the arguments go by name (`args`); and its step calls torch.cuda.synchronize(),
    which fails without CUDA, so off CUDA that call is skipped (nothing to wait for). The
    authors' 7B recipe: rank 1024, update_proj_gap 500, lr 0.005."""

    name = "galore8bit"
    reads_values = True

    def __init__(self, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rank: int = 128, update_proj_gap: int = 200, scale: float = 0.25,
                 proj_type: str = "std", min_8bit_size: int = 4096, in_backward: bool = False):
        super().__init__(lr, betas, eps, weight_decay, rank, update_proj_gap, scale, proj_type, in_backward)
        self.min_8bit_size = min_8bit_size

    @property
    def label(self) -> str:
        return f"8-bit GaLore r={self.rank}"

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.states_on_host:
            raise Invalid("optimizer=galore8bit with offload=optimizer: GaLoreAdamW8bit leaves each projected "
                          "parameter's .grad its low-rank projection, and torchao's CPUOffloadOptimizer copies "
                          "the next gradient into that .grad; use optimizer=galore")

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return _galore_adamw8bit(showing_projectors(self.imported("GaLoreAdamW8bit")))

    def optimizer_kwargs(self) -> dict:
        # bitsandbytes' own defaults, by name; releases before 0.50 read percentile_clipping and block_wise too.
        args = types.SimpleNamespace(optim_bits=8, min_8bit_size=self.min_8bit_size, max_unorm=0.0, skip_zeros=False,
                                     percentile_clipping=100, block_wise=True)
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay, "args": args}

    def adam_state_bytes(self, numel: int) -> float:
        """bitsandbytes' two states of `numel` elements (Optimizer2State.init_state): uint8 codes and
        one fp32 absmax per 256 from `min_8bit_size` elements, else two fp32 tensors. Each optimizer
        makes its own two 256-entry fp32 quantisation maps: in backward (one optimizer per
        tensor) every 8-bit tensor has its own; else `shared_state_bytes` counts them once."""
        if numel < self.min_8bit_size:
            return 2 * numel * 4
        return 2 * numel + 2 * math.ceil(numel / 256) * 4 + (2 * 256 * 4 if self.in_backward else 0)

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        if self.in_layers(name, shape):
            return self.adam_state_bytes(self.low_rank(shape)) + self.projector_bytes(shape, d)
        return self.adam_state_bytes(math.prod(shape))

    def shared_state_bytes(self, largest: int) -> float:
        return 2 * 256 * 4 if largest >= self.min_8bit_size and not self.in_backward else 0.0

    def step_temp(self, groups: list[list[tuple]], d: int, device: str) -> float:
        """adamw8bit.py per projected matrix: grad = its projection; p.saved_data = a full copy of
        the parameter; p.data = a low-rank copy of grad (the parameter's own storage freed) and
        p.grad = grad (the full gradient freed; the low-rank one stays until zero_grad); bitsandbytes'
        update (one op: MemTracker sees none of its temporaries); then project_back's product and
        its scaled copy, added into the copy, which becomes p.data (the low-rank p.data freed)."""
        loop, remake = StepLoop(), self.remakes_projector(device)
        matrices = [s for g, projected in zip(groups, self.projected_groups(groups)) if projected for s in g]
        for i, shape in enumerate(matrices):
            numel, low = math.prod(shape), self.low_rank(shape) * d
            if remake:
                loop.made(self.svd_temp(shape, d))
            loop.set(f"{i} grad", low)  # held by p.grad once the step is over
            loop.set(f"{i} copy", numel * d)  # p.saved_data, then p.data
            loop.set(f"{i} p.data", low)
            loop.live[f"{i} p.data"] = low - numel * d  # the parameter's own storage freed
            loop.live[f"{i} grad"] = low - numel * d  # p.grad = grad: the full gradient freed
            loop.made(numel * d + numel * d)  # project_back: the product and its scaled copy
            loop.live[f"{i} p.data"] = -numel * d  # p.data = p.saved_data: the low-rank p.data freed
        return loop.peak


@functools.cache
def _galore_adamw8bit(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    class GaLoreAdamW8bit(base):
        """The package's class; off CUDA its step's torch.cuda.synchronize() is skipped."""

        def step(self, closure=None):
            on_cuda = any(p.is_cuda for g in self.param_groups for p in g["params"])
            skip = contextlib.nullcontext() if on_cuda else mock.patch.object(torch.cuda, "synchronize",
                                                                             lambda *a, **k: None)
            with skip:
                return super().step(closure)

    return GaLoreAdamW8bit
