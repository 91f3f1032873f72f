"""launch/compose_once.py: a sweep's points composed from each choice of configs merged once are
Hydra's own compositions of them, value for value, `hydra` node and error included."""
from __future__ import annotations

import pickle
from unittest import mock

import cloudpickle
import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.types import RunMode
from omegaconf import OmegaConf

from ablate.schema import register
from helpers import CONF, FAST
from launch.compose_once import ComposeOnce

register()  # the typed schema conf/config.yaml names, and its resolvers

# The sweep's own line, as `python -m ablate -m ...` would have it: a hydra override Hydra replays
# at every point, and one that changes how it names a point's directory.
MASTER = ["experiment=full_7b", "predict_only=true", "hydra.sweep.dir=/tmp/never-made",
          "hydra.job.config.override_dirname.exclude_keys=[seed]"]

POINTS = [
    [],
    FAST,
    ["gpu_memory_gib=24", "model=llama3.1-8b", "batch_size=1", "optimizer=adamw8bit", "optimizer.in_backward=true"],
    ["gpu_memory_gib=16", "model=llama3.1-8b", "batch_size=1", "optimizer=adamw8bit", "optimizer.in_backward=true"],
    ["optimizer.in_backward=true", "gpu_memory_gib=16", "optimizer=adamw8bit", "batch_size=2", "model=llama3.1-8b",
     "seed=3", "rung=4"],  # the same choices in another order, a value before its group
    ["model=mistral-7b", "optimizer=galore8bit", "optimizer.rank=1024", "offload=activations"],
    ["model=hf", "model.name=gpt2", "peft=lora", "peft.r=4", "+optimizer.note=x"],  # a key added
    ["optimizer=adamw", "optimizer.betas=[0.8,0.9]", "++optimizer.weight_decay=0.5"],  # a list, a forced set
    ["~model.config.tie_word_embeddings", "model=llama3.2-1b"],  # a deletion
    ["model={name: gpt2}", "batch_size=3"],  # a group given a dict: Hydra's value, not a choice
]


@pytest.fixture(scope="module")
def loader():
    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))


@pytest.fixture(scope="module")
def master(loader):
    return loader.load_configuration("config", overrides=MASTER, run_mode=RunMode.MULTIRUN)


def whole(config) -> tuple:
    """Everything a composition holds: its values unresolved, the job's resolved, and its flags."""
    job = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    return (OmegaConf.to_container(config, resolve=False), OmegaConf.to_container(job, resolve=True),
            OmegaConf.is_struct(config), OmegaConf.is_readonly(config.hydra))


def test_every_point_is_hydras_own_composition_of_it(loader, master):
    once = ComposeOnce(loader)
    for point in POINTS:
        assert whole(once.load_sweep_config(master, point)) == whole(loader.load_sweep_config(master, point)), point
    ours = once.load_sweep_config(master, POINTS[4])  # the record of its overrides is the point's own
    assert list(ours.hydra.overrides.task) == POINTS[4] and list(ours.hydra.overrides.hydra) == MASTER[2:]
    assert ours.hydra.job.override_dirname == ("batch_size=2,gpu_memory_gib=16,model=llama3.1-8b,"
                                               "optimizer.in_backward=true,optimizer=adamw8bit,rung=4")


@pytest.mark.parametrize("point", [
    ["batch_size=many"],  # a value the schema refuses
    ["no_such_key=1"],  # a key the struct config does not have
    ["model=gpt9"],  # an option the group does not have
    ["optimizer=adamw,sgd"],  # a sweep
    ["batch_size="],  # set to nothing
    ["+batch_size=2"],  # added where it already is
    ["optimizer@opt=sgd"],  # a package given to a value
], ids=str)
def test_a_point_hydra_refuses_is_refused_with_hydras_error(loader, master, point):
    with pytest.raises(Exception) as ours:
        ComposeOnce(loader).load_sweep_config(master, point)
    with pytest.raises(Exception) as hydras:
        loader.load_sweep_config(master, point)
    assert type(ours.value) is type(hydras.value) and str(ours.value) == str(hydras.value)


def test_points_that_choose_the_same_configs_merge_them_once_and_share_nothing(loader, master):
    once = ComposeOnce(loader)
    with mock.patch.object(loader, "load_sweep_config", wraps=loader.load_sweep_config) as hydra:
        checked = [once.load_sweep_config(master, POINTS[i]) for i in (2, 3, 4)]  # the sweeper's check
        checked[0].hydra.job.num = 7  # what the launcher does with its own
        checked[0].batch_size = 9
        launched = [once.load_sweep_config(master, POINTS[i]) for i in (2, 3, 4)]
    # The same choices in another order are merged again: Hydra's order of merging can hang on it.
    assert [c.args[1] for c in hydra.call_args_list] == [["model=llama3.1-8b", "optimizer=adamw8bit"],
                                                         ["optimizer=adamw8bit", "model=llama3.1-8b"]]
    assert [c.batch_size for c in launched] == [1, 1, 2] and launched[0].hydra.job.get("num") != 7
    assert [c.gpu_memory_gib for c in launched] == [24, 16, 16]


def test_the_choices_held_are_bounded_and_a_pickled_loader_holds_none(loader, master, monkeypatch):
    monkeypatch.setattr(ComposeOnce, "HELD", 2)
    once = ComposeOnce(loader)
    for i in (2, 5, 6):
        once.load_sweep_config(master, POINTS[i])
    assert list(once._held) == [("model=mistral-7b", "optimizer=galore8bit", "offload=activations"),
                                ("model=hf", "peft=lora")]  # the least recently used let go
    job = pickle.loads(cloudpickle.dumps(once))  # a pool's job, as submitit sends it to its process
    assert job._held == {} and job._master is None
    assert whole(job.load_sweep_config(master, POINTS[3])) == whole(loader.load_sweep_config(master, POINTS[3]))
    again = loader.load_configuration("config", overrides=MASTER, run_mode=RunMode.MULTIRUN)
    once.load_sweep_config(again, POINTS[6])  # another sweep: its own choices, none of the last one's
    assert list(once._held) == [("model=hf", "peft=lora")] and once._master is again
