"""Turn a resolved config into built objects. The order of composition is written once, here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from ablate.model import GPT, GPTConfig
from ablate.techniques import Invalid, Plan

TECHNIQUE_GROUPS = ("precision", "accumulation", "checkpoint", "offload", "parallel", "optimizer")


@dataclass
class Techniques:
    """One built option per technique group; the train loop sees only their shared interface."""

    precision: Any
    accumulation: Any
    checkpoint: Any
    offload: Any
    parallel: Any
    optimizer: Any

    @classmethod
    def from_config(cls, cfg: dict) -> "Techniques":
        return cls(**{group: instantiate(cfg[group]) for group in TECHNIQUE_GROUPS})

    def check(self, plan: Plan) -> None:
        """Raise Invalid for the first option that cannot run under `plan`."""
        for group in TECHNIQUE_GROUPS:
            getattr(self, group).check(plan)


def plan_of(cfg: dict, device: str) -> Plan:
    return Plan(device=device, batch_size=cfg["batch_size"], seq_len=cfg["seq_len"])


def check_config(cfg: dict, device: str = "auto") -> Techniques:
    """Everything that can be checked without a device: option values and their combination."""
    t = Techniques.from_config(cfg)
    model = cfg["model"]
    if cfg["seq_len"] > model["block_size"]:
        raise Invalid(f"seq_len={cfg['seq_len']} > model.block_size={model['block_size']}")
    for key in ("batch_size", "seq_len"):
        if cfg[key] < 1:
            raise Invalid(f"{key}={cfg[key]} must be >= 1")
    t.check(plan_of(cfg, device))
    return t


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise Invalid("device=cuda but the worker sees no CUDA device (valid: auto, cpu, cuda)")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def gpt_config(model_cfg: dict) -> GPTConfig:
    return GPTConfig(**{f.name: model_cfg[f.name] for f in dataclasses.fields(GPTConfig)})


def build_model(model_cfg: dict, t: Techniques, device: torch.device) -> nn.Module:
    # 1. Build and initialise in fp32 on the host, then move and cast to the parameter dtype.
    model = GPT(gpt_config(model_cfg))
    if model_cfg.get("init_from"):
        from ablate.hf import load_weights  # safetensors only needed when loading weights

        load_weights(model, model_cfg["init_from"])
    model = model.to(device=device, dtype=t.precision.param_dtype)
    # 2. Recompute wrappers go on the bare blocks, before any parallel wrapper hides them.
    model = t.checkpoint.apply(model)
    # 3. The parallel wrapper comes last: DDP/FSDP must see the final module tree.
    return t.parallel.wrap(model)


def build_optimizer(model: nn.Module, t: Techniques) -> torch.optim.Optimizer:
    # 4. After the parallel wrap, so the optimizer holds the (possibly sharded) final parameters.
    return t.optimizer.build(model)
