"""A model's parameters as names and shapes (`ParamLayout`): read off a meta model, or off a sample of
two layers where the family's layers repeat, so that counting, FLOPs, the optimizer's groups, FSDP's
units and the analytic predictor never build all of them; and each parameter's element count.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from ablate.models import Adapter, Family


# Wrapper modules that only hold the real one (checkpoint, compile, FSDP1): left out of a name, so
# `transformer.h.0` names the block with or without them. DDP's `module.` prefix goes too.
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "_tiled_module")


def bare_name(name: str, model: nn.Module) -> str:
    """A parameter's or module's name in `model` as the bare model names it (the layout's names)."""
    parts = [p for p in name.split(".") if p and p not in WRAPPERS]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def logical_numel(p: torch.Tensor) -> int:
    """The elements a parameter stands for: its own, except a 4-bit quantised weight's (bitsandbytes'
    Params4bit packs two weights per byte and keeps the original shape in its `quant_state`), which
    counts those of the weight it quantises, as a parameter count should."""
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


SAMPLED = 2  # layers a sample is built with: a second layer shows whether the first repeats
# Deeper is refused: the predictor lists every layer's parameters (linear: about 1 s per 10,000
# layers), so model.n_layer=999999999999 would stall it for days; trained models have hundreds.
MAX_LAYERS = 100_000


def _repeat(names: list[str], prefix: str, n: int) -> list[tuple[str, str]] | None:
    """Parameter names read from a two-layer sample, in its order -> (the name in the n-layer
    model, the sample's name it repeats), in that model's order: layer 0's run of names repeated
    for layers 0..n-1 where the sample's two runs stand. None unless layer 1's run follows layer
    0's at once, with the same names under its own index."""
    at = [i for i, name in enumerate(names) if name.startswith(prefix)]
    if not at:
        return [(name, name) for name in names]
    first, last = at[0], at[-1] + 1
    run = [names[i][len(prefix):].split(".", 1) for i in range(first, last)]
    rests = [part[1] for part in run if part[0] == "0"]
    if len(at) != last - first or run != [["0", r] for r in rests] + [["1", r] for r in rests]:
        return None
    body = [(f"{prefix}{i}.{rest}", f"{prefix}0.{rest}") for i in range(n) for rest in rests]
    return [(x, x) for x in names[:first]] + body + [(x, x) for x in names[last:]]


@dataclass
class ParamLayout:
    """A model's parameters as its named_parameters() lists them (a tied weight once, under its
    first name) and each layer's names: all that counting, the optimizer's groups, FSDP's units
    and the analytic predictor need of the model.

    Read from the whole meta model, or (`repeated`) from a sample built with two layers, layer 0's
    names and shapes repeated for every layer under its own index, where the samples show that
    the family's layers repeat. The decoder layers of a family are copies of one another, so the
    whole model's names, shapes and order come out the same, for a name and a shape per parameter
    instead of building a module per parameter (~2 ms per GPT-2 block on meta)."""

    model: nn.Module  # the meta model read: the whole model, or the sample whose layer 0 is every layer
    prefix: str  # "<the adapter's layers>.": a layer's parameter is named prefix + "<i>.<rest>"
    shapes: dict  # parameter name -> shape, in the whole model's named_parameters() order
    layer_names: list  # per layer i, its parameter names in that order
    sampled: bool = False  # read from a sample: `model` has fewer layers than `layer_names`
    frozen: frozenset = frozenset()  # the names of parameters that train not (requires_grad False)

    @classmethod
    def read(cls, model: nn.Module, adapter: Adapter) -> ParamLayout:
        """The layout of `model` as it is."""
        prefix = adapter.layers + "."
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        layer_names: list[list[str]] = [[] for _ in adapter.layer_list(model)]
        for name in shapes:  # "<layers>.<i>.<rest>" -> layer i
            if name.startswith(prefix):
                layer_names[int(name[len(prefix):].split(".", 1)[0])].append(name)
        frozen = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
        return cls(model, prefix, shapes, layer_names, frozen=frozen)

    @classmethod
    def repeated(cls, family: Family, change: Callable[[nn.Module], nn.Module] | None = None) -> ParamLayout | None:
        """The layout of `family`'s whole model from its samples of one and two layers; None where
        it has no more than two layers (then the whole model is as cheap), builds no sample, or
        its samples show that its layers do not simply repeat: layer 1 is not layer 0 under
        another index right after it, or the parameters outside the layers change with the
        layer count."""
        n = family.n_layers
        if n is None or n <= SAMPLED:
            return None
        samples = [family.sample(k) for k in (1, SAMPLED)]
        if any(s is None for s in samples):
            return None
        if change is not None:  # on copies: the family's cached samples stay its bare model (a meta copy is free)
            samples = [change(copy.deepcopy(s)) for s in samples]
        one, two = (cls.read(s, family.adapter) for s in samples)
        outside = [[(k, v) for k, v in r.shapes.items() if not k.startswith(r.prefix)] for r in (one, two)]
        pairs = _repeat(list(two.shapes), two.prefix, n)
        if len(two.layer_names) != SAMPLED or outside[0] != outside[1] or pairs is None:
            return None
        rests = [name[len(two.prefix) + 2:] for name in two.layer_names[0]]  # past "<prefix>0."
        return cls(two.model, two.prefix, {name: two.shapes[seen] for name, seen in pairs},
                   [[f"{two.prefix}{i}.{rest}" for rest in rests] for i in range(n)], sampled=True,
                   frozen=frozenset(name for name, seen in pairs if seen in two.frozen))

    @functools.cached_property
    def numels(self) -> dict[str, int]:
        """The whole model's parameter name -> its elements (`logical_numel`: a 4-bit weight counts
        the weights it packs), read off the model the layout read (a sample's layer 0 stands for
        every layer), in `shapes`' order. Read once: a family's layout is read for every point."""
        packed = {name: n for name, p in self.model.named_parameters() if (n := logical_numel(p)) != p.numel()}
        if not packed:
            return {name: math.prod(shape) for name, shape in self.shapes.items()}

        def seen(name: str) -> str:  # the name in the model read that `name` repeats
            if not self.sampled or not name.startswith(self.prefix):
                return name
            return f"{self.prefix}0.{name[len(self.prefix):].split('.', 1)[1]}"
        return {name: packed.get(seen(name), math.prod(shape)) for name, shape in self.shapes.items()}

    def expert_names(self, adapter: Adapter) -> set[str]:
        """The whole model's names of a mixture of experts' weights, read off the model the layout
        read (a sample's layers stand for every layer): a layer's name past "<prefix><i>."."""
        rest = lambda name: name[len(self.prefix):].split(".", 1)[1]  # noqa: E731
        rests = {rest(n) for n in adapter.expert_names(self.model) if n.startswith(self.prefix)}
        return {n for n in self.shapes if n.startswith(self.prefix) and rest(n) in rests} if rests else set()

    def groups(self, param_groups: Callable[[nn.Module], list[dict]]) -> list[list[str]] | None:
        """`param_groups(model)`'s groups (an optimizer option's) as the whole model's parameter
        names. None where a sample cannot say: a group out of the model's own order (a filter of
        it repeats with the layers, another order may not)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in param_groups(self.model)]
        if not self.sampled:
            return groups
        order = {name: i for i, name in enumerate(names.values())}
        whole = []
        for group in groups:
            at = [order[name] for name in group]
            pairs = _repeat(group, self.prefix, len(self.layer_names)) if at == sorted(set(at)) else None
            if pairs is None:
                return None
            whole.append([name for name, _ in pairs])
        return whole
