"""The attention group (ablate/techniques/attention.py): every kernel computes the same losses, the
CUDA-only ones are rows naming what they need, and the analytic model knows what each keeps (the
math backend's and eager's (T, T) probabilities) within 2% of MemTracker on real CPU steps."""
from __future__ import annotations

import itertools

import pytest

from ablate.build import check_config
from ablate.predict.analytic import analytic
from ablate.techniques import Invalid, Plan, Unmodelled
from ablate.techniques.attention import Backend, Flex
from tests.helpers import compose_spec, run_cli, results_under, train_nano
from tests.test_predict import measured

# Grouped-query Llama (4 query heads, 2 key/value heads) and GPT-2, at 256 tokens a row, where a
# layer's (T, T) probabilities outweigh its (T, h) tensors.
LLAMA = ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "model.config.hidden_size=64",
         "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
         "model.config.num_key_value_heads=2", "model.config.head_dim=16", "model.config.vocab_size=128"]
GPT = ["model=gpt-nano", "model.vocab_size=128"]
TINY = {"llama": LLAMA, "gpt2": GPT}
BASE = ["data.vocab_size=128", "device=cpu", "batch_size=2", "seq_len=256"]
DEFAULT = {("llama", "math", "fp32", "none"), ("llama", "eager", "bf16_pure", "block"),
           ("gpt2", "eager", "fp32", "block"), ("gpt2", "math", "bf16_pure", "none")}
GRID = [pytest.param(*p, marks=() if p in DEFAULT else pytest.mark.slow)
        for p in itertools.product(TINY, ["math", "eager"], ["fp32", "bf16_pure", "bf16"], ["none", "block"])]


@pytest.mark.parametrize("family,attention,precision,checkpoint", GRID)
def test_the_prediction_is_within_2_percent_of_memtracker(family, attention, precision, checkpoint):
    base, overrides = [*TINY[family], *BASE], [f"attention={attention}", f"precision={precision}",
                                               f"checkpoint={checkpoint}"]
    real = measured(overrides, base=base)
    pred = analytic(compose_spec([*base, *overrides]))
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.02)
    fused = analytic(compose_spec([*base, *overrides[1:]]))  # sdpa: CPU's flash kernel, O(T) kept
    assert pred.peak_mib > 1.2 * fused.peak_mib  # the (T, T) matrices are most of it


@pytest.mark.parametrize("family", TINY)
def test_every_kernel_gives_the_same_losses(family):
    runs = {a: train_nano([*TINY[family], f"attention={a}"], steps=3, seq_len=32)[0] for a in ("sdpa", "math", "eager")}
    for losses in runs.values():
        assert losses == pytest.approx(runs["sdpa"], rel=1e-5)
    assert runs["sdpa"][-1] < runs["sdpa"][0]


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
def test_cuda_kernels_are_invalid_on_a_cpu_naming_the_device(backend):
    with pytest.raises(Invalid, match=f"attention={backend} is a CUDA kernel: it needs a CUDA GPU, and device=cpu"):
        check_config(compose_spec([*GPT, *BASE, f"attention={backend}"]))
    with pytest.raises(Invalid, match="attention=flex .* needs a CUDA GPU"):
        check_config(compose_spec([*LLAMA, *BASE, "attention=flex"]))


def _checked(option, family: list[str], **plan) -> None:
    """`option` checked as a GPU worker would check it, with the family of `family`'s config."""
    from ablate.build import Techniques

    option.family = Techniques.of(compose_spec([*family, *BASE])).model
    option.check(Plan(device="cuda", batch_size=2, seq_len=256, **plan))


def test_what_the_fused_kernels_refuse_on_a_gpu():
    with pytest.raises(Invalid, match="attention=flash takes fp16 and bf16 inputs only"):
        _checked(Backend("flash"), GPT)
    with pytest.raises(Invalid, match="attention=cudnn takes fp16 and bf16 inputs only"):
        _checked(Backend("cudnn"), GPT, autocast=False)
    _checked(Backend("flash"), GPT, param_dtype="bf16")
    _checked(Backend("cudnn"), LLAMA, autocast=True)
    with pytest.raises(Invalid, match="memory-efficient kernel takes no grouped-query heads .2 key/value heads for 4"):
        _checked(Backend("efficient"), LLAMA)
    _checked(Backend("efficient"), GPT)  # fp32, one key/value head per query head
    with pytest.raises(Invalid, match="model=gpt-nano has no FlexAttention path"):
        _checked(Flex(), GPT)
    _checked(Flex(), LLAMA)
    with pytest.raises(Invalid, match="attention.backend: 'xformers' is not one of flash, efficient, cudnn, math"):
        _checked(Backend("xformers"), GPT)


def test_selective_op_recompute_over_the_math_backend_goes_to_the_trace():
    spec = compose_spec([*LLAMA, *BASE, "attention=math", "checkpoint=ops"])
    with pytest.raises(Unmodelled, match="selective op recompute over math attention"):
        analytic(spec)


@pytest.mark.slow
def test_the_cli_sweep_of_kernels(tmp_path):
    """The issue's command: sdpa, math and eager rows, ok, with equal losses and predictions within
    2%; flash a row naming the device it needs."""
    run_cli(["-m", "attention=sdpa,math,eager,flash", *LLAMA, *BASE, "steps=3"], tmp_path)
    rows = {r["choices"]["attention"]: r for r in results_under(tmp_path)}
    assert rows["flash"]["status"] == "invalid" and "CUDA GPU" in rows["flash"]["reason"]
    for name in ("sdpa", "math", "eager"):
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["prediction"]["peak_mib"] == pytest.approx(row["metrics"]["peak_allocated_mib"], rel=0.02)
        assert row["metrics"]["losses"] == pytest.approx(rows["sdpa"]["metrics"]["losses"], rel=1e-5)
