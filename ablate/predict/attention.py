"""What an attention that keeps (T, T) matrices keeps and makes: the math backend's and the eager
paths' part of a layer's saved tensors and transients (ablate/predict/layers.py plays the rest).
Units as in layers.py: `sb` tokens, `c` bytes per element of the compute dtype."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ablate.techniques.attention import EAGER, FUSED, MATH

if TYPE_CHECKING:
    from ablate.predict.arch import Arch


@dataclass(frozen=True)
class Attention:
    """What a layer's attention keeps: FUSED, MATH or EAGER (the attention option's `saves`), and
    the sequence length, which the (T, T) matrices of the last two scale with."""

    kind: str = FUSED
    seq: int = 0
    fp32_softmax: bool = False  # an eager softmax in fp32 over 16-bit scores (transformers' always; autocast's)


def scores(a: Arch, sb: int, c: int, at: Attention, mask: float = 0) -> tuple[float, float]:
    """(bytes the math backend or an eager path keeps of attention beyond its output, what of it
    selective op recompute keeps: the scores' matmul output, as large as the probabilities).
    Math: q, k and v copies widened to every query head and the probabilities, in fp32 for 16-bit
    inputs. Eager: the same in the compute dtype, transformers' fp32 softmax output beside its
    16-bit cast; `mask`: bytes of a causal mask a layer keeps."""
    q, probs = sb * a.heads * a.head_dim, sb * a.heads * at.seq
    if at.kind == MATH:
        return 3 * q * 4 + probs * 4 if c != 4 else 3 * q * c + probs * c, probs * (4 if c != 4 else c)
    softmax = probs * 4 + probs * c if at.fp32_softmax and c != 4 else probs * c
    return 3 * q * c + softmax + mask, probs * c


def attention_temps(a: Arch, sb: int, c: int, r: int, ln: int, at: Attention) -> tuple[float, float]:
    """(bytes made and dropped in an attention's forward beyond what it keeps, ... in its backward
    beyond what the layer keeps less its MLP's): the (T, T) tensors of the math backend and eager
    paths, none for a fused kernel's O(T) ones. Forward: the scores beside the probabilities.
    Backward: the probabilities' gradient and the scores' (the softmax's backward), in the dtype
    the probabilities are in (fp32 for the math backend's 16-bit inputs); by then the second
    norm's output and what it keeps of its input are gone too."""
    if at.kind == FUSED:
        return 0.0, 0.0
    probs = sb * a.heads * at.seq * (4 if at.kind == MATH and c != 4 else c)
    grads = 2 * probs
    if at.kind == EAGER and at.fp32_softmax and c != 4:  # the fp32 softmax's gradient, cast back by its backward
        grads = sb * a.heads * at.seq * (4 + c)
    # its input and output (GPT-2); RMSNorm's fp32 input, normalised input (in the stream's dtype, or
    # fp32: fp32_norm) and output, or under autocast the MLP's two casts of that output in its place;
    # Gemma 3's norm on attention's output too (its fp32 input, normalised values and rsqrt)
    normalised = 4 if a.fp32_norm else r
    second_norm = sb * a.hidden * (ln + (normalised + (2 * c if r != c else c) if a.kind == "llama" else c))
    if a.sandwich:
        second_norm += sb * a.hidden * 8 + sb * 4
    return probs, grads - second_norm


def eager_mask(a: Arch, b: int, seq: int, c: int, at: Attention) -> float:
    """Bytes of the (B, 1, T, T) additive causal mask transformers makes for eager attention, in the
    compute dtype: an input of every layer, so a recompute wrapper keeps it through backward."""
    return b * seq * seq * c if at.kind == EAGER and a.kind == "llama" else 0.0
