"""ablate/hardware.py: the dense peak TFLOP/s per GPU and compute dtype, and PaLM's FLOPs per
token, the two halves of MFU."""
from __future__ import annotations

from ablate.hardware import flops_per_token, peak_tflops


def test_peak_table_is_precision_aware():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA A10G", "bf16") == 125.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops("Mystery GPU", "bf16") is None
    assert peak_tflops("Mystery GPU", "bf16", override=100) == 100.0
    assert peak_tflops(None, "fp32") is None


def test_flops_per_token_matches_palm_for_gpt2():
    # GPT-2 124M: N without wpe = 124,439,808 - 1024 * 768; L=12, H=768, T=1024.
    n = 124_439_808 - 1024 * 768
    assert flops_per_token(n, 12, 768, 1024) == 6 * n + 12 * 12 * 768 * 1024
