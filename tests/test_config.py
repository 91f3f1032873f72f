"""The real conf/ composes, every option of every group builds, and bad input fails clearly."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ablate.spec import RunSpec
from ablate.build import TECHNIQUE_GROUPS, Techniques, check_config
from ablate.keytypes import check_types
from ablate.command_line import unknown_key
from ablate.schema import GROUPS
from ablate.techniques import Invalid
from helpers import CONF, ROOT, compose_config, compose_spec

OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# GPU kernels, invalid with the defaults (a CPU or fp32, GPT-2, or the `kernels` extra not installed):
# tests/test_kernel_options.py and tests/test_attention.py check them in their own setting.
NOT_WITH_THE_DEFAULTS = {("loss", "liger"), ("loss", "cce"), ("kernels", "liger"), ("attention", "flash"),
                         ("attention", "efficient"), ("attention", "cudnn"), ("attention", "flex")}


def test_every_group_has_its_baseline_option():
    names = set(OPTIONS)
    for baseline in [("optimizer", "adamw"), ("optimizer", "sgd"), ("precision", "fp32"),
                     ("accumulation", "none"), ("checkpoint", "none"), ("offload", "none"),
                     ("parallel", "single"), ("data", "synthetic")]:
        assert baseline in names


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_instantiates(group, option, tmp_path):
    extra = [f"data.path={tmp_path}"] if option in ("tokens", "chars") else []
    cfg = compose_config([f"{group}={option}", *extra])
    if group == "model":
        assert cfg["model"]["name"] == option
        return
    built = instantiate(cfg[group])
    assert type(built).__name__ == cfg[group]["_target_"].rsplit(".", 1)[1]
    if group in TECHNIQUE_GROUPS and (group, option) not in NOT_WITH_THE_DEFAULTS:
        check_config(RunSpec.of(cfg))  # the default combination with this option is valid


def test_techniques_expose_the_loop_interface():
    t = Techniques.of(compose_spec())
    for name in ("autocast", "grad_scaler", "setup"):
        assert callable(getattr(t.precision, name))
    assert callable(t.accumulation.split) and callable(t.checkpoint.apply)
    assert callable(t.offload.context) and callable(t.parallel.sync) and callable(t.optimizer.build)


def test_schema_rejects_unknown_key_and_wrong_type():
    with pytest.raises(ConfigCompositionException, match="batch_sze"):
        compose_config(["batch_sze=4"])
    with pytest.raises(ConfigCompositionException, match="batch_size"):
        compose_config(["batch_size=four"])
    with pytest.raises(ConfigCompositionException, match="device"):
        compose_config(["device=gpu"])


def test_unknown_option_names_the_valid_choices():
    out = subprocess.run([sys.executable, "-m", "ablate", "optimizer=adamx", "--cfg", "job"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.startswith("unknown optimizer 'adamx' (did you mean 'adamw'?). Valid optimizer options: ")
    assert "sgd" in out.stderr and "Traceback" not in out.stderr
    # the start of a name before the closest spelling (was: adamw8 -> 'adamw')
    assert "did you mean 'adamw8bit'?" in unknown_key(["optimizer=adamw8"])
    assert "did you mean 'gpt2-xl'?" in unknown_key(["model=gpt2-x"])


def test_version_names_ablate_and_what_it_runs_on():
    out = subprocess.run([sys.executable, "-m", "ablate", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ablate ") and "torch " in out.stdout and "Hydra " in out.stdout


def test_unknown_key_names_the_valid_keys_and_the_closest():
    out = subprocess.run([sys.executable, "-m", "ablate", "-m", "seq_length=8,16", "--cfg", "job"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "unknown key 'seq_length' (did you mean 'seq_len'?)" in out.stderr
    assert all(k in out.stderr for k in ("batch_size", "steps", "optimizer", "predict_only"))
    assert "did you mean 'model.n_layer'?" in unknown_key(["model.n_layr=2"])
    both = unknown_key(["batch_sz=8", "seq_len=16", "model.n_layr=2"])  # every typo at once, one line each
    assert "'batch_sz' (did you mean 'batch_size'?)" in both.splitlines()[0] and "'model.n_layer'" in both.splitlines()[1]
    assert "did you mean 'optimizer.lr'?" in unknown_key(["optimizer=sgd", "optimizer.lrr=0.1"])
    assert "checkpoint.every_n" in unknown_key(["checkpoint.evry_n=3"])
    # Known keys, groups, Hydra's own keys and flags, option keys and explicit additions pass.
    assert unknown_key(["-m", "--cfg", "job", "hydra/launcher=slurm", "hydra.sweep.dir=x", "optimizer=sgd,adamw",
                        "optimizer.lr=0.1", "model.n_layer=2", "experiment=demo", "+extra=1", "~seed"]) is None
    # A key one option of a sweep lacks would stop the sweep at that option's first point.
    lacking = unknown_key(["-m", "optimizer=sgd,adamw", "optimizer.momentum=0.9"])
    assert lacking.startswith("optimizer.momentum: not a key of optimizer=adamw (momentum is a key of optimizer=")
    assert "optimizer=sgd" in lacking.split(")")[0] and "Its keys: optimizer.betas" in lacking


def test_cfg_job_prints_the_composed_config():
    out = subprocess.run([sys.executable, "-m", "ablate", "--cfg", "job", "optimizer=sgd"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert "ablate.techniques.optimizer.SGD" in out.stdout and "batch_size:" in out.stdout


def test_invalid_combination_names_the_keys():
    with pytest.raises(Invalid, match="batch_size=6 .*accumulation.steps=4"):
        check_config(compose_spec(["batch_size=6", "accumulation.steps=4"]))
    with pytest.raises(Invalid, match="seq_len=2048 > model.block_size=1024"):
        check_config(compose_spec(["seq_len=2048"]))
    # A run that measures no step is no result (steps=0 was an ok row with no timing at all).
    for bad, message in (("steps=0", "steps=0 must be >= 1"), ("samples=0", "samples=0 must be >= 1"),
                         ("warmup_steps=-1", "warmup_steps=-1 must be >= 2"),
                         # 0: an ok row without a peak; 1: a CPU peak without the optimizer state
                         ("warmup_steps=0", "warmup_steps=0 must be >= 2"), ("warmup_steps=1", "warmup_steps=1 must be >= 2"),
                         ("timeout_s=0", "timeout_s=0.0 must be > 0"),
                         ("model.n_head=5", "model.n_embd=192 is not divisible by model.n_head=5"),
                         ("compile=true warmup_steps=1", "warmup_steps=1 must be >= 2"),
                         # not a step's worth: it trained one step of batch_size samples, saying nothing
                         ("samples=7", r"samples=7 is less than one optimizer step's 8 samples \(batch_size=8\)"),
                         ("samples=15 batch_size=4 parallel=ddp parallel.nproc=4 device=cpu",
                          r"samples=15 is less than one optimizer step's 16 samples \(batch_size=4 x 4 ranks\)")):
        with pytest.raises(Invalid, match=message):
            check_config(compose_spec(bad.split()))
    check_config(compose_spec(["warmup_steps=2", "samples=8"]))


@pytest.mark.parametrize("overrides, message", [
    ("parallel=ddp parallel.backend=mpi", "parallel.backend='mpi' is not one of auto, nccl, gloo"),
    ("parallel=ddp parallel.nproc=0", "parallel.nproc=0 must be a positive integer or auto"),
    ("parallel=fsdp parallel.nodes=0", "parallel.nodes=0 must be >= 1"),
    ("parallel=ddp parallel.nodes=2", r"parallel.nodes=2 needs a SLURM allocation \(hydra/launcher=slurm\)"),
    ("parallel=ddp device=cpu parallel.backend=nccl", "parallel.backend=nccl needs CUDA devices"),
    ("parallel=fsdp1 parallel.sharding=hybrid", "parallel.sharding='hybrid' is not one of full, grad_op, no_shard"),
    ("parallel=fsdp1 parallel.backward_prefetch=later", "parallel.backward_prefetch='later' is not one of pre, post"),
    ("parallel.nproc=2", "parallel=single runs one process: parallel.nproc=2"),
    ("model.pad_vocab_to=0", "model.pad_vocab_to=0 must be >= 1"),
])
def test_a_parallel_setting_that_cannot_run_is_invalid_before_any_rank_starts(overrides, message, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(Invalid, match=message):
        check_config(compose_spec(overrides.split()))


@pytest.mark.parametrize("override, message", [
    ("accumulation.steps=abc", "accumulation.steps='abc' must be int"),  # was "'<' not supported between..."
    ("accumulation.steps=true", "accumulation.steps=True must be int"),
    ("optimizer.lr=abc", "optimizer.lr='abc' must be a finite float"),
    ("optimizer.betas=0.9", "optimizer.betas=0.9 must be tuple[float, float]"),
    ("optimizer.betas=[0.9,x]", "optimizer.betas=[0.9, 'x'] must be tuple[float, float]"),
    ("optimizer.betas=[0.9]", "optimizer.betas=[0.9] must be tuple[float, float]"),  # was: IndexError
    ("optimizer.betas=[0.9,0.99,0.5]", "optimizer.betas=[0.9, 0.99, 0.5] must be tuple[float, float]"),  # was: an error row
    ("data.train_samples=abc", "data.train_samples='abc' must be int"),  # was an error row from the worker
    ("parallel.nproc=[2]", "parallel.nproc=[2] must be int | str"),
])
def test_an_option_key_of_the_wrong_type_is_named_before_anything_is_built(override, message):
    with pytest.raises(Invalid, match=re.escape(message)):
        check_config(compose_spec([override]))


def test_option_keys_of_the_annotated_types_pass_the_type_check():
    for overrides in (["optimizer.lr=1"], ["optimizer.betas=[0.9,0.99]"], ["parallel=ddp", "parallel.nproc=auto"],
                      ["checkpoint=layers", "checkpoint.types=[gelu]"], ["optimizer=sgd", "optimizer.momentum=0.9"]):
        check_config(compose_spec(overrides))


def test_hydra_writes_sweeps_under_outputs_not_multirun():
    cfg = (CONF / "config.yaml").read_text()
    assert "${out_dir}/sweeps/" in cfg and "${short_dirname:${hydra.job.override_dirname}}" in cfg
    assert "${out_dir}/runs/" in cfg and "name: ablate" in cfg


def test_train_loop_names_no_technique():
    """DESIGN house style 2: the loop calls the options' interface and never names an option."""
    import ast

    tree = ast.parse((ROOT / "ablate" / "train.py").read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    options = {o for g, o in OPTIONS if g in TECHNIQUE_GROUPS}
    # Each option's own file names its class: read, not composed (a composition per option is slow).
    classes = {str(OmegaConf.load(CONF / g / f"{o}.yaml")["_target_"]).rsplit(".", 1)[1]
               for g, o in OPTIONS if g in TECHNIQUE_GROUPS}
    assert options and classes
    assert not strings & options, "train.py compares against option names"
    assert not names & classes, "train.py refers to technique classes"


def test_long_sweep_directory_names_are_shortened_but_stay_distinct():
    from ablate.schema import short_dirname

    assert short_dirname("optimizer=sgd") == "optimizer=sgd"
    long_a, long_b = "x" * 300 + ",seed=1", "x" * 300 + ",seed=2"
    assert len(short_dirname(long_a).encode()) <= 200
    assert short_dirname(long_a) != short_dirname(long_b) and short_dirname(long_a).startswith("x" * 150)


class _Forward:
    def __init__(self, steps: "TypeOnlyForCheckers" = 1):  # noqa: F821  (as under `if TYPE_CHECKING:`)
        self.steps = steps


def test_an_annotation_that_cannot_be_resolved_skips_the_type_check():
    check_types("group", {"_target_": f"{__name__}._Forward", "steps": "abc"})  # no NameError, no Invalid
    with pytest.raises(Invalid, match="group.steps='abc' must be int"):
        check_types("group", {"_target_": "ablate.techniques.accumulation.Accumulation", "steps": "abc"})
