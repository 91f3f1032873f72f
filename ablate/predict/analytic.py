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

Parameters, gradients, optimizer states and FSDP's units on one rank are ablate/predict/model_state.py's.

The sizes are played through one step as a timeline of allocations and frees
(ablate/predict/timeline.py; the head and the loss in ablate/predict/head_and_loss.py), so the peak lands
where the real one does.
"""
from __future__ import annotations

import math

from ablate.build import Techniques
from ablate.predict import Prediction
from ablate.predict.adapters import (FULL, Training, attention_recompute_temp, dequant_temp, forward_tail,
                                     recompute_grads, unfed)
from ablate.predict.allocator import slack_bytes
from ablate.predict.attention import Attention, attention_temps, eager_mask
from ablate.predict.experts import expert_moments
from ablate.predict.layers import attention_saves, forward_temp, inner_temp, layer_saves, mlp_saves
from ablate.predict.norms import norm_temps
from ablate.predict.model_state import BYTES, MIB, fsdp_shards, grad_bytes, model_state
from ablate.predict.shapes import Shapes, shapes_of
from ablate.predict.tiling import tile_mlp
from ablate.predict.sizes import Sizes
from ablate.predict.timeline import Step, Unmodelled
from ablate.spec import RunSpec

def _sizes(t: Techniques, shapes: Shapes, device: str) -> Sizes:
    """One rank's sizes and switches for the step: model state, then what the forward keeps."""
    sizes = model_state(t, shapes, device)
    a, sb = shapes.arch, shapes.sb
    if a.window and shapes.s >= a.window:
        raise Unmodelled(f"no analytic memory model for sliding-window layers at seq_len={shapes.s} >= "
                         f"sliding_window={a.window}: SDPA takes a (T, T) mask")
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
    tr = _training(t, device, r)
    adapted, frozen = "adapter" in (tr.attn, tr.mlp), "frozen" in (tr.attn, tr.mlp)
    # Neither is modelled here (measured on CPU, tiny Llama LoRA at hidden 256, 512 and 1,024 tokens):
    # selective op recompute keeps the adapters' matmul outputs too (24% short in fp32 and pure bf16,
    # 15% under autocast); a wrapper around each adapter's first Linear keeps peft's fp32 copy of a
    # 16-bit input where autocast's 16-bit cast was counted (3.8% short), and a wrapped frozen Linear
    # its input, which the frozen part is counted without (a frozen MLP's output projection keeps the
    # SwiGLU product: 6-11% short with adapters on attention only; QLoRA's 4-bit ones 5% over)
    if adapted and t.checkpoint.saves_op_outputs:
        raise Unmodelled("no analytic memory model for adapters under selective op recompute (checkpoint=ops)")
    if adapted and t.checkpoint.recomputes_casts and (r != c or frozen):
        raise Unmodelled("no analytic memory model for adapters under layer-type recompute of the Linears "
                         "(checkpoint=layers) in autocast or beside a frozen part (peft.targets other than all)")
    n = t.tiling.mlp_chunks(shapes.s, a.hidden)
    tiled = n > 1  # one slice is the untiled MLP
    sizes.inner_temp = inner_temp(a, sb, c, r, grad_bytes(t), tr, tiled=tiled)
    if a.experts:
        sizes.inner_temp_adding = inner_temp(a, sb, c, r, grad_bytes(t), tr, adding=True)
        sizes.expert_moments = expert_moments(a, sb, r, grad_bytes(t))
    if fsdp_shards(t) and a.kind == "gpt2" and tr == FULL:  # GELU's output outlives c_proj's backward in an FSDP
        sizes.inner_temp += sb * a.inter * c          # unit (MemTracker on a traced rank; why is not known)
    sizes.out_proj_input_grad = 0.0 if a.experts else sb * a.inter * c
    sizes.forward_temp = forward_temp(a, sb, r, c, tr, input_kept=t.checkpoint.wraps_mlp,
                                      linears_wrapped=t.checkpoint.recomputes_casts)
    sizes.forward_tail = forward_tail(a, sb, r, c, tr)
    sizes.recompute_grads = recompute_grads(a, sb, r, c, tr, mlp_alone=t.checkpoint.wraps_mlp)
    sizes.recompute_with_mlp = t.checkpoint.recompute_with_mlp
    sizes.mlp_alone = t.checkpoint.wraps_mlp
    sizes.mlp_saved = mlp_saves(a, sb, r, c, ln, tr)
    at = Attention(t.attention.saves(a, device, c), shapes.s,
                   # CUDA's autocast runs softmax in fp32; CPU's leaves it in the scores' dtype
                   fp32_softmax=a.kind == "llama" or bool(t.precision.autocast_dtype) and device == "cuda")
    if at.kind != "fused" and t.checkpoint.saves_op_outputs:
        raise Unmodelled(f"no analytic memory model for selective op recompute over {at.kind} attention's (T, T) ops")
    if tiled:
        tile_mlp(sizes, shapes, tr, n)
    sizes.attn_saved = attention_saves(a, sb, r, c, ln, at) if at.kind != "fused" else 0.0
    if t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp:
        sizes.attn_later = attention_saves(a, sb, r, c, ln, at, tr)
        sizes.attn_recompute_temp = attention_recompute_temp(a, sb, r, c, tr)
    norm_temps(sizes, a, shapes.sbh, sb, r, c, tiled, tr)
    sizes.attn_forward_temp, sizes.attn_backward_temp = attention_temps(a, sb, c, r, ln, at)
    sizes.blocks = [layer_saves(a, t.checkpoint, i, sb, r, c, ln, at, tr, tiled) for i in range(shapes.layers)]
    if not t.peft.train_embeddings and sizes.blocks:  # layer 0's input needs no gradient
        saved, full = sizes.blocks[0]
        attn = attention_saves(a, sb, r, c, ln, at, tr)
        dead = unfed(a, sb, r, c, ln, tr, attn)
        # kept (not recomputed): not even the input itself, which nothing before an adapter keeps;
        # a wrapped part's own keep was never counted in what is kept
        attention_alone = t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp
        wrapped = tuple(part for part, on in (("norm", t.checkpoint.wraps_norms), ("mlp", t.checkpoint.wraps_mlp),
                                              ("attn", attention_alone)) if on)
        dead_kept = unfed(a, sb, r, c, ln, tr, attn, wrapped)
        kept = saved - dead_kept - shapes.sbh * r
        if tr.attn == "frozen" and "attn" in wrapped:  # nothing in that attention needs a gradient: its
            kept = full - dead_kept - shapes.sbh * r     # wrapper keeps nothing, as if it were not there
        sizes.blocks[0] = (max(kept, 0.0) if saved else 0.0, full - dead)
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
    # (OLMo 2's and Gemma's keep them in fp32: they multiply by the weight before casting back)
    final = shapes.sbh * (4 if a.fp32_norm else r) * tr.norms + sb * 4 if a.kind == "llama" else 2 * sb * 4
    sizes.ln_f_recomputed = t.checkpoint.recomputes_final_norm
    sizes.ln_f_stats = 0 if sizes.ln_f_recomputed else final
    # recomputed, it keeps x_L (the wrapper's input) and makes its keep again in backward, with a
    # whole 4-byte copy of x_L where it upcasts
    sizes.ln_f_remade = final + shapes.sbh * ln * (ln != r) if sizes.ln_f_recomputed else 0.0
    if a.kind == "gpt2":  # wte(idx) and wpe(pos), added into x0
        sizes.embed_temp = shapes.sbh * r + shapes.s * shapes.h * r
    else:
        sizes.embed_temp = shapes.sbh * r if a.scaled_embed else 0.0  # the lookup, before its scaled copy
        # rotary: cos and sin, (1, T, head_dim) in the stream's dtype, shared by every layer
        sizes.rotary = 2 * shapes.s * a.head_dim * r * a.rotary_tables
    if t.checkpoint.wraps_attention:  # a recompute wrapper keeps its inputs, the mask among them
        sizes.rotary += eager_mask(a, shapes.b, shapes.s, c, at)
    # Autocast casts each Linear's weight and bias to the compute dtype at first use, caches the
    # copy until forward ends, and the matmul saves it for backward. FSDP's mixed precision
    # gathers parameters already in that dtype, so nothing is cast there.
    if t.precision.autocast_dtype and not fsdp_shards(t):
        sizes.block_cast = (sum(shapes.param_numels[n] for n in shapes.linear_names) - _fp8_weights(t)) * c
        # Selective op recompute keeps none (a cast is no matmul output), nor does a wrapper around
        # each Linear (it keeps the fp32 weight): backward casts again
        sizes.casts_recomputed = t.checkpoint.recomputes_casts
        # Attention or the MLP recomputed on its own saves none of its projections' casts: they go
        # when the forward ends, and its recompute casts again.
        if t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp:
            sizes.sublayer_cast = sum(shapes.param_numels[n] for n in shapes.linear_names if n not in shapes.mlp_names) * c
        elif t.checkpoint.wraps_mlp:
            sizes.sublayer_cast = sum(shapes.param_numels[n] for n in shapes.linear_names if n in shapes.mlp_names) * c
            # (ablate's GPT-2 measured 0.75% over with it, the Llama layout, OLMo 2 and Pythia 1.2-2.1%
            # under without: fitted on CPU, tiny families at hidden 64 and 256)
            remade = not (a.experts or a.kind == "gpt2")
            sizes.mlp_input_remade = shapes.sbh * r if remade else 0.0
        # A frozen weight's cast is kept by no cache (autocast caches only the casts of weights that need
        # a gradient) and, inside a recompute wrapper, by no saved tensor: it goes as soon as the wrapped
        # part has run (fitted on CPU: tiny Llama LoRA at hidden 256 under attention recompute)
        if not sizes.tiled_mlp and not sizes.casts_recomputed:
            frozen_linears = [n for n in shapes.linear_names if n in shapes.frozen]
            sizes.frozen_cast = sum(shapes.param_numels[n] for n in frozen_linears) * c
            if t.checkpoint.wraps_attention and not t.checkpoint.recompute_with_mlp:
                sizes.frozen_sublayer_cast = sum(shapes.param_numels[n] for n in frozen_linears
                                                 if n not in shapes.mlp_names) * c
            elif t.checkpoint.wraps_mlp:
                sizes.frozen_sublayer_cast = sum(shapes.param_numels[n] for n in frozen_linears
                                                 if n in shapes.mlp_names) * c
        if sizes.tiled_mlp:  # each slice's recompute casts the MLP's weights again (tile_mlp's inner_temp):
            # no backward keeps the forward's casts of them, nor a recompute's around the slices
            sizes.tiled_cast = sum(shapes.param_numels[n] for n in shapes.linear_names if n in shapes.mlp_names) * c
            sizes.sublayer_cast = sizes.tiled_cast + (0.0 if t.checkpoint.wraps_mlp else sizes.sublayer_cast)
        # a recompute beside the MLP's backward casts the output projection's weight again, which
        # goes with that projection's backward
        sizes.out_proj_cast = sum(shapes.param_numels[n] for n in shapes.linear_names if n in shapes.mlp_out_names) * c
        # the whole head, padding included; the chunked loss casts only the tokens' rows itself
        sizes.lm_head_cast = (shapes.vocab if t.loss.from_hidden else shapes.padded_vocab) * shapes.h * c
    if t.checkpoint.wraps_mlp and (tr.mlp == "frozen" or tr.mlp == "adapter" and (tr.dropout or r != c)) \
            and not sizes.mlp_input_remade:
        # a frozen MLP keeps none of its input, nor one whose adapters read copies of it (dropout's, or
        # autocast's casts): its wrapper keeps it beside the MLP's recompute (fitted on CPU: tiny Llama
        # at hidden 256, adapters on attention only, fp32 and pure bf16; with dropout, tiny Llama,
        # Qwen3, Gemma 3 and GPT-2, 1.3-2.4% short without; GPT-2's under autocast 2.4-3.0%)
        sizes.mlp_input_remade = shapes.sbh * r
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


def _training(t: Techniques, device: str, r: int) -> Training:
    """What of each decoder layer trains, as the peft option says."""
    p = t.peft
    # CUDA's fused dropout keeps a 1-byte mask; elsewhere torch's composite dropout keeps its noise,
    # drawn in its input's dtype: the adapter's, to which peft casts that input
    mask = 1 if device == "cuda" else r
    return Training(attn=p.trains("attention"), mlp=p.trains("mlp"), norms=not p.freezes_base, rank=p.r,
                    dropout=mask if p.dropout else 0, dora=p.use_dora)


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
    if device == "cuda" and not fsdp_shards(t) and not shapes.packed and _default_segments(spec.alloc_conf):
        # The blocks the allocator holds the parameters in, made one after another at the build
        # (ablate/predict/allocator.py): gpt2-xl's in bf16 take 67.8 MiB beyond their bytes. Not
        # for FSDP's shards, nor a 4-bit weight, quantised through temporaries.
        param_bytes = BYTES[t.precision.param_dtype]
        sizes.other += slack_bytes([numel * param_bytes for numel in shapes.param_numels.values()])
    if shapes.packed:  # a 4-bit weight dequantised in the compute dtype for a matmul, beside its output
        c = sizes.compute_bytes
        weights = {n: math.prod(shapes.param_shapes[n]) * 2 * c for n in shapes.packed}  # two weights a byte
        widest = max(weights.values())
        # forward on CUDA dequantises each weight whole (bitsandbytes' CPU forward is one fused op)
        sizes.forward_temp += widest if sizes.op_temps else 0.0
        if not sizes.tiled_mlp:  # backward, on either, dequantises the MLP's output projection beside its
            out = max((w for n, w in weights.items() if n in shapes.mlp_names), default=0.0)  # input's gradients
            tr, r = _training(t, device, sizes.stream_bytes), sizes.stream_bytes
            sizes.inner_temp = max(sizes.inner_temp, dequant_temp(shapes.arch, shapes.sb, r, c, tr, out))
        elif sizes.op_temps:  # a tiled MLP's slices, each beside a whole weight (not measured apart: on a
            sizes.inner_temp += widest  # CPU the tiny slices' weights are small)
        if sizes.inner_temp_adding is not None and sizes.op_temps:
            sizes.inner_temp_adding += widest
    return t, shapes, sizes


def analytic(spec: RunSpec) -> Prediction:
    """Predict one rank's device memory for a grid point (no torch allocation)."""
    _, shapes, sizes = sized(spec)
    tl = Step(shapes, sizes).play(spec.batch_size * spec.seq_len)
    return Prediction(peak_mib=tl.peak / MIB, breakdown_mib={k: v / MIB for k, v in tl.at_peak.items()},
                      category_max_mib={k: v / MIB for k, v in tl.max.items()}, method="analytic",
                      steady_mib={k: v / MIB for k, v in tl.now.items()})
