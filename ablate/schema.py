"""The typed run configuration. Hydra merges conf/ into it, so a misspelt key or a wrongly typed
value fails when the config is composed, before anything runs.

Group options (model, data, optimizer, precision, ...) are `_target_` nodes whose keys are exactly their
class's __init__ arguments (ablate/techniques/); instantiating them checks those keys.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ablate.groups import GROUPS  # noqa: F401  (the registry: every group, declared once)
from ablate.hardware import DEVICES

# Groups of `# @package _global_` overlays over the whole config, not techniques (no result "choice"):
# a preset (experiment=leanest), and a scale of any preset (scale=cpu), applied after it.
OVERLAYS = ("experiment", "scale")

# Keys that change where or whether a point runs, never what it measures: left out of run_id.
NON_SEMANTIC_KEYS = ("timeout_s", "skip_existing", "out_dir", "predict", "predict_only", "prune", "prune_margin",
                     "rung")
# Keys in run_id only when set: at null (or false) they change nothing a result records, so the
# points of results from before the key existed keep their run_id and are reused.
HASHED_WHEN_SET = ("gpu_model", "find_seq")


def identity(config: dict) -> dict:
    """What a point's run_id hashes of its resolved config (ablate/run_identity.py)."""
    return {k: v for k, v in config.items()
            if k not in NON_SEMANTIC_KEYS and not (k in HASHED_WHEN_SET and (v is None or v is False))}


class Device(str, Enum):
    auto = "auto"  # cuda when the worker sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"


# The cards run key gpu_model names: those the step-time model has figures for (ablate/hardware.py).
GpuModel = Enum("GpuModel", {d.name: d.name for d in DEVICES}, type=str)


class Predict(str, Enum):
    analytic = "analytic"  # closed-form sizes played through one step (ablate/predict/analytic.py): instant
    trace = "trace"  # the real step on fake tensors under MemTracker (ablate/predict/trace.py): seconds
    none = "none"


@dataclass
class RunKeys:
    """The run keys: what a point is run with, beside one option per group (Config)."""

    batch_size: int = 8  # samples per optimizer step per rank: the effective batch
    seq_len: int = 64  # tokens per sample
    steps: int = 10  # measured optimizer steps
    # Unmeasured steps (>= 2): the first allocates the optimizer state, the last is traced for the breakdown. At 2
    # the traced step is also the one in which DDP rebuilds its gradient buckets, so MemTracker sees
    # them from their allocation (in forward, so it calls them activations). In a later step it
    # sees a bucket only from the first gradient copied into it, and can miss it at a peak before.
    warmup_steps: int = 2
    samples: Optional[int] = None  # train on this many samples instead of `steps` (null: use steps)
    # Held-out batches of batch_size samples for eval_loss after the measured steps, 0 for none (at
    # most data.eval_samples). Bounded: at 256 samples, a 2-step CPU run evaluated for minutes after
    # it trained for seconds.
    eval_steps: int = 2
    seed: int = 0  # torch's seed for initialisation and dropout (the data has its own, data.seed)
    compile: bool = False  # torch.compile the model (after checkpoint wrapping, before parallel wrapping)
    device: Device = Device.auto  # auto (cuda when the worker sees a GPU, else cpu), cpu or cuda
    peak_tflops: Optional[float] = None  # dense peak TFLOP/s for MFU on a GPU missing from the table
    timeout_s: float = 1800.0  # wall-clock limit of one worker
    # The worker's PYTORCH_CUDA_ALLOC_CONF, an ablation axis. (expandable_segments:True trades the
    # caching allocator's fixed-size segments for growable ones: less fragmentation, reserved
    # closer to allocated). null: the job's own environment's value, recorded here when set.
    alloc_conf: Optional[str] = None
    skip_existing: bool = True  # skip a point whose result.json is already terminal
    out_dir: str = "outputs"  # where runs/, sweeps/ and the index of finished points go
    # Capacity planning (ablate/predict/, ablate/capacity.py): memory is predicted for every point.
    predict: Predict = Predict.analytic  # how memory is predicted: analytic (instant), trace (seconds) or none
    predict_only: bool = False  # record each point's prediction (status "predicted") and run nothing
    gpu_memory_gib: Optional[float] = None  # emulate a GPU of this size (GiB); rows say so in env
    # Card the predicted step time is for (null: the GPU in sight, else h100-sxm). Null means the
    # GPU the worker sees; a plan without one in sight (predict_only=true device=cuda) is made for
    # an H100 SXM. Part of run_id once set, unlike predict: a plan's step time is its answer, and the
    # report keeps one row per run_id and machine, so a plan for two cards would lose one. A measured
    # row measures the GPU it ran on whatever this says; naming a card there only costs a rerun.
    gpu_model: Optional[GpuModel] = None
    prune: bool = False  # record a point predicted not to fit as an oom row without running it
    prune_margin: float = 0.1  # prune only above capacity x (1 + margin), as the prediction may be high
    find_batch: bool = False  # search the largest micro-batch that fits (accumulation keeps batch_size)
    find_seq: bool = False  # search the longest seq_len that fits (batch and micro-batch as given)
    rung: Optional[int] = None  # position in a ladder (hydra/sweeper=ladder sets it); the report orders by it


# The whole config: the run keys, and a node per group of ablate/groups.py, each an option's
# `_target_` node whose keys are its class's (checked by ablate/keytypes.py, not here).
# The groups come first in `--cfg job` (a dataclass lists its bases' fields from the last base on).
Config = make_dataclass("Config", [], bases=(RunKeys, make_dataclass("Groups", [(g, Any, field(default=MISSING))
                                                                            for g in GROUPS])))


def short_dirname(name: str, limit: int = 200) -> str:
    """A sweep point's directory name within the file system's 255-byte limit: a long override list
    (a ladder's later rungs) keeps its first characters plus a hash of the whole, so that two
    points never share a directory."""
    if len(name.encode()) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[:limit - 12].decode(errors="ignore") + ",~" + digest


CONF = Path(__file__).resolve().parent.parent / "conf"


@functools.cache
def option_defaults(group: str, option: str) -> dict:
    """An option's values as its file gives them (conf/<group>/<option>.yaml), on top of the
    options of its group that its `defaults` list names (gpt-mini.yaml extends gpt2.yaml, its
    _target_ and vocab_size included); {} if none. An overlay's (experiment, scale) `override /group`
    entries stay in its `defaults`."""
    path = CONF / group / f"{option}.yaml"
    own = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    if group in OVERLAYS:
        return own
    merged = {}
    for entry in own.pop("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            merged.update(option_defaults(group, entry))
    return {**merged, **own}


@functools.cache
def built_option(group: str, option: str, keys: tuple = ()):
    """The object conf/<group>/<option>.yaml builds with its own values, `keys` ((key, value) pairs)
    set over them, or None (no such file, or it does not build): what the report asks for an
    option's label. Imports the class: the slow path."""
    from hydra.utils import instantiate

    node = option_defaults(group, option)
    if "_target_" not in node:
        return None
    try:
        return instantiate({**{k: v for k, v in node.items() if k != "defaults"}, **dict(keys)})
    except Exception:  # a result of an option since changed or removed: the report falls back to its name
        return None


def options(group: str) -> list[str]:
    """The options of a config group: conf/<group>/*.yaml (experiment included)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def option_keys(group: str, option: str) -> list[str]:
    """The keys one option's file sets (less `_target_` and Hydra's `defaults`)."""
    return sorted(k for k in option_defaults(group, option) if not str(k).startswith("_") and k != "defaults")


def option_takes(group: str, option: str) -> list[str]:
    """Every key one option takes: its file's and any other argument its class's __init__ has a
    default for (gpt-nano's file leaves vocab_size at GPT2's). Imports the class: the slow path."""
    import inspect

    from hydra.utils import get_class

    target = option_defaults(group, option).get("_target_")
    params = inspect.signature(get_class(target).__init__).parameters if target else {}
    return sorted(set(option_keys(group, option)) | {k for k in params if k != "self"})


def register() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("short_dirname", short_dirname, replace=True)  # conf/config.yaml
    OmegaConf.register_new_resolver("ablate_help", _help_text, replace=True)  # --help's middle


def _help_text() -> str:
    from ablate.help import text

    return text()
