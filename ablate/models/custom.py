"""model=custom: a user's own nn.Module as a model family, named by its import path
(`model.target=examples.tiny_lm:TinyLM`) and built as `Class(**model.kwargs)`.

The module keeps the model contract (ablate/models/contract.py `LanguageModel`), checked before a
point runs. Where its parts are is said by a few dotted paths (conf/model/custom.yaml; the defaults
fit a nanoGPT-like module), since every technique finds them through the family's adapter; the
norm and activation classes are read off the built module. Its vocabulary is the token embedding's
rows, its longest sequence the position embedding's rows (no limit without one). The analytic
predictor has no layer model of it: such a point is predicted with predict=trace, which runs the
real build on fake tensors. The file that defines the class is an input of the point's run_id
(ablate/results.py `MODULE_KEYS`), so an edited model is a new point.
"""
from __future__ import annotations

import importlib

from torch import nn

from ablate.models import Adapter, Family
from ablate.models.contract import part
from ablate.techniques import Invalid, Plan


def split_target(target: str) -> tuple[str, str]:
    """"pkg.module:Class" or "pkg.module.Class" -> (module, class name); ("", "") where it is neither."""
    module, _, name = target.partition(":") if ":" in target else target.rpartition(".")
    return (module, name) if module and name.isidentifier() else ("", "")


class CustomModel(Family):
    """A user's nn.Module honouring the model contract, built as `target`'s class with `kwargs`.
    `layers`, `attention`, `mlp`, `lm_head`, `embedding`, `position_embedding` (null: none, as with
    rotary positions) are dotted paths from the module, `attention` and `mlp` from a layer."""

    def __init__(self, target: str, kwargs: dict | None = None, name: str = "custom", layers: str = "transformer.h",
                 attention: str = "attn", mlp: str = "mlp", lm_head: str = "lm_head",
                 embedding: str = "transformer.wte", position_embedding: str | None = "transformer.wpe"):
        self.target, self.kwargs, self.name = target, dict(kwargs or {}), name
        self.layers, self.attention, self.mlp = layers, attention, mlp
        self.lm_head, self.embedding, self.position_embedding = lm_head, embedding, position_embedding
        self._cls = self._adapter = None

    @property
    def cls(self) -> type[nn.Module]:
        """The class `target` names, imported; Invalid naming model.target where it cannot be."""
        if self._cls is None:
            module, name = split_target(self.target)
            if not module:
                raise Invalid(f"model.target={self.target!r} is not MODULE:CLASS (examples.tiny_lm:TinyLM)")
            try:
                found = getattr(importlib.import_module(module), name, None)
            except Exception as exc:  # noqa: BLE001  (ImportError, or whatever the module raises as it loads)
                raise Invalid(f"model.target={self.target}: cannot import {module} ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); it must be "
                              f"importable from the working directory or PYTHONPATH") from None
            if not (isinstance(found, type) and issubclass(found, nn.Module)):
                raise Invalid(f"model.target={self.target}: {module} has no nn.Module class {name}")
            self._cls = found
        return self._cls

    def build(self) -> nn.Module:
        try:
            return self.cls(**self.kwargs)
        except (TypeError, ValueError, AssertionError) as exc:  # the class refusing its arguments
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise Invalid(f"model.kwargs={self.kwargs}: {self.cls.__name__}(**kwargs) raised "
                          f"{type(exc).__name__}: {text}") from None

    def check(self, plan: Plan) -> None:
        if plan.seq_len > self.max_seq_len:
            raise Invalid(f"seq_len={plan.seq_len} > the {self.max_seq_len} positions of "
                          f"model.position_embedding={self.position_embedding}")
        super().check(plan)  # the contract: methods, paths, and loss_fn called where the loss is chunked

    @property
    def vocab_size(self) -> int:
        return self._rows("embedding")

    @property
    def max_seq_len(self) -> int:
        return self._rows("position_embedding") if self.position_embedding else 2**31

    def _rows(self, key: str) -> int:
        """The rows of the weight of the module at `key`'s path (a token or a position each)."""
        weight = getattr(part(self.meta_model, getattr(self, key), key), "weight", None)
        if getattr(weight, "dim", lambda: 0)() != 2:
            raise Invalid(f"model.{key}={getattr(self, key)} is no module with a 2-d weight (rows x hidden)")
        return weight.shape[0]

    @property
    def adapter(self) -> Adapter:
        """The paths as given; norms (any class named *Norm*) and the MLP's activations (torch's
        activation modules) as the meta build has them."""
        if self._adapter is None:
            model = self.meta_model
            mlps = [getattr(layer, self.mlp, None) for layer in part(model, self.layers, "layers")]
            norms = {type(m) for m in model.modules() if "Norm" in type(m).__name__}
            activations = {type(m) for mlp in mlps if isinstance(mlp, nn.Module) for m in mlp.modules()
                           if type(m).__module__ == nn.modules.activation.__name__}
            self._adapter = Adapter(layers=self.layers, attention=self.attention, mlp=self.mlp,
                                    norms=tuple(norms), activations=tuple(activations), lm_head=self.lm_head,
                                    embedding=self.embedding, position_embedding=self.position_embedding)
        return self._adapter
