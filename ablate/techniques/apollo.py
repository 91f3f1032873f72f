"""optimizer=apollo, apollo_mini: apollo-torch's APOLLOAdamW, which scales each decoder-layer
matrix's raw gradient by how much Adam changes its random low-rank projection, per channel
(APOLLO) or per tensor (APOLLO-Mini, rank 1).

What each option keeps and makes per step is read off the package's code (apollo-torch 1.0.3:
apollo_torch/apollo.py, random_projector.py, svd_projector.py); the projection, the groups and
the checks are GaLore's (ablate/techniques/projected.py).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ablate.techniques import Invalid
from ablate.techniques.projected import Projected, StepLoop, showing_projectors, side_of


class APOLLO(Projected):
    """apollo-torch's APOLLOAdamW: Adam's two states of each decoder-layer matrix kept for its
    gradient's random projection onto `rank` directions (`proj: random`, remade every
    `update_proj_gap` steps from a seed, no SVD); the ratio of Adam's update norm to the projected
    gradient's norm, per channel of the longer side (`scale_type: channel`) or over the whole
    tensor (`tensor`), scales the raw gradient, which is the update (times sqrt(scale)), under
    Fira's norm-growth limiter.

    Saves: 8 bytes/param of Adam state becomes 8·rank/min(m, n) for an (m, n) matrix (Llama 8B's
    4096-wide matrices at rank 256: 0.5 bytes/param; APOLLO-Mini at rank 1: 0.002). Spends: the
    random projector, rank·min(m, n) in the parameters' dtype per matrix, and per step the
    projection, a full-size scaled gradient (two during the limiter's division) and a
    channel-sized scaling vector per matrix. The embeddings, head, norms and biases keep Adam's
    8 bytes/param.

    Each projected matrix is a group of its own carrying its seed, APOLLO's own numbering of
    the parameters (matrices first, as one group would give them): an optimizer built per
    parameter (in backward, or torchao's CPU offload) would otherwise number every matrix 1 and
    draw the same projections for all matrices of a shape. Only `proj_type: std` is accepted:
    the channel scaling norms the projection along the dimension std keeps.

    Defaults are the authors' (apollo-torch README and their C4 scripts for LLaMA 130M-7B):
    rank 256, scale 1, channel-wise, random projection, update_proj_gap 200, lr 0.01, no weight
    decay; betas and eps are the package's."""

    name = "apollo"
    package, version, module = "apollo-torch", "1.0.3", "apollo_torch"
    proj_types = ("std",)
    reads_values = True  # the limiter compares a norm with 1.01 in Python

    def __init__(self, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int = 256, update_proj_gap: int = 200, scale: float = 1.0,
                 proj_type: str = "std", proj: str = "random", scale_type: str = "channel", scale_front: bool = False,
                 disable_nl: bool = False, in_backward: bool = False):
        super().__init__(lr, betas, eps, weight_decay, rank, update_proj_gap, scale, proj_type, in_backward)
        self.proj, self.scale_type, self.scale_front, self.disable_nl = proj, scale_type, scale_front, disable_nl

    @property
    def label(self) -> str:
        return f"APOLLO r={self.rank}"

    def check_values(self) -> None:
        super().check_values()
        if self.proj not in ("random", "svd"):
            raise Invalid(f"optimizer.proj={self.proj!r} is not one of random, svd")
        if self.scale_type not in ("channel", "tensor"):
            raise Invalid(f"optimizer.scale_type={self.scale_type!r} is not one of channel, tensor")

    def projection(self) -> dict:
        return {**super().projection(), "proj": self.proj, "scale_type": self.scale_type}

    def param_groups(self, model: nn.Module) -> list[dict]:
        """One group per layer matrix with its seed, then the decayed (dim >= 2) and undecayed rest."""
        matrices, rest = self.layer_matrices(model)
        return [*({"params": [p], "weight_decay": self.weight_decay, "seed": i, **self.projection()}
                  for i, p in enumerate(matrices, start=1)),
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": self.weight_decay},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return _seeded(showing_projectors(self.imported("APOLLOAdamW")))

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "scale_front": self.scale_front, "disable_nl": self.disable_nl}

    # The analytic predictor's questions: states as GaLore's (zeros_like the projected gradient), plus
    # the limiter's 0-d norm of the last update (`scaled_grad`), in the parameters' dtype.

    def kept_rank(self, shape: tuple) -> int:
        """A random projector keeps `rank` directions whatever the matrix's size; an SVD no more than min(m, n)."""
        return self.rank if self.proj == "random" else super().kept_rank(shape)

    def projector_bytes(self, shape: tuple, d: int) -> float:
        """random_projector.py: randn (rank, n) for a `right` projector, (m, rank) for a `left` one,
        divided by sqrt(rank) (a new tensor) and cast to the gradient's dtype."""
        if self.proj != "random":
            return super().projector_bytes(shape, d)
        m, n = shape
        return self.rank * (n if side_of(shape, self.proj_type) == "right" else m) * d

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        if self.in_layers(name, shape):
            return 2 * self.low_rank(shape) * d + self.projector_bytes(shape, d) + (0 if self.disable_nl else d)
        return 2 * math.prod(shape) * d

    def remake_temp(self, shape: tuple, d: int) -> float:
        """A random projector's making (get_orthogonal_matrix): an fp32 copy of a 16-bit gradient (its
        shape is all it reads), randn's fp32 matrix and its quotient by sqrt(rank), the cast of a
        16-bit one; then next_seed's 15 int64 draws."""
        if self.proj != "random":
            return self.svd_temp(shape, d)
        m, n = shape
        size = self.rank * (n if side_of(shape, self.proj_type) == "right" else m)
        loop = StepLoop()
        if d != 4:
            loop.set("matrix", m * n * 4)
        loop.set("randn", size * 4)
        loop.set("proj", size * 4)
        loop.live.pop("randn")
        if d != 4:
            loop.set("cast", size * d)
        return max(loop.peak, 15 * 8)

    def step_temp(self, groups: list[list[tuple]], d: int, device: str) -> float:
        """apollo.py's loop over every group (one per tensor in backward), for a projected matrix:
        grad = its projection (remaking the projector first where the step does); Adam's denom and
        norm_grad (low-rank); the scaling factor (channel: two norms of the longer side's length
        and their sum's quotient; tensor: 0-d); scaled_grad = p.grad * factor (full size), under
        the limiter divided by it into another while the first is alive; norm_grad = scaled_grad.
        A plain tensor takes Adam's denom and norm_grad, with the last matrix's scaled_grad still
        bound. The first step draws the projectors but has no limiter to divide by yet: on a GPU,
        whose measured peak covers it, the larger of it and a later step."""
        later = self.loop(groups, d, remake=self.update_proj_gap == 1, first=False)
        return later if device == "cpu" else max(later, self.loop(groups, d, remake=True, first=True))

    def loop(self, groups: list[list[tuple]], d: int, remake: bool, first: bool) -> float:
        """One step's temporaries at their largest (`step_temp`). The limiter's 0-d quotient is
        counted as a tensor: it is 1.0, a float, when the norm did not grow."""
        loop = StepLoop()
        for group, projected in zip(groups, self.projected_groups(groups)):
            for shape in group:
                numel = math.prod(shape)
                loop.set("grad", 0.0)  # p.grad itself
                if not projected:
                    self.adam_step(loop, numel, d)
                    continue
                if remake:
                    loop.made(self.remake_temp(shape, d))
                loop.set("grad", self.low_rank(shape) * d)
                self.adam_step(loop, self.low_rank(shape), d)
                channel = max(shape) if self.scale_type == "channel" else 1
                loop.set("grad_scaling_factor", channel * d, inside=2 * channel * d)
                loop.set("scaled_grad", numel * d)
                if not self.disable_nl and not first:
                    loop.set("scaled_grad_norm", d)
                    loop.made(2 * d)  # its quotient by the last one, over the limiter's sum
                    loop.set("limiter", d, inside=d)  # that quotient / 1.01
                    loop.set("scaled_grad", numel * d)
                    loop.made(d)  # the new state["scaled_grad"] (replacing the old one)
                loop.live["norm_grad"] = 0.0  # norm_grad = scaled_grad: freed when scaled_grad is rebound
        return loop.peak


class APOLLOMini(APOLLO):
    """APOLLO-Mini: APOLLO at rank 1 with one scaling factor per tensor, the authors' extreme
    setting. Saves: nearly all of Adam's state for the layer matrices, 8·1/min(m, n) bytes/param
    (SGD-like: Llama 8B's 4096-wide matrices keep 0.002 bytes/param) plus a rank-1 projector.
    Spends: what APOLLO spends per step, with a 0-d scaling factor. Defaults: the authors'
    (rank 1, scale 128, tensor-wise; lr 0.01)."""

    name = "apollo_mini"

    def __init__(self, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, rank: int = 1, update_proj_gap: int = 200, scale: float = 128.0,
                 proj_type: str = "std", proj: str = "random", scale_type: str = "tensor", scale_front: bool = False,
                 disable_nl: bool = False, in_backward: bool = False):
        super().__init__(lr, betas, eps, weight_decay, rank, update_proj_gap, scale, proj_type, proj, scale_type,
                         scale_front, disable_nl, in_backward)

    @property
    def label(self) -> str:
        return "APOLLO-Mini" if self.rank == 1 else f"APOLLO-Mini r={self.rank}"


@functools.cache
def _seeded(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    class APOLLOAdamW(base):
        """The package's class, each projected parameter's seed its group's `seed`, set as it steps:
        the package sets seeds in its constructor, into a state that an optimizer holding several
        (ablate's InBackward) replaces with its own."""

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"] if "seed" in group else ():
                    self.state[p].setdefault("seed", group["seed"])
            return super().step(closure)

    return APOLLOAdamW
