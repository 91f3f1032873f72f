"""The config groups, declared once. Everything that lists groups derives from REGISTRY: the typed
schema's fields (ablate/schema.py), the techniques the build applies and checks (ablate/build.py),
the report's reference options and the value an older result without a group implies
(analysis/), the tests' group lists. A folder conf/<name>/ per group; a test holds the two equal.

A technique group's `off` option is a real do-nothing object (conf/<name>/<off>.yaml) and the
default of conf/config.yaml: the plain run every delta is measured against. Imports nothing
heavy: the command line's checks read it before any point runs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    name: str
    off: str | None = None  # the do-nothing option; None: every option is something (model, data)
    # The report's reference options when a grid lacks `off`, in order of preference: a
    # `parallel=fsdp,ddp` sweep asks how FSDP does against DDP.
    fallback: tuple[str, ...] = ()
    # Whether `off` is the absence of a technique, so that a row on it reads "− Block recompute";
    # an optimizer or a precision is always some option, and a row on another reads "+ SGD".
    removable: bool = False
    technique: bool = True  # built and checked by ablate/build.py (model and data are the point, not techniques)
    # Checked and built in this order (ablate/build.py), a technique's checks seeing the ones before.
    order: int = 0


REGISTRY = (
    Group("model", technique=False),
    Group("data", technique=False),
    Group("optimizer", off="adamw", fallback=("adamw_foreach", "adamw_fused", "adamw_forloop"), order=5),
    Group("precision", off="fp32", fallback=("tf32", "bf16"), order=0),
    Group("accumulation", off="none", removable=True, order=1),
    Group("checkpoint", off="none", removable=True, order=2),
    Group("offload", off="none", removable=True, order=3),
    Group("parallel", off="single", fallback=("ddp",), removable=True, order=4),
    Group("loss", off="standard", removable=True, order=6),
    Group("peft", off="none", removable=True, order=7),
    Group("attention", off="sdpa", order=8),
    Group("tiling", off="none", removable=True, order=9),
    Group("kernels", off="none", removable=True, order=10),
)
BY_NAME = {g.name: g for g in REGISTRY}
GROUPS = tuple(g.name for g in REGISTRY)  # result.json's `choices`, in this order
TECHNIQUE_GROUPS = tuple(g.name for g in sorted((g for g in REGISTRY if g.technique), key=lambda g: g.order))
# The do-nothing option of each technique group: the report's baseline, and the option an older
# result that predates a group ran with (it had none of it).
OFF = {g.name: g.off for g in REGISTRY if g.off is not None}
REMOVABLE = tuple(g.name for g in REGISTRY if g.removable)
FALLBACK = {g.name: g.fallback for g in REGISTRY if g.fallback}
