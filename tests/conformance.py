"""The model contract (ablate/models/contract.py) checked on a real build of a family, for any
family's tests: `assert_family_conforms(overrides)` (tests/test_model_contract.py runs it for every
option of conf/model)."""
from __future__ import annotations

import math

import torch
from hydra.utils import instantiate
from torch import nn

from ablate.models import lm_loss
from ablate.models.contract import LanguageModel
from ablate.predict.trace import _moe_grouped_mm
from ablate.techniques import Plan
from ablate.techniques.loss import Chunked
from ablate.techniques.precision import FP32
from tests.helpers import compose_config


def assert_family_conforms(overrides: list[str], batch: int = 2, seq: int = 8):
    """Build the model option of the composed `overrides` as a worker does (meta, then storage and
    initial values on the CPU) and check the contract: the meta check passes with the chunked
    loss; forward's logits and loss have their shapes; a recording loss_fn is called once with the
    hidden states and the adapter's LM head and gives the standard loss; tie_weights and
    reset_parameters run and leave finite values; the adapter's paths name modules. Returns the
    family and the model."""
    family = instantiate(compose_config(overrides)["model"])
    # A transformers mixture of experts' grouped GEMM takes bf16 alone on meta tensors: the experts
    # run as the trace runs them (the real step's CPU kernel takes fp32).
    with _moe_grouped_mm():
        family.check_contract(Plan(device="cpu", batch_size=batch, seq_len=seq, chunked_loss=True))
    torch.manual_seed(0)
    model = FP32().materialize(family, torch.device("cpu"))
    assert isinstance(model, LanguageModel) and model.loss_fn is None
    _assert_parts(model, family.adapter)
    vocab = family.vocab_size
    idx, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))

    logits, none = model(idx)
    assert none is None and logits.shape == (batch, seq, vocab), logits.shape
    logits, standard = model(idx, targets)
    assert standard.dim() == 0 and math.isfinite(standard.item())
    torch.testing.assert_close(standard, lm_loss(logits, targets))

    calls, chunked = [], Chunked(chunks=2)

    def recording(hidden, head, y, **kw):
        calls.append((tuple(hidden.shape), head))
        return chunked(hidden, head, y, **kw)

    model.loss_fn = recording
    nothing, loss = model(idx, targets)
    model.loss_fn = None
    head = model.get_submodule(family.adapter.lm_head)
    assert nothing is None and len(calls) == 1, calls
    assert calls[0][0][:2] == (batch, seq) and calls[0][1] is head
    torch.testing.assert_close(loss, standard, rtol=1e-5, atol=1e-5)

    model.tie_weights()
    torch.testing.assert_close(model(idx, targets)[1], standard)
    model.reset_parameters()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert family.flops_params() > 0 and family.dims()[0] == len(family.adapter.layer_list(model))
    return family, model


def _assert_parts(model: nn.Module, adapter) -> None:
    layers = adapter.layer_list(model)
    assert isinstance(layers, nn.ModuleList) and len(layers) > 0
    assert all(isinstance(getattr(layer, name), nn.Module)
               for layer in layers for name in (adapter.attention, adapter.mlp))
    for path in (adapter.lm_head, adapter.embedding, adapter.position_embedding):
        if path:
            assert model.get_submodule(path).weight.dim() == 2, path
