"""offload options: activation offload keeps the math; device-only options are invalid rows on CPU."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ablate.build import check_config
from ablate.predict.analytic import analytic
from ablate.predict.trace import trace
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


def test_optimizer_offload_is_invalid_on_cpu():
    with pytest.raises(Invalid, match="offload=optimizer needs a CUDA device"):
        check_config(compose_spec(["offload=optimizer"]), "cpu")


@pytest.fixture
def no_process_group_after():
    """offload=params in one process makes a process group of one rank: gone after the test."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides", [[], ["precision=bf16", "accumulation=x4"], ["checkpoint=block"]])
def test_parameter_offload_in_one_process_keeps_the_losses(overrides, no_process_group_after):
    """FSDP2 over a group of this one process, its parameters, gradients and AdamW states in
    host memory: the same math as keeping them on the device."""
    plain = train_nano(overrides, steps=4)[0]
    _, model, optimizer, _ = offloaded = train_nano(["offload=params", *overrides], steps=4)
    # Under bf16, FSDP's mixed precision gathers the embeddings in bf16 too: a 16-bit residual stream.
    assert offloaded[0] == pytest.approx(plain, rel=1e-3 if "precision=bf16" in overrides else 1e-5)
    assert dist.get_world_size() == 1
    w = model.get_submodule("transformer.h.0.attn.c_attn").weight
    assert isinstance(w, DTensor) and w.device.type == "cpu"
    assert all(s.device.type == "cpu" for s in optimizer.state[w].values() if isinstance(s, torch.Tensor))


def test_parameter_offload_is_predicted_as_its_trace_on_cpu_and_leaves_one_layer_on_a_gpu():
    """On a CPU the host is the device: the analytic model counts the shards, gradients and
    states there, as the fake-tensor trace does. Planned for a GPU, what stays on the device is
    the gathered parameters of the root and of one layer at a time (fp32 here), nothing else."""
    spec = compose_spec(["model=gpt-nano", "device=cpu", "batch_size=8", "seq_len=32", "offload=params"])
    predicted, traced = analytic(spec), trace(spec)
    assert predicted.peak_mib == pytest.approx(traced.peak_mib, rel=1e-3)
    assert predicted.breakdown_mib == pytest.approx(traced.breakdown_mib, rel=1e-3, abs=1e-3)
    xl = analytic(compose_spec(["model=gpt2-xl", "device=cuda", "batch_size=1", "seq_len=1024", "offload=params"]))
    wte, wpe, layer = 50257 * 1600, 1024 * 1600, 12 * 1600**2 + 13 * 1600
    assert xl.category_max_mib["params"] * 2**20 == pytest.approx((wte + wpe + 2 * 1600 + layer) * 4, rel=1e-3)
    assert xl.category_max_mib["optimizer"] == 0 and xl.steady_mib["grads"] == 0


@pytest.mark.parametrize("overrides, match", [
    (["parallel=ddp", "parallel.nproc=2"], "parallel=ddp with offload=params"),
    (["optimizer.in_backward=true"], "offload=params with optimizer.in_backward=true"),
    (["optimizer=adafactor"], "optimizer=adafactor needs whole parameters"),
])
def test_parameter_offload_rules(overrides, match):
    with pytest.raises(Invalid, match=match):
        check_config(compose_spec(["offload=params", *overrides]), "cpu")


def test_offload_rules_by_plan():
    cuda = Plan(device="cuda", batch_size=8, seq_len=16)
    sharded = Plan(device="cuda", batch_size=8, seq_len=16, sharded=True)
    OptimizerState().check(cuda)  # torchao is installed with the dev extras
    with pytest.raises(Invalid, match="use offload=params"):
        OptimizerState().check(sharded)
    with pytest.raises(Invalid, match="in_backward"):
        OptimizerState().check(Plan(device="cuda", batch_size=8, seq_len=16, in_backward=True))
    Params().check(sharded)
    Params().check(cuda)  # one GPU: FSDP over a group of one rank


def test_optimizer_offload_without_a_working_torchao_says_why(monkeypatch):
    cuda = Plan(device="cuda", batch_size=8, seq_len=16)
    for name in ("torchao", "torchao.optim"):  # as if not installed, or built for another torch
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(Invalid, match=r"^offload=optimizer needs torchao \(.*torchao.*\): pip install torchao$"):
        OptimizerState().check(cuda)
