"""The worker: one process that builds, trains and measures one grid point, then reports.

Started by the job as `python -m ablate.worker <run_dir>/spec.json`. It reports through
<run_dir>/events.jsonl (ablate/events.py), never through its exit code alone, so the job can tell
an OOM from a crash without reading logs.
"""
from __future__ import annotations

import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.utils import instantiate

from ablate import measure
from ablate.build import build_model, build_optimizer, check_config, gpt_config, pick_device, plan_of
from ablate.events import EventWriter
from ablate.hardware import flops_per_token, peak_tflops
from ablate.techniques import Invalid
from ablate.train import evaluate, train_step

PROGRESS_EVERY_S = 0.5  # at most this often a loss is read back (a device sync) for the progress line


def inject_fault(overrides: list[str]) -> None:
    """Test hook: ABLATE_FAULT=oom|error|hang|kill[:substring] fails the points whose overrides
    contain the substring (all points without one), the way a real failure would."""
    spec = os.environ.get("ABLATE_FAULT")
    if not spec:
        return
    kind, _, match = spec.partition(":")
    if match and not any(match in o for o in overrides):
        return
    if kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by ABLATE_FAULT)")
    if kind == "error":
        raise RuntimeError("injected by ABLATE_FAULT")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def run(spec: dict, events: EventWriter) -> dict:
    cfg = spec["config"]
    device = pick_device(cfg["device"])
    t = check_config(cfg, device.type)
    data = instantiate(cfg["data"]).load(cfg["seq_len"])
    if data.vocab_size > cfg["model"]["vocab_size"]:
        raise Invalid(f"data vocabulary {data.vocab_size} > model.vocab_size={cfg['model']['vocab_size']}")
    torch.manual_seed(cfg["seed"])
    t.precision.setup()
    mem = measure.DeviceMemory(device)

    events.emit("phase", phase="init")
    mem.reset()
    model = build_model(cfg["model"], t, device)
    optimizer = build_optimizer(model, t)
    init_peak = mem.peak_allocated_mib()
    scaler = t.precision.grad_scaler(device.type)
    B, world = cfg["batch_size"], t.parallel.nproc
    steps = math.ceil(cfg["samples"] / (B * world)) if cfg.get("samples") else cfg["steps"]
    warmup = cfg["warmup_steps"]

    def step(k: int) -> torch.Tensor:
        return train_step(model, optimizer, scaler, t, data.train_batch(k, B), device)

    events.emit("phase", phase="train")
    inject_fault(spec.get("overrides", []))
    mem.reset()
    losses = [step(k) for k in range(warmup - 1)]
    breakdown, traced_peak = None, None
    if warmup >= 1:  # the last warm-up step is traced for the memory breakdown (untimed)
        breakdown, traced_peak = measure.traced_step(lambda: losses.append(step(warmup - 1)),
                                                     model, optimizer, device)

    events.emit("phase", phase="measure")
    timer, start, last_report = measure.StepTimer(device), time.monotonic(), 0.0
    for k in range(warmup, warmup + steps):
        timer.start()
        losses.append(step(k))
        timer.stop()
        now = time.monotonic()
        if now - last_report >= PROGRESS_EVERY_S or k == warmup + steps - 1:
            events.emit("progress", step=k - warmup + 1, steps=steps, loss=losses[-1].item(),
                        elapsed_s=now - start)
            last_report = now
    times = timer.times_ms()
    peaks = mem.peaks()
    if peaks["peak_allocated_mib"] is None:  # no allocator on CPU: the traced tensor peak stands in
        peaks["peak_allocated_mib"] = traced_peak

    events.emit("phase", phase="eval")
    eval_loss = evaluate(model, data, B, t, device)
    loss_values = torch.stack(losses).tolist() if losses else []
    tail = loss_values[-max(1, steps // 10):]  # loss_final: mean of the last 10% of steps

    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    n = model.num_params(non_embedding=True) if hasattr(model, "num_params") else None
    mc = gpt_config(cfg["model"])
    tokens = steps * B * world * cfg["seq_len"]
    seconds = sum(times) / 1e3
    tflops = flops_per_token(n, mc.n_layer, mc.n_embd, cfg["seq_len"]) * tokens / seconds / world / 1e12
    peak = peak_tflops(gpu_name, t.precision.compute_dtype, cfg.get("peak_tflops"))
    mfu = tflops / peak if peak else None
    metrics = {
        **peaks,
        "host_peak_rss_mib": measure.host_peak_rss_mib(),
        "init_peak_allocated_mib": init_peak,
        "breakdown_mib": breakdown,
        **measure.percentiles(times),
        "train_latency_s": seconds,
        "tokens_per_s": tokens / seconds,
        "samples_per_s": steps * B * world / seconds,
        "tflops": tflops,
        "mfu": mfu,
        "hfu": mfu * (1 + t.checkpoint.recompute_fraction / 3) if mfu is not None else None,
        "loss_first": loss_values[0] if loss_values else None,
        "loss_final": sum(tail) / len(tail) if tail else None,
        "eval_loss": eval_loss,
        "loss_floor": data.loss_floor,
        "losses": loss_values,
    }
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_name": gpu_name,
        "gpu_total_mib": torch.cuda.get_device_properties(device).total_memory / measure.MIB
        if gpu_name else None,
        "world_size": world,
        "python": platform.python_version(),
    }
    return {"metrics": metrics, "env": env}


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running a point."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", text
    if isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc):
        return "oom", text  # host allocation failed: the CPU's out-of-memory
    if isinstance(exc, Invalid):
        return "invalid", text
    return "error", f"{type(exc).__name__}: {text}"


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    events = EventWriter(spec["run_dir"])
    try:
        events.emit("result", **run(spec, events))
        return 0
    except Exception as exc:  # every failure becomes a reported status; the traceback goes to the log
        traceback.print_exc()
        status, reason = classify(exc)
        events.emit("failure", status=status, reason=reason)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
