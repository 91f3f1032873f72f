"""tests/composed.py: the tests' composition is Hydra's, value for value and error for error."""
from __future__ import annotations

from unittest import mock

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests import composed as composing
from tests.helpers import CONF, FAST

LINES = [
    [],
    FAST,
    ["model=gpt2", "precision=bf16", "batch_size=4", "optimizer.lr=1e-3", "optimizer=sgd"],  # a value before its group
    ["experiment=full_7b", "batch_size=2", "device=cuda"],
    ["experiment=leanest", "model=gpt2-xl", "seq_len=64", "+optimizer.note=x"],  # a preset's model changed, a key added
    ["experiment=long_context", "scale=cpu"],
    ["model=hf", "model.name=gpt2", "peft=lora", "peft.r=4"],
    ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "model.config.hidden_size=64", "checkpoint=block"],
    ["optimizer=adamw", "optimizer.betas=[0.8,0.9]", "++optimizer.weight_decay=0.5"],  # a list value, a forced set
    ["~model.config.tie_word_embeddings", "model=llama3.2-1b"],  # a deletion
]


def hydra_whole(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


@pytest.mark.parametrize("line", LINES, ids=lambda line: " ".join(line)[:60] or "defaults")
def test_a_line_composes_to_what_hydra_composes(line):
    assert composing.composed(line) == hydra_whole(line)


@pytest.mark.parametrize("line", [
    ["batch_size=many"],  # a value the schema refuses
    ["no_such_key=1"],  # a key the struct config does not have
    ["model=gpt9"],  # an option the group does not have
    ["optimizer=adamw,sgd"],  # a sweep
    ["batch_size="],  # set to nothing
    ["model.config.hidden_size"],  # no '='
])
def test_a_line_hydra_refuses_is_refused_with_hydras_error(line):
    with pytest.raises(Exception) as ours:
        composing.composed(line)
    with pytest.raises(Exception) as hydras:
        hydra_whole(line)
    assert type(ours.value) is type(hydras.value) and str(ours.value) == str(hydras.value)
    assert isinstance(ours.value, ConfigCompositionException) or "batch_size=" in line[0] or "=" not in line[0]


def test_lines_that_choose_the_same_configs_merge_them_once():
    composing._hydra.cache_clear()
    with mock.patch.object(composing, "compose", wraps=compose) as hydra_compose:
        a = composing.composed(["model=gpt2", "batch_size=4", "seq_len=16"])
        b = composing.composed(["batch_size=8", "model=gpt2", "steps=2"])
        composing.composed(["model=gpt2-medium", "batch_size=8"])
    assert [c.kwargs["overrides"] for c in hydra_compose.call_args_list] == [["model=gpt2"], ["model=gpt2-medium"]]
    assert (a["batch_size"], a["seq_len"], b["batch_size"], b["steps"]) == (4, 16, 8, 2)
    assert b["seq_len"] == hydra_whole([])["seq_len"]  # the first line's values stayed with the first line
