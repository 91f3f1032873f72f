"""Hugging Face models' initialisation drawn on torch's threads (ablate.model.DeferredNormals): the
same distributions as transformers' own serial init, values that do not depend on the thread count,
and every other initialiser's effect kept where it touches a drawn tensor."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from ablate.model import DeferredNormals, on_meta
from tests.helpers import compose_config
from tests.test_families import PUBLISHED, tiny


def _fresh(name: str, *more: str):
    """A tiny model of the family as every point builds it: on meta, then given storage (no values)."""
    family = instantiate(compose_config(tiny(name, "model.config.hidden_size=256", "model.config.intermediate_size=512",
                                             "model.config.vocab_size=512", *more))["model"])
    with on_meta():
        model = family.build()
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _initialised(name: str, threads: int, seed: int = 0, deferred: bool = True) -> dict[str, torch.Tensor]:
    model, before = _fresh(name), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        if deferred:
            model.reset_parameters()  # ablate's: transformers' init_weights under DeferredNormals
        else:
            model.lm.init_weights()  # transformers' own, one draw after another
    finally:
        torch.set_num_threads(before)
    return _values(model)


@pytest.mark.parametrize("name", [n for n in PUBLISHED if n != "mistral-7b"])  # mistral: llama's init
def test_deferred_init_draws_what_transformers_draws_and_the_same_on_any_thread_count(name):
    ours, again, theirs = _initialised(name, 2), _initialised(name, 1), _initialised(name, 1, deferred=False)
    assert ours.keys() == theirs.keys()
    other_seed = _initialised(name, 2, seed=1)
    assert any(not torch.equal(other_seed[k], ours[k]) for k in ours)  # the seed decides
    for key, want in theirs.items():
        assert torch.equal(ours[key], again[key]), key  # the threads decide nothing
        assert torch.isfinite(ours[key]).all(), key
        if want.numel() < 1000 or want.float().std() == 0:  # constants (norms, biases, rotary tables): exactly
            torch.testing.assert_close(ours[key], want, msg=key)
        else:  # drawn: the same N(0, std), other values
            assert not torch.equal(ours[key], want), key
            # two sample stds of n draws differ by ~1/sqrt(n) (Mixtral's router: 1,024 draws, 3%): 4 of those
            rel = max(0.05, 4 / want.numel() ** 0.5)
            assert ours[key].float().std().item() == pytest.approx(want.float().std().item(), rel=rel), key
            assert ours[key].float().mean().item() == pytest.approx(0, abs=0.01), key


def test_a_call_touching_a_pending_draw_sees_it_made_first():
    """Order kept where it shows: a row zeroed after its embedding's draw stays zero, a copy of a
    drawn tensor copies the drawn values, and a tensor drawn twice (a tied head) ends drawn once,
    finite (two draws into one buffer at once would race)."""
    emb, head, src, dst = torch.empty(64, 32), torch.empty(10, 10), torch.empty(40, 40), torch.empty(40, 40)
    torch.manual_seed(0)
    with torch.no_grad(), DeferredNormals() as mode:
        nn.init.normal_(emb, 0.0, 0.02)
        nn.init.normal_(head, std=1.0)
        nn.init.normal_(head, std=3.0)  # overwrites the first draw: only this one is made
        nn.init.ones_(torch.empty(3))  # touches nothing pending: the draws still wait
        assert [s for _, s in mode.pending] == [0.02, 3.0]
        nn.init.zeros_(emb[3])  # the embedding's row: the pending draws are made, then the row zeroed
        assert mode.pending == []
        nn.init.normal_(src, std=0.5)
        dst.copy_(src)  # reads src: drawn first
        assert mode.pending == []
    assert emb[3].abs().sum() == 0 and emb[4].std().item() == pytest.approx(0.02, rel=0.3)
    assert torch.equal(dst, src) and src.std().item() == pytest.approx(0.5, rel=0.05)
    assert torch.isfinite(head).all() and head.std().item() == pytest.approx(3.0, rel=0.2)


def test_a_padding_token_row_stays_zero_after_the_deferred_draws():
    """transformers zeroes the padding token's embedding row right after drawing the embedding:
    the deferred draw is made first, so the row ends zero as under the serial init. (Untied: a
    tied head's own draw comes later and overwrites the row, under transformers' init as here.)"""
    model = _fresh("llama3.2-1b", "+model.config.pad_token_id=5", "model.config.tie_word_embeddings=false")
    torch.manual_seed(0)
    model.reset_parameters()
    emb = model.lm.get_input_embeddings().weight
    assert model.lm.get_input_embeddings().padding_idx == 5
    assert emb[5].abs().sum() == 0 and emb[4].abs().sum() > 0 and torch.isfinite(emb).all()
