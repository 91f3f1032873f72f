"""model group: one class per model family, and one adapter per family saying where its parts are.

A family option (conf/model/*.yaml names it with `_target_`) builds the model and answers what the
rest of ablate asks of a model: its vocabulary, its longest sequence, its parameter count for
FLOPs. Every technique that reaches into the model (checkpoint, FSDP's wrap, the analytic
predictor) asks the family's `Adapter` where the repeated decoder layer, its attention and MLP,
the norms and the LM head are, never an attribute name of its own.

Families: ablate's GPT-2 (ablate/models/gpt.py, the default) and any decoder-only causal LM of
Hugging Face transformers (ablate/models/hf.py), both behind the same `CausalLM` interface:
forward(idx, targets) -> (logits, loss), tie_weights(), reset_parameters().
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ablate.model import on_meta
from ablate.techniques import Option


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

    def load_weights(self, model: nn.Module) -> None:
        """Copy `init_from`'s weights into `model` in place; nothing without one."""

    @property
    def meta_model(self) -> nn.Module:
        """The model on the meta device: shapes and names for counting and prediction, no memory."""
        if getattr(self, "_meta", None) is None:
            with on_meta():
                self._meta = self.build()
        return self._meta

    def num_params(self) -> int:
        """Parameters counted once (tied weights are one tensor), as transformers counts them."""
        return sum(p.numel() for p in self.meta_model.parameters())

    def flops_params(self) -> int:
        """N of the PaLM FLOPs count: the parameters a token's matmuls multiply by. Leaves out learned
        position embeddings, and an untied token embedding (a lookup, no matmul; the LM head's
        matrix is counted). A tied embedding is counted once, as the LM head."""
        a, params = self.adapter, dict(self.meta_model.named_parameters())  # tied: one name
        skip = {f"{a.position_embedding}.weight"} if a.position_embedding else set()
        if f"{a.lm_head}.weight" in params:  # untied (named_parameters lists a shared tensor once)
            skip.add(f"{a.embedding}.weight")
        return sum(p.numel() for n, p in params.items() if n not in skip)

    def dims(self) -> tuple[int, int]:
        """(layers, hidden size): the attention term of the PaLM FLOPs count."""
        layers = self.adapter.layer_list(self.meta_model)
        return len(layers), self.meta_model.get_submodule(self.adapter.embedding).weight.shape[1]
