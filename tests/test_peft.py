"""Adapters (peft=lora, dora, qlora; ablate/techniques/peft.py): what trains, the analytic
prediction against MemTracker on real CPU steps (exact on parameters, gradients and optimizer
states), the math adapters must leave alone, and the combinations they refuse."""
from __future__ import annotations

import itertools

import pytest
import torch

from ablate.build import build_model, build_optimizer, check_config
from ablate.predict import predict
from ablate.predict.analytic import analytic
from ablate.techniques import Invalid, Unmodelled
from ablate.train import train_step
from tests.helpers import compose_spec
from tests.test_predict import MIB, measured

_GQA = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
        "model.config.num_key_value_heads=2", "model.config.num_hidden_layers=2", "model.config.vocab_size=128"]
# Tiny copies of each layout the analytic model describes for adapters, with a token count at which
# a layer's activations outweigh the constant terms (weights, the loss over 128 tokens).
TINY = {"llama": ["model=llama3.2-1b", *_GQA, "model.config.head_dim=16", "batch_size=4", "seq_len=256"],
        "qwen2": ["model=qwen2.5-0.5b", *_GQA, "batch_size=4", "seq_len=256"],
        "gpt2": ["model=gpt-nano", "model.vocab_size=128", "batch_size=8", "seq_len=64"]}
BASE = ["data.vocab_size=128", "device=cpu"]

GRID = list(itertools.product(TINY, ["lora", "dora", "qlora"], ["none", "block"], ["fp32", "bf16", "bf16_pure"]))


def _marked(family: str, peft: str, checkpoint: str, precision: str):
    """Nine tiny-Llama points in the default suite, the rest (and the other layouts) behind `slow`:
    each adapter with each precision, recompute switched so that every pair of the three groups'
    values occurs (a covering array of strength 2; the Llama grid is twice as long)."""
    a, p = ["lora", "dora", "qlora"].index(peft), ["fp32", "bf16", "bf16_pure"].index(precision)
    kept = family == "llama" and (checkpoint == "block") == bool((a + p) % 2)
    return pytest.param(family, peft, checkpoint, precision, marks=() if kept else pytest.mark.slow)


@pytest.mark.parametrize("family,peft,checkpoint,precision", [_marked(*point) for point in GRID])
def test_the_prediction_is_within_2_percent_of_memtracker(family, peft, checkpoint, precision):
    base, overrides = [*TINY[family], *BASE], [f"peft={peft}", f"checkpoint={checkpoint}", f"precision={precision}"]
    spec = compose_spec([*base, *overrides])
    if peft == "qlora" and precision == "bf16":  # refused: see the test of refusals below
        with pytest.raises(Invalid, match="peft=qlora"):
            check_config(spec, "cpu")
        return
    real = measured(overrides, base=base)
    if peft == "dora" and (precision == "bf16" or family == "gpt2"):  # the analytic model says it has none
        with pytest.raises(Unmodelled, match="DoRA"):
            analytic(spec)
        pred = predict(spec, "trace")  # which follows the real step
    else:
        pred = analytic(spec)
        assert pred.category_max_mib["params"] * MIB == real.category_max["params"] * MIB
        assert pred.category_max_mib["grads"] * MIB == real.category_max["grads"] * MIB
        assert pred.steady_mib["optimizer"] * MIB == real.after["optimizer"] * MIB
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.02)


@pytest.mark.parametrize("name,overrides", [
    ("llama3.2-1b", ["peft=lora", "precision=bf16", "checkpoint=none"]),
    ("gemma", ["peft=lora", "precision=bf16_pure", "checkpoint=none"]),
    ("qwen3", ["peft=lora", "precision=bf16_pure", "checkpoint=none"]),
    ("gemma3_text", ["peft=lora", "precision=bf16", "checkpoint=none"]),
    ("qwen3", ["peft=lora", "precision=bf16_pure", "checkpoint=layers"]),
    pytest.param("gemma3_text", ["peft=lora", "precision=bf16_pure", "checkpoint=block"], marks=pytest.mark.slow),
    pytest.param("gemma3_text", ["peft=qlora", "precision=bf16_pure", "checkpoint=none"], marks=pytest.mark.slow),
    pytest.param("qwen3", ["peft=lora", "precision=bf16", "checkpoint=block"], marks=pytest.mark.slow)])
def test_adapters_over_wide_layers_and_every_norm_are_predicted_within_half_a_percent(name, overrides):
    """At hidden 256, where a layer's terms outweigh the rest: under autocast the adapter on the MLP's
    last Linear makes its output and a scaled copy beside its casts, before any norm on the MLP's
    output has kept anything; a frozen norm keeps no normalised values (fp32 ones in Gemma's and
    Gemma 3's norms, q/k norms too), and its backward and the final norm's make room for the
    gradient the weight's multiply no longer frees; under layer-type recompute the first norm's
    wrapper keeps the layer's input, and its own keep is recomputed anyway. Llama's and Gemma's
    first points were 2.1% and 3.3% off without them, the layer-type one 1.8%; Qwen3's and Gemma
    3's had no analytic model."""
    from tests.test_families import _PHI3, tiny

    full = [*tiny(name, *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", *overrides]
    base = ["device=cpu", "batch_size=4", "seq_len=128"]
    real = measured(full, base)
    assert analytic(compose_spec([*base, *full])).peak_mib == pytest.approx(real.peak_mib, rel=0.005)


def test_frozen_weights_have_no_gradient_nor_optimizer_state():
    """Only the adapters train: the plain run's gradients and AdamW states shrink to theirs."""
    base = [*TINY["llama"], *BASE]
    full, lora = measured(["peft=none"], base=base), measured(["peft=lora"], base=base)
    model = _built([*base, "peft=lora"])
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert lora.category_max["grads"] * MIB == adapter_bytes
    assert lora.after["optimizer"] * MIB == 2 * adapter_bytes + 4 * len(trained)  # two moments, an fp32 step each
    assert full.category_max["grads"] > 4 * lora.category_max["grads"]


def test_train_embeddings_trains_the_embedding_and_head_too():
    model = _built([*TINY["llama"], *BASE, "peft=lora", "peft.train_embeddings=true", "model.config.tie_word_embeddings=false"])
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained == {"lm.model.embed_tokens.weight", "lm.lm_head.weight"}


@pytest.mark.parametrize("targets,adapted", [("attention", {"q_proj", "k_proj", "v_proj", "o_proj"}),
                                             ("mlp", {"gate_proj", "up_proj", "down_proj"})])
def test_targets_pick_the_attention_or_the_mlp_linears(targets, adapted):
    model = _built([*TINY["llama"], *BASE, "peft=lora", f"peft.targets={targets}"])
    names = {n.split(".lora_A.")[0].rsplit(".", 1)[1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert names == adapted


@pytest.mark.parametrize("peft", ["lora", "dora"])
def test_an_adapted_models_first_loss_is_the_base_models(peft):
    """B starts at zero (and DoRA's magnitude at the weight's norm): the adapted model computes
    exactly what the base model does until the first step."""
    batch = _batch()
    assert _first_loss(["peft=none"], batch) == _first_loss([f"peft={peft}"], batch)


def test_adapters_wrap_the_weights_init_from_loads(tmp_path):
    """Fine-tuning starts from real weights: model.init_from's are loaded before the adapters wrap
    the Linears, so the adapted model gives the saved model's logits."""
    from tests.test_init_from import save_toy, toy_overrides

    theirs = save_toy("llama3.2-1b", tmp_path)
    model = _built([*toy_overrides("llama3.2-1b", tmp_path), "peft=lora"]).eval()
    assert any(".lora_A." in n for n, _ in model.named_parameters())
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], theirs(input_ids=x).logits)


def test_merged_adapters_give_the_logits_of_the_unmerged_model():
    overrides = [*TINY["gpt2"], *BASE, "peft=lora", "optimizer.lr=0.01"]
    model = _trained(overrides, steps=3)[0]
    idx = _batch()[0]
    model.eval()
    with torch.no_grad():
        before = model(idx)[0]
        merged = [m for m in model.modules() if hasattr(m, "merge") and hasattr(m, "lora_A")]
        assert merged and any(m.lora_B["default"].weight.abs().sum() > 0 for m in merged)  # trained away from zero
        for m in merged:
            m.merge()
        after = model(idx)[0]
    assert torch.allclose(before, after, atol=1e-5)


def test_recompute_leaves_the_adapters_losses_unchanged():
    overrides = [*TINY["gpt2"], *BASE, "peft=lora", "optimizer.lr=0.01"]
    assert _trained([*overrides, "checkpoint=block"])[2] == pytest.approx(_trained(overrides)[2], rel=1e-6)


def test_qlora_starts_within_1_percent_of_the_bf16_base_and_trains():
    """The 4-bit base's quantisation error, at step 1, against the same weights in bf16; then the
    adapters alone bring the loss down on the learnable synthetic data."""
    overrides = [*TINY["gpt2"], *BASE, "precision=bf16_pure", "optimizer.lr=0.01"]
    batch = _batch()
    assert _first_loss(["precision=bf16_pure", "peft=qlora"], batch) == pytest.approx(
        _first_loss(["precision=bf16_pure", "peft=none"], batch), rel=0.01)
    losses = _trained([*overrides, "peft=qlora"], steps=12)[2]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 * 0.98


@pytest.mark.parametrize("overrides,match", [
    (["peft=qlora", "precision=bf16"], "peft=qlora computes its 4-bit layers"),
    (["peft=qlora", "parallel=fsdp", "parallel.nproc=2"], "a shard of a 4-bit weight"),
    (["peft=lora", "precision=fp8"], "with adapters"),
    (["peft=lora", "peft.r=0"], "peft.r=0 must be a positive integer"),
    (["peft=lora", "peft.targets=heads"], "peft.targets='heads' is not one of attention, mlp, all"),
    (["peft=dora", "peft.dropout=1.5"], r"peft.dropout=1.5 must be in \[0, 1\)"),
])
def test_combinations_adapters_cannot_run_are_refused_naming_the_key(overrides, match):
    with pytest.raises(Invalid, match=match):
        check_config(compose_spec([*TINY["gpt2"], *BASE, *overrides]), "cpu")


def test_adapters_without_peft_installed_are_an_invalid_row_naming_the_extra(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
    with pytest.raises(Invalid, match=r"peft=qlora needs Hugging Face peft: pip install -e '\.\[hf\]'"):
        check_config(compose_spec([*TINY["gpt2"], *BASE, "peft=qlora"]), "cpu")


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_a_frozen_head_gets_no_gradient_buffer_from_the_chunked_losses(loss):
    """The chunked and fused losses make the head's gradient themselves: with the head frozen, no
    tensor of its shape may be made at all (for Llama 3.1 8B, 2 GiB in bf16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _built([*TINY["gpt2"], *BASE, "peft=lora", f"loss={loss}", "model.vocab_size=96", "data.vocab_size=96"])
    head = tuple(model.lm_head.weight.shape)  # (96, 48): no other tensor of the step has it

    class Shapes(TorchDispatchMode):
        made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            self.made += [tuple(o.shape) for o in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs]  # not views
            return out

    idx = torch.randint(0, 96, (8, 64))
    with Shapes() as seen:
        model(idx, idx)[1].backward()
    assert head not in seen.made
    assert model.lm_head.weight.grad is None


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (8, 64), generator=g), torch.randint(0, 128, (8, 64), generator=g)


def _built(overrides: list[str]) -> torch.nn.Module:
    t = check_config(compose_spec(overrides), "cpu")
    torch.manual_seed(0)
    return build_model(t, torch.device("cpu"))


def _first_loss(overrides: list[str], batch) -> float:
    model = _built([*TINY["gpt2"], *BASE, *overrides])
    with torch.no_grad():
        return model(*batch)[1].item()


def _trained(overrides: list[str], steps: int = 5):
    """(model, techniques, per-step losses) after `steps` steps on the same batch."""
    spec = compose_spec(overrides)
    t = check_config(spec, "cpu")
    torch.manual_seed(0)
    model = build_model(t, torch.device("cpu"))
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")
    batch = _batch()
    losses = [train_step(model, optimizer, scaler, t, batch, torch.device("cpu")).item() for _ in range(steps)]
    return model, t, losses


@pytest.mark.slow
def test_ddp_and_fsdp_train_the_adapters_as_one_process_with_the_global_batch(tmp_path):
    """Two gloo ranks of 8 samples each against one process of 16 (SGD: the same math in another
    reduction order stays within float noise): LoRA and QLoRA under DDP, LoRA under FSDP2."""
    from tests.helpers import results_under, run_cli

    losses = {}
    for name, args in {"single": ["peft=lora,qlora", "batch_size=16"],
                       "ddp": ["peft=lora,qlora", "parallel=ddp", "batch_size=8"],
                       "fsdp": ["peft=lora", "parallel=fsdp", "batch_size=8"]}.items():
        proc = run_cli(["-m", *args, "optimizer=sgd", f"hydra.sweep.dir={tmp_path}/{name}"], tmp_path / name)
        assert proc.returncode == 0, proc.stderr
        for r in results_under(tmp_path / name):
            assert r["status"] == "ok", r["reason"]
            losses[(r["choices"]["parallel"], r["choices"]["peft"])] = r["metrics"]["losses"]
    for parallel, peft in (("ddp", "lora"), ("ddp", "qlora"), ("fsdp", "lora")):
        assert losses[(parallel, peft)] == pytest.approx(losses[("single", peft)], abs=1e-5), (parallel, peft)


@pytest.mark.parametrize("overrides,reason", [
    (["checkpoint=ops", "precision=fp32"], "selective op recompute"),
    (["checkpoint=layers", "precision=bf16"], "layer-type recompute of the Linears"),
    (["checkpoint=layers", "precision=fp32", "peft.targets=mlp"], "beside a frozen part"),
])
def test_adapters_under_recompute_that_keeps_more_of_them_go_to_the_trace(overrides, reason):
    """Selective op recompute keeps the adapters' matmul outputs too; a wrapper around each
    adapter's first Linear keeps peft's fp32 copy of a 16-bit input where autocast's 16-bit cast
    was counted, and one around a frozen Linear its input. The analytic model has none of these (24%,
    3.8% and 15% short at hidden 256), so it says so and the trace, which follows the real step,
    predicts them."""
    base, overrides = [*TINY["llama"], *BASE], ["peft=lora", *overrides]
    spec = compose_spec([*base, *overrides])
    with pytest.raises(Unmodelled, match=reason):
        analytic(spec)
    assert predict(spec, "trace").peak_mib == pytest.approx(measured(overrides, base=base).peak_mib, rel=0.02)


def _wide(name: str, overrides: list[str], seq_len: int = 128) -> tuple[float, float]:
    """(analytic, measured) peak MiB of `name` at hidden 256 (test_families' widths), 4 x `seq_len` tokens."""
    from tests.test_families import _PHI3, tiny

    full = [*tiny(name, *_PHI3), "data.vocab_size=128", "optimizer=adamw_foreach", *overrides]
    base = ["device=cpu", "batch_size=4", f"seq_len={seq_len}"]
    return analytic(compose_spec([*base, *full])).peak_mib, measured(full, base).peak_mib


@pytest.mark.parametrize("targets,precision,checkpoint", [
    ("all", "bf16", "none"), ("all", "bf16_pure", "layers"),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("all", "fp32", "none"), ("all", "bf16_pure", "block"), ("all", "bf16", "block"), ("mlp", "bf16", "mlp"),
        ("attention", "bf16", "attention"), ("mlp", "fp32", "attention"), ("mlp", "bf16_pure", "none"),
        ("all", "fp32", "layers")])])
def test_adapters_with_dropout_are_predicted_within_half_a_percent(targets, precision, checkpoint):
    """Off CUDA, torch's dropout keeps its noise in its input's dtype (peft's cast to the adapter's),
    not CUDA's 1-byte mask; the adapters reading layer 0's input, which needs no gradient, keep
    none; and the MLP's last adapter holds the MLP's input and its own, which the dropouts copy,
    with the dropout's fp32 output under autocast. Counted with a 1-byte mask alone, these were
    4-20% short (all targets without recompute: 14% in fp32, 19% in bf16). Under layer-type
    recompute a wrapper around each base Linear keeps the input the dropouts' copies stood in
    for (without it, 10% short), and the MLP, kept from forward, frees its output projection's
    dropout copy and mask before gate's and up's gradients exist (1.4% over in fp32 without)."""
    pred, real = _wide("llama3.2-1b", ["peft=lora", "peft.dropout=0.1", f"peft.targets={targets}",
                                       f"precision={precision}", f"checkpoint={checkpoint}"])
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16_pure"])
def test_gpt2s_adapted_mlp_with_dropout_sums_one_input_gradient_at_a_time(precision):
    """GPT-2's adapted c_proj frees its branch's dropout copy and mask before its base's input
    gradient joins the branch's: counted as two gradients beside all it keeps, block recompute was
    2.3% over in fp32 and 2.9% in pure bf16."""
    base, overrides = [*TINY["gpt2"], *BASE], ["peft=lora", "peft.dropout=0.1", "peft.targets=mlp",
                                               f"precision={precision}", "checkpoint=block"]
    real = measured(overrides, base=base)
    assert analytic(compose_spec([*base, *overrides])).peak_mib == pytest.approx(real.peak_mib, rel=0.005)


@pytest.mark.parametrize("targets,precision,checkpoint", [
    ("mlp", "bf16", "attention"),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("attention", "fp32", "mlp"), ("attention", "bf16_pure", "mlp"), ("mlp", "fp32", "attention"),
        ("mlp", "bf16", "mlp"), ("all", "bf16", "mlp"), ("all", "bf16", "attention")])])
def test_a_part_recomputed_on_its_own_beside_adapters_is_predicted_within_half_a_percent(targets, precision,
                                                                                          checkpoint):
    """A wrapper around a frozen part keeps its input, which the unwrapped part does not, and its
    recompute makes all the part keeps; a wrapper around the MLP keeps the input its adapters' forward
    holds anyway; a frozen weight's cast inside a wrapper goes once the part has run (autocast caches
    only the casts of weights that need a gradient); and layer 0's frozen attention, which needs no
    gradient, keeps nothing wrapped or not. Without these: attention-only adapters under MLP
    recompute were 2.3-3.2% short, all or MLP-only ones under MLP recompute in bf16 2.6-3.0% over,
    and under attention recompute in bf16 0.5-1.3% off."""
    pred, real = _wide("llama3.2-1b", ["peft=lora", f"peft.targets={targets}", f"precision={precision}",
                                       f"checkpoint={checkpoint}"])
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("name,precision,checkpoint", [
    ("llama3.2-1b", "bf16", "block"),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("llama3.2-1b", "fp32", "none"), ("llama3.2-1b", "bf16_pure", "block"), ("llama3.2-1b", "bf16", "mlp"),
        ("qwen3", "bf16", "block"), ("gemma3_text", "bf16", "block")])])
def test_adapters_on_attention_beside_a_frozen_mlp_are_predicted_within_half_a_percent(name, precision, checkpoint):
    """A frozen output projection keeps no input for a weight gradient; a trained one's kept input
    stood in for the gradient of that input, which its backward makes and the MLP's backward then
    holds beside its two widest gradients. Counted without it, Llama under block recompute was 5.3%
    short in bf16, 7.8% in pure bf16 and 8.5% in fp32, and 6.4% in fp32 without recompute."""
    pred, real = _wide(name, ["peft=lora", "peft.targets=attention", f"precision={precision}",
                              f"checkpoint={checkpoint}"])
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("name,targets,precision,checkpoint,seq_len", [
    ("llama3.2-1b", "mlp", "bf16_pure", "block", 128),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("llama3.2-1b", "all", "bf16_pure", "every2", 128), ("llama3.2-1b", "mlp", "bf16_pure", "mlp", 128),
        ("qwen3", "all", "bf16_pure", "block", 128), ("llama3.2-1b", "all", "fp32", "none", 512),
        ("llama3.2-1b", "all", "bf16_pure", "block", 512), ("gemma3_text", "all", "fp32", "mlp", 128)])])
def test_doras_weight_norm_is_predicted_within_half_a_percent(name, targets, precision, checkpoint, seq_len):
    """DoRA's weight norm in an MLP's forward, or in a whole layer's recompute, has a 16-bit
    residual stream beside it, which a recompute of the MLP alone does not; down_proj's identity
    and dense update outlive the norm, to its magnitude's multiply, which over 2,048 tokens is the
    recompute's peak; Gemma 3's norm on the MLP's output makes that output's gradient before a
    wrapped MLP is recomputed; and in fp32 the final norm's backward, the peak without recompute
    at 2,048 tokens, holds five (tokens, hidden) tensors. Without them pure bf16 under block
    recompute was 1.1-1.8% short (Qwen3's 1.7%), Gemma 3 under MLP recompute 1.5%, and fp32
    without recompute 1.3%."""
    pred, real = _wide(name, ["peft=dora", f"peft.targets={targets}", f"precision={precision}",
                              f"checkpoint={checkpoint}"], seq_len)
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("name,targets,precision,dropout", [
    ("gpt2", "mlp", "bf16", 0.1),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("gpt2", "all", "fp32", 0.1), ("gpt2", "mlp", "bf16_pure", 0.1), ("gemma3_text", "all", "fp32", 0.1),
        ("llama3.2-1b", "mlp", "bf16_pure", 0.1), ("gpt2", "all", "bf16", 0.0), ("gpt2", "mlp", "bf16", 0.0)])])
def test_a_recomputed_mlp_whose_adapters_copy_its_input_is_predicted_within_half_a_percent(name, targets,
                                                                                            precision, dropout):
    """Under dropout (and on GPT-2's fp32 stream under autocast, whose casts Llama's count already)
    the MLP's adapters read copies of its input, so nothing in the MLP keeps the input itself; a
    wrapper around the MLP keeps it beside the recompute. The recompute runs without the decoder
    layer around it, so no 16-bit residual stream is alive there, and down_proj's dropout copy and
    mask go with its backward whether the MLP was recomputed or kept. Without these, GPT-2 was
    1.3-3.0% short and Gemma 3 in fp32 1.8%; Llama in pure bf16 measured exact only by two of them
    cancelling."""
    overrides = ["peft=lora", f"peft.dropout={dropout}", f"peft.targets={targets}", f"precision={precision}",
                 "checkpoint=mlp"]
    if name == "gpt2":
        base = [*TINY["gpt2"], *BASE]
        pred, real = analytic(compose_spec([*base, *overrides])).peak_mib, measured(overrides, base=base).peak_mib
    else:
        pred, real = _wide(name, overrides, 256 if name == "gemma3_text" else 128)
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("name,precision,checkpoint,seq_len", [
    ("llama3.2-1b", "fp32", "none", 128),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("llama3.2-1b", "bf16_pure", "mlp", 128), ("llama3.2-1b", "fp32", "block", 128),
        ("gemma3_text", "fp32", "block", 64), ("gemma3_text", "bf16_pure", "none", 64)])])
def test_qlora_over_a_few_tokens_a_micro_batch_is_predicted_within_half_a_percent(name, precision, checkpoint,
                                                                                   seq_len):
    """The MLP's 4-bit output projection is dequantised whole for its input's gradient, beside that
    gradient and the branch's: where a micro-batch has fewer tokens than the model's width, that
    weight outweighs the MLP's widest gradients. Gemma 3's norm on the MLP's output made the
    gradient of the projection's output, alive there too. Counted without it, gradient accumulation
    over 4 micro-batches of 64 or 128 tokens was 4-7% short."""
    pred, real = _wide(name, ["peft=qlora", f"precision={precision}", f"checkpoint={checkpoint}",
                              "accumulation=x4"], seq_len)
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("name,precision,checkpoint", [
    ("qwen3", "fp32", "none"),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("qwen3", "bf16_pure", "every2"), ("gemma3_text", "fp32", "none"), ("gemma3_text", "bf16_pure", "mlp"),
        ("gemma3_text", "bf16", "attention")])])
def test_adapters_on_the_mlp_beside_a_frozen_attention_are_predicted_within_half_a_percent(name, precision,
                                                                                            checkpoint):
    """Layer 0's frozen attention, whose input needs no gradient, keeps nothing: what it would keep is
    the frozen attention's (its q/k norms' normalised values already gone with their frozen weights),
    and with it Gemma 3's norm on attention's output keeps nothing either. Counted as a fully trained
    attention's, Qwen3 was 1.2-1.3% short and Gemma 3 0.7% over (1.9-4.5% without its post-norm)."""
    pred, real = _wide(name, ["peft=lora", "peft.targets=mlp", f"precision={precision}",
                              f"checkpoint={checkpoint}"])
    assert pred == pytest.approx(real, rel=0.005)


@pytest.mark.parametrize("peft,precision,checkpoint,seq_len", [
    ("lora", "bf16", "block", 256),
    *(pytest.param(*point, marks=pytest.mark.slow) for point in [
        ("lora", "bf16", "every2", 256), ("dora", "fp32", "block", 128), ("lora", "fp32", "block", 256)])])
def test_gemma3s_recomputed_layer_runs_to_its_post_mlp_norm(peft, precision, checkpoint, seq_len):
    """Gemma 3's norm on the MLP's output asks for its layer's recompute before any of the MLP's
    backward has run (beside its output's gradient upcast to fp32 from 16 bits), and the recompute
    runs past down_proj to that norm, through the first forward's tail, before the norm has made
    what it keeps. Counted as Llama's, which stops at down_proj's branch, LoRA with dropout in bf16
    was 2.4% over with block recompute and 1.7% over with every second block's, DoRA in fp32 1.5%
    over; LoRA in fp32 measured exact only by errors cancelling."""
    dropout = ["peft.dropout=0.1"] if peft == "lora" else []
    pred, real = _wide("gemma3_text", [f"peft={peft}", *dropout, f"precision={precision}",
                                       f"checkpoint={checkpoint}"], seq_len)
    assert pred == pytest.approx(real, rel=0.005)
