"""checkpoint options: recompute keeps the math, does recompute (FLOPs), and shrinks activations."""
from __future__ import annotations

import functools

import pytest
import torch
from hydra.utils import instantiate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.flop_counter import FlopCounterMode

from ablate.build import check_config
from ablate.measure import traced_step
from ablate.models.gpt_module import GPTModule, GPTConfig
from ablate.models.gpt import ADAPTER as GPT_ADAPTER
from ablate.techniques import Invalid, Plan
from ablate.techniques.checkpoint import Layers
from helpers import compose_config, compose_spec, train_nano

RECOMPUTE = ["block", "every2", "attention", "mlp", "ops", "layers"]
ALL = ["none", *RECOMPUTE]
MATMUL_RECOMPUTE = ["block", "every2", "attention", "mlp", "layers"]  # `ops` recomputes pointwise only
PREFIX = "_checkpoint_wrapped_module."


def nano(n_layer: int = 3) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(GPTConfig(n_layer=n_layer, n_head=3, n_embd=48, vocab_size=128, block_size=32))


def option(name: str, *overrides: str):
    """The checkpoint option as the real conf/checkpoint/<name>.yaml builds it."""
    return instantiate(compose_config([f"checkpoint={name}", *overrides])["checkpoint"])


def applied(name: str, n_layer: int = 3):
    opt = option(name)
    return opt.apply(nano(n_layer), GPT_ADAPTER), opt


def batch(k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, 128, (8, 32), generator=g), torch.randint(0, 128, (8, 32), generator=g)  # (B, T)


@functools.cache
def trained(name: str, steps: int = 5) -> tuple[list[float], list[tuple[str, torch.Tensor]]]:
    model, _ = applied(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for k in range(steps):
        _, loss = model(*batch(k))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [(n.replace(PREFIX, ""), p.detach()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("name", RECOMPUTE)
def test_recompute_gives_identical_losses_and_parameters(name):
    base_losses, base_params = trained("none")
    losses, params = trained(name)
    assert losses == pytest.approx(base_losses, abs=1e-6, rel=0)
    assert [n for n, _ in params] == [n for n, _ in base_params]
    for (n, p), (_, q) in zip(params, base_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=n)


def test_block_through_the_real_build_and_train_step():
    base = train_nano(steps=3)[0]
    losses, model, _, t = train_nano(["checkpoint=block"], steps=3)
    assert losses == pytest.approx(base, abs=1e-6, rel=0)
    assert all(isinstance(b, CheckpointWrapper) for b in model.transformer.h)
    assert t.checkpoint.recompute_fraction > 0.8


def train_flops(name: str) -> int:
    """Matmul FLOPs of one forward + backward (FlopCounterMode counts matmuls, not pointwise ops)."""
    model, _ = applied(name)
    counter = FlopCounterMode(display=False)
    with counter:
        model(*batch())[1].backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", MATMUL_RECOMPUTE)
def test_recompute_raises_backward_flops(name):
    assert train_flops(name) > train_flops("none")


def activations_mib(name: str) -> float:
    """The 'activations' entry of MemTracker's breakdown at the peak of one training step."""
    model, _ = applied(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(*batch())[1].backward()  # (8, 32) tokens
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return traced_step(step, model, optimizer, torch.device("cpu")).at_peak["activations"]


def test_block_recompute_shrinks_activations():
    none, every2, block = (activations_mib(n) for n in ("none", "every2", "block"))
    assert block < every2 < none
    assert block < 0.5 * none


@pytest.mark.parametrize("name", ["attention", "mlp", "layers"])
def test_sublayer_recompute_shrinks_activations(name):
    assert activations_mib(name) < activations_mib("none")


def test_selective_ops_recomputes_no_matmul_but_saves_activations():
    assert train_flops("ops") == train_flops("none")  # matmul and SDPA outputs are kept
    assert activations_mib("ops") < activations_mib("none")  # LayerNorm / GELU outputs are not


@pytest.mark.parametrize("name", ALL)
def test_apply_keeps_the_parameters_and_the_tie(name):
    model = nano()
    before = [id(p) for p in model.parameters()]
    count = model.num_params()
    model = option(name).apply(model, GPT_ADAPTER)
    assert [id(p) for p in model.parameters()] == before  # same objects, same order
    assert model.num_params() == count
    assert model.lm_head.weight is model.transformer.wte.weight


def test_layers_wraps_outermost_only():
    model, _ = applied("layers")
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    for w in wrappers:  # no wrapper inside another (a Linear in a wrapped attention stays bare)
        assert not any(isinstance(m, CheckpointWrapper) for m in w._checkpoint_wrapped_module.modules())
    assert isinstance(model.transformer.h[0].attn, CheckpointWrapper)
    assert isinstance(model.transformer.h[0].mlp.c_fc, CheckpointWrapper)
    assert isinstance(model.lm_head, CheckpointWrapper)
    # 3 x (ln_1, attn, ln_2, c_fc, gelu, c_proj) + ln_f + lm_head
    assert len(wrappers) == 3 * 6 + 2


def test_every_n_wraps_every_nth_block():
    model, _ = applied("every2", n_layer=4)
    assert [isinstance(b, CheckpointWrapper) for b in model.transformer.h] == [False, True, False, True]


def test_unknown_layer_type_names_the_valid_choices():
    msg = "checkpoint.types: 'conv' is not one of layernorm, gelu, linear, attention"
    with pytest.raises(Invalid, match=msg):
        check_config(compose_spec(["checkpoint=layers", "checkpoint.types=[linear,conv]"]), "cpu")
    with pytest.raises(Invalid, match=msg):
        Layers(types=["conv"]).apply(nano(), GPT_ADAPTER)


@pytest.mark.parametrize("name,overrides,reason", [
    ("every2", ["checkpoint.every_n=0"], "checkpoint.every_n=0 must be >= 1"),
    ("attention", ["checkpoint.part=ffn"], "checkpoint.part: 'ffn' is not one of attn, mlp"),
])
def test_bad_option_values_are_invalid(name, overrides, reason):
    with pytest.raises(Invalid, match=reason):
        check_config(compose_spec([f"checkpoint={name}", *overrides]), "cpu")
    option(name).check(Plan(device="cpu", batch_size=8, seq_len=32))  # the YAML itself is valid


def test_recompute_fraction():
    fraction = {name: applied(name, n_layer=4)[1].recompute_fraction for name in ALL}
    assert fraction["none"] == 0.0 and fraction["ops"] == 0.0
    assert fraction["block"] > 0.8
    assert fraction["every2"] == pytest.approx(fraction["block"] / 2)
    assert 0 < fraction["attention"] < fraction["block"] and 0 < fraction["mlp"] < fraction["block"]
    assert fraction["attention"] + fraction["mlp"] == pytest.approx(fraction["block"])
    assert fraction["layers"] == pytest.approx(1.0)  # every Linear, lm_head included
