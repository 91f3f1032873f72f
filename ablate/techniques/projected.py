"""The base of the projected-Adam options (GaLore: ablate/techniques/galore.py; APOLLO:
ablate/techniques/apollo.py): the decoder layers' matrices in one projected group, the rest plain
Adam, their checks, and `StepLoop`, which plays a package's step loop as the Python locals it binds,
for the analytic predictor's `step_temp`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import math

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
