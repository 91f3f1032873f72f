"""predict=trace: one rank's real training step run on fake tensors under torch's MemTracker.

The config is built exactly as a worker builds it (build_model, build_optimizer: the same
techniques in the same order), but inside FakeTensorMode: every tensor has a shape, dtype and
device and no storage, so even gpt2-xl allocates nothing. One untraced step creates the optimizer
states; the second is traced by `measure.traced_step`, the tracker a real run reports its
breakdown with, so a prediction on the CPU equals the real CPU step's figures.

Where a fake tensor cannot stand in for a real one, the glue below says why and works around it
as narrowly as it can; options it cannot make work raise `Untraceable`, and the caller falls back
to the analytic model. Everything set up here is undone on the way out, on success or failure.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ablate import measure
from ablate.build import Techniques, build_model, build_optimizer, check_config
from ablate.predict import Prediction
from ablate.spec import RunSpec
from ablate.techniques import parallel as par
from ablate.train import train_step


class Untraceable(Exception):
    """This grid point has an option a fake-tensor step cannot run; predict it another way."""


def trace(spec: RunSpec) -> Prediction:
    """Predict one rank's peak device memory (MiB) for a grid point from a fake step."""
    # Validity is the job's business (check_config without a device, as the job calls it); "cuda"
    # here would ask torch.cuda about bf16 and the GPU count, questions for the worker's host.
    t = check_config(spec)
    _check_traceable(t)
    device = _device(spec.device)
    ddp = t.parallel.ddp_buckets
    if ddp:  # a DDP rank computes what a single process does; its gradient buckets are added below
        t.parallel = par.Single()
    t.optimizer.before_trace()  # e.g. torchao's quantisation tables, cached for the process: of real values
    # allow_non_fake_inputs: a module that computes a constant in its __init__ (Apertus's xIELU:
    # log(expm1(0.8))) computes it on meta, as the model is built there, and the fake mode takes it
    # as a constant; refused, such a family had no trace at all.
    with _fake_world(t.parallel, t.offload), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            _real_optimizer_defaults(), _value_reads(t), _moe_grouped_mm(), _one_sequence_per_row(t):
        with _swappable_params(mode):
            # compile=true is traced eager: compiled kernels cannot run on fake tensors. Inductor's
            # fusions usually keep fewer activations, so this tends to over-predict such runs.
            model = build_model(t, device)
        optimizer = build_optimizer(model, t)
        # fp16's GradScaler reads found_inf.item() in step() to decide whether to skip it, a value
        # a fake tensor does not have. Unscaling is in place, so a disabled scaler costs the same.
        scaler = torch.amp.GradScaler(device.type, enabled=False)

        def step() -> torch.Tensor:
            return train_step(model, optimizer, scaler, t, _fake_batch(spec, t.model.vocab_size), device)

        step()  # creates the optimizer states, as a real run's warm-up does
        traced = measure.traced_step(step, model, optimizer, device)
        buckets = _ddp_bucket_mib(model) if ddp else 0.0
    return Prediction(peak_mib=traced.peak_mib + buckets, breakdown_mib=_plus_other(traced.at_peak, buckets),
                      category_max_mib=_plus_other(traced.category_max, buckets), method="trace",
                      steady_mib=_plus_other(traced.after, buckets))


def _device(requested: str) -> torch.device:
    """The fake device: the one the config names, and for "auto" the GPU the user plans on.

    cuda:0, not "cuda": `.to("cuda")` asks the CUDA runtime for its current device even when the
    tensor is fake.
    """
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        # A fake CUDA step is only the GPU's step where torch can see one: on a CPU-only build the
        # first autograd node on a fake CUDA tensor aborts the whole process (no CUDA device guard
        # to ask for a stream, an error thrown through noexcept code), and on a CUDA build without
        # a GPU torch.autocast("cuda") turns itself off and SDPA takes the math kernel, which
        # stores a (T, T) matrix per head: a wrong prediction, silently.
        raise Untraceable(f"device={requested}: a fake CUDA step needs a visible GPU (this host has "
                          f"none); trace with device=cpu or use the analytic model")
    return torch.device("cuda", 0)


def _check_traceable(t: Techniques) -> None:
    """Raise Untraceable for an option whose step cannot run, or be followed, on fake tensors."""
    untraceable = t.untraceable()  # the same flag decides whether a real run traces its breakdown
    if untraceable:
        raise Untraceable(f"{untraceable}: MemTracker cannot follow its step")
    if t.parallel.world_size < 1:
        raise Untraceable("parallel.nproc=auto: resolve the world size before tracing one rank of it")
    if t.parallel.grads_in_buckets:
        raise Untraceable("parallel.gradient_as_bucket_view=true: a single-process trace keeps whole "
                          "gradients that DDP would copy into its buckets")
    if t.peft.quant_state_bytes(1):  # a quantised base: QLoRA
        raise Untraceable(f"peft={type(t.peft).__name__.lower()}: bitsandbytes' 4-bit weights (Params4bit) "
                          f"cannot be made of fake tensors")
    if t.offload.states_on_host:
        raise Untraceable("offload=optimizer: torchao's CPUOffloadOptimizer moves gradients with real "
                          "CUDA streams and events, which fake tensors cannot stand in for")


def _fake_batch(spec: RunSpec, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) int64 inputs and targets on the host, as TokenData gives them: the train step
    copies them to the device, so the device copies are counted as in a real step."""
    B, T = spec.batch_size, spec.seq_len
    return torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


def _ddp_bucket_mib(model: torch.nn.Module) -> float:
    """DDP's gradient buckets (MiB): the reducer gives every bucket a flat gradient tensor, and the
    buckets cover every trained parameter in its own dtype (torch/csrc/distributed/c10d/reducer.cpp,
    initialize_buckets; gradient_as_bucket_view=False), so a DDP rank holds one more gradient-sized
    copy for good, allocated when the model is wrapped. A real 2-rank gloo run's traced peak is
    exactly the single-process peak plus this."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / measure.MIB


def _plus_other(breakdown: dict, mib: float) -> dict:
    """`breakdown` (MiB by category) with `mib` more in "other"."""
    return {**breakdown, "other": breakdown["other"] + mib}


@contextlib.contextmanager
def _fake_world(parallel, offload) -> Iterator[None]:
    """FSDP shards over a process group (offload=params alone: of one rank): a fake one (torch's
    FakeProcessGroup: collectives do nothing) of the real world size, this process being rank 0;
    destroyed on the way out."""
    if not (parallel.shards_params or offload.shards_params):
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():  # a worker's real group: sharding over a fake one would replace it
        raise Untraceable(f"parallel={type(parallel).__name__.lower()}: this process already has a "
                          f"process group; trace in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=parallel.world_size)
    default_mesh = _fully_shard._init_default_mesh
    try:
        # fully_shard builds its default mesh (every rank) from torch.arange(world).tolist(), a
        # value a fake tensor does not have: the same mesh is built here, before the fake mode.
        mesh = default_mesh()
        _fully_shard._init_default_mesh = lambda mesh_dim_names=None: mesh
        yield
    finally:
        _fully_shard._init_default_mesh = default_mesh
        dist.destroy_process_group()


@contextlib.contextmanager
def _swappable_params(mode: FakeTensorMode) -> Iterator[None]:
    """Let Module.to() convert fake parameters (a torch bug: test_fake_tensor.py::test_module_to).

    Module._apply replaces a fake parameter with torch.utils.swap_tensors, which refuses a tensor
    that has weakrefs; nn.Parameter(fake) goes through FakeTensorMode's real-to-fake converter,
    whose memo (a WeakValueDictionary) holds a weakref to every parameter made. Dropping the two
    tensors from the memo just before the swap clears those weakrefs; the memo is only a cache
    (a later conversion of the same tensor would make a new fake), so nothing else changes.
    """
    memo = mode.fake_tensor_converter.tensor_memo
    swap = torch.utils.swap_tensors

    def swap_fake(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key in [k for k, v in memo.items() if v is t1 or v is t2]:
            del memo[key]
        swap(t1, t2)

    torch.utils.swap_tensors = swap_fake  # Module._apply looks it up at call time
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def _real_optimizer_defaults() -> Iterator[None]:
    """Let torch's optimizers pick the default implementation they pick for real tensors.

    With foreach/fused unset, torch.optim chooses foreach on CUDA (temporaries for a whole
    parameter group at once) only if every parameter's exact type is listed in
    _foreach_supported_types; a FakeTensor is not, so a fake CUDA step would take the for-loop path
    the real one does not. DTensor registers itself in this list the same way (torch.distributed.
    tensor); FakeTensor is added for the trace and removed after.
    """
    from torch.optim import optimizer as torch_optim

    types = torch_optim._foreach_supported_types
    added = FakeTensor not in types
    if added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        if added:
            types.remove(FakeTensor)


@contextlib.contextmanager
def _moe_grouped_mm() -> Iterator[None]:
    """Let a transformers mixture of experts (Mixtral, Qwen3-MoE, OLMoE) run its experts on fake
    tensors in any dtype.

    transformers multiplies each expert's tokens with torch's grouped GEMM, whose CPU kernel takes
    fp32 but whose shape function (the one a fake tensor runs) refuses all but bf16 (whether the
    CUDA kernel takes fp32 is not yet seen here). Where it would refuse, the experts take
    transformers' own fallback op instead: the same matmuls one expert at a time, with the shape
    function transformers registers for torch.compile, keeping its inputs for backward as the
    grouped GEMM does. A tiny Mixtral's traced peak on a CPU: within 3% of the real step's
    (tests/test_families.py). Only where transformers is already imported (an HF model's config
    was read) and has this function."""
    import importlib
    import sys

    moe = None
    if "transformers" in sys.modules:  # a GPT-2 point never imports it
        with contextlib.suppress(ImportError):
            moe = importlib.import_module("transformers.integrations.moe")
    usable = getattr(moe, "_can_use_grouped_mm", None)
    if usable is None:
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and usable(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = usable


@contextlib.contextmanager
def _one_sequence_per_row(t: Techniques) -> Iterator[None]:
    """Let a transformers model's attention mask be what it is in the real step: none.

    transformers asks whether a row's position ids pack several sequences
    (masking_utils.find_packed_sequence_indices), which only their values can say; of a fake tensor
    it assumes they might, and makes a (B, 1, T, T) mask, whereupon its SDPA call repeats grouped
    keys and values for every query head (repeat_kv) where the real step passes none and lets SDPA
    take the groups (enable_gqa, is_causal): tensors the real step never makes. ablate passes no
    position ids (models/hf.py); the model makes its own, an arange per row: never packed.
    """
    if not t.model.uses_transformers:
        yield
        return
    from transformers import masking_utils

    find = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # looked up at call time
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def _value_reads(t: Techniques) -> contextlib.AbstractContextManager:
    """_ValueReads for the optimizers that say they read values (`reads_values`: Adafactor, the
    8-bit and low-bit AdamWs), nothing for the others: any other data-dependent read is a new case to
    look at, so it still fails loudly."""
    return _ValueReads() if t.optimizer.reads_values else contextlib.nullcontext()


class _ValueReads(TorchDispatchMode):
    """Answers a read of a fake tensor's value (`.item()`, `.tolist()`) with 1.0.

    Some optimizers compute numbers from values: torch's Adafactor its step size from the
    parameter's RMS and its clipping from the update's (param.norm().item(), update.norm().item()),
    bitsandbytes its 8-bit quantisation map from torch.linspace(...).tolist(). Those numbers scale
    updates and never size a tensor, so any value gives the same memory. Values a fake tensor does
    know (constants such as Adafactor's step count) are returned as they are.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._local_scalar_dense.default:
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            return 1.0
