"""loss group: how the LM head and the cross-entropy turn the last hidden states into the loss.

The loss is where a small model's largest tensors live: GPT-2's 50,257-token head at batch 8 x seq
1024 makes (B, T, vocab) logits of 1.5 GiB in fp32, and the standard path keeps their log-softmax
for backward and makes two gradients of that size in it. `chunked` never lets them exist whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ablate.techniques import Invalid, Option, Plan


class Standard(Option):
    """The model's own head over the whole batch: (B, T, vocab) logits, their fp32 copy and the
    log-softmax (kept for backward) all alive at once, then two gradients of that size in backward."""

    label = "Standard cross-entropy"
    chunks = 1  # what the predictor reads: the logits exist whole
    from_hidden = False  # the model's own logits, not its hidden states and head
    recompute_fraction = 0.0  # share of the forward's matmul FLOPs run again in backward (for HFU)

    def attach(self, model: nn.Module, adapter) -> None:
        """Nothing to change: the model computes its logits and loss itself."""


class Chunked(Standard):
    """The LM head and the cross-entropy over `chunks` slices of the batch's tokens, each slice's
    logits freed at once and recomputed in backward. Saves: the whole (B, T, vocab) logits, their
    fp32 copy, log-softmax and gradients (at most one slice's are alive: 1/chunks of them), and
    the head weight's gradient is summed in place into one buffer instead of out of place per use.
    Spends: the head's matmul once more in backward (2·B·T·vocab·hidden FLOPs).

    Written as a torch autograd Function (_ChunkedCrossEntropy) rather than a fused Triton kernel
    (Liger-Kernel's fused linear cross-entropy needs Triton, so a GPU), so that it runs on the CPU
    as on a GPU, under every precision and parallel option. The model hands it its final hidden
    states and its head (`model.loss_fn`), so it works for every family whose head is a plain
    linear layer."""

    label = "Chunked cross-entropy"
    from_hidden = True

    def __init__(self, chunks: int = 8):
        self.chunks = chunks

    def check(self, plan: Plan) -> None:
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise Invalid(f"loss.chunks={self.chunks!r} must be a positive integer")
        tokens = plan.batch_size // max(plan.accumulation_steps, 1) * plan.seq_len
        if self.chunks > tokens:
            raise Invalid(f"loss.chunks={self.chunks} > the {tokens} tokens of a micro-batch: "
                          f"a chunk would be empty")

    def attach(self, model: nn.Module, adapter) -> None:
        model.loss_fn = self
        # The head's matmul runs again in backward: its share of the matmul weights, as the
        # checkpoint options count theirs (ablate/techniques/checkpoint.py).
        head = model.get_submodule(adapter.lm_head).weight.numel()
        self.recompute_fraction = head / adapter.matmul_weights([model])

    def __call__(self, hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                 vocab: int | None = None) -> torch.Tensor:
        """Mean cross-entropy of head(hidden) against targets, summed in fp32 as the standard loss
        is. hidden: (B, T, C) after the final norm; targets: (B, T); vocab: the head's first rows
        that are tokens (a padded head's others are left out of the softmax), None for all. The
        head's weight and bias go in, not the module: what hooks modules once per forward
        (MemTracker, FSDP) sees no call."""
        h, y = hidden.flatten(0, 1), targets.flatten()  # (N, C), (N,)
        return self.mean_loss(h, head.weight, head.bias, y, vocab or head.weight.size(0))

    def mean_loss(self, h, weight, bias, y, vocab: int) -> torch.Tensor:
        """h (N, C), y (N,): the mean loss, its gradients made in backward (recomputed)."""
        return _ChunkedCrossEntropy.apply(h, weight, bias, y, self.chunks, vocab) / y.numel()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of h (N, C) @ weight[:vocab].T + bias[:vocab] against y (N,), slice by
    slice (weight (V, C) with V >= vocab: a padded head's last rows stay out of the softmax).
    Forward keeps only its inputs; backward recomputes each slice's logits and turns them into
    their gradient in place (softmax - one-hot), so one slice's (n, V) logits are alive at a time.
    Under autocast the matmuls run in its dtype, as the head's would: the Function casts itself
    (autocast does not reach inside it) and takes logsumexp in fp32."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunks, vocab):
        dtype = _compute_dtype(h.device.type, weight.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            w, b = _rows(weight, bias, vocab, dtype)
            for hs, ys in zip(h.chunk(chunks), y.chunk(chunks)):
                total += _slice_loss(hs.to(dtype), w, b, ys)
        ctx.save_for_backward(h, weight, bias, y)
        ctx.dtype, ctx.chunks, ctx.vocab = dtype, chunks, vocab
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, bias, y = ctx.saved_tensors
        grad_h = torch.empty_like(h)  # (N, C)
        # (V, C), summed in place over the slices; none for a frozen head (adapters: peft)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        grad_w, grad_b = _rows(grad_weight, grad_bias, ctx.vocab)  # its token rows: padding's stay 0
        with torch.autocast(h.device.type, enabled=False):
            w, b = _rows(weight, bias, ctx.vocab, ctx.dtype)
            for hs, ys, dh in zip(h.chunk(ctx.chunks), y.chunk(ctx.chunks), grad_h.chunk(ctx.chunks)):
                _slice_loss(hs.to(ctx.dtype), w, b, ys, (grad_total, dh, grad_w, grad_b))
        return grad_h, grad_weight, grad_bias, None, None, None


def _slice_loss(hs, w, b, ys, grads=None) -> torch.Tensor:
    """One slice's summed loss (fp32, 0-d) from hs (n, C) @ w.T + b in the compute dtype, against
    ys (n,); with grads = (scale, dh, grad_w, grad_b), its gradients too: its fp32 logits (n, V)
    turned in place into (softmax - one-hot) x scale, cast to the compute dtype, then d hidden
    written into dh (n, C) and the head's weight (V, C) and bias gradients summed into grad_w,
    grad_b. A function of its own so that the slice's logits die on return: a loop's variable
    kept them alive through the next slice's matmul and fp32 copy (one more slice of bytes at
    the loss's peak: 786 MiB for gpt2 at micro-batch 64 x 1024 in 8 slices)."""
    logits = F.linear(hs, w, b).float()  # (n, V)
    lse = logits.logsumexp(-1, keepdim=True)  # (n, 1)
    loss = (lse.squeeze(1) - logits.gather(1, ys[:, None]).squeeze(1)).sum()
    if grads is None:
        return loss
    scale, dh, grad_w, grad_b = grads
    logits -= lse
    logits.exp_()  # softmax
    logits[torch.arange(len(ys), device=logits.device), ys] -= 1
    logits *= scale
    g = logits.to(hs.dtype)  # (n, V) d logits for the matmuls
    del logits  # in 16-bit its fp32 bytes go now, before the matmuls (fp32: g is the same tensor)
    dh[:] = g @ w
    if grad_w is None:  # a frozen head
        pass
    elif grad_w.dtype == hs.dtype:  # (V, C), summed in place
        grad_w.addmm_(g.t(), hs)
    else:  # autocast: the slice's share in the compute dtype, added into the parameter dtype
        grad_w += g.t() @ hs
    if grad_b is not None:
        grad_b += g.sum(0)
    return loss


class Fused(Chunked):
    """The chunked loss with its gradients made in forward, slice by slice, as Liger-Kernel's
    fused linear cross-entropy makes them: the loss is the step's last operation, so backward only
    scales them by the loss's incoming gradient. Saves what the chunked loss saves, and its
    recompute: the head's matmul runs once, not twice (for gpt2, about 10% of a step's FLOPs).
    Spends: d hidden (B·T·C) and the head's gradient exist from the loss's forward on, not from
    its backward, moments apart (the peak is the same where it is in backward). Under
    precision=fp16 the gradients would be made before the GradScaler scales the loss, where
    fp16's range flushes the small ones to zero: loss=chunked there. Without grad mode (eval) it
    makes no gradient."""

    label = "Fused cross-entropy"

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.grad_scaler:
            raise Invalid("loss=fused makes its gradients in forward, before the GradScaler's scale: fp16 would "
                          "flush them to zero; use loss=chunked with precision=fp16")

    def attach(self, model: nn.Module, adapter) -> None:
        model.loss_fn = self  # nothing recomputed: recompute_fraction stays 0

    def mean_loss(self, h, weight, bias, y, vocab: int) -> torch.Tensor:
        """h (N, C), y (N,): the mean loss, its gradients made now where backward will want them."""
        grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        return _FusedCrossEntropy.apply(h, weight, bias, y, self.chunks, vocab, grads)


class _FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h (N, C) @ weight[:vocab].T + bias[:vocab] against y (N,), with the
    gradients of h, weight and bias made slice by slice in forward, for a loss gradient of 1, and
    kept on ctx (intermediates, not save_for_backward: activation offload's hooks would copy them
    to the host and back); backward scales them in place by the loss's incoming gradient."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunks, vocab, grads):
        dtype = _compute_dtype(h.device.type, weight.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if grads else None  # (N, C)
        # (V, C), summed in place over the slices; none for a frozen head (adapters: peft)
        grad_weight = torch.zeros_like(weight) if grads and weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if grads and bias is not None and bias.requires_grad else None
        grad_w, grad_b = _rows(grad_weight, grad_bias, vocab) if grads else (None, None)  # padding's rows stay 0
        with torch.autocast(h.device.type, enabled=False):
            w, b = _rows(weight, bias, vocab, dtype)
            for hs, ys, dh in zip(h.chunk(chunks), y.chunk(chunks), grad_h.chunk(chunks) if grads else [None] * chunks):
                total += _slice_loss(hs.to(dtype), w, b, ys, (1.0 / len(y), dh, grad_w, grad_b) if grads else None)
        ctx.grads = (grad_h, grad_weight, grad_bias)
        return total / len(y)

    @staticmethod
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        return *(None if g is None else g.mul_(grad_loss) for g in grads), None, None, None, None


def _rows(weight: torch.Tensor | None, bias: torch.Tensor | None, vocab: int, dtype: torch.dtype | None = None):
    """The head's first `vocab` rows (views, no copy) of its weight (V, C) and bias (V,), cast to
    `dtype` when given (a copy of those rows only)."""
    w, b = None if weight is None else weight[:vocab], None if bias is None else bias[:vocab]
    return (w, b) if dtype is None else (w.to(dtype), None if b is None else b.to(dtype))


def _compute_dtype(device_type: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's matmul would run in: autocast's, inside it; else the parameters'."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else param_dtype
