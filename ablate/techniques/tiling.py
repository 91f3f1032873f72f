"""tiling group: layers computed over slices of the sequence, so that their widest tensors exist for
one slice at a time.

`mlp` is the tiled MLP of Arctic's long-sequence training (ALST, Snowflake 2025): each layer's MLP
runs over `chunks` slices of the sequence, each slice under torch's non-reentrant checkpoint, so
the (tokens x intermediate) tensors of one slice are alive at a time, in forward and again in
backward, where each slice is recomputed and differentiated in turn. The MLP keeps only its input.
It composes with every checkpoint option: under block recompute the recomputed layer tiles its MLP
again. An MLP sees each token on its own, so the slices give the untiled outputs exactly.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ablate.models import Adapter
from ablate.techniques import Invalid, Option, Plan, Unmodelled


class NoTiling(Option):
    """Every layer runs over the whole sequence at once."""

    label = "No tiling"

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        """Wraps the bare model's modules in place, before any recompute wrapper (ablate/build.py)."""
        return model

    def mlp_chunks(self, seq_len: int, hidden: int) -> int:
        """Slices of the sequence each MLP runs over (1: untiled); the predictor's question."""
        return 1

    def recomputed(self, seq_len: int) -> float:
        """The share of the model's matmul weights run again in backward at this sequence length,
        once applied (the step-time model's and HFU's question)."""
        return 0.0


class TiledMLP(NoTiling):
    """Each layer's MLP over `chunks` slices of the sequence, each recomputed in backward (0:
    ALST's rule, ceil(seq_len / hidden): slices about as long as the model is wide, so a slice's
    (tokens x intermediate) tensors are no larger than a (hidden x intermediate) weight).
    Saves: the MLP's (B, T, intermediate) tensors but one slice's. Spends: the MLP's forward again."""

    def __init__(self, chunks: int = 0):
        self.chunks = chunks

    @property
    def label(self) -> str:
        return f"Tiled MLP ({self.chunks} slices)" if self.chunks else "Tiled MLP"

    def check(self, plan: Plan) -> None:
        if self.chunks < 0:
            raise Invalid(f"tiling.chunks={self.chunks} must be >= 0 (0: ceil(seq_len / hidden size))")
        if self.chunks > plan.seq_len:
            raise Invalid(f"tiling.chunks={self.chunks} is more than seq_len={plan.seq_len} tokens")
        try:
            arch = self.family.arch() if self.family is not None else None
        except Unmodelled:
            arch = None
        if arch is not None and arch.experts:
            raise Invalid("tiling=mlp: a mixture of experts routes the tokens of the whole sequence together; "
                          "its block is not tiled (tiling=none)")

    def mlp_chunks(self, seq_len: int, hidden: int) -> int:
        return min(self.chunks or math.ceil(seq_len / hidden), seq_len)

    def recomputed(self, seq_len: int) -> float:
        return self._mlp_share if self.mlp_chunks(seq_len, self._hidden) > 1 else 0.0

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        layers = adapter.layer_list(model)
        # what each slice's recompute runs again, and the width _Tiles slices by (the residual stream's)
        self._mlp_share = adapter.matmul_weights([getattr(layer, adapter.mlp) for layer in layers]) \
            / adapter.matmul_weights([model])
        self._hidden = model.get_submodule(adapter.embedding).weight.shape[1]
        for layer in layers:
            setattr(layer, adapter.mlp, _Tiles(getattr(layer, adapter.mlp), self))
        return model


class _Tiles(nn.Module):
    """An MLP run over slices of its input's sequence (dim 1 of (B, T, hidden)). Its child keeps the
    name ablate/models/layout.py strips (WRAPPERS), so parameter names stay the bare model's."""

    def __init__(self, mlp: nn.Module, option: TiledMLP):
        super().__init__()
        self._tiled_module, self.option = mlp, option

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.option.mlp_chunks(x.shape[1], x.shape[-1])
        if n <= 1:
            return self._tiled_module(x)
        return torch.cat([checkpoint(self._tiled_module, piece, use_reentrant=False)
                          for piece in x.chunk(n, dim=1)], dim=1)
