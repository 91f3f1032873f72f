"""The model contract (ablate/models/contract.py): every option of conf/model keeps it on a real
build (ablate's GPT-2 sizes at 2 layers, the transformers families at toy size, model=custom with
examples/tiny_lm.py); a custom model that breaks it (ignores loss_fn, lacks a method, a path to no
module, a class that cannot be imported) is an invalid row naming what; model=custom trains through
the CLI; and the file defining a custom model is part of its run_id."""
from __future__ import annotations

import pytest
import torch

from ablate import results
from ablate.models.contract import LanguageModel
from ablate.models.hf_toy import _hydra, toy_keys, toy_overrides
from ablate.outcome import validate
from ablate.schema import option_defaults, options
from tests.conformance import assert_family_conforms
from tests.helpers import FAST, ROOT, compose_config, compose_spec, results_under, run_cli

EXAMPLE = ["model=custom", "model.target=examples.tiny_lm:TinyLM"]
NOT_MODEL = [f for f in FAST if not f.startswith("model")]  # FAST's run keys and data, with its vocabulary


def small(name: str) -> list[str]:
    """conf/model/<name>.yaml at a size a CPU builds in a moment, its family's structure kept."""
    node = option_defaults("model", name)  # a size variant's with gpt2.yaml's, which it extends
    if name == "custom":
        return EXAMPLE
    if node["_target_"].endswith("GPT2"):  # its own heads, 16 wide each, 2 layers
        return [f"model={name}", "model.n_layer=2", f"model.n_embd={16 * node['n_head']}", "model.vocab_size=128",
                "model.block_size=64"]
    if not node.get("config"):  # model=hf: no config of its own
        return toy_overrides("llama")
    from transformers import AutoConfig

    keys = toy_keys(AutoConfig.for_model(**node["config"]).to_dict())
    return [f"model={name}", *(f"++model.config.{k}={_hydra(v)}" for k, v in keys.items())]


@pytest.mark.parametrize("name", options("model"))
def test_every_model_option_keeps_the_contract(name):
    assert_family_conforms(small(name))


def test_the_example_is_a_language_model_and_a_plain_module_is_not():
    from examples.tiny_lm import TinyLM

    assert isinstance(TinyLM(), LanguageModel)
    assert not isinstance(torch.nn.Linear(2, 2), LanguageModel)


# Models that break the contract, as a module of their own: (its source, its class, the reason's words).
BROKEN = {
    "ignores_loss_fn": ("""
from examples.tiny_lm import TinyLM
from ablate.models import lm_loss

class Ignores(TinyLM):
    def forward(self, idx, targets=None):
        self.loss_fn, kept = None, self.loss_fn
        try:
            return super().forward(idx, targets)
        finally:
            self.loss_fn = kept
""", "Ignores", "model=custom: Ignores.forward never calls loss_fn, so loss=chunked, fused, liger and cce would "
                "measure the standard loss"),
    "logits_to_loss_fn": ("""
from examples.tiny_lm import TinyLM

class Logits(TinyLM):
    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        if self.loss_fn is not None and targets is not None:
            return None, self.loss_fn(logits, self.lm_head, targets)
        return super().forward(idx, targets)
""", "Logits", "model=custom: Logits.forward calls loss_fn with (1, 2, 512) and a Linear"),
    "values_on_meta": ("""
from examples.tiny_lm import TinyLM

class Values(TinyLM):
    def forward(self, idx, targets=None):
        idx = idx.masked_fill(idx == 0, 1)[:, :len(idx.nonzero())]  # a length read off the values
        return super().forward(idx, targets)
""", "Values", "model=custom: Values.forward fails on the meta device"),
    "no_reset": ("""
import torch

class NoReset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(512, 8), wpe=torch.nn.Embedding(64, 8)))
        self.lm_head = torch.nn.Linear(8, 512)
        self.loss_fn = None

    def tie_weights(self):
        pass
""", "NoReset", "model=custom: NoReset lacks reset_parameters"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_custom_model_that_breaks_the_contract_is_an_invalid_row_naming_it(case, tmp_path, monkeypatch):
    source, cls, reason = BROKEN[case]
    (tmp_path / f"contract_{case}.py").write_text(source)
    monkeypatch.syspath_prepend(tmp_path)
    outcome = validate(compose_spec([*NOT_MODEL, "model=custom", f"model.target=contract_{case}:{cls}",
                                     "loss=chunked"]))
    assert outcome is not None and outcome.status == "invalid" and "\n" not in outcome.reason
    assert outcome.reason.startswith(reason), outcome.reason


# A model=custom key that cannot be built or found, and the reason's words.
UNBUILT = {
    "no module": (["model.target=no_such_module:Net"], "model.target=no_such_module:Net: cannot import "
                                                       "no_such_module (ModuleNotFoundError"),
    "no class": (["model.target=examples.tiny_lm:Nope"], "model.target=examples.tiny_lm:Nope: examples.tiny_lm "
                                                         "has no nn.Module"),
    "no module path": (["model.target=TinyLM"], "model.target='TinyLM' is not MODULE:CLASS"),
    "no mlp": (["model.mlp=ffn"], "model.mlp=ffn: the layer Block has no such child (its children: ln_1, attn, "
                                  "ln_2, mlp)"),
    "no layers": (["model.layers=transformer.blocks"], "model.layers=transformer.blocks: transformer has no "
                                                       "module 'blocks' (its children: wte, wpe, h, ln_f)"),
    "wrong kwargs": (["+model.kwargs.n_layers=2"], "model.kwargs={'n_layers': 2}: TinyLM(**kwargs) raised TypeError"),
    "too long": (["seq_len=300"], "seq_len=300 > the 256 positions of model.position_embedding=transformer.wpe"),
}


@pytest.mark.parametrize("overrides,reason", UNBUILT.values(), ids=UNBUILT)
def test_a_custom_model_option_that_cannot_be_built_is_an_invalid_row_naming_the_key(overrides, reason):
    target = [a for a in overrides if a.startswith("model.target")]
    outcome = validate(compose_spec([*NOT_MODEL, "model=custom", *(target or EXAMPLE[1:]),
                                     *(a for a in overrides if a not in target), "loss=chunked"]))
    assert outcome is not None and outcome.status == "invalid", outcome
    assert outcome.reason.startswith(reason), outcome.reason


def test_the_chunked_loss_on_a_model_that_ignores_it_is_refused_and_the_standard_loss_is_not(tmp_path, monkeypatch):
    (tmp_path / "contract_standard.py").write_text(BROKEN["ignores_loss_fn"][0])
    monkeypatch.syspath_prepend(tmp_path)
    point = [*NOT_MODEL, "model=custom", "model.target=contract_standard:Ignores"]
    assert validate(compose_spec([*point, "loss=standard"])) is None
    assert validate(compose_spec([*point, "loss=fused"])).status == "invalid"


def test_model_custom_trains_the_example_through_the_cli_with_block_recompute_and_the_chunked_loss(tmp_path):
    proc = run_cli([*EXAMPLE, "+model.kwargs.vocab_size=128", "checkpoint=block", "loss=chunked"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = results_under(tmp_path)
    assert row["status"] == "ok" and row["choices"]["model"] == "custom", row["reason"]
    assert row["prediction"]["method"] == "trace"  # no analytic layer model of a user's module
    assert row["metrics"]["loss_final"] < row["metrics"]["loss_first"]


def test_editing_the_custom_models_source_changes_the_run_id(tmp_path, monkeypatch):
    source = (ROOT / "examples" / "tiny_lm.py").read_text()
    (tmp_path / "contract_edited.py").write_text(source)
    monkeypatch.syspath_prepend(tmp_path)
    config = compose_config([*NOT_MODEL, "model=custom", "model.target=contract_edited:TinyLM"])
    before = results.run_id(config)
    assert results.input_paths(config) == {"model.target": str(tmp_path / "contract_edited.py")}
    assert results.run_id(config) == before  # the same file, the same point
    (tmp_path / "contract_edited.py").write_text(source.replace("4 * d", "2 * d"))
    assert results.run_id(config) != before
    assert "model.target" not in results.input_paths(compose_config(FAST))  # other models: no module input
