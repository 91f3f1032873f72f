"""Property: whatever a user types, ablate answers with a one-line error naming a key, or with a
row whose reason names one, or runs exactly the config that was asked for. Never a traceback.

Overrides are drawn (hypothesis): unknown options and keys, wrong types, zero, negative, huge and
non-finite numbers, empty strings, bad paths, and combinations of them; so are the files a point
reads (token and text files, checkpoints) and the directories it writes. Each draw goes through what the CLI
does before a worker starts (the command-line check, Hydra's composition, the job's validation);
a bounded sample goes through the CLI itself. The default suite draws a few dozen (derandomized:
the same ones every run); `make test-slow` draws 500 and more through the CLI.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

from ablate.command_line import unknown_key
from ablate.schema import GROUPS, OVERLAYS, option_keys, options
from helpers import ROOT, compose_config
from launch.start_checks import check_writable
from tests import cli_zygote

RUN_KEYS = ("batch_size", "seq_len", "steps", "warmup_steps", "eval_steps", "samples", "seed", "compile", "device", "peak_tflops",
            "timeout_s", "alloc_conf", "gpu_memory_gib", "prune", "prune_margin", "find_batch", "predict",
            "predict_only", "gpu_model")
HUGE = ["1e30", "999999999999", "inf", "-inf", "1e400", "1e308"]
NUMBERS = ["0", "-1", "1", "2", "3", "7", "64", "-0.5", "0.5", "1e-9", "nan", "0.0", "2.0", "5e-324"]
WORDS = ["''", "abc", "true", "false", "null", "[1,2]", "/nonexistent/dir", "/proc/forbidden", "../..", "cuda",
         "'a b'"]
# Options each group has, plus misspellings of them; and keys no config has.
CHOICES = {g: options(g) for g in (*GROUPS, *OVERLAYS)}  # experiment and scale too
# What a real run on a CPU can take within a test: no huge sizes (a batch of 10**12 samples would
# take the host's memory, not give a row), no model larger than gpt-micro.
TAME = {"values": NUMBERS + WORDS, "choices": {**CHOICES, "model": ["gpt-nano", "gpt-micro"]}}
WILD = {"values": NUMBERS + HUGE + WORDS, "choices": CHOICES}
TYPOS = ["adamx", "leanst", "nonexistent", "gpt-nan", "x4 ", ""]
UNKNOWN_KEYS = ["batch_sz", "model.n_layr", "optimizer.momentun", "foo", "checkpoint.every"]
# Sizes kept small enough for a model to be built and predicted (the CLI sample runs them).
SMALL = ["model=gpt-nano", "seq_len=16", "batch_size=4", "steps=2", "warmup_steps=2", "device=cpu"]


@st.composite
def an_override(draw, values: list[str], choices: dict) -> str:
    value = st.sampled_from(values)
    kind = draw(st.sampled_from(["run", "choice", "option_key", "unknown", "add"]))
    if kind == "run":
        return f"{draw(st.sampled_from(RUN_KEYS))}={draw(value)}"
    if kind == "choice":
        group = draw(st.sampled_from(sorted(choices)))
        return f"{group}={draw(st.sampled_from(choices[group] + TYPOS))}"
    if kind == "unknown":
        return f"{draw(st.sampled_from(UNKNOWN_KEYS))}={draw(value)}"
    group = draw(st.sampled_from(GROUPS))
    option = draw(st.sampled_from(CHOICES[group]))
    key = draw(st.sampled_from(option_keys(group, option) or ["x"]))
    other = draw(st.sampled_from(choices[group]))  # the key may belong to another option than the one run
    prefix = "+" if kind == "add" else ""
    return f"{group}={other} {prefix}{group}.{key}={draw(value)}"


def command_lines(kind: dict):
    return st.lists(an_override(**kind), min_size=1, max_size=3).map(lambda items: " ".join(items).split())


overrides, tame_overrides = command_lines(WILD), command_lines(TAME)


def _dedupe(args: list[str]) -> list[str]:
    """The last value of each key, as a command line's later override wins; Hydra refuses a key
    given twice, which is no input a person types."""
    last = {a.lstrip("+").split("=", 1)[0]: a for a in args}
    return list(last.values())


def _parsed(args: list[str]) -> list | None:
    try:
        return OverridesParser.create().parse_overrides(args)
    except HydraException:
        return None


def _names(args: list[str]) -> set[str]:
    """What a message may name: each override's key, its last part, its group, its value."""
    names = set()
    for a in args:
        key, _, value = a.lstrip("+").partition("=")
        names |= {key, key.split(".")[-1], key.split(".")[0], value.strip("'")}
    return {n for n in names if n}


def _same(asked, got) -> bool:
    if isinstance(asked, float) and isinstance(got, (int, float)):
        return got == asked or (math.isnan(asked) and math.isnan(got))
    return asked == got or (isinstance(got, str) and str(asked) == got)  # enums come back as their names


def before_the_worker(args: list[str]) -> tuple[str, object]:
    """What the CLI makes of `args` before any worker starts: ("error", message) for a command
    line it refuses, ("invalid", reason) for a row without a run, ("runs", config) otherwise."""
    from ablate.job import resolve_alloc_conf, resolve_nproc
    from ablate.outcome import validate
    from ablate.spec import RunSpec

    error = unknown_key(args)
    if error:
        return "error", error
    try:
        config = compose_config(args)
    except (HydraException, OmegaConfBaseException) as exc:  # printed by Hydra as its one message
        return "error", str(exc)
    resolve_nproc(config)
    resolve_alloc_conf(config)
    try:
        spec = RunSpec.of(config)
    except (KeyError, TypeError) as exc:
        pytest.fail(f"{args}: the job could not read its config: {exc!r}")
    invalid = validate(spec)
    return ("invalid", invalid.reason) if invalid else ("runs", config)


def check(args: list[str]) -> None:
    args = _dedupe(args)
    parsed = _parsed(args)
    kind, what = before_the_worker([*SMALL, *args])
    if kind == "error":
        assert what and "Traceback" not in what
        assert any(n in what for n in _names(args)), f"{args}: the error names none of them: {what}"
    elif kind == "invalid":
        assert what and "\n" not in what, f"{args}: a reason is one line: {what!r}"
        assert any(n in what for n in _names([*SMALL, *args])) or "=" in what, f"{args}: names nothing: {what}"
    else:  # it runs: exactly what was asked, and nothing its row could not hold
        json.dumps(what, allow_nan=False)  # a NaN or inf would train, then lose its row
        assert parsed is not None
        for o in parsed:
            if o.is_delete() or o.is_sweep_override():
                continue
            key = o.key_or_group
            if key in CHOICES or "/" in key:  # a group choice: its option's target is the one composed
                continue
            node = what
            for part in key.split("."):
                node = node[part]
            assert _same(o.value(), node), f"{args}: asked {key}={o.value()!r}, would run {node!r}"


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overrides)
def test_every_drawn_command_line_is_an_error_a_reason_or_what_was_asked(args):
    check(args)


@pytest.mark.slow
@settings(max_examples=500, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overrides)
def test_every_drawn_command_line_many(args):
    check(args)


def cli(args: list[str], out_dir, extra: list[str]) -> None:
    """The same property through `python -m ablate`: a row whose reason is one line (exit 0 when
    it ran or was planned, 1 when it did not end ok), or, with no row, exit 1 with a message and
    no traceback."""
    args = _dedupe(args)
    proc = cli_zygote.run([*SMALL, *extra, *args, f"out_dir={out_dir}"], dict(os.environ), ROOT, timeout=600)
    assert "Traceback" not in proc.stderr + proc.stdout, (args, proc.stderr[-3000:])
    rows = [json.loads(p.read_text()) for p in out_dir.rglob("result.json")]
    if not rows:  # a command line it refused
        assert proc.returncode == 1 and proc.stderr.strip(), (args, proc.stderr)
        return
    assert len(rows) == 1, (args, proc.stdout)
    assert rows[0]["status"] in ("ok", "predicted", "invalid", "oom"), (args, rows[0]["reason"])
    assert rows[0]["reason"] is None or "\n" not in rows[0]["reason"]
    assert proc.returncode == (0 if rows[0]["status"] in ("ok", "predicted") else 1), (args, proc.returncode)


@settings(max_examples=2, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(args=tame_overrides)
def test_a_drawn_command_line_through_the_cli(args, tmp_path_factory):
    cli(args, tmp_path_factory.mktemp("cli"), ["predict_only=true"])


@pytest.mark.slow
@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(args=tame_overrides)
def test_drawn_command_lines_through_the_cli_run_for_real(args, tmp_path_factory):
    # The time limit is the test's: a drawn timeout_s=0.5 gives a timeout row, rightly, not a finding
    args = [a for a in args if not a.lstrip("+").startswith("timeout_s=")]
    cli(args, tmp_path_factory.mktemp("cli"), ["timeout_s=120"])


# The files a point reads and the directories it writes, drawn: a text or token file of any bytes
# (empty, odd-length, binary, too short, fine), and an output directory anywhere.

ODD_BYTES = [b"", b"\0" * 7, bytes(range(256)), "h\xe9llo".encode("latin-1"), b"\xff\xfe" * 40,
             ("to be or not to be " * 40).encode(), bytes(2000)]
FILE_BYTES = st.one_of(st.binary(max_size=48), st.sampled_from(ODD_BYTES))
_FILES: list[Path] = []  # where drawn files go: a pytest temporary directory, pruned as they are


@pytest.fixture(autouse=True, scope="module")
def _drawn_files_root(tmp_path_factory):
    _FILES[:] = [tmp_path_factory.mktemp("drawn")]


@st.composite
def a_data_source(draw) -> list[str]:
    """data=chars or data=tokens over files of drawn bytes (token files may be missing)."""
    kind = draw(st.sampled_from(["chars", "tokens"]))
    where = Path(tempfile.mkdtemp(dir=_FILES[0]))
    if kind == "chars":
        path = where / "input.txt"
        path.write_bytes(draw(FILE_BYTES))
    else:
        path = where
        for name in draw(st.sets(st.sampled_from(["train", "val"]), min_size=1)):
            (where / f"{name}.bin").write_bytes(draw(FILE_BYTES))
    return [f"data={kind}", f"data.path={path}"]


def check_files(args: list[str]) -> None:
    """A drawn data source: the job refuses it naming data.path, or the worker's load reads it or
    fails saying data.path (one line each); never an exception naming nothing."""
    from ablate.build import check_config
    from ablate.runner import load_data
    from ablate.spec import RunSpec

    kind, what = before_the_worker([*SMALL, *args])
    assert kind != "error", (args, what)
    if kind == "invalid":
        assert "\n" not in what and "data." in what, (args, what)
        return
    spec = RunSpec.of(what)
    try:
        load_data(spec, check_config(spec, "cpu"))
    except Exception as exc:  # the worker's row: its reason is this message's first line
        assert "data.path" in str(exc).splitlines()[0], (args, repr(exc))


@pytest.mark.slow  # 30 drawn files (19 s); the drawn command lines run by default
@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(a_data_source())
def test_every_drawn_data_file_is_refused_naming_its_key_or_read(args):
    check_files(args)


@st.composite
def an_out_dir(draw) -> Path:
    """A directory to write results under: fine, under a file, a file itself, or where no one writes."""
    root = Path(tempfile.mkdtemp(dir=_FILES[0]))
    (root / "afile").write_text("")
    return draw(st.sampled_from([root / "new" / "deep", root, root / "afile", root / "afile" / "sub",
                                 Path("/proc/ablate"), Path("/sys/ablate/out"), Path("/proc/self/fd/0/x")]))


@settings(max_examples=12, derandomize=True, database=None, deadline=None)
@given(an_out_dir())
def test_every_drawn_out_dir_is_written_or_refused_in_one_line(path):
    try:
        check_writable(str(path), "out_dir")
    except SystemExit as stop:
        (line,) = str(stop.code).splitlines()
        assert line.startswith(f"error: cannot write under out_dir={path}: ") and "Nothing ran" in line
        return
    path.mkdir(parents=True, exist_ok=True)  # what the run does next, and can
    (path / "x").write_text("")


# A checkpoint for model.init_from, drawn: transformers' own GPT-2 save of gpt-nano's shapes with
# tensors dropped, added, reshaped or cast to another dtype.

NANO = ["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128"]
DTYPES = ["float16", "bfloat16", "float64", "int64", "int8", "uint8", "bool"]


@pytest.fixture(scope="module")
def nano_checkpoint(tmp_path_factory) -> dict:
    """gpt-nano's weights as transformers' GPT2LMHeadModel saves them: {name: tensor}."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = compose_config([*SMALL, *NANO])["model"]
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                                    vocab_size=model["vocab_size"], n_positions=model["block_size"]))
    where = tmp_path_factory.mktemp("nano")
    hf.save_pretrained(where)
    from safetensors.torch import load_file

    return {"config": (where / "config.json").read_text(), "state": load_file(where / "model.safetensors")}


@st.composite
def a_damage(draw, names: list[str]) -> list[tuple[str, str, str]]:
    """Up to three (what, tensor name, detail) changes to a checkpoint."""
    what = st.sampled_from(["drop", "reshape", "cast", "add"])
    return draw(st.lists(st.tuples(what, st.sampled_from(names), st.sampled_from(DTYPES)), max_size=3))


def damaged(checkpoint: dict, damage: list[tuple[str, str, str]]) -> Path:
    import torch
    from safetensors.torch import save_file

    state = dict(checkpoint["state"])
    for what, name, dtype in damage:
        if name not in state:
            continue
        if what == "drop":
            del state[name]
        elif what == "reshape":
            state[name] = state[name].flatten()[: max(1, state[name].numel() // 2)]
        elif what == "cast":
            state[name] = state[name].to(getattr(torch, dtype))
        else:
            state[f"{name}.extra"] = state[name].clone()
    where = Path(tempfile.mkdtemp(dir=_FILES[0]))
    (where / "config.json").write_text(checkpoint["config"])
    save_file({k: v.contiguous() for k, v in state.items()}, where / "model.safetensors")
    return where


def check_checkpoint(checkpoint: dict, damage: list) -> None:
    """The job refuses a damaged checkpoint naming model.init_from (one line), or the worker's load
    takes it; a load never fails with a message naming nothing."""
    from ablate.build import check_config
    from ablate.spec import RunSpec

    args = [*NANO, f"model.init_from={damaged(checkpoint, damage)}"]
    kind, what = before_the_worker([*SMALL, *args])
    assert kind != "error", (damage, what)
    if kind == "invalid":
        assert "\n" not in what and what.startswith("model.init_from="), (damage, what)
        return
    family = check_config(RunSpec.of(what), "cpu").model
    family.load_weights(family.build())  # what the job let through, the worker loads


@pytest.mark.slow  # 25 drawn checkpoints (17 s)
@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_drawn_checkpoint_is_refused_naming_init_from_or_loads(nano_checkpoint, data):
    check_checkpoint(nano_checkpoint, data.draw(a_damage(sorted(nano_checkpoint["state"]))))
