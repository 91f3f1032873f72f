"""ablate/measure.py: step-time percentiles, and the traced step's memory by category (params,
grads, optimizer states, activations), frozen parameters included."""
from __future__ import annotations

import gc

import pytest
import torch

from ablate.measure import percentiles, traced_step


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 12)])
    assert (p["iter_time_ms"], p["iter_time_ms_p10"], p["iter_time_ms_p90"]) == (6.0, 2.0, 10.0)
    assert percentiles([])["iter_time_ms"] is None


def test_breakdown_categories_on_cpu():
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(torch.randn(64, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # states exist from here on
    trace = traced_step(step, model, opt, torch.device("cpu"))
    mib = 256 * 256 * 4 / 2**20
    assert trace.at_peak["params"] == pytest.approx(mib) and trace.at_peak["optimizer"] >= 2 * mib
    assert trace.peak_mib == pytest.approx(sum(trace.at_peak.values()))
    # Once the step is over only the states are left: exp_avg, exp_avg_sq and a 4-byte fp32 step.
    assert trace.after["optimizer"] * 2**20 == 2 * 256 * 256 * 4 + 4
    assert trace.category_max["grads"] == pytest.approx(mib)
    assert trace.category_max["activations"] >= 64 * 256 * 4 / 2**20  # the input saved for backward


def test_a_frozen_parameter_is_traced_as_a_parameter_without_a_gradient():
    """A parameter that needs no gradient (a mixture's router bias, as in AFMoE and ERNIE 4.5 MoE)
    made MemTracker fail the step: torch refuses a gradient hook on it."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model[1].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step():
        model(torch.randn(64, 256)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    trace = traced_step(step, model, opt, torch.device("cpu"))
    assert trace.category_max["params"] * 2**20 == 2 * (256 * 256 + 256) * 4
    assert trace.category_max["grads"] * 2**20 == 2 * 256 * 256 * 4 + 256 * 4  # no gradient for the frozen bias
    assert model[1].bias.grad is None and model[1].weight.grad is None  # hooks gone, step done


class _WeightNorm(torch.nn.Module):
    """A detached norm computed through two submodules, as DoRA's is with lora_B(lora_A(eye)): a
    graph no backward reaches, freed when this module returns."""

    def __init__(self, graph: bool):
        super().__init__()
        self.a, self.b, self.graph = torch.nn.Linear(512, 8), torch.nn.Linear(8, 512), graph

    def forward(self):
        with torch.set_grad_enabled(self.graph):
            return self.b(self.a(torch.eye(512))).norm().detach()  # saves a 1 MiB identity for a's gradient


class _SideBranch(torch.nn.Module):
    def __init__(self, graph: bool):
        super().__init__()
        self.norm, self.out = _WeightNorm(graph), torch.nn.Linear(512, 512)

    def forward(self, x):
        return self.out(x) / self.norm()


class _Layers(torch.nn.Module):
    """Side branches as a model's repeated layers: the tracer freezes what is alive as each starts."""

    def __init__(self, graph: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(_SideBranch(graph) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("collector", ["enabled", "disabled"])
@pytest.mark.parametrize("build", [_SideBranch, _Layers])
def test_a_graph_no_backward_reaches_is_freed_when_its_module_returns(collector, build):
    """MemTracker's hook on a submodule's input holds that input's graph in a reference cycle, so a
    graph no backward reaches outlived its forward until Python's collector ran (DoRA's measured peak
    moved by 4% between runs). The traced peak must be the one an untraced step has, whenever the
    collector runs: the same as when the side branch builds no graph at all."""
    peaks = {}
    for graph in (True, False):
        torch.manual_seed(0)
        model = build(graph)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            model(torch.randn(4096, 512)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if collector == "disabled":
            gc.disable()
        try:
            peaks[graph] = traced_step(step, model, opt, torch.device("cpu")).peak_mib
        finally:
            gc.enable()
    assert peaks[True] == peaks[False]
