"""Deep models: counting and the analytic predictor read a sample of two layers, not every layer
(Family.layout), and give exactly what the whole meta model gives; a model whose layers are not
all alike, or whose optimizer groups do not follow its order, is built whole."""
from __future__ import annotations

import functools
import itertools

import pytest
from hydra.utils import instantiate

from ablate.models import gpt_module as gpt_model
from ablate.outcome import validate
from ablate.models import ParamLayout
from ablate.models.gpt import GPT2
from ablate.models.hf import HFCausalLM
from ablate.predict import predict
from ablate.predict.analytic import analytic
from ablate.spec import RunSpec
from tests.helpers import compose_config

# Tiny versions of three Hugging Face families (tests/test_families.py's), whose layer count is then set.
HF = {"llama3.2-1b": ["model.config.hidden_size=64", "model.config.intermediate_size=128",
                      "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                      "model.config.head_dim=16", "model.config.vocab_size=128", "data.vocab_size=128"],
      "pythia-160m": ["model.config.hidden_size=64", "model.config.intermediate_size=256",
                      "model.config.num_attention_heads=4", "model.config.vocab_size=128", "data.vocab_size=128"],
      "mixtral-8x7b": ["model.config.hidden_size=64", "model.config.intermediate_size=128",
                       "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                       "model.config.num_local_experts=4", "model.config.vocab_size=128", "data.vocab_size=128"]}
PARALLEL = {"single": [], "fsdp": ["parallel.nproc=2"]}


@functools.lru_cache(maxsize=None)
def _config(*overrides: str) -> dict:
    return compose_config(["device=cpu", "batch_size=4", "seq_len=32", *overrides])


def model_keys(name: str, n: int) -> tuple[str, ...]:
    """The overrides of model `name` at `n` layers."""
    if name in HF:
        return (f"model={name}", *HF[name], f"model.config.num_hidden_layers={n}")
    return (f"model={name}", f"model.n_layer={n}")


def point(model: tuple[str, ...], device: str = "cpu", **options: str) -> RunSpec:
    """The model's composed config on `device` with each group's option swapped in as its own
    composed node: composing every point whole would take ~0.2 s each, and no group's node refers
    to a key of another."""
    config = {**_config(*model), "device": device}
    for group, option in options.items():
        config[group] = _config(f"{group}={option}", *PARALLEL.get(option, []))[group]
    return RunSpec.of(config)


def whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family builds its whole meta model, as before samples: no family can build one."""
    for family in (GPT2, HFCausalLM):
        monkeypatch.setattr(family, "with_layers", lambda self, n: None)


# Autocast (its casts of one layer's Linears), a for-loop step (its temporaries follow the
# optimizer's groups), loss=chunked, accumulation, and precision=fp8 (which reads one layer's Linears).
EXTRA = [dict(precision="bf16_pure", optimizer="adamw_forloop"), dict(precision="bf16", loss="chunked"),
         dict(accumulation="x4", parallel="fsdp", offload="params"), dict(precision="fp8", device="cuda")]
# checkpoint x parallel x optimizer x offload (the optimizer's states offloaded to the host of a
# GPU: a plan's device=cuda), and EXTRA; the job's invalid combinations are left out when run.
GRID = [dict(checkpoint=c, parallel=p, optimizer=o, offload=f, device="cuda" if f == "optimizer" else "cpu")
        for c, p, o, f in itertools.product(["none", "block", "every2", "layers"], PARALLEL,
                                            ["adamw", "sgd", "adamw8bit"], ["none", "params", "optimizer"])] + EXTRA
# Each option of GRID at least once, and EXTRA: the default suite's points.
COMPACT = [dict(checkpoint="none", parallel="single", optimizer="adamw"),
           dict(checkpoint="block", parallel="fsdp", optimizer="sgd"),
           dict(checkpoint="every2", parallel="fsdp", optimizer="adamw8bit", offload="params"),
           dict(checkpoint="layers", parallel="single", optimizer="adamw8bit", offload="optimizer", device="cuda"),
           dict(checkpoint="every2", parallel="single", optimizer="sgd", offload="params"), *EXTRA]
CASES = [pytest.param(name, n, COMPACT, id=f"{name}-{n}")
         for name, n in (("gpt-nano", 3), ("gpt-mini", 7), ("llama3.2-1b", 3), ("pythia-160m", 7),
                         ("mixtral-8x7b", 3))] \
    + [pytest.param(name, n, GRID, id=f"{name}-{n}-grid", marks=pytest.mark.slow)
       for name in ("gpt-nano", "gpt-mini", *HF) for n in (3, 7)]  # 1 or 2 layers: no sample, nothing to compare


@pytest.mark.parametrize("name, n, points", CASES)
def test_a_sampled_prediction_is_the_whole_models(name, n, points, monkeypatch):
    """The whole Prediction (peak, breakdown, each category's maximum, what stays), float for float,
    from a two-layer sample and from the whole meta model."""
    model = model_keys(name, n)
    specs = [spec for spec in (point(model, **options) for options in points) if validate(spec) is None]
    assert len(specs) > len(points) // 2  # the grid is not mostly invalid
    family = instantiate(specs[0].groups["model"])
    assert family.layout.sampled == (n > 2)  # more than two layers: read from a sample
    sampled = [analytic(spec) for spec in specs]
    with monkeypatch.context() as m:
        whole(m)
        assert not instantiate(specs[0].groups["model"]).layout.sampled
        assert [analytic(spec) for spec in specs] == sampled


@pytest.mark.parametrize("name", ["gpt-nano", "gpt-mini", *HF])
def test_counts_from_a_sample_are_the_whole_models(name, monkeypatch):
    """Parameter counts, FLOPs' N and dims, the layout and the adapter, read from two layers."""
    model = model_keys(name, 7)
    family = instantiate(_config(*model)["model"])
    with monkeypatch.context() as m:
        whole(m)
        full = instantiate(_config(*model)["model"])
        expected = (full.num_params(), full.flops_params(), full.dims(), full.adapter,
                    list(full.layout.shapes.items()), full.layout.layer_names)
    assert family.layout.sampled and len(family.adapter.layer_list(family.layout.model)) == 2
    assert (family.num_params(), family.flops_params(), family.dims(), family.adapter,
            list(family.layout.shapes.items()), family.layout.layer_names) == expected


def test_a_10000_layer_prediction_builds_three_blocks(monkeypatch):
    """The analytic prediction's cost is linear in the layers: the meta model it reads has two
    blocks whatever n_layer says (plus a one-block sample, which shows that nothing outside the
    layers grows with them), where building all 10,000 took 20 s."""
    built = []
    init = gpt_model.Block.__init__
    monkeypatch.setattr(gpt_model.Block, "__init__", lambda self, cfg: (built.append(cfg.n_layer), init(self, cfg))[1])
    spec = RunSpec.of(_config("model=gpt-nano", "model.n_layer=10000", "predict_only=true"))
    assert validate(spec) is None
    prediction = predict(spec, "analytic")
    assert sorted(built) == [1, 2, 2]
    # Its parameters: the embeddings and ln_f, and 10,000 blocks of 12·48² + 13·48 (fp32, one copy).
    blocks, outside = 10_000 * (12 * 48**2 + 13 * 48), 50257 * 48 + 1024 * 48 + 2 * 48
    assert prediction.steady_mib["params"] * 2**20 == 4 * (blocks + outside)


def test_layers_of_more_than_one_kind_are_built_whole():
    """Qwen2 with sliding-window attention on its upper layers: its layers are not all of one kind,
    so no sample stands for them, and the counts come from the whole model."""
    model = ["model=qwen2.5-0.5b", "model.config.num_hidden_layers=4", "model.config.hidden_size=64",
             "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
             "model.config.num_key_value_heads=2", "++model.config.use_sliding_window=true",
             "++model.config.sliding_window=16", "++model.config.max_window_layers=2"]
    family = instantiate(_config(*model)["model"])
    assert len(set(family.hf_config.layer_types)) == 2
    assert family.with_layers(2) is None and not family.layout.sampled
    assert family.num_params() == sum(p.numel() for p in family.meta_model.parameters())


def test_groups_out_of_the_models_order_come_from_the_whole_model():
    """An optimizer's groups that are not a filter of the model's order (here reversed) cannot be
    repeated from a sample: the family asks the whole model instead."""
    family = instantiate(_config("model=gpt-nano", "model.n_layer=4")["model"])

    def reversed_groups(model):
        return [{"params": list(model.parameters())[::-1]}]

    assert family.layout.sampled and family.layout.groups(reversed_groups) is None
    names = [n for n, _ in family.meta_model.named_parameters()][::-1]
    assert family.param_groups(reversed_groups) == [names]


def test_a_sample_repeats_layer_zero_under_each_index():
    """Layer 4's names and shapes are layer 0's under index 4, between layer 3's and ln_f's."""
    layout = instantiate(_config("model=gpt-nano", "model.n_layer=5")["model"]).layout
    assert isinstance(layout, ParamLayout) and len(layout.layer_names) == 5
    assert layout.layer_names[4][0] == "transformer.h.4.ln_1.weight"
    assert list(layout.shapes)[-3:] == ["transformer.h.4.mlp.c_proj.bias", "transformer.ln_f.weight",
                                        "transformer.ln_f.bias"]
    assert layout.shapes["transformer.h.4.attn.c_attn.weight"] == (144, 48)
