"""A model family's sizes as the analytic model reads them (`Arch`), and the transformers
model_types whose layers ablate/predict/layers.py describes."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.techniques import Unmodelled


# Mixtures of experts as transformers 5 writes them, and the config key of one expert's width
MOE = {"mixtral": "intermediate_size", "olmoe": "intermediate_size", "qwen2_moe": "moe_intermediate_size",
       "qwen3_moe": "moe_intermediate_size"}
# Phi-3 (Phi-3.5 and Phi-4-mini too): the llama layer with qkv_proj and gate_up_proj
FUSED_PROJ = ("phi3",)
# OLMo 2: the llama layer's two norms moved onto the attention's and the MLP's outputs
POST_NORM = ("olmo2",)
# Gemma 3: the llama layer's pre-norms and OLMo 2's post-norms both (four per layer)
SANDWICH = ("gemma3_text",)
# Gemma: the llama layer with GELU's gate in place of SiLU's (as many bytes kept) and the embeddings
# scaled by sqrt(hidden)
SCALED_EMBED = ("gemma", *SANDWICH)
# RMSNorm multiplying by its weight in fp32 and casting the product back: it keeps its normalised
# values in fp32 whatever the stream's dtype (Llama's casts them back first)
FP32_NORM = (*POST_NORM, *SCALED_EMBED)
LLAMA_LIKE = ("llama", "qwen2", "mistral", "qwen3", "smollm3", "granite", *FUSED_PROJ, *POST_NORM, *SCALED_EMBED,
              *MOE)
# RMSNorm on q and on k before rotary: over each head's head_dim, or over the whole projection
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj", "olmo2": "proj", "gemma3_text": "head"}


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
    fused_proj: bool = False  # q, k and v one Linear's output, gate and up another's (Phi-3)
    post_norm: bool = False  # each sub-layer's output normalised before its residual add, none before (OLMo 2)
    fp32_norm: bool = False  # RMSNorm keeps its normalised values in fp32 (FP32_NORM)
    scaled_embed: bool = False  # the embeddings' output is multiplied into a new tensor (Gemma)
    sandwich: bool = False  # post_norm's norms on the sub-layers' outputs beside the llama layer's on their inputs
    # Sliding-window layers (Gemma 3): transformers hands SDPA no mask while the sequence is shorter
    # than the window (each is then plain causal attention), a (T, T) one from there on
    window: int = 0
    rotary_tables: int = 1  # cos and sin per attention kind (Gemma 3's local and global bases)

    @property
    def out_norms(self) -> bool:
        """An RMSNorm on each sub-layer's output: the MLP's runs first in the layer's backward."""
        return self.post_norm or self.sandwich


def arch_of(family) -> Arch:
    """The sizes of a model option (ablate/models/), as the family gives them (Family.arch);
    Unmodelled for a layout not described here."""
    return family.arch()


def hf_arch(hf) -> Arch:
    """The sizes of a transformers config `hf` whose layers this module describes; else Unmodelled."""
    kind = getattr(hf, "model_type", None)
    if kind in LLAMA_LIKE or kind == "gpt_neox":
        kinds = set(getattr(hf, "layer_types", None) or ())
        window = 0
        if "sliding_attention" in kinds:
            if kind not in SANDWICH:  # SDPA then takes a (T, T) mask
                raise Unmodelled(f"no analytic memory model for model_type={kind} with sliding-window layers")
            window = hf.sliding_window
        heads = hf.num_attention_heads
        sizes = {"inter": hf.intermediate_size, **(_moe_sizes(hf) if kind in MOE else {})}
        return Arch("llama" if kind in LLAMA_LIKE else "neox", hf.num_hidden_layers, hf.hidden_size, heads,
                    getattr(hf, "num_key_value_heads", None) or heads,
                    getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
                    tied=bool(hf.tie_word_embeddings), head_rows=hf.vocab_size, qk_norm=QK_NORM.get(kind, ""),
                    fused_proj=kind in FUSED_PROJ, post_norm=kind in POST_NORM, fp32_norm=kind in FP32_NORM,
                    scaled_embed=kind in SCALED_EMBED, sandwich=kind in SANDWICH, window=window,
                    rotary_tables=len(kinds) if kind in SANDWICH and kinds else 1, **sizes)
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
