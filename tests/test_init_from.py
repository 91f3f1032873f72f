"""`model.init_from`: transformers' own save_pretrained output loads into every shipped family (each
Hugging Face family's tiny version, and ablate's GPT-2) through the family's key mapping and gives
transformers' logits; a checkpoint that does not fit the model (a tensor of another shape, float
weights saved as integers, no such directory, no config.json) is an `invalid` row whose one-line
reason names model.init_from and the keys, refused by the job's check from the files' headers, so
that a plan (predict_only=true) refuses it too."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from ablate.build import check_config
from ablate.models.hf_toy import _hydra, toy_keys
from ablate.outcome import validate
from ablate.techniques import Invalid
from tests.helpers import CONF, compose_config, compose_spec, results_under, run_cli

HF_TARGET = "ablate.models.hf.HFCausalLM"
# The shipped configs of a Hugging Face family (conf/model/hf.yaml names none: its config is empty).
HF_FAMILIES = sorted(p.stem for p in (CONF / "model").glob("*.yaml")
                     if OmegaConf.load(p).get("_target_") == HF_TARGET and OmegaConf.load(p).get("config"))
BASE = ["data.vocab_size=128", "device=cpu", "batch_size=2", "seq_len=16"]


def shipped(name: str) -> dict:
    """The transformers config keys of conf/model/<name>.yaml."""
    return OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"))["config"]


def toy(name: str) -> dict:
    """A shipped family's size keys made tiny (ablate/models/hf_toy.py): 2 layers, hidden 64, 128 tokens."""
    from transformers import AutoConfig

    return toy_keys(AutoConfig.for_model(**shipped(name)).to_dict())


def save_toy(name: str, path) -> torch.nn.Module:
    """transformers' own model of a shipped family's tiny version, saved to `path` by save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**shipped(name), **toy(name)})
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    lm.save_pretrained(path)
    return lm.eval()


def toy_overrides(name: str, path) -> list[str]:
    """The shipped family at its tiny size, starting from `path`."""
    return [f"model={name}", *(f"++model.config.{k}={_hydra(v)}" for k, v in toy(name).items()),
            f"model.init_from={path}", *BASE]


def save_gpt2(path, model: dict) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel of ablate's GPT-2 config `model` (a composed model group), saved."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                                    vocab_size=model["vocab_size"], n_positions=model["block_size"],
                                    bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(path)
    return hf.eval()


def loaded(overrides: list[str]) -> torch.nn.Module:
    """The model a worker trains: the job's checks passed, built, init_from's weights loaded."""
    family = check_config(compose_spec(overrides)).model
    model = family.build()
    family.load_weights(model)
    return model.eval()


def resave(path, change) -> None:
    """Rewrite the checkpoint's model.safetensors with `change(name, tensor)` applied to each tensor."""
    file = path / "model.safetensors"
    state = {k: change(k, v).contiguous() for k, v in load_file(file).items()}
    save_file(state, file, metadata={"format": "pt"})


def refusal(overrides: list[str]) -> str:
    """The job's one-line reason for refusing the point (ablate.outcome.validate)."""
    outcome = validate(compose_spec(overrides))
    assert outcome is not None and outcome.status == "invalid", outcome
    assert "\n" not in outcome.reason
    return outcome.reason


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_every_shipped_hf_family_loads_save_pretrained_weights_and_gives_transformers_logits(name, tmp_path):
    theirs = save_toy(name, tmp_path)
    ours = loaded(toy_overrides(name, tmp_path))
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(input_ids=x).logits)


@pytest.mark.parametrize("pad", [1, 64])
def test_ablates_gpt2_loads_transformers_gpt2_weights_and_gives_its_logits(tmp_path, pad):
    """pad_vocab_to=64: the model's 128 token rows take the checkpoint's 100, its padding rows left as they were."""
    overrides = ["model=gpt-nano", "model.vocab_size=100", f"model.pad_vocab_to={pad}", f"model.init_from={tmp_path}",
                 *BASE, "data.vocab_size=100"]
    theirs = save_gpt2(tmp_path, compose_config(overrides)["model"])
    ours = loaded(overrides)
    x = torch.randint(0, 100, (2, 16))
    assert ours.transformer.wte.weight.shape[0] == (128 if pad == 64 else 100)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0][..., :100], theirs(x).logits)


def test_a_tensor_of_another_shape_is_refused_by_the_job_naming_the_file_the_key_and_both_shapes(tmp_path):
    save_toy("llama3.2-1b", tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    resave(tmp_path, lambda k, v: torch.zeros(100, 64) if k == key else v)
    overrides = toy_overrides("llama3.2-1b", tmp_path)
    reason = refusal(overrides)
    assert reason == (f"model.init_from={tmp_path}: shapes differ: "
                      f"{key} (100, 64) in the checkpoint, (128, 64) in the model")
    family = instantiate(compose_config(overrides)["model"])  # the worker's load, past no check, says the same
    model = family.build()
    with pytest.raises(Invalid) as worker:
        family.load_weights(model)
    assert str(worker.value) == reason


def test_many_mismatched_keys_are_listed_a_few_then_counted(tmp_path):
    overrides = ["model=gpt-nano", "model.vocab_size=128", f"model.init_from={tmp_path}", *BASE]
    save_gpt2(tmp_path, compose_config(overrides)["model"])
    resave(tmp_path, lambda k, v: v[:, :10] if k.endswith("mlp.c_fc.weight") or k.endswith("attn.c_attn.weight") else v)
    reason = refusal(overrides)
    assert reason.startswith(f"model.init_from={tmp_path}: shapes differ: transformer.h.0.attn.c_attn.weight (48, 10) "
                             f"in the checkpoint, (48, 144) in the model, ")
    assert reason.endswith("... and 3 more")


@pytest.mark.parametrize("name", ["pythia-160m", "gpt-nano"])
def test_float_weights_saved_as_integers_are_refused_naming_the_key_and_the_dtype(name, tmp_path):
    if name == "gpt-nano":
        overrides = ["model=gpt-nano", "model.vocab_size=128", f"model.init_from={tmp_path}", *BASE]
        save_gpt2(tmp_path, compose_config(overrides)["model"])
    else:
        overrides = toy_overrides(name, tmp_path)
        save_toy(name, tmp_path)
    resave(tmp_path, lambda k, v: (v * 100).to(torch.int64))
    reason = refusal(overrides)
    assert reason.startswith(f"model.init_from={tmp_path}: floating-point weights saved as another kind: ")
    assert "is torch.int64 where the model's is torch.float32" in reason and "... and" in reason


def test_a_plan_refuses_a_checkpoint_that_does_not_fit(tmp_path):
    """predict_only=true runs no worker: the job's check alone refuses the point, an invalid row."""
    ckpt = tmp_path / "ckpt"
    save_gpt2(ckpt, compose_config(["model=gpt-nano", "model.vocab_size=128"])["model"])
    resave(ckpt, lambda k, v: v.to(torch.int64) if k == "transformer.wpe.weight" else v)
    proc = run_cli([f"model.init_from={ckpt}", "predict_only=true", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 1, proc.stderr  # a single run that ended invalid
    rows = results_under(tmp_path)
    assert [r["status"] for r in rows] == ["invalid"], rows
    assert rows[0]["reason"] == (f"model.init_from={ckpt}: floating-point weights saved as another kind: "
                                 f"transformer.wpe.weight is torch.int64 where the model's is torch.float32")


@pytest.mark.parametrize("model", [["model=gpt-nano", "model.vocab_size=128"], ["model=smollm2-135m"]])
def test_no_directory_or_no_config_json_is_an_invalid_row_naming_the_key(model, tmp_path):
    absent = tmp_path / "absent"
    assert refusal([*model, f"model.init_from={absent}", *BASE]).startswith(f"model.init_from={absent}: no ")
    (tmp_path / "model.safetensors").write_bytes(b"")
    reason = refusal([*model, f"model.init_from={tmp_path}", *BASE])
    assert reason.startswith(f"model.init_from={tmp_path}: no config.json")


def test_a_pythia_checkpoint_with_the_old_buffers_and_in_float16_loads(tmp_path):
    """Pythia's published files are float16 and still carry each layer's causal-mask buffers and
    rotary frequencies, which transformers' GPT-NeoX no longer has: its loader passes over them, and so
    does ablate's (the family's own list of keys to ignore)."""
    theirs = save_toy("pythia-160m", tmp_path)
    state = {k: v.half() for k, v in load_file(tmp_path / "model.safetensors").items()}
    for i in range(2):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = loaded(toy_overrides("pythia-160m", tmp_path))
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs.half().float()(input_ids=x).logits)


def test_a_checkpoint_in_shards_loads_with_each_layers_experts_stacked_across_files(tmp_path):
    theirs = save_toy("mixtral-8x7b", tmp_path / "whole")
    theirs.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 2
    ours = loaded(toy_overrides("mixtral-8x7b", tmp_path / "shards"))
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(input_ids=x).logits)
