"""kernels group: the family's own modules swapped for fused GPU kernels.

`liger` is Liger-Kernel's Triton kernels for transformers' Llama family: RMSNorm, the SwiGLU MLP
(SiLU(gate) x up in one kernel, recomputed in backward from the two projections it keeps) and the
rotary embedding (applied to q and k in place). The LM head and loss stay the loss group's
(`loss=liger` is Liger's fused linear cross-entropy), so the two groups compose.
"""
from __future__ import annotations

import importlib.util
import sys

from torch import nn

from ablate.models import Adapter
from ablate.techniques import Invalid, Option, Plan, Unmodelled

# transformers' model_types whose layers Liger's Llama kernels fit as they are: RMSNorm with Llama's
# casting, a gate/up/down SwiGLU MLP, the module-level apply_rotary_pos_emb of the attention.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
LIGER = "pip install liger-kernel, or -e '.[kernels]' in ablate's repository"


def require(key: str, what: str, modules: tuple[str, ...], install: str) -> None:
    """Raise Invalid for `key` (an option of GPU kernels, `what` they are) where one of `modules`
    cannot be imported. Looked up, not imported: the job checks too, and Triton's import alone
    takes seconds. After the option's other rules: a point to change is said before a package to
    install."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Invalid(f"{key} needs {what}, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                      f"not installed: {install}")


def _model_type(family) -> str | None:
    """transformers' model_type of a family that builds a transformers model; None for another."""
    return family.hf_config.model_type if getattr(family, "uses_transformers", False) else None


def _on_fake_tensors(model: nn.Module) -> bool:
    """Whether the model is being built on fake tensors (predict=trace's step)."""
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(p) for p in model.parameters())


class NoKernels(Option):
    """The family's modules as they are: PyTorch's eager ops."""

    label = "No fused kernels"

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        """Swaps modules of the bare model in place, before any recompute wrapper (ablate/build.py)."""
        return model

    def fused_parts(self) -> tuple[str, ...]:
        """The predictor's question: the parts of each layer that run as fused kernels, whose saved
        tensors the analytic layer model (ablate/predict/layers.py) does not count. None here."""
        return ()


class Liger(NoKernels):
    """Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in each decoder layer of a Llama-family
    model (Triton, CUDA only). Saves: the MLP's SiLU output and the product's inputs beyond the two
    projections (recomputed in backward), RMSNorm's fp32 copy of its input, rotary's temporaries.
    Spends: the SwiGLU product once more in backward."""

    label = "Liger kernels"

    def check(self, plan: Plan) -> None:
        kind = _model_type(self.family)
        if kind not in LLAMA_FAMILY:
            name = getattr(self.family, "name", "?")
            raise Invalid(f"kernels=liger takes transformers' Llama family (model_type {', '.join(LLAMA_FAMILY)}: "
                          f"model=llama3.2-1b, qwen2.5-0.5b, mistral-7b, ...); model={name} is "
                          f"{f'model_type={kind}' if kind else 'not a transformers model'}")
        if plan.device == "cpu":
            raise Invalid("kernels=liger needs Liger-Kernel's Triton kernels on a CUDA GPU; device=cpu has none")
        act = getattr(self.family.hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # Liger's SwiGLU computes SiLU whatever the config says
            raise Invalid(f"kernels=liger: Liger's SwiGLU kernel is SiLU(gate) x up; model.config.hidden_act={act}")
        require("kernels=liger", "Liger-Kernel's Triton kernels", ("liger_kernel", "triton"), LIGER)

    def apply(self, model: nn.Module, adapter: Adapter) -> nn.Module:
        if _on_fake_tensors(model):  # and its module-level rotary swap would reach the job's later traces
            raise RuntimeError("kernels=liger: Liger's Triton kernels cannot run on fake tensors (predict=trace)")
        from liger_kernel.transformers import LigerSwiGLUMLP, liger_rotary_pos_emb
        from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module

        # Liger's own per-instance patches (what its apply_liger_kernel_to_llama(model=...) does to a
        # built model): each module's forward rebound, its parameters and their names kept, so
        # peft's adapters, fp8's Linears and every path the other techniques use stay as they are.
        for module in model.modules():
            if isinstance(module, adapter.norms):
                _patch_rms_norm_module(module)
        for layer in adapter.layer_list(model):
            _patch_swiglu_module(getattr(layer, adapter.mlp), LigerSwiGLUMLP)
        # transformers' attention calls its module's apply_rotary_pos_emb, with no per-instance
        # hook: swapped in that module, as Liger does. A worker builds one model per process.
        sys.modules[adapter.attention_class(model).__module__].apply_rotary_pos_emb = liger_rotary_pos_emb
        return model

    def fused_parts(self) -> tuple[str, ...]:
        raise Unmodelled("kernels=liger: Liger's RMSNorm, SwiGLU and rotary kernels keep other tensors for "
                         "backward than the eager modules the analytic layer model counts")
