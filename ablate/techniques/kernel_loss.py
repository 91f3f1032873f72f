"""loss=liger and loss=cce: the LM head and cross-entropy as other libraries' kernels. Each takes the
final hidden states and the head's weight, as ablate's chunked loss does (`attach` sets the model's
`loss_fn`), and never makes the whole (B, T, vocab) logits.

- `liger`: Liger-Kernel's fused linear cross-entropy (Triton): the tokens in slices whose logits
  are about as large as the hidden states, each slice's gradients made in forward, in place over its
  logits. What `loss=fused` does in PyTorch ops.
- `cce`: Apple's Cut Cross-Entropy. `loss.impl=cce` (Triton): the log-sum-exp of each token over the
  vocabulary in on-chip tiles, forward and again in backward, so no logit ever reaches device
  memory. `loss.filter_eps`: skip the logits' gradients below it (the package's `auto` is the
  compute dtype's resolution / 32), off by default. `loss.impl=torch_compile`: the package's
  PyTorch path, compiled by inductor, which runs on a CPU and makes the whole logits.
"""
from __future__ import annotations

import platform
import sys

import torch

from ablate.techniques import Invalid, Plan, Unmodelled
from ablate.techniques.kernels import LIGER, require
from ablate.techniques.loss import Chunked, Fused, _compute_dtype


class Liger(Fused):
    """Liger-Kernel's fused linear cross-entropy (CUDA, Triton): ceil(vocab / hidden) slices of the
    tokens, Liger's rule (each slice's tokens rounded up to a power of two), each slice's logits
    turned in place into their gradient in the compute dtype, d hidden and the head's gradient
    summed in forward. Saves: the whole logits, their fp32 copy, log-softmax and gradients, and the
    head's second matmul. Spends: d hidden and the head's gradient from the loss's forward on."""

    label = "Liger fused cross-entropy"

    def __init__(self) -> None:  # no keys: Liger picks its own slices
        pass

    @property
    def chunks(self) -> int:
        """The predictor's question (its slices of the micro-batch's tokens): played as loss=fused,
        which the analytic model plays as loss=chunked (the same peak). Liger bounds a slice's logits
        to about the hidden states' elements: ceil(vocab / hidden) slices. Its slices are that
        many or, each rounded up to a power of two tokens, up to half as many and twice as large:
        the model is low by at most one slice (about B·T·hidden logits). In 16 bits it is high by
        one slice's fp32 copy, which Liger, working in place in the compute dtype, never makes."""
        if self.family is None:
            raise Unmodelled("loss=liger: its slices follow the model's vocabulary and hidden size")
        arch = self.family.arch()  # Unmodelled for a family without sizes
        return -(-arch.vocab // arch.hidden)

    def check(self, plan: Plan) -> None:
        if plan.device == "cpu":  # the job's device auto leaves the device to the worker's check
            raise Invalid("loss=liger needs Liger-Kernel's Triton kernels on a CUDA GPU; device=cpu has none")
        if plan.grad_scaler:
            raise Invalid("loss=liger makes its gradients in forward, before the GradScaler's scale: fp16 would "
                          "flush them to zero; use loss=cce or loss=chunked with precision=fp16")
        require("loss=liger", "Liger-Kernel's Triton kernels", ("liger_kernel", "triton"), LIGER)

    def mean_loss(self, h, weight, bias, y, vocab: int) -> torch.Tensor:
        """h (N, C), y (N,): the mean loss over the head's first `vocab` rows (autocast applies
        inside, as Liger's forward is autocast's custom_fwd)."""
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(h, weight[:vocab], y, None if bias is None else bias[:vocab])


CCE = "pip install cut-cross-entropy, or -e '.[kernels]' in ablate's repository"


class CutCrossEntropy(Chunked):
    """Apple's Cut Cross-Entropy: `impl` = cce (CUDA, Triton: no logit in device memory, the
    head's matmul run again in backward) or torch_compile (the package's PyTorch path under
    inductor, which runs on a CPU: the whole logits, inductor fusing their softmax). Saves (cce):
    the whole logits, their fp32 copy, log-softmax and gradients. Spends: the head's matmul again
    in backward.

    `filter_eps` (impl=cce) skips the backward's tiles whose softmax is below it: `auto` is the
    package's default, the compute dtype's resolution / 32 (bf16: 2.4e-4). Off here (None), so
    that the loss is the other loss options' and a row's loss and time compare with theirs: from
    a random start every softmax is about 1 / vocab, below that threshold, so `auto` drops all
    but the target's gradient and skips most of the backward's matmuls. Even unfiltered the loss
    is not quite the others': the package sums d hidden and the head's gradient across its tiles
    in the 16-bit compute dtype (docs/techniques.md has the measured gap)."""

    label = "Cut cross-entropy"
    IMPLS = ("cce", "torch_compile")
    FILTERS = ("auto", "high")  # the package's names for its threshold; a number is one too
    key_labels = {("filter_eps", f): "Cut cross-entropy, gradients filtered" for f in FILTERS}

    def __init__(self, impl: str = "cce", filter_eps: float | str | None = None):
        self.impl = impl
        self.filter_eps = filter_eps

    @property
    def chunks(self) -> int:
        """The predictor's question. impl=cce: played as loss=chunked with one token a slice (the
        model caps its slices at the micro-batch's tokens), so no logits but one token's row. The
        rest is the chunked loss's backward: d hidden and the head's gradient made whole (CCE makes
        them in the compute dtype, then casts them to the parameters'), and no copy of the head's
        weight kept (CCE casts it tile by tile). Under autocast the model misses d hidden's fp32
        cast, B·T·hidden x 4 bytes for a moment. impl=torch_compile: inductor's loss over the
        whole logits, which the model plays only for compile=true on CUDA."""
        if self.impl == "torch_compile":
            raise Unmodelled("loss=cce loss.impl=torch_compile: inductor's loss over the whole logits, which the "
                             "analytic model plays only for compile=true on CUDA")
        return sys.maxsize

    def check(self, plan: Plan) -> None:
        if self.impl not in self.IMPLS:
            raise Invalid(f"loss.impl={self.impl!r} is not one of {', '.join(self.IMPLS)}")
        eps = self.filter_eps
        number = isinstance(eps, (int, float)) and not isinstance(eps, bool)
        if eps is not None and not (eps in self.FILTERS or (number and eps >= 0)):
            raise Invalid(f"loss.filter_eps={eps!r} is not one of null (every gradient kept), "
                          f"{', '.join(self.FILTERS)} or a threshold >= 0")
        if eps is not None and self.impl != "cce":
            raise Invalid(f"loss.filter_eps={eps!r} filters loss.impl=cce's backward; loss.impl={self.impl} keeps "
                          f"every gradient: loss.filter_eps=null")
        if self.impl == "cce" and plan.device == "cpu":
            raise Invalid("loss=cce loss.impl=cce runs Cut Cross-Entropy's Triton kernels on a CUDA GPU; "
                          "device=cpu has none: loss.impl=torch_compile is its CPU path")
        if self.impl == "cce" and not plan.autocast and plan.param_dtype == "fp32":
            raise Invalid("loss=cce loss.impl=cce: its backward kernel takes 16-bit hidden states, and this "
                          "precision computes in fp32: precision=bf16,bf16_pure,fp16, or loss.impl=torch_compile")
        # The package imports its Triton kernels on Linux whatever the impl (macOS has none).
        triton = () if self.impl == "torch_compile" and platform.system() == "Darwin" else ("triton",)
        require(f"loss=cce loss.impl={self.impl}", "Cut Cross-Entropy (whose package imports Triton on Linux)",
                ("cut_cross_entropy", *triton), CCE)

    def attach(self, model, adapter) -> None:
        if model.get_submodule(adapter.lm_head).bias is not None:
            raise Invalid("loss=cce: Cut Cross-Entropy takes a head without a bias; this model's has one "
                          "(loss=liger, chunked or fused take it)")
        if self.impl == "cce":  # its backward runs the head's matmul again, tile by tile: counted for HFU
            super().attach(model, adapter)
        else:  # inductor keeps the logits for backward: nothing run again
            model.loss_fn = self

    def mean_loss(self, h, weight, bias, y, vocab: int) -> torch.Tensor:
        """h (N, C), y (N,): the mean loss over the head's first `vocab` rows. impl=cce's backward
        takes 16-bit hidden states: h in the compute dtype (autocast reaches no Triton kernel);
        the weight goes as it is, its tiles cast inside."""
        from cut_cross_entropy import linear_cross_entropy

        if self.impl != "cce":
            return linear_cross_entropy(h, weight[:vocab], y, impl=self.impl)
        e = h.to(_compute_dtype(h.device.type, weight.dtype))
        return linear_cross_entropy(e, weight[:vocab], y, impl=self.impl, filter_eps=self.filter_eps)
