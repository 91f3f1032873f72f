"""loss=chunked and loss=fused for any transformers family whose logits are its head's output alone:
checked on a toy copy of the config (ablate/models/hf_toy.py) where the family is not on the list
checked by tests/test_families.py, and refused, saying why, where its forward changes them."""
from __future__ import annotations

import pytest
import torch

from ablate.models.hf_toy import head_is_not_plain
from ablate.techniques import Invalid
from tests.helpers import hf_toy as toy, train_nano

pytest.importorskip("transformers")


# Not on hf.PLAIN_HEAD, with plain heads: Arcee (a Llama with a ReLU² MLP) and ERNIE 4.5.
@pytest.mark.parametrize("model_type", ["arcee", "ernie4_5"])
def test_an_unlisted_family_with_a_plain_head_takes_the_chunked_and_fused_losses(model_type):
    from ablate.models.hf import PLAIN_HEAD

    assert model_type not in PLAIN_HEAD
    plain = train_nano(toy(model_type))[0]
    for loss in ("chunked", "fused"):
        assert train_nano([*toy(model_type), f"loss={loss}", "loss.chunks=3"])[0] == pytest.approx(plain, rel=1e-5), loss


@pytest.mark.parametrize("model_type, attn, why", [
    ("cohere", "sdpa", r"its forward changes the head's output \(a toy copy's logits have 0.0625 times its spread\)"),  # logit_scale
    # Dory's head multiplies by a learned per-token scale that starts at 1: its module's forward is
    # not its weight's matmul, which is what the chunked loss takes
    ("dory", "sdpa", r"its forward changes the head's output \(a toy copy's logits have 1\.\d+ times its spread\)"),
    ("llama4_text", "sdpa", r"its base model \(Llama4ForCausalLM\) gives no last_hidden_state for the head"),
    ("gemma2", "eager", r"its forward changes the head's output \(a toy copy's logits have 0.2\d* times its spread\)"),  # tanh(x/30)·30
])
@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_a_family_that_changes_its_logits_after_the_head_is_refused_saying_why(model_type, attn, why, loss):
    with pytest.raises(Invalid, match=rf"loss=chunked, fused, liger and cce need logits that are the head's output "
                                      rf"alone; model_type='{model_type}': {why}: use loss=standard"):
        train_nano([*toy(model_type), f"loss={loss}", f"attention={attn}"], steps=1)


def test_the_check_sees_a_scale_set_in_the_users_config_and_leaves_the_random_state():
    """A family's logit_scale of 1 is a plain head, any other value is not; the check draws its toy's
    weights from a random state of its own."""
    from transformers import AutoConfig

    state = torch.random.get_rng_state()
    assert head_is_not_plain(AutoConfig.for_model("cohere", logit_scale=1.0)) is None
    assert "0.5 times" in head_is_not_plain(AutoConfig.for_model("cohere", logit_scale=0.5))
    assert torch.equal(torch.random.get_rng_state(), state)
