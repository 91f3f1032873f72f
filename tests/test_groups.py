"""The group registry (ablate/groups.py) against conf/, the lists that derive from it, and the
analytic predictor's rule that an option it cannot ask about its memory, of a known group or a new
one, is Unmodelled by name (the point falls back to the trace), never left out."""
from __future__ import annotations

from dataclasses import fields

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from ablate import build, groups
from ablate.build import Techniques
from ablate.groups import GROUPS, OFF, TECHNIQUE_GROUPS
from ablate.predict.analytic import analytic
from ablate.schema import OVERLAYS, Config, built_option, options
from ablate.techniques import Option, Unmodelled
from ablate.techniques.optimizer import TorchOptimizer
from analysis import compare, load, option_names, tables
from helpers import CONF, FAST, compose_spec


def test_every_group_folder_under_conf_is_in_the_registry_and_back():
    folders = {p.name for p in CONF.iterdir() if p.is_dir()} - {"hydra", *OVERLAYS}
    assert folders == set(GROUPS)


def test_each_technique_groups_default_is_its_do_nothing_option_and_its_references_exist():
    defaults = {k: v for entry in OmegaConf.load(CONF / "config.yaml")["defaults"]
                if isinstance(entry, dict) or OmegaConf.is_dict(entry) for k, v in entry.items()}
    for group in GROUPS:
        assert group in defaults, f"conf/config.yaml has no default for {group}"
    for g in groups.REGISTRY:
        if g.off is not None:
            assert defaults[g.name] == g.off, f"{g.name}'s default is {defaults[g.name]}, its off option {g.off}"
            assert {g.off, *g.fallback} <= set(options(g.name)), g.name


def test_every_technique_option_names_itself_for_the_report_and_no_two_alike():
    for group in TECHNIQUE_GROUPS:
        labels = {option: option_names.label(group, option) for option in options(group)}
        for option, text in labels.items():
            assert built_option(group, option) is not None, f"conf/{group}/{option}.yaml does not build"
            assert text and text != f"{group}={option}", f"{group}={option} has no label"
        assert len(set(labels.values())) == len(labels), f"two options of {group} share a label: {labels}"


def test_an_option_key_set_on_its_own_is_named_by_its_option_class():
    row = pd.Series({"optimizer": "adamw8bit", "optimizer.in_backward": True, "parallel": "fsdp1",
                     "parallel.backward_prefetch": "post", "parallel.nproc": 2})
    assert option_names.key_label(row, "optimizer.in_backward") == "Optimizer step in backward"
    assert option_names.key_label(row, "parallel.backward_prefetch") == "Backward prefetch (post)"
    assert option_names.key_label(row, "parallel.nproc") == "parallel.nproc=2"  # no name of its own
    assert option_names.label("checkpoint", "every2") == "Recompute every 2nd block"
    assert option_names.label("checkpoint", "no_such_option") == "checkpoint=no_such_option"  # an older row's


def test_the_schema_the_build_and_the_report_read_their_groups_from_the_registry():
    assert [f.name for f in fields(Config)][:len(GROUPS)] == list(GROUPS)
    assert list(Techniques.of(compose_spec(FAST)).options()) == list(TECHNIQUE_GROUPS)
    assert compare.BASELINE == OFF == load.LEGACY and set(tables.REMOVABLE) <= set(OFF)
    assert set(TECHNIQUE_GROUPS) == set(OFF)  # every technique has a do-nothing option to compare with


class Quiet(Option):
    """An option of a group the predictor has never heard of, saying nothing of its memory."""


class Bare(TorchOptimizer):
    """An optimizer option that builds a torch optimizer but gives no model of its state."""

    def __init__(self, lr: float = 0.1, weight_decay: float = 0.0, in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)

    def optimizer_class(self):
        return torch.optim.SGD

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr}


def test_an_option_of_a_new_group_that_says_nothing_of_its_memory_is_unmodelled_by_group(monkeypatch):
    spec = compose_spec(FAST)
    spec.groups["sparsity"] = {"_target_": f"{__name__}.Quiet"}
    monkeypatch.setattr(build, "TECHNIQUE_GROUPS", (*TECHNIQUE_GROUPS, "sparsity"))
    with pytest.raises(Unmodelled, match=r"no analytic memory model for group sparsity \(option Quiet\)"):
        analytic(spec)


def test_an_option_of_a_known_group_without_its_memory_model_is_unmodelled_by_name():
    spec = compose_spec([*FAST, "optimizer=sgd"])
    spec.groups["optimizer"] = {"_target_": f"{__name__}.Bare"}
    with pytest.raises(Unmodelled, match="no memory model for optimizer option Bare"):
        analytic(spec)
    assert analytic(compose_spec([*FAST, "optimizer=sgd"])).peak_mib > 0  # the option it stands in for answers
