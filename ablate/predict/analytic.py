"""The analytic memory model: closed-form tensor sizes, played through one training step.

Sizes come from the model family's parameter shapes (Family.layout: on the meta device, nothing
allocated, read off a sample of two layers where the layers repeat; names and layers found through
its adapter) and from the activations each op saves for backward. Activations per transformer layer
start from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): s·b·h·(34 + 5·a·s/h) bytes in 16-bit with dropout. ablate's GPT has no dropout masks (p=0
returns its input) and uses SDPA, so no (s, s) score matrix is stored and the 5as/h term is gone:
what a layer saves is 16·s·b·h elements plus LayerNorm statistics and SDPA's log-sum-exp, 32·s·b·h
bytes in 16-bit where the paper counts 34 with its two dropout masks. Each family's layer is
described in ablate/predict/layers.py.

Under FSDP2 (fully_shard) each rank holds dim-0 chunks of every parameter, padded to
ceil(rows / world) rows, so rank 0's are the largest; its optimizer states take the same local
shapes, and only the 0-d step counters are whole on every rank. A unit (a block, or the root:
embeddings and ln_f) is all-gathered in the compute dtype for its forward and again for its
backward; its gradients are made whole, then reduce-scattered into shards. FSDP1 is given the same
sizes: MemTracker cannot follow it, but the gpt2-xl FSDP1 batch scan's allocator peaks came within
1.6% of them (benchmarks/results/NVIDIA-H100-80GB-HBM3/repredict.md).

The sizes are played through one step as a timeline of allocations and frees
(ablate/predict/timeline.py; the head and the loss in ablate/predict/head_and_loss.py), so the peak lands
where the real one does.
"""
from __future__ import annotations

import math

from ablate.build import Techniques
from ablate.predict import Prediction
from ablate.predict.adapters import FULL, Training, recompute_grads, unfed
from ablate.predict.allocator import slack_bytes
from ablate.predict.attention import Attention, attention_temps, eager_mask
from ablate.predict.experts import expert_moments
from ablate.predict.layers import attention_saves, forward_temp, inner_temp, layer_saves, mlp_saves
from ablate.predict.shapes import Shapes, shapes_of
from ablate.predict.tiling import tile_mlp
from ablate.predict.sizes import Sizes, Unit
from ablate.predict.timeline import Step, Unmodelled
from ablate.spec import RunSpec

MIB = 2**20
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# cuBLAS takes its workspaces through the caching allocator at the first matmuls (32 MiB each on
# Hopper, NVIDIA's recommended size): two of them. Every predict_check point's allocator peak ran
# 54-88 MiB above the modelled tensors, and a traced gpt-mini step 67 MiB above MemTracker's
# (benchmarks/results/NVIDIA-H100-80GB-HBM3/).
CUBLAS_WORKSPACES = 64 * MIB


def _local_shape(shape: tuple, world: int) -> tuple:
    """A parameter's shape on rank 0 when FSDP shards it over `world` ranks: dim 0 in chunks of
    ceil(rows / world), the last ranks' padded to that size, so rank 0 holds the largest shard."""
    return (-(-shape[0] // world), *shape[1:])


def _fsdp(t: Techniques) -> bool:
    """Whether FSDP shards the parameters: a sharded parallel option, or offload=params (in one
    process, FSDP over a group of one rank)."""
    return t.parallel.shards_params or t.offload.shards_params


def _grad_bytes(t: Techniques) -> int:
    """Bytes per gradient element: the parameters' dtype, or FSDP's mixed-precision compute dtype
    (it gathers parameters in it, and backward makes their gradients in it)."""
    return BYTES[t.precision.autocast_dtype or t.precision.param_dtype] if _fsdp(t) else BYTES[t.precision.param_dtype]


def _model_state(t: Techniques, shapes: Shapes, device: str) -> Sizes:
    """Parameters, gradients, optimizer states and FSDP's units on one rank (bytes)."""
    param_bytes = BYTES[t.precision.param_dtype]
    gather_bytes = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]  # FSDP's mp param_dtype
    p = t.parallel
    fsdp = _fsdp(t)
    world = max(p.world_size, 1) if p.shards_params else 1  # offload=params alone: FSDP over one rank
    local = {n: math.prod(_local_shape(s, world)) for n, s in shapes.param_shapes.items()}
    trains = [n for n in local if n not in shapes.frozen]  # a frozen parameter has no gradient and no state
    # FSDP CPU offload: shards, their grads and states on the host (on a CPU, the host is the device)
    offloaded = t.offload.params_on_host and device != "cpu"
    # The optimizer option's own model of its states (ablate/techniques/optimizer.py, lowbit.py), for
    # each tensor's local shape: torch keeps a DTensor parameter's states in its shard's shape.
    states = sum(t.optimizer.state_bytes(_local_shape(shapes.param_shapes[n], world), param_bytes, device, n)
                 for n in trains)
    states += t.optimizer.shared_state_bytes(max([local[n] for n in trains] or [0]))
    if offloaded or t.offload.states_on_host:
        states = 0.0
    grads = {n: 0.0 if n in shapes.frozen else numel * _grad_bytes(t) for n, numel in shapes.param_numels.items()}
    if t.offload.grads_on_host:
        grads = dict.fromkeys(grads, 0.0)
    groups = [[_local_shape(shapes.param_shapes[n], world) for n in g] for g in shapes.groups]
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


def _sizes(t: Techniques, shapes: Shapes, device: str) -> Sizes:
    """One rank's sizes and switches for the step: model state, then what the forward keeps."""
    sizes = _model_state(t, shapes, device)
    a, sb = shapes.arch, shapes.sb
    # Bytes per element, in the formulas' notation (ablate/predict/layers.py): c of the compute
    # dtype, r of the residual stream, ln of what a norm keeps of its input. Autocast adds the
    # residual stream in fp32, unless FSDP's mixed precision gathers the embeddings in the compute
    # dtype: then the stream is 16-bit too. CUDA autocast runs LayerNorm in fp32, so there each
    # LayerNorm keeps an fp32 copy of a 16-bit input (CPU autocast does not); RMSNorm (llama)
    # keeps an fp32 copy of any input.
    c = BYTES[t.precision.autocast_dtype or t.precision.param_dtype]
    fsdp_mp = t.parallel.fsdp_mixed_precision or t.offload.fsdp_mixed_precision
    r = c if fsdp_mp else BYTES[t.precision.param_dtype]
    ln = 4 if a.kind == "llama" or (t.precision.autocast_dtype and device == "cuda") else r
    sizes.compute_bytes, sizes.stream_bytes, sizes.norm_bytes = c, r, ln
    tr = _training(t)
    sizes.inner_temp = inner_temp(a, sb, c, r, _grad_bytes(t), tr)
    if a.experts:
        sizes.inner_temp_adding = inner_temp(a, sb, c, r, _grad_bytes(t), tr, adding=True)
        sizes.expert_moments = expert_moments(a, sb, r, _grad_bytes(t))
    if _fsdp(t) and a.kind == "gpt2" and tr == FULL:  # GELU's output outlives c_proj's backward in an FSDP
        sizes.inner_temp += sb * a.inter * c          # unit (MemTracker on a traced rank; why is not known)
    sizes.out_proj_input_grad = 0.0 if a.experts else sb * a.inter * c
    sizes.forward_temp = forward_temp(a, sb, r, c, tr)
    sizes.recompute_grads = recompute_grads(a, sb, r, c, tr)
    sizes.recompute_with_mlp = t.checkpoint.recompute_with_mlp
    sizes.mlp_saved = mlp_saves(a, sb, r, c, ln, tr)
    at = Attention(t.attention.saves(a, device, c), shapes.s,
                   # CUDA's autocast runs softmax in fp32; CPU's leaves it in the scores' dtype
                   fp32_softmax=a.kind == "llama" or bool(t.precision.autocast_dtype) and device == "cuda")
    if at.kind != "fused" and t.checkpoint.saves_op_outputs:
        raise Unmodelled(f"no analytic memory model for selective op recompute over {at.kind} attention's (T, T) ops")
    n = t.tiling.mlp_chunks(shapes.s, a.hidden)
    tiled = n > 1  # one slice is the untiled MLP
    if tiled:
        tile_mlp(sizes, shapes, tr, n)
    sizes.attn_saved = attention_saves(a, sb, r, c, ln, at) if at.kind != "fused" else 0.0
    if t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp:
        sizes.attn_later = attention_saves(a, sb, r, c, ln, at)
    # RMSNorm's backward in fp32: the gradient of its normalised input and of its fp32 input, two
    # (B, T, h) fp32 tensors, and on a 16-bit stream the fp32 casts of both gradients besides
    # (fitted on CPU: tiny Llama, seq 4,096, tiled MLP under block recompute, where this is the peak)
    sizes.norm_backward_temp = shapes.sbh * 4 * (2 if r == 4 else 4) if a.kind == "llama" else 0.0
    sizes.final_norm_backward_temp = sizes.norm_backward_temp  # the same RMSNorm, before the last layer's
    if a.post_norm:  # OLMo 2's RMSNorm is fp32 throughout: four (B, T, h) fp32 tensors at its backward's
        # widest, whatever the stream's dtype; its norm on the MLP's output runs first in the layer's
        # backward, beside everything the layer keeps (fitted on CPU: tiny OLMo 2, fp32 and bf16)
        sizes.norm_backward_temp = sizes.out_norm_backward_temp = 4 * shapes.sbh * 4
        sizes.out_norm_saved = 2 * shapes.sbh * 4 + sb * 4  # its fp32 input and normalised values, the rsqrt
        # the final one: the head's 16-bit gradient cast up beside, its fp32 normalised values gone first
        sizes.final_norm_backward_temp = sizes.norm_backward_temp + shapes.sbh * (r - 4)
    if a.kind == "llama" and not tr.norms:  # the gradient of the second norm's output lives through it; a
        # trained weight's multiply frees the normalised input it kept (r) as its backward starts,
        # making room for it, a frozen one kept none (fitted on CPU: tiny Llama, LoRA over a tiled MLP)
        sizes.norm_backward_temp += shapes.sbh * r
    sizes.attn_forward_temp, sizes.attn_backward_temp = attention_temps(a, sb, c, r, ln, at)
    sizes.blocks = [layer_saves(a, t.checkpoint, i, sb, r, c, ln, at, tr, tiled) for i in range(shapes.layers)]
    if not t.peft.train_embeddings and sizes.blocks:  # layer 0's input needs no gradient
        saved, full = sizes.blocks[0]
        dead = unfed(a, sb, r, c, ln, tr, attention_saves(a, sb, r, c, ln, at))
        # kept (not recomputed): not even the input itself, which nothing before an adapter keeps
        sizes.blocks[0] = (max(saved - dead - shapes.sbh * r, 0.0) if saved else 0.0, full - dead)
    # The head's input is kept for its weight's gradient (the chunked loss keeps it anyway).
    sizes.head_keeps_input = t.peft.train_embeddings or t.loss.from_hidden
    # the head's matmul keeps its cast of that input; a loss from the hidden states (the chunked
    # loss's Function) keeps the hidden states as the model hands them over, casting slices itself
    sizes.head_input_bytes = r if t.loss.from_hidden else c
    # (the chunked loss multiplies by the head's weight itself: no wrapper around the head runs)
    sizes.head_wrapped = t.checkpoint.wraps_head and not t.loss.from_hidden
    # ablate's GPT-2 takes its loss in the forward that made ln_f's output, which it holds until the
    # loss is taken: under autocast beside the head's cast of it (a transformers model returns first;
    # a wrapped head keeps that very output)
    if a.kind == "gpt2" and r != c and not t.loss.from_hidden and not sizes.head_wrapped:
        sizes.ln_f_out_held = shapes.sbh * r
    # The final norm's own keep: LayerNorm's mean and rstd, or RMSNorm's rsqrt and normalised input
    # (for its weight's gradient).
    # (OLMo 2's RMSNorm keeps its normalised values in fp32: it multiplies by the weight before casting back)
    final = shapes.sbh * (4 if a.post_norm else r) * tr.norms + sb * 4 if a.kind == "llama" else 2 * sb * 4
    sizes.ln_f_recomputed = t.checkpoint.recomputes_final_norm
    sizes.ln_f_stats = 0 if sizes.ln_f_recomputed else final
    # recomputed, it keeps x_L (the wrapper's input) and makes its keep again in backward, with a
    # whole 4-byte copy of x_L where it upcasts
    sizes.ln_f_remade = final + shapes.sbh * ln * (ln != r) if sizes.ln_f_recomputed else 0.0
    if a.kind == "gpt2":  # wte(idx) and wpe(pos), added into x0
        sizes.embed_temp = shapes.sbh * r + shapes.s * shapes.h * r
    else:  # rotary: cos and sin, (1, T, head_dim) in the stream's dtype, shared by every layer
        sizes.rotary = 2 * shapes.s * a.head_dim * r
    if t.checkpoint.wraps_attention:  # a recompute wrapper keeps its inputs, the mask among them
        sizes.rotary += eager_mask(a, shapes.b, shapes.s, c, at)
    # Autocast casts each Linear's weight and bias to the compute dtype at first use, caches the
    # copy until forward ends, and the matmul saves it for backward. FSDP's mixed precision
    # gathers parameters already in that dtype, so nothing is cast there.
    if t.precision.autocast_dtype and not _fsdp(t):
        sizes.block_cast = (sum(shapes.param_numels[n] for n in shapes.linear_names) - _fp8_weights(t)) * c
        # Selective op recompute keeps none (a cast is no matmul output), nor does a wrapper around
        # each Linear (it keeps the fp32 weight): backward casts again
        sizes.casts_recomputed = t.checkpoint.recomputes_casts
        # Attention recomputed on its own saves none of its projections' casts: they go when the forward ends.
        if t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp:
            sizes.attn_cast = sum(shapes.param_numels[n] for n in shapes.linear_names if n not in shapes.mlp_names) * c
        # the whole head, padding included; the chunked loss casts only the tokens' rows itself
        sizes.lm_head_cast = (shapes.vocab if t.loss.from_hidden else shapes.padded_vocab) * shapes.h * c
    sizes.offload_acts = t.offload.activations_on_host and device != "cpu"  # else already on the host
    sizes.offload_ahead = t.offload.layers_ahead if sizes.offload_acts else -1
    sizes.loss_chunks = t.loss.chunks if t.loss.from_hidden else 1
    sizes.micro_steps, sizes.in_backward = t.accumulation.steps, t.optimizer.in_backward
    sizes.grad_lag = t.optimizer.in_backward and t.optimizer.steps_on_next_gradient
    # FSDP with mixed precision that keeps whole gradients over micro-steps sums them in fp32 (its
    # reduce dtype) beside .grad (FSDPParam.unsharded_accumulated_grad), not in the 16-bit .grad.
    sizes.upcast = (sizes.root is not None and not sizes.sync_each and bool(t.precision.autocast_dtype)
                    and sizes.micro_steps > 1)
    return sizes


def _training(t: Techniques) -> Training:
    """What of each decoder layer trains, as the peft option says."""
    p = t.peft
    return Training(attn=p.trains("attention"), mlp=p.trains("mlp"), norms=not p.freezes_base, rank=p.r,
                    dropout=bool(p.dropout), dora=p.use_dora)


def _fp8_weights(t: Techniques) -> int:
    """Elements of one layer's weights that the precision option computes in float8 (FP8's
    fp8_weights: autocast casts no 16-bit copy of them)."""
    return t.precision.fp8_weights(t.model.adapter.layer_list(t.model.layout.model)[0])  # every layer's


# The groups whose options this model asks its questions of, each in its own terms (an optimizer its
# state bytes, a checkpoint option what a layer keeps, ...). An option of any other group has told
# it nothing: a point with one is predicted by the trace instead, never without that group's bytes.
ASKED = ("precision", "accumulation", "checkpoint", "offload", "parallel", "optimizer", "loss", "peft", "attention",
         "tiling", "kernels")


def _asked(t: Techniques) -> None:
    for group, option in t.options().items():
        if group not in ASKED and not option.memory_in_params:
            raise Unmodelled(f"no analytic memory model for group {group} (option {type(option).__name__})")


def _default_segments(alloc_conf: str | None) -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF leaves the caching allocator's segments and splitting as they
    are by default (expandable segments grow in place; a split or rounding setting changes the
    blocks; cudaMallocAsync is another allocator)."""
    settings = dict(kv.split(":", 1) for kv in (alloc_conf or "").replace(" ", "").split(",") if ":" in kv)
    changed = ("max_split_size_mb", "roundup_power2_divisions")
    return (settings.get("expandable_segments", "False").lower() != "true" and not any(k in settings for k in changed)
            and settings.get("backend", "native") == "native")


# The last point sized, and what it came to: a point's memory and its step time are predicted one
# after the other from the same spec (ablate/outcome.py `predicted`), and sizing it builds every
# option again (a tenth of a planned point's time). By identity: a spec is frozen, and a changed one
# (`spec.replace`, the batch search's) is another object. Nothing downstream writes to the sizes.
_last_sized: tuple[RunSpec, tuple[Techniques, Shapes, Sizes]] | None = None


def sized(spec: RunSpec) -> tuple[Techniques, Shapes, Sizes]:
    """A point's options, shapes and one rank's sizes, as the step is played (the step-time model,
    ablate/predict/step_time.py, reads the same)."""
    global _last_sized
    last = _last_sized  # read once: another thread may size another point meanwhile
    if last is not None and last[0] is spec:
        return last[1]
    result = _sized(spec)
    _last_sized = spec, result
    return result


def _sized(spec: RunSpec) -> tuple[Techniques, Shapes, Sizes]:
    t = Techniques.of(spec)
    _asked(t)
    t.kernels.fused_parts()  # fused kernels raise Unmodelled: their saved tensors are not the layer model's
    device = "cpu" if spec.device == "cpu" else "cuda"  # auto: the GPU the user plans on
    shapes = shapes_of(spec, t)
    sizes = _sizes(t, shapes, device)
    # The compiled loss on CUDA only: on a CPU the peak a row reports is the traced step's, which
    # runs eagerly (MemTracker cannot follow compiled code), so the eager step is what it measures.
    sizes.compiled = spec.compile and device == "cuda"
    # inductor's pad_mm aligns a matmul's dims to 8 elements in 16-bit and 4 in fp32 (GPUs only): the
    # head's rows, which model.pad_vocab_to=64 aligns already
    sizes.pad_head = sizes.compiled and shapes.padded_vocab % (8 if sizes.compute_bytes == 2 else 4) != 0
    sizes.op_temps = device == "cuda"
    if device == "cuda" and not _fsdp(t) and not shapes.packed and _default_segments(spec.alloc_conf):
        # The blocks the allocator holds the parameters in, made one after another at the build
        # (ablate/predict/allocator.py): gpt2-xl's in bf16 take 67.8 MiB beyond their bytes. Not
        # for FSDP's shards, nor a 4-bit weight, quantised through temporaries.
        param_bytes = BYTES[t.precision.param_dtype]
        sizes.other += slack_bytes([numel * param_bytes for numel in shapes.param_numels.values()])
    if sizes.op_temps and shapes.packed:  # a 4-bit weight dequantised for each matmul, inside the op
        widest = max(math.prod(shapes.param_shapes[n]) * 2 for n in shapes.packed)  # two weights a byte
        sizes.forward_temp += widest * sizes.compute_bytes
        sizes.inner_temp += widest * sizes.compute_bytes
        if sizes.inner_temp_adding is not None:
            sizes.inner_temp_adding += widest * sizes.compute_bytes
    return t, shapes, sizes


def analytic(spec: RunSpec) -> Prediction:
    """Predict one rank's device memory for a grid point (no torch allocation)."""
    _, shapes, sizes = sized(spec)
    tl = Step(shapes, sizes).play(spec.batch_size * spec.seq_len)
    return Prediction(peak_mib=tl.peak / MIB, breakdown_mib={k: v / MIB for k, v in tl.at_peak.items()},
                      category_max_mib={k: v / MIB for k, v in tl.max.items()}, method="analytic",
                      steady_mib={k: v / MIB for k, v in tl.now.items()})
