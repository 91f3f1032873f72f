"""Dense peak TFLOP/s per GPU and compute dtype, for MFU. Vendor datasheet figures without sparsity.

MFU must divide by the peak of the dtype the matmuls actually ran in: an fp32 run on an H100 is
measured against 67 TFLOP/s, not against bf16's 989. `peak_tflops=` overrides the table.
"""
from __future__ import annotations

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


def flops_per_token(n_params_non_embedding: int, n_layer: int, width: int, seq_len: int) -> int:
    """Model FLOPs per trained token, PaLM convention: 6N for the weights + 12 L H T for attention
    (H: the attention's width, query heads x head_dim; QK^T and AV make 4·T·H forward)."""
    return 6 * n_params_non_embedding + 12 * n_layer * width * seq_len
