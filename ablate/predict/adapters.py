"""What adapters (ablate/techniques/peft.py, peft's LoRA layers) change in what a decoder layer keeps
for backward, against the fully trained layer of ablate/predict/layers.py, and the tensors they
make and drop on the way. Notation as there: `sb` tokens, `r`, `c` and `ln` bytes per element.

A frozen Linear keeps its weight for its input's gradient, never its input; an adapted one's branch
keeps that input for A's gradient (the very tensor, unless each branch makes a copy of its own: its
dropout's, or under autocast, where peft casts the input to the adapter's fp32 and autocast casts it
back, so each branch keeps its own 16-bit copy), the dropout's mask (`Training.dropout` bytes an
element), and the (tokens, rank) product for B's. A frozen norm weight's multiply keeps nothing.
Measured against MemTracker on CPU: benchmarks/results/cpu/peft_predict.md and
peft_targets_predict.md (every target, dropout, recompute option and precision).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ablate.techniques import Unmodelled

if TYPE_CHECKING:
    from ablate.predict.arch import Arch


@dataclass(frozen=True)
class Training:
    """What of one decoder layer trains (the peft option's answer, ablate/techniques/peft.py): its
    attention's and MLP's linear layers "full" (their weights), "adapter" (frozen, a LoRA branch of
    rank `rank` beside each) or "frozen"; whether the norms' weights train; `dropout` on the
    adapters' input. (Layer 0 over a frozen embedding keeps less again: `unfed`.)"""

    attn: str = "full"
    mlp: str = "full"
    norms: bool = True
    rank: int = 0
    dropout: int = 0  # bytes per element of what dropout on the adapters' input keeps beside its output (0: none)
    dora: bool = False  # DoRA's magnitude beside each adapter


FULL = Training()


def change(a: Arch, sb: int, r: int, c: int, tr: Training) -> dict:
    """Bytes by part ("attn", "mlp", "norm", "matmul") a layer that trains as `tr` says keeps beyond
    the fully trained layer's; Unmodelled for a layout without a model here."""
    if a.kind not in _TRAINED or a.experts or a.fused_proj or a.post_norm:
        raise Unmodelled(f"no analytic memory model for adapters on a {a.kind} layer"
                         f"{' of experts' if a.experts else ''}{' with post-norms only' if a.post_norm else ''}"
                         f"{' with fused projections' if a.fused_proj else ''}")
    # GPT-2 under DoRA measures within 0.2% of this model without recompute, but 2.5% over it with
    # block recompute, where the recomputed weight norm's graph, lora_B(lora_A(eye)), stays in the
    # checkpoint's frame until the layer's backward ends; the model has no term for that yet.
    if tr.dora and a.kind == "gpt2":
        raise Unmodelled("no analytic memory model for DoRA on GPT-2's biased Linears (the output less its "
                         "bias is one more tensor per Linear)")
    if tr.dora and r != c:
        raise Unmodelled("no analytic memory model for DoRA under autocast (its fp32 magnitude turns each adapted "
                         "Linear's output fp32, which the layers after it take in that dtype)")
    return _TRAINED[a.kind](a, sb, r, c, tr)


def forward_temp(a: Arch, sb: int, r: int, c: int, tr: Training, input_kept: bool = False,
                 linears_wrapped: bool = False) -> float:
    """Made and dropped inside an adapted layer's forward (bytes): the adapters' own (`adapter_temp`;
    `input_kept`: a recompute wrapper around the MLP keeps its input; `linears_wrapped`: one around
    each Linear keeps that Linear's) and DoRA's (`dora_temp`)."""
    own = adapter_temp(a, sb, r, c, tr.dropout, input_kept, linears_wrapped) if tr.mlp == "adapter" else 0.0
    return max(own, dora_temp(a, sb, r, c, tr, input_kept) if tr.dora else 0.0)


def dora_inner_temp(a: Arch, sb: int, c: int) -> float:
    """The MLP's widest tensors in an adapted Llama layer's backward under DoRA: down_proj's DoRA
    outputs are freed before gate's and up's gradients exist; its own backward holds three (tokens,
    hidden) gradients with them alive."""
    return max(2 * sb * a.inter * c - 2 * sb * a.hidden * c, 3 * sb * a.hidden * c)


def dora_temp(a: Arch, sb: int, r: int, c: int, tr: Training, input_kept: bool = False) -> float:
    """Made and dropped in forward by DoRA (peft's DoraLinearLayer) on a Llama layer, beyond what the
    layer keeps once done: the larger of
    - its weight norm, taken per adapted Linear from the adapter's dense update B·A (an (in, in)
      identity run through the branch), the base weight, the update scaled and their sum, all
      (out, in);
    - at up_proj, the magnitude's three elementwise terms over its (tokens, inter) output, alive at
      their sum, less what the MLP still makes after it (its output, the product's, down_proj's
      two DoRA outputs);
    - at down_proj's magnitude multiply, its identity and dense update, which peft's forward holds
      to its end, and two (tokens, hidden) tensors: the base output scaled, and in a recompute the
      branch's scaled output gradient (forward makes more there, but holds less of the layer).
    A 16-bit residual stream is alive beside the MLP's (RMSNorm keeps only its fp32 copy), but not
    in the recompute of a wrapper around the MLP alone (`input_kept`), whose forward keeps less
    (measured op by op on CPU: tiny Llama at hidden 256, each recompute option, pure bf16). In a
    whole layer's recompute the branch's scaled output gradient is alive, as `recompute_grads`
    counts for LoRA, and down_proj's branch output, which the layer keeps, is not made yet: the
    two cancel."""
    q, h = a.heads * a.head_dim, a.hidden
    linears = {"attn": [(h, q), (q, h)], "mlp": [(h, a.inter), (a.inter, h)]}
    norm = {part: max((n_in * n_in + 3 * n_in * n_out) * c for n_in, n_out in linears[part])
            for part in ("attn", "mlp") if getattr(tr, part) == "adapter"}
    if tr.mlp != "adapter":
        return norm["attn"]
    residual = sb * h * r if a.kind == "llama" and r != 4 and not input_kept else 0.0
    down_end = (a.inter * a.inter + a.inter * h + 2 * sb * h) * c
    mlp = max(norm["mlp"], (a.inter - 2 * h) * sb * c, down_end) + residual
    return max(norm.get("attn", 0.0), mlp)


def adapter_temp(a: Arch, sb: int, r: int, c: int, dropout: int = 0, input_kept: bool = False,
                 linears_wrapped: bool = False) -> float:
    """Made and dropped while the MLP's last Linear runs its adapter: the base Linear's output,
    alive until the branch's is added to it. Where the branches copy their inputs (autocast's casts,
    dropout's outputs) nothing keeps the Linear's input, nor the MLP's own input (the second norm's
    output, in the stream's dtype) unless a recompute wrapper around the MLP does (`input_kept`):
    the layer holds both while its MLP runs, and a 16-bit residual stream besides, which RMSNorm
    keeps only as its fp32 copy (not in the recompute of such a wrapper, whose forward runs
    without the layer around it). Under autocast also peft's fp32 copy of the Linear's input for the
    fp32 adapter and, with dropout, the dropout's fp32 output until A has cast it (measured op by op
    on CPU: tiny Llama at hidden 256, with and without dropout, each precision)."""
    sbh, widest = sb * a.hidden, sb * (4 * a.hidden if a.kind == "gpt2" else a.inter)
    temp = sbh * c + (sbh * r if a.kind == "llama" and r != 4 and not input_kept else 0.0)
    if r != c or dropout:
        temp += 0.0 if linears_wrapped else widest * c + (0.0 if input_kept else sbh * r)
    if r != c:
        temp += widest * 4 * (2 if dropout else 1)
    return temp


def forward_tail(a: Arch, sb: int, r: int, c: int, tr: Training) -> float:
    """Made in a layer's first forward after the last tensor it saves, so a recompute, which stops
    there, never makes it (bytes): the branch's output on the MLP's last Linear and its scaled copy,
    (tokens, hidden) each, beside `adapter_temp` less the dropout's output under autocast, gone by
    then (fitted on CPU: tiny Llama at hidden 256, 512 to 1,024 tokens; ablate's GPT-2, whose
    c_proj adds a bias, measures without it)."""
    if tr.mlp != "adapter" or tr.dora or a.kind != "llama":
        return 0.0
    gone = sb * a.inter * 4 if tr.dropout and r != c else 0.0
    return max(2 * sb * a.hidden * c - gone, 0.0)


def recompute_grads(a: Arch, sb: int, r: int, c: int, tr: Training = FULL, mlp_alone: bool = False) -> float:
    """Gradients alive when a recomputed layer is run again (bytes): with an adapter on the MLP's
    last Linear, its first saved tensor is asked for only after its output's gradient was scaled
    for the branch, beside that output's gradient in its own dtype (c) where it is not the
    residual stream's: autocast's cast of it, or the gradient a norm on the MLP's output (Gemma
    3's) made, whose backward runs before a wrapper around the MLP alone is recomputed. Inside a
    whole layer's recompute that norm is what asks, before any of the MLP's backward: only its
    output's gradient is alive, upcast to fp32 where the norm computes in fp32 from 16 bits."""
    if tr.mlp != "adapter":
        return 0.0
    if a.out_norms and not mlp_alone:
        return sb * a.hidden * 4 if c != 4 else 0.0
    own = sb * a.hidden * c if r != c or a.out_norms and mlp_alone else 0.0
    if tr.dora:  # DoRA's scaled gradient is counted against what its recompute has not made yet
        return own
    return own + sb * a.hidden * c


def attention_recompute_temp(a: Arch, sb: int, r: int, c: int, tr: Training) -> float:
    """Alive at the end of an adapted attention's recompute on its own, beyond what it keeps (bytes):
    the output projection's base output, and the gradient of that projection's output scaled for
    the branch, which asked for the recompute; beside that gradient in its own dtype where it is
    not the residual stream's (autocast's cast of it, or the gradient a norm on the attention's
    output made, whose backward has freed the fp32 input that norm kept)."""
    if tr.attn != "adapter":
        return 0.0
    sbh = sb * a.hidden
    return sbh * c * (2 + (r != c or a.out_norms)) - (sbh * 4 if a.out_norms else 0.0)


def dequant_temp(a: Arch, sb: int, r: int, c: int, tr: Training, weight: float) -> float:
    """The MLP's backward at its 4-bit output projection (bytes beyond what the layer keeps), where
    the projection's `weight` is dequantised for its input's gradient: the branch's gradient of that
    input made already, the input itself, or dropout's copy and mask, gone with the branch's
    backward (a frozen projection's gradient alone); the gradient of the projection's output where
    it is not the residual stream's (a norm on the MLP's output made it) not yet gone. Beside few
    tokens, more than the MLP's widest gradients (measured op by op on CPU: tiny Llama and Gemma 3
    QLoRA at 64 and 128 tokens a micro-batch, 4-7% short without)."""
    inter = sb * a.inter
    own = sb * a.hidden * c if r != c or a.out_norms else 0.0
    if tr.mlp == "adapter":
        return weight + 2 * inter * c - inter * (c + tr.dropout) + own
    return weight + inter * c + own


def _branches(tr: Training, sb: int, c: int, inputs: list[tuple], copies: bool) -> float:
    """Bytes the adapted Linears reading `inputs` keep beyond what full training kept of those
    inputs. Each input as (its elements, the Linears reading it, the bytes full training kept of
    it, or -1 where something else keeps it anyway, the Linears' summed output width): each
    Linear's (tokens, rank) product, and under DoRA the base's and the branch's outputs, which the
    magnitude's gradient needs."""
    kept, linears, width = 0.0, 0, 0
    for numel, n, before, outs in inputs:
        linears, width = linears + n, width + outs
        if copies:  # each branch its own copy (and dropout mask); else the input itself, as before
            kept += n * numel * (c + tr.dropout) - max(before, 0)
    return kept + linears * sb * tr.rank * c + (2 * sb * width * c if tr.dora else 0)


def _by_part(tr: Training, sb: int, c: int, inputs: dict, copies: bool) -> dict:
    """The change of each part ("attn", "mlp": the inputs of its Linears, as `_branches` takes them)
    as it trains: an adapted one's branches and the inputs they copied, a frozen one's lost keeps."""
    change = {}
    for part, ins in inputs.items():
        mode = getattr(tr, part)
        change[part] = _branches(tr, sb, c, ins, copies) if mode == "adapter" else 0.0
        change[f"{part}_linear_inputs"] = _linear_inputs(ins) if mode == "adapter" and copies else 0.0
        if mode == "frozen":
            change[f"{part}_input"], change[part] = _frozen(ins)
    return change


def _linear_inputs(inputs: list[tuple]) -> float:
    """Bytes of `inputs` that the branches' copies stood in for (`_branches`), which a recompute
    wrapper around each base Linear keeps again: the Linear's input, the same tensor for all."""
    return sum(max(before, 0) for _, _, before, _ in inputs)


def _frozen(inputs: list[tuple]) -> tuple[float, float]:
    """Bytes a frozen, unadapted part no longer keeps of its inputs: (of the part's own input, which
    a recompute wrapper around the part keeps instead; of the rest)."""
    first, *rest = (-max(before, 0) for _, _, before, _ in inputs)
    return first, sum(rest)


def _llama_trained(a: Arch, sb: int, r: int, c: int, tr: Training) -> dict:
    """Llama's change by part. Inputs of the attention's Linears: ln_1's output (q, k, v; kept once,
    or as three autocast casts), SDPA's output (o; SDPA keeps it anyway); of the MLP's: ln_2's
    output (gate, up; once, or two casts), the SwiGLU product (down; kept for it alone). Frozen
    RMSNorm weights drop each norm's normalised input (r)."""
    sbh, q, inter = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.inter
    autocast = r != c
    copies = autocast or bool(tr.dropout)
    attn_in = [(sbh, 3, (3 if autocast else 1) * sbh * c, (a.heads + 2 * a.kv_heads) * a.head_dim), (q, 1, -1, a.hidden)]
    mlp_in = [(sbh, 2, (2 if autocast else 1) * sbh * c, 2 * a.inter), (inter, 1, inter * c, a.hidden)]
    # frozen, each RMSNorm's weight multiply keeps none of its normalised values: the pre-norms'
    # (fp32: fp32_norm), the post-norms' (fp32: they read 16-bit outputs), the q/k norms' (in the
    # projections' dtype, or fp32)
    change = {"norm": 0.0 if tr.norms else -2 * sbh * (4 if a.fp32_norm else r) - (2 * sbh * 4 if a.sandwich else 0)}
    qk = 0.0 if tr.norms or not a.qk_norm else -sb * (a.heads + a.kv_heads) * a.head_dim * (4 if a.fp32_norm else c)
    change.update(_by_part(tr, sb, c, {"attn": attn_in, "mlp": mlp_in}, copies))
    change["attn"] += qk
    change["qk_norm"] = qk  # (of attention's: WITHIN)
    change["matmul"] = 0.0
    return change


def _gpt2_trained(a: Arch, sb: int, r: int, c: int, tr: Training) -> dict:
    """ablate's GPT-2 by part. Inputs: ln_1's output (c_attn), SDPA's output (attention's c_proj;
    SDPA keeps it anyway), ln_2's output (c_fc), GELU's output (the MLP's c_proj), each read by one
    Linear. LayerNorm keeps its input and statistics whether its weight trains or not."""
    sbh = sb * a.hidden
    h = a.hidden
    attn_in = [(sbh, 1, sbh * c, 3 * h), (sbh, 1, -1, h)]
    mlp_in = [(sbh, 1, sbh * c, 4 * h), (4 * sbh, 1, 4 * sbh * c, h)]
    return _by_part(tr, sb, c, {"attn": attn_in, "mlp": mlp_in}, r != c or bool(tr.dropout))


_TRAINED = {"llama": _llama_trained, "gpt2": _gpt2_trained}
# parts that are bytes of another part (attention's, the MLP's), counted once in the layer's sum
WITHIN = ("qk_norm", "attn_linear_inputs", "mlp_linear_inputs")


def unfed(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training, attn: float, wrapped: tuple = ()) -> float:
    """Bytes layer 0 keeps in full training that it does not when its input needs no gradient (a
    frozen embedding), beyond its input itself: its first norm's copy of the input and statistics,
    under autocast the casts of the weights that input meets before an adapter (a frozen Linear
    keeps its weight only for an input that needs a gradient), the first adapters' dropout masks
    (kept only for their input's gradient), and where the attention is frozen, all it (`attn`: what
    the frozen attention keeps) and the norms after it keep. Of what a recompute wrapper keeps
    in place of a part (`wrapped`: of "norm", "attn", "mlp"), that part's own bytes were never counted."""
    sbh, w = sb * a.hidden, a.hidden * a.heads * a.head_dim  # a (h, h) projection's elements (q, o)
    autocast = r != c
    if a.kind == "llama":
        norm, qkv = sbh * (4 - r) + sb * 4, w + 2 * a.hidden * a.kv_heads * a.head_dim
    else:  # gpt2: LayerNorm keeps its input (a copy when ln != r), mean and rstd
        norm, qkv = sbh * (ln - r) + 2 * sb * 4, 3 * w
    # (a wrapped part's frozen weights' casts go after its forward anyway: Step.uncached_cast)
    attn_cast, mlp_cast = ("attn" not in wrapped) * c * autocast, ("mlp" not in wrapped) * c * autocast
    dead = (0 if "norm" in wrapped else norm) + qkv * attn_cast
    first = "attn" if tr.attn == "adapter" else "mlp"
    if first not in wrapped:
        dead += {"attn": 3, "mlp": 2}[first] * sbh * tr.dropout if a.kind == "llama" else sbh * tr.dropout
    if tr.attn == "frozen":  # nothing in the attention needs a gradient: the MLP's adapters are the first
        ln_2 = sbh * 4 + sb * 4 if a.kind == "llama" else sbh * ln + 2 * sb * 4
        ln_2 += sbh * 4 + sb * 4 if a.sandwich else 0.0  # and Gemma 3's norm on attention's output
        dead += attn + ln_2 + w * attn_cast + 2 * a.hidden * a.inter * mlp_cast
    return dead
