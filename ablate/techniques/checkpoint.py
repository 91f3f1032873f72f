"""checkpoint group: which activations are recomputed in backward instead of stored.

Every option wraps chosen submodules in place with torch's own non-reentrant checkpoint wrapper
(what torchtitan uses), so parameters stay the same objects: the tied lm_head/wte weight survives.
The modules are found through the model family's adapter (ablate/models/): its repeated layers,
their attention and MLP, its norm and activation classes, for any family.

`recompute_fraction` (for HFU) is the share of the model's forward FLOPs run again in backward,
estimated from matmul weights: the weights a token multiplies by inside the recomputed modules over
those of the whole model (Adapter.matmul_weights: every Linear, the LM head included, and a mixture
of experts' routed share). An approximation: SDPA and pointwise FLOPs are
ignored, and torch's early stop may skip a wrapped module's last matmul when nothing after it is
needed in backward (the estimate counts it), so the true recompute is at most this figure.
"""
from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ablate.models import Adapter
from ablate.techniques import Invalid, Option, Plan


class NoCheckpoint(Option):
    """Store every activation for backward: fastest, most activation memory."""

    label = "No recompute"
    recompute_fraction = 0.0  # share of the forward pass run again in backward (for HFU)
    # The analytic predictor's questions (ablate/predict/layers.py, analytic.py):
    recompute_with_mlp = True  # a layer's recompute is alive during its MLP's backward (else after it)
    recomputes_final_norm = False  # the final norm is recomputed: it keeps nothing beyond its input
    wraps_norms = False  # every norm is recomputed, its wrapper keeping its input (a layer's first: the layer's input)
    wraps_attention = False  # a wrapper takes attention's inputs (a layer, or attention itself), so it keeps them
    wraps_mlp = False  # the MLP alone is recomputed
    saves_op_outputs = False  # what a layer keeps is chosen op by op (selective op recompute)
    recomputes_casts = False  # no matmul keeps its weight's autocast cast: backward casts again
    wraps_head = False  # the LM head (a Linear) is recomputed: its wrapper keeps its input, no cast

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        return model

    def kept(self, index: int, full: float, parts: dict) -> float:
        """Bytes layer `index` keeps for backward beyond its input, given what it keeps without
        recompute: `full` in all, `parts` by what keeps it ("attn", "mlp", "norm", "qk_norm": the
        bytes each keeps; "matmul": the matmul and SDPA outputs; "attn_input", "mlp_input": what
        attention's and the MLP's projections keep of the norm output they read, and
        "mlp_input_wrapped" what a wrapper around them keeps of it instead)."""
        return full


class _Recompute(NoCheckpoint, abc.ABC):
    """Shared glue: pick (parent, name) pairs, wrap each module, estimate recompute_fraction."""

    @abc.abstractmethod
    def _targets(self, model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str]]:
        """The (parent module, child name) pairs whose child is wrapped."""

    def _wrap(self, module: nn.Module) -> nn.Module:
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        targets = self._targets(model, adapter)
        chosen = [getattr(parent, name) for parent, name in targets]
        # 2 * weights FLOPs per token for each matmul; the factor 2 cancels in the ratio.
        self.recompute_fraction = adapter.matmul_weights(chosen) / adapter.matmul_weights([model])
        for (parent, name), module in zip(targets, chosen):
            setattr(parent, name, self._wrap(module))  # ModuleList accepts "0", "1", ... as names
        return model


class Blocks(_Recompute):
    """Recompute every `every_n`-th transformer block in backward instead of storing its
    activations (torchtitan's full / selective-layer AC). Saves: all activations inside those
    blocks but their input, (B, T, C) per block. Spends: one more forward of those blocks."""

    wraps_attention = True

    def __init__(self, every_n: int = 1):
        self.every_n = every_n

    @property
    def label(self) -> str:
        if self.every_n == 1:
            return "Block recompute"
        n = self.every_n
        nth = {1: "st", 2: "nd", 3: "rd"}.get(n % 10 if n % 100 not in (11, 12, 13) else 0, "th")
        return f"Recompute every {n}{nth} block"

    def check(self, plan: Plan) -> None:
        if self.every_n < 1:
            raise Invalid(f"checkpoint.every_n={self.every_n} must be >= 1")

    def kept(self, index: int, full: float, parts: dict) -> float:
        return 0.0 if (index + 1) % self.every_n == 0 else full  # only the layer input, by the wrapper

    def _targets(self, model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str]]:
        h = adapter.layer_list(model)
        # Blocks n, 2n, ... counted from 1 (torchtitan's ac_freq): every_n=2 wraps h[1], h[3], ...
        return [(h, str(i)) for i in range(len(h)) if (i + 1) % self.every_n == 0]


class Sublayer(_Recompute):
    """Recompute one sub-layer of every block, `part` = attn (q, k, v, SDPA output and its
    logsumexp) or mlp (the (B, T, 4C) hidden before and after GELU). Saves: that sub-layer's
    activations. Spends: one more forward of it, about 1/3 (attn) or 2/3 (mlp) of a block's matmuls."""

    PARTS = ("attn", "mlp")

    def __init__(self, part: str = "mlp"):
        self.part = part

    @property
    def label(self) -> str:
        return {"attn": "Attention recompute", "mlp": "MLP recompute"}.get(self.part, f"{self.part} recompute")

    @property
    def recompute_with_mlp(self) -> bool:
        return self.part != "attn"

    @property
    def wraps_attention(self) -> bool:
        return self.part == "attn"

    @property
    def wraps_mlp(self) -> bool:
        return self.part == "mlp"

    def kept(self, index: int, full: float, parts: dict) -> float:
        # the sub-layer's input (a norm output) is kept, in place of its projections' casts of it
        if self.part == "attn":
            return full - parts["attn"] - parts.get("attn_input", 0.0)
        mlp_input = parts.get("mlp_input", 0.0)
        return full - parts["mlp"] - mlp_input + parts.get("mlp_input_wrapped", mlp_input)

    def check(self, plan: Plan) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.part not in self.PARTS:
            raise Invalid(f"checkpoint.part: {self.part!r} is not one of {', '.join(self.PARTS)}")

    def _targets(self, model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str]]:
        self._validate()
        child = adapter.attention if self.part == "attn" else adapter.mlp  # the family's name for it
        return [(block, child) for block in adapter.layer_list(model)]


# Ops whose outputs selective recompute keeps: the matmuls and attention, costly to redo.
# The forward SDPA kernels differ by device (CUDA flash / efficient / cuDNN, the CPU flash one).
# _grouped_mm is a mixture of experts' matmul (transformers runs all experts of a layer as one).
_SAVE_NAMES = ("mm", "addmm", "bmm", "linear", "_grouped_mm", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_fused_attention_overrideable")
_SAVE = {getattr(torch.ops.aten, n) for n in _SAVE_NAMES if hasattr(torch.ops.aten, n)}
# transformers' loop over the experts, which it runs where torch's grouped matmul cannot (and the
# trace runs for experts not in bf16): by name, since transformers registers it only when imported.
_SAVE_CUSTOM = ("transformers::grouped_mm_fallback",)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep matmul and attention outputs, recompute everything else."""
    packet = getattr(op, "overloadpacket", None)
    saved = packet in _SAVE or getattr(op, "name", lambda: "")() in _SAVE_CUSTOM
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveOps(_Recompute):
    """Per-op selective recompute in every block (torch's create_selective_checkpoint_contexts,
    torchtitan's op-level SAC): the outputs of matmuls and SDPA are stored, the pointwise ops
    (LayerNorm, GELU, dropout, views) are run again in backward. Saves: the pointwise outputs,
    e.g. the (B, T, 4C) GELU output and the LayerNorm outputs. Spends: only cheap pointwise
    recompute, so recompute_fraction is ~0 (no matmul runs twice)."""

    label = "Selective op recompute"
    wraps_attention = saves_op_outputs = recomputes_casts = True  # a cast is no matmul output

    def kept(self, index: int, full: float, parts: dict) -> float:
        return parts["matmul"]  # matmul and SDPA outputs kept; norms, adds, activations recomputed

    def _targets(self, model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str]]:
        h = adapter.layer_list(model)
        return [(h, str(i)) for i in range(len(h))]

    def _wrap(self, module: nn.Module) -> nn.Module:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn)

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        model = super().apply(model, adapter)
        self.recompute_fraction = 0.0  # pointwise FLOPs only, which the estimate ignores
        return model


# checkpoint.types -> the family's classes of that kind. `layernorm` is the family's norm (LayerNorm,
# or RMSNorm in Llama-like models), `gelu` its MLP activation module (GELU, or SiLU).
LAYER_TYPES: dict[str, Callable[[Adapter, nn.Module], tuple[type, ...]]] = {
    "layernorm": lambda a, model: a.norms,
    "gelu": lambda a, model: a.activations,
    "linear": lambda a, model: a.linears,
    "attention": lambda a, model: (a.attention_class(model),),
}


class Layers(_Recompute):
    """Recompute every module of the chosen `types` (layernorm: the family's norm, gelu: its MLP
    activation, linear, attention) anywhere in the model, outermost only (a Linear inside a wrapped attention is not wrapped again).
    Saves: what each such module stores for backward beyond its input (LayerNorm statistics,
    attention's q, k, v and SDPA output). Spends: one more forward of each. A lone Linear saves
    only its input and weight, which the wrapper keeps anyway: wrapping it saves nothing."""

    label = "Layer-type recompute"  # the report adds the types: "(layernorm, gelu)"
    recompute_with_mlp = False

    def __init__(self, types: Sequence[str] = ("layernorm", "gelu", "linear", "attention")):
        self.types = list(types)

    @property
    def wraps_norms(self) -> bool:
        return "layernorm" in self.types

    @property
    def recomputes_final_norm(self) -> bool:
        return self.wraps_norms

    @property
    def wraps_attention(self) -> bool:
        return "attention" in self.types

    @property
    def recomputes_casts(self) -> bool:  # every Linear wrapped: each keeps its fp32 weight, no cast
        return "linear" in self.types

    @property
    def wraps_head(self) -> bool:
        return "linear" in self.types

    def kept(self, index: int, full: float, parts: dict) -> float:
        saved = full
        if "attention" in self.types:  # its insides recomputed
            saved -= parts["attn"]
        if "attention" in self.types or "linear" in self.types:  # a wrapper around attention, or around
            saved -= parts.get("attn_input", 0.0)  # each projection, keeps the norm's output, not their casts of it
        if "linear" in self.types:  # ... and around the MLP's first projections
            mlp_input = parts.get("mlp_input", 0.0)
            saved -= mlp_input - parts.get("mlp_input_wrapped", mlp_input)
            # a wrapper around an adapted Linear's base keeps the input its adapters' copies stood in for
            saved += parts.get("mlp_linear_inputs", 0.0)
            if "attention" not in self.types:
                saved += parts.get("attn_linear_inputs", 0.0)
        if "layernorm" in self.types:  # what a norm keeps beyond its input
            saved -= parts["norm"]
            if "attention" not in self.types:  # Qwen3's q/k norms: wrapped inside attention only when it is not
                saved -= parts.get("qk_norm", 0.0)
        return saved  # any other wrapped Linear, or an activation, keeps what it kept before: its input

    def _validate(self) -> None:
        for t in self.types:
            if t not in LAYER_TYPES:
                raise Invalid(f"checkpoint.types: {t!r} is not one of {', '.join(LAYER_TYPES)}")

    def check(self, plan: Plan) -> None:
        self._validate()

    def _targets(self, model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str]]:
        self._validate()
        classes = tuple(c for t in self.types for c in LAYER_TYPES[t](adapter, model))
        chosen: list[str] = []
        for name, module in model.named_modules():  # pre-order: a parent comes before its children
            if isinstance(module, classes) and not any(name.startswith(p + ".") for p in chosen):
                chosen.append(name)
        targets = []
        for name in chosen:
            parent, _, child = name.rpartition(".")
            targets.append((model.get_submodule(parent), child))
        return targets
