"""Where a grid point's step time goes: its training steps under torch.profiler.

    python benchmarks/profile_step.py [--steps 3] [--top 15] [--micro-batch N] [--results DIR] [--name NAME]
                                      [overrides ...]   ->  <results>/<device>/<name>.md (name: profile_step)

The overrides are `python -m ablate`'s, composed the same way, and the point's own step runs
(ablate.runner.trainer), but in this process: one point, one device, no worker, nothing measured
for a result.json. warmup_steps run first (compile=true compiles there); then --steps steps are
profiled. The page gives, per step:
- the wall time and the time the device spent in kernels (the gap is the host: launches,
  Python, waits);
- the top kernels by device time (on a CPU: the top operators by their own CPU time);
- the host calls that wait for the device or copy across (cudaStreamSynchronize, cudaMemcpy,
  ...): a step that needs none still makes a few (the loss, GradScaler), each one a stall.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` without installing the project
    sys.path.insert(0, str(ROOT))

# CUDA runtime calls that block the host until the device catches up, or copy between the two.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cudaMemcpyAsync", "cudaStreamWaitEvent")


def compose(overrides: list[str]):
    """The point's RunSpec, composed as the job composes it (conf/, the schema, auto keys resolved)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ablate.job import resolve_alloc_conf, resolve_nproc
    from ablate.schema import CONF, register
    from ablate.spec import RunSpec

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    resolve_alloc_conf(config)
    resolve_nproc(config)
    return RunSpec.of(config)


def profile(spec, steps: int):
    """Warm the point up, then profile `steps` of its steps. Returns (profiler, device, wall ms per step)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ablate.build import check_config, pick_device
    from ablate.runner import load_data, trainer

    device = pick_device(spec.device)
    t = check_config(spec, device.type)
    if t.parallel.world_size > 1:
        raise SystemExit(f"profile_step runs one process; parallel.nproc={t.parallel.world_size}: "
                         "give parallel=single (or parallel.nproc=1)")
    device = t.parallel.setup(device)
    data = load_data(spec, t)
    torch.manual_seed(spec.seed)
    t.precision.setup()
    _, _, step = trainer(spec, t, data, device)
    for k in range(spec.warmup_steps):
        step(k)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for k in range(spec.warmup_steps, spec.warmup_steps + steps):
            step(k)
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    return prof, device, wall_ms


def tables(events, on_gpu: bool, steps: int, top: int) -> tuple[float, list[str]]:
    """(device ms per step, Markdown lines) from the profiler's `key_averages()`: the top kernels
    (CPU: operators) by their own time, and on a GPU the host's waits and copies."""
    from torch.autograd import DeviceType

    if on_gpu:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # kernels, memcpys, memsets
        own = {e.key: e.self_device_time_total for e in kernels}
        what, unit = "Kernel", "device"
    else:  # every operator's own time, less the profiler's step markers
        own = {e.key: e.self_cpu_time_total for e in events if not e.key.startswith("ProfilerStep")}
        what, unit = "Operator", "CPU"
    calls = {e.key: e.count for e in events}
    total_us = sum(own.values())
    lines = [f"| {what} | Calls per step | {'Device' if on_gpu else 'CPU'} ms per step | Share of {unit} time |",
             "|---|---:|---:|---:|"]
    for name, us in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        shown = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{shown.replace('|', '/')}` | {calls[name] / steps:g} | {us / 1e3 / steps:.3f} | "
                     f"{us / (total_us or 1.0):.1%} |")
    if on_gpu:
        waits = sorted((e for e in events if e.key in WAITS and e.device_type == DeviceType.CPU),
                       key=lambda e: -e.count)
        lines += ["", "Host calls that wait for the device or copy across:", "",
                  "| Call | Calls per step | Host ms per step |", "|---|---:|---:|"]
        lines += [f"| `{e.key}` | {e.count / steps:g} | {e.self_cpu_time_total / 1e3 / steps:.3f} |"
                  for e in waits] or ["| (none) | 0 | 0 |"]
    return total_us / 1e3 / steps, lines


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="benchmarks/profile_step.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps profiled, after the point's warmup_steps")
    parser.add_argument("--top", type=int, default=15, help="rows in the kernel (operator) table")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where <device>/ goes")
    parser.add_argument("--name", default="profile_step", help="the page's file name, without .md")
    parser.add_argument("--micro-batch", type=int, help="train batch_size in micro-batches of this size (a "
                        "find_batch row's max_batch_size), accumulation making up the rest")
    args, overrides = parser.parse_known_args(argv)
    spec = compose(overrides)
    if args.micro_batch:
        if spec.batch_size % args.micro_batch:
            parser.error(f"--micro-batch {args.micro_batch} does not divide batch_size={spec.batch_size}")
        spec = spec.with_micro_batch(args.micro_batch)
    elif spec.find_batch:
        parser.error("find_batch=true: profile_step searches nothing; give --micro-batch N (a find_batch row's "
                     "max_batch_size) or find_batch=false")
    if spec.alloc_conf:  # the worker's setting, before this process first touches CUDA
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = spec.alloc_conf

    import torch

    from ablate.job import git_sha
    from bench import device_dir

    prof, device, wall_ms = profile(spec, args.steps)
    busy_ms, lines = tables(prof.key_averages(), device.type == "cuda", args.steps, args.top)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    where = "on the device" if gpu else "in operators (CPU time)"
    page = [f"# Where a step's time goes: {' '.join(overrides) or 'the defaults'}", "",
            f"- command: `python benchmarks/profile_step.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
            f"- commit: `{git_sha()}`; device: {gpu or 'CPU'}; torch {torch.__version__}, CUDA {torch.version.cuda or '-'}",
            f"- {args.steps} steps profiled after {spec.warmup_steps} warm-up steps; batch {spec.batch_size} "
            f"(micro-batch {spec.batch_size // spec.groups['accumulation']['steps']}) x seq {spec.seq_len}, "
            f"compile={str(spec.compile).lower()}", "",
            f"Per step: {wall_ms:.2f} ms wall, {busy_ms:.2f} ms {where} ({busy_ms / wall_ms:.0%} of the wall).", "",
            *lines, ""]
    out = Path(args.results) / device_dir(gpu) / f"{args.name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(page))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
