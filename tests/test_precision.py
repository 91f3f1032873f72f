"""precision and accumulation options: faithful math, the dtypes they promise, invalid combinations."""
from __future__ import annotations

import pytest
import torch

from ablate.spec import RunSpec

from ablate.build import check_config
from ablate.measure import StepCounter
from ablate.techniques import Invalid, Plan
from ablate.techniques.precision import BF16, FP8, FP16, FP32, TF32, BF16Pure
from ablate.train import train_step
from ablate.data import Synthetic
from helpers import compose_config, compose_spec, train_nano


def test_accumulation_x4_matches_one_batch():
    """Four micro-batches make one batch's gradient up to float round-off. SGD's step is linear in
    the gradient, so its weights stay that close; AdamW divides by the gradient's running RMS,
    which scales the round-off of a near-zero gradient up to a sizeable part of the learning
    rate (2e-5 of 6e-4, depending on the summation order of the machine's kernels), so under it
    only the losses are compared."""
    for optimizer in ("adamw", "sgd"):
        base, m0, _, _ = train_nano([f"optimizer={optimizer}"], steps=4)
        acc, m4, _, t = train_nano([f"optimizer={optimizer}", "accumulation=x4"], steps=4)
        assert t.accumulation.steps == 4
        assert base == pytest.approx(acc, abs=1e-5)
    for a, b in zip(m0.parameters(), m4.parameters()):  # SGD's
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_accumulation_steps_key_and_divisibility():
    assert check_config(compose_spec(["accumulation.steps=3", "batch_size=6"])).accumulation.steps == 3
    with pytest.raises(Invalid, match="batch_size=8 is not divisible by accumulation.steps=3"):
        check_config(compose_spec(["accumulation.steps=3", "batch_size=8"]))


@pytest.mark.parametrize("option", ["tf32", "bf16", "fp16"])
def test_reduced_precision_trains_close_to_fp32(option):
    base = train_nano(steps=3)[0]
    other, model, _, _ = train_nano([f"precision={option}"], steps=3)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert other == pytest.approx(base, abs=0.05 if option != "tf32" else 1e-6)


def test_autocast_runs_matmuls_in_the_low_dtype():
    x = torch.randn(4, 8)
    lin = torch.nn.Linear(8, 8)
    for option, dtype in ((BF16(), torch.bfloat16), (FP16(), torch.float16), (FP32(), torch.float32)):
        with option.autocast("cpu"):
            assert lin(x).dtype == dtype


def test_tf32_flag_is_set_and_fp32_resets_it():
    TF32().setup()
    assert torch.backends.cuda.matmul.allow_tf32
    FP32().setup()
    assert not torch.backends.cuda.matmul.allow_tf32


def test_bf16_pure_halves_parameter_bytes_and_keeps_grads_and_states_in_bf16():
    _, fp32, _, _ = train_nano(steps=1)
    _, pure, opt, _ = train_nano(["precision=bf16_pure"], steps=1)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert nbytes(pure) * 2 == nbytes(fp32)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == torch.bfloat16 for v in states)


@pytest.mark.parametrize("option", ["fp32", "bf16_pure"])
def test_init_on_device_allocates_in_the_target_dtype_and_keeps_the_tie(option):
    losses, model, _, _ = train_nano([f"precision={option}", "precision.init_on_device=true"], steps=2)
    assert model.lm_head.weight is model.transformer.wte.weight
    dtype = torch.bfloat16 if option == "bf16_pure" else torch.float32
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in model.parameters())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(128.0)).item(), abs=0.3)  # GPT-2 init


def test_fp16_scaler_skips_overflowing_steps_and_they_are_counted():
    cfg = compose_config(["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128", "precision=fp16"])
    t = check_config(RunSpec.of(cfg), "cpu")
    from ablate.build import build_model, build_optimizer

    model = build_model(t, torch.device("cpu"))
    opt = build_optimizer(model, t)
    counter = StepCounter(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # fp16 gradients overflow at this scale
    assert t.precision.grad_scaler("cpu").is_enabled()
    data = Synthetic(vocab_size=128, train_samples=16).load(8)
    for k in range(30):
        train_step(model, opt, scaler, t, data.train_batch(k, 4), torch.device("cpu"))
    assert 0 < counter.count < 30  # the first steps were skipped (scale halved each time), then it trained
    assert scaler.get_scale() < 2.0**30


def test_bf16_on_a_gpu_without_bf16_is_invalid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    plan = Plan(device="cuda", batch_size=8, seq_len=16)
    for option in (BF16(), BF16Pure()):
        with pytest.raises(Invalid, match="no bf16 support"):
            option.check(plan)
    FP16().check(plan)  # fp16 needs no bf16
    BF16().check(Plan(device="auto", batch_size=8, seq_len=16))  # the job cannot know yet


def test_fp8_on_a_cpu_is_an_invalid_row_naming_the_gpu_it_needs():
    with pytest.raises(Invalid, match=r"precision=fp8 needs a CUDA GPU of compute capability >= 8\.9 .*device=cpu"):
        check_config(compose_spec(["precision=fp8", "device=cpu"]))


def test_fp8_names_the_capability_of_an_older_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(Invalid, match=r"compute capability >= 8\.9 .*NVIDIA A100 is 8\.0"):
        FP8().check(Plan(device="cuda", batch_size=8, seq_len=16))


def test_fp8_converts_the_decoder_layers_linears_and_leaves_the_head_and_odd_sizes():
    """torchao's float8 layers replace each Linear inside the repeated layers whose sizes _scaled_mm
    takes (multiples of 16); the LM head stays a Linear (it computes in bf16)."""
    from torchao.float8.float8_linear import Float8Linear

    t = check_config(compose_spec(["model=gpt-nano", "model.n_embd=48", "model.n_head=3"]), "auto")
    model = FP8().convert(t.model.build(), t.model.adapter)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(kinds[n] is Float8Linear for n in kinds if n.startswith("transformer.h."))
    assert kinds["lm_head"] is torch.nn.Linear and sum(k is Float8Linear for k in kinds.values()) == 4 * 3
    odd = check_config(compose_spec(["model=gpt-nano", "model.n_embd=40", "model.n_head=4"]), "auto")
    assert not any(isinstance(m, Float8Linear) for m in FP8().convert(odd.model.build(), odd.model.adapter).modules())
