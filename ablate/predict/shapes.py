"""The analytic model's shapes: one rank's micro-batch and the model's parameter sizes and names, read
off the family's layout on the meta device (ablate/predict/analytic.py plays them through a step)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from ablate.build import Techniques
from ablate.models import param_change
from ablate.predict.arch import Arch, arch_of
from ablate.spec import RunSpec


@dataclass
class Shapes:
    """One rank's micro-batch and the model's sizes and names. Element counts; `sbh` is one
    (B, T, hidden) tensor. Parameter names are the model's own; `layer_names[i]` are layer i's."""

    b: int  # micro-batch per rank
    s: int  # sequence length
    arch: Arch  # the family's sizes (ablate/predict/arch.py)
    param_numels: dict  # parameter name -> elements (a tied LM head counted once, as the embedding)
    param_shapes: dict  # parameter name -> shape
    groups: list  # the optimizer's parameter groups: parameter names in the order it steps them
    layer_names: list  # per layer, its parameter names
    embedding: str  # the token embedding's weight
    lm_head: str | None  # the LM head's weight when untied, else None
    linear_names: list  # layer 0's parameters inside its attention and MLP (what autocast casts)
    mlp_names: frozenset = frozenset()  # every layer's parameters inside its MLP
    mlp_out_names: frozenset = frozenset()  # of them, its output projection's (a dense MLP's last Linear)
    expert_names: frozenset = frozenset()  # every layer's mixture-of-experts weights
    frozen: frozenset = frozenset()  # parameters that train not: no gradient, no optimizer state
    packed: dict = field(default_factory=dict)  # parameter name -> bytes per element of a non-float storage (4-bit)

    @property
    def h(self) -> int:
        return self.arch.hidden

    @property
    def heads(self) -> int:
        return self.arch.heads

    @property
    def layers(self) -> int:
        return self.arch.layers

    @property
    def vocab(self) -> int:
        return self.arch.vocab

    @property
    def padded_vocab(self) -> int:
        """The head's rows: the width of the logits it makes, before the loss slices off padding."""
        return self.arch.head_rows

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def sb(self) -> int:
        return self.s * self.b


def shapes_of(spec: RunSpec, t: Techniques) -> Shapes:
    """One rank's micro-batch and the model's sizes and names as the point's techniques leave them."""
    arch = arch_of(t.model)  # Unmodelled for a family without a layer model
    # Names and shapes from the family's layout: for repeated layers read off a two-layer sample on
    # the meta device, in the whole model's order, so the cost is linear in the layers (building all
    # of them took ~2 ms each: 20 s at 10,000), and nothing is allocated.
    # The model as the techniques leave it (frozen or added parameters), as the build makes it.
    change = param_change(t)
    layout, a = t.model.layout_with(change), t.model.adapter
    shapes = layout.shapes  # a tied weight once, under its first name
    inner = tuple(f"{layout.prefix}0.{part}." for part in (a.attention, a.mlp))
    # A mixture of experts' weights multiply in their own dtype (grouped_mm is no autocast op): never cast.
    experts = layout.expert_names(a)
    groups = t.model.param_groups(t.optimizer.param_groups, change)
    lm_head = f"{a.lm_head}.weight"
    return Shapes(b=spec.batch_size // t.accumulation.steps, s=spec.seq_len, arch=arch,
                  param_numels={n: math.prod(s) for n, s in shapes.items()}, param_shapes=shapes, groups=groups,
                  layer_names=layout.layer_names, embedding=f"{a.embedding}.weight",
                  lm_head=lm_head if lm_head in shapes else None,
                  linear_names=[n for n in layout.layer_names[0]
                                if n.startswith(inner) and n not in experts],
                  mlp_names=frozenset(n for i, names in enumerate(layout.layer_names) for n in names
                                      if n.startswith(f"{layout.prefix}{i}.{a.mlp}.")),
                  mlp_out_names=_mlp_out(layout, a, experts), expert_names=frozenset(experts),
                  frozen=layout.frozen, packed=_packed(layout))


def _mlp_out(layout, a, experts) -> frozenset:
    """Every layer's parameters of its MLP's output projection: the MLP's last Linear child (down_proj,
    c_proj), read off the meta model's layer 0. None for a mixture of experts, or where adapters wrap
    the MLP's Linears (their own backward orders the gradients)."""
    mlp = layout.model.get_submodule(f"{layout.prefix}0.{a.mlp}")
    linears = [name for name, m in mlp.named_children() if type(m) is nn.Linear]
    if experts or not linears:
        return frozenset()
    return frozenset(n for i, names in enumerate(layout.layer_names) for n in names
                     if n.startswith(f"{layout.prefix}{i}.{a.mlp}.{linears[-1]}."))


def _packed(layout) -> dict:
    """{name: bytes per element} of the parameters stored as integers (a 4-bit base packs two weights
    per uint8), read off the meta model the layout read: its layer 0 stands for every layer."""
    def rest(name: str) -> str:  # a layer's name past "<prefix><i>.", else the name
        return name[len(layout.prefix):].split(".", 1)[1] if name.startswith(layout.prefix) else name

    seen = {rest(n): p.element_size() for n, p in layout.model.named_parameters() if not p.is_floating_point()}
    return {n: seen[rest(n)] for n in layout.shapes if rest(n) in seen} if seen else {}
