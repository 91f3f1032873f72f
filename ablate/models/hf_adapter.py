"""Where a transformers causal LM keeps its parts (ablate.models.Adapter), read from the model
itself, and the import of transformers with the error a run without it gets."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ablate.models import Adapter
from ablate.techniques import Invalid

if TYPE_CHECKING:
    from ablate.models.hf import HFModule


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise Invalid(f"this model needs Hugging Face transformers ({e}): "
                      f"pip install -e '.[hf]' in ablate's repository") from None
    transformers.logging.set_verbosity_error()  # its warnings about unused generation keys are noise here
    return transformers


def find_adapter(model: HFModule) -> Adapter:
    """The adapter of a transformers model, read from its structure (paths from `model`)."""
    lm = model.lm
    names = {id(m): n for n, m in model.named_modules()}
    unit = set(getattr(lm, "_no_split_modules", None) or ())
    layers = next((n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
                   and type(m[0]).__name__ in unit), None)
    if layers is None:
        raise Invalid(f"model: {type(lm).__name__} names no repeated layer in _no_split_modules ({unit or 'none'})")
    layer = model.get_submodule(layers)[0]
    children = dict(layer.named_children())
    attention = next((n for n, m in children.items() if type(m).__name__.endswith("Attention")), None)
    # the feed-forward block: an MLP, or a mixture of experts (Mixtral's SparseMoeBlock, Granite's MoE)
    mlp = next((n for n, m in children.items() if type(m).__name__.lower().endswith(("mlp", "moe", "moeblock"))),
               None)
    if attention is None or mlp is None:
        raise Invalid(f"model: no attention or MLP child in {type(layer).__name__} ({', '.join(children)})")
    tf = _transformers()
    activations = {type(m) for m in children[mlp].modules() if type(m).__module__ == tf.activations.__name__
                   or isinstance(m, (nn.GELU, nn.SiLU, nn.ReLU))}
    norms = {type(m) for m in model.modules() if "Norm" in type(m).__name__}
    # A mixture of experts keeps its experts' weights as (experts, out, in) tensors of one module;
    # each token is routed through num_experts_per_tok of them. Any layer's MLP: some families
    # start with dense layers (Qwen-MoE's mlp_only_layers).
    experts = [m for layer in model.get_submodule(layers) for m in getattr(layer, mlp).modules()
               if any(p.dim() == 3 for p in m.parameters(recurse=False))]
    top_k = getattr(lm.config, "num_experts_per_tok", None)  # none: 3-d weights that every token uses
    routed = top_k / next(p for p in experts[0].parameters() if p.dim() == 3).shape[0] if experts and top_k else 1.0
    embedding = names[id(lm.get_input_embeddings())]
    positions = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and n != embedding
                 and m.num_embeddings == getattr(lm.config, "max_position_embeddings", None)]
    return Adapter(layers=layers, attention=attention, mlp=mlp, norms=tuple(norms), activations=tuple(activations),
                   lm_head=names[id(lm.get_output_embeddings())], embedding=embedding,
                   position_embedding=positions[0] if positions else None,
                   linears=(nn.Linear, tf.pytorch_utils.Conv1D), experts=tuple({type(m) for m in experts}),
                   routed=routed)
