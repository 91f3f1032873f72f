"""offload options: activation offload keeps the math; device-only options are invalid rows on CPU."""
from __future__ import annotations

import sys

import pytest
import torch

from ablate.build import check_config
from ablate.techniques import Invalid, Plan
from ablate.techniques.offload import Activations, OptimizerState, Params
from helpers import compose_spec, train_nano


def test_activation_offload_gives_identical_losses():
    base = train_nano(steps=5)[0]
    offloaded = train_nano(["offload=activations"], steps=5)[0]
    assert offloaded == pytest.approx(base, abs=1e-6)


def test_activation_offload_installs_pack_hooks_for_the_forward_only():
    # On CUDA save_on_cpu's pack hook copies each saved tensor to pinned host memory (see the gpu
    # tests); on a CPU the copy is a no-op, so here we check that the hooks are active in forward.
    top = torch._C._autograd._top_saved_tensors_default_hooks
    with Activations().context("cpu"):
        assert top(False) is not None
    assert top(False) is None


@pytest.mark.parametrize("overrides,reason", [
    (["offload=optimizer"], "offload=optimizer needs a CUDA device"),
    (["offload=params"], "offload=params needs parallel=fsdp"),
])
def test_device_only_offload_is_invalid_on_cpu(overrides, reason):
    with pytest.raises(Invalid, match=reason):
        check_config(compose_spec(overrides), "cpu")


def test_offload_rules_by_plan():
    cuda = Plan(device="cuda", batch_size=8, seq_len=16)
    sharded = Plan(device="cuda", batch_size=8, seq_len=16, sharded=True)
    OptimizerState().check(cuda)  # torchao is installed with the dev extras
    with pytest.raises(Invalid, match="use offload=params"):
        OptimizerState().check(sharded)
    with pytest.raises(Invalid, match="in_backward"):
        OptimizerState().check(Plan(device="cuda", batch_size=8, seq_len=16, in_backward=True))
    Params().check(sharded)
    with pytest.raises(Invalid, match="needs parallel=fsdp"):
        Params().check(cuda)


def test_optimizer_offload_without_a_working_torchao_says_why(monkeypatch):
    cuda = Plan(device="cuda", batch_size=8, seq_len=16)
    for name in ("torchao", "torchao.optim"):  # as if not installed, or built for another torch
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(Invalid, match=r"^offload=optimizer needs torchao \(.*torchao.*\): pip install 'ablate\[ao\]'$"):
        OptimizerState().check(cuda)
