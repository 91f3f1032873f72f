"""The values a model built on the meta device would otherwise start without.

A model built on meta has shapes and no values; the family's initialisers (`reset_parameters`)
then write every weight once, on the device. A value that a module sets in its own `__init__` and
no initialiser writes again is left as whatever the allocator's memory held: Apertus's xIELU
activation makes its alpha parameters and its beta and eps buffers from constants in `__init__`,
and transformers' `_init_weights` does not know them, so an Apertus MLP trained on garbage (its
losses changed from run to run, and block recompute "changed" them further). So each tensor is
marked before the initialisers run, and what is still marked after them is copied from the model
built for real on the host with no initialiser run (`Family.constants`), where those constants are.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _mark_value(dtype: torch.dtype) -> float | int | None:
    """What no initialiser writes: NaN, or an integer type's least value (None: left unmarked)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return torch.iinfo(dtype).min
    return None


def _marked(t: torch.Tensor) -> bool:
    mark = _mark_value(t.dtype)
    if mark is None or t.numel() == 0:
        return False
    if t.dtype.is_floating_point:  # a sum reads the tensor once and makes no (numel,) mask: 10x faster
        return bool(torch.isnan(t.sum()))  # (+inf and -inf together also sum to NaN: copied, harmlessly)
    return bool((t == mark).any())


def initialise(model: nn.Module, initialise_: Callable[[], None], constants: Callable[[], nn.Module]) -> list[str]:
    """Run `initialise_()` on `model` (its tensors given storage, none written yet), then give each
    tensor it left (wholly or in part) unwritten its value in `constants()`. Returns their names."""
    if any(isinstance(t, FakeTensor) for _, t in _tensors(model)):  # predict=trace: no values to mend
        initialise_()
        return []
    with torch.no_grad():
        for _, t in _tensors(model):
            mark = _mark_value(t.dtype)
            if mark is not None:
                t.fill_(mark)
        initialise_()
        unset = [name for name, t in _tensors(model) if _marked(t)]
        if unset:
            source = dict(_tensors(constants()))
            own = dict(_tensors(model))
            for name in unset:
                own[name].copy_(source[name])
    return unset
