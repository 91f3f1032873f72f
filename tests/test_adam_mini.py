"""optimizer=adam_mini (the adam-mini package's Adam_mini): the package's partition as ablate's GPT-2
and transformers' Llama names meet it (the states' shapes), Adam on blocks of one element, the loss
falling, the analytic prediction against MemTracker (exact on the state, within 2% at the peak),
the name sets the predictor mirrors, and the refusals."""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from ablate.build import build_model, build_optimizer, check_config
from ablate.predict.analytic import analytic
from ablate.techniques import Invalid, Plan
from ablate.techniques import adam_mini
from ablate.techniques.adam_mini import AdamMini
from ablate.train import train_step
from helpers import OPTIMIZER_CONFIGS as CONFIGS
from helpers import compose_spec, traced_training

pytest.importorskip("adam_mini")

CPU = torch.device("cpu")
MIB = 2**20


@functools.cache
def trained(config: str, *overrides: str, steps: int = 3):
    """`steps` real train_steps on one fixed batch, the last traced by MemTracker. Returns
    (losses, Trace, model, optimizer, spec)."""
    return traced_training([*CONFIGS[config], "optimizer=adam_mini", "optimizer.lr=3e-3", *overrides], steps)


def test_adam_mini_trains():
    losses = trained("nano")[0]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.3, losses


IN_BACKWARD = "optimizer.in_backward=true"


@pytest.mark.parametrize("config, precision, extra", [
    ("nano", "fp32", ""), ("llama", "bf16_pure", ""), ("wide", "fp32", ""), ("wide", "fp32", IN_BACKWARD),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("nano", "bf16_pure", ""), ("llama", "fp32", ""), ("wide", "bf16_pure", ""), ("wide", "bf16_pure", IN_BACKWARD),
        ("llama", "fp32", IN_BACKWARD)])])
@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
def test_analytic_matches_memtracker(config, precision, extra):
    """The states to the byte (a full m, v per block, in the parameters' dtype); the peak within 2%
    (where the activations make it, and where the step's two update-sized temporaries do: wide,
    after backward or, in backward, one tensor at a time)."""
    _, real, _, _, spec = trained(config, f"precision={precision}", *([extra] if extra else []))
    pred = analytic(spec)
    assert pred.steady_mib["optimizer"] * MIB == real.after["optimizer"] * MIB
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.02)


def test_gpt2_states_follow_the_package_partition():
    """ablate's GPT-2: q, k and v fused in attn.c_attn take one v per head each (registered as the
    package's query/key names), attn.c_proj and the MLP one per row, wte one per token, wpe and the
    LayerNorm weights one each, biases Adam's per element; m is always whole."""
    _, _, model, optimizer, spec = trained("nano")
    C, heads, V = 48, 3, 128
    state = {n: optimizer.state[p] for n, p in model.named_parameters()}
    v = {n: tuple(s["vmean"].shape) if "vmean" in s else ("full", *s["v"].shape) for n, s in state.items()}
    assert v["transformer.h.0.attn.c_attn.weight"] == (3 * heads, 1)
    assert tuple(state["transformer.h.0.attn.c_attn.weight"]["m"].shape) == (3 * heads, C * C // heads)
    assert v["transformer.h.0.attn.c_proj.weight"] == (C, 1)
    assert v["transformer.h.0.mlp.c_fc.weight"] == (4 * C, 1) and v["transformer.h.0.mlp.c_proj.weight"] == (C, 1)
    assert v["transformer.wte.weight"] == (V, 1)
    assert v["transformer.wpe.weight"] == v["transformer.h.0.ln_1.weight"] == v["transformer.ln_f.weight"] == ()
    assert v["transformer.h.0.attn.c_attn.bias"] == ("full", 3 * C)


def test_llama_states_follow_the_package_partition():
    """transformers' Llama names need nothing added: q_proj and k_proj one v per head (heads of
    head_dim × hidden elements, set on the package where heads × head_dim ≠ hidden, as here:
    4 × 32 on 64, which the package's hidden²/heads would cut into half-heads), v_proj, o_proj,
    the MLP and the embedding one per row, the norms one each."""
    spec = compose_spec([*CONFIGS["llama"], "model.config.head_dim=32", "optimizer=adam_mini"])
    t = check_config(spec, "cpu")
    model = build_model(t, CPU)
    optimizer = build_optimizer(model, t)
    train_step(model, optimizer, t.precision.grad_scaler("cpu"), t, (torch.randint(0, 128, (2, 8)),) * 2, CPU)
    # HFModule holds transformers' model as `lm`
    v = {n.removeprefix("lm."): tuple(optimizer.state[p]["vmean"].shape) for n, p in model.named_parameters()}
    layer = "model.layers.0."
    assert v[layer + "self_attn.q_proj.weight"] == (4, 1) and v[layer + "self_attn.k_proj.weight"] == (2, 1)
    assert v[layer + "self_attn.v_proj.weight"] == (2 * 32, 1) and v[layer + "self_attn.o_proj.weight"] == (64, 1)
    assert v[layer + "mlp.gate_proj.weight"] == (128, 1) and v[layer + "mlp.down_proj.weight"] == (64, 1)
    assert v["model.embed_tokens.weight"] == (128, 1)
    assert v[layer + "input_layernorm.weight"] == v["model.norm.weight"] == ()
    assert analytic(spec).steady_mib["optimizer"] * MIB == sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
        if isinstance(t, torch.Tensor))


def test_blocks_of_one_element_are_adam():
    """A block of one element has the mean of one squared gradient for its second moment: Adam's.
    Rows of one column (an MLP's), a one-element norm and a bias (Adam's own branch), stepped
    through the option's make, against torch.optim.Adam."""
    option = AdamMini(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    option.family = nano_family()
    torch.manual_seed(0)
    named = {"h.0.mlp.c_fc.weight": torch.randn(5, 1), "h.0.ln_1.weight": torch.randn(1),
             "h.0.mlp.c_fc.bias": torch.randn(5)}
    ours = {n: torch.nn.Parameter(x.clone()) for n, x in named.items()}
    theirs = [torch.nn.Parameter(x.clone()) for x in named.values()]
    opt = option.make([{"params": list(ours.values()), "names": {id(p): n for n, p in ours.items()}}])
    adam = torch.optim.Adam(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    for k in range(3):
        grads = [torch.randn_like(p) for p in theirs]
        for p, q, g in zip(ours.values(), theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
    for p, q, before in zip(ours.values(), theirs, named.values()):
        assert not torch.equal(p, before)  # it moved
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert {n: option.block(n) for n in ours} == {"h.0.mlp.c_fc.weight": "row", "h.0.ln_1.weight": "one",
                                                  "h.0.mlp.c_fc.bias": "full"}


def test_the_predictor_mirrors_the_package_name_sets():
    """The predictor's partition (adam_mini.FULL, PER_HEAD, PER_ROW) is the package's own: a new
    release that renames or adds a block fails here, not silently in a prediction."""
    from adam_mini import Adam_mini

    opt = Adam_mini([("w", torch.nn.Parameter(torch.zeros(2)))], verbose=False)
    assert adam_mini.FULL == opt.adam_block_names
    assert adam_mini.PER_HEAD == opt.wqk_names
    assert adam_mini.PER_ROW == opt.embd_names | opt.output_names | opt.wv_names | opt.attn_proj_names | opt.mlp_names


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
def test_in_backward_steps_each_parameter_with_its_own_adam_mini():
    losses = trained("nano", IN_BACKWARD)[0]
    assert losses == pytest.approx(trained("nano")[0], rel=1e-5)


PLAN = Plan(device="cpu", batch_size=8, seq_len=32)


@functools.cache
def nano_family():
    return check_config(compose_spec([*CONFIGS["nano"], "optimizer=adam_mini"])).model


def option(**kwargs) -> AdamMini:
    opt = AdamMini(**kwargs)
    opt.family = nano_family()
    return opt


@pytest.mark.parametrize("plan, reason", [
    ({"sharded": True}, r"optimizer=adam_mini needs whole parameters"),
    ({"states_on_host": True, "device": "cuda"}, r"offload=optimizer.*use offload=none"),
    ({"stochastic_rounding": True}, r"stochastic_rounding=true needs optimizer=adamw"),
    ({"frozen_base": True}, r"with peft=lora, dora or qlora: .*use optimizer=adamw"),
])
def test_refusals(plan, reason):
    with pytest.raises(Invalid, match=reason):
        option().check(Plan(**{"device": "cpu", "batch_size": 8, "seq_len": 32, **plan}))
    option().check(PLAN)
    option().check(Plan(device="cuda", batch_size=8, seq_len=32, world_size=2))  # DDP: whole parameters


@pytest.mark.parametrize("kwargs, reason", [
    ({"lr": -1.0}, r"optimizer.lr=-1.0 must be >= 0"), ({"betas": (0.9, 1.0)}, r"optimizer.betas=\[0.9, 1.0\]"),
    ({"weight_decay": -0.1}, r"optimizer.weight_decay=-0.1"), ({"eps": 0.0}, r"optimizer.eps=0.0 must be > 0")])
def test_bad_values_are_invalid_in_the_job(kwargs, reason):
    with pytest.raises(Invalid, match=reason):
        option(**kwargs).check(PLAN)


def test_in_backward_keeps_its_own_rules():
    with pytest.raises(Invalid, match="optimizer.in_backward=true needs accumulation=none"):
        option(in_backward=True).check(Plan(device="cpu", batch_size=8, seq_len=32, accumulation_steps=2))


def test_a_missing_or_broken_package_is_an_invalid_row_naming_the_release(monkeypatch):
    opt = option()
    monkeypatch.setitem(sys.modules, "adam_mini", None)  # as if not installed: find_spec says so, import fails
    missing = r"^optimizer=adam_mini needs adam-mini==1\.1\.1: pip install adam-mini==1\.1\.1$"
    with pytest.raises(Invalid, match=missing):
        opt.check(PLAN)
    with pytest.raises(Invalid, match=r"optimizer=adam_mini needs adam-mini==1\.1\.1 \(importing adam_mini failed"):
        opt.optimizer_class()  # the worker's import, as when a future torch breaks the package


def test_a_family_without_attention_sizes_is_invalid():
    opt = option()
    opt.family = type("Opaque", (), {"name": "opaque", "arch": lambda self: (_ for _ in ()).throw(
        adam_mini.Unmodelled("no sizes")), "hf_config": None})()
    with pytest.raises(Invalid, match="needs the model's hidden size and attention heads, which model=opaque"):
        opt.check(PLAN)
