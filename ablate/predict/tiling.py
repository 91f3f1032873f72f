"""What a tiled MLP (tiling=mlp, ablate/techniques/tiling.py) changes in one rank's sizes: the MLP
keeps nothing of its own for backward, and its widest tensors exist for one slice of the sequence at
a time, in forward and again in backward, where each slice is recomputed. Measured against
MemTracker on CPU: tests/test_tiling.py (bare layers at 4,096 tokens; LoRA and QLoRA beside them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ablate.predict.adapters import FULL, Training
from ablate.predict.layers import forward_temp
from ablate.techniques import Unmodelled

if TYPE_CHECKING:
    from ablate.predict.shapes import Shapes
    from ablate.predict.sizes import Sizes


def tile_mlp(sizes: Sizes, shapes: Shapes, tr: Training, n: int) -> None:
    """Each layer's MLP over `n` > 1 slices, sizes as the untiled layer's already (`c`, `r` in
    sizes). In backward one slice's MLP is recomputed and differentiated beside the slices' input
    gradients made so far (one (B, T, h) at most); at the end those gradients are joined, as in
    forward the slices' outputs are: two (B, T, h)."""
    a, c, r, sbh = shapes.arch, sizes.compute_bytes, sizes.stream_bytes, shapes.sbh
    if tr != FULL and (r != c or tr.dora):
        raise Unmodelled("no analytic memory model for adapters over a tiled MLP under autocast or DoRA (each slice "
                         "casts the adapters' inputs again; DoRA takes its weight norm again for every slice)")
    sizes.inner_temp = max(sbh * c + (sizes.inner_temp + sizes.mlp_saved) / n, 2 * sbh * c)
    sizes.forward_temp = forward_temp(a, -(-shapes.sb // n), r, c, tr)  # an adapted MLP's, over one slice
    if r != c:  # autocast in each slice's recompute: its casts of the slice for gate and up, and of the weights
        weights = sum(shapes.param_numels[name] for name in shapes.linear_names if name in shapes.mlp_names)
        sizes.inner_temp += 2 * sbh * c / n + weights * c
    sizes.mlp_untiled, sizes.mlp_saved, sizes.tiled_mlp = sizes.mlp_saved, 0.0, True
