"""Recompute wrappers predicted against MemTracker on CPU, in 16-bit, where what the wrappers keep
differs from what the modules they wrap would have kept: layer-type recompute (checkpoint=layers,
a wrapper around every module of the chosen types), the MLP recomputed alone, a whole block
recomputed under autocast."""
from __future__ import annotations

import pytest

from ablate.predict.analytic import analytic
from tests.helpers import compose_spec
from tests.test_families import _PHI3, tiny
from tests.test_predict import NANO, measured

_LLAMA = [*tiny("llama3.2-1b", *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", "checkpoint=layers"]
_LLAMA_BASE = ["device=cpu", "batch_size=4", "seq_len=128"]


@pytest.mark.parametrize("overrides", [
    ["precision=bf16_pure"], ["precision=bf16"],
    pytest.param(["precision=bf16", "accumulation=x4"], marks=pytest.mark.slow),
    pytest.param(["precision=bf16", "checkpoint.types=[linear]"], marks=pytest.mark.slow),
    pytest.param(["precision=bf16_pure", "checkpoint.types=[layernorm]"], marks=pytest.mark.slow)])
def test_layer_type_recompute_of_a_llama_is_predicted_within_half_a_percent(overrides):
    """The recomputed final norm makes its keep again for its backward, and its fp32 copy of a
    16-bit stream (bf16_pure: 3.9% under when not counted). A wrapped Linear keeps its fp32 weight,
    not autocast's cast of it, so the casts go when forward ends; the wrapped head keeps the final
    norm's fp32 output itself, and casts it and its weight again in backward (bf16: 2.9% over,
    counted as the casts kept to backward)."""
    real = measured([*_LLAMA, *overrides], _LLAMA_BASE)
    assert analytic(compose_spec([*_LLAMA_BASE, *_LLAMA, *overrides])).peak_mib == pytest.approx(real.peak_mib, rel=0.005)


@pytest.mark.parametrize("checkpoint", ["layers", pytest.param("none", marks=pytest.mark.slow)])
def test_the_chunked_loss_keeps_the_hidden_states_as_the_model_hands_them_over(checkpoint):
    """Under autocast the chunked loss's Function saves the final norm's fp32 output and casts each
    slice itself, in forward and again in backward; with the casts of layer-type recompute gone
    when forward ends, the peak is the loss's forward, 0.9% under when counted as the cast."""
    overrides = ["precision=bf16", "loss=chunked", f"checkpoint={checkpoint}"]
    real = measured(overrides)
    assert analytic(compose_spec([*NANO, *overrides])).peak_mib == pytest.approx(real.peak_mib, rel=0.003)


@pytest.mark.parametrize("name,overrides", [
    ("llama3.2-1b", []), ("pythia-160m", []),
    pytest.param("llama3.2-1b", ["accumulation=x4"], marks=pytest.mark.slow),
    pytest.param("qwen2.5-0.5b", [], marks=pytest.mark.slow)])
def test_the_mlp_recomputed_alone_under_autocast_casts_its_weights_again(name, overrides):
    """The MLP recomputed on its own under autocast keeps none of its weights' casts from forward
    (the wrapper saves no matmul input), casts them and its input again in backward beside the
    norm output its wrapper holds, and lets the output projection's cast go with that projection's
    backward. Counted as casts kept from forward, tiny Llama at hidden 256 was 3.3% over (4.0% at
    four micro-batches), Qwen2 1.8% at hidden 64; with its input's casts left out, Pythia 2.1% under."""
    width = _PHI3 if name == "llama3.2-1b" else []
    full = [*tiny(name, *width), "data.vocab_size=128", "optimizer=adamw_foreach", "checkpoint=mlp",
            "precision=bf16", *overrides]
    base = _LLAMA_BASE if name == "llama3.2-1b" else ["device=cpu", "batch_size=8", "seq_len=32"]
    real = measured(full, base)
    assert analytic(compose_spec([*base, *full])).peak_mib == pytest.approx(real.peak_mib, rel=0.005)


@pytest.mark.parametrize("name", ["llama3.2-1b", pytest.param("phi3", marks=pytest.mark.slow)])
def test_a_block_recomputed_under_autocast_lets_the_output_projections_cast_go_with_its_backward(name):
    """A block recomputed beside its MLP's backward casts its weights again; the MLP's output
    projection's cast and its input go as that projection's backward ends, before the gate's and
    up's gradients are made together. Counted to the layer's end, tiny Llama at hidden 256 was 1.3% over."""
    full = [*tiny(name, *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", "checkpoint=block",
            "precision=bf16"]
    real = measured(full, _LLAMA_BASE)
    assert analytic(compose_spec([*_LLAMA_BASE, *full])).peak_mib == pytest.approx(real.peak_mib, rel=0.003)
