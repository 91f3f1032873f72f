"""One rank's sizes for one step, in bytes, and the switches that decide when each is alive: what
ablate/predict/analytic.py works out and ablate/predict/timeline.py's Step plays."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Unit:
    """One FSDP unit on one rank (bytes): a transformer block, or the root (embeddings, ln_f)."""

    gathered: float  # its parameters all-gathered: every rank's padded shard, in the compute dtype
    sharded_grads: float  # this rank's gradient shards after the reduce-scatter (parameter dtype)
    reduce_input: float  # the flat reduce-scatter input: the whole unit's gradients (reduce dtype)


@dataclass
class Sizes:
    """One rank's sizes for one step (bytes) and the switches that decide when each is alive."""

    params: float  # resident parameters on the device: whole, or this rank's shards (FSDP)
    grads: dict  # parameter name -> its gradient as backward makes it (whole: FSDP shards it after)
    states: float  # optimizer states on the device (this rank's shards under FSDP)
    step_temp: float  # optimizer-step temporaries at their largest
    other: float  # persistent extras: DDP buckets, cuBLAS workspaces
    root: Unit | None = None  # FSDP only
    block: Unit | None = None
    reshard: bool = True  # FSDP frees gathered parameters after forward (ZeRO-3), else after backward
    sync_each: bool = False  # FSDP only: reduce-scatter every micro-step, not only the last (whole grads kept)
    upcast: bool = False  # FSDP under autocast sums micro-steps' whole gradients in fp32 beside .grad
    # Bytes per element; the formulas (ablate/predict/layers.py) write them c, r and ln.
    compute_bytes: int = 4  # c: of the compute dtype (what Linear, SDPA and GELU produce)
    stream_bytes: int = 4  # r: of the residual stream: the parameter dtype (fp32 under autocast),
    #                        the compute dtype under FSDP's mixed precision (its embeddings are gathered in it)
    norm_bytes: int = 4  # ln: what a LayerNorm keeps of its input: r, or a 4-byte copy (CUDA autocast)
    blocks: list = field(default_factory=list)  # per block: (kept for backward, kept without recompute)
    ln_f_stats: float = 0.0  # what the final norm keeps beyond its input and output, unless recomputed
    ln_f_recomputed: bool = False  # ... which it is: it keeps its input alone
    ln_f_remade: float = 0.0  # ... and makes that keep (and its 4-byte copy) again in its backward
    ln_f_out_held: float = 0.0  # ln_f's output, held beside the head's cast of it until the loss is taken
    head_keeps_input: bool = True  # the head keeps its input (ln_f's output) for its weight's gradient
    head_input_bytes: int = 4  # ... per element: its cast (the compute dtype), or ln_f's output itself
    embed_temp: float = 0.0  # made and dropped while the embeddings are summed into x0 (learned positions)
    rotary: float = 0.0  # rotary cos and sin, kept through forward and backward
    inner_temp: float = 0.0  # the MLP's two widest tensors, alive together inside a layer's forward and backward
    inner_temp_adding: float | None = None  # ... in backward, where its weights' gradients add into kept ones (None: the same)
    expert_moments: list = field(default_factory=list)  # ... and then each expert weight's: (other, its new gradient)
    out_proj_input_grad: float = 0.0  # the gradient of a dense MLP's output projection's input (s·b·inter)
    forward_temp: float = 0.0  # made and dropped inside a layer's forward however much it keeps (experts' outputs)
    # ... beside it, only in the first forward: made after the layer's last saved tensor; less what a
    # norm on the MLP's output keeps, which it keeps only once those temporaries are gone
    forward_tail: float = 0.0
    recompute_grads: float = 0.0  # gradients made before a recomputed layer's first saved tensor is asked for
    recompute_with_mlp: bool = True  # a layer's recompute is alive during its MLP's backward (else after it)
    mlp_alone: bool = False  # ... and is the MLP's alone: a norm on its output runs its backward before it
    mlp_saved: float = 0.0  # what a layer's MLP keeps for backward, freed once its backward is done
    tiled_mlp: bool = False  # the MLP runs slice by slice (ablate/predict/tiling.py)
    inner_temp_later: float = 0.0  # ... inner_temp being its first slice's in backward, its later slices' at most
    inner_temp_remade: float = 0.0  # ... in a layer recomputed around it (its input made again, gone sooner)
    mlp_untiled: float = 0.0  # ... what one layer's MLP would keep untiled, made slice by slice instead (step time)
    # An attention that makes (T, T) tensors (math backend, eager): what it keeps, and what it
    # makes and drops beside that in forward and in backward (ablate/predict/layers.py attention_temps)
    attn_saved: float = 0.0
    norm_backward_temp: float = 0.0  # an RMSNorm's fp32 gradients in its backward, beyond what the layer keeps
    final_norm_backward_temp: float = 0.0  # ... in the final norm's backward, right after the head's
    out_norm_backward_temp: float = 0.0  # ... a post-norm's on the MLP's output, first in its layer's backward
    out_norm_saved: float = 0.0  # what that post-norm keeps, freed as its backward ends
    attn_forward_temp: float = 0.0
    attn_backward_temp: float = 0.0
    block_cast: float = 0.0  # autocast's compute-dtype copies of one block's Linear weights and biases
    casts_recomputed: bool = False  # a layer's recompute keeps none of them however much else it keeps (cast again)
    attn_later: float = 0.0  # what attention recomputed on its own makes again, after the second norm's backward
    attn_recompute_temp: float = 0.0  # ... and beside it at that recompute's end (an adapted output projection's)
    # an MLP recomputed on its own under autocast casts its input again, while its wrapper keeps
    # that input (the norm's output) beside the casts: what full - saved nets off
    mlp_input_remade: float = 0.0
    # the MLP's output projection's cast, made again by a recompute beside the MLP's backward: it goes
    # as that projection's backward ends
    out_proj_cast: float = 0.0
    sublayer_cast: float = 0.0  # of them, a sub-layer's recomputed on its own, whose wrapper saves none (cast again in backward)
    frozen_cast: float = 0.0  # of them, the frozen weights' (gone after a recomputed layer's forward)
    frozen_sublayer_cast: float = 0.0  # of a sub-layer's, the frozen weights' (gone after its forward)
    # ... and a tiled MLP's (among them), which only its slices' recomputes cast again: the backward's
    # own casts of them are one slice's inner temporaries, and its weights' gradients add up slice by
    # slice in that dtype, from the first slice's backward to the last
    tiled_cast: float = 0.0
    lm_head_cast: float = 0.0  # ... of lm_head's (the tied wte)
    head_wrapped: bool = False  # the head is recomputed: it keeps ln_f's output itself, casts it again in backward
    loss_chunks: int = 1  # the loss's slices of the tokens (loss=chunked): logits alive one slice at a time
    offload_acts: bool = False  # saved tensors go to the host (save_on_cpu on a GPU)
    # ... on a side stream: a layer's saved tensors stay on the device until the next layer's
    # forward, and in backward this many layers' are fetched back ahead of their turn (-1: not overlapped)
    offload_ahead: int = -1
    compiled: bool = False  # compile=true: inductor's fused cross-entropy (Step.compiled_loss_backward)
    pad_head: bool = False  # ... and, on CUDA, a vocabulary inductor pads for the head's matmuls
    op_temps: bool = True  # temporaries made inside one aten op (logsumexp's shifted logits) count: the
    #                        CUDA allocator holds them; MemTracker, the dispatch mode a CPU row's peak
    #                        comes from, sees each op's outputs only
    micro_steps: int = 1
    in_backward: bool = False  # each parameter is stepped, and its gradient freed, inside backward
    grads_in_buckets: bool = False  # DDP gradient_as_bucket_view: each gradient is copied into its bucket (`other`)
    step_temp_each: dict = field(default_factory=dict)  # in backward: name -> that tensor's step temporaries
    grad_lag: bool = False  # in backward, a gradient is stepped when the next one arrives (the last by step())
