"""What one decoder layer keeps for backward, per model family: the analytic model's activations.

A family's layer is described by its sizes (`Arch`, read from the model option) and one function
giving the bytes it keeps for backward beyond its input. Three layouts cover the shipped families:
- gpt2: ablate's GPT-2 (LayerNorm, fused qkv, GELU MLP of 4h, learned positions, tied head).
- llama: Llama, Qwen2, Mistral as transformers writes them (RMSNorm, separate q/k/v projections
  with grouped-query K/V heads, rotary, SwiGLU MLP of three matrices, tied or untied head); Qwen3
  is this layer with an RMSNorm on each query and key head (qk_norm).
- neox: GPT-NeoX / Pythia (LayerNorm, fused qkv, partial rotary, attention and MLP in parallel
  off one residual, GELU MLP, untied head).
Any other layout raises Unmodelled, and the job falls back to predict=trace.

Units: `sb` tokens of the micro-batch; `r` bytes/element of the residual stream (the parameter
dtype, fp32 under autocast, the compute dtype under FSDP's mixed precision); `c` of the compute
dtype (what Linear, SDPA and the activation produce); `ln` of what a norm keeps of its input: the
input itself (r), or a 4-byte copy when CUDA autocast runs LayerNorm in fp32 on a 16-bit stream
(RMSNorm always upcasts: 4).
Attention is SDPA everywhere: no (T, T) score matrix is stored, and its output is laid out (B, T,
heads, head_dim) already, so the output projection keeps that very tensor as its input.
"""
from __future__ import annotations

from dataclasses import dataclass

from ablate.predict.timeline import Unmodelled
from ablate.techniques import checkpoint as ckpt

LLAMA_LIKE = ("llama", "qwen2", "mistral", "qwen3")
QK_NORM = ("qwen3",)  # an RMSNorm over head_dim on q and on k, before rotary


@dataclass(frozen=True)
class Arch:
    """A family's sizes, as the layer functions need them."""

    kind: str  # gpt2 | llama | neox
    layers: int
    hidden: int
    heads: int
    kv_heads: int  # key/value heads (grouped-query attention); = heads without it
    head_dim: int
    inter: int  # MLP hidden width (4h in GPT-2; SwiGLU's gate and up width in Llama)
    vocab: int
    tied: bool  # the LM head is the token embedding
    head_rows: int  # the LM head's rows: vocab, or more where GPT-2's pad_vocab_to pads them
    qk_norm: bool = False  # Qwen3: q and k each normalised per head (QK_NORM)


def arch_of(family) -> Arch:
    """The sizes of a model option (ablate/models/); Unmodelled for a layout not described here."""
    from ablate.models.gpt import GPT2

    if isinstance(family, GPT2):
        c = family.config
        return Arch("gpt2", c.n_layer, c.n_embd, c.n_head, c.n_head, c.n_embd // c.n_head, 4 * c.n_embd,
                    c.vocab_size, tied=True, head_rows=c.padded_vocab)
    hf = getattr(family, "hf_config", None)
    kind = getattr(hf, "model_type", None)
    if kind in LLAMA_LIKE or kind == "gpt_neox":
        if "sliding_attention" in (getattr(hf, "layer_types", None) or ()):  # SDPA then takes a (T, T) mask
            raise Unmodelled(f"no analytic memory model for model_type={kind} with sliding-window layers")
        heads = hf.num_attention_heads
        return Arch("llama" if kind in LLAMA_LIKE else "neox", hf.num_hidden_layers, hf.hidden_size, heads,
                    getattr(hf, "num_key_value_heads", None) or heads,
                    getattr(hf, "head_dim", None) or hf.hidden_size // heads, hf.intermediate_size, hf.vocab_size,
                    tied=bool(hf.tie_word_embeddings), head_rows=hf.vocab_size, qk_norm=kind in QK_NORM)
    raise Unmodelled(f"no analytic memory model for model_type={kind or type(family).__name__}")


def layer_saves(a: Arch, option, index: int, sb: int, r: int, c: int, ln: int) -> tuple[float, float]:
    """(bytes layer `index` keeps for backward beyond its input under checkpoint `option`, bytes it
    keeps without recompute). Its input is the previous layer's output, counted there as r·sbh."""
    full, parts = _FULL[a.kind](a, sb, r, c, ln)
    if isinstance(option, ckpt.Blocks):  # only the layer input is kept, by the wrapper
        return (0.0 if (index + 1) % option.every_n == 0 else full), full
    if isinstance(option, ckpt.Sublayer):  # the sub-layer's input (a norm output) is kept
        return full - (parts["attn"] if option.part == "attn" else parts["mlp"]), full
    if isinstance(option, ckpt.SelectiveOps):
        return parts["matmul"], full  # matmul and SDPA outputs kept; norms, adds, activations recomputed
    if isinstance(option, ckpt.Layers):
        saved = full
        if "attention" in option.types:  # its insides recomputed; its input kept
            saved -= parts["attn"]
        if "layernorm" in option.types:  # what a norm keeps beyond its input
            saved -= parts["norm"]
            if "attention" not in option.types:  # Qwen3's q/k norms: wrapped inside attention only when it is not
                saved -= parts.get("qk_norm", 0.0)
        return saved, full  # a wrapped Linear or activation keeps exactly what it kept before
    if isinstance(option, ckpt.NoCheckpoint):
        return full, full
    raise Unmodelled(f"no memory model for checkpoint option {type(option).__name__}")


def mlp_saves(a: Arch, sb: int, r: int, c: int, ln: int) -> float:
    """Bytes a layer's MLP keeps for backward (freed as soon as the MLP's backward is done)."""
    return _FULL[a.kind](a, sb, r, c, ln)[1]["mlp"]


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


def _llama(a: Arch, sb: int, r: int, c: int, ln: int) -> tuple[float, dict]:
    """RMSNorm (transformers' LlamaRMSNorm) upcasts its input to fp32 and keeps it, the rsqrt
    (s·b fp32) and the normalised input in the input dtype; its output goes on to the
    projections. Attention keeps q and k after rotary (new tensors: q·cos + rotate_half(q)·sin
    keeps only the shared cos and sin), v (a view of v_proj's output), SDPA's output and
    log-sum-exp; K and V have kv_heads heads, and SDPA takes them as they are (enable_gqa).
    SwiGLU keeps gate and up outputs, SiLU's output and the product: 4 of (s·b·inter). Under
    autocast, rotary's q·cos promotes q to the stream's fp32, and SDPA keeps its own casts of q and k.
    Per layer: ln_1's fp32 input (a copy when r != 4: the layer input then dies), normalised and
    output; attention; x + attn in fp32 (kept by ln_2: itself when r == 4, else a copy); ln_2's
    normalised and output; the MLP."""
    sbh, q, kv = sb * a.hidden, sb * a.heads * a.head_dim, sb * a.kv_heads * a.head_dim
    lse, rsqrt = sb * a.heads * 4, sb * 4
    norm = sbh * r + rsqrt  # kept by one RMSNorm beyond its fp32 input and its output
    attn = (q + 2 * kv + q) * c + lse  # q, k after rotary; v; SDPA out; lse
    mlp = 4 * sb * a.inter * c
    # Qwen3's q_norm and k_norm (RMSNorm over each head): the projection's output in fp32 (itself
    # in fp32, else a copy), the rsqrt (one fp32 per token and head) and the normalised heads in
    # the projection's dtype, which the weight multiplies. Recomputed, such a norm keeps only its
    # input, which the projection makes anyway (c).
    qk = (q + kv) * (4 + c) + sb * (a.heads + a.kv_heads) * 4 if a.qk_norm else 0
    qk_recomputed = qk - (q + kv) * c if a.qk_norm else 0
    attn += qk
    # Under autocast on an fp32 stream (r != c) each projection casts the norm's output itself
    # (autocast caches casts of weights only): q, k and v keep 3 copies of ln_1's, gate and up 2 of ln_2's.
    outs = (3 + 2 if r != c else 1 + 1) * sbh * c
    full = sbh * (4 - r) + 2 * norm + outs + attn + sbh * 4 + mlp
    # A recomputed RMSNorm keeps only its input (r): its fp32 copy (when r != 4) goes too, and the
    # input it keeps is one that would have been kept or copied anyway.
    return full, {"attn": attn, "mlp": mlp, "norm": 2 * (sbh * 4 + rsqrt), "qk_norm": qk_recomputed,
                  # q/k/v and o projections, SDPA, gate and up, down
                  "matmul": (q + 2 * kv + q + 2 * sbh) * c + lse + 2 * sb * a.inter * c}


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
