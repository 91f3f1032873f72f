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
    groups: list  # the optimizer's parameter groups: element counts in the order it steps them

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
    groups = [[p.numel() for p in g["params"]] for g in t.optimizer.param_groups(model)]
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


def _state_bytes(t: Techniques, shape: tuple, numel: int, d: int, device: str) -> float:
    """Optimizer state bytes on the training device for one parameter tensor."""
    o = t.optimizer
    # torch keeps Adam/Adafactor's `step` as a 0-d fp32 tensor on the host unless fused.
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
class _Bytes:
    """Per-rank sizes the timeline plays with (bytes)."""

    params: float  # resident parameters on the device
    grads: dict  # parameter name -> gradient bytes resident after backward
    states: float
    step_temp: float
    unsharded_block: float  # one block's parameters all-gathered for compute (FSDP), else 0
    unsharded_root: float  # embeddings + ln_f all-gathered for the whole step (FSDP root), else 0
    keep_unsharded: bool  # FSDP without reshard_after_forward: gathered blocks stay until backward
    other: float  # persistent extras: DDP buckets


def _sizes(t: Techniques, sh: Shapes, device: str) -> _Bytes:
    pd = BYTES[t.precision.param_dtype]
    gather_d = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]  # FSDP's mp param_dtype
    p = t.parallel
    world = max(p.world_size, 1)
    shard = world if p.shards_params else 1
    names = list(sh.param_numels)
    total = sum(sh.param_numels.values())
    offloaded = isinstance(t.offload, Params)  # FSDP CPU offload: shards, grads and states on the host
    states = sum(_state_bytes(t, sh.param_shapes[n], sh.param_numels[n], pd, device) for n in names) / shard
    if isinstance(t.optimizer, opt.AdamW8bit) and max(sh.param_numels.values()) >= t.optimizer.min_8bit_size:
        states += 2 * 256 * 4  # the two fp32 quantisation maps, shared by every 8-bit tensor
    if offloaded or isinstance(t.offload, OptimizerState):
        states = 0.0
    grads = {n: sh.param_numels[n] * pd / shard for n in names}
    if offloaded or (isinstance(t.offload, OptimizerState) and t.offload.gradients):
        grads = dict.fromkeys(names, 0.0)
    block = sum(v for n, v in sh.param_numels.items() if n.startswith("transformer.h.0."))
    root = total - block * sh.layers
    sharded = shard > 1
    reshard = getattr(p, "reshard_after_forward", getattr(p, "sharding", "full") == "full")
    ddp = isinstance(p, par.DDP)
    return _Bytes(
        params=0.0 if offloaded else total * pd / shard,
        grads=grads,
        states=states,
        step_temp=0.0 if states == 0 else _step_temp_bytes(t, [[n / shard for n in g] for g in sh.groups], pd,
                                                           device),
        unsharded_block=block * gather_d if sharded or offloaded else 0.0,
        unsharded_root=root * gather_d if sharded or offloaded else 0.0,
        keep_unsharded=sharded and not reshard,
        other=total * pd if ddp else 0.0,  # DDP's flat buckets copy every gradient (no bucket views)
    )


def _play(t: Techniques, sh: Shapes, z: _Bytes, batch_tokens: int) -> Timeline:
    """One optimizer step (all micro-steps), optimizer states already allocated."""
    tl = Timeline()
    pd = BYTES[t.precision.param_dtype]
    c = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]
    r = pd  # the residual stream stays in the parameter dtype (autocast adds in fp32)
    sbh, sb, V = sh.sbh, sh.sb, sh.vocab
    offload_acts = isinstance(t.offload, Activations)
    ln_f_stats = 0 if isinstance(t.checkpoint, ckpt.Layers) and "layernorm" in t.checkpoint.types else 2 * sb * 4
    tl.alloc("params", z.params)
    tl.alloc("optimizer", z.states)
    tl.alloc("other", z.other + z.unsharded_root)
    tl.alloc("activations", batch_tokens * 8 * 2)  # int64 inputs and targets of the whole batch
    in_backward = t.optimizer.in_backward
    blocks = [_block_saves(t, i, sh, r, c) for i in range(sh.layers)]
    keep = (lambda n: 0.0) if offload_acts else (lambda n: n)  # save_on_cpu: saved tensors live on the host
    names = list(z.grads)
    block_names = [[n for n in names if n.startswith(f"transformer.h.{i}.")] for i in range(sh.layers)]
    have_grads = False
    for _ in range(t.accumulation.steps):
        # Forward. Embedding outputs, then x0 = wte(idx) + wpe(pos): the residual stream (B, T, C).
        tl.transient("activations", sbh * r + sh.s * sh.h * r)
        tl.alloc("activations", keep(sbh * r))
        for saved, full in blocks:
            gathered = z.unsharded_block
            tl.alloc("other", gathered)
            tl.transient("activations", min(full - saved, 8 * sbh * c))  # made and dropped inside
            tl.alloc("activations", keep(saved) + keep(sbh * r))  # kept + the block output
            if not z.keep_unsharded:
                tl.free("other", gathered)
        # ln_f statistics and output, logits (B, T, V), their fp32 copy, log-softmax (fp32, kept).
        tl.alloc("activations", keep(ln_f_stats + sbh * c))
        tl.alloc("activations", sb * V * c + (sb * V * 4 if c != 4 else 0))
        tl.alloc("activations", keep(sb * V * 4))
        tl.free("activations", sb * V * c + (sb * V * 4 if c != 4 else 0))  # logits not kept
        # Backward: loss -> log-softmax -> logits -> lm_head.
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
        tl.free("activations", keep(sbh * c + ln_f_stats + sbh * r))  # and x_L, ln_f's input
        tl.alloc("other", sbh * r)  # d x_L (replaces d ln_f out)
        tl.free("other", sbh * c)
        for i in reversed(range(sh.layers)):
            saved, full = blocks[i]
            tl.alloc("other", 0 if z.keep_unsharded else z.unsharded_block)
            back = full - saved + (saved if offload_acts else 0)  # recomputed, or copied back from the host
            tl.alloc("activations", back)
            tl.transient("other", 8 * sbh * c)  # d c_fc out and d GELU out alive together
            for n in block_names[i]:
                _grad(tl, z.grads[n], have_grads, in_backward)
            tl.free("activations", keep(saved) + back + (keep(sbh * r) if i else 0))  # and its input (x0 below)
            tl.free("other", z.unsharded_block)
        # Embedding backward: a dense (V, C) gradient is added to lm_head's share, then wte.grad.
        tl.transient("other", wte)
        tl.free("other", wte)
        _grad(tl, wte, have_grads, in_backward)
        for n in names:
            if not n.startswith("transformer.h.") and n != "transformer.wte.weight":
                _grad(tl, z.grads[n], have_grads, in_backward)
        tl.free("activations", keep(sbh * r))
        tl.free("other", sbh * r)
        have_grads = True
    tl.transient("optimizer", z.step_temp)
    tl.free("grads", tl.now["grads"])  # zero_grad(set_to_none=True)
    return tl


def _grad(tl: Timeline, nbytes: float, have: bool, in_backward: bool) -> None:
    """A parameter's gradient arrives: new, or added into the one from an earlier micro-step
    (briefly both), or stepped and freed at once (optimizer.in_backward)."""
    if in_backward or have:
        tl.transient("grads", nbytes)
    else:
        tl.alloc("grads", nbytes)


def analytic(cfg: dict) -> Prediction:
    """Predict one rank's device memory for a resolved config (no torch allocation)."""
    t = Techniques.from_config(cfg)
    device = "cpu" if cfg["device"] == "cpu" else "cuda"  # auto: the GPU the user plans on
    sh = _shapes(cfg, t)
    tl = _play(t, sh, _sizes(t, sh, device), cfg["batch_size"] * cfg["seq_len"])
    return Prediction(peak_mib=tl.peak / MIB, breakdown_mib={k: v / MIB for k, v in tl.at_peak.items()},
                      category_max_mib={k: v / MIB for k, v in tl.max.items()}, method="analytic",
                      steady_mib={k: v / MIB for k, v in tl.now.items()})
