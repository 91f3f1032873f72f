"""optimizer options: implementations agree, stepping in backward is the same math with fewer live
gradients, low-state optimizers keep less state, weight decay skips vectors, invalid combinations."""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate

from ablate.build import check_config
from ablate.measure import StepCounter, traced_step
from ablate.models.gpt_module import GPTModule, GPTConfig
from ablate.techniques import Invalid, Plan
from ablate.techniques.adafactor import Adafactor
from ablate.techniques.lowbit import AdamW8bit
from ablate.techniques.optimizer import SGD, AdamW, InBackward
from helpers import ROOT, compose_config, compose_spec, train_nano

CPU = torch.device("cpu")
# MemTracker's own post-accumulate-grad hook reads p.grad after the in-backward hook has freed it.
FREED_GRAD_WARNING = "ignore:Expected a tensor or a traceable wrapper-subclass"


def option(name: str, *overrides: str):
    """The optimizer option exactly as conf/optimizer/<name>.yaml (+ overrides) builds it."""
    return instantiate(compose_config([f"optimizer={name}", *overrides])["optimizer"])


def gpt(n_layer: int = 2, n_embd: int = 64, bias: bool = True) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, vocab_size=128, block_size=32, bias=bias))


def plan(**kw) -> Plan:
    return Plan(**{"device": "cpu", "batch_size": 8, "seq_len": 16, **kw})


def train(opt_option, model: GPTModule, steps: int = 3, batch_size: int = 8):
    """`steps` plain steps on fixed random tokens; returns the built optimizer and its step function."""
    opt_option.check(plan())
    opt = opt_option.build(model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (batch_size, 16), generator=gen)

    def step():
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(steps):
        step()
    return opt, step


def test_forloop_foreach_and_fused_adamw_agree():
    # Without biases: the key bias gets only float-noise gradients (~1e-11; softmax is invariant to
    # it), which Adam normalises into lr-sized steps, so there fused's rounding differs by ~1e-6.
    models = {}
    for name in ("adamw_forloop", "adamw_foreach", "adamw_fused"):
        models[name] = gpt(bias=False)
        opt, _ = train(option(name), models[name])
        assert opt.defaults["foreach"] == {"adamw_forloop": False, "adamw_foreach": True}.get(name)
        assert opt.defaults["fused"] == (True if name == "adamw_fused" else None)
    start = gpt(bias=False)
    for a, b, c, p0 in zip(*(m.parameters() for m in models.values()), start.parameters()):
        assert not torch.equal(a, p0)  # they trained
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        torch.testing.assert_close(c, a, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings(FREED_GRAD_WARNING)
@pytest.mark.parametrize("overrides", [["optimizer=sgd"], ["optimizer=sgd", "optimizer.momentum=0.9"],
                                       ["optimizer=adamw"], ["optimizer=adafactor"], ["optimizer=adamw8bit"]])
def test_in_backward_matches_the_step_after_backward_through_the_real_loop(overrides):
    base, m0, opt0, _ = train_nano(overrides, steps=3)
    losses, m1, opt1, t = train_nano([*overrides, "optimizer.in_backward=true"], steps=3)
    assert t.optimizer.in_backward and isinstance(opt1, InBackward) and not isinstance(opt0, InBackward)
    assert len(opt1.optimizers) == len(list(m1.parameters()))  # one optimizer per parameter
    assert all(p.grad is None for p in m1.parameters())
    counter = StepCounter(opt1)
    opt1.step()  # a no-op that still runs step hooks, so the runner's skipped-step count stays 0
    assert counter.count == 1
    assert losses == pytest.approx(base, abs=1e-6)
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    if overrides != ["optimizer=sgd"]:  # the shared state is the per-parameter optimizers' state
        assert set(opt1.state) == set(m1.parameters()) and opt1.state[next(m1.parameters())]


@functools.cache
def breakdown(name: str, *overrides: str) -> dict:
    """MemTracker's breakdown (MiB) at the peak of one step, states already allocated. 4 layers of
    n_embd=128: every matrix has >= 4096 elements (bitsandbytes' min_8bit_size), and no single
    matrix dominates the step temporaries that the peak's "optimizer" entry includes."""
    model = gpt(n_layer=4, n_embd=128)
    opt, step = train(option(name, *overrides), model, steps=1, batch_size=2)
    return traced_step(step, model, opt, CPU).at_peak


def test_8bit_and_factored_states_are_much_smaller_than_adamws():
    adamw = breakdown("adamw")["optimizer"]
    n_params = sum(p.numel() for p in gpt(n_layer=4, n_embd=128).parameters())
    assert adamw >= 8 * n_params / 2**20  # exp_avg + exp_avg_sq in fp32
    assert 0 < breakdown("adamw8bit")["optimizer"] <= 0.3 * adamw
    assert 0 < breakdown("adafactor")["optimizer"] <= 0.1 * adamw


def test_sgd_keeps_state_only_with_momentum():
    assert breakdown("sgd")["optimizer"] == 0
    n_params = sum(p.numel() for p in gpt(n_layer=4, n_embd=128).parameters())
    assert breakdown("sgd", "optimizer.momentum=0.9")["optimizer"] >= 4 * n_params / 2**20


@pytest.mark.filterwarnings(FREED_GRAD_WARNING)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_in_backward_lowers_the_gradient_peak(name):
    normal, in_backward = breakdown(name), breakdown(name, "optimizer.in_backward=true")
    assert in_backward["grads"] < normal["grads"]
    # The states are still labelled "optimizer" through the InBackward wrapper.
    assert in_backward["optimizer"] == pytest.approx(normal["optimizer"], rel=0.2, abs=1e-9)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor", "adamw8bit"])
@pytest.mark.parametrize("in_backward", ["false", "true"])
def test_weight_decay_only_on_matrices_and_embeddings(name, in_backward):
    model = gpt()
    opt = option(name, "optimizer.weight_decay=0.05", f"optimizer.in_backward={in_backward}").build(model)
    decay = {p: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert set(decay) == set(model.parameters())
    assert {p.dim() >= 2 for p in decay} == {True, False}  # both kinds exist
    assert all(wd == (0.05 if p.dim() >= 2 else 0.0) for p, wd in decay.items())


@pytest.mark.parametrize("opt, kw, match", [
    (SGD(in_backward=True), {"accumulation_steps": 4}, "optimizer.in_backward=true needs accumulation=none"),
    (AdamW(in_backward=True), {"grad_scaler": True}, r"optimizer.in_backward=true .* cannot unscale/skip"),
    (AdamW(in_backward=True), {"world_size": 2}, "optimizer.in_backward=true needs parallel=single"),
    (AdamW(implementation="fused"), {"device": "mps"}, "optimizer.implementation=fused .* not device=mps"),
    (AdamW(implementation="loop"), {}, "optimizer.implementation='loop' is not one of default, forloop, foreach, fused"),
    (SGD(), {"stochastic_rounding": True}, "precision.stochastic_rounding=true needs optimizer=adamw .*optimizer=sgd"),
    (Adafactor(), {"stochastic_rounding": True}, "stochastic_rounding=true needs optimizer=adamw .*=adafactor"),
    (AdamW8bit(), {"stochastic_rounding": True}, "stochastic_rounding=true needs optimizer=adamw .*=adamw8bit"),
    (AdamW(implementation="fused"), {"stochastic_rounding": True}, "optimizer.implementation=fused must be default"),
    (Adafactor(), {"sharded": True, "world_size": 2}, "optimizer=adafactor needs whole parameters: parallel=fsdp"),
    # torch's own value checks, in the job process (they were error rows from inside a worker)
    (AdamW(lr=-1), {}, "optimizer=adamw: Invalid learning rate: -1"),
    (AdamW(betas=(0.9, 1.5)), {}, "optimizer=adamw: Invalid beta parameter at index 1: 1.5"),
    (SGD(momentum=-0.5), {}, "optimizer=sgd: Invalid momentum value: -0.5"),
    (Adafactor(beta2_decay=0.5), {}, "optimizer=adafactor: beta2_decay should be <= 0"),
])
def test_invalid_combinations_name_their_keys(opt, kw, match):
    with pytest.raises(Invalid, match=match):
        opt.check(plan(**kw))


def test_checking_the_values_leaves_torch_dynamo_unimported():
    """A torch optimizer built with a parameter imports torch._dynamo: 1.1 s in every job process
    (it made the suite 3 minutes slower). The values are checked without one."""
    code = ("import sys; from helpers import compose_spec; from ablate.build import check_config; "
            "[check_config(compose_spec([f'optimizer={o}'])) for o in ('adamw', 'sgd', 'adafactor')]; "
            "sys.exit('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr or "check_config imported torch._dynamo"


def test_valid_combinations_pass_check():
    for opt in (SGD(), AdamW(), Adafactor(), AdamW8bit()):
        opt.check(plan(accumulation_steps=4, grad_scaler=True, world_size=2))  # only in_backward minds these
    AdamW(implementation="fused").check(plan(device="cuda"))
    AdamW(in_backward=True).check(plan(device="auto"))


def test_in_backward_rule_reaches_a_composed_config():
    with pytest.raises(Invalid, match="optimizer.in_backward=true needs accumulation=none"):
        check_config(compose_spec(["optimizer.in_backward=true", "accumulation=x4"]), "cpu")


@pytest.mark.parametrize("overrides, invalid", [
    (["parallel=fsdp"], True), (["parallel=fsdp_grad_op"], True), (["parallel=fsdp1"], True),
    (["parallel=fsdp1", "parallel.sharding=no_shard"], False), (["parallel=ddp"], False),
], ids=lambda o: ",".join(o) if isinstance(o, list) else None)
def test_adafactor_rule_reaches_composed_parallel_options(overrides, invalid):
    # A real 2-rank gloo run of adafactor under parallel=fsdp fails in step() (DTensor rejects
    # aten.pow_ on a _NormPartial column norm); under fsdp1 its losses leave DDP's at step 2.
    cfg = compose_spec(["optimizer=adafactor", "parallel.nproc=2", *overrides])
    expect = pytest.raises(Invalid, match="optimizer=adafactor needs whole parameters")
    with expect if invalid else contextlib.nullcontext():
        check_config(cfg, "cpu")


def test_missing_optional_packages_are_invalid_not_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: import fails
    with pytest.raises(Invalid) as err:
        AdamW8bit().check(plan())
    assert str(err.value) == "optimizer=adamw8bit needs bitsandbytes: pip install bitsandbytes"
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(Invalid, match=r"needs torchao: pip install torchao"):
        AdamW().check(plan(stochastic_rounding=True, param_dtype="bf16"))
    AdamW().check(plan())  # without stochastic rounding torchao is not needed


def test_stochastic_rounding_builds_torchaos_adamw():
    pytest.importorskip("torchao")
    opt = AdamW()
    opt.check(plan(stochastic_rounding=True, param_dtype="bf16"))
    assert opt.optimizer_class().__module__.startswith("torchao.optim")
    assert opt.optimizer_kwargs()["bf16_stochastic_round"] is True
    built = opt.build(gpt().to(torch.bfloat16))  # its step compiles (slow on CPU): built, not stepped
    assert isinstance(built, opt.optimizer_class())
    opt.check(plan())  # the same option without stochastic rounding goes back to torch's AdamW
    assert opt.optimizer_class() is torch.optim.AdamW and "bf16_stochastic_round" not in opt.optimizer_kwargs()


def test_class_and_kwargs_are_the_one_source_for_make():
    for opt in (AdamW(implementation="forloop"), SGD(momentum=0.9), Adafactor(), AdamW8bit()):
        built = opt.build(gpt())
        assert type(built) is opt.optimizer_class()
        for key, value in opt.optimizer_kwargs().items():
            if key == "min_8bit_size":  # bitsandbytes keeps it outside `defaults`
                assert built.args.min_8bit_size == value
            elif key != "weight_decay":  # the parameter groups carry their own
                assert built.defaults[key] == value, key
