"""The analytic memory model against torch's MemTracker on real CPU steps, and its effects."""
from __future__ import annotations

import itertools

import pytest
import torch

from ablate import measure
from ablate.build import build_model, build_optimizer, check_config
from ablate.predict import predict
from ablate.predict.analytic import analytic
from ablate.predict.trace import trace
from ablate.train import train_step
from tests.helpers import compose_spec, slow_except

MIB = 2**20
# gpt-nano with a small vocabulary, so that the blocks' activations are not drowned by the logits.
NANO = ["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]


def measured(overrides: list[str], base: list[str] = NANO, extra: dict | None = None) -> measure.Trace:
    """MemTracker on the second real step of the point (the first allocates optimizer states);
    `extra`: option nodes of groups the config has not got (a test's own)."""
    spec = compose_spec([*base, *overrides])
    spec.groups.update(extra or {})
    t = check_config(spec, "cpu")
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = build_model(t, cpu)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")

    def step():
        batch = torch.randint(0, spec.groups["data"]["vocab_size"], (2, spec.batch_size, spec.seq_len))  # made inside the step, as in runs
        train_step(model, optimizer, scaler, t, (batch[0], batch[1]), cpu)

    step()
    return measure.traced_step(step, model, optimizer, cpu)


OPTIMIZERS = ["sgd", "adamw", "adamw_foreach", "adamw_fused", "adafactor", "adamw8bit"]
GRID = list(itertools.product(OPTIMIZERS, ["fp32", "bf16_pure"], ["none", "block"], ["none", "x4"]))


def _pairwise(optimizer, precision, checkpoint, accumulation):
    """Twelve of the 48 points in the default suite, the rest behind `slow`: each optimizer with
    each precision, and the two switches set so that every pair of the four groups' values occurs
    (a covering array of strength 2; the whole grid is 4x longer)."""
    o, p = OPTIMIZERS.index(optimizer), int(precision == "bf16_pure")
    kept = (checkpoint == "block") == bool(p ^ o % 2) and (accumulation == "x4") == bool(p ^ o // 2 % 2)
    point = (optimizer, precision, checkpoint, accumulation)
    return pytest.param(*point, marks=() if kept else pytest.mark.slow)


@pytest.mark.parametrize("optimizer,precision,checkpoint,accumulation", [_pairwise(*point) for point in GRID])
def test_analytic_matches_memtracker(optimizer, precision, checkpoint, accumulation):
    overrides = [f"optimizer={optimizer}", f"precision={precision}", f"checkpoint={checkpoint}",
                 f"accumulation={accumulation}"]
    real = measured(overrides)
    pred = analytic(compose_spec([*NANO, *overrides]))
    # Bytes, exactly: parameters, the gradient set (with a micro-step's gradient being added in
    # under accumulation), and the optimizer states left once the step is over.
    assert pred.category_max_mib["params"] * MIB == real.category_max["params"] * MIB
    assert pred.category_max_mib["grads"] * MIB == real.category_max["grads"] * MIB
    assert pred.steady_mib["optimizer"] * MIB == real.after["optimizer"] * MIB
    assert pred.category_max_mib["activations"] == pytest.approx(real.category_max["activations"], rel=0.15)
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.10)


# One rank of DDP and FSDP2 (2 or 4 gloo ranks), as the trace predictor runs it: the real step on a
# fake process group, which equals a real rank's traced step (tests/test_predict_trace.py), in a
# second instead of a torchrun. An odd vocabulary makes FSDP pad wte's dim 0 to a multiple of the
# world size, so rank 0's shards are a little more than 1/world.
RANKS = ["model=gpt-nano", "model.vocab_size=131", "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]


# Six in the default suite; the other four, each a neighbour of one of the six, behind `slow`.
@pytest.mark.parametrize("parallel, overrides", [
    pytest.param("ddp", [], marks=pytest.mark.slow),
    ("ddp", ["precision=bf16", "accumulation=x4"]),
    pytest.param("fsdp", [], marks=pytest.mark.slow),
    ("fsdp", ["precision=bf16"]),
    ("fsdp", ["precision=bf16_pure", "checkpoint=block"]),
    pytest.param("fsdp", ["precision=bf16", "accumulation=x4"], marks=pytest.mark.slow),
    ("fsdp", ["precision=bf16", "accumulation=x4", "parallel.sync_each_micro_step=false"]),
    ("fsdp", ["parallel.nproc=4", "optimizer=sgd", "optimizer.momentum=0.9"]),
    ("fsdp_grad_op", ["accumulation=x4"]),
    pytest.param("fsdp_grad_op", ["accumulation=x4", "parallel.sync_each_micro_step=false"], marks=pytest.mark.slow),
], ids=lambda o: ",".join(o) if isinstance(o, list) else o)
def test_analytic_matches_a_traced_rank_of_ddp_and_fsdp(parallel, overrides):
    cfg = compose_spec([*RANKS, f"parallel={parallel}", "parallel.nproc=2", *overrides])
    pred, rank = analytic(cfg), trace(cfg)
    # Bytes, exactly: this rank's parameter shards and optimizer states once the step is over (the
    # 0-d step counters whole on every rank); parameters at their most (shards plus the units
    # all-gathered at once); gradients at their most (whole ones before a reduce-scatter, shards
    # after; DDP: whole).
    assert pred.steady_mib["params"] * MIB == rank.steady_mib["params"] * MIB
    assert pred.steady_mib["optimizer"] * MIB == rank.steady_mib["optimizer"] * MIB
    assert pred.category_max_mib["params"] * MIB == rank.category_max_mib["params"] * MIB
    grads = pred.category_max_mib["grads"] * MIB, rank.category_max_mib["grads"] * MIB
    if parallel.startswith("fsdp") and "precision=bf16" in overrides and "accumulation=x4" not in overrides:
        # FSDP2 under autocast frees one LayerNorm vector's bf16 gradient a moment after the
        # root's reduce-scatter has made its shards; the model leaves that moment out.
        assert 0 <= grads[1] - grads[0] <= cfg.groups["model"]["n_embd"] * 2
    else:
        assert grads[0] == grads[1]
    # Peaks: within 5% here (0.2% at gpt-mini's vocabulary), the rest being when FSDP frees its
    # flat all-gather buffers and prefetches the next unit, which the model leaves out.
    assert pred.peak_mib == pytest.approx(rank.peak_mib, rel=0.05)


@pytest.mark.parametrize("checkpoint", ["none", "block"])
def test_fsdp_mixed_precision_keeps_a_16_bit_residual_stream(checkpoint):
    """FSDP gathers the embeddings in bf16, so the residual stream (and a recomputed block's kept
    input) is 16-bit, not the parameters' fp32 as under plain autocast."""
    cfg = compose_spec([*RANKS, "seq_len=256", "parallel=fsdp", "parallel.nproc=2", "precision=bf16",
                          f"checkpoint={checkpoint}"])
    pred, rank = analytic(cfg), trace(cfg)
    assert pred.category_max_mib["activations"] == pytest.approx(rank.category_max_mib["activations"], rel=0.02)


@pytest.mark.parametrize("checkpoint", ["attention", "ops"])
def test_under_autocast_gpt2_holds_ln_fs_output_beside_its_cast_through_the_loss(checkpoint):
    """ablate's GPT-2 takes its loss in its own forward, which holds ln_f's fp32 output until the
    loss is taken: with attention or op recompute keeping little, that loss forward is the peak
    (1.2% and 1.5% under without it; recompute keeping no cast of attention's weights)."""
    overrides = [f"checkpoint={checkpoint}", "precision=bf16"]
    real = measured(overrides)
    assert analytic(compose_spec([*NANO, *overrides])).peak_mib == pytest.approx(real.peak_mib, rel=0.002)


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
@pytest.mark.parametrize("optimizer", slow_except(["adamw4bit", "apollo"], "apollo"))
def test_a_step_in_backward_runs_after_the_output_projection_lets_its_input_go(optimizer):
    """The output projection's backward makes its weight gradient beside the input it saved and
    its input's gradient, then frees that input before AccumulateGrad's hook steps the weight:
    where that step's temporaries make the peak, counting the input overshoots (0.9% and 2.4%)."""
    if optimizer == "apollo":
        pytest.importorskip("apollo_torch")
    overrides = [f"optimizer={optimizer}", "optimizer.in_backward=true"]
    real = measured(overrides)
    assert analytic(compose_spec([*NANO, *overrides])).peak_mib == pytest.approx(real.peak_mib, rel=0.002)


def test_gpt2_xl_model_state_is_16_bytes_per_param():
    """fp32 AdamW without AMP, DDP on one rank: 4 (params) + 4 (grads) + 8 (two states) bytes/param."""
    cfg = compose_spec(["model=gpt2-xl", "parallel=ddp", "parallel.nproc=1", "device=cuda",
                          "batch_size=1", "seq_len=1024"])
    pred = analytic(cfg)
    state = pred.category_max_mib["params"] + pred.category_max_mib["grads"] + pred.steady_mib["optimizer"]
    assert state * MIB == 16 * 1_557_611_200


def activations(*overrides: str) -> float:
    return analytic(compose_spec([*NANO, *overrides])).category_max_mib["activations"]


def test_monotone_in_the_techniques():
    assert activations("checkpoint=block") < activations("checkpoint=every2") < activations("checkpoint=none")
    assert activations("offload=activations", "device=auto") < activations("device=auto")

    def state(option: str) -> float:
        return analytic(compose_spec([*NANO, f"optimizer={option}", "model.n_embd=192"])).steady_mib["optimizer"]

    assert state("adamw8bit") < state("adamw") / 3 and state("adafactor") < state("adamw8bit")

    def per_rank_peak(parallel: str) -> float:
        return analytic(compose_spec(["model=gpt2", f"parallel={parallel}", "parallel.nproc=4",
                                        "device=cuda", "batch_size=4", "seq_len=512"])).peak_mib

    assert per_rank_peak("fsdp") < per_rank_peak("ddp")
    assert per_rank_peak("fsdp") < per_rank_peak("fsdp_grad_op") < per_rank_peak("ddp")


def test_predict_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="analytic, trace, none"):
        predict(compose_spec(NANO), "guess")



@pytest.mark.parametrize("vocab, per_logit, pad", [(50257, 4, 1), (50304, 6, 1), (50257, 6, 64)])
def test_a_compiled_cuda_step_drops_the_eager_losss_fp32_tensors(vocab, per_logit, pad):
    """compile=true on CUDA: the fused loss keeps no fp32 copy or log-softmax. Against the eager
    step, the peak (in the loss's backward) drops by 4 bytes per logit in bf16 where inductor pads
    the misaligned vocabulary for the head's matmuls, by 6 where it need not; the gpt2 rows of
    benchmarks/results/NVIDIA-H200/ check the first (tests/test_predict_records.py). A head padded
    to 50,304 rows (pad_vocab_to=64) is aligned: no pad_mm copy, as the padded vocabulary (inferred
    from inductor's CPU code for the sliced loss). On a CPU, whose rows report the eagerly traced
    step, compile changes nothing."""
    base = ["model=gpt2", f"model.vocab_size={vocab}", f"model.pad_vocab_to={pad}", "precision=bf16", "batch_size=8",
            "seq_len=1024"]
    logits = 8 * 1024 * vocab
    for device, drop in (("cuda", per_logit * logits), ("cpu", 0)):
        eager, compiled = (analytic(compose_spec([*base, f"device={device}", f"compile={c}"])).peak_mib
                           for c in ("false", "true"))
        assert (eager - compiled) * 2**20 == pytest.approx(drop, abs=2**20)


def test_fp32_grouped_query_attention_on_cuda_keeps_sdpas_math_backends_probabilities():
    """On CUDA, SDPA with grouped-query heads in fp32 has no fused kernel (flash and cuDNN take
    16-bit, the memory-efficient kernel no grouped heads): the math backend keeps the softmax's
    (B, heads, T, T) output and its own copies of q, k and v widened to every head, in place of
    q, k, v and the log-sum-exp. The fp32 Mixtral row of benchmarks/results/NVIDIA-H200/moe.md
    measured it (5.9% over the fused-kernel figure; -0.1% with the math backend's:
    tests/test_predict_records.py). Nothing changes in 16-bit, without grouped heads, or on a CPU,
    whose flash kernel takes fp32 and grouped heads. Sizes: that row's Mixtral, 4 x 512 tokens."""
    from ablate.predict.arch import arch_of
    from ablate.predict.layers import Attention, layer_saves
    from ablate.techniques import checkpoint as ckpt
    from ablate.techniques.attention import FUSED, MATH, Sdpa

    mixtral = ["model=mixtral-8x7b", "model.config.num_hidden_layers=2", "model.config.hidden_size=1024",
               "model.config.intermediate_size=2048", "batch_size=4", "seq_len=512"]
    a = arch_of(build_model_family(mixtral))
    assert (a.heads, a.kv_heads, a.head_dim) == (32, 8, 32)
    sdpa = Sdpa()
    assert sdpa.saves(a, "cuda", 4) == MATH and sdpa.saves(a, "cuda", 2) == sdpa.saves(a, "cpu", 4) == FUSED
    sb, heads_t = 4 * 512, 4 * 32 * 512
    fused, math = (layer_saves(a, ckpt.NoCheckpoint(), 0, sb, 4, 4, 4, Attention(kind, 512))[0] for kind in (FUSED, MATH))
    # (probabilities 128 MiB + q, widened k and v 8 MiB each) - (q, k, v 12 MiB and the log-sum-exp), per layer
    q, kv = heads_t * 32 * 4, heads_t // 4 * 32 * 4
    assert math - fused == heads_t * 512 * 4 + 3 * q - (q + 2 * kv) - heads_t * 4
    cuda, cpu = (analytic(compose_spec([*mixtral, "precision=fp32", f"device={d}"])) for d in ("cuda", "cpu"))
    assert cuda.category_max_mib["activations"] - cpu.category_max_mib["activations"] == pytest.approx(
        2 * (math - fused) / 2**20, abs=1)
    olmoe = arch_of(build_model_family(["model=olmoe-1b-7b"]))  # 16 query and 16 key/value heads
    assert sdpa.saves(olmoe, "cuda", 4) == FUSED


@pytest.mark.slow  # a Llama at a vocabulary large enough to peak there (20 s)
def test_a_fine_loss_peaks_in_the_final_rmsnorms_backward_with_the_heads_gradient():
    """A loss in fine slices leaves the step's peak where the head's gradient (a large vocabulary)
    meets the final RMSNorm's backward, which computes in fp32 in a 16-bit model: its fp32
    gradients count there as in every layer's norm (without them: -5.7%). Narrow, with a
    vocabulary 32 times the width: the CPU's bf16 matmuls without native bf16 units run at about
    1 GFLOP/s, and the head's are most of the step."""
    base = ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "model.config.hidden_size=256",
            "model.config.intermediate_size=512", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=1", "model.config.head_dim=128", "model.config.vocab_size=8192",
            "data.vocab_size=128", "device=cpu", "batch_size=4", "seq_len=256", "precision=bf16_pure",
            "loss=chunked", "loss.chunks=64"]
    real = measured([], base)
    assert analytic(compose_spec(base)).peak_mib == pytest.approx(real.peak_mib, rel=0.005)


def build_model_family(overrides: list[str]):
    from hydra.utils import instantiate

    return instantiate(compose_spec(overrides).groups["model"])


# Each precision once in the default suite, each loss with one or two of them; the rest behind `slow`.
@pytest.mark.parametrize("precision,loss", [
    ("fp32", "standard"), pytest.param("fp32", "chunked", marks=pytest.mark.slow),
    pytest.param("bf16", "standard", marks=pytest.mark.slow), ("bf16", "chunked"),
    ("bf16_pure", "standard"), pytest.param("bf16_pure", "chunked", marks=pytest.mark.slow)])
def test_analytic_knows_a_padded_heads_logits(precision, loss):
    """model.pad_vocab_to=128 widens gpt-nano's head from 300 to 384 rows: the analytic model moves
    with the measured peak and activations, byte for byte as far as these steps show (its error
    is the unpadded point's)."""
    base = ["model=gpt-nano", "model.vocab_size=300", "data.vocab_size=128", "device=cpu", "batch_size=8",
            "seq_len=256", f"precision={precision}", f"loss={loss}"]
    errors = []
    for pad in (1, 128):
        real, pred = measured([f"model.pad_vocab_to={pad}"], base), analytic(compose_spec([*base, f"model.pad_vocab_to={pad}"]))
        errors.append((pred.peak_mib - real.peak_mib, pred.category_max_mib["activations"] - real.category_max["activations"]))
    assert errors[1] == pytest.approx(errors[0], abs=1 / 1024)  # MiB: within a KiB
