"""A mixture of experts' layer as transformers 5 runs it: what it keeps for backward, and its widest
moments in backward (the analytic model's part for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE; the
rest of their layer is Llama's, ablate/predict/layers.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ablate.predict.arch import Arch


def saves(a: Arch, sb: int, r: int, c: int) -> tuple[float, int, float]:
    """A mixture of experts as transformers 5 runs it (integrations/moe.py, grouped_mm): (bytes it
    keeps beyond ln_2's output, the casts of that output it keeps under autocast, the bytes of its
    matmuls' outputs). S = s·b·top_k (token, expert) pairs, sorted by expert.

    The experts multiply in their weights' dtype, which is the stream's (r): grouped_mm is not an
    autocast op, and transformers casts its input to the weights. They keep the gathered input
    (S·h), the gate_up output (S·2i), SiLU's output and the product (S·i each), and the down
    output (S·h) for the routing weights' multiply, with those weights (S) and three int64
    permutations of S (the sort, token of each pair, inverse). The router keeps its fp32 softmax
    (s·b·experts), top-k's indices, and where it renormalises the top-k weights (Mixtral always,
    the others with norm_topk_prob; counted always) them and their sum. Qwen2-MoE's shared expert
    is a SwiGLU MLP (4·s·b·shared, in c) whose output its sigmoid gate multiplies."""
    S, h, i = sb * a.top_k, a.hidden, a.inter
    weights = 4 if a.fp32_routing else c
    experts = S * (2 * h + 4 * i) * r + S * weights + 3 * S * 8
    router = sb * a.experts * 4 + sb * a.top_k * (8 + 4) + sb * 4
    shared = 4 * sb * a.shared_inter * c + sb * h * c + sb * c if a.shared_inter else 0
    casts = 1 + (3 if a.shared_inter else 0)  # the router's linear; the shared expert's gate_proj, up_proj and gate
    # outputs of the router's linear (c), gate_up and down (r), and the shared expert's four Linears (c)
    shared_out = (2 * a.shared_inter + h) * sb * c + sb * c if a.shared_inter else 0
    matmul = sb * a.experts * c + S * (2 * i + h) * r + shared_out
    return experts + router + shared, casts, matmul


def expert_moments(a: Arch, sb: int, r: int, g: int) -> list[tuple[float, float]]:
    """A mixture of experts' backward in a micro-step after the first, where each weight's new
    gradient is added into the kept one and freed (measured op by op on CPU: tiny Mixtral and
    OLMoE): (bytes beyond what the layer keeps, the new gradient's bytes) at each weight's
    gradient. At down's: the product's gradient (S·i) beside it, the down output freed and its
    gradient alive. At gate_up's: its output's gradient (S·2i), the down and gate_up outputs,
    SiLU's and the product gone (S·(h + 4i))."""
    S, h, i, e = sb * a.top_k, a.hidden, a.inter, a.experts
    return [(S * i * r, e * h * i * g), (2 * S * i * r - S * (h + 4 * i) * r, e * 2 * i * h * g)]


def inner_temp(a: Arch, sb: int, c: int, r: int, g: int, adding: bool = False) -> float:
    """The experts' widest tensors alive together inside a layer's backward beyond what it keeps
    (bytes), `g` bytes per gradient element: the largest of (measured on CPU, tiny Mixtral, Qwen-MoE,
    OLMoE):
    - where its backward starts, three (S, h) gradients in the dtype the routing weights'
      multiply made (fp32 with Mixtral's fp32 weights): the reordered one, the one before the
      reorder, and the multiply's own; with Qwen2-MoE's shared expert, whose gated output is added
      after the experts', the gate's share of the input's gradient besides (s·b·h in the compute
      dtype), and the gradient of the shared expert's output in place of that output (the sigmoid
      gate gone);
    - at SwiGLU's backward: the product's gradient and both its factors' (3 of S·i), beside
      down's whole weight gradient (experts, i, h), less the down output's gradient and the
      product already freed (S·(h + i)): the largest where top_k·inter is wide against hidden
      (OLMoE's 8 of 64);
    - at gate_up's backward: the gradient of its output (S·2i) and both expert weights' whole
      gradients, (experts, 3·i, h), less what SwiGLU's backward has freed too: the down output, the
      product, SiLU's output and gate_up's (S·(h + 4i); the widest at scale, where the weights'
      gradients dwarf the tokens');
    - `adding` (a later micro-step, whose weight gradients are added into the kept ones one at a
      time: `expert_moments`): the first two, down's new gradient added and gone by SwiGLU's;
    - the shared expert's gate and up gradients, as Llama's."""
    S, h, i, weighted, e = sb * a.top_k, a.hidden, a.inter, 4 if a.fp32_routing else r, a.experts
    freed = S * (h + i) * r
    at_swiglu = 3 * S * i * r + (0.0 if adding else e * i * h * g) - freed
    at_gate_up = 2 * S * i * r + e * 3 * i * h * g - S * (h + 4 * i) * r
    start = 3 * S * h * weighted + (sb * h * c - sb * c if a.shared_inter else 0)
    return max(start, at_swiglu, 0.0 if adding else at_gate_up, 2 * sb * a.shared_inter * c)
