"""Benchmark: what the traced step (MemTracker, run once per point for its breakdown) costs against
an untraced step, as a model's layer count grows, on this machine's CPU.

    python benchmarks/traced_step_cost.py [--layers 8 32] [--peft none lora] [hydra overrides ...]

A Llama 3.1 8B layer shape scaled down (hidden 256, MLP 896) with block recompute and the chunked
loss, batch 1 x 128 tokens, fp32. Prints one Markdown row per (peft, layers): the median of three
untraced steps, the faster of two traced ones and their ratio. A tracer whose cost grows with the
square of the layers shows as a ratio that grows with them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ablate import measure  # noqa: E402
from ablate.build import check_config  # noqa: E402
from ablate.runner import load_data, trainer  # noqa: E402
from tests.helpers import compose_spec  # noqa: E402

SHAPE = ["model=llama3.1-8b", "model.config.hidden_size=256", "model.config.intermediate_size=896",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.vocab_size=4096",
         "precision=fp32", "checkpoint=block", "loss=chunked", "batch_size=1", "seq_len=128", "device=cpu"]


def cost(overrides: list[str]) -> tuple[float, float]:
    """(median untraced step, fastest traced step), seconds."""
    spec = compose_spec([*SHAPE, *overrides])
    t = check_config(spec, "cpu")
    t.precision.setup()
    device = torch.device("cpu")
    model, optimizer, step = trainer(spec, t, load_data(spec, t), device)
    step(0)
    untraced, traced = [], []
    for k in range(3):
        start = time.perf_counter()
        step(1 + k)
        untraced.append(time.perf_counter() - start)
    for k in range(2):
        start = time.perf_counter()
        measure.traced_step(lambda: step(4 + k), model, optimizer, device)
        traced.append(time.perf_counter() - start)
    return statistics.median(untraced), min(traced)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--peft", nargs="+", default=["none", "lora"])
    args, overrides = parser.parse_known_args()
    print("| peft | layers | overrides | step (s) | traced step (s) | ratio |\n|---|---:|---|---:|---:|---:|")
    for peft in args.peft:
        for layers in args.layers:
            step, traced = cost([f"peft={peft}", f"model.config.num_hidden_layers={layers}", *overrides])
            print(f"| {peft} | {layers} | {' '.join(overrides) or '-'} | {step:.3f} | {traced:.2f} | {traced / step:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
