"""parallel group: how many processes train, and how model state is replicated or sharded.

Every option but `single` runs under torchrun (launch/torchrun.py): one process per rank, each
reading RANK / LOCAL_RANK / WORLD_SIZE. `batch_size` is per rank, so the global batch is
batch_size x world size and rank r trains on the r-th slice of it.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from ablate.techniques import Invalid, Option, Plan
from ablate.techniques.precision import DTYPES


class Single(Option):
    """One process on one device: the whole model, its gradients and optimizer states on it."""

    label = "Single process"
    world_size = 1
    shards_params = False  # parameters are whole on every rank
    rank = 0
    # What the analytic predictor (ablate/predict/analytic.py) asks:
    ddp_buckets = False  # DDP's buckets: a second copy of every gradient
    grads_in_buckets = False  # each .grad a view into its bucket: that copy is the gradient
    fsdp_mixed_precision = False  # FSDP gathers the parameters in the compute dtype (no autocast copies)

    def __init__(self, nproc: int | str = 1, nodes: int = 1):
        self.nproc, self.nodes = nproc, nodes

    def check(self, plan: Plan) -> None:
        if self.nproc != 1 or self.nodes != 1:
            raise Invalid(f"parallel=single runs one process: parallel.nproc={self.nproc}, "
                          f"parallel.nodes={self.nodes} need parallel=ddp, fsdp, fsdp_grad_op or fsdp1")

    def setup(self, device: torch.device) -> torch.device:
        """Join the process group (if any) and return this rank's device."""
        return device

    def teardown(self) -> None:
        """Leave the process group."""

    def wrap(self, model: nn.Module, adapter, precision, offload) -> nn.Module:
        """`adapter` (ablate/models/) says where the model's repeated layers are; the offload
        option where one process keeps its parameters."""
        return offload.place(model, adapter, precision)

    def sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Wraps forward + backward of a micro-step; gradients are reduced only on the last."""
        return contextlib.nullcontext()


class _Distributed(Single):
    """Shared glue: process group, one device per local rank, option validation."""

    key_labels = {("sync_each_micro_step", "False"): "Gradient sync on the last micro-step only",
                  ("sync_each_micro_step", "True"): "Gradient sync every micro-step"}
    BACKENDS = ("auto", "nccl", "gloo")

    def __init__(self, nproc: int | str = "auto", nodes: int = 1, backend: str = "auto"):
        super().__init__(nproc, nodes)
        self.backend = backend

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes if isinstance(self.nproc, int) else 0  # 0: not resolved yet

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def check(self, plan: Plan) -> None:
        if self.backend not in self.BACKENDS:
            raise Invalid(f"parallel.backend={self.backend!r} is not one of {', '.join(self.BACKENDS)}")
        if self.nproc != "auto" and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise Invalid(f"parallel.nproc={self.nproc!r} must be a positive integer or auto")
        if self.nodes < 1:
            raise Invalid(f"parallel.nodes={self.nodes} must be >= 1")
        if self.nodes > 1 and "SLURM_JOB_ID" not in os.environ:
            raise Invalid(f"parallel.nodes={self.nodes} needs a SLURM allocation (hydra/launcher=slurm)")
        if plan.device == "cpu" and self.backend == "nccl":
            raise Invalid("parallel.backend=nccl needs CUDA devices; on a CPU use gloo (or auto)")
        if plan.device == "cuda" and isinstance(self.nproc, int) and self.nproc > torch.cuda.device_count():
            raise Invalid(f"parallel.nproc={self.nproc} > {torch.cuda.device_count()} visible GPUs")

    def setup(self, device: torch.device) -> torch.device:
        backend = self.backend if self.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        return device

    def teardown(self) -> None:
        # No destroy_process_group(): the worker exits with os._exit right after reporting (see
        # ablate/worker.py); destroying a gloo group under a live DDP reducer deadlocks.
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another still needs it


class DDP(_Distributed):
    """DistributedDataParallel: every rank holds the whole model, gradients and optimizer states;
    gradients are all-reduced in buckets during backward. Spends: a full replica per GPU plus the
    buckets, a second copy of every gradient. Saves: nothing per GPU; buys throughput.
    gradient_as_bucket_view=True makes each .grad a view into its bucket: one gradient copy fewer."""

    label = "DDP"
    key_labels = {**_Distributed.key_labels, ("gradient_as_bucket_view", "True"): "Gradients as bucket views"}

    def __init__(self, nproc: int | str = "auto", nodes: int = 1, backend: str = "auto",
                 gradient_as_bucket_view: bool = False):
        super().__init__(nproc, nodes, backend)
        self.gradient_as_bucket_view = gradient_as_bucket_view

    ddp_buckets = True

    @property
    def grads_in_buckets(self) -> bool:
        return self.gradient_as_bucket_view

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.sharded:
            raise Invalid("parallel=ddp with offload=params: DDP keeps a whole replica on every device; "
                          "use parallel=fsdp (or parallel=single)")

    def wrap(self, model: nn.Module, adapter, precision, offload) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=self.gradient_as_bucket_view)

    def sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last_micro_step else model.no_sync()


class FSDP(_Distributed):
    """FSDP2 (`fully_shard`) on every repeated layer (the adapter's), then on the root. Parameters, gradients
    and optimizer states are sharded over the ranks (1/world each); a block's parameters are
    all-gathered just before use. reshard_after_forward=True frees them again after forward
    (ZeRO-3; all-gathered again in backward), False keeps them until backward (ZeRO-2-like:
    one all-gather fewer, a full block's parameters alive between forward and backward).

    Under gradient accumulation, sync_each_micro_step=True (plain fully_shard's behaviour, and
    torchtitan's) reduce-scatters each micro-step's gradients into the shards: gradients stay
    1/world per rank, for one reduce-scatter per micro-step. False defers it to the last
    micro-step (no_sync): every unit's whole gradients stay alive in between, in fp32 under mixed
    precision, as much gradient memory as a DDP rank's, for fewer collectives. (DDP always
    defers: its gradients are whole either way.)"""

    shards_params = fsdp_mixed_precision = True

    def __init__(self, nproc: int | str = "auto", nodes: int = 1, backend: str = "auto",
                 reshard_after_forward: bool = True, sync_each_micro_step: bool = True):
        super().__init__(nproc, nodes, backend)
        self.reshard_after_forward, self.sync_each_micro_step = reshard_after_forward, sync_each_micro_step

    @property
    def label(self) -> str:
        return "FSDP" if self.reshard_after_forward else "FSDP without reshard after forward"

    def wrap(self, model: nn.Module, adapter, precision, offload) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {"reshard_after_forward": self.reshard_after_forward}
        if precision.autocast_dtype:  # compute in the autocast dtype, reduce gradients in fp32
            low = DTYPES[precision.autocast_dtype]
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if hasattr(offload, "cpu_offload_policy"):
            kwargs["offload_policy"] = offload.cpu_offload_policy()
        for block in adapter.layer_list(model):
            fully_shard(block, **kwargs)
        return fully_shard(model, **kwargs)

    def sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        return _gradient_sync(model, last_micro_step or self.sync_each_micro_step)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool):
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class FSDP1(_Distributed):
    """The classic FullyShardedDataParallel, one unit per transformer block (transformer auto-wrap).
    `sharding`: full (ZeRO-3), grad_op (ZeRO-2), no_shard (DDP-like). `backward_prefetch`: pre
    all-gathers the next block's parameters before the current block's gradient computation
    (faster, one more block of parameters alive), post after it, none not at all.
    sync_each_micro_step: as in FSDP."""

    label = "FSDP1"
    key_labels = {**_Distributed.key_labels, ("backward_prefetch", "pre"): "Backward prefetch (pre)",
                  ("backward_prefetch", "post"): "Backward prefetch (post)"}

    SHARDING = ("full", "grad_op", "no_shard")
    PREFETCH = ("pre", "post", "none")
    # MemTracker hooks every parameter's gradient accumulation; FSDP1's flat-parameter views
    # (use_orig_params) are not leaves, so no breakdown (nor CPU peak) under FSDP1.
    traceable = False
    fsdp_mixed_precision = True

    def __init__(self, nproc: int | str = "auto", nodes: int = 1, backend: str = "auto",
                 sharding: str = "full", backward_prefetch: str = "pre", sync_each_micro_step: bool = True):
        super().__init__(nproc, nodes, backend)
        self.sharding, self.backward_prefetch = sharding, backward_prefetch
        self.sync_each_micro_step = sync_each_micro_step

    @property
    def shards_params(self) -> bool:
        return self.sharding != "no_shard"

    def check(self, plan: Plan) -> None:
        super().check(plan)
        for key, value, valid in (("sharding", self.sharding, self.SHARDING),
                                  ("backward_prefetch", self.backward_prefetch, self.PREFETCH)):
            if value not in valid:
                raise Invalid(f"parallel.{key}={value!r} is not one of {', '.join(valid)}")

    def wrap(self, model: nn.Module, adapter, precision, offload) -> nn.Module:
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        strategy = {"full": fsdp.ShardingStrategy.FULL_SHARD, "grad_op": fsdp.ShardingStrategy.SHARD_GRAD_OP,
                    "no_shard": fsdp.ShardingStrategy.NO_SHARD}[self.sharding]
        prefetch = {"pre": fsdp.BackwardPrefetch.BACKWARD_PRE, "post": fsdp.BackwardPrefetch.BACKWARD_POST,
                    "none": None}[self.backward_prefetch]
        mixed = None
        if precision.autocast_dtype:
            low = DTYPES[precision.autocast_dtype]
            mixed = fsdp.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
        device = next(model.parameters()).device
        return fsdp.FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={adapter.layer_class(model)}),
            sharding_strategy=strategy, backward_prefetch=prefetch, mixed_precision=mixed,
            cpu_offload=fsdp.CPUOffload(offload_params=True) if hasattr(offload, "cpu_offload_policy") else None,
            device_id=device,  # explicit even on CPU: FSDP1 only infers accelerator devices
            use_orig_params=True,  # the optimizer's weight-decay groups see the original parameters
        )

    def sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last_micro_step or self.sync_each_micro_step else model.no_sync()
