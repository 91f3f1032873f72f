"""ablate's own GPT-2 as a model family (the default), and loading GPT-2 weights from a local
Hugging Face checkpoint directory (safetensors, no hub access).

The directory is what `GPT2LMHeadModel.save_pretrained(dir)` writes: config.json plus
model.safetensors (or shards listed in model.safetensors.index.json).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from ablate.models.gpt_module import GPTModule, GPTConfig
from ablate.models import MAX_LAYERS, Adapter, Family, weights
from ablate.techniques import Invalid, Plan

ADAPTER = Adapter(layers="transformer.h", attention="attn", mlp="mlp", norms=(nn.LayerNorm,),
                  activations=(nn.GELU,), lm_head="lm_head", embedding="transformer.wte",
                  position_embedding="transformer.wpe")


class GPT2(Family):
    """ablate's GPT-2 (ablate/models/gpt_module.py): n_layer blocks of n_head heads over n_embd, a learned
    position embedding of block_size, the LM head tied to the token embedding."""

    def __init__(self, name: str, n_layer: int, n_head: int, n_embd: int, vocab_size: int = 50257,
                 block_size: int = 1024, dropout: float = 0.0, bias: bool = True, init_from: str | None = None,
                 pad_vocab_to: int = 1):
        self.name, self.init_from = name, init_from
        self.config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                                block_size=block_size, dropout=dropout, bias=bias, pad_vocab_to=pad_vocab_to)

    def check(self, plan: Plan) -> None:
        c = self.config
        for key in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "pad_vocab_to"):
            if getattr(c, key) < 1:
                raise Invalid(f"model.{key}={getattr(c, key)} must be >= 1")
        if c.n_layer > MAX_LAYERS:
            raise Invalid(f"model.n_layer={c.n_layer} is more than {MAX_LAYERS:,} layers")
        if c.n_embd % c.n_head:  # else the model's own assert fails inside a worker
            raise Invalid(f"model.n_embd={c.n_embd} is not divisible by model.n_head={c.n_head}")
        if not 0 <= c.dropout < 1:  # else nn.Dropout's ValueError in the worker; at 1 it zeroes every activation
            raise Invalid(f"model.dropout={c.dropout} must be in [0, 1)")
        if plan.seq_len > c.block_size:
            raise Invalid(f"seq_len={plan.seq_len} > model.block_size={c.block_size}")
        if self.init_from:  # the files' headers against the meta model: refused here, before any worker loads them
            try:
                fitted(self.meta_model, self.init_from, meta=True)
            except ValueError as e:  # a config key that differs from the checkpoint's
                raise Invalid(str(e)) from None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.block_size

    @property
    def adapter(self) -> Adapter:
        return ADAPTER

    def build(self) -> nn.Module:
        return GPTModule(dataclasses.replace(self.config, attention=self.attn_implementation))

    def arch(self):
        from ablate.predict.arch import Arch

        c = self.config
        return Arch("gpt2", c.n_layer, c.n_embd, c.n_head, c.n_head, c.n_embd // c.n_head, 4 * c.n_embd,
                    c.vocab_size, tied=True, head_rows=c.padded_vocab)

    @property
    def n_layers(self) -> int:
        return self.config.n_layer

    def with_layers(self, n: int) -> nn.Module:
        """Every block is the same Block of the same config: n of them stand for any number."""
        return GPTModule(dataclasses.replace(self.config, n_layer=n, attention=self.attn_implementation))

    def flops_params(self) -> int:
        """The padded rows of the head (pad_vocab_to) are no token's: work, but not the model's."""
        c = self.config
        return super().flops_params() - (c.padded_vocab - c.vocab_size) * c.n_embd

    def load_weights(self, model: nn.Module) -> None:
        if self.init_from:
            load_weights(model, self.init_from)


# HF's GPT-2 uses Conv1D layers, whose weights are stored (in, out): nn.Linear's (out, in) transposed.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# The tensors with a row per token: a model with pad_vocab_to has more rows than the checkpoint.
_PADDED = ("transformer.wte.weight", "lm_head.weight")
_TIED = ("lm_head.weight",)  # the token embedding's own tensor: a checkpoint may leave it out


def read_config(path: str | Path) -> dict:
    """GPT-2 shape keys of a checkpoint directory, in our GPTConfig's names."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise Invalid(f"model.init_from={path}: no {'config.json' if path.is_dir() else 'such directory'} "
                      f"(a local save_pretrained directory of a GPT-2)")
    hf = json.loads((path / "config.json").read_text())
    keys = dict(n_layer="n_layer", n_head="n_head", n_embd="n_embd", vocab_size="vocab_size", block_size="n_positions")
    if any(k not in hf for k in keys.values()):
        raise Invalid(f"model.init_from={path}: its config.json is not a GPT-2's (model_type={hf.get('model_type')!r})")
    return {ours: hf[theirs] for ours, theirs in keys.items()}


def _as_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HF GPT-2 checkpoint's tensors under ablate's GPTModule names (GPT2Model's lack `transformer.`)."""
    ours = {}
    for key, value in state.items():
        key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if not key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers in older checkpoints;
            ours[key] = value  # SDPA needs none
    return ours


def fitted(model: GPTModule, path: str | Path, meta: bool = False) -> tuple[dict, dict]:
    """(model's tensors, checkpoint's) under the same names, checked (weights.refuse_misfit): the
    model's as views in the checkpoint's layout (Conv1D's transposed; a padded model's token rows
    cut to the checkpoint's vocabulary), so that a reason gives the shapes the file has, and a copy
    into a view fills the parameter. The model's config must match the checkpoint's config.json
    first: a ValueError naming the config key that differs."""
    wrong = [f"model.{k}={getattr(model.config, k)} but the checkpoint has {v}"
             for k, v in read_config(path).items() if getattr(model.config, k) != v]
    if wrong:  # named by its config key, not as the first tensor whose shape differs
        raise ValueError(f"model.init_from={path}: " + "; ".join(wrong))
    ours = {k: v[:model.config.vocab_size] if k in _PADDED else v.t() if k.endswith(_CONV1D) else v
            for k, v in model.state_dict().items()}
    theirs = _as_ours(weights.read(Path(path), meta))  # meta: the files' headers alone
    weights.refuse_misfit(path, ours, theirs, missing=[k for k in ours if k not in theirs and k not in _TIED])
    return ours, theirs


def load_weights(model: GPTModule, path: str | Path) -> None:
    """Copy a local HF GPT-2 checkpoint into `model` in place (any device, any dtype)."""
    ours, theirs = fitted(model, path)
    with torch.no_grad():
        for key, value in theirs.items():
            ours[key].copy_(value)
