"""Load GPT-2 weights from a local Hugging Face checkpoint directory (safetensors), no hub access.

The directory is what `GPT2LMHeadModel.save_pretrained(dir)` writes: config.json plus
model.safetensors (or shards listed in model.safetensors.index.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ablate.model import GPT

# HF's GPT-2 uses Conv1D layers, whose weights are stored (in, out): transpose into nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_config(path: str | Path) -> dict:
    """GPT-2 shape keys of a checkpoint directory, in our GPTConfig's names."""
    hf = json.loads((Path(path) / "config.json").read_text())
    return dict(
        n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
        vocab_size=hf["vocab_size"], block_size=hf["n_positions"],
    )


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
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
        for key, value in _state_dict(path).items():
            key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
            if key.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers in older checkpoints; SDPA needs none
            if key not in ours:
                raise KeyError(f"model.init_from={path}: unexpected tensor {key}")
            if key.endswith(_CONV1D):
                value = value.t()
            if ours[key].shape != value.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model {tuple(ours[key].shape)}")
            ours[key].copy_(value)
