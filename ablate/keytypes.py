"""Option keys against the types their class's `__init__` annotates, before anything is built.

An option node's keys are exactly its class's constructor arguments (`conf/accumulation/x4.yaml`
-> `Accumulation(steps: int)`), but the root schema types them `Any`: `accumulation.steps=abc`
reached the class and failed there as "'<' not supported between 'str' and 'int'", a message
naming no key. This check names it: "accumulation.steps='abc' must be int".
"""
from __future__ import annotations

import inspect
import math
import types
import typing
from typing import Any

from hydra.utils import get_class

from ablate.techniques import Invalid


def check_types(group: str, node: dict) -> None:
    """Raise Invalid for the first key of `node` (an option's config, `_target_` included) whose
    value does not have its annotated type, or that the class does not take (`+optimizer.momentum`
    under adamw: instantiate's TypeError would name neither the group nor the keys it takes).
    Unannotated keys pass."""
    from ablate.command_line import belongs_to

    cls = get_class(node["_target_"])
    init = cls.__init__
    params = inspect.signature(cls).parameters  # of the class: () for one without an __init__ of its own
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = list(params)
        for key in node:
            if not key.startswith("_") and key not in takes:  # _target_, _convert_: instantiate's own
                raise Invalid(f"{group}.{key} is not a key of {node['_target_'].rsplit('.', 1)[-1]}"
                              f"{belongs_to(group, key)}. " + ("Its keys: " + ", ".join(f"{group}.{k}" for k in takes)
                                                                 if takes else "It takes no keys."))
    try:
        hints = typing.get_type_hints(init)
    except NameError:  # an annotation naming a type imported only for type checkers: nothing to check against
        return
    for key, value in node.items():
        hint = hints.get(key)
        if hint is not None and not fits(value, hint):
            raise Invalid(f"{group}.{key}={value!r} must be {type_name(hint)}")


def fits(value, hint) -> bool:
    """Whether a config value has type `hint`: an int is also a float; a bool is neither (YAML's
    true is not a count); a list stands for a tuple or sequence, and its items are checked too (a
    fixed-length tuple's count as well: betas=[0.9] is no (float, float))."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is tuple and args and Ellipsis not in args:  # tuple[float, float]: that many, each its own type
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(fits, value, args))
    if origin is not None:  # tuple[float, ...], Sequence[str], list[str]
        items = [a for a in args if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and (not items or all(fits(v, items[0]) for v in value))
    if hint is type(None):
        return value is None
    if isinstance(value, bool) and hint is not bool:
        return False
    if hint is float:  # NaN and inf pass every comparison a check makes (timeout_s=nan: no timeout)
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    return isinstance(value, hint)


def type_name(hint) -> str:
    if hint is float:
        return "a finite float"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "").replace("collections.abc.", "")
