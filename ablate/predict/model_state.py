"""Parameters, gradients, optimizer states and FSDP's units on one rank, in bytes: the analytic
model's model state (ablate/predict/analytic.py plays them through a step with the activations).

Under FSDP2 (fully_shard) each rank holds dim-0 chunks of every parameter, padded to
ceil(rows / world) rows, so rank 0's are the largest; its optimizer states take the same local
shapes, and only the 0-d step counters are whole on every rank. A unit (a block, or the root:
embeddings and ln_f) is all-gathered in the compute dtype for its forward and again for its
backward; its gradients are made whole, then reduce-scattered into shards. FSDP1 is given the same
sizes: MemTracker cannot follow it, but the gpt2-xl FSDP1 batch scan's allocator peaks came within
1.6% of them (benchmarks/results/NVIDIA-H100-80GB-HBM3/repredict.md).
"""
from __future__ import annotations

import math

from ablate.build import Techniques
from ablate.predict.shapes import Shapes
from ablate.predict.sizes import Sizes, Unit

MIB = 2**20
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# cuBLAS takes its workspaces through the caching allocator at the first matmuls (32 MiB each on
# Hopper, NVIDIA's recommended size): two of them. Every predict_check point's allocator peak ran
# 54-88 MiB above the modelled tensors, and a traced gpt-mini step 67 MiB above MemTracker's
# (benchmarks/results/NVIDIA-H100-80GB-HBM3/).
CUBLAS_WORKSPACES = 64 * MIB


def local_shape(shape: tuple, world: int) -> tuple:
    """A parameter's shape on rank 0 when FSDP shards it over `world` ranks: dim 0 in chunks of
    ceil(rows / world), the last ranks' padded to that size, so rank 0 holds the largest shard."""
    return (-(-shape[0] // world), *shape[1:])


def fsdp_shards(t: Techniques) -> bool:
    """Whether FSDP shards the parameters: a sharded parallel option, or offload=params (in one
    process, FSDP over a group of one rank)."""
    return t.parallel.shards_params or t.offload.shards_params


def grad_bytes(t: Techniques) -> int:
    """Bytes per gradient element: the parameters' dtype, or FSDP's mixed-precision compute dtype
    (it gathers parameters in it, and backward makes their gradients in it)."""
    return BYTES[t.precision.autocast_dtype or t.precision.param_dtype] if fsdp_shards(t) else BYTES[t.precision.param_dtype]


def model_state(t: Techniques, shapes: Shapes, device: str) -> Sizes:
    """Parameters, gradients, optimizer states and FSDP's units on one rank (bytes)."""
    param_bytes = BYTES[t.precision.param_dtype]
    gather_bytes = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]  # FSDP's mp param_dtype
    p = t.parallel
    fsdp = fsdp_shards(t)
    world = max(p.world_size, 1) if p.shards_params else 1  # offload=params alone: FSDP over one rank
    local = {n: math.prod(local_shape(s, world)) for n, s in shapes.param_shapes.items()}
    trains = [n for n in local if n not in shapes.frozen]  # a frozen parameter has no gradient and no state
    # FSDP CPU offload: shards, their grads and states on the host (on a CPU, the host is the device)
    offloaded = t.offload.params_on_host and device != "cpu"
    # The optimizer option's own model of its states (ablate/techniques/optimizer.py, lowbit.py), for
    # each tensor's local shape: torch keeps a DTensor parameter's states in its shard's shape.
    states = sum(t.optimizer.state_bytes(local_shape(shapes.param_shapes[n], world), param_bytes, device, n)
                 for n in trains)
    states += t.optimizer.shared_state_bytes(max([local[n] for n in trains] or [0]))
    if offloaded or t.offload.states_on_host:
        states = 0.0
    grads = {n: 0.0 if n in shapes.frozen else numel * grad_bytes(t) for n, numel in shapes.param_numels.items()}
    if t.offload.grads_on_host:
        grads = dict.fromkeys(grads, 0.0)
    groups = [[local_shape(shapes.param_shapes[n], world) for n in g] for g in shapes.groups]
    stored = sum(numel * shapes.packed.get(n, param_bytes) for n, numel in local.items())
    # A 4-bit weight's scales are tensors beside it, not parameters: the CUDA allocator holds them,
    # MemTracker (a CPU row's peak) never sees them.
    if device == "cuda":
        stored += sum(t.peft.quant_state_bytes(2 * local[n]) for n in shapes.packed)
    # In backward each tensor is stepped alone, by an optimizer made of its group with it alone in it.
    each = {} if not t.optimizer.in_backward else {
        n: t.optimizer.step_temp([[shape] if j == i else [] for j in range(len(groups))], param_bytes, device)
        for i, (names, group) in enumerate(zip(shapes.groups, groups)) for n, shape in zip(names, group)}
    sizes = Sizes(params=0.0 if offloaded else stored, grads=grads, states=states, step_temp_each=each,
                  step_temp=0.0 if states == 0 or each else t.optimizer.step_temp(groups, param_bytes, device),
                  other=(sum(shapes.param_numels[n] for n in trains) * param_bytes if p.ddp_buckets else 0.0)
                  + (CUBLAS_WORKSPACES if device == "cuda" else 0.0),
                  grads_in_buckets=p.grads_in_buckets)
    if fsdp:
        reduce_d = 4 if t.precision.autocast_dtype else param_bytes  # FSDP reduces in fp32 under autocast

        def unit(names: list[str]) -> Unit:
            shard, grad = sum(local[n] for n in names), sum(local[n] for n in names if n not in shapes.frozen)
            return Unit(gathered=shard * world * gather_bytes,
                        sharded_grads=0.0 if offloaded else grad * param_bytes, reduce_input=grad * world * reduce_d)

        in_layers = {n for names in shapes.layer_names for n in names}
        sizes.root = unit([n for n in local if n not in in_layers])
        sizes.block = unit(shapes.layer_names[0])
        sizes.reshard = getattr(p, "reshard_after_forward", getattr(p, "sharding", "full") == "full")
        sizes.sync_each = getattr(p, "sync_each_micro_step", True)  # fully_shard's own default
    return sizes
