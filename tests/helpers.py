"""Test helpers: compose the real config, and run the real CLI in a subprocess."""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import cli_zygote
from tests.composed import composed  # registers the config schema

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
# A grid point that trains in about a second on one CPU core.
FAST = ["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128", "data.train_samples=64",
        "data.eval_samples=8", "batch_size=4", "seq_len=16", "steps=3", "warmup_steps=2", "device=cpu"]


def slow_except(values, *kept) -> list:
    """`values` as parameters, each but `kept` marked slow: the default suite runs a case or two of
    a check that repeats a whole sweep per case (minutes on 2 cores), `make test-slow` the rest."""
    return [v if v in kept else pytest.param(v, marks=pytest.mark.slow) for v in values]


def fast_defaults(args) -> list[str]:
    """FAST less what `args` set (args win); another model drops gpt-nano's keys along with it."""
    keys = {a.lstrip("+").split("=")[0] for a in args}
    other_model = "model" in keys
    return [f for f in FAST if f.split("=")[0] not in keys and not (other_model and f.startswith("model"))]


def compose_config(overrides: list[str] = ()) -> dict:
    """The config the overrides compose to, as plain data: a copy of its own for each caller."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict:
    # a test that measures a point and then predicts it composes the same overrides twice
    return composed(overrides)


def compose_spec(overrides: list[str] = ()):
    """The composed config as the job hands it down: a RunSpec."""
    from ablate.spec import RunSpec

    return RunSpec.of(compose_config(overrides))


def run_cli(args: list[str], out_dir: Path, env: dict | None = None, timeout: float = 300,
            fast: bool = True) -> subprocess.CompletedProcess:
    """`python -m ablate ARGS` with outputs under out_dir; never raises on a non-zero exit. It runs
    forked from a process that has done the command's imports (tests/cli_zygote.py)."""
    defaults = fast_defaults(args) if fast else []
    full_env = {k: v for k, v in os.environ.items() if k != "ABLATE_FAULT"}
    full_env.update(env or {})
    return cli_zygote.run([*args, f"out_dir={out_dir}", *defaults], full_env, ROOT, timeout)


def run_report(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m analysis.report ARGS` from the repository, as subprocess.run with its output
    captured would run it, forked from the tests' CLI server (tests/cli_zygote.py): torch and
    ablate's options, which the report imports to name them, are imported there already."""
    return cli_zygote.run(args, dict(os.environ), ROOT, timeout, module="analysis.report")


def results_under(path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(path).rglob("result.json"))]


def started_pids(path: Path) -> list[int]:
    """The pids of the workers that started under `path` (their "started" events): a worker
    started ahead of its point has no point in its command line (launch/warm_start.py)."""
    return [json.loads(line)["pid"] for events in sorted(Path(path).rglob("events.jsonl"))
            for line in events.read_text().splitlines() if '"started"' in line]


def train_nano(overrides: list[str] = (), steps: int = 3, batch_size: int = 8, seq_len: int = 16, seed: int = 0,
               device: str = "cpu"):
    """Build the composed config's techniques and a nano GPT (FAST, then `overrides`), train `steps`
    steps through the real train_step on fixed synthetic data; returns (per-step losses, model,
    optimizer, techniques)."""
    import torch

    from ablate.build import build_model, build_optimizer, check_config
    from ablate.data import Synthetic
    from ablate.spec import RunSpec
    from ablate.train import train_step

    cfg = compose_config([*fast_defaults(overrides), f"batch_size={batch_size}", f"seq_len={seq_len}", *overrides])
    t = check_config(RunSpec.of(cfg), device)
    data = Synthetic(vocab_size=128, train_samples=64).load(seq_len)
    torch.manual_seed(seed)
    t.precision.setup()
    device = torch.device(device)
    model = build_model(t, device)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler(device.type)
    losses = [train_step(model, optimizer, scaler, t, data.train_batch(k, batch_size), device).item()
              for k in range(steps)]
    return losses, model, optimizer, t


def hf_toy(model_type: str) -> list[str]:
    """model=hf overrides for a toy `model_type` of transformers (2 layers, hidden 64, 128 tokens:
    ablate/models/hf_toy.py), with data of its vocabulary."""
    from ablate.models.hf_toy import toy_overrides

    return [*toy_overrides(model_type), "data.vocab_size=128"]


# Tiny configs the optimizer options' tests trace a real CPU step of: GPT-2, Llama (GQA), and one
# token through wide matrices, where the optimizer step's own tensors, not the activations, make the peak.
_NANO = ["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]
_LLAMA = ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "model.config.hidden_size=64",
          "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
          "model.config.num_key_value_heads=2", "model.config.head_dim=16", "model.config.vocab_size=128",
          "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]
_WIDE = ["model=gpt-nano", "model.n_embd=384", "model.n_head=6", "model.vocab_size=128", "data.vocab_size=128",
         "device=cpu", "batch_size=1", "seq_len=2"]
OPTIMIZER_CONFIGS = {"nano": _NANO, "llama": _LLAMA, "wide": _WIDE}


def traced_training(overrides: list[str], steps: int = 3):
    """`steps` real train_steps of the composed config on one fixed batch of learnable tokens (128 of
    them), the last traced by MemTracker. Returns (losses, Trace, model, optimizer, spec)."""
    import torch

    from ablate import measure
    from ablate.build import build_model, build_optimizer, check_config
    from ablate.data import Synthetic
    from ablate.train import train_step

    cpu = torch.device("cpu")
    spec = compose_spec(overrides)
    t = check_config(spec, "cpu")
    batch = Synthetic(vocab_size=128, train_samples=64).load(spec.seq_len).train_batch(0, spec.batch_size)
    torch.manual_seed(0)
    model = build_model(t, cpu)
    optimizer = build_optimizer(model, t)
    scaler = t.precision.grad_scaler("cpu")
    losses = []

    def step():
        losses.append(train_step(model, optimizer, scaler, t, batch, cpu).item())

    for _ in range(steps - 1):
        step()
    return losses, measure.traced_step(step, model, optimizer, cpu), model, optimizer, spec
