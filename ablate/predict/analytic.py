"""The analytic memory model: closed-form tensor sizes, played through one training step.

Sizes come from the model's parameter shapes (built on the meta device: nothing is allocated)
and from the activations each op saves for backward. Activations per transformer layer start
from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
s·b·h·(34 + 5·a·s/h) bytes in 16-bit with dropout. This GPT has no dropout masks (p=0 returns
its input) and uses SDPA, so no (s, s) score matrix is stored and the 5as/h term is gone: what a
layer saves is 16·s·b·h elements (below, `_block_saves`) plus LayerNorm statistics and SDPA's
log-sum-exp, 32·s·b·h bytes in 16-bit where the paper counts 34 with its two dropout masks.

The step is played as a timeline of allocations and frees in the order a real step makes them
(forward block by block, backward in reverse with recompute, optimizer step, zero_grad), so the
peak is where the real one is and the breakdown at the peak is comparable with MemTracker's.
Categories follow MemTracker: tensors made in forward (and recomputed ones) are activations,
other tensors made in backward are "other", optimizer-step temporaries count as "optimizer".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ablate.build import Techniques, gpt_config
from ablate.model import GPT
from ablate.predict import Prediction
from ablate.predict.timeline import Timeline, Unmodelled
from ablate.techniques import checkpoint as ckpt
from ablate.techniques import optimizer as opt
from ablate.techniques import parallel as par
from ablate.techniques.offload import Activations, OptimizerState, Params

MIB = 2**20
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Shapes:
    """One rank's micro-batch and the model's sizes. Element counts; `sbh` is one (B, T, C) tensor."""

    b: int  # micro-batch per rank
    s: int  # sequence length
    h: int  # n_embd
    heads: int
    layers: int
    vocab: int
    param_numels: dict  # parameter name -> elements (the tied lm_head counted once, as wte)
    param_shapes: dict  # parameter name -> shape
    groups: list  # the optimizer's parameter groups: parameter shapes in the order it steps them

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def sb(self) -> int:
        return self.s * self.b


def _shapes(cfg: dict, t: Techniques) -> Shapes:
    mc = gpt_config(cfg["model"])
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = GPT(mc)
    params = dict(model.named_parameters())
    groups = [[tuple(p.shape) for p in g["params"]] for g in t.optimizer.param_groups(model)]
    return Shapes(b=cfg["batch_size"] // t.accumulation.steps, s=cfg["seq_len"], h=mc.n_embd, heads=mc.n_head,
                  layers=mc.n_layer, vocab=mc.vocab_size, param_numels={n: p.numel() for n, p in params.items()},
                  param_shapes={n: tuple(p.shape) for n, p in params.items()}, groups=groups)


def _block_saves(t: Techniques, index: int, sh: Shapes, r: int, c: int) -> tuple[float, float]:
    """(bytes block `index` keeps for backward beyond its input, bytes it keeps without recompute).
    What it does not keep is made again in backward, just before the block's own backward.

    r: bytes/element of the residual stream (the parameter dtype; fp32 under autocast).
    c: bytes/element of the compute dtype (what Linear, SDPA and GELU produce).
    Without recompute a block saves (in units of s·b·h): ln_1 out 1c, qkv 3c, SDPA out 1c,
    x + attn 1r, ln_2 out 1c, c_fc out 4c, GELU out 4c = 15, plus its input (the previous block's
    output, counted there); LayerNorm mean and rstd (2·s·b fp32 each LayerNorm) and SDPA's
    log-sum-exp (s·b·heads fp32).
    """
    sbh, sb = sh.sbh, sh.sb
    stats, lse = 2 * 2 * sb * 4, sb * sh.heads * 4
    full = (1 + 3 + 1 + 1 + 4 + 4) * sbh * c + sbh * r + stats + lse
    option = t.checkpoint
    if isinstance(option, ckpt.Blocks):  # only the block input is kept, by the wrapper
        return (0.0 if (index + 1) % option.every_n == 0 else full), full
    if isinstance(option, ckpt.Sublayer):  # the sub-layer's input (a LayerNorm output) is kept
        return full - (4 * sbh * c + lse if option.part == "attn" else 8 * sbh * c), full
    if isinstance(option, ckpt.SelectiveOps):
        # Kept: matmul and SDPA outputs (qkv 3, attn proj 1, fc 4, mlp proj 1, SDPA 1 + lse);
        # recomputed: LayerNorm outputs and statistics, the residual add, GELU.
        return (3 + 1 + 4 + 1 + 1) * sbh * c + lse, full
    if isinstance(option, ckpt.Layers):
        saved = full
        if "attention" in option.types:  # q, k, v, SDPA out and lse recomputed; its input kept
            saved -= 4 * sbh * c + lse
        if "layernorm" in option.types:  # statistics recomputed (the input is kept either way)
            saved -= stats
        return saved, full  # a wrapped Linear or GELU keeps exactly what it kept before
    if isinstance(option, ckpt.NoCheckpoint):
        return full, full
    raise Unmodelled(f"no memory model for checkpoint option {type(option).__name__}")


def _local_shape(shape: tuple, world: int) -> tuple:
    """A parameter's shape on rank 0 when FSDP shards it over `world` ranks: dim 0 in chunks of
    ceil(rows / world), the last ranks' padded to that size, so rank 0 holds the largest shard."""
    return (-(-shape[0] // world), *shape[1:])


def _state_bytes(t: Techniques, shape: tuple, d: int, device: str) -> float:
    """Optimizer state bytes on the training device for one parameter tensor of `shape` (its
    shard under FSDP: torch keeps a DTensor parameter's states in its local shape)."""
    o, numel = t.optimizer, math.prod(shape)
    # torch keeps Adam/Adafactor's `step` as a 0-d fp32 tensor on the host unless fused: whole on
    # every rank, one per parameter tensor.
    step = 4 if device == "cpu" or getattr(o, "implementation", "") == "fused" else 0
    if isinstance(o, opt.AdamW8bit):
        if numel < o.min_8bit_size:
            return 2 * numel * 4  # small tensors keep fp32 states
        return 2 * numel + 2 * math.ceil(numel / 256) * 4  # uint8 states + one fp32 absmax per 256 values
    if isinstance(o, opt.AdamW):
        return 2 * numel * d + step
    if isinstance(o, opt.SGD):
        return numel * d if o.momentum else 0
    if isinstance(o, opt.Adafactor):
        if len(shape) < 2:
            return numel * d + step
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return (rows + cols) * d + step
    raise Unmodelled(f"no memory model for optimizer option {type(o).__name__}")


def _for_loop(groups: list[list[int]], d: int, per_tensor: int) -> float:
    """Temporaries of a for-loop step: `per_tensor` tensor-sized ones for the current parameter,
    plus the previous parameter's last one, which a loop variable keeps until reassigned."""
    return max((prev + per_tensor * cur) * d for g in groups for prev, cur in zip([0, *g], g))


def _step_temp_bytes(t: Techniques, groups: list[list[int]], d: int, device: str) -> float:
    """Optimizer temporaries at their largest during the step (bytes)."""
    o = t.optimizer
    if isinstance(o, opt.AdamW8bit):
        return 0.0  # one fused kernel per tensor
    if isinstance(o, opt.AdamW):
        impl = o.implementation
        if impl == "fused":
            return 0.0
        if impl == "foreach" or (impl == "default" and device == "cuda"):  # torch's default on CUDA
            return max(sum(g) for g in groups) * d  # sqrt(exp_avg_sq) for a whole group at once
        return _for_loop(groups, d, 2)  # sqrt(exp_avg_sq) and its quotient
    if isinstance(o, opt.Adafactor):
        return _for_loop(groups, d, 1)  # the row x col variance estimate, scaled in place
    if isinstance(o, opt.SGD):
        return _for_loop(groups, d, 1) if o.weight_decay else 0.0  # grad + wd * param
    raise Unmodelled(f"no memory model for optimizer option {type(o).__name__}")


@dataclass
class _Unit:
    """One FSDP unit on one rank (bytes): a transformer block, or the root (embeddings, ln_f)."""

    gathered: float  # its parameters all-gathered: every rank's padded shard, in the compute dtype
    sharded_grads: float  # this rank's gradient shards after the reduce-scatter (parameter dtype)
    reduce_input: float  # the flat reduce-scatter input: the whole unit's gradients (reduce dtype)


@dataclass
class _Bytes:
    """Per-rank sizes the timeline plays with (bytes)."""

    params: float  # resident parameters on the device: whole, or this rank's shards (FSDP)
    grads: dict  # parameter name -> its gradient as backward makes it (whole: FSDP shards it after)
    states: float
    step_temp: float
    other: float  # persistent extras: DDP buckets
    root: _Unit | None = None  # FSDP only
    block: _Unit | None = None
    reshard: bool = True  # FSDP frees gathered parameters after forward (ZeRO-3), else after backward


def _sizes(t: Techniques, sh: Shapes, device: str) -> _Bytes:
    pd = BYTES[t.precision.param_dtype]
    gd = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]  # FSDP's mp param_dtype
    p = t.parallel
    world = max(p.world_size, 1) if p.shards_params else 1
    local = {n: math.prod(_local_shape(s, world)) for n, s in sh.param_shapes.items()}
    offloaded = isinstance(t.offload, Params)  # FSDP CPU offload: shards, their grads and states on the host
    states = sum(_state_bytes(t, _local_shape(s, world), pd, device) for s in sh.param_shapes.values())
    if isinstance(t.optimizer, opt.AdamW8bit) and max(local.values()) >= t.optimizer.min_8bit_size:
        states += 2 * 256 * 4  # the two fp32 quantisation maps, shared by every 8-bit tensor
    if offloaded or isinstance(t.offload, OptimizerState):
        states = 0.0
    grads = {n: numel * (gd if p.shards_params else pd) for n, numel in sh.param_numels.items()}
    if isinstance(t.offload, OptimizerState) and t.offload.gradients:
        grads = dict.fromkeys(grads, 0.0)
    groups = [[math.prod(_local_shape(s, world)) for s in g] for g in sh.groups]
    z = _Bytes(params=0.0 if offloaded else sum(local.values()) * pd, grads=grads, states=states,
               step_temp=0.0 if states == 0 else _step_temp_bytes(t, groups, pd, device),
               other=sum(sh.param_numels.values()) * pd if isinstance(p, par.DDP) else 0.0)  # DDP's buckets
    if p.shards_params:
        reduce_d = 4 if t.precision.autocast_dtype else pd  # FSDP reduces in fp32 under autocast

        def unit(names: list[str]) -> _Unit:
            shard = sum(local[n] for n in names)
            return _Unit(gathered=shard * world * gd, sharded_grads=0.0 if offloaded else shard * pd,
                         reduce_input=shard * world * reduce_d)

        z.root = unit([n for n in local if not n.startswith("transformer.h.")])
        z.block = unit([n for n in local if n.startswith("transformer.h.0.")])
        z.reshard = getattr(p, "reshard_after_forward", getattr(p, "sharding", "full") == "full")
    return z


class _Step:
    """One optimizer step (every micro-step's forward and backward, then the optimizer step)
    played on a Timeline, optimizer states already allocated. Bytes on one rank."""

    def __init__(self, t: Techniques, sh: Shapes, z: _Bytes, device: str):
        self.t, self.sh, self.z, self.tl = t, sh, z, Timeline()
        self.c = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]  # compute dtype
        self.r = BYTES[t.precision.param_dtype]  # the residual stream (autocast adds in fp32)
        self.offload_acts = isinstance(t.offload, Activations) and device != "cpu"  # else already on the host
        # FSDP with mixed precision sums whole gradients over micro-steps in fp32 (its reduce dtype),
        # beside .grad (FSDPParam.unsharded_accumulated_grad), not in the compute-dtype .grad.
        self.upcast = z.root is not None and bool(t.precision.autocast_dtype) and t.accumulation.steps > 1
        layer_stats = isinstance(t.checkpoint, ckpt.Layers) and "layernorm" in t.checkpoint.types
        self.ln_f_stats = 0 if layer_stats else 2 * sh.sb * 4
        self.blocks = [_block_saves(t, i, sh, self.r, self.c) for i in range(sh.layers)]
        self.block_names = [[n for n in z.grads if n.startswith(f"transformer.h.{i}.")] for i in range(sh.layers)]
        self.root_names = [n for n in z.grads if not n.startswith("transformer.h.")]
        self.have_grads = False
        # Autocast casts each Linear's weight and bias to the compute dtype at first use, caches the
        # copy until forward ends, and the matmul saves it for backward. FSDP's mixed precision
        # gathers parameters already in that dtype, so nothing is cast there.
        casts = bool(t.precision.autocast_dtype) and not t.parallel.shards_params
        linear = sum(v for n, v in sh.param_numels.items() if n.startswith(("transformer.h.0.attn.",
                                                                          "transformer.h.0.mlp.")))
        self.block_cast = linear * self.c if casts else 0
        self.lm_head_cast = sh.vocab * sh.h * self.c if casts else 0

    def keeps_cast(self, saved: float) -> bool:
        """Whether a block's cast weights stay on the device from its forward to its backward:
        not when the whole block is recomputed (Korthikanti's full recompute: `saved` is 0), nor
        when saved tensors go to the host. (A partly recomputed block is counted as keeping them.)"""
        return saved > 0 and not self.offload_acts

    def keep(self, nbytes: float) -> float:
        return 0.0 if self.offload_acts else nbytes  # save_on_cpu: saved tensors live on the host

    def play(self, batch_tokens: int) -> Timeline:
        tl, z, steps = self.tl, self.z, self.t.accumulation.steps
        tl.alloc("params", z.params)
        tl.alloc("optimizer", z.states)
        tl.alloc("other", z.other)
        tl.alloc("activations", batch_tokens * 8 * 2)  # int64 inputs and targets of the whole batch
        for k in range(steps):
            self.forward()
            self.backward(sync=k == steps - 1)  # FSDP keeps whole gradients until the last micro-step
            self.have_grads = True
        tl.transient("optimizer", z.step_temp)
        tl.free("grads", tl.now["grads"])  # zero_grad(set_to_none=True)
        return tl

    def forward(self) -> None:
        tl, sh, z, c, r, keep = self.tl, self.sh, self.z, self.c, self.r, self.keep
        sbh, sb, V = sh.sbh, sh.sb, sh.vocab
        self.gather(z.root, "activations")
        # Embedding outputs, then x0 = wte(idx) + wpe(pos): the residual stream (B, T, C).
        tl.transient("activations", sbh * r + sh.s * sh.h * r)
        tl.alloc("activations", keep(sbh * r))
        for saved, full in self.blocks:
            self.gather(z.block, "activations")
            tl.alloc("activations", self.block_cast)
            tl.transient("activations", min(full - saved, 8 * sbh * c))  # made and dropped inside
            tl.alloc("activations", keep(saved) + keep(sbh * r))  # kept + the block output
            if z.reshard:
                self.release(z.block)
        # ln_f statistics and output, logits (B, T, V), their fp32 copy, log-softmax (fp32, kept).
        tl.alloc("activations", keep(self.ln_f_stats + sbh * c) + self.lm_head_cast)
        tl.alloc("activations", sb * V * c + (sb * V * 4 if c != 4 else 0))
        tl.alloc("activations", keep(sb * V * 4))
        tl.free("activations", sb * V * c + (sb * V * 4 if c != 4 else 0))  # logits not kept
        # Autocast's cache goes with the forward: casts backward does not need on the device with it.
        tl.free("activations", sum(self.block_cast for saved, _ in self.blocks if not self.keeps_cast(saved))
                + self.lm_head_cast - keep(self.lm_head_cast))
        if z.reshard:  # the root's forward ends with the loss; its backward gathers it again
            self.release(z.root)

    def backward(self, sync: bool) -> None:
        tl, sh, z, c, r, keep = self.tl, self.sh, self.z, self.c, self.r, self.keep
        sbh, sb, V = sh.sbh, sh.sb, sh.vocab
        if z.reshard:
            self.gather(z.root, "other")
        # Loss -> log-softmax -> logits -> lm_head.
        tl.alloc("other", 2 * sb * V * 4)  # d log-softmax, d logits
        tl.free("activations", keep(sb * V * 4))
        tl.free("other", sb * V * 4)
        if c != 4:
            tl.transient("other", sb * V * c)
        # lm_head's share of the tied wte gradient waits in autograd's buffer (a temporary) until
        # the embedding's share is added; only then does it become wte.grad.
        wte = z.grads["transformer.wte.weight"]
        tl.alloc("other", sbh * c + wte)  # d ln_f out, lm_head's d wte
        tl.free("other", sb * V * 4)
        tl.transient("activations", self.lm_head_cast - keep(self.lm_head_cast))  # back from the host
        tl.free("activations", keep(sbh * c + self.ln_f_stats + sbh * r + self.lm_head_cast))  # and x_L, ln_f's input
        tl.alloc("other", sbh * r)  # d x_L (replaces d ln_f out)
        tl.free("other", sbh * c)
        for i in reversed(range(sh.layers)):
            saved, full = self.blocks[i]
            if z.reshard:
                self.gather(z.block, "other")
            back = full - saved + (saved if self.offload_acts else 0)  # recomputed, or copied back from the host
            back += 0 if self.keeps_cast(saved) else self.block_cast  # cast again, or copied back
            tl.alloc("activations", back)
            tl.transient("other", 8 * sbh * c)  # d c_fc out and d GELU out alive together
            for n in self.block_names[i]:
                self.grad(z.grads[n])
            kept = keep(saved) + (self.block_cast if self.keeps_cast(saved) else 0)
            tl.free("activations", kept + back + (keep(sbh * r) if i else 0))  # and its input (x0 below)
            self.reduce(z.block, self.block_names[i], sync)
            self.release(z.block)
        # Embedding backward: its dense (V, C) gradient and lm_head's share are summed out of place
        # (three wte-sized tensors alive at once); the sum becomes wte.grad, or is added into it.
        tl.alloc("other", 2 * wte)
        tl.free("other", 3 * wte)
        for n in ["transformer.wte.weight", *(n for n in self.root_names if n != "transformer.wte.weight")]:
            self.grad(z.grads[n])
        tl.free("activations", keep(sbh * r))
        tl.free("other", sbh * r)
        self.reduce(z.root, self.root_names, sync)
        self.release(z.root)

    def grad(self, nbytes: float) -> None:
        """A parameter's gradient arrives: new, or added into the one from an earlier micro-step
        (briefly both), or stepped and freed at once (optimizer.in_backward)."""
        if self.t.optimizer.in_backward or (self.have_grads and not self.upcast):
            self.tl.transient("grads", nbytes)
        else:
            self.tl.alloc("grads", nbytes)

    def gather(self, unit: _Unit | None, kind: str) -> None:
        """FSDP all-gathers a unit's parameters into one flat buffer (labelled `kind`: MemTracker
        calls it an activation in forward, other in backward), copies them out into the whole
        parameters, then frees the buffer."""
        if unit:
            self.tl.alloc(kind, unit.gathered)
            self.tl.alloc("params", unit.gathered)
            self.tl.free(kind, unit.gathered)

    def release(self, unit: _Unit | None) -> None:
        if unit:
            self.tl.free("params", unit.gathered)

    def reduce(self, unit: _Unit | None, names: list[str], sync: bool) -> None:
        """FSDP after a unit's backward: on the last micro-step its whole gradients are copied into
        one flat buffer for the reduce-scatter and freed, and this rank's shard of the sum becomes
        its gradient; on earlier ones they wait (in fp32 beside .grad under mixed precision)."""
        if not unit or self.t.optimizer.in_backward:
            return
        whole = ("grads", sum(self.z.grads[n] for n in names))
        if self.upcast:
            summed = ("other", whole[1] / self.c * 4)
            if not self.have_grads:  # the first micro-step converts .grad; later ones add into it
                self.tl.alloc(*summed)
            self.tl.free(*whole)
            whole = summed
        if sync:
            self.tl.alloc("other", unit.reduce_input)
            self.tl.free(*whole)
            self.tl.alloc("grads", unit.sharded_grads)
            self.tl.free("other", unit.reduce_input)


def analytic(cfg: dict) -> Prediction:
    """Predict one rank's device memory for a resolved config (no torch allocation)."""
    t = Techniques.from_config(cfg)
    device = "cpu" if cfg["device"] == "cpu" else "cuda"  # auto: the GPU the user plans on
    sh = _shapes(cfg, t)
    tl = _Step(t, sh, _sizes(t, sh, device), device).play(cfg["batch_size"] * cfg["seq_len"])
    return Prediction(peak_mib=tl.peak / MIB, breakdown_mib={k: v / MIB for k, v in tl.at_peak.items()},
                      category_max_mib={k: v / MIB for k, v in tl.max.items()}, method="analytic",
                      steady_mib={k: v / MIB for k, v in tl.now.items()})
