"""benchmarks/profile_step.py: a point's steps under torch.profiler, as a page of where the time goes."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from torch.autograd import DeviceType

from tests.helpers import FAST, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step  # noqa: E402  (benchmarks/ is no package)


def rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the Markdown table whose header starts with `heading`."""
    lines = page.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(heading))
    body = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    return body


@pytest.mark.slow  # the benchmark script end to end (13 s)
def test_a_cpu_point_gets_its_top_operators_by_their_own_time(tmp_path):
    args = ["--results", str(tmp_path), "--steps", "2", "--top", "5", "--micro-batch", "2", *FAST]
    proc = subprocess.run([sys.executable, "benchmarks/profile_step.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "cpu" / "profile_step.md").read_text()
    assert f"python benchmarks/profile_step.py {' '.join(args)}" in page  # the command, to run it again
    assert "batch 4 (micro-batch 2)" in page
    table = rows(page, "| Operator |")
    assert len(table) == 5
    ms = [float(r[2]) for r in table]
    assert ms == sorted(ms, reverse=True) and ms[-1] > 0
    assert sum(float(r[3].rstrip("%")) for r in table) <= 100.05
    assert any(r[0].startswith("`aten::") for r in table)  # the model's own operators, not the profiler's
    assert "ms wall" in page and "Kernel" not in page  # no device, so no kernel or host-wait table


@dataclass
class Event:
    """What profile_step reads of one row of torch.profiler's key_averages()."""

    key: str
    count: int
    device_type: DeviceType
    self_device_time_total: float = 0.0  # microseconds
    self_cpu_time_total: float = 0.0


def test_on_a_gpu_kernels_rank_by_device_time_and_host_waits_are_counted():
    """The CUDA path, with events shaped like the profiler's: the CPU operator that launched a
    kernel carries that kernel's time too, and must not be counted twice."""
    events = [Event("aten::mm", 40, DeviceType.CPU, self_device_time_total=9000.0, self_cpu_time_total=800.0),
              Event("sm90_xmma_gemm_bf16", 40, DeviceType.CUDA, self_device_time_total=9000.0),
              Event("flash_fwd_kernel", 24, DeviceType.CUDA, self_device_time_total=3000.0),
              Event("vectorized_elementwise_kernel", 200, DeviceType.CUDA, self_device_time_total=2000.0),
              Event("cudaStreamSynchronize", 2, DeviceType.CPU, self_cpu_time_total=4000.0),
              Event("cudaLaunchKernel", 264, DeviceType.CPU, self_cpu_time_total=1500.0)]
    busy_ms, lines = profile_step.tables(events, on_gpu=True, steps=2, top=2)
    page = "\n".join(lines)
    assert busy_ms == 7.0  # 14,000 us of kernels over 2 steps
    assert rows(page, "| Kernel |") == [["`sm90_xmma_gemm_bf16`", "20", "4.500", "64.3%"],
                                        ["`flash_fwd_kernel`", "12", "1.500", "21.4%"]]
    assert rows(page, "| Call |") == [["`cudaStreamSynchronize`", "1", "2.000"]]  # launches are no wait


@pytest.mark.gpu
def test_on_a_gpu_the_page_ranks_the_steps_kernels(tmp_path):
    """The CUDA path for real (the GPU host runs it before profiling gpt2 with it): kernels with
    device time, the step's kernel time inside its wall time, and the waits table."""
    import torch

    from bench import device_dir

    if not torch.cuda.is_available():
        pytest.fail("the gpu marker was selected on a machine without CUDA")
    args = ["--results", str(tmp_path), "--steps", "2", "--top", "5", "model=gpt-mini", "precision=bf16",
            "batch_size=8", "seq_len=256", "device=cuda"]
    proc = subprocess.run([sys.executable, "benchmarks/profile_step.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / device_dir(torch.cuda.get_device_name()) / "profile_step.md").read_text()
    kernels = rows(page, "| Kernel |")
    assert len(kernels) == 5 and all(float(r[2]) > 0 for r in kernels)
    wall, busy = re.search(r"Per step: ([\d.]+) ms wall, ([\d.]+) ms on the device", page).groups()
    assert 0 < float(busy) <= float(wall) * 1.05  # kernels run inside the step (one stream, little overlap)
    assert rows(page, "| Call |")  # the waits table, even if it says (none)
