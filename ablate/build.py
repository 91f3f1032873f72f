"""Turn a resolved config into built objects. The order of composition is written once, here."""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from ablate.capacity import MemoryLimit
from ablate.groups import TECHNIQUE_GROUPS  # noqa: F401  (tests and the predictor read it here too)
from ablate.keytypes import check_types
from ablate.models import Family
from ablate.spec import RunSpec
from ablate.techniques import Invalid, Option, Plan

# Families built from a spec, by their node and attention: what a family caches (its transformers
# config, meta model, samples and layouts) depends on those alone, and a job asks for it in every
# point's check, prediction, step time and count, once more per probe of a batch or length search
# (find_seq plans a point in a dozen): built once, read off the meta model once.
_FAMILIES: OrderedDict[str, Family] = OrderedDict()
FAMILIES_KEPT = 8  # a sweep over more models than this builds the oldest again


def family_of(node: dict, attn_implementation: str) -> Family:
    """The family `node` (the spec's model node) builds with `attn_implementation`, shared by
    every point of this process that names the same."""
    key = json.dumps([node, attn_implementation], sort_keys=True, default=str)
    if key not in _FAMILIES:
        family = instantiate(node)
        family.attn_implementation = attn_implementation
        _FAMILIES[key] = family
        while len(_FAMILIES) > FAMILIES_KEPT:
            _FAMILIES.popitem(last=False)
    _FAMILIES.move_to_end(key)
    return _FAMILIES[key]


class Techniques:
    """The model family and one built option per technique group (ablate/groups.py), each an
    attribute named for its group (`t.optimizer`); the train loop sees only their shared interface."""

    def __init__(self, model: Family, **options: Any):
        missing = [g for g in TECHNIQUE_GROUPS if g not in options]
        if missing or len(options) != len(TECHNIQUE_GROUPS):
            raise TypeError(f"Techniques takes one option per technique group {TECHNIQUE_GROUPS}; missing {missing}")
        self.model = model
        for group, option in options.items():
            option.family = model  # where its layers are, for an option that treats them apart (Muon)
            setattr(self, group, option)
        model.attn_implementation = self.attention.implementation  # the attention the family builds
        self.nodes: dict[str, dict] | None = None  # group -> the option's node, where built from a spec

    @classmethod
    def of(cls, spec: RunSpec) -> "Techniques":
        """Every option built anew from the spec's option nodes (options are stateful: a fresh set
        each time), and the model family of its node and attention, built once per process."""
        options = {group: instantiate(spec.groups[group]) for group in TECHNIQUE_GROUPS}
        t = cls(family_of(spec.groups["model"], options["attention"].implementation), **options)
        t.nodes = {group: spec.groups[group] for group in TECHNIQUE_GROUPS}
        return t

    def options(self) -> dict[str, Any]:
        """{group: its option}, technique groups in the order they are checked and built."""
        return {group: getattr(self, group) for group in TECHNIQUE_GROUPS}

    def untraceable(self) -> str | None:
        """`group=option` for the first option whose step MemTracker cannot follow; None if all can."""
        for group, option in self.options().items():
            if not option.traceable:
                return f"{group}={type(option).__name__.lower()}"
        return None

    def check(self, plan: Plan) -> None:
        """Raise Invalid for the first option that cannot run under `plan`."""
        for group in ("model", *TECHNIQUE_GROUPS):
            getattr(self, group).check(plan)


def plan_of(spec: RunSpec, device: str, t: Techniques) -> Plan:
    """What every option may know about the others when it checks itself."""
    return Plan(device=device, batch_size=spec.batch_size, seq_len=spec.seq_len,
                world_size=t.parallel.world_size, accumulation_steps=t.accumulation.steps,
                grad_scaler=t.precision.scales_loss, param_dtype=t.precision.param_dtype,
                stochastic_rounding=t.precision.stochastic_rounding,
                sharded=t.parallel.shards_params or t.offload.shards_params,
                in_backward=t.optimizer.in_backward, chunked_loss=t.loss.from_hidden, frozen_base=t.peft.freezes_base,
                autocast=t.precision.autocast_dtype is not None, states_on_host=t.offload.states_on_host)


def check_config(spec: RunSpec, device: str | None = None) -> Techniques:
    """Option values and their combination. `device` is the worker's (cpu, cuda). Without one (the
    job, which never touches CUDA) a config that says device=cpu gets the CPU's rules at once, and
    the other device-specific rules wait for the worker, which calls this again with its device."""
    device = device or ("cpu" if spec.device == "cpu" else "auto")
    for group in ("model", *TECHNIQUE_GROUPS, "data"):
        missing = [k for k, v in spec.groups[group].items() if v == "???"]  # OmegaConf's mandatory value
        if missing:  # else instantiate's "Missing mandatory value: path", naming no group
            raise Invalid(f"{group}.{missing[0]} is required by this {group} option: give {group}.{missing[0]}=...")
        check_types(group, spec.groups[group])
    t = Techniques.of(spec)
    data = instantiate(spec.groups["data"])  # its own checks (data.branching <= data.vocab_size); loading waits for the worker
    data.check()  # its files, cheaply (sizes, a text's head): a plan refuses what the worker's load would
    if (getattr(data, "vocab_size", None) or 0) > t.model.vocab_size:
        raise Invalid(f"data.vocab_size={data.vocab_size} > the model's vocabulary of {t.model.vocab_size} tokens")
    if spec.eval_steps < 0:
        raise Invalid(f"eval_steps={spec.eval_steps} must be >= 0 (0: no eval)")
    for key in ("batch_size", "seq_len", "steps", "samples"):  # steps=0 would report an ok run that timed nothing
        if getattr(spec, key) is not None and getattr(spec, key) < 1:
            raise Invalid(f"{key}={getattr(spec, key)} must be >= 1")
    per_step = spec.batch_size * t.parallel.world_size  # samples one optimizer step takes, all ranks
    if spec.samples is not None and 0 < spec.samples < per_step:  # else one step of more samples than asked
        raise Invalid(f"samples={spec.samples} is less than one optimizer step's {per_step} samples (batch_size="
                      f"{spec.batch_size}{f' x {t.parallel.world_size} ranks' if t.parallel.world_size > 1 else ''}):"
                      f" give samples >= {per_step}, or steps")
    if spec.warmup_steps < 2:  # 0 gave an ok row with no peak, 1 a peak without the optimizer state (on CPU)
        raise Invalid(f"warmup_steps={spec.warmup_steps} must be >= 2: the first step allocates the optimizer "
                      "state and the last warm-up step is the one traced for the breakdown (and, on a CPU, the peak)")
    if spec.timeout_s <= 0:  # else a timeout row for a worker killed before it could start
        raise Invalid(f"timeout_s={spec.timeout_s} must be > 0 (seconds one worker may run)")
    if spec.gpu_memory_gib is not None:
        MemoryLimit(spec.gpu_memory_gib, torch.device("cpu"))  # rejects a card smaller than the CUDA context
    t.check(plan_of(spec, device, t))
    return t


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise Invalid("device=cuda but the worker sees no CUDA device (valid: auto, cpu, cuda)")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def build_model(t: Techniques, device: torch.device, compile: bool = False) -> nn.Module:
    # 1. Materialise on the device in the parameter dtype (the precision option decides how),
    #    then load init_from's weights, if any, into it. A base the peft option stores in another
    #    format (QLoRA's 4-bit weights) is materialised on the host and converted on its way over.
    model = t.precision.materialize(t.model, torch.device("cpu") if t.peft.base_on_host else device)
    t.model.load_weights(model)
    adapter = t.model.adapter  # where the layers are, for every technique below
    # 1a. Parameters the techniques change (frozen, added), on the bare model, before any wrapper
    #     sees them; the analytic predictor makes the same change on its meta model.
    model = change_params(t)(model)
    if t.peft.base_on_host:  # one tensor at a time: the device never holds the whole 16-bit base
        model = model.to(device)
    model = t.offload.apply(model, adapter)  # hooks on the bare layers (where each layer's saved tensors begin)
    t.loss.attach(model, adapter)  # before any wrapper: the model's own forward hands its hidden states to the loss
    # 1b. Layers swapped for another number format (fp8) on the bare model, before recompute
    #     wrappers and compile see them (torchtitan's order).
    model = t.precision.convert(model, adapter)
    # 1c. Modules swapped for fused kernels, then MLPs tiled over the sequence, on the bare layers,
    #     before a recompute wrapper hides them (a recomputed layer then tiles again).
    model = t.kernels.apply(model, adapter)
    model = t.tiling.apply(model, adapter)
    # 2. Recompute wrappers go on the bare layers, before compile and any parallel wrapper hide them.
    model = t.checkpoint.apply(model, adapter)
    # 3. Compile the wrapped model before the parallel wrap (torchtitan's order), so DDP/FSDP
    #    hooks stay outside the compiled graphs.
    if compile:
        model = torch.compile(model)
    # 4. The parallel wrapper comes last: DDP/FSDP must see the final module tree.
    return t.parallel.wrap(model, adapter, t.precision, t.offload)


def change_params(t: Techniques):
    """model -> the model with every technique's change_params applied, in the build's order. Its
    `key` names the change for the family's layouts (Family.layout_with): the nodes of the options
    that make it, where `t` was built from a spec; None (read anew each time) otherwise."""
    def change(model: nn.Module) -> nn.Module:
        for option in t.options().values():
            model = option.change_params(model, t.model.adapter)
        return model
    changing = [g for g, o in t.options().items() if type(o).change_params is not Option.change_params]
    change.key = None if t.nodes is None else json.dumps([t.nodes[g] for g in changing], sort_keys=True, default=str)
    return change


def build_optimizer(model: nn.Module, t: Techniques) -> torch.optim.Optimizer:
    # 5. After the parallel wrap, so the optimizer holds the (possibly sharded) final parameters;
    #    the offload option decides where its states live.
    return t.offload.build_optimizer(t.optimizer, model)
