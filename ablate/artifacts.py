"""The files a run leaves beside its result.json to say where the memory went (rank 0 writes them):

- memory_by_module.csv: the traced step's memory per module (MemTracker, any device);
- memory_snapshot.pickle: the CUDA caching allocator's record of the traced step (under
  compile=true, of the compiled warm-up step before it: ablate.runner.snapshot_compiled_step);
- oom_snapshot.pickle: the allocator's state at a CUDA OOM.

A snapshot opens in https://pytorch.org/memory_viz (drag the file onto the page; nothing is
uploaded). result.json names the files written under `artifacts` (ablate.results.ARTIFACTS).
Sizes in MiB (2**20 bytes).
"""
from __future__ import annotations

import csv
import os
import pickle
from pathlib import Path

import torch

from ablate.measure import _CATEGORY, BREAKDOWN_KEYS, MIB, Trace
from ablate.models.layout import bare_name
from ablate.results import ARTIFACTS

MODULE_COLUMNS = ("module", "depth", "fwd_peak_mib", "bwd_peak_mib", "at_peak_mib",
                  *(f"at_peak_{k}_mib" for k in BREAKDOWN_KEYS))
# Allocator events kept (a ring buffer: the newest win). A GPT-2-class step allocates and frees a
# few times per op: 100k covers a gpt2-xl step (~50k ops), a file of tens of MB.
HISTORY_ENTRIES = 100_000


def _inclusive(held: dict, root: str) -> dict[str, dict[str, float]]:
    """ModTracker name -> category -> MiB alive at the peak, each module with its submodules.
    What no module of the model allocated (the optimizer step's temporaries, a loss computed
    outside forward: ModTracker's "Global" or another root) is the root's."""
    out: dict[str, dict[str, float]] = {}
    for (owner, kind), nbytes in held.items():
        if owner != root and not owner.startswith(root + "."):
            owner = root
        parts = owner.split(".")
        for i in range(1, len(parts) + 1):
            split = out.setdefault(".".join(parts[:i]), dict.fromkeys(BREAKDOWN_KEYS, 0.0))
            split[_CATEGORY.get(kind, "other")] += nbytes / MIB
    return out


def module_rows(trace: Trace, model: torch.nn.Module) -> list[dict]:
    """memory_by_module.csv: one row per module of `model` (named_modules' path without wrappers;
    the root is "model"; depth counts the dots), in MiB:
    - fwd_peak_mib / bwd_peak_mib: the highest total of traced memory on the device (all of it,
      not just this module's) while the module's forward / backward ran; empty: it never ran one;
    - at_peak_mib and at_peak_<category>_mib: of the memory alive at the step's peak (the row
      "model" adds up to the traced peak, the breakdown's categories), what this module and its
      submodules allocated, plus the parameters they hold with their gradients and optimizer state.
    """
    root = type(model).__name__  # ModTracker names the root by its class, the rest by their path
    inclusive, rows, seen = _inclusive(trace.held, root), [], set()
    for name, _ in model.named_modules():
        clean = bare_name(name, model)
        if clean in seen:
            continue  # a wrapper's inner module: the wrapper's row (outermost) stands for it
        seen.add(clean)
        fqn = f"{root}.{name}" if name else root
        fwd, bwd = trace.windows.get(fqn, (-1, -1))
        split = inclusive.get(fqn, dict.fromkeys(BREAKDOWN_KEYS, 0.0))
        rows.append({"module": clean or "model", "depth": clean.count(".") + 1 if clean else 0,
                     "fwd_peak_mib": fwd / MIB if fwd >= 0 else None, "bwd_peak_mib": bwd / MIB if bwd >= 0 else None,
                     "at_peak_mib": sum(split.values()), **{f"at_peak_{k}_mib": v for k, v in split.items()}})
    return rows


def _atomic(path: Path, write, mode: str = "w") -> Path:
    """Write through a temporary file and rename it: a killed writer leaves no half file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, mode, **({"newline": ""} if mode == "w" else {})) as f:
        write(f)
    os.replace(tmp, path)
    return path


def write_module_csv(rows: list[dict], run_dir: str | Path) -> Path:
    """run_dir/memory_by_module.csv (columns MODULE_COLUMNS; an empty cell: not measured)."""
    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=MODULE_COLUMNS)
        writer.writeheader()
        writer.writerows({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in rows)
    return _atomic(Path(run_dir) / ARTIFACTS["memory_by_module"], write)


class AllocatorHistory:
    """The CUDA caching allocator's record of every allocation (Python stack, size, address) and
    free, for memory_viz. Nothing on a CPU, which has no such allocator.

    Recording costs host time on every allocation and free (~2 us with a Python stack, torch's
    figure; no C++ stacks, no stacks for frees) and a few KB per event kept, so it runs for the
    traced warm-up step only, which is untimed, so the measured steps never pay it (what it would
    cost a step is unmeasured). Blocks allocated before it (parameters, optimizer states) show
    in the snapshot without a stack; backward allocates on autograd's thread, which has no Python
    stack either.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.init()  # the allocator applies recording to the devices it has set up

    def start(self) -> None:
        if self.cuda:
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                     max_entries=HISTORY_ENTRIES, clear_history=True)

    def stop(self, run_dir: str | Path | None = None) -> Path | None:
        """Stop recording; first, given a run_dir, write run_dir/memory_snapshot.pickle."""
        if not self.cuda:
            return None
        try:
            if run_dir is None:
                return None
            snapshot = torch.cuda.memory._snapshot()
            return _atomic(Path(run_dir) / ARTIFACTS["memory_snapshot"], lambda f: pickle.dump(snapshot, f), "wb")
        finally:
            torch.cuda.memory._record_memory_history(None)


_at_oom: list = []  # the allocator's state at this process's latest CUDA OOM (at most one)


def watch_for_oom(device: torch.device) -> None:
    """On CUDA, keep the allocator's state at every OOM for `dump_oom_snapshot`.

    torch calls the observer inside the failing allocation, after freeing its cache and before
    raising, so the state holds everything the step had allocated (unwinding the raise frees it).
    The observer only copies that state to host memory: an OOM some code catches and survives
    writes no file. It costs nothing until an OOM. The snapshot has the blocks' sizes and
    addresses; stacks and a timeline only for an OOM in the traced step, where AllocatorHistory
    records (recording elsewhere would slow the other steps and the model's construction down).
    """
    if device.type != "cuda":
        return
    torch.cuda.init()  # observers attach to the allocator's devices: they must be set up

    def observer(device_index: int, requested: int, device_allocated: int, device_free: int) -> None:
        _at_oom[:] = [torch.cuda.memory._snapshot()]

    torch._C._cuda_attach_out_of_memory_observer(observer)


def dump_oom_snapshot(run_dir: str | Path, rank: int = 0) -> Path | None:
    """Write the state kept at the last CUDA OOM (rank r > 0: oom_snapshot.rank<r>.pickle, so
    ranks never write one file); None when none was observed (a CPU, an injected fault)."""
    if not _at_oom:
        return None
    name = ARTIFACTS["oom_snapshot"]
    if rank:
        name = name.replace(".pickle", f".rank{rank}.pickle")
    snapshot = _at_oom[0]
    return _atomic(Path(run_dir) / name, lambda f: pickle.dump(snapshot, f), "wb")
