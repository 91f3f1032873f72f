"""The driver's view of a worker, sampled from the job process: GPU memory and utilisation.

NVML sees what the allocator cannot: the CUDA context, NCCL buffers, other libraries' memory.
Where there is no driver (CPU machines, CI) every field is None.
"""
from __future__ import annotations

import os
import statistics
import threading

import psutil

MIB = 2**20


def visible_gpu_count() -> int:
    """GPUs a worker started from here would see, without initialising CUDA in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    nv = _nvml()
    return nv.nvmlDeviceGetCount() if nv else 0


def gpu_total_mib() -> float | None:
    """Total memory of the first GPU a worker would see (None without one), without initialising CUDA."""
    nv = _nvml()
    if not nv or visible_gpu_count() == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    try:
        handle = (nv.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                  else nv.nvmlDeviceGetHandleByUUID(visible))
        return nv.nvmlDeviceGetMemoryInfo(handle).total / MIB
    except Exception:  # an odd CUDA_VISIBLE_DEVICES entry: capacity unknown, nothing is pruned
        return None


def near_cpus(gpus: list[int]) -> dict[int, set[int]]:
    """The CPUs near each GPU (NVML index, PCI order), as NVML's affinity mask says: its NUMA
    node's. {} where there is no driver; a GPU NVML cannot answer for is left out."""
    nv = _nvml()
    if not nv:
        return {}
    words = -(-(os.cpu_count() or 1) // 64)  # the mask in 64-bit words, CPU 64w+b at word w's bit b
    near = {}
    for gpu in gpus:
        try:
            mask = nv.nvmlDeviceGetCpuAffinity(nv.nvmlDeviceGetHandleByIndex(gpu), words)
        except Exception:  # a fake id (tests), an old driver
            continue
        near[gpu] = {64 * w + b for w, word in enumerate(mask) for b in range(64) if word >> b & 1}
    return near


def _nvml():
    try:
        import pynvml  # provided by the nvidia-ml-py package

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no device: nothing to sample
        return None


def _visible_indices(n: int) -> set[int]:
    """NVML indices of the devices a worker started from here may use: those CUDA_VISIBLE_DEVICES
    names by index (NVML ignores the variable and numbers devices in PCI order, as CUDA does under
    CUDA_DEVICE_ORDER=PCI_BUS_ID, which hydra/launcher=gpu_pool sets), else all of them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if visible is None or not all(e.isdigit() for e in entries):  # unset, or UUIDs: all
        return set(range(n))
    return {int(e) for e in entries}


class NvmlSampler:
    """Every `interval_s`: memory of the worker's process tree per device, and utilisation of the
    devices it uses while `measuring` is set (so init and eval do not dilute GPU Usage %)."""

    def __init__(self, root_pid: int, interval_s: float = 0.1):
        self.root_pid, self.interval_s = root_pid, interval_s
        self.measuring = False
        self.nvml = _nvml()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.peak_mib: float | None = None
        self.peak_by_pid: dict[int, float] = {}  # MiB, for per-rank peaks under torchrun
        self.util: list[float] = []
        if self.nvml:
            n = self.nvml.nvmlDeviceGetCount()
            self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            # Fallback where process ids are not visible (containers): growth over this baseline,
            # on the worker's own devices only (points may run beside it on the others).
            self._baseline = [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
            self._own = _visible_indices(n)

    def __enter__(self) -> "NvmlSampler":
        if self.nvml:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _pids(self) -> set[int]:
        try:
            root = psutil.Process(self.root_pid)
            return {self.root_pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.Error:
            return {self.root_pid}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # a driver hiccup loses one sample, never the run
                continue

    def _sample(self) -> None:
        nv, pids = self.nvml, self._pids()
        total, used_devices = 0, []
        for i, h in enumerate(self._handles):
            procs = [p for p in nv.nvmlDeviceGetComputeRunningProcesses(h) if p.pid in pids]
            for p in procs:
                self.peak_by_pid[p.pid] = max(self.peak_by_pid.get(p.pid, 0.0), (p.usedGpuMemory or 0) / MIB)
            mine = [p.usedGpuMemory or 0 for p in procs]
            if not mine and i in self._own:  # pid namespaces hide the worker: count the device's growth instead
                grown = nv.nvmlDeviceGetMemoryInfo(h).used - self._baseline[i]
                mine = [grown] if grown > 0 else []
            if mine:
                total += sum(mine)
                used_devices.append(h)
        if used_devices:
            self.peak_mib = max(self.peak_mib or 0.0, total / MIB)
        if self.measuring:
            self.util += [float(nv.nvmlDeviceGetUtilizationRates(h).gpu) for h in used_devices]

    def fields(self) -> dict:
        """The result-contract fields this sampler owns."""
        driver = None
        if self.nvml:
            driver = self.nvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        return {
            "nvml_peak_mib": self.peak_mib,
            "gpu_util_pct_mean": statistics.fmean(self.util) if self.util else None,
            "gpu_util_pct_std": statistics.pstdev(self.util) if len(self.util) > 1 else None,
            "driver": driver,
        }
