"""Families whose configs are more than one size per key: Gemma 4's head_dim that differs between
its sliding-window and full-attention layers (transformers' per-layer configs), Gemma 3n's
per-layer lists, DeepSeek's latent attention; each at toy size (ablate/models/hf_toy.py)."""
from __future__ import annotations

import math

import pytest
from hydra.utils import instantiate

from tests.helpers import compose_config, hf_toy, train_nano

pytest.importorskip("transformers")


def test_gemma4_trains_with_a_head_width_per_layer_and_counts_their_mean_for_mfu():
    """The toy keeps one layer of each kind: sliding-window attention with 16-wide heads and full
    attention with 32-wide ones (global_head_dim). The global config refuses to say head_dim; MFU's
    attention term takes 4 heads x the layers' mean of 24."""
    family = instantiate(compose_config(hf_toy("gemma4_text"))["model"])
    assert family.hf_config.layer_types == ["sliding_attention", "full_attention"]
    assert family.dims() == (2, 4 * (16 + 32) / 2)
    losses = train_nano(hf_toy("gemma4_text"), steps=3)[0]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("model_type", ["gemma3n_text", "deepseek_v3"])
def test_a_toy_copy_of_a_family_with_per_layer_lists_or_latent_attention_trains(model_type):
    """Gemma 3n's activation sparsity per layer cut to the toy's two layers (and no layers sharing
    keys and values); DeepSeek V3's latent attention with a key/value head per query head, as its
    configs have: both failed to build at toy size before."""
    losses = train_nano(hf_toy(model_type), steps=2)[0]
    assert all(map(math.isfinite, losses))
