"""The model is GPT-2: its sizes, its parameter counts, and its logits next to Hugging Face's."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from ablate.models.gpt_module import GPTModule, SIZES, GPTConfig, on_meta
from helpers import FAST, ROOT, compose_config, results_under, run_cli

# GPT-2's published parameter counts (tied embeddings, vocab 50257, 1024 positions).
GPT2_PARAMS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
               "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(GPT2_PARAMS))
def test_gpt2_parameter_counts(name):
    cfg = compose_config([f"model={name}"])["model"]
    with on_meta():  # shapes only: no memory, even for gpt2-xl
        model = GPTModule(GPTConfig(cfg["n_layer"], cfg["n_head"], cfg["n_embd"]))
    assert model.num_params() == GPT2_PARAMS[name]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"]) == SIZES[name]


def test_a_model_on_meta_has_the_real_shapes_and_skips_the_initialisers():
    cfg = GPTConfig(2, 2, 32, vocab_size=100, block_size=16)
    with on_meta():
        meta = GPTModule(cfg)
    real = GPTModule(cfg)
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in real.named_parameters()]
    assert meta.lm_head.weight is meta.transformer.wte.weight
    assert real.transformer.wte.weight.std() > 0  # outside, the initialisers run as before
    # Why skip them: on meta they go through torch._refs, which imports torch._dynamo (~1 s). A
    # fresh process, since this one may have imported it already.
    code = ("import sys; from ablate.models.gpt_module import GPTModule, GPTConfig, on_meta\n"
            "with on_meta(): GPTModule(GPTConfig(2, 2, 32))\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_init_draws_each_weight_once_with_gpt2s_stds_and_the_same_values_on_any_number_of_threads(monkeypatch):
    """The weights are drawn on torch's threads at once (one normal_ runs on one core: gpt2-xl's
    build took 12-16 s of a point, benchmarks/results/NVIDIA-H200/README.md), so their values must
    not depend on the threads or the order the draws finish in; each weight, the residual
    projections included, is drawn once."""
    cfg = GPTConfig(4, 2, 256, vocab_size=1000, block_size=64)

    def built(threads: int, seed: int = 0) -> dict[str, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(seed)
            return {n: p.detach().clone() for n, p in GPTModule(cfg).named_parameters()}
        finally:
            torch.set_num_threads(before)

    one, two = built(1), built(2)
    assert all(torch.equal(one[n], two[n]) for n in one)
    assert not torch.equal(built(2, seed=1)["transformer.wte.weight"], one["transformer.wte.weight"])
    for name, w in one.items():
        if name.endswith("c_proj.weight"):
            assert w.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert w.std().item() == pytest.approx(0.02, rel=0.05), name
    calls = []
    normal_ = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda w, *a, **k: calls.append(w.shape) or normal_(w, *a, **k))
    with on_meta():  # as every point builds (precision.materialize): the layers' own initialisers skipped
        model = GPTModule(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.reset_parameters()
    assert len(calls) == 2 + 4 * cfg.n_layer  # wte (the head is tied to it), wpe, four matrices a layer


def test_embeddings_are_tied_and_counted_once():
    model = GPTModule(GPTConfig(2, 2, 32, vocab_size=100, block_size=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=True) == model.num_params() - 16 * 32


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPTModule(GPTConfig(2, 2, 32, vocab_size=100, block_size=16))
    x, y = torch.randint(0, 100, (2, 3, 16))
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, 100)
    assert abs(loss.item() - torch.log(torch.tensor(100.0)).item()) < 0.3  # near-uniform at init
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_a_padded_vocabulary_trains_as_the_unpadded_one():
    """model.pad_vocab_to: the embedding and the head get zero rows up to a multiple, which no
    token has and no logit shows. Same weights, same logits, loss and gradients (the standard and
    the chunked loss); the padding's gradient is zero, so it stays zero under any optimizer."""
    from ablate.techniques.loss import Chunked

    def built(cfg: GPTConfig) -> GPTModule:  # as every point builds it (precision.materialize): on meta, then initialised once
        with on_meta():
            model = GPTModule(cfg)
        model.to_empty(device="cpu")
        model.tie_weights()
        torch.manual_seed(0)
        model.reset_parameters()
        return model

    plain = built(GPTConfig(2, 2, 32, vocab_size=100, block_size=16))
    padded = built(GPTConfig(2, 2, 32, vocab_size=100, block_size=16, pad_vocab_to=64))
    assert padded.transformer.wte.weight.shape == (128, 32) and padded.lm_head.weight is padded.transformer.wte.weight
    assert padded.transformer.wte.weight[100:].abs().sum() == 0  # initialised zero, no token's row
    # one seed, one model: the token rows and every other weight draw what the unpadded model's do
    for name, p in padded.named_parameters():
        assert torch.equal(p[:100] if name == "transformer.wte.weight" else p, plain.get_parameter(name)), name
    x, y = torch.randint(0, 100, (2, 3, 16))
    for loss_fn in (None, Chunked(5)):
        plain.loss_fn = padded.loss_fn = loss_fn
        ours, theirs = padded(x, y), plain(x, y)
        if loss_fn is None:
            assert ours[0].shape == (3, 16, 100)
            torch.testing.assert_close(ours[0], theirs[0])
        torch.testing.assert_close(ours[1], theirs[1])
        padded.zero_grad(), plain.zero_grad()
        ours[1].backward(), theirs[1].backward()
        grad = padded.transformer.wte.weight.grad
        assert grad[100:].abs().sum() == 0
        torch.testing.assert_close(grad[:100], plain.transformer.wte.weight.grad)


def test_a_padded_vocabularys_rows_count_as_parameters_not_as_model_flops():
    from hydra.utils import instantiate

    plain, padded = (instantiate(compose_config(["model=gpt2", *o])["model"]) for o in ([], ["model.pad_vocab_to=64"]))
    assert padded.config.padded_vocab == 50304
    assert padded.num_params() - plain.num_params() == 47 * 768  # memory: the rows exist
    assert padded.flops_params() == plain.flops_params()  # MFU: no token's work


@pytest.mark.parametrize("pad", [1, 64])
def test_logits_match_huggingface_gpt2(tmp_path, pad):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ablate.models.gpt import load_weights, read_config

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=211, n_positions=48,
                                    bos_token_id=0, eos_token_id=0)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    ours = GPTModule(GPTConfig(**read_config(tmp_path), pad_vocab_to=pad)).eval()
    load_weights(ours, tmp_path)  # a padded model takes the checkpoint's rows, its padding left zero
    x = torch.randint(0, 211, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, rtol=1e-5, atol=1e-5)


def test_init_from_rejects_a_mismatched_checkpoint(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ablate.models.gpt import load_weights

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path)
    # named by the config key, not by the first tensor of another shape
    with pytest.raises(ValueError, match=f"model.init_from={tmp_path}: model.n_embd=64 but the checkpoint has 32$"):
        load_weights(GPTModule(GPTConfig(1, 2, 64, vocab_size=50, block_size=16)), tmp_path)


def test_a_run_from_a_checkpoint_starts_at_the_checkpoints_loss(tmp_path):
    """`model.init_from=DIR` through the CLI: the first step's loss is the checkpoint's on that
    batch, whether the model is built on the CPU and overwritten or built on meta and filled
    (precision.init_on_device=true, where nothing is initialised before the weights arrive)."""
    from hydra.utils import instantiate
    from transformers import GPT2Config, GPT2LMHeadModel

    from ablate.models.gpt import load_weights, read_config

    cfg = compose_config(FAST)
    model = cfg["model"]
    torch.manual_seed(7)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                                    vocab_size=model["vocab_size"], n_positions=model["block_size"],
                                    bos_token_id=0, eos_token_id=0))
    with torch.no_grad():  # large tied embeddings: a loss far from a fresh model's log(vocab_size)
        hf.transformer.wte.weight.mul_(20)
    hf.save_pretrained(tmp_path / "ckpt")
    ours = GPTModule(GPTConfig(**read_config(tmp_path / "ckpt")))
    load_weights(ours, tmp_path / "ckpt")
    x, y = instantiate(cfg["data"]).load(cfg["seq_len"]).train_batch(0, cfg["batch_size"])
    with torch.no_grad():
        expected = ours(torch.as_tensor(x), torch.as_tensor(y))[1].item()

    proc = run_cli(["-m", f"model.init_from={tmp_path / 'ckpt'}", "precision.init_on_device=false,true",
                    f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = results_under(tmp_path / "s")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows]
    for row in rows:
        assert row["metrics"]["losses"][0] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - math.log(model["vocab_size"])) > 1  # not what a fresh initialisation gives
