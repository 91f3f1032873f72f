"""What a point trains and what it costs: `params` and `trainable_params` in every row (the worker's
count of its built model, a plan's of the meta layout, the same figures), the report's Trainable
column where rows differ in them, the contract's refusal of a negative count; and the FLOPs count
that gives a frozen weight 4 FLOPs a token instead of 6 (tflops, mfu, hfu and the step-time
model), checked by hand and against FlopCounterMode on a real CPU step."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ablate import build, results, runner, spec as spec_module
from ablate.build import TECHNIQUE_GROUPS, Techniques, build_model, build_optimizer, check_config
from ablate.events import EventWriter
from ablate.hardware import flops_per_token
from ablate.models import logical_numel, param_change
from ablate.schema import GROUPS
from ablate.spec import RunSpec
from ablate.techniques import Option
from ablate.train import train_step
from analysis import compare, tables
from analysis.load import load
from helpers import compose_config, fast_defaults, results_under, run_cli
from test_predict_params import FreezeEmbedding, Nothing

# FAST's gpt-nano: 3 layers of width 48, a 128-token vocabulary tied to the head, 1,024 positions.
L, D, V, POSITIONS = 3, 48, 128, 1024
LAYER = 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + (4 * D * D + 4 * D) + (4 * D * D + D)
NANO_PARAMS = V * D + POSITIONS * D + L * LAYER + 2 * D  # token and position embeddings, layers, final norm
MLP = 4 * D * D + 4 * D + 4 * D * D + D  # a layer's MLP: c_fc and c_proj, weights and biases


class FreezeMLP(Option):
    """Every decoder layer's MLP (its two linear layers, weights and biases) trains not."""

    memory_in_params = True

    def change_params(self, model, adapter):
        for layer in adapter.layer_list(model):
            layer.get_submodule(adapter.mlp).requires_grad_(False)
        return model


@pytest.fixture
def tune(monkeypatch):
    """A technique group of the test's own ("tune"), which the build, the checks and the spec carry
    like any other: `point(option, *overrides)` is FAST's point with `option` in it."""
    monkeypatch.setattr(build, "TECHNIQUE_GROUPS", (*TECHNIQUE_GROUPS, "tune"))
    monkeypatch.setattr(spec_module, "GROUPS", (*GROUPS, "tune"))  # RunSpec.of keeps its node

    def point(option: type[Option], *overrides: str):
        config = compose_config([*fast_defaults(overrides), *overrides])
        config["tune"] = {"_target_": f"{__name__}.{option.__name__}"}
        return RunSpec.of(config)
    return point


def worker_metrics(spec, tmp_path) -> dict:
    """The metrics the worker reports for `spec`: ablate.runner.run, in this process."""
    job = {"config": spec.to_config(), "run_dir": str(tmp_path)}
    return runner.run(job, EventWriter(tmp_path))["metrics"]


def test_the_worker_counts_every_parameter_once_and_those_that_train(tune, tmp_path):
    m = worker_metrics(tune(FreezeEmbedding), tmp_path)
    # the tied embedding is one tensor: frozen, it takes the head with it
    assert (m["params"], m["trainable_params"]) == (NANO_PARAMS, NANO_PARAMS - V * D)


def test_a_plan_and_a_pruned_point_carry_the_counts_the_worker_makes(tune, tmp_path):
    from ablate.console import Progress
    from ablate.outcome import outcome_of

    for option, trainable in ((FreezeEmbedding, NANO_PARAMS - V * D), (FreezeMLP, NANO_PARAMS - L * MLP)):
        plan, _ = outcome_of(tune(option, "predict_only=true"), tmp_path, [], Progress("plan"))
        assert plan.status == "predicted"
        assert (plan.metrics["params"], plan.metrics["trainable_params"]) == (NANO_PARAMS, trainable)
        run = worker_metrics(tune(option), tmp_path)
        assert (run["params"], run["trainable_params"]) == (NANO_PARAMS, trainable)
    # a card far too small for gpt2-xl: pruned on its prediction, never run, its counts all the same
    spec = tune(FreezeEmbedding, "model=gpt2-xl", "predict_only=true", "device=cuda", "gpu_memory_gib=2")
    pruned, _ = outcome_of(spec, tmp_path, [], Progress("pruned"))
    assert results.predicted_oom({"status": pruned.status, "reason": pruned.reason})
    xl = 1_557_611_200  # gpt2-xl's parameters, as transformers counts them
    assert (pruned.metrics["params"], pruned.metrics["trainable_params"]) == (xl, xl - 50257 * 1600)


def test_rows_with_and_without_a_worker_say_the_same_through_the_cli(tmp_path):
    # The plan is the same point (predict_only is no part of its run_id, nor of its directory's name).
    proc = run_cli(["-m", "predict_only=false,true", "skip_existing=false", f"hydra.sweep.dir={tmp_path}/s",
                    "hydra.sweep.subdir=${hydra.job.num}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["status"]: r["metrics"] for r in results_under(tmp_path / "s")}
    assert set(rows) == {"ok", "predicted"}
    for m in rows.values():
        assert m["params"] == m["trainable_params"] == NANO_PARAMS
    assert results.problem(results_under(tmp_path / "s")[0]) is None


@pytest.mark.slow  # two torchrun sweeps of two ranks: 18 s of the default suite's budget
def test_sharded_ranks_add_up_to_the_whole_model(tmp_path):
    """Under FSDP each rank holds a shard (FSDP2's DTensors, FSDP1's views into its flat shard):
    the row counts the whole model, not rank 0's part, nor the ranks' parts twice."""
    proc = run_cli(["-m", "parallel=fsdp,fsdp1", "parallel.nproc=2", "batch_size=2",
                    f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = results_under(tmp_path / "s")
    assert len(rows) == 2
    for row in rows:
        assert row["metrics"]["params"] == row["metrics"]["trainable_params"] == NANO_PARAMS, row["choices"]


def test_a_4bit_weight_counts_the_weights_it_packs():
    class Packed(torch.nn.Parameter):  # bitsandbytes' Params4bit, as the count sees it
        pass

    p = Packed(torch.zeros(32, 1, dtype=torch.uint8), requires_grad=False)
    assert logical_numel(p) == 32
    p.quant_state = type("QuantState", (), {"shape": torch.Size([8, 8])})()
    assert logical_numel(p) == 64
    p.quant_state = None  # not yet quantised: its own elements
    assert logical_numel(p) == 32
    bnb = pytest.importorskip("bitsandbytes")
    linear = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    assert linear.weight.numel() == 1024 and logical_numel(linear.weight) == 64 * 32  # quantised on the move
    assert runner.held_params(linear) == (64 * 32, 0)


def test_a_negative_parameter_count_is_no_result():
    row = results.make("0" * 12, "ok", None, {}, {"batch_size": 4}, [], metrics={"params": 10, "trainable_params": 0})
    assert results.problem(row) is None
    for key in ("params", "trainable_params"):
        bad = {**row, "metrics": {**row["metrics"], key: -1}}
        assert results.problem(bad) == f"metrics.{key} is -1, not a count >= 0"
        assert "not a number" in results.problem({**row, "metrics": {**row["metrics"], key: "1.2 M"}})


def _write(root, name: str, trainable: int | None, optimizer: str, finished: str) -> None:
    metrics = {"peak_allocated_mib": 100.0, "train_latency_s": 1.0, "iter_time_ms": 10.0, "loss_final": 3.0,
               "losses": [4.0, 3.0], "params": 1_234_567 if trainable is not None else None,
               "trainable_params": trainable}
    choices = {"model": "gpt2", "data": "synthetic", "optimizer": optimizer, "precision": "fp32",
               "accumulation": "none", "checkpoint": "none", "offload": "none", "parallel": "single"}
    r = results.make(name, "ok", None, choices, {"batch_size": 8, "accumulation": {"steps": 1}}, [], metrics=metrics,
                     env={"gpu_name": "NVIDIA H100 80GB HBM3", "world_size": 1},
                     timing={"started_at": None, "finished_at": finished, "wall_s": 1.0})
    results.write_json(root / name / "result.json", r)


def _tables(root):
    df = load([root])
    labels = compare.varied(df)
    base = compare.baseline_index(df, labels, None)
    return tables.setting(df, labels, base), tables.full(df, labels, base)


def test_the_report_says_what_each_row_trains_only_where_the_rows_differ(tmp_path):
    _write(tmp_path / "differ", "a", 1_234_567, "adamw", "2026-01-01T00:00:01")
    _write(tmp_path / "differ", "b", 202_000, "sgd", "2026-01-01T00:00:02")
    setting, full = _tables(tmp_path / "differ")
    assert list(setting.columns[:2]) == ["Setting", "Trainable"]
    assert list(setting["Trainable"]) == ["1.23 M of 1.23 M (100%)", "202 K of 1.23 M (16.4%)"]
    assert list(full["Trainable"]) == ["1.23 M of 1.23 M (100%)", "202 K of 1.23 M (16.4%)"]
    _write(tmp_path / "same", "a", 1_234_567, "adamw", "2026-01-01T00:00:01")
    _write(tmp_path / "same", "b", 1_234_567, "sgd", "2026-01-01T00:00:02")
    _write(tmp_path / "same", "c", None, "adafactor", "2026-01-01T00:00:03")  # an older row: no counts
    setting, full = _tables(tmp_path / "same")
    assert "Trainable" not in setting and "Trainable" not in full
    assert tables.trainable({"trainable_params": 3_407_872, "params": 8_030_261_248}) == "3.41 M of 8.03 B (0.0424%)"


# FLOPs by hand: N of the PaLM count for gpt-nano, without its position embedding, the tied
# embedding once as the head.
N = NANO_PARAMS - POSITIONS * D


def test_the_workers_tflops_count_a_frozen_weight_at_four_flops_a_token(tune, tmp_path):
    m = worker_metrics(tune(FreezeEmbedding, "peak_tflops=1"), tmp_path)
    # 6 FLOPs a token for a trainable weight, 4 for the frozen head, PaLM's attention term
    per_token = 6 * (N - V * D) + 4 * V * D + 12 * L * D * 16
    tokens = 3 * 4 * 16  # FAST: 3 timed steps of 4 samples of 16 tokens
    assert m["tflops"] * 1e12 * m["train_latency_s"] / tokens == pytest.approx(per_token, rel=1e-9)
    assert m["hfu"] == m["mfu"]  # nothing recomputed


def test_hfu_counts_a_recomputed_forward_as_its_share_of_a_partly_frozen_step(tune, tmp_path):
    m = worker_metrics(tune(FreezeEmbedding, "peak_tflops=1", "checkpoint=block"), tmp_path)
    r = L * 12 * D * D / (L * 12 * D * D + V * D)  # block recompute: the layers' matmul weights of all
    model = 6 * (N - V * D) + 4 * V * D + 12 * L * D * 16
    forward = 2 * N + 4 * L * D * 16
    assert m["hfu"] / m["mfu"] == pytest.approx(1 + r * forward / model, rel=1e-9)
    assert m["hfu"] / m["mfu"] > 1 + r / 3  # a frozen head makes the forward more than a third


def test_a_frozen_weight_costs_four_flops_a_token_and_a_trainable_one_six(tune):
    t = Techniques.of(tune(FreezeEmbedding))
    assert t.model.flops_split() == (N, 0) and t.model.flops_params() == N  # nothing changed: PaLM's N
    trained, frozen = t.model.flops_split(param_change(t))
    assert (trained, frozen) == (N - V * D, V * D)  # the head, tied to the frozen embedding
    assert flops_per_token(trained, L, D, 16, frozen) == 6 * (N - V * D) + 4 * V * D + 12 * L * D * 16
    t = Techniques.of(tune(FreezeMLP))
    assert t.model.flops_split(param_change(t)) == (N - L * MLP, L * MLP)


def test_padded_head_rows_leave_the_side_the_head_is_on(tune):
    """GPT-2's flops_params leaves the padded rows of its head out (no token's work): frozen, the
    head's rows leave the frozen share, not the trainable one."""
    t = Techniques.of(tune(FreezeEmbedding, "model.pad_vocab_to=100"))  # 128 rows padded to 200
    assert t.model.flops_params() == N
    assert t.model.flops_split(param_change(t)) == (N - V * D, V * D)
    t = Techniques.of(tune(FreezeMLP, "model.pad_vocab_to=100"))
    assert t.model.flops_split(param_change(t)) == (N - L * MLP, L * MLP)


def test_the_step_time_model_counts_frozen_weights_at_four(tune):
    from ablate.predict.step_time import work_of

    plain, frozen = work_of(tune(Nothing)), work_of(tune(FreezeEmbedding))
    tokens = 4 * 16
    assert plain.flops - frozen.flops == pytest.approx(2 * V * D * tokens, rel=1e-12)
    # a 16-bit head of 130 rows breaks tensor-core alignment: its FLOPs, 4 a token frozen, run slower
    bf16 = ("device=cuda", "precision=bf16_pure", "model.vocab_size=130")
    plain, frozen = work_of(tune(Nothing, *bf16)), work_of(tune(FreezeEmbedding, *bf16))
    assert (plain.unaligned_flops, frozen.unaligned_flops) == (6 * 130 * D * tokens, 4 * 130 * D * tokens)


def counted_step(spec) -> tuple[int, int]:
    """(FLOPs FlopCounterMode counts in one real training step of `spec` on the CPU, the model
    count of them): attention by the math kernel, whose matmuls it counts (the CPU's fused
    kernel it does not)."""
    t = check_config(spec, "cpu")
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = build_model(t, cpu)
    optimizer = build_optimizer(model, t)
    batch = torch.randint(0, V, (2, spec.batch_size, spec.seq_len))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        train_step(model, optimizer, t.precision.grad_scaler("cpu"), t, (batch[0], batch[1]), cpu)
    trained, frozen = t.model.flops_split(param_change(t))
    per_token = flops_per_token(trained, *t.model.dims(), spec.seq_len, frozen)
    return counter.get_total_flops(), per_token * spec.batch_size * spec.seq_len


@pytest.mark.parametrize("option", [FreezeMLP, FreezeEmbedding])
def test_the_count_agrees_with_the_matmuls_a_partly_frozen_step_runs(tune, option):
    """FlopCounterMode counts the matmuls the step runs; the count's N also holds the biases and
    norms (2% of gpt-nano's), so the two agree within 3%. Counting the frozen weights at 6 FLOPs
    would miss by far more."""
    plain, plain_count = counted_step(tune(Nothing))
    ran, count = counted_step(tune(option))
    assert count == pytest.approx(ran, rel=0.03) and plain_count == pytest.approx(plain, rel=0.03)
    frozen = L * MLP if option is FreezeMLP else V * D
    assert ran < plain and not math.isclose(plain_count, ran, rel_tol=0.03)  # the old count
    # the weight gradients a frozen weight skips: 2 FLOPs a token for each of its elements
    assert plain - ran == pytest.approx(2 * frozen * 4 * 16, rel=0.03)
