"""Technique effects that only a GPU shows, asserted on measured torch.cuda peaks. Opt in: -m gpu."""
from __future__ import annotations

import pytest
import torch

from helpers import train_nano

pytestmark = pytest.mark.gpu
# A model big enough that activations and optimizer states dominate the allocator's peak.
MODEL = ["model=gpt-mini", "model.vocab_size=512", "data.vocab_size=512"]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker was selected on a machine without CUDA")


def _peak(overrides: list[str], steps: int = 3, batch_size: int = 16, seq_len: int = 256):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    losses, model, opt, t = train_nano([*MODEL, *overrides], steps=steps, batch_size=batch_size,
                                       seq_len=seq_len, device="cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    return losses, peak


def test_block_recompute_lowers_the_cuda_peak():
    base, none_peak = _peak([])
    losses, block_peak = _peak(["checkpoint=block"])
    assert block_peak < 0.8 * none_peak
    assert losses == pytest.approx(base, abs=1e-5)


def test_pinned_activation_offload_lowers_the_cuda_peak():
    base, none_peak = _peak([])
    losses, off_peak = _peak(["offload=activations"])
    assert off_peak < 0.8 * none_peak
    assert losses == pytest.approx(base, abs=1e-5)


def test_optimizer_offload_moves_adamw_states_off_the_device():
    base, none_peak = _peak([], batch_size=1, seq_len=32)
    losses, off_peak = _peak(["offload=optimizer"], batch_size=1, seq_len=32)
    assert off_peak < none_peak
    assert losses == pytest.approx(base, abs=1e-3)


def test_fused_adamw_on_cuda_matches_foreach():
    _, fused, _, _ = train_nano([*MODEL, "optimizer=adamw_fused"], device="cuda")
    _, foreach, _, _ = train_nano([*MODEL, "optimizer=adamw_foreach"], device="cuda")
    for a, b in zip(fused.parameters(), foreach.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fp16_uses_an_enabled_grad_scaler_and_trains():
    losses, model, _, t = train_nano([*MODEL, "precision=fp16"], steps=20, device="cuda")
    assert t.precision.grad_scaler("cuda").is_enabled()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
