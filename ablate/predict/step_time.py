"""Predicted seconds of one optimizer step (every micro-step and the optimizer step) of one rank.

What the step does comes from what the memory model already knows (`Work`, read off the analytic
model's shapes and sizes, ablate/predict/analytic.py); how fast a device does it from its datasheet
and the few efficiencies fit on recorded runs (`seconds`, ablate/hardware.py). Per micro-step:

- matmuls: PaLM's model FLOPs of its tokens (a frozen weight's 4 a token, a trainable one's 6),
  plus the forward the checkpoint and loss options run again (their recompute_fraction of the 2N
  forward FLOPs), at MATMUL_EFFICIENCY of the dense peak for the compute dtype, lower for a
  micro-batch of few tokens (HALF_RATE_TOKENS); a 16-bit LM head whose rows break tensor-core
  alignment (GPT-2's 50,257) UNALIGNED_HEAD times slower;
- device-memory traffic of what the matmuls do not cover, at HBM_EFFICIENCY of the bandwidth:
  every byte a layer keeps for backward written and read in forward, read in backward and its
  gradient made there (ACTIVATION_PASSES; a recomputed byte is made again), and the logits'
  passes through the loss (`logit_bytes`);
- the host link (activation offload: what the step keeps for backward, out and back; parameter
  offload: the parameters in for forward and for backward), at LINK_EFFICIENCY of the link;
- the host's own work, launching it all from Python (HOST_LAYER_S per layer, recomputed ones
  again), which runs ahead of the device and hides under its time.

Per optimizer step: the step's reads and writes of parameters, gradients and states
(OPTIMIZER_PASSES), on the device, or on the host with the link's copies when offloaded; its host
work per tensor and state. A step that waits for the device on the host (an optimizer stepping in
backward that reads tensor values) adds host time to device time instead; FSDP adds its wait per
unit gathered (FSDP_UNIT_S). Communication between ranks is not modelled.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import sys
from dataclasses import dataclass

from ablate import hardware
from ablate.hardware import Device, flops_per_token
from ablate.models import param_change
from ablate.predict.analytic import sized
from ablate.predict.model_state import BYTES
from ablate.predict.timeline import Step

# Counted, not fit: each byte a layer keeps for backward is written and read once in forward, read
# again in backward, and a gradient of its size made there.
ACTIVATION_PASSES = 4
# Counted for torch's foreach and for-loop AdamW: about 20 tensor-sized reads and writes per
# parameter, against the 7 of one read and write of parameter, gradient and two states; fused: one.
OPTIMIZER_PASSES = {"fused": 1, "other": 3}
# Logit bytes per element of inductor's two fused loss kernels: their device time in
# benchmarks/results/NVIDIA-H100-80GB-HBM3/profile_step.md and NVIDIA-H200/profile_step.md (171 and
# 147 ms for 26.4G logits) at HBM_EFFICIENCY of each card's bandwidth.
COMPILED_LOGIT_BYTES = 20
# Not fit (no recorded compiled row is bound by the host): compiled code launches a fraction of
# eager's kernels, from fewer Python calls.
COMPILED_HOST_SHARE = 1 / 3
# Not fit (no recorded row steps on the host): a server socket's achieved DRAM bandwidth for the
# CPU optimizer step of offload=optimizer and offload=params.
HOST_STEP_GBS = 40.0


@dataclass
class Work:
    """One optimizer step of one rank, as amounts: per micro-step unless named `step_`."""

    micro_steps: int
    tokens: int  # one micro-batch's tokens
    dtype: str  # the compute dtype: PEAK_TFLOPS's column
    flops: float  # matmul FLOPs, recompute included
    unaligned_flops: float  # of them, the LM head's when its rows break tensor-core alignment
    memory_bytes: float  # device-memory traffic beyond the matmuls: activations, logits
    link_bytes: float  # over the host link: activation offload, parameter offload
    host_layers: float  # layers launched from Python, recomputed ones twice
    fsdp_units: int  # FSDP units gathered (0 without FSDP)
    compiled: bool
    step_bytes: float  # the optimizer step's device-memory traffic
    step_host_bytes: float  # ... its host-memory traffic when it runs on the host
    step_link_bytes: float  # gradients out and parameters back for a step on the host
    step_tensors: float  # parameter tensors x the states each keeps: the step's host work
    host_waits: bool  # the host waits for the device inside backward: nothing hides under anything


def logit_bytes(c: int, compiled: bool, from_hidden: bool, recomputed: bool) -> float:
    """Device-memory bytes per logit element (tokens x head rows) of the loss, in the compute
    dtype's `c` bytes, counted from its ops: the head's output (c) and its fp32 copy (c + 4 where c
    != 4); the standard loss's log-softmax (read twice, written: 12) and backward (the one-hot
    gradient 4, log-softmax backward 16, the cast back); the chunked and fused losses' logsumexp
    (16) and in-place softmax gradient (24, the cast back), the chunked loss making the logits
    again in backward. Compiled: COMPILED_LOGIT_BYTES, each time the logits are made."""
    if compiled:  # inductor fuses the loss's pointwise ops, the chunked and fused losses' too
        return COMPILED_LOGIT_BYTES * (2 if recomputed else 1)
    cast = c + 4 if c != 4 else 0
    make = c + cast
    if not from_hidden:
        return make + 12 + 4 + 16 + cast
    return make + 16 + (make if recomputed else 0) + 24 + cast


class _Offloaded(Step):
    """The step played as the memory model plays it, counting what activation offload sends to the
    host in one micro-step's forward: every byte the model keeps for backward."""

    sent = 0.0
    _forward = False

    def keep(self, nbytes: float) -> float:
        if self._forward and self.sizes.offload_acts:
            self.sent += nbytes
        return super().keep(nbytes)

    def forward(self) -> None:
        self._forward = True
        super().forward()
        self._forward = False


def work_of(spec) -> Work:
    """What one optimizer step of this point (an ablate.spec.RunSpec) does, on one rank."""
    t, shapes, sizes = sized(spec)
    family, micro = t.model, t.accumulation.steps
    tokens = shapes.b * shapes.s
    again = _recomputed(spec, t)
    (n, frozen), (layers, width) = family.flops_split(param_change(t)), family.dims()
    in_layers, head_again = min(again.layers_again / again.layers, 1.0), again.head_again
    # Run again: 2 FLOPs per weight a token multiplies by, and attention's forward (4LHT of the
    # PaLM count's 12LHT) in the layers recomputed.
    forward_again = 2 * again.again + 4 * layers * width * spec.seq_len * in_layers
    flops = (flops_per_token(n, layers, width, spec.seq_len, frozen) + forward_again) * tokens
    dtype = t.precision.compute_dtype
    rows = shapes.vocab if t.loss.from_hidden else shapes.padded_vocab
    align = {"bf16": 8, "fp16": 8, "tf32": 4}.get(dtype)  # 16 bytes of the tensor cores' operands
    # The head's FLOPs a token (a frozen head makes no weight gradient: 4, not 6), its recompute's besides.
    head_flops = (4 if (shapes.lm_head or shapes.embedding) in shapes.frozen else 6) + 2 * head_again
    unaligned = head_flops * rows * shapes.h * tokens if align and not sizes.compiled and rows % align else 0.0
    kept = sum(full for _, full in sizes.blocks) + sum(full - saved for saved, full in sizes.blocks)
    # A tiled MLP's tensors are made all the same, slice by slice: in forward, in a recomputed
    # layer's forward, and once more by each slice's recompute in backward.
    kept += sum(sizes.mlp_untiled * (3 if full > saved else 2) for saved, full in sizes.blocks)
    logits = tokens * rows * logit_bytes(sizes.compute_bytes, sizes.compiled, t.loss.from_hidden, head_again > 0)
    offload = _Offloaded(shapes, sizes)
    offload.play(spec.batch_size * spec.seq_len)
    on_host, p = spec.device != "cpu", BYTES[t.precision.param_dtype]
    numel = sizes.params / p if sizes.params else sum(shapes.param_numels.values())  # this rank's
    params_in = 2 * numel * p if t.offload.params_on_host and on_host else 0.0  # for forward and backward
    grads = sum(sizes.grads.values())
    host_step = on_host and (t.offload.states_on_host or t.offload.params_on_host)
    states = sizes.states if not host_step else _state_bytes(t, shapes)
    step = (2 * numel * p + grads + 2 * states) * OPTIMIZER_PASSES[
        "fused" if getattr(t.optimizer, "implementation", None) == "fused" else "other"]
    fsdp = t.parallel.shards_params or t.offload.shards_params
    return Work(micro_steps=micro, tokens=tokens, dtype=dtype, flops=flops, unaligned_flops=unaligned,
                memory_bytes=ACTIVATION_PASSES * kept + logits, link_bytes=2 * offload.sent / micro + params_in,
                host_layers=shapes.layers * (1 + in_layers),
                fsdp_units=shapes.layers + 1 if fsdp else 0,
                compiled=sizes.compiled, step_bytes=0.0 if host_step else step,
                step_host_bytes=step if host_step else 0.0,
                step_link_bytes=2 * numel * p if host_step else 0.0,
                step_tensors=len(shapes.param_numels) * round(states / max(numel * p, 1)),
                host_waits=t.optimizer.in_backward and t.optimizer.reads_values)


def _state_bytes(t, shapes) -> float:
    """The optimizer's states in the host's memory (where an offloaded step keeps them)."""
    p = BYTES[t.precision.param_dtype]
    return sum(t.optimizer.state_bytes(shape, p, "cpu", name) for name, shape in shapes.param_shapes.items()
               if name not in shapes.frozen)


@dataclass(frozen=True)
class Recompute:
    """What the checkpoint, loss and tiling options run again in backward, as matmul weights (half a
    token's FLOPs): each option's recompute_fraction, which it sets when applied to a model."""

    weights: float  # all of the model's
    again: float  # of them, run again by any of those options
    layers: float  # the decoder layers' own
    layers_again: float  # of those, run again by the checkpoint option
    head_again: float  # the loss's recompute, as a share of the head's (1: the chunked loss)

    def __sub__(self, other: "Recompute") -> "Recompute":  # what the layers of one sample add to another's
        return Recompute(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __add__(self, other: "Recompute") -> "Recompute":
        return Recompute(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> "Recompute":
        return Recompute(*(a * k for a in dataclasses.astuple(self)))


@dataclass(frozen=True)
class _Applied:
    """A copy of a model with copies of the point's loss, tiling and checkpoint options applied to
    it as the build applies them: its matmul weights, and what each option runs again."""

    weights: float  # the whole model's
    layers: float  # the decoder layers'
    head: float  # the LM head's
    loss: float  # the loss option's recompute_fraction
    checkpoint: float  # the checkpoint option's
    tiling: object  # the tiling option, applied: its share run again depends on the sequence's length

    def at(self, seq_len: int) -> Recompute:
        """What the options run again over `seq_len` tokens. A tiled MLP's slices run their forward
        once more whether the layer is recomputed or not."""
        again = self.loss + self.checkpoint + self.tiling.recomputed(seq_len)
        return Recompute(weights=self.weights, again=again * self.weights, layers=self.layers,
                         layers_again=self.checkpoint * self.weights, head_again=self.loss * self.weights / self.head)


# A model and its checkpoint, loss and tiling options -> the copies they were applied to: the same
# for every batch size and sequence length, so a batch or length search applies them once.
_APPLIED: dict[str, tuple[_Applied, _Applied | None, float]] = {}
SAMPLE_LAYERS = 12  # the samples a deep model's recompute is read off: 12 and 24 layers


def _recomputed(spec, t) -> Recompute:
    """What the point's checkpoint and loss options run again, for the whole model. Applied to
    copies of meta-device models: the whole model up to 24 layers, else samples of 12 and 24 layers
    whose difference is what 12 more layers add."""
    key = json.dumps([spec.groups[g] for g in ("model", "checkpoint", "loss", "tiling")], sort_keys=True, default=str)
    if key not in _APPLIED:
        family, n = t.model, t.model.n_layers
        small = family.sample(SAMPLE_LAYERS) if n is not None and n > 2 * SAMPLE_LAYERS else None
        large = family.sample(2 * SAMPLE_LAYERS) if small is not None else None
        if large is not None:
            _APPLIED[key] = (_applied(t, small), _applied(t, large), (n - SAMPLE_LAYERS) / SAMPLE_LAYERS)
        else:
            _APPLIED[key] = (_applied(t, family.meta_model), None, 0.0)
    first, second, more = _APPLIED[key]
    if second is None:
        return first.at(spec.seq_len)
    return first.at(spec.seq_len) + (second.at(spec.seq_len) - first.at(spec.seq_len)) * more


def _applied(t, model) -> _Applied:
    """Copies of the point's loss, tiling and checkpoint options applied to a copy of `model` as the
    build applies them (the loss attached first)."""
    model, loss, checkpoint = copy.deepcopy(model), copy.copy(t.loss), copy.copy(t.checkpoint)
    tiling, adapter = copy.copy(t.tiling), t.model.adapter
    loss.attach(model, adapter)
    tiling.apply(model, adapter)
    checkpoint.apply(model, adapter)
    return _Applied(weights=adapter.matmul_weights([model]), layers=adapter.matmul_weights(adapter.layer_list(model)),
                    head=model.get_submodule(adapter.lm_head).weight.numel(), loss=loss.recompute_fraction,
                    checkpoint=checkpoint.recompute_fraction, tiling=tiling)


def device_of(spec, seen: str | None) -> Device | None:
    """The device a point's step is timed on: the CPU for device=cpu; else the card gpu_model
    names, else the GPU the worker sees (`seen`, its name as the driver gives it), else the card
    a plan without one is made for (hardware.PLANNED). None for a GPU the table does not know."""
    if spec.device == "cpu":
        return hardware.CPU
    return hardware.device(spec.extra.get("gpu_model") or seen or hardware.PLANNED)


def seconds(work: Work, dev: Device, peak_override: float | None = None) -> float | None:
    """The predicted seconds of `work` on `dev`; None without a peak for its compute dtype."""
    split = parts(work, dev, peak_override)
    if split is None:
        return None
    device, host, waits = split["device"], split["host"], split["waits"]
    # On a CPU the host is the device: one does the other's work.
    return (device + host if dev.link_gbs == 0 or work.host_waits else max(device, host)) + waits


def parts(work: Work, dev: Device, peak_override: float | None = None) -> dict | None:
    """`work`'s seconds on `dev` by who spends them: the device's (`device`), the host's launching
    it (`host`, hidden under the device's unless the host waits for it), FSDP's waits (`waits`);
    None without a peak for its compute dtype."""
    peak = dev.peak_tflops(work.dtype, peak_override)
    if not peak:
        return None
    efficiency = hardware.MATMUL_EFFICIENCY["fp32" if work.dtype == "fp32" else "tensor"]
    rate = peak * 1e12 * efficiency * work.tokens / (work.tokens + hardware.HALF_RATE_TOKENS)
    memory = dev.memory_gbs * 1e9 * hardware.HBM_EFFICIENCY
    link = dev.link_gbs * 1e9 * hardware.LINK_EFFICIENCY
    micro = (work.flops + work.unaligned_flops * (hardware.UNALIGNED_HEAD - 1)) / rate \
        + work.memory_bytes / memory + (work.link_bytes / link if link else 0.0)
    step = work.step_bytes / memory + work.step_host_bytes / (HOST_STEP_GBS * 1e9) \
        + (work.step_link_bytes / link if link else 0.0)
    launch = work.host_layers * hardware.HOST_LAYER_S
    host = work.micro_steps * launch * (COMPILED_HOST_SHARE if work.compiled else 1) \
        + work.step_tensors * hardware.HOST_TENSOR_S
    return {"device": work.micro_steps * micro + step, "host": host,
            "waits": work.micro_steps * work.fsdp_units * hardware.FSDP_UNIT_S}


def step_time_s(spec, seen_gpu: str | None = None) -> float | None:
    """The predicted seconds of one optimizer step of this point (an ablate.spec.RunSpec) on the
    device it is timed on (`device_of`); None where that device is unknown or the time cannot be
    predicted (a warning says why)."""
    dev = device_of(spec, seen_gpu)
    if dev is None:
        return None
    try:
        return seconds(work_of(spec), dev, spec.peak_tflops)
    except Exception as exc:  # a model the analytic sizes do not describe: a memory prediction, no time
        _note_once(f"note: no step time predicted: {type(exc).__name__}: {exc}")
        return None


@functools.cache
def _note_once(line: str) -> None:
    """A note printed once per process (a sweep's points, a batch search's probes share one)."""
    print(line, file=sys.stderr)
