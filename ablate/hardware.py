"""Per-device figures: dense peak TFLOP/s per GPU and compute dtype (for MFU and the step-time
model), memory and host-link bandwidths (for the step-time model), the PaLM FLOPs count (frozen
weights at 4 FLOPs a token, not 6).

Vendor datasheet figures, peaks without sparsity. MFU must divide by the peak of the dtype the
matmuls actually ran in: an fp32 run on an H100 is measured against 67 TFLOP/s, not against bf16's
989. `peak_tflops=` overrides the table. What a device achieves of these figures is the step-time
model's business (ablate/predict/step_time.py), not this table's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# name fragment (matched against torch.cuda.get_device_name, lower case) -> {dtype: TFLOP/s}.
# Ordered: the first fragment found in the device name wins, so specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("h100 pcie", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("h100 nvl", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    ("h100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),  # SXM
    ("a100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("l40s", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1}),
    ("l40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0}),
    ("a40", {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7}),
    ("a10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("l4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    ("v100", {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0}),  # no TF32 or bf16 tensor cores
    ("4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),  # fp32 accumulate
    ("3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),  # fp32 accumulate
]


def peak_tflops(gpu_name: str | None, compute_dtype: str, override: float | None = None) -> float | None:
    """The dense peak for this GPU and dtype, `override` if given, None if unknown (MFU is then null)."""
    if override is not None:
        return float(override)
    if not gpu_name:
        return None
    name = gpu_name.lower()
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in name:
            return peaks.get(compute_dtype)
    return None


@dataclass(frozen=True)
class Device:
    """A device the step-time model knows: its datasheet's bandwidths, and its peaks (PEAK_TFLOPS's
    row for `fragment`, unless given here)."""

    name: str  # what run key gpu_model takes
    fragment: str  # found, as a whole word, in torch.cuda.get_device_name() (lower case)
    memory_gbs: float  # device memory bandwidth, GB/s (HBM, GDDR; the CPU's DRAM)
    link_gbs: float  # host link, GB/s each way (PCIe x16); 0 where the host memory is the device's
    peaks: dict = field(default_factory=dict)  # TFLOP/s per dtype where PEAK_TFLOPS has no row

    def peak_tflops(self, compute_dtype: str, override: float | None = None) -> float | None:
        return override if override is not None else self.peaks.get(compute_dtype) or \
            peak_tflops(self.fragment, compute_dtype)


# Ordered as PEAK_TFLOPS: the first whose fragment is in a device's name wins. PCIe Gen5 x16 moves
# 64 GB/s each way, Gen4 x16 32 GB/s.
DEVICES: list[Device] = [
    Device("h200", "h200", memory_gbs=4800, link_gbs=64),
    Device("h100-pcie", "h100 pcie", memory_gbs=2000, link_gbs=64),  # HBM2e
    Device("h100-nvl", "h100 nvl", memory_gbs=3900, link_gbs=64),
    Device("h100-sxm", "h100", memory_gbs=3350, link_gbs=64),  # HBM3, "NVIDIA H100 80GB HBM3"
    Device("a100", "a100", memory_gbs=2039, link_gbs=32),  # the 80 GB SXM4's (the 40 GB's: 1,555)
    Device("l4", "l4", memory_gbs=300, link_gbs=32),  # GDDR6
    Device("rtx-4090", "4090", memory_gbs=1008, link_gbs=32),  # GDDR6X
    Device("rtx-3090", "3090", memory_gbs=936, link_gbs=32),  # GDDR6X
]
# A CPU as the device: rough, of a 2-core slice of a server (AVX-512 FMA at ~2.6 GHz; a share of
# one socket's DRAM bandwidth). Planning for CPUs is not what the step-time model is for.
CPU = Device("cpu", "cpu", memory_gbs=20, link_gbs=0, peaks={"fp32": 0.3, "tf32": 0.3, "bf16": 0.3, "fp16": 0.1})
# The card a plan is made for when it names none and no GPU is in sight (gpu_model=null).
PLANNED = "h100-sxm"


def device(name: str | None) -> Device | None:
    """The device a GPU name stands for: a DEVICES name (gpu_model's value), or a name
    torch.cuda.get_device_name() gives ("NVIDIA H100 80GB HBM3"), matched by fragment as whole
    words ("l4" is not in "L40S"); None when none matches."""
    if not name:
        return None
    low = name.lower()
    for d in DEVICES:
        if low == d.name:
            return d
    for d in DEVICES:
        if re.search(rf"(?<![a-z0-9]){re.escape(d.fragment)}(?![a-z0-9])", low):
            return d
    return None


def flops_per_token(n_trainable: int, n_layer: int, width: int, seq_len: int, n_frozen: int = 0) -> int:
    """Model FLOPs per trained token, PaLM convention: 6N for the weights + 12 L H T for attention
    (H: the attention's width, query heads x head_dim; QK^T and AV make 4·T·H forward). A weight
    makes 2 FLOPs forward and 4 backward, 2 for its input's gradient and 2 for its own; a frozen
    one (`n_frozen`) has no gradient of its own to make, so it costs 4."""
    return 6 * n_trainable + 4 * n_frozen + 12 * n_layer * width * seq_len


def forward_flops_per_token(n_params: int, n_layer: int, width: int, seq_len: int) -> int:
    """The forward's share of `flops_per_token` (trainable and frozen weights alike): 2N + 4 L H T,
    what a recomputed forward runs again."""
    return 2 * n_params + 4 * n_layer * width * seq_len




# What a device achieves of its datasheet figures, and what the host spends launching a step: the
# step-time model's efficiencies (ablate/predict/step_time.py). Fit together on the recorded H100
# and H200 runs (benchmarks/results/NVIDIA-*/*/runs.csv, set against the model by
# benchmarks/repredict.py), for the most rows within 20% of their measured time, then the least
# squared log error on the rows whose time the model describes (the pages name the others and
# why); the rows each figure rests on most are named beside it.
# Dense matmuls' share of the peak: fp32 on the CUDA cores (the fp32 gpt2_large_ladder, leanest
# and gpt2_xl_8gib rows), tf32 and 16-bit on the tensor cores (the compiled bf16 gpt2_throughput
# rows, where matmuls are two thirds of the device's time).
MATMUL_EFFICIENCY = {"fp32": 0.73, "tensor": 0.65}
# The micro-batch's tokens at which matmuls run at half that share (the ladder's gpt2-large from
# 4,096 to 16,384 tokens, and the 2,048 of predict_check).
HALF_RATE_TOKENS = 200
# How many times slower a 16-bit LM head whose rows break tensor-core alignment multiplies than an
# aligned one: the eager gpt2_throughput rows, the H200's with 50,257 rows, the H100's padded to
# 50,304 (compiled, inductor pads them itself).
UNALIGNED_HEAD = 5.0
# Share of the memory bandwidth streaming kernels achieve (not fit: what elementwise kernels reach).
HBM_EFFICIENCY = 0.8
# Share of the host link that activation offload's pinned copies achieve (the leanest rows).
LINK_EFFICIENCY = 0.6
# Host seconds to launch one layer's forward and backward from Python, again for a recomputed one
# (the 16-bit predict_check rows, which the host bounds; a fixed cost per micro-step besides fit to
# nothing).
HOST_LAYER_S = 2.1e-3
# Host seconds of an optimizer step per parameter tensor and state it keeps (the same rows:
# AdamW's against SGD's).
HOST_TENSOR_S = 20e-6
# Host seconds FSDP waits per unit it gathers, per micro-step (the gpt2_xl_fsdp_batch_scan rows:
# FSDP1 rate-limits its all-gathers by waiting on the device).
FSDP_UNIT_S = 1.4e-3
