"""The loss group: the chunked cross-entropy (and the fused one, its gradients made in forward)
equals the standard one, saves the logits' memory, and the analytic model knows its bytes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ablate.build import check_config
from ablate.predict.analytic import analytic, sized
from ablate.predict.timeline import Step
from ablate.techniques import Invalid
from ablate.techniques.loss import Chunked, Fused
from tests.helpers import compose_spec, results_under, run_cli, train_nano
from tests.test_predict import NANO, measured

MIB = 2**20


def grads_of(loss_fn, h, weight, bias, y):
    """(loss, dh, dweight, dbias) of a fresh copy of the inputs."""
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    loss = loss_fn(h, weight, bias, y)
    loss.backward()
    return loss.detach(), h.grad, weight.grad, None if bias is None else bias.grad


def standard(h, weight, bias, y):
    return F.cross_entropy(F.linear(h, weight, bias).float().flatten(0, 1), y.flatten())


def chunked(n, kind=Chunked):
    def loss(h, weight, bias, y):
        return kind(n)(h, SimpleNamespace(weight=weight, bias=bias), y)  # it reads only the head's tensors
    return loss


@pytest.mark.parametrize("kind", [Chunked, Fused])
@pytest.mark.parametrize("chunks", [1, 3, 8, 37])  # 3 does not divide the 74 tokens; 37 is 2 per slice
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_gives_the_standard_loss_and_gradients(chunks, with_bias, kind):
    torch.manual_seed(0)
    h, y = torch.randn(2, 37, 16), torch.randint(0, 101, (2, 37))
    weight, bias = torch.randn(101, 16) * 0.3, torch.randn(101) if with_bias else None
    ours, theirs = grads_of(chunked(chunks, kind), h, weight, bias, y), grads_of(standard, h, weight, bias, y)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_loss_scales_its_gradients_by_the_incoming_one_and_makes_none_without_grad_mode(monkeypatch):
    """Its gradients are made in forward for a loss gradient of 1: accumulation's 1/k (or any
    factor after the loss) scales them in backward. Eval (no grad mode) makes none."""
    from ablate.techniques import loss as module

    torch.manual_seed(0)
    h, y, weight = torch.randn(2, 37, 16), torch.randint(0, 101, (2, 37)), torch.randn(101, 16) * 0.3
    ours = grads_of(lambda *a: chunked(4, Fused)(*a) * 0.25, h, weight, None, y)
    theirs = grads_of(lambda *a: standard(*a) * 0.25, h, weight, None, y)
    for a, b in zip(ours[1:3], theirs[1:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    slice_loss = module._slice_loss

    def without_grads(hs, w, b, ys, grads=None):
        assert grads is None, "a gradient made without grad mode"
        return slice_loss(hs, w, b, ys)
    monkeypatch.setattr(module, "_slice_loss", without_grads)
    with torch.no_grad():
        loss = chunked(4, Fused)(h, weight.requires_grad_(), None, y)
    assert loss.item() == pytest.approx(standard(h, weight, None, y).item(), rel=1e-6)


@pytest.mark.parametrize("kind", [Chunked, Fused])
def test_chunked_under_autocast_computes_as_the_head_would(kind):
    """bf16 autocast: the chunked slices run their matmuls in bf16 too, so they agree with the
    standard loss to bf16's precision, and the gradients keep their inputs' dtypes."""
    torch.manual_seed(0)
    h, y, weight = torch.randn(4, 32, 64), torch.randint(0, 512, (4, 32)), torch.randn(512, 64) * 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = grads_of(chunked(8, kind), h, weight, None, y), grads_of(standard, h, weight, None, y)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-3, atol=0)
    for a, b in zip(ours[1:3], theirs[1:3]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("loss", ["chunked", "fused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16_pure"])
def test_training_with_the_chunked_loss_follows_the_standard_one(precision, loss):
    plain = train_nano([f"precision={precision}"], steps=4)[0]
    ours = train_nano([f"precision={precision}", f"loss={loss}", "loss.chunks=5"], steps=4)[0]
    assert plain[-1] < plain[0]
    assert ours == pytest.approx(plain, rel=1e-5 if precision == "fp32" else 2e-2)


# gpt-nano with a 2,048-token vocabulary: the logits dominate, as at GPT-2's 50,257.
BIG_VOCAB = [*NANO, "model.vocab_size=2048", "data.vocab_size=2048"]


@pytest.mark.parametrize("loss", ["chunked", "fused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_pure"])
@pytest.mark.parametrize("accumulation", ["none", "x4"])
def test_analytic_knows_the_chunked_losss_bytes(precision, accumulation, loss):
    """loss=fused makes in forward what the chunked loss makes in backward: its peak (at the end
    of the loss's forward, the moment before backward begins) is the chunked loss's."""
    overrides = [f"precision={precision}", f"accumulation={accumulation}", f"loss={loss}"]
    real, pred = measured(overrides, BIG_VOCAB), analytic(compose_spec([*BIG_VOCAB, *overrides]))
    assert pred.category_max_mib["grads"] * MIB == real.category_max["grads"] * MIB
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.01)


# Where the loss's slices are the step's peak: a 16,384-token vocabulary over 8 x 64 tokens in 2
# slices makes each slice's fp32 logits 16 MiB, against about 5 MiB for the rest of gpt-nano's step.
SLICE_PEAK = [*NANO, "model.vocab_size=16384", "data.vocab_size=16384", "seq_len=64", "loss.chunks=2"]


@pytest.mark.parametrize("loss", ["chunked", "fused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16_pure"])
def test_one_slices_logits_at_a_time(precision, loss):
    """A slice's logits are gone before the next slice's are made: the loop's variable kept the
    previous slice's fp32 logits alive through the next one's matmul (one more slice of bytes,
    2 x 8,192 x 16,384 B here; 786 MiB for gpt2 at micro-batch 64 x 1024 in 8 slices), which
    the predictor, rightly, never counted."""
    overrides = [f"precision={precision}", f"loss={loss}"]
    real, pred = measured(overrides, SLICE_PEAK), analytic(compose_spec([*SLICE_PEAK, *overrides]))
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.01)


class EverySlice(Step):
    """The step with its loss's slices played one by one, as many as there are."""

    def forward_slice(self, q):
        for _ in range(self.slices()[0]):
            super().forward_slice(q)

    def backward_slice(self, q):
        for _ in range(self.slices()[0]):
            super().backward_slice(q)


@pytest.mark.parametrize("loss", ["chunked", "fused", "cce"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_pure"])
def test_one_slice_played_is_the_step_with_every_slice_played(precision, loss):
    """The predictor plays one of the loss's slices: each leaves the timeline as it found it, so the
    step's peak, its breakdown and every category's maximum are those of all slices played."""
    spec = compose_spec(["model=gpt2", "device=cuda", "batch_size=2", "seq_len=256", f"precision={precision}",
                         f"loss={loss}", "loss.chunks=16" if loss != "cce" else "loss.impl=cce"])
    _, shapes, sizes = sized(spec)
    one = Step(shapes, sizes)
    n, q = one.slices()
    assert n == (16 if loss != "cce" else 512)
    one.tl.alloc("params", 1.0)
    for play in (one.forward_slice, one.backward_slice):
        before = dict(one.tl.now)
        play(q)
        assert one.tl.now == before
    tokens = spec.batch_size * spec.seq_len
    a, b = Step(shapes, sizes).play(tokens), EverySlice(shapes, sizes).play(tokens)
    assert (a.peak, a.at_peak, a.max, a.now) == (b.peak, b.at_peak, b.max, b.now)


def test_chunked_saves_most_of_the_logits_bytes():
    """MemTracker's peak drops by at least 80% of the whole logits' fp32 bytes (batch 8 x seq 32 x
    2,048 tokens x 4 B = 2 MiB), and the predictor sees the same saving."""
    logits = 8 * 32 * 2048 * 4 / MIB
    saved = measured([], BIG_VOCAB).peak_mib - measured(["loss=chunked"], BIG_VOCAB).peak_mib
    assert saved >= 0.8 * logits
    predicted = analytic(compose_spec(BIG_VOCAB)).peak_mib - analytic(compose_spec([*BIG_VOCAB, "loss=chunked"])).peak_mib
    assert predicted == pytest.approx(saved, rel=0.1)


@pytest.mark.parametrize("overrides, match", [
    (["loss.chunks=0"], "loss.chunks=0 must be a positive integer"),
    (["loss.chunks=300", "batch_size=8", "seq_len=32"], r"loss.chunks=300 > the 256 tokens of a micro-batch"),
    (["model=hf", "+model.config.model_type=gemma2", "+model.config.num_hidden_layers=1", "attention=eager"],
     r"loss=chunked, fused, liger and cce need logits that are the head's output alone; model_type='gemma2': "
     r"its forward changes the head's output"),
])
def test_invalid_chunked_losses_name_their_key(overrides, match):
    for loss in ("chunked", "fused"):
        with pytest.raises(Invalid, match=match):
            check_config(compose_spec(["device=cpu", f"loss={loss}", *overrides]))


def test_the_fused_loss_refuses_fp16s_grad_scaler():
    with pytest.raises(Invalid, match="loss=fused makes its gradients in forward, before the GradScaler's scale"):
        check_config(compose_spec(["device=cpu", "loss=fused", "precision=fp16"]))
    check_config(compose_spec(["device=cpu", "loss=chunked", "precision=fp16"]))


@pytest.mark.slow
def test_a_chunked_loss_sweep_of_gpt2_saves_its_logits(tmp_path):
    """GPT-2's real vocabulary on CPU through the CLI: equal losses, and a peak lower by at least
    80% of the (4 x 256 x 50,257) fp32 logits (196 MiB). Two of its 12 layers: the logits are the
    vocabulary's, and ten more layers would only add matmuls (2.3x the step's FLOPs)."""
    proc = run_cli(["-m", "loss=standard,chunked", "model=gpt2", "model.n_layer=2", "batch_size=4", "seq_len=256",
                    "steps=2", "warmup_steps=2", "device=cpu", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, fast=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["choices"]["loss"]: r for r in results_under(tmp_path / "s")}
    assert [rows[k]["status"] for k in ("standard", "chunked")] == ["ok", "ok"]
    m = {k: r["metrics"] for k, r in rows.items()}
    assert m["chunked"]["losses"] == pytest.approx(m["standard"]["losses"], rel=1e-4)
    logits = 4 * 256 * 50257 * 4 / MIB
    assert m["standard"]["peak_allocated_mib"] - m["chunked"]["peak_allocated_mib"] >= 0.8 * logits
    for row in rows.values():  # and the predictor saw each peak
        assert row["prediction"]["peak_mib"] == pytest.approx(row["metrics"]["peak_allocated_mib"], rel=0.05)


@pytest.mark.slow
def test_chunked_and_fused_under_ddp_and_fsdp_give_the_standard_losses(tmp_path):
    """Two gloo ranks: FSDP2 gathers the head's weight for the root's forward and again for its
    backward, which the chunked loss's saved weight relies on; DDP reduces its gradient."""
    proc = run_cli(["-m", *NANO[:3], "loss=standard,chunked,fused", "parallel=fsdp,ddp", "parallel.nproc=2",
                    "batch_size=4", "seq_len=32", "steps=3", f"hydra.sweep.dir={tmp_path}/s"], tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["choices"]["parallel"], r["choices"]["loss"]): r for r in results_under(tmp_path / "s")}
    assert len(rows) == 6 and {r["status"] for r in rows.values()} == {"ok"}
    for parallel in ("fsdp", "ddp"):
        for loss in ("chunked", "fused"):  # fused: the head's gradient made in forward, on the gathered weight
            assert rows[parallel, loss]["metrics"]["losses"] == pytest.approx(
                rows[parallel, "standard"]["metrics"]["losses"], rel=1e-5), (parallel, loss)


def test_the_chunked_loss_counts_its_recomputed_head_for_hfu():
    """HFU adds the head's matmul run again in backward: its weight's share of all Linear weights
    (GPT-2's tied head: vocab x n_embd of the whole model's matmul weights)."""
    _, model, _, t = train_nano(["loss=chunked"], steps=1)
    head = 128 * 48  # gpt-nano at FAST's vocabulary: 128 tokens x 48
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert t.loss.recompute_fraction == pytest.approx(head / linears) and 0 < t.loss.recompute_fraction < 1
    assert train_nano([], steps=1)[3].loss.recompute_fraction == 0
    assert train_nano(["loss=fused"], steps=1)[3].loss.recompute_fraction == 0  # its head runs once
