"""Hugging Face models' initialisation drawn on torch's threads (ablate.models.gpt_module.DeferredNormals): the
same distributions as transformers' own serial init, values that do not depend on the thread count,
and every other initialiser's effect kept where it touches a drawn tensor."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from ablate.models.gpt_module import DeferredNormals, on_meta
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


class _Constants(nn.Module):
    """A module that sets values in its own __init__ which no initialiser writes again (as
    Apertus's xIELU does), beside a weight its reset_parameters draws."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.alpha = nn.Parameter(torch.full((1,), 0.8))
        self.register_buffer("table", torch.arange(6), persistent=False)
        self.register_buffer("pair", torch.tensor([1.0, 2.0]).to(torch.bfloat16))

    def reset_parameters(self):
        nn.init.normal_(self.weight)
        with torch.no_grad():
            self.pair[0] = 5.0  # part of a tensor: the rest is still unwritten

    def tie_weights(self):
        pass


def test_what_no_initialiser_writes_comes_from_the_modules_own_init():
    from ablate.techniques.precision import _initialised

    with on_meta():
        model = _Constants()
    torch.manual_seed(0)
    _initialised(model, torch.device("cpu"), _Constants)
    assert model.alpha.item() == pytest.approx(0.8) and torch.equal(model.table, torch.arange(6))
    assert model.pair.tolist() == [1.0, 2.0]  # wholly the module's: a half-written tensor is not trusted
    assert torch.isfinite(model.weight).all() and model.weight.std() > 0.3  # drawn, as before


def test_a_family_whose_module_sets_its_own_constants_starts_as_transformers_builds_it():
    """Apertus's xIELU activation sets its alphas, beta and eps from constants in __init__, which
    transformers' _init_weights does not write: built on meta, they were whatever memory held, so
    the losses changed from one run to the next and recompute seemed to change them too."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import train_nano

    tiny_apertus = _tiny_apertus()
    plain, model, _, t = train_nano(tiny_apertus, steps=0)
    act = model.lm.model.layers[1].mlp.act_fn
    theirs = AutoModelForCausalLM.from_config(t.model.hf_config).model.layers[1].mlp.act_fn
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        assert torch.equal(getattr(act, name), getattr(theirs, name)), name
    assert train_nano(tiny_apertus)[0] == train_nano(tiny_apertus)[0]  # the same every run
    assert train_nano([*tiny_apertus, "checkpoint=block"])[0] == pytest.approx(train_nano(tiny_apertus)[0], rel=1e-5)


def _tiny_apertus() -> list[str]:
    from tests.test_families import _GQA

    keys = [*_GQA, "model.config.head_dim=16", "model.config.num_hidden_layers=2", "model.config.vocab_size=128"]
    return ["model=hf", "+model.config.model_type=apertus", *(f"+{k}" for k in keys), "data.vocab_size=128"]


def test_a_family_computing_constants_in_its_init_is_traced():
    """predict=trace builds the model on meta under a fake mode, where xIELU's log(expm1(0.8)) is a
    meta tensor the fake mode refused: Apertus had no prediction at all."""
    from ablate.predict.trace import trace
    from tests.helpers import compose_spec
    from tests.test_predict import measured

    base = ["device=cpu", "batch_size=8", "seq_len=32", "optimizer=adamw_foreach"]
    predicted = trace(compose_spec([*base, *_tiny_apertus()])).peak_mib
    assert predicted == pytest.approx(measured(_tiny_apertus(), base).peak_mib, rel=0.05)
