"""GaLore and APOLLO (optimizer=galore, galore8bit, apollo, apollo_mini): each trains on a CPU; their
updates have the structure the methods claim (GaLore's in its projector's span, APOLLO's the raw
gradient scaled per channel, APOLLO-Mini's per tensor); the glue keeps the packages' math (APOLLO's
seeds; 8-bit GaLore with fp32 states steps as GaLore, which the package's own arguments prevent); a
step in backward equals the step after it; the states are exactly the analytic predictor's bytes
and the step's peak within 2% of MemTracker's on a CPU step; and the combinations they refuse."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import math
import subprocess
import sys

import pytest
import torch

from ablate.build import build_model, build_optimizer, check_config
from ablate.data import Synthetic
from ablate.predict.analytic import analytic
from ablate.techniques import Invalid, Plan
from ablate.techniques.apollo import APOLLO, APOLLOMini
from ablate.techniques.galore import GaLore, GaLore8bit
from ablate.techniques.projected import projected_shape, side_of
from ablate.train import train_step
from helpers import ROOT, compose_spec, fast_defaults, results_under, run_cli, train_nano
from test_predict import measured

pytest.importorskip("galore_torch")
pytest.importorskip("apollo_torch")

CPU = torch.device("cpu")
MIB = 2**20
OPTIONS = ["galore", "galore8bit", "apollo", "apollo_mini"]
# MemTracker's own post-accumulate-grad hook reads p.grad after the in-backward hook has freed it.
FREED_GRAD_WARNING = "ignore:Expected a tensor or a traceable wrapper-subclass"
NANO = ["model=gpt-nano", "model.vocab_size=128", "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]
LLAMA = ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "model.config.hidden_size=64",
         "model.config.intermediate_size=128", "model.config.num_attention_heads=4",
         "model.config.num_key_value_heads=2", "model.config.head_dim=16", "model.config.vocab_size=128",
         "data.vocab_size=128", "device=cpu", "batch_size=8", "seq_len=32"]
MODELS = {"gpt": NANO, "llama": LLAMA}


def plan(**kw) -> Plan:
    return Plan(**{"device": "cpu", "batch_size": 8, "seq_len": 16, **kw})


def built(name: str, *overrides: str):
    """(model, optimizer, techniques, one fixed batch) for gpt-nano with 128 tokens under `name`."""
    args = [f"optimizer={name}", *overrides]
    spec = compose_spec([*fast_defaults(args), *args])
    t = check_config(spec, "cpu")
    torch.manual_seed(0)
    model = build_model(t, CPU)
    optimizer = build_optimizer(model, t)
    batch = Synthetic(vocab_size=128, train_samples=64).load(spec.seq_len).train_batch(0, spec.batch_size)
    return model, optimizer, t, batch


def layer_matrices(model, t) -> dict:
    return {n: p for n, p in model.named_parameters() if t.optimizer.in_layers(n, tuple(p.shape))}


def one_step(name: str, *overrides: str):
    """Two steps on one batch; returns {layer matrix name: (its gradient, its change)} of the
    second, whose projectors the first made (no weight decay: the options' default)."""
    model, optimizer, t, batch = built(name, *overrides)
    scaler = t.precision.grad_scaler("cpu")
    train_step(model, optimizer, scaler, t, batch, CPU)
    matrices = layer_matrices(model, t)
    before = {n: p.detach().clone() for n, p in matrices.items()}
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
             for n, p in matrices.items()]
    train_step(model, optimizer, scaler, t, batch, CPU)
    for h in hooks:
        h.remove()
    return {n: (grads[n], p.detach() - before[n]) for n, p in matrices.items()}, model, optimizer, t


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_trains_on_cpu_through_the_build_path(name):
    model, optimizer, t, batch = built(name)
    losses = [train_step(model, optimizer, t.precision.grad_scaler("cpu"), t, batch, CPU).item() for _ in range(6)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses  # the same batch six times: the loss must fall


def test_galore_updates_lie_in_the_projectors_span_and_its_states_are_the_predicted_shapes():
    """GaLore's update of a matrix is its Adam update in the projected space, projected back: with
    a `right` projector P (r, n) of orthonormal rows (an SVD's), dW = N P, so dW (I - P^T P) = 0; with
    a `left` one (m, r), (I - P P^T) dW = 0. At rank 4 of 48 that is a real constraint."""
    steps, model, optimizer, t = one_step("galore", "optimizer.rank=4")
    option = t.optimizer
    for name, p in layer_matrices(model, t).items():
        grad, change = steps[name]
        state, shape = optimizer.state[p], tuple(p.shape)
        side = side_of(shape, "std")
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == projected_shape(shape, 4, side)
        P = state["projector_matrix"]
        assert P is state["projector"].ortho_matrix
        assert P.untyped_storage().nbytes() == option.projector_bytes(shape, 4)  # the SVD's whole factor
        outside = change - change @ P.T @ P if side == "right" else change - P @ P.T @ change
        assert change.norm() > 0 and outside.norm() < 1e-5 * change.norm(), name
    wte = model.transformer.wte.weight  # not projected: Adam's full-size states
    assert optimizer.state[wte]["exp_avg"].shape == wte.shape and "projector" not in optimizer.state[wte]


@pytest.mark.parametrize("name", ["apollo", "apollo_mini"])
def test_apollo_scales_the_raw_gradient_per_channel_and_apollo_mini_per_tensor(name):
    """APOLLO's update is the raw gradient times a scaling factor from Adam in the projected space:
    one per channel of the longer side (rows of an (m, n) matrix with m >= n, else columns), so
    dW / G is constant along each channel and differs between channels; APOLLO-Mini's is one per
    tensor, so dW / G is one number."""
    steps, _, _, _ = one_step(name, "optimizer.rank=4" if name == "apollo" else "optimizer.rank=1")
    for matrix, (grad, change) in steps.items():
        rows = grad.shape[0] >= grad.shape[1]
        ratio, clear = change / grad, grad.abs() > 1e-3 * grad.abs().max()  # where float noise does not rule
        ratio, clear = (ratio, clear) if rows else (ratio.T, clear.T)  # channels as rows
        ratio, clear = ratio[clear.any(1)], clear[clear.any(1)]
        per_channel = torch.stack([r[c].median() for r, c in zip(ratio, clear)])
        spread = (ratio - per_channel[:, None]).abs()[clear].max()
        assert spread < 1e-4 * per_channel.abs().max(), matrix  # one factor per channel
        channels = per_channel.abs().max() / per_channel.abs().min()
        assert channels > 1.01 if name == "apollo" else channels == pytest.approx(1.0, rel=1e-4), matrix


def test_galore8bit_with_fp32_states_steps_as_galore():
    """With every state in fp32 (min_8bit_size above any tensor) bitsandbytes' Adam is GaLore's Adam
    but for where eps enters (bitsandbytes scales it by sqrt(1 - beta2^t)): at eps=1e-12 the projected
    matrices end equal. galore-torch 1.0 hands bitsandbytes its arguments by position, which
    bitsandbytes reads as max_unorm=100 and skip_zeros=True: the update is then clipped to 100x the
    norm of the parameter the step has just zeroed, and a matrix with fp32 states never moves
    (its weight decay aside). The option passes them by name."""
    from bitsandbytes.optim.optimizer import Optimizer2State
    from galore_torch import GaLoreAdamW8bit

    package_args = GaLoreAdamW8bit([torch.nn.Parameter(torch.zeros(2, 2))]).args
    shifted = "percentile_clipping" not in inspect.signature(Optimizer2State.__init__).parameters
    assert (package_args.max_unorm, package_args.skip_zeros) == ((100, True) if shifted else (0.0, False))
    ours = GaLore8bit().optimizer_class()([torch.nn.Parameter(torch.zeros(2, 2))], **GaLore8bit().optimizer_kwargs())
    assert (ours.args.max_unorm, ours.args.skip_zeros) == (0.0, False)
    runs = {name: train_nano([f"optimizer={name}", "optimizer.rank=4", "optimizer.eps=1e-12", *extra], steps=3)
            for name, extra in [("galore", []), ("galore8bit", ["optimizer.min_8bit_size=1000000000"])]}
    (_, galore, _, t), (_, eight, _, _) = runs["galore"], runs["galore8bit"]
    start = layer_matrices(train_nano(["optimizer=galore"], steps=0)[1], t)
    for (name, a), b in zip(layer_matrices(galore, t).items(), layer_matrices(eight, t).values()):
        assert (a - start[name]).abs().max() > 3e-3  # they trained: about lr x scale a step
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)  # Adam's first steps round near-zero gradients apart


def test_apollo_glue_keeps_the_packages_own_seeds():
    """Ours puts each matrix in a group of its own with APOLLO's number for it as its seed: the same
    random projections as the package built over one group of all matrices."""
    from apollo_torch import APOLLOAdamW

    _, ours, _, t = train_nano(["optimizer=apollo", "optimizer.rank=4"], steps=3)
    torch.manual_seed(0)
    model = build_model(t, CPU)
    matrices, rest = t.optimizer.layer_matrices(model)
    groups = [{"params": matrices, **t.optimizer.projection()}, {"params": [p for p in rest if p.dim() >= 2]},
              {"params": [p for p in rest if p.dim() < 2]}]
    package = APOLLOAdamW(groups, lr=t.optimizer.lr, eps=t.optimizer.eps)
    data = Synthetic(vocab_size=128, train_samples=64).load(16)
    for k in range(3):
        _, loss = model(*data.train_batch(k, 8))
        loss.backward()
        package.step()
        package.zero_grad(set_to_none=True)
    for a, b in zip(ours.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.filterwarnings(FREED_GRAD_WARNING)
@pytest.mark.parametrize("name", OPTIONS)
def test_in_backward_matches_the_step_after_backward(name):
    """One optimizer per parameter, stepped from its gradient hook: the same parameters as the
    step after backward (APOLLO's seeds included), each matrix keeping its projector."""
    base, m0, _, _ = train_nano([f"optimizer={name}", "optimizer.rank=4"], steps=3)
    losses, m1, opt1, t = train_nano([f"optimizer={name}", "optimizer.rank=4", "optimizer.in_backward=true"], steps=3)
    assert losses == pytest.approx(base, abs=1e-6)
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    for p in layer_matrices(m1, t).values():
        assert opt1.state[p]["projector_matrix"] is opt1.state[p]["projector"].ortho_matrix


def _cases(default: set) -> list:
    every = [(o, m, prec, ib) for o in OPTIONS for m in MODELS for prec in ("fp32", "bf16_pure")
             for ib in (False, True)]
    return [c if c in default else pytest.param(*c, marks=pytest.mark.slow) for c in every]


# One case per option in the default suite, the four together covering both models, both
# precisions and both places of the step; the rest with -m slow.
DEFAULT = {("galore", "gpt", "fp32", False), ("galore8bit", "llama", "bf16_pure", True),
           ("apollo", "llama", "fp32", True), ("apollo_mini", "gpt", "bf16_pure", False)}


@pytest.mark.filterwarnings(FREED_GRAD_WARNING)
@pytest.mark.parametrize("name, model, precision, in_backward", _cases(DEFAULT))
def test_states_are_the_predicted_bytes_and_the_peak_within_2pct(name, model, precision, in_backward):
    """MemTracker on the second real step (the projectors made by the first). galore8bit's step
    copies each projected parameter and makes the copy its data (the package swaps p.data): made in
    the step, MemTracker labels those bytes optimizer state from then on, so they move between the
    two categories, not in total."""
    overrides = [f"optimizer={name}", f"precision={precision}", f"optimizer.in_backward={in_backward}"]
    real = measured(overrides, MODELS[model])
    pred = analytic(compose_spec([*MODELS[model], *overrides]))
    moved = 0.0
    if name == "galore8bit":
        spec = compose_spec([*MODELS[model], *overrides])
        t = check_config(spec, "cpu")
        d = 4 if precision == "fp32" else 2
        moved = sum(math.prod(s) * d for n, s in t.model.layout.shapes.items() if t.optimizer.in_layers(n, s)) / MIB
    assert pred.steady_mib["optimizer"] * MIB == (real.after["optimizer"] - moved) * MIB
    assert pred.steady_mib["params"] * MIB == (real.after["params"] + moved) * MIB
    assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.02)


@pytest.mark.filterwarnings(FREED_GRAD_WARNING)
@pytest.mark.parametrize("name", [n if n == "galore" else pytest.param(n, marks=pytest.mark.slow) for n in OPTIONS])
def test_remade_projectors_are_the_step_temporaries(name):
    """update_proj_gap=1 remakes every projector in the traced step (an SVD, or APOLLO's random
    draw, per matrix) at rank 8 of 48-64; one sample and 4 tokens, so that the step, not the
    activations, holds the peak. The step's own temporaries (MemTracker's optimizer maximum less
    the states) are the predictor's to the byte; APOLLO's limiter quotient is 1.0, a float, where
    the norm did not grow, and counted as a 0-d tensor (4 bytes more)."""
    for base in MODELS.values():
        overrides = [f"optimizer={name}", "optimizer.rank=8", "optimizer.update_proj_gap=1"]
        base = [*base, "batch_size=1", "seq_len=4"]
        real = measured(overrides, base)
        pred = analytic(compose_spec([*base, *overrides]))
        assert pred.peak_mib == pytest.approx(real.peak_mib, rel=0.02)
        if name != "galore8bit":  # whose copies change category (above)
            temp = (pred.category_max_mib["optimizer"] - real.category_max["optimizer"]) * MIB
            assert 0 <= temp <= (4 if name.startswith("apollo") else 0)


@pytest.mark.parametrize("option, kw, message", [
    (GaLore(), {"sharded": True}, r"optimizer=galore projects whole matrices, which FSDP shards .* use parallel=ddp"),
    (APOLLOMini(), {"sharded": True}, r"optimizer=apollo_mini projects whole matrices"),
    (GaLore8bit(), {"states_on_host": True},
     r"optimizer=galore8bit with offload=optimizer: .* low-rank projection.*; use optimizer=galore"),
    (APOLLO(), {"stochastic_rounding": True}, r"stochastic_rounding=true needs optimizer=adamw .*=apollo"),
    (GaLore(rank=0), {}, r"optimizer.rank=0 must be >= 1"),
    (GaLore8bit(update_proj_gap=0), {}, r"optimizer.update_proj_gap=0 must be >= 1"),
    (GaLore(proj_type="full"), {}, r"optimizer.proj_type='full' is not one of std, reverse_std, left, right"),
    (APOLLO(proj_type="reverse_std"), {}, r"optimizer.proj_type='reverse_std' is not one of std$"),
    (APOLLO(proj="orthogonal"), {}, r"optimizer.proj='orthogonal' is not one of random, svd"),
    (APOLLOMini(scale_type="row"), {}, r"optimizer.scale_type='row' is not one of channel, tensor"),
])
def test_refusals_name_the_key_and_what_to_use(option, kw, message):
    with pytest.raises(Invalid, match=message):
        option.check(plan(**kw))


def test_offload_of_the_states_is_allowed_where_the_class_takes_plain_groups():
    """torchao's CPUOffloadOptimizer builds one optimizer per large parameter from the option's class,
    kwargs and that parameter's group keys (rank, seed): GaLore and APOLLO run so (it needs CUDA;
    offload=optimizer itself refuses a CPU)."""
    for option in (GaLore(), APOLLO(), APOLLOMini()):
        option.check(plan(device="cuda", states_on_host=True))


@pytest.mark.parametrize("option, package", [(GaLore(), "galore-torch==1.0"), (GaLore8bit(), "galore-torch==1.0"),
                                             (APOLLO(), "apollo-torch==1.0.3"), (APOLLOMini(), "apollo-torch==1.0.3")])
def test_a_missing_other_or_broken_package_is_an_invalid_row_naming_the_release(option, package, monkeypatch):
    find_spec, version = importlib.util.find_spec, importlib.metadata.version
    other = package.split("==")[0]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9" if name == other else version(name))
    with pytest.raises(Invalid, match=rf"optimizer={option.name} needs {package} .*not 9\.9: pip install {package}"):
        option.check(plan())
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == option.module else find_spec(name, *a))
    with pytest.raises(Invalid) as err:
        option.check(plan())
    assert str(err.value) == f"optimizer={option.name} needs {package}: pip install {package}"
    monkeypatch.setitem(sys.modules, option.module, None)  # an import that fails (a torch it was not built for)
    with pytest.raises(Invalid, match=rf"optimizer={option.name} needs {package}, which fails to import here"):
        option.optimizer_class()


def test_the_job_checks_without_importing_the_packages():
    """check_config in a fresh process (as the job runs it): the packages and transformers stay unimported."""
    code = ("import sys; sys.path.insert(0, 'tests'); from helpers import compose_spec, fast_defaults;"
            "from ablate.build import check_config\n"
            f"for o in {OPTIONS!r}: check_config(compose_spec([*fast_defaults([]), 'optimizer=' + o]))\n"
            "print(sorted(m for m in ('galore_torch', 'apollo_torch', 'transformers', 'bitsandbytes')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_cli_rows_match_the_prediction(tmp_path):
    """The real CLI and worker on gpt-micro: an ok row per option whose traced optimizer bytes are the prediction's."""
    proc = run_cli(["-m", f"optimizer={','.join(OPTIONS)}", "model=gpt-micro", "batch_size=4", "seq_len=64", "steps=3",
                    "device=cpu"],
                   tmp_path, timeout=900, fast=False)
    rows = results_under(tmp_path)
    assert proc.returncode == 0 and len(rows) == 4, proc.stderr[-3000:]
    for row in rows:
        assert row["status"] == "ok", row["reason"]
        measured_, predicted = row["metrics"]["breakdown_mib"], row["prediction"]["breakdown_mib"]
        assert measured_["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.01), row["choices"]
        assert row["metrics"]["peak_allocated_mib"] == pytest.approx(row["prediction"]["peak_mib"], rel=0.02)
