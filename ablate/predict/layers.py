"""What one decoder layer keeps for backward, per model family: the analytic model's activations.

A family's layer is described by its sizes (`Arch`, read from the model option) and one function
giving the bytes it keeps for backward beyond its input. Three layouts cover the shipped families:
- gpt2: ablate's GPT-2 (LayerNorm, fused qkv, GELU MLP of 4h, learned positions, tied head).
- llama: Llama, Qwen2, Mistral as transformers writes them (RMSNorm, separate q/k/v projections
  with grouped-query K/V heads, rotary, SwiGLU MLP of three matrices, tied or untied head); Qwen3
  is this layer with an RMSNorm on each query and key head (qk_norm). The mixtures of experts
  Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are this layer with a routed block of SwiGLU experts in
  place of the MLP (`_experts`).
- neox: GPT-NeoX / Pythia (LayerNorm, fused qkv, partial rotary, attention and MLP in parallel
  off one residual, GELU MLP, untied head).
Any other layout raises Unmodelled, and the job falls back to predict=trace.

Units: `sb` tokens of the micro-batch; `r` bytes/element of the residual stream (the parameter
dtype, fp32 under autocast, the compute dtype under FSDP's mixed precision); `c` of the compute
dtype (what Linear, SDPA and the activation produce); `ln` of what a norm keeps of its input: the
input itself (r), or a 4-byte copy when CUDA autocast runs LayerNorm in fp32 on a 16-bit stream
(RMSNorm always upcasts: 4).
Attention is SDPA everywhere: no (T, T) score matrix is stored, and its output is laid out (B, T,
heads, head_dim) already, so the output projection keeps that very tensor as its input. The one
exception is `math_sdpa`: where no fused CUDA kernel takes the call, SDPA's math backend keeps
the (T, T) probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.predict.timeline import Unmodelled

# Mixtures of experts as transformers 5 writes them, and the config key of one expert's width
MOE = {"mixtral": "intermediate_size", "olmoe": "intermediate_size", "qwen2_moe": "moe_intermediate_size",
       "qwen3_moe": "moe_intermediate_size"}
LLAMA_LIKE = ("llama", "qwen2", "mistral", "qwen3", *MOE)
# RMSNorm on q and on k before rotary: over each head's head_dim, or over the whole projection
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}


@dataclass(frozen=True)
class Arch:
    """A family's sizes, as the layer functions need them."""

    kind: str  # gpt2 | llama | neox
    layers: int
    hidden: int
    heads: int
    kv_heads: int  # key/value heads (grouped-query attention); = heads without it
    head_dim: int
    inter: int  # MLP hidden width (4h in GPT-2; SwiGLU's gate and up width in Llama; one expert's)
    vocab: int
    tied: bool  # the LM head is the token embedding
    head_rows: int  # the LM head's rows: vocab, or more where GPT-2's pad_vocab_to pads them
    qk_norm: str = ""  # QK_NORM's "head" or "proj"; "" without
    experts: int = 0  # a mixture of experts' experts per layer; 0: a dense MLP
    top_k: int = 0  # the experts each token is routed to
    shared_inter: int = 0  # Qwen2-MoE's shared expert beside them: a dense SwiGLU MLP this wide
    fp32_routing: bool = False  # Mixtral keeps the routing weights in fp32; the others cast them to the logits'


@dataclass(frozen=True)
class Training:
    """What of one decoder layer trains (the peft option's answer, ablate/techniques/peft.py): its
    attention's and MLP's linear layers "full" (their weights), "adapter" (frozen, a LoRA branch of
    rank `rank` beside each) or "frozen"; whether the norms' weights train; whether its input
    needs a gradient (not in layer 0 over a frozen embedding: nothing before the first adapter
    keeps anything for backward); `dropout` on the adapters' input."""

    attn: str = "full"
    mlp: str = "full"
    norms: bool = True
    input_grad: bool = True
    rank: int = 0
    dropout: bool = False
    dora: bool = False  # DoRA's magnitude beside each adapter

    @property
    def full(self) -> bool:
        return self == Training(input_grad=self.input_grad) and self.input_grad


FULL = Training()


def arch_of(family) -> Arch:
    """The sizes of a model option (ablate/models/), as the family gives them (Family.arch);
    Unmodelled for a layout not described here."""
    return family.arch()


def hf_arch(hf) -> Arch:
    """The sizes of a transformers config `hf` whose layers this module describes; else Unmodelled."""
    kind = getattr(hf, "model_type", None)
    if kind in LLAMA_LIKE or kind == "gpt_neox":
        if "sliding_attention" in (getattr(hf, "layer_types", None) or ()):  # SDPA then takes a (T, T) mask
            raise Unmodelled(f"no analytic memory model for model_type={kind} with sliding-window layers")
        heads = hf.num_attention_heads
        sizes = {"inter": hf.intermediate_size, **(_moe_sizes(hf) if kind in MOE else {})}
        return Arch("llama" if kind in LLAMA_LIKE else "neox", hf.num_hidden_layers, hf.hidden_size, heads,
                    getattr(hf, "num_key_value_heads", None) or heads,
                    getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
                    tied=bool(hf.tie_word_embeddings), head_rows=hf.vocab_size, qk_norm=QK_NORM.get(kind, ""), **sizes)
    raise Unmodelled(f"no analytic memory model for model_type={kind}")


def _moe_sizes(hf) -> dict:
    """A mixture of experts' Arch fields; Unmodelled where its layers are not all alike (dense
    layers among the sparse ones) or its router does more than route."""
    kind = hf.model_type
    if getattr(hf, "mlp_only_layers", None) or (getattr(hf, "decoder_sparse_step", None) or 1) != 1:
        raise Unmodelled(f"no analytic memory model for model_type={kind} with dense layers among the experts' "
                         f"(mlp_only_layers, decoder_sparse_step)")
    for key in ("router_jitter_noise", "clip_qkv"):  # in-place noise and clamps keep more
        if getattr(hf, key, None):
            raise Unmodelled(f"no analytic memory model for model_type={kind} with {key}={getattr(hf, key)}")
    return {"experts": hf.num_experts, "top_k": hf.num_experts_per_tok,
            "inter": getattr(hf, MOE[kind]),
            "shared_inter": getattr(hf, "shared_expert_intermediate_size", None) or 0,
            "fp32_routing": kind == "mixtral"}


def math_sdpa(a: Arch, device: str, c: int) -> bool:
    """Whether SDPA runs its math backend, on CUDA, for this layer: grouped-query heads (transformers
    passes enable_gqa=True where there is no mask and head_dim <= 256) in fp32. Flash and cuDNN take
    16-bit inputs only, and the memory-efficient kernel refuses grouped-query heads (torch's
    sdp_utils.cpp). CPU's flash kernel takes both. fp32 Mixtral at 4 x 512 tokens measured 5.9% over
    the fused-kernel prediction (benchmarks/results/NVIDIA-H200/moe.md)."""
    return device == "cuda" and c == 4 and a.kind == "llama" and a.kv_heads < a.heads and a.head_dim <= 256


def _full(a: Arch, sb: int, r: int, c: int, ln: int, seq: int, tr: Training = FULL) -> tuple[float, dict]:
    """The layout's (bytes kept, parts); `seq`: the sequence length where SDPA runs its math backend,
    else 0; `tr`: what of the layer trains."""
    full, parts = _llama(a, sb, r, c, ln, seq) if a.kind == "llama" else _FULL[a.kind](a, sb, r, c, ln)
    if tr == FULL:
        return full, parts
    if a.kind not in _TRAINED or a.experts or a.qk_norm:
        raise Unmodelled(f"no analytic memory model for adapters on a {a.kind} layer"
                         f"{' of experts' if a.experts else ''}{' with q/k norms' if a.qk_norm else ''}")
    if tr.dora and a.kind == "gpt2":  # measured 2-6% apart on CPU, moving with the collector's timing
        raise Unmodelled("no analytic memory model for DoRA on GPT-2's biased Linears (the output less its "
                         "bias is one more tensor per Linear)")
    if tr.dora and r != c:
        raise Unmodelled("no analytic memory model for DoRA under autocast (its fp32 magnitude turns each adapted "
                         "Linear's output fp32, which the layers after it take in that dtype)")
    change = _TRAINED[a.kind](a, sb, r, c, ln, tr)
    parts = {k: max(v + change.get(k, 0.0), 0.0) for k, v in parts.items()}
    return full + sum(change.values()), parts


def layer_saves(a: Arch, option, index: int, sb: int, r: int, c: int, ln: int, seq: int = 0,
                tr: Training = FULL) -> tuple[float, float]:
    """(bytes layer `index` keeps for backward beyond its input under checkpoint `option`, bytes it
    keeps without recompute). Its input is the previous layer's output, counted there as r·sbh.
    `seq`: the sequence length where SDPA runs its math backend (`math_sdpa`), else 0; `tr`: what
    of the layer trains."""
    full, parts = _full(a, sb, r, c, ln, seq, tr)
    kept = getattr(option, "kept", None)
    if kept is None:
        raise Unmodelled(f"no memory model for checkpoint option {type(option).__name__} (it has no kept())")
    saved = kept(index, full, parts)
    if saved == 0 and a.kind == "llama":  # the whole layer recomputed from its input, which the
        full += sb * a.hidden * r * (r != 4)  # checkpoint holds: the first norm's fp32 copy replaces nothing
    return saved, full


def mlp_saves(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training = FULL) -> float:
    """Bytes a layer's MLP keeps for backward (freed as soon as the MLP's backward is done)."""
    return _full(a, sb, r, c, ln, 0, tr)[1]["mlp"]


def _gpt2(a: Arch, sb: int, r: int, c: int, ln: int) -> tuple[float, dict]:
    """In units of s·b·h: ln_1 out 1c, qkv 3c (q, k, v are views of it), SDPA out 1c, x + attn 1ln
    (kept by ln_2), ln_2 out 1c, c_fc out 4c, GELU out 4c = 15, plus its input (ln_1 keeps its
    own copy when ln != r, and the input then dies with the block: hence ln - r more); LayerNorm
    mean and rstd (2·s·b fp32 each LayerNorm) and SDPA's log-sum-exp (s·b·heads fp32)."""
    sbh = sb * a.hidden
    stats, lse = 2 * 2 * sb * 4, sb * a.heads * 4
    full = (1 + 3 + 1 + 1 + 4 + 4) * sbh * c + sbh * ln + sbh * (ln - r) + stats + lse
    return full, {"attn": 4 * sbh * c + lse, "mlp": 8 * sbh * c, "norm": stats,
                  "matmul": (3 + 1 + 4 + 1 + 1) * sbh * c + lse}


def _llama(a: Arch, sb: int, r: int, c: int, ln: int, seq: int = 0) -> tuple[float, dict]:
    """RMSNorm (transformers' LlamaRMSNorm) upcasts its input to fp32 and keeps it, the rsqrt
    (s·b fp32) and the normalised input in the input dtype; its output goes on to the
    projections. Attention keeps q and k after rotary (new tensors: q·cos + rotate_half(q)·sin
    keeps only the shared cos and sin), v (a view of v_proj's output), SDPA's output and
    log-sum-exp; K and V have kv_heads heads, and SDPA takes them as they are (enable_gqa).
    SwiGLU keeps gate and up outputs, SiLU's output and the product: 4 of (s·b·inter). Under
    autocast, rotary's q·cos promotes q to the stream's fp32, and SDPA keeps its own casts of q and k.
    Per layer: ln_1's fp32 input (a copy when r != 4: the layer input then dies), normalised and
    output; attention; x + attn in fp32 (kept by ln_2: itself when r == 4, else a copy); ln_2's
    normalised and output; the MLP (or a mixture of experts: `_experts`).
    SDPA's math backend (`seq` > 0, `math_sdpa`) keeps, in place of the log-sum-exp, the scaled q,
    k and v widened to every query head, and the softmax's (B, heads, T, T) output; under ops
    recompute, the scores' matmul output (as large) in place of the log-sum-exp."""
    sbh, q, kv = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.kv_heads * a.head_dim
    lse, rsqrt = sb * a.heads * 4, sb * 4
    probs = sb * a.heads * seq * c  # (B, heads, T, T): s·b·heads·T
    sdpa, sdpa_matmul = (3 * q * c + probs, probs) if seq else (lse, lse)
    norm = sbh * r + rsqrt  # kept by one RMSNorm beyond its fp32 input and its output
    attn = (q + 2 * kv + q) * c + sdpa  # q, k after rotary; v; SDPA out; lse (or the math backend's)
    # q_norm and k_norm (RMSNorm over each head, or OLMoE's over the whole projection): the
    # projection's output in fp32 (itself in fp32, else a copy), the rsqrt (one fp32 per token and
    # head, or per token) and the normalised values in the projection's dtype, which the weight
    # multiplies. Recomputed, such a norm keeps only its input, which the projection makes anyway (c).
    rsqrts = {"head": sb * (a.heads + a.kv_heads) * 4, "proj": 2 * sb * 4}.get(a.qk_norm, 0)
    qk = (q + kv) * (4 + c) + rsqrts if a.qk_norm else 0
    qk_recomputed = qk - (q + kv) * c if a.qk_norm else 0
    attn += qk
    # SwiGLU: gate and up (each casting ln_2's output under autocast), down; or the experts
    if a.experts:
        mlp, ln_2_casts, mlp_matmul = _experts(a, sb, r, c)
    else:
        mlp, ln_2_casts, mlp_matmul = 4 * sb * a.inter * c, 2, 2 * sb * a.inter * c + sbh * c
    # Under autocast on an fp32 stream (r != c) each projection casts the norm's output itself
    # (autocast caches casts of weights only): q, k and v keep 3 copies of ln_1's, the MLP its own of ln_2's.
    outs = (3 + ln_2_casts if r != c else 1 + 1) * sbh * c
    full = sbh * (4 - r) + 2 * norm + outs + attn + sbh * 4 + mlp
    # Recomputed, the MLP keeps ln_2's output (r) in place of its casts of it (when r != c).
    mlp_recomputed = mlp + (ln_2_casts * sbh * c - sbh * r if r != c else 0) if a.experts else mlp
    # A recomputed RMSNorm keeps only its input (r): its fp32 copy (when r != 4) goes too, and the
    # input it keeps is one that would have been kept or copied anyway.
    return full, {"attn": attn, "mlp": mlp_recomputed, "norm": 2 * (sbh * 4 + rsqrt), "qk_norm": qk_recomputed,
                  # q/k/v and o projections, SDPA; the MLP's
                  "matmul": (q + 2 * kv + q + sbh) * c + sdpa_matmul + mlp_matmul}


def _experts(a: Arch, sb: int, r: int, c: int) -> tuple[float, int, float]:
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


def forward_temp(a: Arch, sb: int, r: int, c: int = 4, tr: Training = FULL) -> float:
    """Made and dropped inside a layer's forward even when it keeps everything (bytes): a mixture
    of experts' routing-weighted outputs, (S, h), and their copy put back in token order (for
    Mixtral in fp32, its routing weights' dtype). A dense MLP's all stay for backward: 0."""
    if tr.dora and "adapter" in (tr.attn, tr.mlp):
        return max(adapter_temp(a, sb, r, c) if tr.mlp == "adapter" else 0.0, dora_temp(a, sb, c, tr))
    if tr.mlp == "adapter":
        return adapter_temp(a, sb, r, c)
    return 2 * sb * a.top_k * a.hidden * (4 if a.fp32_routing else r) if a.experts else 0.0


def dora_temp(a: Arch, sb: int, c: int, tr: Training) -> float:
    """Made and dropped in forward by DoRA (peft's DoraLinearLayer) on a Llama layer, beyond what the
    layer keeps once done: the larger of
    - its weight norm, taken per adapted Linear from the adapter's dense update B·A (an (in, in)
      identity run through the branch), the base weight, the update scaled and their sum, all
      (out, in);
    - at up_proj, the magnitude's three elementwise terms over its (tokens, inter) output, alive at
      their sum, less what the MLP still makes after it (its output, the product's, down_proj's
      two DoRA outputs)."""
    q, h = a.heads * a.head_dim, a.hidden
    linears = {"attn": [(h, q), (q, h)], "mlp": [(h, a.inter), (a.inter, h)]}
    norm = max((n_in * n_in + 3 * n_in * n_out) * c for part in ("attn", "mlp") if getattr(tr, part) == "adapter"
               for n_in, n_out in linears[part])
    return max(norm, (a.inter - 2 * h) * sb * c) if tr.mlp == "adapter" else norm


def adapter_temp(a: Arch, sb: int, r: int, c: int) -> float:
    """Made and dropped while the MLP's last Linear runs its adapter: the base Linear's output,
    alive until the branch's is added to it; under autocast also peft's fp32 copy of the Linear's
    input for the fp32 adapter, the input itself beside that copy and the adapter's cast of it,
    and the MLP's own input, the second norm's fp32 output, held by the layer while its MLP runs."""
    sbh, widest = sb * a.hidden, sb * (4 * a.hidden if a.kind == "gpt2" else a.inter)
    if r == c:
        return sbh * c
    return widest * (4 + c) + sbh * (c + 4)


def recompute_grads(a: Arch, sb: int, r: int, c: int, tr: Training = FULL) -> float:
    """Gradients alive when a recomputed layer is run again (bytes): with an adapter on the MLP's
    last Linear, its first saved tensor is asked for only after its output's gradient was scaled
    for the branch (and, under autocast, cast to the compute dtype first)."""
    if tr.mlp != "adapter" or tr.dora:  # DoRA's last multiply asks for the base's saved output at once
        return 0.0
    return sb * a.hidden * c * (2 if r != c else 1)


def inner_temp(a: Arch, sb: int, c: int, r: int, g: int, tr: Training = FULL) -> float:
    """The MLP's widest tensors alive together inside a layer's forward and backward (bytes), `g`
    bytes per gradient element: GPT-2's gradients of c_fc's and GELU's outputs (s·b·4h each),
    Llama's of gate's and up's. A mixture of experts', the largest of (measured on CPU, tiny
    Mixtral, Qwen-MoE, OLMoE):
    - where its backward starts, three (S, h) gradients in the dtype the routing weights'
      multiply made (fp32 with Mixtral's fp32 weights): the reordered one, the one before the
      reorder, and the multiply's own;
    - at gate_up's backward: the gradient of its output (S·2i) and both expert weights' whole
      gradients, (experts, 3·i, h), less the down output and product already freed (S·(h + i));
    - the shared expert's gate and up gradients, as Llama's."""
    if a.experts:
        S, h, i, weighted = sb * a.top_k, a.hidden, a.inter, 4 if a.fp32_routing else r
        grads = a.experts * 3 * i * h * g
        return max(3 * S * h * weighted, 2 * S * i * r + grads - S * (h + i) * r, 2 * sb * a.shared_inter * c)
    if tr.dora and tr.mlp == "adapter":  # down_proj's DoRA outputs are freed before gate's and up's
        # gradients exist; its own backward holds three (tokens, hidden) gradients with them alive
        return max(2 * sb * a.inter * c - 2 * sb * a.hidden * c, 3 * sb * a.hidden * c)
    return (1 if a.kind == "neox" else 2) * sb * a.inter * c


def _neox(a: Arch, sb: int, r: int, c: int, ln: int) -> tuple[float, dict]:
    """GPT-NeoX with its parallel residual: both LayerNorms read the layer input (kept once, as r;
    each keeps an ln-byte copy when ln != r) and keep their mean and rstd; attention keeps the
    fused qkv output (v is a view of it), q and k after rotary (new whole tensors: the rotated
    part concatenated with the rest), SDPA's output and log-sum-exp, and a contiguous copy of that
    output as the dense projection's input (SDPA reads the strided v and writes (B, heads, T,
    head_dim), which the reshape to (B, T, C) must copy); the MLP keeps its (s·b·inter)
    hidden before and after GELU; the two LayerNorm outputs (c) go on to the projections."""
    sbh = sb * a.hidden
    stats, lse = 2 * 2 * sb * 4, sb * a.heads * 4
    attn = (3 + 1 + 1 + 1 + 1) * sbh * c + lse
    mlp = 2 * sb * a.inter * c
    full = 2 * sbh * c + attn + mlp + 2 * sbh * (ln - r) + 2 * stats
    # qkv, SDPA, dense, the MLP's two projections
    return full, {"attn": attn, "mlp": mlp, "norm": 2 * stats, "matmul": (3 + 1 + 1 + 1) * sbh * c + lse + sb * a.inter * c}


_FULL = {"gpt2": _gpt2, "llama": _llama, "neox": _neox}


# Adapters (ablate/techniques/peft.py, peft's LoRA layers): what changes from a fully trained layer.
# A frozen Linear keeps its weight for its input's gradient, never its input; an adapted one's
# branch keeps that input for A's gradient (the very tensor, unless each branch makes a copy of its
# own: its dropout's, or under autocast, where peft casts the input to the adapter's fp32 and
# autocast casts it back, so each branch keeps its own 16-bit copy), the dropout's mask (1 byte),
# and the (tokens, rank) product for B's. A frozen norm weight's multiply keeps nothing.


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
            kept += n * numel * (c + (1 if tr.dropout else 0)) - max(before, 0)
    return kept + linears * sb * tr.rank * c + (2 * sb * width * c if tr.dora else 0)


def _frozen(inputs: list[tuple]) -> float:
    """Bytes a frozen, unadapted part no longer keeps of its inputs."""
    return -sum(max(before, 0) for _, _, before, _ in inputs)


def _llama_trained(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training) -> dict:
    """Llama's change by part. Inputs of the attention's Linears: ln_1's output (q, k, v; kept once,
    or as three autocast casts), SDPA's output (o; SDPA keeps it anyway); of the MLP's: ln_2's
    output (gate, up; once, or two casts), the SwiGLU product (down; kept for it alone). Frozen
    RMSNorm weights drop each norm's normalised input (r)."""
    sbh, q, inter = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.inter
    autocast = r != c
    copies = autocast or tr.dropout
    attn_in = [(sbh, 3, (3 if autocast else 1) * sbh * c, (a.heads + 2 * a.kv_heads) * a.head_dim), (q, 1, -1, a.hidden)]
    mlp_in = [(sbh, 2, (2 if autocast else 1) * sbh * c, 2 * a.inter), (inter, 1, inter * c, a.hidden)]
    change = {"norm": 0.0 if tr.norms else -2 * sbh * r}
    for part, inputs in (("attn", attn_in), ("mlp", mlp_in)):
        mode = getattr(tr, part)
        change[part] = (_branches(tr, sb, c, inputs, copies) if mode == "adapter"
                        else _frozen(inputs) if mode == "frozen" else 0.0)
    change["matmul"] = 0.0
    return change


def _gpt2_trained(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training) -> dict:
    """ablate's GPT-2 by part. Inputs: ln_1's output (c_attn), SDPA's output (attention's c_proj;
    SDPA keeps it anyway), ln_2's output (c_fc), GELU's output (the MLP's c_proj), each read by one
    Linear. LayerNorm keeps its input and statistics whether its weight trains or not."""
    sbh = sb * a.hidden
    h = a.hidden
    attn_in = [(sbh, 1, sbh * c, 3 * h), (sbh, 1, -1, h)]
    mlp_in = [(sbh, 1, sbh * c, 4 * h), (4 * sbh, 1, 4 * sbh * c, h)]
    change = {}
    for part, inputs in (("attn", attn_in), ("mlp", mlp_in)):
        mode = getattr(tr, part)
        change[part] = (_branches(tr, sb, c, inputs, r != c or tr.dropout) if mode == "adapter"
                        else _frozen(inputs) if mode == "frozen" else 0.0)
    return change


_TRAINED = {"llama": _llama_trained, "gpt2": _gpt2_trained}


def unfed(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training) -> float:
    """Bytes layer 0 keeps in full training that it does not when its input needs no gradient (a
    frozen embedding), beyond its input itself: its first norm's copy of the input and statistics,
    under autocast the casts of the weights that input meets before an adapter (a frozen Linear
    keeps its weight only for an input that needs a gradient), and where the attention is frozen,
    all it and the second norm keep."""
    sbh, w = sb * a.hidden, a.hidden * a.heads * a.head_dim  # a (h, h) projection's elements (q, o)
    autocast = r != c
    if a.kind == "llama":
        norm, qkv = sbh * (4 - r) + sb * 4, w + 2 * a.hidden * a.kv_heads * a.head_dim
        attn = _llama(a, sb, r, c, ln)[1]["attn"]
    else:  # gpt2: LayerNorm keeps its input (a copy when ln != r), mean and rstd
        norm, qkv, attn = sbh * (ln - r) + 2 * sb * 4, 3 * w, 4 * sbh * c + sb * a.heads * 4
    dead = norm + (qkv * c if autocast else 0)
    if tr.attn == "frozen":  # nothing in the attention needs a gradient: the MLP's adapters are the first
        ln_2 = sbh * 4 + sb * 4 if a.kind == "llama" else sbh * ln + 2 * sb * 4
        dead += attn + ln_2 + ((w + 2 * a.hidden * a.inter) * c if autocast else 0)
    return dead
