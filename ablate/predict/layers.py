"""What one decoder layer keeps for backward, per model family: the analytic model's activations.

A family's layer is described by its sizes (`Arch`, ablate/predict/arch.py) and one function
giving the bytes it keeps for backward beyond its input. Three layouts cover the shipped families:
- gpt2: ablate's GPT-2 (LayerNorm, fused qkv, GELU MLP of 4h, learned positions, tied head).
- llama: Llama, Qwen2, Mistral as transformers writes them (RMSNorm, separate q/k/v projections
  with grouped-query K/V heads, rotary, SwiGLU MLP of three matrices, tied or untied head); so are
  SmolLM3 (rotary left out of every fourth layer: q and k are then kept as the projections made
  them, as many bytes) and Granite (its multipliers scale tensors nothing keeps). Qwen3 is this
  layer with an RMSNorm on each query and key head (qk_norm); Phi-3 with q, k and v one Linear's
  output and gate and up another's (fused_proj); OLMo 2 with its two norms on the attention's and
  the MLP's outputs instead of their inputs (post_norm, `_post_norm`); Gemma with GELU's gate in
  place of SiLU's (as many bytes) and norms that keep their normalised values in fp32 (fp32_norm);
  Gemma 3 with OLMo 2's post-norms beside the pre-norms (sandwich) and fp32 q/k norms per head,
  while its sliding-window layers see no mask (shorter than the window). The mixtures of experts
  Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are this layer with a routed block of SwiGLU experts in
  place of the MLP (ablate/predict/experts.py).
- neox: GPT-NeoX / Pythia (LayerNorm, fused qkv, partial rotary, attention and MLP in parallel
  off one residual, GELU MLP, untied head).
Any other layout raises Unmodelled, and the job falls back to predict=trace. A layer whose weights
train through adapters (peft) keeps what ablate/predict/adapters.py changes of this.

Units: `sb` tokens of the micro-batch; `r` bytes/element of the residual stream (the parameter
dtype, fp32 under autocast, the compute dtype under FSDP's mixed precision); `c` of the compute
dtype (what Linear, SDPA and the activation produce); `ln` of what a norm keeps of its input: the
input itself (r), or a 4-byte copy when CUDA autocast runs LayerNorm in fp32 on a 16-bit stream
(RMSNorm always upcasts: 4).
What attention keeps is the attention option's answer (ablate/techniques/attention.py `saves`):
- FUSED (a flash, memory-efficient or cuDNN kernel, CPU's flash): its output and a log-sum-exp per
  query and head; no (T, T) matrix. Its output is laid out (B, T, heads, head_dim) already, so the
  output projection keeps that very tensor as its input.
- MATH (SDPA's math backend): the softmax's (B, heads, T, T) output and its own copies of q, k and
  v (scaled, widened to every query head, contiguous), all in fp32 when the inputs are 16-bit (it
  upcasts them for accuracy); q, k and v themselves are then kept by nothing.
- EAGER (the family's own plain ops): the probabilities, and q, k and v as the matmuls take them;
  transformers' softmax runs in fp32 and casts back (both kept), ablate's GPT-2 keeps its (T, T)
  causal mask.
"""
from __future__ import annotations

from ablate.predict import adapters, experts
from ablate.predict.adapters import FULL, Training
from ablate.predict.arch import Arch
from ablate.predict.timeline import Unmodelled
from ablate.predict.attention import Attention, scores
from ablate.techniques.attention import FUSED

def _full(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention, tr: Training = FULL) -> tuple[float, dict]:
    """The layout's (bytes kept, parts); `at`: what attention keeps; `tr`: what of the layer trains."""
    if a.kind == "neox" and at.kind != FUSED:
        raise Unmodelled(f"no analytic memory model for gpt_neox's attention with {at.kind} kernels")
    full, parts = (_post_norm if a.post_norm else _FULL[a.kind])(a, sb, r, c, ln, at)
    if tr == FULL:
        return full, parts
    change = adapters.change(a, sb, r, c, tr)
    # (what a part's Linears keep of its input, less what a wrapper keeps of it, may go below 0)
    parts = {k: (v + change[k] if k.endswith("_input") else max(v + change[k], 0.0)) if k in change else v
             for k, v in parts.items()}
    parts.update({k: v for k, v in change.items() if k.endswith("_linear_inputs")})
    return full + sum(v for k, v in change.items() if k not in adapters.WITHIN), parts


def layer_saves(a: Arch, option, index: int, sb: int, r: int, c: int, ln: int, at: Attention = Attention(),
                tr: Training = FULL, tiled_mlp: bool = False) -> tuple[float, float]:
    """(bytes layer `index` keeps for backward beyond its input under checkpoint `option`, bytes it
    keeps without recompute). Its input is the previous layer's output, counted there as r·sbh.
    `at`: what attention keeps; `tr`: what of the layer trains; `tiled_mlp`: the MLP runs in
    recomputed slices (tiling=mlp), so it keeps nothing but its input, which its norm makes."""
    full, parts = _full(a, sb, r, c, ln, at, tr)
    if tiled_mlp:  # the slices' checkpoints keep the norm's output (r) in place of the MLP's casts of it
        full += sb * a.hidden * r - parts["mlp_input"] - parts["mlp"]
        parts = {**parts, "matmul": parts["matmul"] - parts["mlp_matmul"], "mlp": 0.0, "mlp_matmul": 0.0}
    kept = getattr(option, "kept", None)
    if kept is None:
        raise Unmodelled(f"no memory model for checkpoint option {type(option).__name__} (it has no kept())")
    saved = kept(index, full, parts)
    ops = getattr(option, "saves_op_outputs", False)
    if ops and not tiled_mlp and not a.out_norms:
        # Selective op recompute keeps every matmul's output in its cache and hands each back as the
        # recompute reaches it; the recompute stops at the last tensor backward needs, the input of
        # the layer's last matmul, whose output, needed by nothing, then stays cached until the
        # layer's backward ends (measured op by op on CPU: tiny Llama, Pythia). A post-norm after
        # that matmul needs its output: the recompute reaches it too.
        full += parts["last_matmul"]
    if (saved == 0 or ops) and a.kind == "llama":  # the whole layer recomputed from its input, which the
        # checkpoint holds: the first norm's fp32 copy (post-norm: the projections' casts) replaces nothing
        full += sb * a.hidden * r * ((r != c) if a.post_norm else (r != 4))
    return saved, full


def attention_saves(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention = Attention(),
                    tr: Training = FULL) -> float:
    """Bytes a layer's attention keeps for backward, as much of it as `tr` trains."""
    return _full(a, sb, r, c, ln, at, tr)[1]["attn"]


def mlp_saves(a: Arch, sb: int, r: int, c: int, ln: int, tr: Training = FULL) -> float:
    """Bytes a layer's MLP keeps for backward (freed as soon as the MLP's backward is done)."""
    return _full(a, sb, r, c, ln, Attention(), tr)[1]["mlp"]


def _gpt2(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention) -> tuple[float, dict]:
    """In units of s·b·h: ln_1 out 1c, qkv 3c (q, k, v are views of it), SDPA out 1c, x + attn 1ln
    (kept by ln_2), ln_2 out 1c, c_fc out 4c, GELU out 4c = 15, plus its input (ln_1 keeps its
    own copy when ln != r, and the input then dies with the block: hence ln - r more); LayerNorm
    mean and rstd (2·s·b fp32 each LayerNorm) and SDPA's log-sum-exp (s·b·heads fp32).
    The math backend and the eager path keep, in place of qkv and the log-sum-exp, their own
    copies of q, k and v and the (B, heads, T, T) probabilities (`attention.scores`); eager its (T, T)
    mask too."""
    sbh = sb * a.hidden
    stats, lse = 2 * 2 * sb * 4, sb * a.heads * 4
    sdpa, sdpa_matmul = (3 * sbh * c + lse, lse) if at.kind == FUSED else scores(a, sb, c, at, mask=at.seq ** 2)
    full = (1 + 1 + 1 + 4 + 4) * sbh * c + sdpa + sbh * ln + sbh * (ln - r) + stats
    # attn_input: ln_1's output as c_attn keeps it (cast, under autocast) less as a recompute
    # wrapper around attention keeps it (the norm's output, in the stream's dtype)
    return full, {"attn": sbh * c + sdpa, "attn_input": sbh * (c - r), "mlp": 8 * sbh * c, "norm": stats,
                  "matmul": (3 + 1 + 4 + 1 + 1) * sbh * c + sdpa_matmul, "mlp_matmul": 5 * sbh * c,
                  "mlp_input": sbh * c, "mlp_input_wrapped": sbh * r, "last_matmul": sbh * c}


def _llama(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention = Attention()) -> tuple[float, dict]:
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
    The math backend and the eager path keep, in place of q, k, v and the log-sum-exp, their own
    copies and the probabilities (`attention.scores`); under ops recompute, the scores' matmul output (as
    large) in place of the log-sum-exp."""
    sbh, q, kv = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.kv_heads * a.head_dim
    lse, rsqrt = sb * a.heads * 4, sb * 4
    sdpa, sdpa_matmul = ((q + 2 * kv) * c + lse, lse) if at.kind == FUSED else scores(a, sb, c, at)
    norm = sbh * (4 if a.fp32_norm else r) + rsqrt  # kept by one RMSNorm beyond its fp32 input and its output
    attn = q * c + sdpa  # SDPA out; q, k after rotary, v and the lse (or the math backend's, eager's)
    # q_norm and k_norm (RMSNorm over each head, or OLMoE's over the whole projection): the
    # projection's output in fp32 (itself in fp32, else a copy), the rsqrt (one fp32 per token and
    # head, or per token) and the normalised values in the projection's dtype, which the weight
    # multiplies. Recomputed, such a norm keeps only its input, which the projection makes anyway (c).
    # (Gemma 3's multiply in fp32, keeping fp32 normalised values)
    rsqrts = {"head": sb * (a.heads + a.kv_heads) * 4, "proj": 2 * sb * 4}.get(a.qk_norm, 0)
    qk = (q + kv) * (4 + (4 if a.fp32_norm else c)) + rsqrts if a.qk_norm else 0
    qk_recomputed = qk - (q + kv) * c if a.qk_norm else 0
    attn += qk
    ln_1_casts = 3  # the projections reading ln_1's output
    if a.fused_proj:
        # A fused kernel keeps v, a view of qkv_proj's one output, and so that output whole; and
        # rotary's cat lays q out as (B, heads, T, head_dim), SDPA's output follows q's layout,
        # so the reshape that makes o_proj's input copies it (measured on CPU; CUDA's flash kernel
        # also writes its output in q's layout). Eager attention and the math backend keep their
        # own copies of v (a batched matmul's reshape copies the strided view) and copy their output anyway.
        if at.kind == FUSED:
            attn += (q + kv) * c + q * c
        ln_1_casts = 1
    # SwiGLU: gate and up (each casting ln_2's output under autocast), down; or the experts.
    # Phi-3's one gate_up output keeps as many bytes as gate's and up's (both views of it).
    if a.experts:
        mlp, ln_2_casts, mlp_matmul = experts.saves(a, sb, r, c)
    else:
        mlp, ln_2_casts, mlp_matmul = 4 * sb * a.inter * c, 1 if a.fused_proj else 2, 2 * sb * a.inter * c + sbh * c
    # Under autocast on an fp32 stream (r != c) each projection casts the norm's output itself
    # (autocast caches casts of weights only): q, k and v keep 3 copies of ln_1's, the MLP its own of ln_2's.
    outs = (ln_1_casts + ln_2_casts if r != c else 1 + 1) * sbh * c
    full = sbh * (4 - r) + 2 * norm + outs + attn + sbh * 4 + mlp
    # Gemma 3's post-norms, as OLMo 2's: each keeps its input in fp32 (a copy of the c-byte
    # projection output), the fp32 normalised values and the rsqrt; recomputed, only that input
    post = sbh * 8 + rsqrt if a.sandwich else 0.0
    full += 2 * post
    # Recomputed, the MLP keeps ln_2's output (r) in place of its casts of it (when r != c).
    mlp_recomputed = mlp + (ln_2_casts * sbh * c - sbh * r if r != c else 0) if a.experts else mlp
    # A recomputed RMSNorm keeps only its input (r): its fp32 copy (when r != 4) goes too, and the
    # input it keeps is one that would have been kept or copied anyway.
    # attn_input: ln_1's output as q, k and v keep it (three casts under autocast, else one) less as
    # a recompute wrapper around attention keeps it (the norm's output, in the stream's dtype)
    return full, {"attn": attn, "attn_input": (ln_1_casts * c if r != c else c) * sbh - r * sbh, "mlp": mlp_recomputed,
                  "norm": 2 * (norm + sbh * (4 - r)) + (2 * (post - sbh * c) if post else 0.0),
                  "qk_norm": qk_recomputed,
                  # q/k/v and o projections, SDPA; the MLP's
                  "matmul": (q + 2 * kv + q + sbh) * c + sdpa_matmul + mlp_matmul, "mlp_matmul": mlp_matmul,
                  "mlp_input": (ln_2_casts if r != c else 1) * sbh * c,
                  # a wrapper keeps ln_2's output itself (a mixture's "mlp" counts it already)
                  "mlp_input_wrapped": (ln_2_casts if r != c else 1) * sbh * c if a.experts else sbh * r,
                  # down_proj's; a mixture's routed experts read their down output (kept anyway),
                  # Qwen2-MoE's shared expert ends with its (s·b, 1) gate
                  "last_matmul": (sb * c if a.shared_inter else 0.0) if a.experts else sbh * c}


def _post_norm(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention) -> tuple[float, dict]:
    """OLMo 2: attention and the MLP read the residual stream itself, and an RMSNorm normalises each
    one's output before it is added back. q, k and v keep the layer input (under autocast three
    casts of it, and the input then dies); rotary and SDPA keep what Llama's do. Its RMSNorm
    multiplies by the weight in fp32 before casting back, so every norm (q_norm and k_norm over the
    whole projections, the two post-norms) keeps its input in fp32 (a copy of a 16-bit one), the
    rsqrt and the fp32 normalised values. Gate and up keep the stream after attention (or their two
    casts of it); SwiGLU as Llama."""
    sbh, q, kv = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.kv_heads * a.head_dim
    sdpa, sdpa_matmul = ((q + 2 * kv) * c + sb * a.heads * 4, sb * a.heads * 4) if at.kind == FUSED \
        else scores(a, sb, c, at)
    qk = (q + kv) * 8 + 2 * sb * 4  # q_norm and k_norm
    attn = q * c + sdpa + qk  # SDPA out, its inputs
    norm = sbh * 8 + sb * 4  # one post-norm: fp32 input, normalised, rsqrt
    x_in = 3 * sbh * c - sbh * r if r != c else 0.0  # beyond the layer input, which q, k and v keep (r == c)
    h_in = 2 * sbh * c if r != c else sbh * r  # what gate and up keep of the stream they read
    mlp = 4 * sb * a.inter * c
    mlp_matmul = 2 * sb * a.inter * c + sbh * c
    full = x_in + attn + norm + h_in + mlp + norm
    # recomputed, a norm keeps only its input, the c-byte output of the Linear before it
    return full, {"attn": attn, "attn_input": x_in, "mlp": mlp, "norm": 2 * (norm - sbh * c),
                  "qk_norm": qk - (q + kv) * c,
                  "matmul": (q + 2 * kv + q + sbh) * c + sdpa_matmul + mlp_matmul, "mlp_matmul": mlp_matmul,
                  "mlp_input": h_in, "mlp_input_wrapped": sbh * r, "last_matmul": sbh * c}


def forward_temp(a: Arch, sb: int, r: int, c: int = 4, tr: Training = FULL, input_kept: bool = False,
                 linears_wrapped: bool = False) -> float:
    """Made and dropped inside a layer's forward even when it keeps everything (bytes): a mixture
    of experts' routing-weighted outputs, (S, h), and their copy put back in token order (for
    Mixtral in fp32, its routing weights' dtype); an adapted layer's (`input_kept`: a recompute
    wrapper around the MLP keeps its input; `linears_wrapped`: one around each Linear keeps
    that Linear's). A dense MLP's all stay for backward: 0."""
    if "adapter" in (tr.attn, tr.mlp):
        return adapters.forward_temp(a, sb, r, c, tr, input_kept, linears_wrapped)
    return 2 * sb * a.top_k * a.hidden * (4 if a.fp32_routing else r) if a.experts else 0.0


def inner_temp(a: Arch, sb: int, c: int, r: int, g: int, tr: Training = FULL, adding: bool = False,
               tiled: bool = False) -> float:
    """The MLP's widest tensors alive together inside a layer's forward and backward beyond what it
    keeps (bytes), `g` bytes per gradient element: GPT-2's gradients of c_fc's and GELU's outputs
    (s·b·4h each) less GELU's output, which c_proj's backward has freed by then (an adapted c_proj
    has two gradients of its input alive instead); Llama's of gate's and up's (the product
    down_proj kept is gone, its gradient not yet); a mixture of experts' (`experts.inner_temp`). An
    adapted MLP frees its output projection's dropout copy and mask with that projection's
    backward, before gate's and up's gradients exist (measured op by op on CPU: tiny Llama at
    hidden 64 and 256, layer-type and MLP recompute in fp32, 1.4-2.1% over without); the slices of
    a `tiled` one measure as counted without that (within 1%: ablate/predict/tiling.py)."""
    if a.experts:
        return experts.inner_temp(a, sb, c, r, g, adding)
    if tr.dora and tr.mlp == "adapter":
        return adapters.dora_inner_temp(a, sb, c)
    # GPT-2's: an adapted c_proj sums its base's and its branch's input gradients (two at once), unless
    # the branch's dropout copy and mask, gone before the base's is made, made room for it
    two = a.kind == "gpt2" and tr.mlp == "adapter" and not tr.dropout
    widest = (2 if two or a.kind not in ("neox", "gpt2") else 1) * sb * a.inter * c
    # A frozen output projection kept no input, whose bytes stood in for its input's gradient, made by
    # its backward and alive through these (fitted on CPU: tiny Llama, adapters on attention only)
    gone = sb * a.inter * (c + tr.dropout) if a.kind == "llama" and tr.mlp == "adapter" and tr.dropout and not tiled \
        else 0.0
    return widest + (sb * a.inter * c if tr.mlp == "frozen" else 0.0) - gone


def _neox(a: Arch, sb: int, r: int, c: int, ln: int, at: Attention) -> tuple[float, dict]:
    """GPT-NeoX with its parallel residual: both LayerNorms read the layer input (kept once, as r;
    each keeps an ln-byte copy when ln != r) and keep their mean and rstd; attention keeps the
    fused qkv output (v is a view of it), q and k after rotary (new whole tensors: the rotated
    part concatenated with the rest), SDPA's output and log-sum-exp, and a contiguous copy of that
    output as the dense projection's input (SDPA reads the strided v and writes (B, heads, T,
    head_dim), which the reshape to (B, T, C) must copy); the MLP keeps its (s·b·inter)
    hidden before and after GELU; the two LayerNorm outputs (c) go on to the projections."""
    sbh = sb * a.hidden
    stats, lse = 2 * 2 * sb * 4, sb * a.heads * 4  # both LayerNorms' mean and rstd
    attn = (3 + 1 + 1 + 1 + 1) * sbh * c + lse
    mlp = 2 * sb * a.inter * c
    full = 2 * sbh * c + attn + mlp + 2 * sbh * (ln - r) + stats
    # qkv, SDPA, dense, the MLP's two projections
    return full, {"attn": attn, "attn_input": sbh * (c - r), "mlp": mlp, "norm": stats,
                  "matmul": (3 + 1 + 1 + 1) * sbh * c + lse + sb * a.inter * c,
                  "mlp_matmul": sb * a.inter * c + sbh * c,
                  "mlp_input": sbh * c, "mlp_input_wrapped": sbh * r, "last_matmul": sbh * c}


_FULL = {"gpt2": _gpt2, "llama": _llama, "neox": _neox}
