"""Mixtures of experts predicted against MemTracker on CPU at hidden 256, 512 tokens a micro-batch:
wide enough that the experts' weight gradients and the shared expert's terms show beside the
tokens' (the tiny families' grid, at hidden 64, cannot tell them apart)."""
from __future__ import annotations

import pytest

from ablate.predict.analytic import analytic
from tests.helpers import compose_spec
from tests.test_families import _PHI3, tiny
from tests.test_predict import measured

_BASE = ["device=cpu", "batch_size=4", "seq_len=128"]


def _check(name: str, overrides: list[str], rel: float) -> None:
    full = [*tiny(name, *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", *overrides]
    real = measured(full, _BASE)
    assert analytic(compose_spec([*_BASE, *full])).peak_mib == pytest.approx(real.peak_mib, rel=rel)


@pytest.mark.parametrize("overrides", [
    ["checkpoint=none", "precision=fp32"], ["checkpoint=attention", "precision=bf16"],
    pytest.param(["checkpoint=none", "precision=bf16_pure"], marks=pytest.mark.slow),
    pytest.param(["checkpoint=ops", "precision=fp32"], marks=pytest.mark.slow)])
def test_a_mixtures_saved_tensors_go_with_its_experts_backward(overrides):
    """Mixtral's experts free what they saved as their backward runs: at gate_up's weight gradient
    SwiGLU's tensors and the down output are gone (S·(h + 4i)), and by the time attention makes
    its gradients all of them are (2.9% over, counted to the layer's end)."""
    _check("mixtral-8x7b", overrides, rel=0.002)


@pytest.mark.parametrize("overrides", [
    ["checkpoint=none", "precision=fp32"], ["checkpoint=none", "precision=bf16"],
    pytest.param(["checkpoint=block", "precision=bf16_pure"], marks=pytest.mark.slow)])
def test_qwen2_moes_shared_expert_has_begun_its_backward_when_the_experts_begin_theirs(overrides):
    """Qwen2-MoE adds its gated shared expert's output after the experts': by the experts'
    backward the gate has made its share of the input's gradient and the shared output's own
    gradient replaces the output the gated multiply kept (1.3% under without them)."""
    _check("qwen2_moe", overrides, rel=0.002)
