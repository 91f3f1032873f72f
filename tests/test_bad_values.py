"""Values that cannot mean what they say are `invalid` rows naming the key or the file, found by
the job before any worker starts: data counts (train_samples, eval_samples, branching, order),
model.dropout outside [0, 1), empty or odd-length token files, a chars file that is not text.
A plan (predict_only=true) refuses the same points a run does; data.eval_samples=0 means no eval."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from ablate.data import Chars, Synthetic, Tokens
from ablate.outcome import validate
from ablate.techniques import Invalid
from helpers import compose_spec, results_under, run_cli, started_pids

NANO = ["model=gpt-nano", "device=cpu", "batch_size=4", "seq_len=16"]


@pytest.mark.parametrize("override, reason", [
    ("data.train_samples=0", "data.train_samples=0 must be >= 1"),
    ("data.train_samples=-3", "data.train_samples=-3 must be >= 1"),
    ("data.eval_samples=-1", "data.eval_samples=-1 must be >= 0 (0: no held-out split, no eval_loss)"),
    ("data.branching=0", "data.branching=0 must be >= 1"),
    ("data.branching=-2", "data.branching=-2 must be >= 1"),
    ("data.order=0", "data.order=0 must be >= 1"),
    ("model.dropout=2.0", "model.dropout=2.0 must be in [0, 1)"),
    ("model.dropout=-0.5", "model.dropout=-0.5 must be in [0, 1)"),
    ("model.dropout=1.0", "model.dropout=1.0 must be in [0, 1)"),  # every activation zeroed
])
def test_a_count_or_rate_out_of_range_is_invalid_in_the_job_naming_its_key(override, reason):
    outcome = validate(compose_spec([*NANO, override]))
    assert outcome is not None and (outcome.status, outcome.reason) == ("invalid", reason)


@pytest.mark.parametrize("kind", ["chars", "tokens"])
def test_a_negative_eval_samples_of_a_file_source_is_invalid_naming_its_key(tmp_path, kind):
    outcome = validate(compose_spec([*NANO, f"data={kind}", f"data.path={tmp_path}", "data.eval_samples=-4"]))
    assert (outcome.status, outcome.reason) == ("invalid", "data.eval_samples=-4 must be >= 0 "
                                                           "(0: no held-out split, no eval_loss)")


def test_no_eval_samples_is_a_run_without_eval(tmp_path):
    """data.eval_samples=0: no held-out split, so no eval batches and no loss floor to compare with."""
    assert validate(compose_spec([*NANO, "data.eval_samples=0"])) is None
    data = Synthetic(vocab_size=64, train_samples=8, eval_samples=0).load(8)
    assert list(data.eval_batches(4)) == [] and data.loss_floor is None
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "val.bin")
    tokens = Tokens(str(tmp_path), eval_samples=0).load(8)
    assert list(tokens.eval_batches(4)) == [] and tokens.train_batch(0, 2)[0].shape == (2, 8)
    assert math.isfinite(Synthetic(vocab_size=64, train_samples=8, eval_samples=4).load(8).loss_floor)


def _tokens(path, train: bytes, val: bytes) -> str:
    path.mkdir()
    (path / "train.bin").write_bytes(train)
    (path / "val.bin").write_bytes(val)
    return str(path)


@pytest.mark.parametrize("train, val, what", [
    (b"", b"\x01\x00" * 40, "train.bin is empty (0 bytes): no tokens"),
    (b"\x01\x00" * 40, b"", "val.bin is empty (0 bytes): no tokens"),
    (b"\x01\x00" * 40 + b"\x01", b"\x01\x00" * 40, "train.bin has an odd length of 81 bytes: "
                                                   "not uint16 tokens (2 bytes each)"),
    (b"\x01\x00" * 40, b"\x01" * 41, "val.bin has an odd length of 41 bytes: not uint16 tokens (2 bytes each)"),
], ids=["empty-train", "empty-val", "odd-train", "odd-val"])
def test_an_empty_or_odd_length_token_file_is_invalid_in_the_job_naming_it(tmp_path, train, val, what):
    path = _tokens(tmp_path / "bins", train, val)
    outcome = validate(compose_spec([*NANO, "data=tokens", f"data.path={path}"]))
    assert (outcome.status, outcome.reason) == ("invalid", f"data.path={path}: {what}")
    with pytest.raises(Invalid, match=re.escape(what)):  # and the worker's load, should the file change after the job looked
        Tokens(path).load(8)


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4


@pytest.mark.parametrize("content, what", [
    (PNG, "is not UTF-8 text: invalid start byte at byte 0"),
    (b"hello\x00world " * 50, "is not text: a NUL byte at byte 5"),  # valid UTF-8, but binary
    ("caf\u00e9 ".encode("latin-1") * 50, "is not UTF-8 text: invalid continuation byte at byte 3"),
    (b"", "is empty: no characters"),
], ids=["png", "nul", "latin-1", "empty"])
def test_a_chars_file_that_is_not_text_is_invalid_in_the_job_naming_it(tmp_path, content, what):
    f = tmp_path / "input.txt"
    f.write_bytes(content)
    outcome = validate(compose_spec([*NANO, "data=chars", f"data.path={f}"]))
    assert (outcome.status, outcome.reason) == ("invalid", f"data.path={f} {what}")


def test_binary_past_the_head_the_job_reads_is_invalid_when_the_worker_loads_it(tmp_path):
    """The job reads a chars file's head only; load reads it all, and names the file too."""
    nul, latin = tmp_path / "nul.txt", tmp_path / "latin.txt"
    nul.write_bytes(b"abc " * 20000 + b"\x00" + b"abc " * 10)
    latin.write_bytes(b"abc " * 20000 + "\u00e9".encode("latin-1") + b"abc " * 10)
    for f in (nul, latin):
        assert validate(compose_spec([*NANO, "data=chars", f"data.path={f}"])) is None
    with pytest.raises(Invalid, match=re.escape(f"data.path={nul} is not text: a NUL at character 80000")):
        Chars(str(nul)).load(8)
    with pytest.raises(Invalid, match=re.escape(f"data.path={latin} is not UTF-8 text")):
        Chars(str(latin)).load(8)


def test_a_character_cut_at_the_end_of_the_head_is_still_text(tmp_path):
    f = tmp_path / "input.txt"
    f.write_bytes(b"a" * (2**16 - 1) + "\u00e9".encode() * 100)  # the head ends inside a 2-byte character
    Chars(str(f)).check()


@pytest.mark.parametrize("plan", [False, True], ids=["run", "plan"])
def test_a_run_and_a_plan_both_refuse_a_file_that_is_not_text_through_the_cli(tmp_path, plan):
    """Both invalid, neither starting a worker: a plan refuses what the run would."""
    binary, nul = tmp_path / "a.png", tmp_path / "b.txt"
    binary.write_bytes(PNG)
    nul.write_bytes(b"hello\x00world " * 50)
    args = ["-m", "data=chars", f"data.path={binary},{nul}", f"hydra.sweep.dir={tmp_path}/s", *NANO,
            "steps=3", "warmup_steps=2", *(["predict_only=true"] if plan else [])]
    proc = run_cli(args, tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr
    reasons = {r["config"]["data"]["path"]: (r["status"], r["reason"]) for r in results_under(tmp_path / "s")}
    assert reasons == {str(binary): ("invalid", f"data.path={binary} is not UTF-8 text: invalid start byte at byte 0"),
                       str(nul): ("invalid", f"data.path={nul} is not text: a NUL byte at byte 5")}
    assert not started_pids(tmp_path) and not list((tmp_path / "s").rglob("worker.log"))


@pytest.mark.parametrize("argv, message", [
    (["optimizer.lr=abc"], "optimizer.lr='abc' must be a finite float (optimizer=adamw has 0.0006)."),
    (["-m", "optimizer=adamw,sgd", "optimizer.lr=0.1,abc"], "optimizer.lr='abc' must be a finite float"),
    (["accumulation=x2", "accumulation.steps=2.5"], "accumulation.steps=2.5 must be int (accumulation=x2 has 2)."),
    (["optimizer.in_backward=yes"], "optimizer.in_backward='yes' must be bool (optimizer=adamw has false)."),
    (["checkpoint=block", "checkpoint.every_n=x"], "checkpoint.every_n='x' must be int"),
])
def test_an_option_key_of_the_wrong_type_is_refused_on_the_command_line(argv, message):
    from ablate.command_line import unknown_key

    assert message in (unknown_key(argv) or "")


def test_values_of_the_files_types_and_keys_whose_file_has_none_pass_the_command_line():
    from ablate.command_line import unknown_key

    for argv in (["optimizer.lr=1"], ["optimizer.lr=1e-3"], ["optimizer=sgd", "optimizer.momentum=0.9"],
                 ["optimizer.in_backward=true"], ["parallel=ddp", "parallel.nproc=auto"]):
        assert unknown_key(argv) is None, argv


def test_a_typed_value_error_exits_1_and_writes_no_row(tmp_path):
    proc = run_cli(["optimizer.lr=abc"], tmp_path)
    assert proc.returncode == 1 and "optimizer.lr='abc' must be a finite float" in proc.stderr
    assert results_under(tmp_path) == []  # refused like a misspelt key, not a row in the next report
