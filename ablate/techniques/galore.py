"""optimizer=galore, galore8bit: galore-torch's GaLore, Adam over gradients projected onto a few
directions of each decoder-layer matrix; the base of APOLLO's options (ablate/techniques/apollo.py).

What each option keeps and makes per step is read off the package's code (galore-torch 1.0:
galore_torch/adamw.py, adamw8bit.py, galore_projector.py) and given in bytes to the analytic
predictor: `state_bytes` for the states, `step_temp` for the step's temporaries, played as the
package's step loop runs them (`StepLoop`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import math
import types
from unittest import mock

import torch
from torch import nn

from ablate.techniques import Invalid, Plan
from ablate.techniques.optimizer import TorchOptimizer


class StepLoop:
    """An optimizer's step loop as the Python locals it binds, in bytes: a name bound to a new
    tensor holds it, the tensor it held before is freed once the new one exists (Python evaluates
    before it rebinds), and a loop variable holds its tensor until it is bound again, into the
    next parameter's turn. `peak` is the most they held at once, over what the step started with."""

    def __init__(self):
        self.live: dict[str, float] = {}
        self.peak = 0.0

    def set(self, name: str, nbytes: float, inside: float = 0.0) -> None:
        """`name` = a new tensor of `nbytes`, made with `inside` bytes more alive while it is made."""
        self.peak = max(self.peak, sum(self.live.values()) + nbytes + inside)
        self.live[name] = nbytes

    def made(self, nbytes: float) -> None:
        """A tensor made and dropped with everything bound alive (an expression's intermediate)."""
        self.set("", nbytes)
        self.live.pop("")


def projected_shape(shape: tuple, rank: int, side: str) -> tuple:
    """The projected gradient of an (m, n) gradient: grad @ P.T, (m, rank), for a `right` projector
    (rank, n); P.T @ grad, (rank, n), for a `left` one (m, rank)."""
    m, n = shape
    return (m, rank) if side == "right" else (rank, n)


def side_of(shape: tuple, proj_type: str) -> str:
    """Which side the projector multiplies (galore_projector.py project()): `std` keeps the longer
    dimension (right when m >= n), `reverse_std` the shorter."""
    m, n = shape
    if proj_type in ("left", "right"):
        return proj_type
    return "right" if (m >= n) == (proj_type == "std") else "left"


class Projected(TorchOptimizer):
    """Base: the decoder layers' matrices in one projected group (rank, update_proj_gap, scale,
    proj_type), the embeddings, head, norms and biases in plain Adam groups (the authors' split:
    their nn.Linear layers in attention and MLP); matrices decayed, vectors not. The package is
    looked up, not imported, by `check` (the job process checks too); an import that fails in the
    worker is an invalid row naming the release ablate is built against."""

    package, version, module = "", "", ""  # pip name, pinned release, import name
    proj_types = ("std", "reverse_std", "left", "right")
    reads_values = False

    def __init__(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, rank: int,
                 update_proj_gap: int, scale: float, proj_type: str, in_backward: bool):
        super().__init__(lr, weight_decay, in_backward)
        self.betas, self.eps, self.rank = tuple(betas), eps, rank
        self.update_proj_gap, self.scale, self.proj_type = update_proj_gap, scale, proj_type

    def projection(self) -> dict:
        """The projected group's keys, as the package reads them."""
        return {"rank": self.rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale,
                "proj_type": self.proj_type}

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The layers' matrices (projected), then the decayed (dim >= 2) and undecayed rest."""
        matrices, rest = self.layer_matrices(model)
        return [{"params": matrices, "weight_decay": self.weight_decay, **self.projection()},
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": self.weight_decay},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]

    @staticmethod
    def projected_groups(groups: list) -> list[bool]:
        """Which of `param_groups`' groups are projected: all but the last two."""
        return [i < len(groups) - 2 for i in range(len(groups))]

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if importlib.util.find_spec(self.module) is None:
            raise Invalid(f"optimizer={self.name} needs {self.requirement()}: pip install {self.requirement()}")
        try:
            found = importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:  # importable, but not installed as a distribution
            found = "an unknown release"
        if found != self.version:
            raise Invalid(f"optimizer={self.name} needs {self.requirement()} (its memory model is read off that "
                          f"release), not {found}: pip install {self.requirement()}")
        if plan.sharded:
            raise Invalid(f"optimizer={self.name} projects whole matrices, which FSDP shards (parallel=fsdp, "
                          "fsdp_grad_op, fsdp1 and offload=params) split across ranks: use parallel=ddp or single")

    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def check_values(self) -> None:
        """Ours, without the package: importing it (and transformers) would cost the job seconds;
        its own checks (lr, betas) run in the worker."""
        if self.rank < 1:
            raise Invalid(f"optimizer.rank={self.rank} must be >= 1 (directions kept per matrix)")
        if self.update_proj_gap < 1:
            raise Invalid(f"optimizer.update_proj_gap={self.update_proj_gap} must be >= 1 (steps between projections)")
        if self.proj_type not in self.proj_types:
            raise Invalid(f"optimizer.proj_type={self.proj_type!r} is not one of {', '.join(self.proj_types)}")

    def imported(self, attr: str):
        """`attr` of the package, or an invalid row where it does not import (a torch or
        transformers it was not built for)."""
        try:
            return getattr(importlib.import_module(self.module), attr)
        except Exception as exc:  # noqa: BLE001  any failure of a third-party import is the same refusal
            raise Invalid(f"optimizer={self.name} needs {self.requirement()}, which fails to import here "
                          f"({type(exc).__name__}: {exc})") from None

    # The analytic predictor's questions. Every state is made `zeros_like` the (projected) gradient,
    # in the parameters' dtype `d`; `step` is a Python int, `projector` a Python object holding a tensor.

    def projector_bytes(self, shape: tuple, d: int) -> float:
        """The SVD projector kept per matrix (galore_projector.py get_orthogonal_matrix): in fp32 a
        view of torch.linalg.svd's whole U (m, q) or Vh (q, n), q = min(m, n), so that whole
        factor stays alive; for 16-bit gradients its first `rank` columns or rows cast to their dtype."""
        m, n = shape
        side, q = side_of(shape, self.proj_type), min(m, n)
        if d == 4:
            return q * n * 4 if side == "right" else m * q * 4
        return self.kept_rank(shape) * (n if side == "right" else m) * d

    def kept_rank(self, shape: tuple) -> int:
        """Directions a matrix keeps: an SVD has no more than min(m, n)."""
        return min(self.rank, *shape)

    def low_rank(self, shape: tuple) -> int:
        """Elements of a matrix's projected gradient (and of each of its Adam states)."""
        return math.prod(projected_shape(shape, self.kept_rank(shape), side_of(shape, self.proj_type)))

    def svd_temp(self, shape: tuple, d: int) -> float:
        """Bytes alive at once while a projector is remade (get_orthogonal_matrix): an fp32 copy of a
        16-bit gradient; U (m, q), S (q) and Vh (q, n) in fp32; diag(S[:r]) (r, r) and the product
        it feeds, U[:, :r] @ diag (m, r) for a `right` projector, diag @ Vh[:r] (r, n) for a `left`
        one (fp32, dropped unused); for a 16-bit gradient the kept factor cast to its dtype. The
        projector it replaces is a state (`state_bytes`), alive until replaced. Op outputs only:
        LAPACK's and cuSOLVER's own workspace is not counted (MemTracker cannot see it; not yet
        checked on a GPU)."""
        m, n = shape
        q, r, right = min(m, n), self.kept_rank(shape), side_of(shape, self.proj_type) == "right"
        loop = StepLoop()
        if d != 4:
            loop.set("matrix", m * n * 4)
        loop.set("factors", (m * q + q + q * n) * 4)  # one op's three outputs
        loop.set("diag", r * r * 4)
        loop.set("product", (m if right else n) * r * 4)
        loop.live.pop("diag")
        if d != 4:
            loop.set("cast", r * (n if right else m) * d)
        return loop.peak

    def remakes_projector(self, device: str) -> bool:
        """Whether the step the peak is read from remakes the projectors: every `update_proj_gap`
        steps from the first. On a GPU the measured peak covers the warm-up, whose first step makes
        them; on a CPU it is the traced step, the last warm-up step (the second by default), which
        remakes them only when every step does."""
        return device != "cpu" or self.update_proj_gap == 1

    def adam_step(self, loop: StepLoop, numel: int, d: int) -> None:
        """The plain Adam update's locals (adamw.py): denom = sqrt(exp_avg_sq) + eps,
        norm_grad = exp_avg / denom, both tensor-sized; the rest in place."""
        loop.set("denom", numel * d)
        loop.set("norm_grad", numel * d)


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
def showing_projectors(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`base` (a GaLore or APOLLO optimizer) with each projector's matrix also in its state, as
    `projector_matrix` (the same tensor, no copy). The package keeps it inside a Python object in
    the state, where nothing that reads an optimizer's state tensors finds it: MemTracker counted
    it only once the step touched it, so a traced step's peak in forward left it out."""

    class ShowingProjectors(base):
        def step(self, closure=None):
            states = [self.state[p] for g in self.param_groups for p in g["params"] if p in self.state]
            for state in states:  # else a projector remade in the step outlived it here
                state.pop("projector_matrix", None)
            loss = super().step(closure)
            for state in (self.state[p] for g in self.param_groups for p in g["params"] if p in self.state):
                if "projector" in state:
                    state["projector_matrix"] = state["projector"].ortho_matrix
            return loss

    ShowingProjectors.__name__ = ShowingProjectors.__qualname__ = base.__name__
    return ShowingProjectors


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
