"""One training step played as allocations and frees: the analytic model's bookkeeping.

ablate/predict/analytic.py works out one rank's sizes (`Sizes`); `Step` plays them in the order a
real step allocates and frees them (forward block by block, backward in reverse with recompute,
FSDP's all-gathers and reduce-scatters, the optimizer step, zero_grad), so the peak is where the
real one is and the breakdown at the peak is comparable with MemTracker's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ablate.predict.grad_play import GradPlay
from ablate.predict.head_and_loss import LossPlay
from ablate.predict.ledger import Timeline
from ablate.predict.sizes import Sizes
from ablate.techniques import Unmodelled  # noqa: F401  (the predictor's callers import it from here)

if TYPE_CHECKING:
    from ablate.predict.shapes import Shapes

class Step(LossPlay, GradPlay):
    """One optimizer step (every micro-step's forward and backward, then the optimizer step)
    played on a Timeline, optimizer states already allocated. Bytes on one rank.

    Categories follow MemTracker: tensors made in forward (and recomputed ones) are activations,
    other tensors made in backward are "other", optimizer-step temporaries count as "optimizer",
    FSDP's all-gathered parameters are parameters."""

    def __init__(self, shapes: Shapes, sizes: Sizes):
        self.shapes, self.sizes, self.tl = shapes, sizes, Timeline()
        self.c, self.r = sizes.compute_bytes, sizes.stream_bytes
        # ln_f's 4-byte copy of a 16-bit x_L (CUDA autocast; RMSNorm always), unless ln_f is recomputed
        self.ln_copy = 0.0 if sizes.ln_f_recomputed else shapes.sbh * (sizes.norm_bytes - sizes.stream_bytes)
        self.block_names = shapes.layer_names
        in_layers = {n for names in shapes.layer_names for n in names}
        self.root_names = [n for n in sizes.grads if n not in in_layers]
        self.have_grads = False
        self.pending: tuple[str, float] | None = None  # grad_lag: the gradient the next one's arrival steps
        self.copying = 0.0  # offload_ahead: the last layer's saved tensors, still on the device

    def keeps_cast(self, saved: float) -> bool:
        """Whether a block's cast weights stay on the device from its forward to its backward:
        not when the whole block is recomputed (Korthikanti's full recompute: `saved` is 0), nor
        when saved tensors go to the host, nor when the layer's recompute keeps only op outputs.
        (A block partly recomputed by wrappers inside it is counted as keeping them.)"""
        return saved > 0 and not self.sizes.offload_acts and not self.sizes.casts_recomputed

    def uncached_cast(self, saved: float) -> float:
        """A block's casts of frozen weights inside a recompute wrapper, which neither autocast's cache
        nor a saved tensor holds: gone once the wrapped part has run (its whole layer's where `saved` is 0)."""
        return self.sizes.frozen_cast if saved == 0 else self.sizes.frozen_sublayer_cast

    def keep(self, nbytes: float) -> float:
        return 0.0 if self.sizes.offload_acts else nbytes  # save_on_cpu: saved tensors live on the host

    def play(self, batch_tokens: int) -> Timeline:
        tl, sizes, steps = self.tl, self.sizes, self.sizes.micro_steps
        tl.alloc("params", sizes.params)
        tl.alloc("optimizer", sizes.states)
        tl.alloc("other", sizes.other)
        tl.alloc("activations", batch_tokens * 8 * 2)  # int64 inputs and targets of the whole batch
        for k in range(steps):
            self.forward()
            self.backward(sync=sizes.sync_each or k == steps - 1)  # FSDP: reduce-scatter now, or keep whole grads
            self.have_grads = True
        self.step_pending()  # the last gradient of a lagging in-backward option: step() steps it
        tl.transient("optimizer", sizes.step_temp)
        tl.free("grads", tl.now["grads"])  # zero_grad(set_to_none=True)
        return tl

    def forward(self) -> None:
        tl, shapes, sizes, r, keep = self.tl, self.shapes, self.sizes, self.r, self.keep
        sbh = shapes.sbh
        self.gather(sizes.root, "activations")
        # Embedding outputs (x0 = wte(idx) + wpe(pos) with learned positions): the residual stream (B, T, C).
        tl.transient("activations", sizes.embed_temp)
        tl.alloc("activations", keep(sbh * r) + sizes.rotary)
        copying = 0.0  # the previous layer's saved tensors, on their way to the host (offload_ahead)
        for saved, full in sizes.blocks:
            self.gather(sizes.block, "activations")
            tl.alloc("activations", sizes.block_cast)
            tl.transient("activations", min(full - saved, sizes.inner_temp))  # made and dropped inside
            # the scores beside the probabilities, whether the checkpoint keeps them or not
            tl.transient("activations", sizes.attn_saved + sizes.attn_forward_temp if sizes.attn_forward_temp else 0.0)
            tl.alloc("activations", keep(saved) + keep(sbh * r))  # kept + the block output
            attention_first = not sizes.mlp_alone and saved > 0  # a wrapped attention's go before the MLP runs
            tl.free("activations", self.uncached_cast(saved) if attention_first else 0.0)
            tl.transient("activations", sizes.forward_temp + sizes.forward_tail)  # with all the layer keeps alive
            tl.free("activations", 0.0 if attention_first else self.uncached_cast(saved))
            if sizes.offload_ahead >= 0:
                tl.alloc("activations", saved + sbh * r)
                tl.free("activations", copying)
                copying = saved + sbh * r
            if sizes.reshard:
                self.release(sizes.block)
        self.copying = copying  # no layer follows to wait for the last one's copies: they go in backward
        # ln_f statistics and output (the head's input), then the head and the loss.
        tl.alloc("activations", keep(sizes.ln_f_stats + self.ln_copy) + self.head_input() + sizes.lm_head_cast)
        tl.alloc("activations", sizes.ln_f_out_held)
        self.loss_forward()
        tl.free("activations", sizes.ln_f_out_held)
        # Autocast's cache goes with the forward: casts backward does not need on the device with it.
        tl.free("activations", sum((sizes.block_cast if not self.keeps_cast(saved) else sizes.sublayer_cast)
                                   - self.uncached_cast(saved) for saved, _ in sizes.blocks)
                + sizes.lm_head_cast - self.head_cast_kept())
        if sizes.reshard:  # the root's forward ends with the loss; its backward gathers it again
            self.release(sizes.root)

    def backward(self, sync: bool) -> None:
        tl, shapes, sizes, c, r, keep = self.tl, self.shapes, self.sizes, self.c, self.r, self.keep
        sbh, wte = shapes.sbh, sizes.grads[shapes.embedding]
        if sizes.reshard:
            self.gather(sizes.root, "other")
        self.loss_backward()
        tl.free("activations", self.copying)
        self.copying = 0.0
        # What the head saved (its weight's cast, unless chunked; its input, ln_f's output), and of it on the device.
        if sizes.head_wrapped:  # a recomputed head's: its input alone (its casts are made again)
            saved = sbh * r
        else:
            saved = (sizes.lm_head_cast if sizes.loss_chunks == 1 else 0.0) \
                + sbh * sizes.head_input_bytes * sizes.head_keeps_input
        on_device = self.head_cast_kept() + self.head_input()
        tl.transient("activations", saved - on_device)  # back from the host
        tl.free("activations", on_device)  # the head's backward has run
        tl.alloc("activations", sizes.ln_f_remade)  # recomputed for its backward, beside its gradients
        tl.transient("other", sizes.final_norm_backward_temp)
        tl.free("activations", sizes.ln_f_remade)
        tl.free("activations", keep(self.sizes.ln_f_stats + sbh * r + self.ln_copy))  # and x_L
        tl.alloc("other", sbh * r)  # d x_L (replaces d ln_f out)
        tl.free("other", sbh * c)
        for i in reversed(range(shapes.layers)):
            saved, full = self.sizes.blocks[i]
            if sizes.reshard:
                self.gather(sizes.block, "other")
            ahead = sum(s + sbh * r for s, _ in sizes.blocks[max(i - sizes.offload_ahead, 0):i]) \
                if sizes.offload_ahead > 0 else 0.0  # the next layers' saved tensors, fetched early
            tl.alloc("activations", ahead)
            back = full - saved + (saved if self.sizes.offload_acts else 0)  # recomputed, or copied back from the host
            # cast again (attention's alone, where only it is recomputed), or copied back
            back += (self.sizes.sublayer_cast if self.keeps_cast(saved) else self.sizes.block_cast) - sizes.tiled_cast
            back += sizes.mlp_input_remade if full > saved else 0.0
            early, later = 0.0, 0.0  # kept bytes freed before the recompute; recomputed after the second norm's backward
            mlp = [n for n in self.block_names[i] if n in shapes.mlp_names]
            # the output projection's gradients come first: its backward runs before the activation's.
            # A tiled MLP's are summed slice by slice (in the compute dtype where autocast casts the
            # weights) and become gradients after the last (cast up, or the sums themselves)
            first = [] if sizes.tiled_mlp else [n for n in mlp if n in shapes.mlp_out_names]
            summed = {n: shapes.param_numels[n] * c if sizes.tiled_cast else sizes.grads[n]
                      for n in mlp if n not in shapes.frozen} if sizes.tiled_mlp else {}
            adding = self.adds_into_kept()
            inner = sizes.inner_temp_adding if adding and sizes.inner_temp_adding is not None else sizes.inner_temp
            # the projection's backward asks for its input: a layer recomputed beside its MLP is recomputed
            # first (a tiled MLP's slices make their own input again, but a post-norm on their output asks too)
            remade_first = sizes.recompute_with_mlp and full > saved
            recomputed_first = remade_first and not sizes.tiled_mlp
            if not remade_first or sizes.mlp_alone:  # a post-norm outside the MLP's wrapper goes first
                self.out_norm_backward()
            if not recomputed_first:
                self.out_proj_grads(first)
            if sizes.recompute_with_mlp:  # the whole layer, or its MLP, recomputed before the MLP's backward
                tl.alloc("other", sizes.recompute_grads if full > saved else 0.0)
                tl.alloc("activations", back)
                if full > saved:  # what the recomputed forward makes and drops
                    tl.transient("activations", self.recompute_temp())
                tl.free("other", sizes.recompute_grads if full > saved else 0.0)
                if remade_first and not sizes.mlp_alone:
                    self.out_norm_backward()
                if recomputed_first:
                    self.out_proj_grads(first)
                    # the output projection's weight, cast again by the MLP's recompute, goes with its backward
                    tl.free("activations", sizes.out_proj_cast)
                    back -= sizes.out_proj_cast
                remade = full > saved and not sizes.mlp_alone
                self.mlp_backward(inner, summed, remade)
                if sizes.tiled_mlp:  # its input, made again around the slices or kept for them, went with the last
                    tl.free("activations", sbh * r if remade else keep(sbh * r))
                    back -= sbh * r if remade else 0.0
                    early = 0.0 if remade else keep(sbh * r)
                self.expert_grads(adding)
            else:  # only attention or norms: recomputed when backward reaches them, after the MLP's,
                self.mlp_backward(inner, summed, False)  # whose saved tensors are gone by then
                self.expert_grads(adding)
                early = keep(sizes.mlp_saved + (sbh * r if sizes.tiled_mlp else 0.0))  # a tiled MLP's: its input
                tl.free("activations", early)
                later = min(back, sizes.attn_later + sizes.sublayer_cast - sizes.tiled_cast)  # attention's own, made in its turn
                tl.alloc("activations", back - later)
            # after the MLP's backward (its saved tensors gone, its weights' gradients made): the second
            # norm's fp32 gradients, then attention's (T, T) ones, recomputed on its own only now
            # A SwiGLU's input projections make their weights' gradients after its activation's
            # backward: its saved tensors are gone by then, the gradients of gate's and up's
            # outputs alive. In a later micro-step each new gradient is added into the kept one,
            # briefly both: Phi-3's one gate_up weight makes that moment its step's peak where
            # micro-batches are short, unless counted so (1.2% over, tiny Phi-3 at 128 tokens)
            # A mixture's expert weights make their gradients at moments its inner temp counts (with
            # them); once made, its saved tensors are gone too (1.6% over for tiny Mixtral at hidden
            # 256 when counted to the layer's end, where attention's gradients are made)
            rest = [n for n in mlp if n not in first]
            swiglu = adding and rest and shapes.arch.kind == "llama" and not shapes.arch.experts and not sizes.tiled_mlp
            gone = max(keep(sizes.mlp_saved) - early, 0.0)  # (a tiled MLP keeps none: early is its input)
            gone_first = swiglu or bool(rest and shapes.arch.experts and not sizes.tiled_mlp)
            tl.free("activations", gone if gone_first else 0.0)
            tl.alloc("other", inner if swiglu else 0.0)
            cast_up = bool(sizes.tiled_cast)  # a 16-bit sum is cast to the fp32 gradient beside it; else it is the gradient
            for n in rest:
                tl.free("other", 0.0 if cast_up else summed.get(n, 0.0))
                self.grad(sizes.grads[n], n)
                tl.free("other", summed.get(n, 0.0) if cast_up else 0.0)
            tl.free("other", inner if swiglu else 0.0)
            tl.free("activations", 0.0 if gone_first else gone)
            tl.transient("other", sizes.norm_backward_temp)
            tl.alloc("activations", later)
            tl.transient("other", sizes.attn_recompute_temp if later else 0.0)
            tl.transient("other", sizes.attn_backward_temp)
            for n in self.block_names[i]:
                if n not in mlp:
                    self.grad(sizes.grads[n], n)
            kept = keep(saved) + (self.sizes.block_cast - self.sizes.sublayer_cast if self.keeps_cast(saved) else 0) \
                - early - gone
            tl.free("activations", kept + back + (keep(sbh * r) if i else 0) + ahead  # and its input (x0 below)
                    - sizes.out_norm_saved)
            self.reduce(sizes.block, self.block_names[i], sync)
            self.release(sizes.block)
        # Embedding backward: its dense (V, C) gradient and a tied head's share are summed out of
        # place (three wte-sized tensors alive at once); the sum becomes wte.grad, or is added into it.
        if not shapes.lm_head:
            tl.alloc("other", 2 * wte)
            tl.free("other", 3 * wte)
        for n in [shapes.embedding, *(n for n in self.root_names if n not in (shapes.embedding, shapes.lm_head))]:
            self.grad(sizes.grads[n], n)
        tl.free("activations", keep(sbh * r) + sizes.rotary)
        tl.free("other", sbh * r)
        self.reduce(sizes.root, self.root_names, sync)
        self.release(sizes.root)

    def mlp_backward(self, inner: float, summed: dict, remade: bool) -> None:
        """The MLP's widest tensors in its backward (d c_fc out and d GELU out alive together); a
        tiled MLP's in its first slice, then beside the sums of its weights' gradients (`summed`), its
        input `remade` by a recompute around the layer or kept from forward."""
        self.tl.transient("other", inner)
        if summed:
            self.tl.alloc("other", sum(summed.values()))
            self.tl.transient("other", self.sizes.inner_temp_remade if remade else self.sizes.inner_temp_later)

    def recompute_temp(self) -> float:
        """Made and dropped by a layer's recompute. A norm on the MLP's output inside the recomputed
        layer asks for the recompute and keeps the last tensors backward needs, so the recompute
        runs past the MLP's last Linear to it: the first forward's tail too, before that norm has
        made what it keeps (counted in what the layer keeps)."""
        sizes = self.sizes
        if not sizes.out_norm_saved or sizes.mlp_alone:
            return sizes.forward_temp
        return max(sizes.forward_temp - sizes.out_norm_saved, sizes.forward_temp + sizes.forward_tail)

    def out_norm_backward(self) -> None:
        """A post-norm on the MLP's output (OLMo 2) runs first in its layer's backward: its fp32
        gradients beside all the layer keeps, then what it kept goes."""
        self.tl.transient("other", self.sizes.out_norm_backward_temp)
        self.tl.free("activations", self.sizes.out_norm_saved)

    def out_proj_grads(self, names: list[str]) -> None:
        """The MLP's output projection's weight gradients, each made beside the gradient of the
        projection's input (its backward makes both before either goes on): what a new gradient
        added into a kept one, in a later micro-step, is alive with, and what an optimizer stepping
        in backward steps beside, the projection's input gone by then."""
        d_in = self.sizes.out_proj_input_grad if names and not self.sizes.tiled_mlp else 0.0
        self.tl.alloc("other", d_in)
        if self.sizes.in_backward and d_in:
            # The node makes its weight gradients beside the input it saved, and lets that input
            # go before AccumulateGrad's hook steps them. (The input is the same size as its
            # gradient; it stays counted in the layer's activations, freed with them below.)
            self.tl.transient("grads", sum(self.sizes.grads[n] for n in names))
            self.tl.free("activations", d_in)
        for n in names:
            self.grad(self.sizes.grads[n], n)
        if self.sizes.in_backward and d_in:
            self.tl.alloc("activations", d_in)
        self.tl.free("other", d_in)
