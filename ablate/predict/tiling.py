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
    sizes). In backward the slices run last first, each recomputed and differentiated on its own:
    one slice's widest tensors (and, under autocast, its casts of the weights and of its input) beside
    - the gradient of the MLP's output, which the residual add casts to the compute dtype under
      autocast (or a post-norm on the output makes) and the slices read views of: whole until the
      last slice is done;
    - the input gradients of the slices done, kept until the last one joins them;
    - after the first slice, the sums of the weights' gradients (Step.backward);
    The forward's slices' outputs, joined at the end, are at most the output's size beside one slice."""
    a, c, r, sbh = shapes.arch, sizes.compute_bytes, sizes.stream_bytes, shapes.sbh
    # GPT-2's LoRA under autocast measured 3% over and 1.5% under this model (none and block recompute,
    # 4 slices, tiny GPT-2 on CPU); DoRA takes its weight norm again for every slice
    if tr != FULL and (tr.dora or r != c and a.kind != "llama"):
        raise Unmodelled("no analytic memory model for DoRA over a tiled MLP, nor for adapters over one under "
                         f"autocast on a {a.kind} layer (only the Llama layout's is modelled)")
    one = (sizes.inner_temp + sizes.mlp_saved) / n  # a slice's widest tensors
    tokens = -(-shapes.sb // n)  # a slice's
    if tr.mlp == "adapter" and tr.dropout and r != c:  # and, recomputed under autocast, the output projection
        # adapter's dropout output in fp32 until A has cast it (fitted on CPU: tiny Llama at hidden 256, 4 slices)
        one += tokens * a.inter * 4
    tail = tokens * a.inter * c  # ... of them, those its output projection's backward makes
    sizes.forward_temp = forward_temp(a, tokens, r, c, tr)  # an adapted MLP's, over one slice
    if r != c:  # autocast in each slice's recompute: its casts of the weights, and of the slice for each
        # projection that reads it (gate and up; Phi-3's one gate_up, GPT-2's c_fc)
        mlp = [name for name in shapes.linear_names if name in shapes.mlp_names]
        reads = sum(name.endswith("weight") and name not in shapes.mlp_out_names for name in mlp)
        one += reads * sbh * c / n + sum(shapes.param_numels[name] for name in mlp) * c
        tail += sum(shapes.param_numels[name] for name in shapes.linear_names if name in shapes.mlp_out_names) * c
    d_out = sbh * c if r != c or a.out_norms else 0.0  # made by the residual add's cast, or by a post-norm's backward
    sizes.inner_temp = max(sbh * c + one, 2 * sbh * c)  # the forward's outputs so far (then joined), or the backward's first slice
    later = (n - 1) / n * sbh * r + one  # the last slice's, the MLP's input kept through it
    sizes.inner_temp_later = max(d_out + later, 2 * sbh * r)
    # Under autocast the slices keep their casts of the input, not the input: one that a recompute
    # around the layer made goes as the last slice's recompute ends, before its output projection's backward
    before_last = (n - 2) / n * sbh * r + one if n > 2 else 0.0  # the last but one, unless that is the first
    remade = max(before_last, later - min(sbh * r, tail)) if r != c else later
    sizes.inner_temp_remade = max(d_out + remade, 2 * sbh * r)
    sizes.mlp_untiled, sizes.mlp_saved, sizes.tiled_mlp = sizes.mlp_saved, 0.0, True
