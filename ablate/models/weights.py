"""`model.init_from`: a save_pretrained directory's safetensors weights, read as a model's state dict
and checked against the model before anything is copied.

The check compares each tensor's shape and dtype with the model's: a tensor of another shape, a
floating-point parameter saved as integers (a copy would truncate it silently: a run that never
learns), a parameter the files lack or a tensor the model has no place for is an `invalid` row
naming the directory and the keys, in one line. It needs no data: `read(path, meta=True)` gives
meta tensors of the files' headers, so the job refuses such a checkpoint before any worker runs
(a plan, predict_only=true, included), and the worker checks the tensors it loads the same way.

A Hugging Face model's checkpoint names its tensors as the family's conversion mapping in
transformers says (Pythia's head is saved as `embed_out`, a mixture's experts one by one): `hf_state`
converts them with that mapping, as transformers' own loader does, into the names the model gives
them. ablate's GPT-2 converts its own (ablate/models/gpt.py).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ablate.techniques import Invalid

SHOWN = 3  # keys a reason lists of each kind before "... and N more"


def files(path: Path) -> list[Path]:
    """The safetensors files of a save_pretrained directory: model.safetensors, or the shards its
    model.safetensors.index.json names."""
    if not path.is_dir():
        raise Invalid(f"model.init_from={path}: no such directory (a local save_pretrained directory)")
    index = path / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    absent = [name for name in names if not (path / name).is_file()]
    if absent:
        raise Invalid(f"model.init_from={path}: no {absent[0]} there (ablate reads save_pretrained's safetensors)")
    return [path / name for name in names]


def read(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the directory by its name in the files; with `meta`, meta tensors of the
    shapes and dtypes in the files' headers, no data read."""
    state: dict[str, torch.Tensor] = {}
    for file in files(path):
        if not meta:
            state.update(load_file(str(file)))
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape = part.get_shape()
                # The header names its dtype in safetensors' words ("I64"); a slice of no rows is a tensor
                # of the torch dtype safetensors maps it to, read without the data.
                dtype = (part[:0] if shape else part[()]).dtype
                state[name] = torch.empty(shape, dtype=dtype, device="meta")
    return state


def _few(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" ... and {more} more" if more > 0 else "")


def refuse_misfit(path, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                  missing: Iterable[str] | None = None, unexpected: Iterable[str] | None = None) -> None:
    """Raise Invalid, one line naming model.init_from=path and the keys, unless the checkpoint's
    tensors `theirs` (under the model's names) fit the model's state dict `ours` (meta or real):
    the same shape, and floating point wherever the model's is. `missing` and `unexpected` are
    the keys the family counts as such (without them: every key one side lacks)."""
    common = [k for k in theirs if k in ours]
    shapes = [f"{k} {tuple(theirs[k].shape)} in the checkpoint, {tuple(ours[k].shape)} in the model"
              for k in common if theirs[k].shape != ours[k].shape]
    kinds = [f"{k} is {theirs[k].dtype} where the model's is {ours[k].dtype}"
             for k in common if ours[k].is_floating_point() and not theirs[k].is_floating_point()]
    missing = [k for k in ours if k not in theirs] if missing is None else sorted(missing)
    unexpected = [k for k in theirs if k not in ours] if unexpected is None else sorted(unexpected)
    parts = [f"{what}: {_few(keys)}" for what, keys in (
        ("shapes differ", shapes), ("floating-point weights saved as another kind", kinds),
        ("missing", missing), ("unexpected", unexpected)) if keys]
    if parts:
        raise Invalid(f"model.init_from={path}: " + "; ".join(parts))


def hf_state(path, lm: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors `state` under the names the transformers model `lm` gives them,
    checked against it (refuse_misfit, with transformers' own missing and unexpected keys: a tied
    head may be absent, a family's old buffers may be there): what `lm.load_state_dict` takes.
    The tensors are taken out of `state` as they are converted, so that a mixture's experts are
    held twice one layer at a time, not all at once."""
    from transformers.utils.loading_report import LoadStateDictInfo

    ours = lm.state_dict()
    theirs = _converted(lm, ours, state)
    tied = set(getattr(lm, "all_tied_weights_keys", None) or {})
    info = LoadStateDictInfo(missing_keys=set(ours) - set(theirs) - tied, unexpected_keys=set(theirs) - set(ours),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    lm._adjust_missing_and_unexpected_keys(info)  # the family's _keys_to_ignore_on_load_*, as from_pretrained
    refuse_misfit(path, ours, theirs, info.missing_keys, info.unexpected_keys)
    return {k: v for k, v in theirs.items() if k in ours}


def _converted(lm: nn.Module, ours: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` renamed and converted by the family's conversion mapping, key by key as transformers'
    convert_and_load_state_dict_in_model does (its renames, at most one converter per key, the base
    model's prefix added or dropped), without its loading into the model. A key the model has no
    place for keeps its renamed name, to be reported."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(lm)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out, pending = {}, {}
    for key in sorted(state, key=dot_natural_key):  # experts in index order: a converter stacks them so
        name, pattern = rename_source_key(key, renamings, converters, lm.base_model_prefix, ours)
        if name not in ours and key in ours:  # a key already the model's: kept (transformers' rule)
            name, pattern = key, None
        if pattern is None or name not in ours:
            out[name] = state.pop(key)
        else:
            pending.setdefault(name, copy.deepcopy(by_pattern[pattern])).add_tensor(name, key, pattern, state.pop(key))
    with torch.no_grad():
        for name, converter in pending.items():
            for target, value in converter.convert(name, model=lm, config=lm.config).items():
                out[target] = value[0] if isinstance(value, list) else value
    return out
