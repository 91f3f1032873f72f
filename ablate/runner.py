"""One grid point inside a worker (one rank): build -> warm up -> trace one step -> timed steps ->
eval -> metrics gathered from every rank. Rank 0 reports for the group."""
from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.distributed.tensor import DTensor

from ablate import artifacts, measure
from ablate.run_metrics import largest, metrics
from ablate.build import Techniques, build_model, build_optimizer, check_config, pick_device
from ablate.capacity import MemoryLimit
from ablate.data import TokenData
from ablate.events import EventWriter
from ablate.models import logical_numel
from ablate.spec import RunSpec
from ablate.techniques import Invalid
from ablate.train import evaluate, train_step
from launch import cpus as host_cpus

PROGRESS_EVERY_S = 0.5  # at most this often a loss is read back (a device sync) for the progress line


@dataclass
class Trained:
    """What the training phase measured on this rank."""

    steps: int  # measured steps
    times_ms: list[float]
    losses: list[float]  # every optimizer step, warm-up included, averaged over ranks
    peaks: dict
    breakdown: dict | None = None
    init_peak_mib: float | None = None
    compile_s: float | None = None  # wall time of the first step, which compiles the model
    skipped_steps: int | None = None  # optimizer steps the GradScaler skipped (inf/nan gradients)
    traced_step_oom: bool = False  # the traced warm-up step ran out of memory; training went on untraced
    warmup: int = 0  # of the steps in `losses`, the first `warmup` are warm-up steps
    loss_scale: float | None = None  # the GradScaler's scale after the last step (fp16); None without one
    params: tuple[int, int] | None = None  # (elements, trainable elements) of the parameters this rank holds, as built
    # The allocator's peak allocated MiB in each phase: the warm-up steps before the traced one, the
    # traced step (its tracer included), the timed steps. None where not measured (a CPU).
    phase_peaks: dict | None = None

    @property
    def diverged_at(self) -> int | None:
        """The first optimizer step (1-based, warm-up included) whose loss is NaN or inf; None
        when every loss is finite."""
        return next((k for k, loss in enumerate(self.losses, 1) if not math.isfinite(loss)), None)

    def divergence(self) -> str | None:
        """Why this run's losses are not a measurement, in one line; None when they are. Its peaks
        and times still are: the same kernels ran on the same shapes."""
        k = self.diverged_at
        if k is None:
            return None
        value = self.losses[k - 1]
        where = f"warm-up step {k}" if k <= self.warmup else f"measured step {k - self.warmup}"
        scale = (f"; the fp16 loss scale ended at {self.loss_scale:g} with {self.skipped_steps} optimizer "
                 "steps skipped" if self.loss_scale is not None else "")
        return (f"the loss was {value} at {where} (step {k} of {len(self.losses)}, warm-up "
                f"included){scale}; memory and time are measured, the losses are not")


def load_data(spec: RunSpec, t: Techniques) -> TokenData:
    vocab = t.model.vocab_size
    data = instantiate(spec.groups["data"]).load(spec.seq_len, vocab)
    if data.vocab_size > vocab:
        raise Invalid(f"the data has {data.vocab_size} token ids > the model's vocabulary of {vocab} tokens")
    return data


def all_ranks(obj) -> list:
    """`obj` from every rank, in rank order (just [obj] in a single process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank_mean(losses: list[torch.Tensor], device: torch.device) -> list[float]:
    """Per-step losses averaged over ranks: the loss of the global batch (equal slices per rank)."""
    if not losses:
        return []
    stacked = torch.stack(losses).float()
    if dist.is_initialized():
        dist.all_reduce(stacked)  # SUM: gloo has no AVG
        stacked /= dist.get_world_size()
    return stacked.tolist()


def last_warmup_step(step, model: torch.nn.Module, optimizer, t: Techniques, device: torch.device,
                     mem: measure.DeviceMemory, history: artifacts.AllocatorHistory | None,
                     out: Path | None) -> tuple[dict | None, float | None, dict, bool, float | None]:
    """The last warm-up step (untimed) is the one looked into: traced by MemTracker for the
    breakdown and memory_by_module.csv where the parallel option allows it, and on CUDA recorded
    by the allocator for memory_snapshot.pickle (unless `history` is None: a compiled step before
    it was recorded). The files go to `out` (rank 0's run directory; None: nowhere). Returns
    (breakdown, traced peak MiB, the allocator's peaks before the step, whether the traced step ran
    out of memory, the allocator's peak MiB over the traced step); breakdown and peak are None where
    the step was not traced or ran out (below), the last where it was not traced."""
    record = history is not None
    if record:
        history.start()  # this step alone: recording slows every allocation down
    if t.untraceable():
        step()
        if record:
            history.stop(out)
        return None, None, {}, False, None  # a training step: its peaks go on into the timed steps'
    # The allocator's peaks leave the traced step out: they measure training, not the tracer's
    # dispatch mode. Earlier warm-up steps count (the first allocates the optimizer state).
    warm_peaks = mem.peaks()
    mem.reset()  # the traced step's own peak: does tracing a step change what it allocates?
    try:
        trace = measure.traced_step(step, model, optimizer, device)
    except torch.OutOfMemoryError:
        # The traced step runs eagerly under MemTracker's dispatch mode: under compile=true, or with
        # torchao's compiled optimizer step, it can hold more than the steps it looks into (4-bit
        # gpt2-xl on 8 GiB: benchmarks/results/NVIDIA-H200/gpt2_xl_8gib.md). Its OOM is the tracer's, not
        # training's: the point goes on untraced, and its measured steps decide ok or oom. What the
        # step left (gradients, or some of them under optimizer.in_backward) goes first.
        trace = None
        optimizer.zero_grad(set_to_none=True)
        if out is not None:
            artifacts.dump_oom_snapshot(out)
    if record:
        history.stop(out)  # memory_snapshot.pickle (after an OOM: the traced step up to it)
    traced_alloc = mem.peak_allocated_mib()
    mem.reset()
    if trace is None:
        return None, None, warm_peaks, True, traced_alloc
    if out is not None:
        artifacts.write_module_csv(artifacts.module_rows(trace, model), out)
    return trace.at_peak, trace.peak_mib, warm_peaks, False, traced_alloc


def snapshot_compiled_step(spec: RunSpec) -> int | None:
    """The warm-up step whose allocations memory_snapshot.pickle records under compile=true: the
    last one before the traced step, if it is not the first (which compiles). None: the traced
    step is recorded (no compile, or fewer than three warm-up steps)."""
    return spec.warmup_steps - 2 if spec.compile and spec.warmup_steps >= 3 else None


def held_params(model: torch.nn.Module) -> tuple[int, int]:
    """(elements, trainable elements) of the parameters this rank holds, each tensor once (a tied
    weight is one), a 4-bit weight as the weights it packs (`logical_numel`). Through compile's and
    DDP's wrappers (their parameters are the model's); under FSDP this rank's shards: FSDP2's
    DTensors hold their local part, FSDP1's original parameters are views into its flat shard, so
    the ranks' counts add up to the model's. Read as built: an FSDP2 forward without backward (an
    eval) can leave whole parameters where the shards were."""
    total = trainable = 0
    for p in model.parameters():
        n = p.to_local().numel() if isinstance(p, DTensor) else logical_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def trainer(spec: RunSpec, t: Techniques, data: TokenData, device: torch.device,
            scaler: torch.amp.GradScaler | None = None
            ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], torch.Tensor]]:
    """The built model and optimizer, and step(k): one optimizer step on this rank's slice of
    global batch k, returning its loss (benchmarks/profile_step.py profiles the same step).
    `scaler`: the precision option's GradScaler, where the caller reads its state afterwards."""
    model = build_model(t, device, compile=spec.compile)
    optimizer = build_optimizer(model, t)
    scaler = scaler or t.precision.grad_scaler(device.type)  # allocates nothing until its first step
    B, rank, world = spec.batch_size, t.parallel.rank, t.parallel.world_size

    def step(k: int) -> torch.Tensor:  # rank r trains on the r-th slice of global batch k
        return train_step(model, optimizer, scaler, t, data.train_batch(k, B, rank, world), device)

    return model, optimizer, step


def train(spec: RunSpec, t: Techniques, data: TokenData, device: torch.device, events: EventWriter,
          before_first_step=lambda: None, run_dir: Path | None = None) -> tuple[torch.nn.Module, Trained]:
    mem, history = measure.DeviceMemory(device), artifacts.AllocatorHistory(device)
    events.emit("phase", phase="init")
    mem.reset()
    scaler = t.precision.grad_scaler(device.type)
    model, optimizer, step = trainer(spec, t, data, device, scaler)
    init_peak = mem.peak_allocated_mib()
    params = held_params(model)
    optimizer_steps = measure.StepCounter(optimizer)
    B, world, warmup = spec.batch_size, t.parallel.world_size, spec.warmup_steps
    steps = math.ceil(spec.samples / (B * world)) if spec.samples else spec.steps

    events.emit("phase", phase="train")
    before_first_step()
    mem.reset()  # the training peak covers warm-up too: the first step allocates optimizer state
    losses, first_step_s = [], None
    out = run_dir if t.parallel.rank == 0 else None  # rank 0 writes the files
    # The traced step runs eagerly (MemTracker is a dispatch mode, which torch.compile refuses), so
    # under compile=true the allocator records the compiled warm-up step before it instead: the
    # snapshot then shows the memory of the steps that are measured. Not the first, which compiles.
    compiled = snapshot_compiled_step(spec)
    for k in range(warmup - 1):
        if compiled == k:
            history.start()
        start = time.perf_counter()
        losses.append(step(k))
        if k == 0:  # with compile=true this step compiles the graphs
            first_step_s = measure.seconds_since(start, device)
        if compiled == k:
            history.stop(out)
    breakdown, traced_peak, warm_peaks, trace_oom, traced_alloc = None, None, {}, False, None
    if warmup >= 1:
        events.emit("phase", phase="trace")
        breakdown, traced_peak, warm_peaks, trace_oom, traced_alloc = last_warmup_step(
            lambda: losses.append(step(warmup - 1)), model, optimizer, t, device, mem,
            None if compiled is not None else history, out)
    events.emit("phase", phase="measure")
    timer, start, last_report = measure.StepTimer(device), time.monotonic(), 0.0
    for k in range(warmup, warmup + steps):
        timer.start()
        losses.append(step(k))
        timer.stop()
        now = time.monotonic()
        if now - last_report >= PROGRESS_EVERY_S or k == warmup + steps - 1:
            events.emit("progress", step=k - warmup + 1, steps=steps, loss=losses[-1].item(),
                        elapsed_s=now - start)
            last_report = now
    timed = mem.peaks()
    peaks = {k: largest([v, warm_peaks.get(k)]) for k, v in timed.items()}
    phase_peaks = {"warmup": warm_peaks.get("peak_allocated_mib"), "traced": traced_alloc,
                   "timed": timed["peak_allocated_mib"]}
    if peaks["peak_allocated_mib"] is None:  # no allocator stats on CPU: the traced tensor peak stands in
        peaks["peak_allocated_mib"] = traced_peak
    taken = optimizer_steps.count
    return model, Trained(steps=steps, times_ms=timer.times_ms(), peaks=peaks, breakdown=breakdown,
                          losses=rank_mean(losses, device), init_peak_mib=init_peak,
                          compile_s=first_step_s if spec.compile else None,
                          skipped_steps=warmup + steps - taken if taken is not None else None,
                          traced_step_oom=trace_oom, warmup=warmup,
                          loss_scale=scaler.get_scale() if scaler.is_enabled() else None, params=params,
                          phase_peaks=phase_peaks if any(v is not None for v in phase_peaks.values()) else None)


def run(job: dict, events: EventWriter, before_first_step=lambda: None) -> dict | None:
    """The whole grid point on this rank (`job`: the spec.json the job wrote); rank 0 returns
    {"metrics", "env", "diverged"} for the result event ("diverged": why the losses are not a
    measurement, or None)."""
    spec = RunSpec.of(job["config"])
    device = pick_device(spec.device)
    t = check_config(spec, device.type)
    device = t.parallel.setup(device)
    limit = MemoryLimit(spec.gpu_memory_gib, device)  # an emulated smaller GPU, if asked for
    limit.apply()
    artifacts.watch_for_oom(device)  # the worker writes oom_snapshot.pickle if one comes
    data = load_data(spec, t)
    torch.manual_seed(spec.seed)
    t.precision.setup()
    model, trained = train(spec, t, data, device, events, before_first_step, Path(job["run_dir"]))
    limit.check(trained.peaks["peak_allocated_mib"])
    events.emit("phase", phase="eval")
    eval_loss = evaluate(model, data, spec.batch_size, t, device, spec.eval_steps)
    events.emit("phase", phase="report")  # gathering every rank's figures, tearing down
    mine = {"peaks": trained.peaks, "times_ms": trained.times_ms, "init_peak_mib": trained.init_peak_mib,
            "host_peak_rss_mib": measure.host_peak_rss_mib(), "host": socket.gethostname(),
            "params": trained.params, "phase_peaks": trained.phase_peaks}
    ranks = all_ranks(mine)
    # Only on success: a failing rank exits at once (the worker reports and leaves), and torchrun
    # then stops the others; waiting for them in a barrier here would hang the group.
    t.parallel.teardown()
    if t.parallel.rank != 0:
        return None
    cuda = device.type == "cuda"
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_name": gpu_name,
        "gpu_total_mib": torch.cuda.get_device_properties(device).total_memory / measure.MIB if cuda else None,
        "world_size": t.parallel.world_size,
        # what host-bound times depend on: rank 0's CPUs (a gpu_pool point's own) and torch's threads on them
        "cpus": host_cpus.fmt(host_cpus.allowed()),
        "cpu_threads": torch.get_num_threads(),
        **limit.env(),
    }
    return {"metrics": metrics(spec, t, trained, ranks, eval_loss, data.loss_floor, gpu_name), "env": env,
            "diverged": trained.divergence()}
