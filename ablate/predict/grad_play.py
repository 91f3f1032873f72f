"""Step's gradients as they arrive in backward (new, added into kept ones, stepped in backward, or
copied into DDP's buckets) and FSDP's units (all-gathered parameters, reduce-scattered gradients).
Uses the Step's timeline `tl`, `shapes`, `sizes`, compute bytes `c`, and its `have_grads` and
`pending` (ablate/predict/timeline.py)."""
from __future__ import annotations

from ablate.predict.sizes import Unit


class GradPlay:
    """Step's gradient arrivals and FSDP unit traffic."""

    def grad(self, nbytes: float, name: str) -> None:
        """Parameter `name`'s gradient arrives: new, or added into the one from an earlier micro-step
        (briefly both), or stepped (with that one tensor's step temporaries) and freed at once
        (optimizer.in_backward), or copied into its DDP bucket, which .grad then views
        (gradient_as_bucket_view)."""
        whole_kept = self.have_grads and not self.sizes.sync_each  # FSDP syncing each micro-step shards them
        if self.sizes.in_backward:
            self.tl.alloc("grads", nbytes)
            if self.sizes.grad_lag:  # this one's arrival steps the one before
                self.step_pending()
                self.pending = (name, nbytes)
            else:
                self.tl.transient("optimizer", self.sizes.step_temp_each.get(name, 0.0))
                self.tl.free("grads", nbytes)
        elif self.sizes.grads_in_buckets or (whole_kept and not self.sizes.upcast):
            # an expert weight's new gradient: counted at its moment in the experts' backward (expert_grads)
            counted = self.adds_into_kept() and name in self.shapes.expert_names
            self.tl.transient("grads", 0.0 if counted else nbytes)
        else:
            self.tl.alloc("grads", nbytes)

    def adds_into_kept(self) -> bool:
        """Whether this micro-step's gradients are added, one at a time, into whole ones kept from the last."""
        s = self.sizes
        return self.have_grads and not (s.sync_each or s.in_backward or s.upcast or s.grads_in_buckets)

    def expert_grads(self, adding: bool) -> None:
        """Each expert weight's new gradient, in a micro-step that adds it into the kept one, at its
        moment in the experts' backward (what else is alive then beside it: `other`, net of what
        that backward has freed)."""
        for other, grad in self.sizes.expert_moments if adding else ():
            self.tl.alloc("other", other)
            self.tl.transient("grads", grad)
            self.tl.free("other", other)

    def step_pending(self) -> None:
        """Step and free the gradient waiting for the next one (grad_lag), with its step temporaries."""
        if self.pending:
            name, nbytes = self.pending
            self.tl.transient("optimizer", self.sizes.step_temp_each.get(name, 0.0))
            self.tl.free("grads", nbytes)
            self.pending = None

    def gather(self, unit: Unit | None, kind: str) -> None:
        """FSDP all-gathers a unit's parameters into one flat buffer (labelled `kind`: MemTracker
        calls it an activation in forward, other in backward), copies them out into the whole
        parameters, then frees the buffer."""
        if unit:
            self.tl.alloc(kind, unit.gathered)
            self.tl.alloc("params", unit.gathered)
            self.tl.free(kind, unit.gathered)

    def release(self, unit: Unit | None) -> None:
        if unit:
            self.tl.free("params", unit.gathered)

    def reduce(self, unit: Unit | None, names: list[str], sync: bool) -> None:
        """FSDP after a unit's backward: on a synced micro-step (each one, or only the last) its
        whole gradients are copied into one flat buffer for the reduce-scatter and freed, and this
        rank's shard of the sum becomes its gradient, or is added into it; on the others they wait
        (in fp32 beside .grad under mixed precision)."""
        if not unit or self.sizes.in_backward:
            return
        whole = ("grads", sum(self.sizes.grads[n] for n in names))
        if self.sizes.upcast:
            summed = ("other", whole[1] / self.c * 4)
            if not self.have_grads:  # the first micro-step converts .grad; later ones add into it
                self.tl.alloc(*summed)
            self.tl.free(*whole)
            whole = summed
        if sync:
            self.tl.alloc("other", unit.reduce_input)
            self.tl.free(*whole)
            if self.have_grads and self.sizes.sync_each:  # an earlier micro-step's shards: these add into them
                self.tl.transient("other", unit.sharded_grads)
            else:
                self.tl.alloc("grads", unit.sharded_grads)
            self.tl.free("other", unit.reduce_input)
