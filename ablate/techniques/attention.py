"""attention group: the kernel that computes attention, and so what it keeps for backward.

`sdpa` lets PyTorch's scaled_dot_product_attention pick its kernel per call. `flash`, `efficient`,
`cudnn` and `math` force one of SDPA's backends with torch.nn.attention.sdpa_kernel, around the
whole micro-step: a recompute in backward must pick the kernel its forward did, or non-reentrant
checkpointing finds other saved tensors. `eager` is the family's own attention in plain ops
(transformers' `eager`, nanoGPT's path in ablate's GPT-2), which keeps the (T, T) probabilities;
`flex` is transformers' FlexAttention path, whose compiled kernel keeps what flash does.

What each keeps (the predictor asks `saves`): the fused kernels keep their output and a
log-sum-exp per query and head, O(T); the math backend keeps the softmax's (B, heads, T, T)
output and scaled copies of q and k; eager keeps the probabilities too, with the family's own
extra copies (ablate/predict/layers.py counts them).
"""
from __future__ import annotations

import contextlib

from ablate.techniques import Invalid, Option, Plan, Unmodelled

FUSED, MATH, EAGER = "fused", "math", "eager"  # what the predictor is told a layer's attention keeps
CPU_ONES = "sdpa, math, eager"  # the options a CPU runs


def _sixteen_bit(plan: Plan) -> bool:
    """Whether the plan computes in a 16-bit dtype (autocast, or 16-bit parameters)."""
    return plan.autocast or plan.param_dtype != "fp32"


def _arch(family):
    """The family's sizes (predict/arch.Arch), or None where it has none to give."""
    try:
        return family.arch() if family is not None else None
    except Unmodelled:
        return None


class Sdpa(Option):
    """PyTorch's choice: SDPA picks flash, memory-efficient, cuDNN or math per call."""

    label = "SDPA"
    implementation = "sdpa"  # what the family builds: transformers' attn_implementation, GPT-2's path

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        """Wraps each micro-step's forward and backward."""
        return contextlib.nullcontext()

    def saves(self, arch, device: str, compute_bytes: int) -> str:
        """FUSED, MATH or EAGER: what a layer's attention keeps, for `arch` (predict/arch.Arch).
        CUDA has no fused kernel for fp32 with grouped-query heads (transformers passes
        enable_gqa=True where there is no mask and head_dim <= 256): flash and cuDNN take 16-bit
        inputs only and the memory-efficient kernel refuses grouped-query heads (torch's
        sdp_utils.cpp), so SDPA runs its math backend there. CPU's flash kernel takes both. fp32
        Mixtral at 4 x 512 tokens measured 5.9% over the fused prediction before this rule
        (benchmarks/results/NVIDIA-H200/moe.md)."""
        gqa_fp32 = (compute_bytes == 4 and arch.kind == "llama" and arch.kv_heads < arch.heads
                    and arch.head_dim <= 256)
        return MATH if device == "cuda" and gqa_fp32 else FUSED


class Backend(Sdpa):
    """One of SDPA's kernels, forced: `backend` = flash (FlashAttention-2), efficient
    (memory-efficient, xFormers'), cudnn (cuDNN's fused attention) or math (plain ops in C++).
    Saves: flash, efficient and cuDNN keep O(T) per head. Spends: math keeps (T, T) per head."""

    LABELS = {"flash": "FlashAttention-2", "efficient": "Memory-efficient SDPA", "cudnn": "cuDNN attention",
              "math": "Math SDPA"}

    def __init__(self, backend: str = "flash"):
        self.backend = backend

    @property
    def label(self) -> str:
        return self.LABELS.get(self.backend, self.backend)

    def check(self, plan: Plan) -> None:
        if self.backend not in self.LABELS:
            raise Invalid(f"attention.backend: {self.backend!r} is not one of {', '.join(self.LABELS)}")
        if self.backend == "math":
            return
        key = f"attention={self.backend}"
        if plan.device == "cpu":
            raise Invalid(f"{key} is a CUDA kernel: it needs a CUDA GPU, and device=cpu has none "
                          f"(on a CPU: attention={CPU_ONES.replace(', ', ',')})")
        if self.backend in ("flash", "cudnn") and not _sixteen_bit(plan):
            raise Invalid(f"{key} takes fp16 and bf16 inputs only; this precision computes in fp32 "
                          f"(precision=bf16,bf16_pure,fp16; or attention=efficient,math)")
        arch = _arch(self.family)
        if self.backend == "efficient" and arch is not None and arch.kv_heads < arch.heads:
            raise Invalid(f"{key}: the memory-efficient kernel takes no grouped-query heads "
                          f"({arch.kv_heads} key/value heads for {arch.heads} query heads): "
                          f"attention=flash,cudnn,math")
        if arch is not None and arch.head_dim > 256 and self.backend in ("flash", "cudnn"):
            raise Invalid(f"{key} takes head_dim <= 256; this model's is {arch.head_dim}")

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # torch only where a step runs

        names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
        return sdpa_kernel(getattr(SDPBackend, names[self.backend]))

    def saves(self, arch, device: str, compute_bytes: int) -> str:
        return MATH if self.backend == "math" else FUSED


class Eager(Sdpa):
    """The family's own attention in plain ops: scores, mask, softmax, dropout, weighted sum.
    Spends: the (B, heads, T, T) probabilities kept for backward, and the scores made on the way."""

    label = "Eager attention"
    implementation = "eager"

    def saves(self, arch, device: str, compute_bytes: int) -> str:
        return EAGER


class Flex(Sdpa):
    """transformers' FlexAttention path (torch.nn.attention.flex_attention, compiled to one Triton
    kernel): keeps what flash does. Only transformers' families have it."""

    label = "FlexAttention"
    implementation = "flex_attention"
    # torch.compile declines to compile under a dispatch mode, and the eager FlexAttention it would
    # fall back to is a higher-order op that makes the whole (B, heads, T, T) scores: not the step
    # that is measured.
    traceable = False

    def check(self, plan: Plan) -> None:
        if plan.device == "cpu":
            raise Invalid(f"attention=flex is compiled to a Triton kernel: it needs a CUDA GPU, and device=cpu has none "
                          f"(on a CPU: attention={CPU_ONES.replace(', ', ',')})")
        if self.family is not None and not getattr(self.family, "has_flex_attention", False):
            raise Invalid(f"attention=flex: model={getattr(self.family, 'name', '?')} has no FlexAttention path "
                          f"(transformers' families have; attention=sdpa,eager,flash,efficient,cudnn,math)")

    def saves(self, arch, device: str, compute_bytes: int) -> str:
        return FUSED
