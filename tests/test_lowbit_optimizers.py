"""torchao's low-bit AdamW options (adamw4bit, adamw8bit_ao, adamw_fp8): they train on a CPU, their
states are the size torchao allocates and the analytic predictor says, adamw_fp8 wants an fp8 GPU,
and every optimizer option has a memory model."""
from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from ablate.build import build_model, build_optimizer, check_config
from ablate.data import Synthetic
from ablate.measure import StepCounter, traced_step
from ablate.predict.analytic import analytic
from ablate.predict.timeline import Unmodelled
from ablate.techniques import Invalid, Plan
from ablate.techniques.lowbit import AdamW4bit, AdamW8bitAO, AdamWFp8
from ablate.train import train_step
from helpers import CONF, compose_spec, fast_defaults, results_under, run_cli

pytest.importorskip("torchao")

CPU = torch.device("cpu")
# n_embd=128 makes every matrix >= 4096 elements and a multiple of both block sizes (128, 256), so
# torchao quantises all of them; block_size=32 keeps the position embedding as small as the rest.
# Quantised tensors then hold 99% of the parameters (only biases and LayerNorms keep fp32 states).
SIZE = ["model.n_layer=2", "model.n_head=2", "model.n_embd=128", "model.block_size=32", "model.vocab_size=128",
        "batch_size=8", "seq_len=16"]


def spec_of(name: str, *overrides: str):
    args = [*SIZE, f"optimizer={name}", "optimizer.lr=3e-3", *overrides]
    return compose_spec([*fast_defaults(args), *args])


@functools.cache
def trained(name: str, *overrides: str, steps: int = 4):
    """`steps` real train_steps of the composed option on fixed data, the last traced by MemTracker.
    Returns (losses, Trace)."""
    spec = spec_of(name, *overrides)
    t = check_config(spec, "cpu")
    data = Synthetic(vocab_size=128, train_samples=64).load(spec.seq_len)
    torch.manual_seed(0)
    model = build_model(t, CPU)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")
    batch = data.train_batch(0, spec.batch_size)  # the same batch: the loss must fall

    def step():
        losses.append(train_step(model, optimizer, scaler, t, batch, CPU).item())

    losses = []
    for _ in range(steps - 1):
        step()
    return losses, traced_step(step, model, optimizer, CPU)


@pytest.mark.parametrize("name", ["adamw4bit", "adamw_bf16"])
def test_on_a_cpu_torchaos_step_runs_eagerly(name):
    """torchao compiles its per-tensor step for each parameter shape: on a CPU, inductor's C++ build
    (46 s for this model's first step on 2 cores, against half a second eagerly), for the same
    function. A CPU run steps eagerly, compiling nothing."""
    from torch._dynamo.utils import counters

    spec = spec_of(name)
    t = check_config(spec, "cpu")
    model = build_model(t, CPU)
    optimizer = build_optimizer(model, t)
    batch = Synthetic(vocab_size=128, train_samples=64).load(spec.seq_len).train_batch(0, spec.batch_size)
    counters.clear()
    train_step(model, optimizer, t.precision.grad_scaler("cpu"), t, batch, CPU)
    assert all(optimizer.state[p] for p in model.parameters())  # stepped
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("name", ["adamw4bit", "adamw8bit_ao"])
def test_lowbit_adamw_trains_on_cpu_through_the_build_path(name):
    losses, _ = trained(name)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5 and losses == sorted(losses, reverse=True), losses


@pytest.mark.parametrize("name, ratio", [("adamw4bit", (0.10, 0.16)), ("adamw8bit_ao", (0.22, 0.30))])
def test_lowbit_states_are_what_the_predictor_says_and_a_fraction_of_adamws(name, ratio):
    # Measured (torch 2.13, torchao 0.18, MiB): adamw 3.184; adamw4bit 0.448 (0.141 of it: half a
    # byte per value, a 4-byte scale per 128, the fp32 biases and LayerNorms); adamw8bit_ao 0.848
    # (0.266). Both equal to the byte to the analytic prediction. `after` is the states alone;
    # category_max adds the eager step's fp32 temporaries of the largest tensor (24 bytes/elem).
    measured, adamw = trained(name)[1], trained("adamw")[1]
    predicted = analytic(spec_of(name))
    assert measured.after["optimizer"] == pytest.approx(predicted.steady_mib["optimizer"], rel=0.1)
    assert measured.category_max["optimizer"] == pytest.approx(predicted.category_max_mib["optimizer"], rel=0.1)
    low, high = ratio
    assert low <= measured.after["optimizer"] / adamw.after["optimizer"] <= high


def test_adamw_fp8_on_a_cpu_is_an_invalid_row_naming_the_capability_it_needs():
    with pytest.raises(Invalid, match=r"optimizer=adamw_fp8 needs a CUDA GPU of compute capability >= 8\.9"):
        check_config(compose_spec([*fast_defaults(["optimizer=adamw_fp8"]), "optimizer=adamw_fp8"]))


def test_adamw_fp8_names_the_capability_found_on_an_older_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    plan = Plan(device="cuda", batch_size=8, seq_len=16)
    with pytest.raises(Invalid, match=r"compute capability >= 8\.9 .*NVIDIA A100 is 8\.0"):
        AdamWFp8().check(plan)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    AdamWFp8().check(plan)
    AdamWFp8().check(Plan(device="auto", batch_size=8, seq_len=16))  # the job leaves it to the worker


def test_missing_torchao_is_an_invalid_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    for option in (AdamW4bit(), AdamW8bitAO(), AdamWFp8()):
        with pytest.raises(Invalid) as err:
            option.check(Plan(device="auto", batch_size=8, seq_len=16))
        assert str(err.value) == f"optimizer={option.name} needs torchao: pip install torchao"


def test_odd_4bit_block_size_is_invalid():
    with pytest.raises(Invalid, match="optimizer.block_size=63 must be even"):
        AdamW4bit(block_size=63).check(Plan(device="cpu", batch_size=8, seq_len=16))


def test_build_in_backward_and_stochastic_rounding_reach_torchao():
    for option in (AdamW4bit(in_backward=True), AdamW8bitAO(), AdamWFp8()):
        option.check(Plan(device="auto", batch_size=8, seq_len=16, stochastic_rounding=True, param_dtype="bf16"))
        assert option.optimizer_class().__mro__[1].__module__ == "torchao.optim.adam"
        assert option.optimizer_kwargs()["bf16_stochastic_round"] is True
    # bf16 ones stepped by 1e-3, a quarter of bf16's spacing just below 1.0 (2**-8): rounding to
    # nearest leaves them at 1.0; stochastic rounding moves a quarter of them down a step, on the CPU.
    for stochastic, moved in ((False, 0.0), (True, 1e-3)):
        p = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
        p.grad = torch.ones_like(p)
        option = AdamW8bitAO(lr=1e-3, weight_decay=0.0)
        option.check(Plan(device="cpu", batch_size=8, seq_len=16, stochastic_rounding=stochastic, param_dtype="bf16"))
        with torch.compiler.set_stance("force_eager"):
            option.make([{"params": [p]}]).step()
        assert p.dtype == torch.bfloat16
        assert (1 - p.float()).mean().item() == pytest.approx(moved, rel=0.15, abs=1e-9)


def test_the_step_counter_counts_a_torchao_step_once():
    """torch wraps a class's step in its hook runner when the first instance is built: the
    runner's step counter (a step hook) sees each torchao step once."""
    import torchao.optim

    p = torch.nn.Parameter(torch.randn(64, 64))
    torchao.optim.AdamW8bit([p])  # wraps torchao's AdamW8bit.step
    opt = AdamW8bitAO().make([{"params": [p]}])
    counter = StepCounter(opt)
    p.grad = torch.ones_like(p)
    with torch.compiler.set_stance("force_eager"):
        opt.step()
    assert counter.count == 1 and len(opt.state[p]) == 3  # step, exp_avg, exp_avg_sq


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
def test_in_backward_steps_each_parameter_with_its_own_torchao_optimizer():
    losses, _ = trained("adamw8bit_ao", "optimizer.in_backward=true")
    assert losses == pytest.approx(trained("adamw8bit_ao")[0], abs=1e-5)


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml")))
def test_every_optimizer_option_has_a_memory_model(name):
    """A new optimizer option must say how big its states are: the analytic predictor raises
    Unmodelled for one it does not know, and this fails."""
    spec = compose_spec([*fast_defaults([f"optimizer={name}"]), f"optimizer={name}"])
    try:
        prediction = analytic(spec)
    except Unmodelled as exc:
        pytest.fail(f"optimizer={name}: {exc}")
    assert prediction.peak_mib > 0


@pytest.mark.slow
def test_cli_rows_match_the_prediction(tmp_path):
    """The real CLI and worker: ok rows whose traced optimizer bytes are the prediction's."""
    proc = run_cli(["-m", "optimizer=adamw4bit,adamw8bit_ao", *SIZE], tmp_path, timeout=900)
    rows = results_under(tmp_path)
    assert proc.returncode == 0 and len(rows) == 2, proc.stderr[-3000:]
    for row in rows:
        assert row["status"] == "ok", row["reason"]
        measured, predicted = row["metrics"]["breakdown_mib"], row["prediction"]["breakdown_mib"]
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.1), row["choices"]
