"""model group: one class per model family, and one adapter per family saying where its parts are.

A family option (conf/model/*.yaml names it with `_target_`) builds the model and answers what the
rest of ablate asks of a model: its vocabulary, its longest sequence, its parameter count for
FLOPs, its parameters' names and shapes (`Family.layout`: read off a sample of two layers where
the family's layers repeat, so that counting and the analytic predictor never build all of them).
Every technique that reaches into the model (checkpoint, FSDP's wrap, the analytic predictor) asks
the family's `Adapter` where the repeated decoder layer, its attention and MLP, the norms and the
LM head are, never an attribute name of its own.

Families: ablate's GPT-2 (ablate/models/gpt.py, the default) and any decoder-only causal LM of
Hugging Face transformers (ablate/models/hf.py), both behind the same `HFModule` interface:
forward(idx, targets) -> (logits, loss), tie_weights(), reset_parameters().
"""
from __future__ import annotations

import abc
import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ablate.models.gpt_module import on_meta
from ablate.models.layout import MAX_LAYERS, SAMPLED, ParamLayout, logical_numel  # noqa: F401  (imported from here)
from ablate.techniques import Option, Unmodelled


@dataclass(frozen=True)
class Adapter:
    """Where one family keeps the parts techniques act on. Paths are dotted attribute paths from
    the root module `Family.build()` returns; classes are matched with isinstance."""

    layers: str  # the nn.ModuleList of repeated decoder layers ("transformer.h")
    attention: str  # a layer's attention submodule ("attn", "self_attn", "attention")
    mlp: str  # a layer's MLP submodule
    norms: tuple[type, ...]  # LayerNorm, RMSNorm, ...
    activations: tuple[type, ...]  # the MLP's activation module (GELU, SiLU)
    lm_head: str  # the output projection (vocab x hidden)
    embedding: str  # the token embedding
    position_embedding: str | None = None  # learned positions (GPT-2's wpe); None with rotary
    linears: tuple[type, ...] = (nn.Linear,)  # HF GPT-2's Conv1D is one too
    # A mixture of experts' containers of expert weights ((experts, out, in) tensors, multiplied by
    # a grouped matmul, not a Linear) and the share of them a token multiplies by: top-k / experts.
    experts: tuple[type, ...] = ()
    routed: float = 1.0

    def matmul_weights(self, modules) -> float:
        """Weight elements a token multiplies by inside `modules` (half its matmul FLOPs): each
        Linear's, and the routed share of the experts' weights."""
        linear = sum(m.weight.numel() for root in modules for m in root.modules() if isinstance(m, self.linears))
        experts = sum(p.numel() for root in modules for m in root.modules() if isinstance(m, self.experts)
                      for p in m.parameters(recurse=False))
        return linear + self.routed * experts

    def expert_names(self, model: nn.Module) -> set[str]:
        """The names of `model`'s expert weights."""
        return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, self.experts)
                for p, _ in m.named_parameters(recurse=False)}

    def layer_list(self, model: nn.Module) -> nn.ModuleList:
        # getattr, not get_submodule: torch.compile's OptimizedModule forwards attributes to the
        # model it wraps but has no such child.
        return functools.reduce(getattr, self.layers.split("."), model)

    def layer_class(self, model: nn.Module) -> type[nn.Module]:
        """The repeated layer's class (FSDP1's transformer auto-wrap unit)."""
        return type(self.layer_list(model)[0])

    def attention_class(self, model: nn.Module) -> type[nn.Module]:
        return type(getattr(self.layer_list(model)[0], self.attention))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, T, vocab) logits against (B, T) targets, taken in fp32
    whatever the compute dtype (the (B*T, vocab) logits are upcast). Every family uses this one,
    so a loss means the same thing across families."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class Family(Option, abc.ABC):
    """A model option. Subclasses build one family's model from their config keys."""

    name: str
    # The attention the model is built with (the attention group's `implementation`, which
    # ablate.build.Techniques sets): sdpa, eager, or flex_attention where the family has it.
    attn_implementation = "sdpa"
    has_flex_attention = False

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds: the data's must stay below it."""

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """The longest sequence the model takes (seq_len must not exceed it)."""

    @property
    @abc.abstractmethod
    def adapter(self) -> Adapter:
        """Where this family's parts are."""

    @abc.abstractmethod
    def build(self) -> nn.Module:
        """The model, on the current default device and dtype, initialised (or skipped on meta)."""

    def constants(self) -> nn.Module:
        """The model built for real on the host: the values its modules set in their own `__init__`,
        which a build on meta lacks (ablate/models/meta_constants.py). Its random draws are made on a copy of
        the random state, so the caller's draws stay as they were."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            return self.build()

    def load_weights(self, model: nn.Module) -> None:
        """Copy `init_from`'s weights into `model` in place; nothing without one."""

    def check(self, plan) -> None:
        """The model contract (`check_contract`); a family that checks more calls this too where
        its module is not ablate's own (ablate's GPTModule and transformers' wrapper are tested once,
        by tests/test_model_contract.py, not per point)."""
        self.check_contract(plan)

    def check_contract(self, plan) -> None:
        """Invalid where the module this family builds breaks the model contract
        (ablate/models/contract.py check_model), read off a meta build: its one-layer sample where
        it has one; with the chunked loss planned, one meta forward says whether it calls loss_fn."""
        from ablate.models.contract import check_model

        sample = self.sample(1)
        check_model(self.meta_model if sample is None else sample, self, chunked=plan.chunked_loss)

    uses_transformers = False  # its model is a transformers one (the trace patches transformers' masking)

    def arch(self):
        """The sizes the analytic predictor's layer model reads (ablate/predict/arch.py `Arch`);
        Unmodelled for a family whose layers it does not describe (predict=trace runs any)."""
        raise Unmodelled(f"no analytic memory model for model family {type(self).__name__}")

    @property
    def n_layers(self) -> int | None:
        """How many decoder layers the model has; None where the family cannot say without building it."""
        return None

    def with_layers(self, n: int) -> nn.Module | None:
        """This model with `n` decoder layers in place of its own count, all else the same (built
        as `build` builds); None where its layers may differ from one another, so that a few of
        them say nothing of the others."""
        return None

    @property
    def meta_model(self) -> nn.Module:
        """The whole model on the meta device: shapes and names, no memory. Building it costs ~2 ms
        per layer on a CPU (20 s for 10,000 GPT-2 blocks): counting and prediction read
        `layout` instead, which needs at most two layers."""
        if getattr(self, "_meta", None) is None:
            with on_meta():
                self._meta = self.build()
        return self._meta

    def sample(self, n: int) -> nn.Module | None:
        """The model on the meta device with `n` layers (the whole model when it has no more), or
        None where `with_layers` cannot build one."""
        if self.n_layers is not None and n >= self.n_layers:
            return self.meta_model
        samples = self.__dict__.setdefault("_samples", {})
        if n not in samples:
            with on_meta():
                samples[n] = self.with_layers(n)
        return samples[n]

    @property
    def layout(self) -> ParamLayout:
        """The whole model's parameter names and shapes: from a two-layer model where its layers
        repeat (ParamLayout.repeated checks that they do), else from the whole meta model."""
        if getattr(self, "_layout", None) is None:
            self._layout = ParamLayout.repeated(self) or ParamLayout.read(self.meta_model, self.adapter)
        return self._layout

    def layout_with(self, change: Callable[[nn.Module], nn.Module] | None) -> ParamLayout:
        """The layout of the model `change` makes of this family's (the techniques' change_params,
        as the build applies them: frozen, added or replaced parameters); `layout` without one."""
        if change is None:
            return self.layout
        key = getattr(change, "key", None)  # ablate.build.change_params names its change: read once
        layouts = self.__dict__.setdefault("_changed", {})
        if key is None or key not in layouts:
            layout = ParamLayout.repeated(self, change) or ParamLayout.read(change(copy.deepcopy(self.meta_model)),
                                                                            self.adapter)
            if key is None:
                return layout
            layouts[key] = layout
        return layouts[key]

    def param_groups(self, param_groups: Callable[[nn.Module], list[dict]],
                     change: Callable[[nn.Module], nn.Module] | None = None) -> list[list[str]]:
        """An optimizer option's `param_groups(model)` as the whole model's parameter names, in the
        order each group lists them (of the model `change` makes, as `layout_with`)."""
        groups = self.layout_with(change).groups(param_groups)
        if groups is None:  # not a filter of the model's order: only the whole model can say
            whole = self.meta_model if change is None else change(copy.deepcopy(self.meta_model))
            groups = ParamLayout.read(whole, self.adapter).groups(param_groups)
        return groups

    def num_params(self) -> int:
        """Parameters counted once (tied weights are one tensor), as transformers counts them."""
        return sum(math.prod(shape) for shape in self.layout.shapes.values())

    def param_counts(self, change: Callable[[nn.Module], nn.Module] | None = None) -> tuple[int, int]:
        """(parameters, trainable parameters) of the model `change` makes of this family's (as
        `layout_with`), each counted once (a tied weight is one tensor), a 4-bit weight as the
        weights it packs: the counts of a row no worker built."""
        layout = self.layout_with(change)
        numels = layout.numels
        total = sum(numels.values())
        return total, total - sum(numels[name] for name in layout.frozen)

    def flops_params(self) -> int:
        """N of the PaLM FLOPs count: the parameters a token's matmuls multiply by. Leaves out learned
        position embeddings, and an untied token embedding (a lookup, no matmul; the LM head's
        matrix is counted). A tied embedding is counted once, as the LM head."""
        return sum(self._matmul_split(self.layout))

    def flops_split(self, change: Callable[[nn.Module], nn.Module] | None = None) -> tuple[int, int]:
        """`flops_params`' N of the model `change` makes (as `layout_with`) as (trainable, frozen):
        a frozen weight's backward makes its input's gradient but not its own, so the FLOPs count
        takes 6 per trainable element and 4 per frozen one. With nothing frozen, (flops_params(), 0)."""
        a, layout = self.adapter, self.layout_with(change)
        trainable, frozen = self._matmul_split(layout)
        # What a family's flops_params takes off the rule's count (GPT-2's padded head rows) is the
        # head's: on the side its weight trains on (tied, the embedding's name is the head's).
        correction = self.flops_params() - sum(self._matmul_split(self.layout))
        head = f"{a.lm_head}.weight" if f"{a.lm_head}.weight" in layout.shapes else f"{a.embedding}.weight"
        return (trainable, frozen + correction) if head in layout.frozen else (trainable + correction, frozen)

    def _matmul_split(self, layout: ParamLayout) -> tuple[int, int]:
        """(trainable, frozen) elements a token's matmuls multiply by, by the rules of `flops_params`."""
        a, numels = self.adapter, layout.numels  # tied: one name
        skip = {f"{a.position_embedding}.weight"} if a.position_embedding else set()
        if f"{a.lm_head}.weight" in numels:  # untied (named_parameters lists a shared tensor once)
            skip.add(f"{a.embedding}.weight")
        # A mixture of experts' weights count as the share a token is routed through (Mixtral 8x7B:
        # 2 of 8 experts, 12.9B of 46.7B parameters); their names read off the model the layout read.
        experts = layout.expert_names(a)
        weights, in_experts = [0, 0], [0, 0]  # [trainable, frozen]
        for name, n in numels.items():
            if name not in skip:
                frozen = name in layout.frozen
                weights[frozen] += n
                in_experts[frozen] += n if name in experts else 0
        return tuple(w - round(e * (1 - a.routed)) for w, e in zip(weights, in_experts))

    def dims(self) -> tuple[int, int]:
        """(layers, attention width): the attention term of the PaLM FLOPs count. The width is the
        query heads x head_dim, the hidden size here (GPT-2's heads split it)."""
        layout = self.layout
        return len(layout.layer_names), layout.model.get_submodule(self.adapter.embedding).weight.shape[1]


def param_change(t) -> Callable[[nn.Module], nn.Module] | None:
    """The change of the parameters that `t`'s options make (ablate/build.py change_params, `t` a
    build.Techniques), or None where none of them overrides `change_params`, so that the family's
    own layout, read once, serves (`layout_with(None)`)."""
    if all(type(o).change_params is Option.change_params for o in t.options().values()):
        return None
    from ablate.build import change_params  # ablate.build imports this module

    return change_params(t)
