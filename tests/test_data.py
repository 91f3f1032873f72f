"""Data options: deterministic, held-out eval split, and a synthetic source a model can learn."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ablate.data import Chars, Synthetic, Tokens
from ablate.outcome import validate
from ablate.techniques import Invalid
from tests.helpers import compose_spec


def test_synthetic_is_seeded_and_shifted():
    a, b = Synthetic(vocab_size=64, train_samples=32).load(16), Synthetic(vocab_size=64, train_samples=32).load(16)
    xa, ya = a.train_batch(3, 4)
    xb, _ = b.train_batch(3, 4)
    assert torch.equal(xa, xb) and xa.shape == (4, 16) and xa.dtype == torch.int64
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one
    assert int(xa.max()) < 64
    c = Synthetic(vocab_size=64, train_samples=32, seed=7).load(16)
    assert not torch.equal(c.train_batch(3, 4)[0], xa)


def test_synthetic_floor_is_below_uniform_and_matches_empirical_entropy():
    data = Synthetic(vocab_size=32, order=1, branching=4, train_samples=2000, eval_samples=2000).load(32)
    assert 0 < data.loss_floor < math.log(4) + 0.01 + math.log(32) / 32
    # The count-based bigram entropy of the held-out rows estimates the same floor.
    rows = np.concatenate([np.concatenate([x.numpy(), y[:, -1:].numpy()], 1) for x, y in data.eval_batches(500)])
    counts = np.zeros((32, 32))
    np.add.at(counts, (rows[:, :-1].ravel(), rows[:, 1:].ravel()), 1)
    p = counts / counts.sum(1, keepdims=True).clip(1)
    h = -(counts * np.log(np.where(p > 0, p, 1))).sum() / counts.sum()
    assert abs(h - data.loss_floor) < 0.05


def test_ranks_and_epochs_see_different_samples():
    data = Synthetic(vocab_size=64, train_samples=8).load(8)
    r0, r1 = data.train_batch(0, 2, rank=0, world_size=2)[0], data.train_batch(0, 2, rank=1, world_size=2)[0]
    assert not torch.equal(r0, r1)
    epoch0 = {tuple(r) for s in range(4) for r in data.train_batch(s, 2)[0].tolist()}
    assert len(epoch0) == 8  # one epoch visits every training sample once


def test_eval_split_is_held_out():
    data = Synthetic(vocab_size=512, train_samples=64, eval_samples=16).load(32)
    train = {tuple(r) for r in data.train.tolist()}
    assert not any(tuple(r) in train for r in data.eval.tolist())
    assert sum(len(x) for x, _ in data.eval_batches(5)) == 16


def test_tokens_reads_nanogpt_bin_files(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(200, dtype=np.uint16) + 5000).tofile(tmp_path / "val.bin")
    data = Tokens(str(tmp_path), eval_samples=4).load(10)
    x, y = data.train_batch(0, 3)
    assert torch.equal(y, x + 1) and int(x.max()) < 1000  # consecutive windows of train.bin
    ex, _ = next(data.eval_batches(4))
    assert int(ex.min()) >= 5000


def test_a_missing_data_file_is_invalid_in_the_job_naming_the_path(tmp_path):
    for data in (Tokens(str(tmp_path)), Chars(str(tmp_path / "input.txt"))):
        with pytest.raises(Invalid, match=f"data.path={tmp_path}.*: no "):
            data.check()  # the job's look, so a plan refuses what the worker's load would
        with pytest.raises(Invalid, match=f"data.path={tmp_path}"):
            data.load(8)


def test_chars_builds_a_vocabulary_and_splits(tmp_path):
    f = tmp_path / "input.txt"
    f.write_text("abcdefgh" * 50 + "xyz" * 20)
    data = Chars(str(f), eval_samples=3).load(8)
    assert data.vocab_size == 11
    x, y = data.train_batch(0, 2)
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


def test_data_too_short_or_a_chain_wider_than_its_vocabulary_names_the_key(tmp_path):
    """A chain's branching is an invalid row from the job, before any worker starts; a text too short
    for seq_len an error row naming data.path once the worker reads it (a longer file fixes it, and
    a rerun retries errors, never invalid rows)."""
    f = tmp_path / "input.txt"
    f.write_text("abc" * 10)
    with pytest.raises(ValueError, match="data.path: the train split has 27 tokens, needs more than seq_len=64"):
        Chars(str(f)).load(64)
    outcome = validate(compose_spec(["data.vocab_size=8", "model.vocab_size=8", "data.branching=9"]))
    assert (outcome.status, outcome.reason) == ("invalid", "data.branching=9 > data.vocab_size=8")


def test_eval_is_bounded_by_eval_steps_and_off_at_zero():
    """A 2-step run evaluated 256 held-out samples after training (4 minutes of gpt2 on a CPU):
    eval_steps batches of batch_size now, none at 0."""
    from ablate.build import check_config
    from ablate.train import evaluate

    data = Synthetic(vocab_size=64, train_samples=32, eval_samples=64).load(8)
    t = check_config(compose_spec(["model=gpt-nano", "model.vocab_size=64", "data.vocab_size=64", "device=cpu"]))
    model = t.model.build()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    one = evaluate(model, data, 4, t, torch.device("cpu"), batches=1)
    assert seen == [4] and one > 0  # one batch of 4 of the 64 held-out samples
    assert evaluate(model, data, 4, t, torch.device("cpu"), batches=3) != one and seen[1:] == [4, 4, 4]
    assert evaluate(model, data, 4, t, torch.device("cpu"), batches=0) is None and len(seen) == 4


def test_eval_runs_the_training_micro_batches_and_a_compiled_model_eagerly():
    """Eval holds a micro-step's memory, not the whole batch's: with accumulation x2 a batch of 4
    goes through the model as two of 2, and its mean loss is the whole batch's. A compiled model
    is not compiled again for eval mode (11-15 s on gpt2: benchmarks/results/NVIDIA-H200/README.md):
    it runs eagerly."""
    from ablate.build import check_config
    from ablate.train import evaluate

    data = Synthetic(vocab_size=64, train_samples=32, eval_samples=64).load(8)
    overrides = ["model=gpt-nano", "model.vocab_size=64", "data.vocab_size=64", "device=cpu"]
    whole, halves = (check_config(compose_spec([*overrides, f"accumulation.steps={n}"])) for n in (1, 2))
    torch.manual_seed(0)
    model = whole.model.build()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    one = evaluate(model, data, 4, whole, torch.device("cpu"), batches=2)
    assert seen == [4, 4]
    split = evaluate(model, data, 4, halves, torch.device("cpu"), batches=2)
    assert seen[2:] == [2, 2, 2, 2] and split == pytest.approx(one, rel=1e-5)

    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo hands the compiler
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    x, y = next(iter(data.eval_batches(4)))
    compiled(x, y)  # training mode: compiled once
    before = len(graphs)
    assert before >= 1
    assert evaluate(compiled, data, 4, whole, torch.device("cpu"), batches=2) == pytest.approx(one, rel=1e-5)
    assert len(graphs) == before and compiled.training
