"""Turn a resolved config into built objects. The order of composition is written once, here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from ablate.capacity import MemoryLimit
from ablate.keytypes import check_types
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


def plan_of(cfg: dict, device: str, t: Techniques) -> Plan:
    """What every option may know about the others when it checks itself."""
    return Plan(device=device, batch_size=cfg["batch_size"], seq_len=cfg["seq_len"],
                world_size=t.parallel.world_size, accumulation_steps=t.accumulation.steps,
                grad_scaler=t.precision.scales_loss, param_dtype=t.precision.param_dtype,
                stochastic_rounding=t.precision.stochastic_rounding, sharded=t.parallel.shards_params,
                in_backward=t.optimizer.in_backward)


def check_config(cfg: dict, device: str | None = None) -> Techniques:
    """Option values and their combination. `device` is the worker's (cpu, cuda). Without one (the
    job, which never touches CUDA) a config that says device=cpu gets the CPU's rules at once, and
    the other device-specific rules wait for the worker, which calls this again with its device."""
    device = device or ("cpu" if cfg["device"] == "cpu" else "auto")
    for group in (*TECHNIQUE_GROUPS, "data"):
        check_types(group, cfg[group])
    t = Techniques.from_config(cfg)
    instantiate(cfg["data"])  # its own checks (data.branching <= data.vocab_size); loading waits for the worker
    model = cfg["model"]
    if cfg["seq_len"] > model["block_size"]:
        raise Invalid(f"seq_len={cfg['seq_len']} > model.block_size={model['block_size']}")
    for key in ("batch_size", "seq_len", "steps", "samples"):  # steps=0 would report an ok run that timed nothing
        if cfg.get(key) is not None and cfg[key] < 1:
            raise Invalid(f"{key}={cfg[key]} must be >= 1")
    if cfg["warmup_steps"] < 0:
        raise Invalid(f"warmup_steps={cfg['warmup_steps']} must be >= 0")
    if cfg["timeout_s"] <= 0:  # else a timeout row for a worker killed before it could start
        raise Invalid(f"timeout_s={cfg['timeout_s']} must be > 0 (seconds one worker may run)")
    if model["n_embd"] % model["n_head"]:  # else the model's own assert fails inside a worker
        raise Invalid(f"model.n_embd={model['n_embd']} is not divisible by model.n_head={model['n_head']}")
    if cfg.get("gpu_memory_gib") is not None:
        MemoryLimit(cfg["gpu_memory_gib"], torch.device("cpu"))  # rejects a card smaller than the CUDA context
    if cfg["compile"] and cfg["warmup_steps"] < 2:
        raise Invalid("compile=true needs warmup_steps >= 2: the first compiles, the last is traced")
    t.check(plan_of(cfg, device, t))
    return t


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise Invalid("device=cuda but the worker sees no CUDA device (valid: auto, cpu, cuda)")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def gpt_config(model_cfg: dict) -> GPTConfig:
    return GPTConfig(**{f.name: model_cfg[f.name] for f in dataclasses.fields(GPTConfig)})


def build_model(model_cfg: dict, t: Techniques, device: torch.device, compile: bool = False) -> nn.Module:
    # 1. Materialise on the device in the parameter dtype (the precision option decides how).
    model = t.precision.materialize(lambda: GPT(gpt_config(model_cfg)), device)
    if model_cfg.get("init_from"):
        from ablate.hf import load_weights  # safetensors only needed when loading weights

        load_weights(model, model_cfg["init_from"])
    # 2. Recompute wrappers go on the bare blocks, before compile and any parallel wrapper hide them.
    model = t.checkpoint.apply(model)
    # 3. Compile the wrapped model before the parallel wrap (torchtitan's order), so DDP/FSDP
    #    hooks stay outside the compiled graphs.
    if compile:
        model = torch.compile(model)
    # 4. The parallel wrapper comes last: DDP/FSDP must see the final module tree.
    return t.parallel.wrap(model, t.precision, t.offload)


def build_optimizer(model: nn.Module, t: Techniques) -> torch.optim.Optimizer:
    # 5. After the parallel wrap, so the optimizer holds the (possibly sharded) final parameters;
    #    the offload option decides where its states live.
    return t.offload.build_optimizer(t.optimizer, model)
