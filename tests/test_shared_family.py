"""A job builds each model family once: every point's check, prediction, step time and count, and
every probe of a batch or length search, read the same family's meta model and layouts (ablate/
build.py family_of), while each gets options of its own."""
from __future__ import annotations

import pytest

from ablate import build
from ablate.build import Techniques, change_params
from ablate.models import param_change
from ablate.models.hf import HFCausalLM
from ablate.outcome import predicted
from ablate.predict import step_time
from tests.helpers import compose_spec

LLAMA = ["model=llama3.2-1b", "model.config.num_hidden_layers=30", "model.config.hidden_size=64",
         "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
         "model.config.num_key_value_heads=2", "model.config.vocab_size=128", "data.vocab_size=128",
         "device=cuda", "predict_only=true", "batch_size=1", "seq_len=64"]


@pytest.fixture
def fresh(monkeypatch):
    """No family or applied recompute left over from another test in this process."""
    monkeypatch.setattr(build, "_FAMILIES", type(build._FAMILIES)())
    monkeypatch.setattr(step_time, "_APPLIED", {})


def test_points_of_one_model_share_its_family_and_get_options_of_their_own(fresh):
    first, again = (Techniques.of(compose_spec(LLAMA)) for _ in range(2))
    assert again.model is first.model and again.optimizer is not first.optimizer
    eager = Techniques.of(compose_spec([*LLAMA, "attention=eager"]))  # another attention builds other layers
    wider = Techniques.of(compose_spec([*LLAMA, "model.config.intermediate_size=256"]))
    assert eager.model is not first.model and eager.model.attn_implementation == "eager"
    assert wider.model is not first.model and first.model.attn_implementation == "sdpa"


def test_a_length_search_builds_the_model_once(fresh, monkeypatch):
    """A probe at each length, as find_seq makes them (QLoRA over a 30-layer model: the adapters'
    layouts, and the 12- and 24-layer samples step time reads recompute off) builds no model after
    the first probe."""
    built = []
    build_with = HFCausalLM.with_layers
    monkeypatch.setattr(HFCausalLM, "with_layers", lambda self, n: built.append(n) or build_with(self, n))
    spec = compose_spec([*LLAMA, "peft=qlora", "checkpoint=block", "tiling=mlp"])
    first = predicted(spec)
    assert built and first.step_time_s
    samples = len(built)
    longer = [predicted(spec.replace(seq_len=n)) for n in (128, 4096, 65536)]
    assert len(built) == samples
    peaks = [first.peak_mib, *(p.peak_mib for p in longer)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4


def test_an_adapters_layout_read_once_is_the_one_read_anew(fresh):
    t = Techniques.of(compose_spec([*LLAMA, "peft=lora", "peft.r=4"]))
    change = param_change(t)
    assert change.key is not None and change.key == change_params(Techniques.of(compose_spec(
        [*LLAMA, "peft=lora", "peft.r=4"]))).key
    kept = t.model.layout_with(change)
    assert t.model.layout_with(change) is kept
    change.key = None  # a change with no name is read anew
    anew = t.model.layout_with(change)
    assert anew is not kept and anew.shapes == kept.shapes and anew.frozen == kept.frozen
    assert any("lora_A" in name for name in kept.shapes) and kept.frozen
    other = param_change(Techniques.of(compose_spec([*LLAMA, "peft=lora", "peft.r=8"])))
    assert t.model.layout_with(other).shapes != kept.shapes
