"""The command line's own checks, before Hydra composes anything: a key no config has, an option
no group has, a value of the wrong type or not finite, an overlay that cannot scale the model
named. Each gives one line naming the key and the valid choices (`python -m ablate` exits 1 with
it), never a Hydra traceback or a row per point. Reads conf/ and the schema, never torch."""
from __future__ import annotations

import difflib
import functools
import math
import typing
from dataclasses import fields
from enum import Enum

from omegaconf import OmegaConf

from ablate.schema import CONF, GROUPS, OVERLAYS, Config, option_defaults, option_keys, option_takes, options


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
            # The option's own file first: its class (and torch with it) is imported only where that
            # leaves a key out, so that a preset's command line leaves torch to the prestarted worker.
            lacking = [k for k in sets if k not in option_keys("model", model)]
            lacking = [k for k in lacking if k not in option_takes("model", model)] if lacking else []
            if lacking:
                errors.append(f"{o.key_or_group}={o.value()} sets " + ", ".join(f"model.{k}" for k in lacking)
                              + f", which model={model} does not take: it scales ablate's GPT-2 (model=gpt-nano ... "
                              f"gpt2-xl). For model={model} leave {o.key_or_group}={o.value()} out and set its own "
                              f"sizes (a Hugging Face model's under model.config: model.config.num_hidden_layers=2 "
                              f"model.config.hidden_size=64 ...) and device=cpu.")
    return errors
