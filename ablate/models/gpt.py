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
from safetensors.torch import load_file
from torch import nn

from ablate.model import GPT, GPTConfig
from ablate.models import MAX_LAYERS, Adapter, Family
from ablate.techniques import Invalid, Plan

ADAPTER = Adapter(layers="transformer.h", attention="attn", mlp="mlp", norms=(nn.LayerNorm,),
                  activations=(nn.GELU,), lm_head="lm_head", embedding="transformer.wte",
                  position_embedding="transformer.wpe")


class GPT2(Family):
    """ablate's GPT-2 (ablate/model.py): n_layer blocks of n_head heads over n_embd, a learned
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
        if plan.seq_len > c.block_size:
            raise Invalid(f"seq_len={plan.seq_len} > model.block_size={c.block_size}")

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
        return GPT(self.config)

    @property
    def n_layers(self) -> int:
        return self.config.n_layer

    def with_layers(self, n: int) -> nn.Module:
        """Every block is the same Block of the same config: n of them stand for any number."""
        return GPT(dataclasses.replace(self.config, n_layer=n))

    def flops_params(self) -> int:
        """The padded rows of the head (pad_vocab_to) are no token's: work, but not the model's."""
        c = self.config
        return super().flops_params() - (c.padded_vocab - c.vocab_size) * c.n_embd

    def load_weights(self, model: nn.Module) -> None:
        if self.init_from:
            load_weights(model, self.init_from)


# HF's GPT-2 uses Conv1D layers, whose weights are stored (in, out): transpose into nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# The tensors with a row per token: a model with pad_vocab_to has more rows than the checkpoint.
_PADDED = ("transformer.wte.weight", "lm_head.weight")


def read_config(path: str | Path) -> dict:
    """GPT-2 shape keys of a checkpoint directory, in our GPTConfig's names."""
    hf = json.loads((Path(path) / "config.json").read_text())
    return dict(
        n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
        vocab_size=hf["vocab_size"], block_size=hf["n_positions"],
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory (one file or an index of shards), by its name."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def load_weights(model: GPT, path: str | Path) -> None:
    """Copy a local HF GPT-2 checkpoint into `model` in place (any device, any dtype)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.init_from={path}: no config.json (expected a save_pretrained dir)")
    # Every tensor is copied whole, so each shape key must match; named here by its config key,
    # not as the first tensor whose shape differs.
    wrong = [f"model.{k}={getattr(model.config, k)} but the checkpoint has {v}"
             for k, v in read_config(path).items() if getattr(model.config, k) != v]
    if wrong:
        raise ValueError(f"model.init_from={path}: " + "; ".join(wrong))
    ours = model.state_dict()
    with torch.no_grad():
        for key, value in read_state_dict(path).items():
            key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
            if key.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers in older checkpoints; SDPA needs none
            if key not in ours:
                raise KeyError(f"model.init_from={path}: unexpected tensor {key}")
            if key.endswith(_CONV1D):
                value = value.t()
            mine = ours[key]
            if key in _PADDED and mine.shape[0] > value.shape[0]:  # pad_vocab_to: the tokens' rows
                mine = mine[:value.shape[0]]
            if mine.shape != value.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model {tuple(mine.shape)}")
            mine.copy_(value)
