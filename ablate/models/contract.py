"""The model contract: what the module a model family builds (`Family.build`) must do for ablate to
train and measure it, written as a Protocol (`LanguageModel`) and checked before a point runs
(`check_model`, from `Family.check_contract`).

Most of it fails loudly where it is broken (a missing method is an AttributeError in the worker);
one part does not: a model that ignores `loss_fn` trains, and its loss=chunked row measures the
standard loss under the chunked label. So that part is run, on the meta device: a forward with a
sentinel `loss_fn`, which stops it where it is called.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ablate.techniques import Invalid

METHODS = ("forward", "tie_weights", "reset_parameters")


@runtime_checkable
class LanguageModel(Protocol):
    """The module a family builds, as ablate's build, train loop and loss options use it.

    - `forward(idx, targets=None)`: idx (B, T) int64 token ids; targets (B, T) the next tokens,
      already shifted, or None. Returns (logits (B, T, vocab) or None, mean loss (0-d) or None): the
      loss with targets only, taken as `ablate.models.lm_loss` takes it (fp32 cross-entropy), so a
      loss means the same for every family.
    - `loss_fn`: None, or what loss=chunked and loss=fused set (ablate/techniques/loss.py `attach`):
      a callable (hidden (B, T, C) after the final norm, head module (weight (V, C), bias), targets,
      **kw) -> mean loss. Set and with targets, forward must return (None, loss_fn(hidden, head,
      targets)) and make no logits: the head and the loss are computed together, in slices.
    - `tie_weights()`: shares the LM head's weight with the token embedding where the model does (a
      no-op where it does not); called again after `to_empty`, which unties them.
    - `reset_parameters()`: every parameter's and buffer's initial value, in place: a model is built
      on the meta device and given storage on its device before this runs.

    Its forward runs on meta tensors (shapes, no values): `check_model` and predict=trace run it so.
    """

    loss_fn: Optional[Callable[..., torch.Tensor]]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None): ...

    def tie_weights(self) -> None: ...

    def reset_parameters(self) -> None: ...


def part(model: nn.Module, path: str, key: str) -> nn.Module:
    """`model`'s submodule at the dotted `path`; Invalid naming `model.<key>` where there is none."""
    at, seen = model, []
    for name in path.split("."):
        child = dict(at.named_children()).get(name)
        if child is None:
            children = ", ".join(n for n, _ in at.named_children()) or "none"
            where = ".".join(seen) or type(model).__name__
            raise Invalid(f"model.{key}={path}: {where} has no module {name!r} (its children: {children})")
        at, seen = child, [*seen, name]
    return at


def check_model(model: nn.Module, family, chunked: bool = False) -> None:
    """Raise Invalid, naming the model option, for the first part of the contract that `model` (a
    meta build of `family`, an ablate.models.Family) breaks: a method or `loss_fn` missing, a
    forward that does not take (idx, targets), an adapter path to no module; with `chunked`
    (loss=chunked or fused), a forward that never hands its hidden states and head to `loss_fn`.

    Cost: attribute reads, and with `chunked` one forward on a (1, 2) meta input: 5-10 ms per
    decoder layer on a CPU (a meta LayerNorm runs torch._refs' Python), after the process's first
    meta LayerNorm, which imports torch._dynamo (1 s)."""
    who = f"model={family.name}: {type(model).__name__}"
    missing = [m for m in METHODS if not callable(getattr(model, m, None))]
    missing += [] if hasattr(model, "loss_fn") else ["a loss_fn attribute (None until a loss option sets it)"]
    if missing:
        raise Invalid(f"{who} lacks {', '.join(missing)}, which the model contract asks for "
                      f"(ablate/models/contract.py LanguageModel)")
    idx = torch.zeros((1, min(2, family.max_seq_len)), dtype=torch.long, device="meta")
    try:
        inspect.signature(model.forward).bind(idx, idx)
    except TypeError:
        raise Invalid(f"{who}.forward{inspect.signature(model.forward)} does not take (idx, targets)") from None
    _check_parts(model, family.adapter)
    if chunked:
        _check_calls_loss_fn(model, idx, who)


def _check_parts(model: nn.Module, adapter) -> None:
    """Each adapter path names a module: the layers a non-empty ModuleList whose first layer has
    the attention and MLP children; the head and the embeddings modules with a 2-d weight."""
    layers = part(model, adapter.layers, "layers")
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise Invalid(f"model.layers={adapter.layers} is {type(layers).__name__}, not the non-empty nn.ModuleList "
                      f"of repeated layers that checkpointing and FSDP wrap")
    for key in ("attention", "mlp"):
        name = getattr(adapter, key)
        if not isinstance(getattr(layers[0], name, None), nn.Module):
            children = ", ".join(n for n, _ in layers[0].named_children())
            raise Invalid(f"model.{key}={name}: the layer {type(layers[0]).__name__} has no such child "
                          f"(its children: {children})")
    for key in ("lm_head", "embedding", "position_embedding"):
        path = getattr(adapter, key)
        weight = getattr(part(model, path, key), "weight", None) if path else None
        if path and not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
            raise Invalid(f"model.{key}={path} is no module with a 2-d weight (rows x hidden)")


class _Reached(BaseException):
    """Raised by the sentinel loss_fn: stops the forward where it calls it. A BaseException, so that
    a model's own `except Exception` does not take it for a failure of its own."""

    def __init__(self, hidden, head, targets):
        super().__init__()
        self.hidden, self.head, self.targets = hidden, head, targets


def _sentinel(hidden, head, targets, **kw):
    raise _Reached(hidden, head, targets)


class _AnyValue(TorchDispatchMode):
    """Answers a read of a meta tensor's value (`.item()`) with 1 (True for a bool), which meta
    tensors cannot answer: transformers asks whether position ids pack several sequences, a model
    may assert its token ids' range. The check follows the path to loss_fn, whatever the values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def _check_calls_loss_fn(model: nn.Module, idx: torch.Tensor, who: str) -> None:
    """One meta forward with targets and the sentinel as loss_fn: it must reach it, with (B, T, C)
    hidden states and a head whose weight is (V, C)."""
    kept, model.loss_fn = model.loss_fn, _sentinel
    try:
        with torch.no_grad(), _AnyValue():
            model(idx, idx)
    except _Reached as reached:
        hidden, head, targets = reached.hidden, reached.head, reached.targets
    except Exception as exc:  # noqa: BLE001  (a model's own error, whatever it is, is the reason)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Invalid(f"{who}.forward fails on the meta device ({type(exc).__name__}: {text}), so ablate cannot "
                      f"check that it calls loss_fn, which loss=chunked, fused, liger and cce need: make it run on "
                      f"meta tensors (shapes, no values) or use loss=standard") from None
    else:
        raise Invalid(f"{who}.forward never calls loss_fn, so loss=chunked, fused, liger and cce would measure the "
                      f"standard loss: with targets and self.loss_fn set, return "
                      f"(None, self.loss_fn(hidden, self.lm_head, targets))")
    finally:
        model.loss_fn = kept
    weight = getattr(head, "weight", None)
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and isinstance(hidden, torch.Tensor)
            and hidden.shape == (*idx.shape, weight.shape[1]) and getattr(targets, "shape", None) == idx.shape):
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise Invalid(f"{who}.forward calls loss_fn with {shape} and a {type(head).__name__}: it takes the "
                      f"(B, T, C) hidden states after the final norm, the LM head module (weight (V, C)) and "
                      f"the (B, T) targets")
