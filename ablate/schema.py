"""The typed run configuration. Hydra merges conf/ into it, so a misspelt key or a wrongly typed
value fails when the config is composed, before anything runs.

Group options (model, data, optimizer, precision, ...) are `_target_` nodes whose keys are exactly their
class's __init__ arguments (ablate/techniques/); instantiating them checks those keys.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import math
import typing
from dataclasses import dataclass, field, fields, make_dataclass
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
# Keys in run_id only when set: at null they change nothing a result records, so the points of
# results from before the key existed keep their run_id and are reused.
HASHED_WHEN_SET = ("gpu_model",)


def identity(config: dict) -> dict:
    """What a point's run_id hashes of its resolved config (ablate/run_identity.py)."""
    return {k: v for k, v in config.items()
            if k not in NON_SEMANTIC_KEYS and not (k in HASHED_WHEN_SET and v is None)}


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
def built_option(group: str, option: str):
    """The object conf/<group>/<option>.yaml builds with its own values, or None (no such file, or
    it does not build): what the report asks for an option's label. Imports the class: the slow path."""
    from hydra.utils import instantiate

    node = option_defaults(group, option)
    if "_target_" not in node:
        return None
    try:
        return instantiate({k: v for k, v in node.items() if k != "defaults"})
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


def _option_keys(group: str) -> list[str]:
    """Every key any option of `group` takes (conf/<group>/*.yaml), for checking a command line."""
    return sorted({k for option in options(group) for k in option_keys(group, option)})


def belongs_to(group: str, key: str) -> str:
    """' (momentum is a key of optimizer=sgd)': where a key another option of `group` takes belongs."""
    owners = [f"{group}={o}" for o in options(group) if key in option_keys(group, o)]
    return f" ({key} is a key of {', '.join(owners)})" if owners else ""


def _chosen(group: str, overrides: list) -> list[str]:
    """The option(s) of `group` a command line runs: the ones it names (group=a,b), else the one
    its scale or experiment puts there, else conf/config.yaml's default. [] when that cannot be told."""
    for o in overrides:
        if o.key_or_group == group and not (o.is_add() or o.is_delete()):
            return [str(v) for v in (o.sweep_string_iterator() if o.is_sweep_override() else [o.value()])]
    for overlay in reversed(OVERLAYS):  # the later in config.yaml's defaults wins (scale=cpu's model)
        names = [o.value() for o in overrides if o.key_or_group == overlay and not o.is_sweep_override()]
        for entry in option_defaults(overlay, str(names[0])).get("defaults", []) if names else []:
            if isinstance(entry, dict) and f"override /{group}" in entry:
                return [entry[f"override /{group}"]]
    if any(o.key_or_group == "experiment" for o in overrides):  # a sweep over experiments, or one whose
        return []  # ladder rungs may pick the option: not known before composition
    return [entry[group] for entry in _root_defaults() if isinstance(entry, dict) and group in entry]


@functools.cache
def _root_defaults() -> list:
    """conf/config.yaml's defaults list: each group's default option."""
    return OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]


def _option_error(o, valid: list[str]) -> str | None:
    """The error for `group=option` naming an option that does not exist (experiment=leanst would
    otherwise be Hydra's page-long "Could not find", or, when the group is optional, nothing)."""
    names = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    wrong = [str(n) for n in names if str(n) not in valid and n is not None]
    if not wrong:
        return None
    # An option the typed name begins (adamw8 -> adamw8bit) before the closest spelling (adamw)
    close = [v for v in valid if v.startswith(wrong[0])][:1] or difflib.get_close_matches(wrong[0], valid, n=1)
    return (f"unknown {o.key_or_group} '{wrong[0]}'" + (f" (did you mean '{close[0]}'?)" if close else "")
            + f". Valid {o.key_or_group} options: " + ", ".join(valid) + ".")


def _run_types() -> dict:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config) if f.name not in GROUPS}


RUN_TYPES = _run_types()  # run key -> its annotated type
_KIND = {bool: "true or false", int: "a whole number", float: "a finite number", str: "a string", type(None): "null"}


def _wrong_type(o, hint) -> str | None:
    """The error for a run key given a value of another type. OmegaConf converts rather than
    refuses some: compile=-1 and compile=7 became true, a silent change of what was asked."""
    from ablate.keytypes import fits

    values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    enum = next((a for a in args if isinstance(a, type) and issubclass(a, Enum)), None)
    for value in values:
        ok = (value in [m.value for m in enum] or (value is None and type(None) in typing.get_args(hint))) if enum \
            else fits(value, hint)
        if not ok:
            kinds = "one of " + ", ".join(m.value for m in enum) if enum else " or ".join(
                _KIND.get(a, a.__name__) for a in (typing.get_args(hint) or [hint]))
            return f"{o.key_or_group}={value!r} must be {kinds}."
    return None


def _wrong_option_type(o, group: str, key: str, chosen: list[str]) -> str | None:
    """The error for an option key given a value its options' files show it cannot take: a number
    where the file has one (optimizer.lr=abc), a bool where it has one. Read off the files' own
    values, not the classes' annotations (ablate/keytypes.py checks those in the job), so that
    the command line imports no torch; a key whose file value is null or text passes here."""
    from ablate.keytypes import fits, type_name

    values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    for option in chosen:
        default = option_defaults(group, option).get(key)
        kind = bool if isinstance(default, bool) else int if isinstance(default, int) else \
            float if isinstance(default, float) else None
        bad = next((v for v in values if kind and v is not None and not fits(v, kind)), None)
        if bad is not None:
            shown = str(default).lower() if isinstance(default, bool) else default
            # the words the job's own check (ablate/keytypes.py) uses for the same value
            return f"{o.key_or_group}={bad!r} must be {type_name(kind)} ({group}={option} has {shown})."
    return None


def unknown_key(argv: list[str]) -> str | None:
    """The error for a command line that sets a key no config has, naming the closest key and the
    valid ones (Hydra's own says only "Key 'batch_sz' not in 'Config'", or suggests `+key` for an
    option's key, which then fails inside the option's constructor), or picks an option no group
    has; None when every key and option is known. A key of another option of the same group
    (optimizer.momentum under adamw) names the option it belongs to."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_known_args(argv)[0]
        if args.shell_completion:  # `--shell-completion install=bash`: Hydra's own words, not overrides
            return None
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except Exception:  # a syntax error: Hydra reports it better
        return None
    errors = []
    for o in overrides:
        if o.is_delete():
            continue
        if _non_finite(o):  # of any key, an option's too: the point would train, then its row could not be written
            errors.append(f"{o.key_or_group}={_non_finite(o)} is not a finite number: every number ablate "
                          "takes is finite (NaN and inf pass no check that compares them).")
            continue
        if o.is_force_add():
            continue
        head, _, rest = o.key_or_group.replace("/", ".").partition(".")
        if (head in GROUPS or head in OVERLAYS) and not rest and not o.is_add():
            errors.append(_option_error(o, options(head)))
            continue
        if o.is_add():
            continue
        if head in GROUPS and rest:
            prefix, key = head + ".", rest.split(".")[0]
            valid = _option_keys(head)
            chosen = [c for c in _chosen(head, overrides) if c in options(head)]
            lacking = [c for c in chosen if key not in option_keys(head, c)]
            lacking = [c for c in lacking if key not in option_takes(head, c)] if key in valid else []
            if lacking:  # a sweep's every point must take it: Hydra would stop the sweep at the first that does not
                errors.append(f"{o.key_or_group}: not a key of {head}={lacking[0]}{belongs_to(head, key)}. Its keys: "
                              + ", ".join(prefix + k for k in option_takes(head, lacking[0])) + ".")
                continue
            if not rest.count(".") and key in valid:
                errors.append(_wrong_option_type(o, head, key, chosen))
        else:
            prefix, key, valid = "", head, [f.name for f in fields(Config)] + [*OVERLAYS, "hydra"]
            if key in RUN_TYPES and not rest:
                errors.append(_wrong_type(o, RUN_TYPES[key]))
        if key not in valid:
            close = [prefix + k for k in difflib.get_close_matches(key, valid, n=1)]
            errors.append(f"unknown key '{o.key_or_group}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                          + f". Valid {prefix[:-1] or 'top-level'} keys: "
                          + ", ".join(prefix + k for k in sorted(valid)) + ".")
    errors = [e for e in errors if e] + _unscalable(overrides)
    if not errors:
        return None
    return "\n".join(errors + ["See the whole config with `python -m ablate --cfg job`."])


def _non_finite(o) -> str | None:
    """The first NaN or infinite number an override's value holds (a sweep's, a list's, a dict's),
    as typed; None without one."""
    def walk(value):
        if isinstance(value, float) and not math.isfinite(value):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)
    try:
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    except Exception:  # a range or interval sweep: no values to list, and none NaN-typed
        return None
    return next((str(v) for v in walk(values)), None)


def _unscalable(overrides: list) -> list[str]:
    """An overlay that sets model keys (scale=cpu: model.n_embd, ...) with a model named on the
    command line that takes none of them (a Hugging Face model's shape is under model.config):
    one line naming both, not the composed config's "model.n_embd is not a key of HFCausalLM"."""
    errors = []
    for o in overrides:
        if o.key_or_group not in OVERLAYS or o.is_sweep_override() or o.is_delete():
            continue
        sets = option_defaults(o.key_or_group, str(o.value())).get("model") or {}
        for model in (c for c in _chosen("model", overrides) if c in options("model")) if sets else ():
            lacking = [k for k in sets if k not in option_takes("model", model)]
            if lacking:
                errors.append(f"{o.key_or_group}={o.value()} sets " + ", ".join(f"model.{k}" for k in lacking)
                              + f", which model={model} does not take: it scales ablate's GPT-2 (model=gpt-nano ... "
                              f"gpt2-xl). For model={model} leave {o.key_or_group}={o.value()} out and set its own "
                              f"sizes (a Hugging Face model's under model.config: model.config.num_hidden_layers=2 "
                              f"model.config.hidden_size=64 ...) and device=cpu.")
    return errors


def register() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("short_dirname", short_dirname, replace=True)  # conf/config.yaml
    OmegaConf.register_new_resolver("ablate_help", _help_text, replace=True)  # --help's middle


def _help_text() -> str:
    from ablate.help import text

    return text()
