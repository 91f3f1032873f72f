"""The LM head and the loss, played on a step's timeline (ablate/predict/timeline.py's Step).

The loss group's options (ablate/techniques/loss.py) differ here and nowhere else in the step: the
standard loss with its fp32 copy and log-softmax, the chunked loss slice by slice, and the standard
loss as compile=true fuses it on CUDA. Sizes in bytes, logits counted as elements (tokens x V).

loss=fused is played as loss=chunked: it makes in its forward what the chunked loss makes in its
backward, and the end of the loss's forward is the start of its backward, so the peak there is the
same (MemTracker measured them equal on CPU: tests/test_loss.py). It keeps the head's input (B x T
x C) no longer than its forward, which the chunked loss keeps for backward: where a step's peak
comes later in backward, the prediction is high by that much (gpt2 at 8 x 1024 in bf16: 12 MiB).
"""
from __future__ import annotations


class LossPlay:
    """Step's head and loss: forward from ln_f's output to the loss, backward from the loss to d
    ln_f out and the head's gradient. Uses the Step's timeline `tl`, `shapes`, `sizes`, compute
    bytes `c`, and its `keep` and `grad`."""

    def head_input(self) -> float:
        """ln_f's output, the head's input, kept for backward (on the host under activation offload);
        not by a frozen head, which needs it for no gradient of its own. A recompute wrapper
        around the head keeps it as ln_f made it, in the stream's dtype, frozen head or not."""
        if self.sizes.head_wrapped:
            return self.keep(self.shapes.sbh * self.r)
        return self.keep(self.shapes.sbh * self.sizes.head_input_bytes) if self.sizes.head_keeps_input else 0.0

    def head_cast_kept(self) -> float:
        """Autocast's cast of the head's weight, kept from forward for backward: not by the chunked
        loss, which casts for itself in forward and again in backward, nor by a recomputed head."""
        return 0.0 if self.sizes.loss_chunks > 1 or self.sizes.head_wrapped else self.keep(self.sizes.lm_head_cast)

    def head_remade(self) -> float:
        """What a recomputed head makes again for its backward: the casts of its weight and input
        (none without autocast), alive until its gradients are made."""
        if not self.sizes.head_wrapped:
            return 0.0
        return self.sizes.lm_head_cast + (self.shapes.sbh * self.c if self.r != self.c else 0.0)

    def slices(self) -> tuple[int, float]:
        """The loss's slices of the micro-batch's tokens: how many, and the largest one's logits
        as elements (tokens x V). The standard loss is one slice of every token.

        Each slice is played at the largest one's size and leaves the timeline as it found it, so
        the loss plays one: the next would reach the same peak with the same breakdown. (Under
        loss=cce a slice is one token: a plan would otherwise play tens of thousands a point.)"""
        n = min(self.sizes.loss_chunks, self.shapes.sb)
        return n, -(-self.shapes.sb // n) * self.shapes.vocab

    def logsumexp_temp(self, q: float) -> float:
        """A slice's logsumexp makes its fp32 logits less their row maxima (q elements) inside the
        op, then sums their exp in place: bytes the allocator holds a moment, unseen by MemTracker."""
        return q * 4 if self.sizes.op_temps else 0.0

    def padding(self) -> float:
        """Logits (elements) a padded head (GPT-2's pad_vocab_to) makes beyond the standard loss's
        tokens x V, in rows the loss slices off. The chunked loss multiplies by the tokens' rows only."""
        return self.shapes.sb * (self.shapes.padded_vocab - self.shapes.vocab)

    def loss_forward(self) -> None:
        """Logits in the compute dtype (as wide as the head: padding included) and their fp32
        copy, then what the loss makes of them. The standard loss keeps its log-softmax (fp32) for
        backward (on the host under offload); a chunked slice takes logsumexp (on CUDA one more
        fp32 slice-sized temporary, made inside the op) and keeps nothing."""
        tl, c = self.tl, self.c
        n, q = self.slices()
        made = q * c + (q * 4 if c != 4 else 0)
        if n == 1 and self.sizes.compiled:  # fused: the logits alone, kept for backward (and returned)
            tl.alloc("activations", self.keep((q + self.padding()) * c))
            return
        if n == 1:
            made += self.padding() * c
            tl.alloc("activations", made)
            tl.alloc("activations", self.keep(q * 4))
            tl.free("activations", made)
            return
        self.forward_slice(q)  # one slice's play is all n's (slices)

    def forward_slice(self, q: float) -> None:
        """A chunked slice's forward: its compute-dtype logits go once copied to fp32, before
        logsumexp's temporary; nothing stays."""
        tl, c = self.tl, self.c
        made = q * c + (q * 4 if c != 4 else 0)
        tl.alloc("activations", made)
        tl.free("activations", made - q * 4)
        tl.transient("activations", self.logsumexp_temp(q))
        tl.free("activations", q * 4)

    def loss_backward(self) -> None:
        """Loss -> log-softmax -> logits -> head: gradients of the head's input (d ln_f out,
        `other` until it becomes d x_L) and of its weight. A tied head's share of the embedding
        gradient waits in autograd's buffer (a temporary) until the embedding's share is added;
        only then does it become wte.grad. An untied head's gradient is its own at once."""
        tl, shapes, sizes, c, keep = self.tl, self.shapes, self.sizes, self.c, self.keep
        n, q = self.slices()
        head = sizes.grads[shapes.lm_head] if shapes.lm_head else sizes.grads[shapes.embedding]
        if n > 1:
            return self.chunked_backward(q, head)
        if sizes.compiled:
            return self.compiled_loss_backward(q, head)
        back = q * 4 - keep(q * 4)  # an offloaded log-softmax, copied back for its backward
        tl.alloc("activations", back)
        tl.alloc("other", 2 * q * 4)  # d log-softmax, d logits
        tl.free("activations", keep(q * 4) + back)
        tl.free("other", q * 4)
        if c != 4:
            tl.transient("other", q * c)
        # a padded head's: the sliced logits' gradient, padded back to its rows for the matmuls
        padded = (q + self.padding()) * c if self.padding() else 0
        tl.alloc("other", padded)
        tl.alloc("activations", self.head_remade())
        tl.alloc("other", shapes.sbh * c)  # d ln_f out
        self.grad(head, shapes.lm_head) if shapes.lm_head else tl.alloc("other", head)
        tl.free("activations", self.head_remade())
        tl.free("other", q * 4 + padded)

    def compiled_loss_backward(self, q: float, head: float) -> None:
        """compile=true on CUDA, the standard loss: inductor fuses log-softmax and its backward, so
        neither the fp32 copy nor the log-softmax exists; forward kept the logits (compute dtype).
        Backward holds them with the zero gradient autograd makes for the logits the model
        returns (the step drops them) and their own gradient: 3 x c bytes per logit, as inductor's
        generated code for this graph shows on a CPU. On an H200 gpt2 (vocabulary 50,257) held a
        fourth: both compiled peaks came 4 x c bytes per logit under the eager ones (within 0.05%),
        where this model says 6 x c. Inferred, not yet seen: it is the gradient padded for the
        head's matmuls by inductor's pad_mm, which aligns a matmul's dims on GPUs (to 8 elements
        in 16-bit, 4 in fp32) and 50,257 is not aligned. The vocabulary padded to 50,304 is the
        check: the next GPU run's compiled snapshot (benchmarks/results/NVIDIA-H200/README.md).
        A head padded to aligned rows (model.pad_vocab_to=64) needs no pad_mm: inductor's code for
        its sliced loss on a CPU writes the logits' gradient over the kept padded logits' buffer,
        and feeds that to the matmuls. So it is taken to hold the three, the kept logits as wide as
        the head's rows; not yet seen on a GPU."""
        tl, shapes, sizes, c, keep = self.tl, self.shapes, self.sizes, self.c, self.keep
        kept = (q + self.padding()) * c  # the head's logits, as forward kept them
        padded = kept if sizes.pad_head else 0  # d logits padded for the matmuls (pad_mm's, or the sliced loss's)
        grads = 2 * q * c + padded
        tl.alloc("activations", kept - keep(kept))  # an offloaded one, back from the host
        tl.alloc("other", grads)
        tl.free("activations", kept)
        tl.free("other", grads - padded)  # the padded one feeds the matmuls
        tl.alloc("activations", self.head_remade())
        tl.alloc("other", shapes.sbh * c)  # d ln_f out
        self.grad(head, shapes.lm_head) if shapes.lm_head else tl.alloc("other", head)
        tl.free("activations", self.head_remade())
        tl.free("other", padded)

    def chunked_backward(self, q: float, head: float) -> None:
        """loss=chunked: d ln_f out and the weight's gradient allocated whole, the weight cast once
        under autocast, then slice by slice the logits recomputed and turned into their gradient
        in place, multiplied into both (under autocast the weight's share is made in the compute
        dtype, then added)."""
        tl, shapes, sizes, c = self.tl, self.shapes, self.sizes, self.c
        tl.alloc("other", shapes.sbh * c + head + sizes.lm_head_cast)
        self.backward_slice(q)  # one slice's play is all n's (slices)
        tl.free("other", sizes.lm_head_cast)
        if shapes.lm_head:
            tl.free("other", head)
            self.grad(head, shapes.lm_head)

    def backward_slice(self, q: float) -> None:
        """A chunked slice's backward: its logits recomputed, turned into their gradient in place
        and multiplied into d ln_f out and the head's gradient; nothing stays."""
        tl, c = self.tl, self.c
        made = q * c + (q * 4 if c != 4 else 0)
        tl.alloc("other", made)
        tl.free("other", made - q * 4)  # the fp32 logits stay, to become their gradient
        tl.transient("other", self.logsumexp_temp(q))
        if c != 4:  # ... cast to the compute dtype for the matmuls
            tl.alloc("other", q * c)
            tl.free("other", q * 4)
        tl.transient("other", self.sizes.lm_head_cast)  # the weight's share in the compute dtype (autocast)
        tl.free("other", q * c if c != 4 else q * 4)
