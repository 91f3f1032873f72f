"""The analytic predictor sees the model the techniques make: an option that freezes parameters or
adds some (its `change_params`, which the build applies) is predicted exactly, on parameters,
gradients and optimizer state, against MemTracker on real CPU steps."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ablate import build
from ablate.build import TECHNIQUE_GROUPS
from ablate.predict.analytic import analytic
from ablate.techniques import Option
from tests.test_predict import MIB, NANO, measured

RANK = 8  # columns of the matrix added to every attention block


class Nothing(Option):
    """Changes nothing: the plain run of the group."""

    memory_in_params = True


class FreezeEmbedding(Option):
    """The token embedding (and a head tied to it) trains not."""

    memory_in_params = True

    def change_params(self, model, adapter):
        model.get_submodule(adapter.embedding).weight.requires_grad_(False)
        return model


class AttentionExtra(Option):
    """A (d, RANK) parameter on every attention block, used by its output (as an adapter's would
    be), so that it has a gradient and optimizer state."""

    memory_in_params = True

    def change_params(self, model, adapter):
        for layer in adapter.layer_list(model):
            attention = layer.get_submodule(adapter.attention)
            weight = next(attention.parameters())
            attention.extra = nn.Parameter(torch.zeros(weight.shape[-1], RANK, dtype=weight.dtype, device=weight.device))
            attention.register_forward_hook(lambda m, args, out: out + out @ m.extra @ m.extra.T)
        return model


@pytest.mark.parametrize("option", ["FreezeEmbedding", "AttentionExtra"])
@pytest.mark.parametrize("overrides", [["optimizer=adamw"], ["optimizer=sgd", "optimizer.momentum=0.9", "accumulation=x4"],
                                       ["precision=bf16_pure", "checkpoint=block"]], ids=",".join)
def test_frozen_and_added_parameters_are_predicted_exactly(monkeypatch, option, overrides):
    monkeypatch.setattr(build, "TECHNIQUE_GROUPS", (*TECHNIQUE_GROUPS, "tune"))
    node = {"_target_": f"{__name__}.{option}"}
    real = measured(overrides, base=NANO, extra={"tune": node})
    pred = analytic(with_group(overrides, "tune", node))
    plain = analytic(with_group(overrides, "tune", {"_target_": f"{__name__}.Nothing"}))
    assert pred.category_max_mib["params"] * MIB == real.category_max["params"] * MIB
    assert pred.category_max_mib["grads"] * MIB == real.category_max["grads"] * MIB
    assert pred.steady_mib["optimizer"] * MIB == real.after["optimizer"] * MIB
    changed = "grads" if option == "FreezeEmbedding" else "params"
    assert pred.category_max_mib[changed] != plain.category_max_mib[changed]  # the change is seen at all


def with_group(overrides: list[str], group: str, node: dict):
    from tests.helpers import compose_spec

    spec = compose_spec([*NANO, *overrides])
    spec.groups[group] = node
    return spec
