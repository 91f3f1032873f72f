"""What the RMSNorms' backward makes and drops beyond what a layer keeps (`Sizes`' norm fields):
fitted op by op against MemTracker on CPU, family by family, where each is the step's peak.
Notation as in ablate/predict/layers.py: `sbh` elements of the hidden states, `sb` tokens, `r`
and `c` bytes per element of the stream and of the compute."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ablate.predict.adapters import Training
    from ablate.predict.arch import Arch
    from ablate.predict.sizes import Sizes


def norm_temps(sizes: Sizes, a: Arch, sbh: int, sb: int, r: int, c: int, tiled: bool, tr: Training) -> None:
    """Set a layer's norms' backward temporaries, the final norm's, and a post-MLP norm's (what it
    keeps, and what it makes first in its layer's backward), for an MLP `tiled` or not and the
    layer trained as `tr` says."""
    # RMSNorm's backward in fp32: the gradient of its normalised input and of its fp32 input, two
    # (B, T, h) fp32 tensors, and on a 16-bit stream the fp32 casts of both gradients besides
    # (fitted on CPU: tiny Llama, seq 4,096, tiled MLP under block recompute, where this is the peak)
    sizes.norm_backward_temp = sbh * 4 * (2 if r == 4 else 4) if a.kind == "llama" else 0.0
    sizes.final_norm_backward_temp = sizes.norm_backward_temp  # the same RMSNorm, before the last layer's
    if a.kind == "llama" and r == c == 4:  # in fp32 the final one holds five (B, T, h) tensors at its widest, the
        # variance's gradient three of them, once the head's gradient and the normalised values a trained weight
        # kept are gone: one more than a layer's own norms (measured op by op on CPU: tiny Llama at hidden 256,
        # 2,048 tokens, trained and frozen norms, where it is DoRA's peak without recompute)
        sizes.final_norm_backward_temp += sbh * 4
    if tiled and a.kind == "llama" and r != 4:  # a tiled MLP's joined 16-bit input gradient, and beside it the
        # norm's fp32 copy of it (fitted on CPU: tiny Llama at hidden 256 in pure bf16, 4 slices)
        sizes.norm_backward_temp += sbh * (4 - r)
    if a.kind == "llama" and r == 4 and c != 4:  # under autocast the head's 16-bit input gradient meets the fp32
        # stream there: 6·sbh bytes more (fitted on CPU: tiny Llama and Gemma 3, hidden 256, batch 4 and 8)
        sizes.final_norm_backward_temp += sbh * (4 + c)
    fp32_throughout = 4 * sbh * 4  # an RMSNorm fp32 throughout: four (B, T, h) fp32 tensors at its widest
    # on an fp32 stream Gemma's is Llama's (fitted on CPU: tiny OLMo 2 and Gemma)
    if a.post_norm or a.fp32_norm and r != 4:
        sizes.norm_backward_temp = fp32_throughout
        # the final one: the head's 16-bit gradient cast up beside, its fp32 normalised values gone first
        sizes.final_norm_backward_temp = sizes.norm_backward_temp + sbh * (r - 4)
    if a.sandwich and c != 4:  # its post-norms read a 16-bit projection output: fp32 throughout, as OLMo 2's,
        # and the one on attention's output runs after the pre-MLP norm's backward (fitted on CPU: tiny Gemma 3)
        sizes.norm_backward_temp = max(sizes.norm_backward_temp, fp32_throughout)
    if a.out_norms:  # its norm on the MLP's output runs first in the layer's backward, beside everything the layer
        # keeps: fp32 throughout, whatever the stream's dtype (fitted on CPU: tiny OLMo 2 and Gemma 3)
        sizes.out_norm_backward_temp = max(sizes.norm_backward_temp, fp32_throughout)
        sizes.out_norm_saved = 2 * sbh * 4 + sb * 4  # its fp32 input and normalised values, the rsqrt
    if a.kind == "llama" and not tr.norms:  # the gradient of the second norm's output lives through it; a
        # trained weight's multiply frees the normalised input it kept (r) as its backward starts,
        # making room for it, a frozen one kept none (fitted on CPU: tiny Llama, LoRA over a tiled MLP)
        normalised = sbh * (4 if a.fp32_norm else r)
        sizes.norm_backward_temp += normalised
        sizes.final_norm_backward_temp += normalised  # the final norm's alike (its weight frozen too)
        if a.out_norms:  # and the post-norm's, whose normalised values are fp32 and not kept
            sizes.out_norm_backward_temp += sbh * 4
            sizes.out_norm_saved -= sbh * 4
    if a.out_norms and sizes.forward_temp:  # the norm on the MLP's output keeps nothing yet while the
        sizes.forward_tail -= sizes.out_norm_saved  # adapters' temporaries are alive
