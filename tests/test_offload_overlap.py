"""offload=activations_overlap: the losses of offload=none, alone and under each recompute option;
its hooks' bookkeeping on a CPU (what is offloaded, the size threshold, the next layer fetched
ahead, the holding a fake CUDA step shows the predictor's trace); bad key values and whatever
offload=activations refuses are invalid rows naming the key. -m gpu: the same losses and a lower
peak on CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ablate.outcome import validate
from ablate.predict.analytic import analytic
from ablate.techniques import Invalid, Plan
from ablate.techniques.offload import Activations
from ablate.techniques.offload_streams import OverlappedActivations, SideStreamOffload
from helpers import CONF, compose_spec, slow_except, train_nano

# gpt-nano's saved tensors are a few KiB to a few hundred: a threshold that offloads most of them.
OVERLAP = ["offload=activations_overlap", "offload.min_bytes=1024"]
RECOMPUTE = [f"checkpoint={p.stem}" for p in sorted((CONF / "checkpoint").glob("*.yaml")) if p.stem != "none"]


def test_overlapped_offload_gives_the_losses_of_no_offload():
    base = train_nano(steps=3)[0]
    losses, _, _, t = train_nano(OVERLAP, steps=3)
    assert losses == base  # on a CPU nothing is copied: the same tensors, bit for bit
    stats = t.offload.stats
    assert 0 < stats.offloaded < stats.packed and stats.offloaded_bytes > 0
    assert 0 < stats.fetched_ahead < stats.offloaded  # the last layer's are still on the device
    assert not t.offload._offload._saved  # the end of backward forgot every saved tensor


@pytest.mark.parametrize("other", slow_except([*RECOMPUTE, "accumulation=x2"], "checkpoint=block", "checkpoint=ops"))
def test_overlapped_offload_composes_with_recompute_and_accumulation(other):
    """A recompute wrapper's own hooks take the tensors saved inside it; ours the rest."""
    base = train_nano([other], steps=2)[0]
    losses, _, _, t = train_nano([other, *OVERLAP], steps=2)
    assert losses == base
    assert t.offload.stats.offloaded > 0


def _layers(offload: SideStreamOffload, sizes: list[list[int]]) -> list[list[tuple[int, torch.Tensor]]]:
    """Pack float32 tensors of `sizes` elements, one list per layer, as a forward would."""
    packed = []
    with offload.hooks():
        for layer in sizes:
            offload.layer_boundary()
            tensors = [torch.randn(n) for n in layer]
            packed.append([(offload.pack(t), t) for t in tensors])
            offload.layer_boundary()
    return packed


def test_small_tensors_and_parameters_stay_on_the_device_and_unpack_as_packed():
    offload = SideStreamOffload(min_bytes=1024, prefetch=1)
    weight = nn.Parameter(torch.randn(64, 64))
    big, small = torch.randn(512), torch.randn(255)  # 2048 and 1020 bytes
    kept = [small, weight, weight.t(), torch.randn(1).expand(1024)]  # a broadcast view: its copy would grow
    with offload.hooks():
        handles = [offload.pack(t) for t in [big, *kept]]
    assert (offload.stats.packed, offload.stats.offloaded, offload.stats.offloaded_bytes) == (5, 1, 2048)
    assert not any(offload.offloadable(t) for t in kept) and offload.offloadable(big)
    for h, t in zip(handles, [big, *kept]):
        assert offload.unpack(h) is t  # the host is the device: no copy, the same tensor
    with pytest.raises(RuntimeError, match="unpacked twice"):
        offload.unpack(handles[0])


def test_a_layers_first_unpack_fetches_the_next_layer_ahead():
    offload = SideStreamOffload(min_bytes=0, prefetch=1)
    layers = _layers(offload, [[256, 256], [256, 256, 256], [256]])
    assert [len(g) for g in offload._groups] == [2, 3, 1]  # one group per layer
    (h, t), = layers[2]
    assert torch.equal(offload.unpack(h), t)
    assert offload._fetched == {2, 1} and offload.stats.fetched_ahead == 3  # layer 1, while layer 2 runs
    h, t = layers[1][2]
    assert torch.equal(offload.unpack(h), t)
    assert offload._fetched == {2, 1, 0} and offload.stats.fetched_ahead == 5
    for h, t in [*layers[1][:2], *layers[0]]:
        assert torch.equal(offload.unpack(h), t)
    assert offload.stats.fetched_ahead == 5  # nothing fetched twice


def test_without_prefetch_a_layer_comes_back_when_its_backward_asks():
    offload = SideStreamOffload(min_bytes=0, prefetch=0)
    layers = _layers(offload, [[256], [256], [256]])
    for layer in reversed(layers):
        for h, t in layer:
            assert torch.equal(offload.unpack(h), t)
    assert offload.stats.fetched_ahead == 0 and offload._fetched == {0, 1, 2}  # each when asked


def test_a_fake_cuda_step_holds_what_cuda_may_hold():
    """The predictor's trace runs the hooks on fake tensors, copied at once: each layer's originals
    stay on the device until the next layer starts (CUDA's bound while copies are in flight), and
    a layer's backward finds the next layer's tensors already back."""
    offload = SideStreamOffload(min_bytes=0, prefetch=1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with offload.hooks():
            handles = []
            for layer in range(3):
                offload.layer_boundary()
                handles.append([offload.pack(torch.empty(256, device="cuda:0")) for _ in range(2)])
                held = [s.group for s in offload._stash]
                assert held == [layer, layer]  # the previous layer's originals were dropped
        assert all(s.host.device.type == "cpu" for g in offload._groups for s in g)
        assert offload.unpack(handles[2][0]).device.type == "cuda"  # its original, never fetched
        assert all(s.device is not None and s.device.device.type == "cuda" for s in offload._groups[1])
        assert offload.stats.fetched_ahead == 2


@pytest.mark.parametrize("override, reason", [
    ("offload.prefetch=-1", "offload.prefetch=-1 must be >= 0 (layers fetched ahead in backward)"),
    ("offload.min_bytes=-1", "offload.min_bytes=-1 must be >= 0"),
    ("offload.prefetch=two", "offload.prefetch='two' must be int"),
])
def test_a_bad_key_value_is_an_invalid_row_naming_the_key(override, reason):
    outcome = validate(compose_spec(["model=gpt-nano", "device=cpu", "offload=activations_overlap", override]))
    assert outcome is not None and (outcome.status, outcome.reason) == ("invalid", reason)


def test_what_activation_offload_refuses_is_refused_naming_this_option(monkeypatch):
    def refuse(self, plan):
        raise Invalid("offload=activations with some option: a reason")

    monkeypatch.setattr(Activations, "check", refuse)
    with pytest.raises(Invalid, match=r"^offload=activations_overlap with some option: a reason$"):
        OverlappedActivations().check(Plan(device="cuda", batch_size=8, seq_len=16))


def test_the_predictor_holds_a_layer_in_forward_and_fetches_the_next_ahead():
    """Beyond the synchronous offload's peak, at most a layer held on its way out and `prefetch`
    layers fetched early: between that and no offload at all."""
    option = OverlappedActivations()
    assert option.label == "Overlapped activation offload" and option.activations_on_host
    plan = ["model=gpt2", "device=cuda", "batch_size=8", "seq_len=1024"]
    sync, none = (analytic(compose_spec([*plan, f"offload={o}"])).peak_mib for o in ("activations", "none"))
    one, two = (analytic(compose_spec([*plan, "offload=activations_overlap", f"offload.prefetch={n}"])).peak_mib
                for n in (1, 2))
    assert sync < one <= two < none
    cpu = [*plan[:1], "device=cpu", *plan[2:]]  # the host is the device: nothing moves
    assert analytic(compose_spec([*cpu, "offload=activations_overlap"])).peak_mib == analytic(
        compose_spec([*cpu, "offload=none"])).peak_mib


@pytest.mark.gpu
def test_on_cuda_the_copies_keep_the_losses_and_lower_the_peak():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker was selected on a machine without CUDA")
    model = ["model=gpt-mini", "model.vocab_size=512", "data.vocab_size=512"]

    def run(overrides):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        losses, _, _, t = train_nano([*model, *overrides], steps=3, batch_size=16, seq_len=256, device="cuda")
        torch.cuda.synchronize()
        return losses, torch.cuda.max_memory_allocated(), t

    base, none_peak, _ = run([])
    losses, peak, t = run(["offload=activations_overlap"])
    assert losses == pytest.approx(base, abs=1e-5)
    assert peak < 0.8 * none_peak
    assert t.offload.stats.offloaded > 0 and t.offload.stats.fetched_ahead > 0
