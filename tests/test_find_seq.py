"""find_seq=true, the longest seq_len that fits: the search's lengths and rules on fake probe runs
and predictions, a real search through the CLI on a CPU with an emulated card, the plan, the refusals,
the run_id, and the report's "Longest context" column."""
from __future__ import annotations

import signal

import pytest

from ablate import find_seq, outcome, results
from ablate.capacity import CUDA_CONTEXT_MIB
from ablate.console import Progress
from ablate.find_batch import MARGIN
from ablate.predict import Prediction
from ablate.predict.analytic import analytic
from ablate.schema import identity
from ablate.spec import RunSpec
from launch.worker_exit import Outcome
from tests.helpers import FAST, compose_config, compose_spec, results_under, run_cli

CAPACITY = 1000.0  # MiB; a length fits while its peak stays under 950
# gpt-nano at batch 1 with positions to spare, so that memory, not block_size, ends the search
TINY = [*(f for f in FAST if f.split("=")[0] not in ("batch_size", "steps")),
        "batch_size=1", "steps=1", "eval_steps=0", "model.block_size=16384"]


def spec(*overrides: str) -> RunSpec:
    return compose_spec([*FAST, "find_seq=true", "steps=50", *overrides])


def ladder(found: int, limit: int) -> list[int]:
    """Every length the search can try around `found`: the powers, then the lengths between the
    power at or below it and its double."""
    power = 1 << (found.bit_length() - 1)
    return sorted(set(find_seq.powers(limit)) | set(find_seq.between(power, limit)))


def test_the_lengths_are_powers_of_two_then_steps_of_1024_or_an_eighth():
    assert find_seq.powers(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert find_seq.between(16384, 10**6) == list(range(17408, 32768, 1024))  # multiples of 1,024
    assert find_seq.between(4096, 10**6) == list(range(4608, 8192, 512))  # an eighth: seven lengths
    assert find_seq.between(64, 10**6) == [72, 80, 88, 96, 104, 112, 120]
    assert find_seq.between(1, 10**6) == [] and find_seq.between(4, 10**6) == [5, 6, 7]
    assert find_seq.between(1024, 1500) == [1152, 1280, 1408, 1500]  # never past the model, its maximum included
    assert find_seq.between(1024, 1024) == []


@pytest.mark.parametrize("longest", [1, 3, 700, 1024, 5000, 6143, 40000, 65535])
def test_the_search_finds_the_longest_length_that_fits_and_a_right_guess_costs_four_probes(longest):
    limit = 65536
    expected = max(n for n in ladder(longest, limit) if n <= longest)
    for guess in (None, expected, 8, limit):
        tried = []
        found = find_seq.search(lambda n: tried.append(n) or n <= longest, limit, guess)
        assert found == expected and all(n <= limit for n in tried)
        assert len(set(tried)) == len(tried)  # no length probed twice
        above = min((n for n in ladder(found, limit) if n > found), default=None)
        assert above is None or above in tried  # the next length up was tried, and did not fit
        if guess == expected:
            assert len(tried) <= 4


def test_nothing_fits_and_the_model_bound():
    assert find_seq.search(lambda n: False, 4096) is None
    assert find_seq.search(lambda n: True, 1500) == 1500  # the model's maximum, off the grid
    assert find_seq.bounded(1500, 1500).startswith("find_seq: stopped at the model's 1,500 positions")
    assert find_seq.bounded(1024, 1500) is None


class FakeRuns:
    """run(spec, where): a peak of `mib_per_token` per token of seq_len; remembers what ran where."""

    def __init__(self, mib_per_token: float, status: str = "ok", reason: str | None = None):
        self.mib_per_token, self.status, self.reason = mib_per_token, status, reason
        self.calls: list[tuple[int, int, str]] = []  # (seq_len, steps, directory name)

    def __call__(self, probe: RunSpec, where) -> Outcome:
        assert not find_seq.searching(probe) and probe.batch_size == 4  # the batch stays; no search again
        self.calls.append((probe.seq_len, probe.steps, where.name))
        peak = {"peak_reserved_mib": probe.seq_len * self.mib_per_token} if self.status == "ok" else {}
        return Outcome(self.status, self.reason, peak)


def test_the_probes_confirm_the_guess_then_the_point_runs_at_the_longest(tmp_path):
    runs = FakeRuns(mib_per_token=0.1)  # 9,500 tokens fill the margin: 9,216 fits, 9,728 does not
    out = find_seq.measured(spec(), CAPACITY, tmp_path, runs, limit=65536, guess=9216)
    assert out.status == "ok" and out.reason is None and out.metrics["max_seq_len"] == 9216
    *probes, final = runs.calls
    assert [n for n, _, _ in probes] == [8192, 16384, 9216, 10240]
    assert all(steps == 1 and where == f"seq_{n}" for n, steps, where in probes)
    assert final == (9216, 50, tmp_path.name)  # the point itself: its own steps, in its own directory
    assert out.metrics["predicted_max_seq_len"] == 9216
    assert [(p["seq_len"], p["fits"]) for p in out.metrics["find_seq"]] == [
        (8192, True), (16384, False), (9216, True), (10240, False)]


def test_a_search_the_model_ends_says_so_in_the_reason(tmp_path):
    out = find_seq.measured(spec(), CAPACITY, tmp_path, FakeRuns(mib_per_token=0.01), limit=1024, guess=1024)
    assert out.status == "ok" and out.metrics["max_seq_len"] == 1024
    assert [p["seq_len"] for p in out.metrics["find_seq"]] == [1024]  # nothing past the model's positions
    assert "the model's 1,024 positions" in out.reason and "not by memory" in out.reason


@pytest.mark.parametrize("status", ["oom", "invalid"])
def test_a_point_that_fits_nowhere_keeps_the_shortest_probes_status(tmp_path, status):
    out = find_seq.measured(spec(), CAPACITY, tmp_path, FakeRuns(1.0, status, "what the worker said"), limit=64)
    assert out.status == status and out.metrics["max_seq_len"] is None
    assert out.reason == "no seq_len at batch_size=4 fits: seq_len 1: what the worker said"


def test_a_stop_signal_ends_the_search_at_that_probe(tmp_path):
    stopped = lambda probe, where: Outcome("timeout", "SIGUSR2", {}, stopped_by=signal.SIGUSR2)  # noqa: E731
    out = find_seq.measured(spec(), CAPACITY, tmp_path, stopped, limit=4096, guess=512)
    assert out.status == "timeout" and len(out.metrics["find_seq"]) == 1


def prediction(peak_mib: float) -> Prediction:
    return Prediction(peak_mib=peak_mib, breakdown_mib={}, category_max_mib={}, method="analytic")


def test_planned_judges_each_length_by_its_prediction():
    predict = lambda probe: prediction(0.1 * probe.seq_len)  # noqa: E731
    out, best = find_seq.planned(spec(), CAPACITY, predict, limit=65536)
    assert out.status == "predicted" and out.metrics == {"max_seq_len": 9216, "predicted_max_seq_len": 9216}
    assert best.peak_mib == pytest.approx(921.6)
    out, _ = find_seq.planned(spec(), CAPACITY, lambda probe: prediction(5000.0), limit=65536)
    assert out.status == "oom" and results.predicted_oom({"status": out.status, "reason": out.reason})


def decided(tmp_path, *overrides: str) -> tuple[Outcome, Prediction | None]:
    return outcome.outcome_of(spec(*overrides), tmp_path, [], Progress("point"))


def test_a_plan_gives_the_predicted_longest_sequence(tmp_path):
    card = ["model.block_size=65536", "gpu_memory_gib=1"]
    out, best = decided(tmp_path, "predict_only=true", *card)
    found = out.metrics["predicted_max_seq_len"]
    assert out.status == "predicted" and out.metrics["max_seq_len"] == found and found > 1024
    usable = 1024 - CUDA_CONTEXT_MIB
    assert best.peak_mib <= usable * (1 - MARGIN) < analytic(find_seq.at_seq_len(spec(*card), found + 1024)).peak_mib
    assert not list(tmp_path.rglob("spec.json"))  # nothing ran


def test_find_seq_with_find_batch_or_without_a_capacity_is_invalid(tmp_path):
    out, _ = decided(tmp_path, "find_batch=true", "gpu_memory_gib=1")
    assert out.status == "invalid" and "find_seq=true and find_batch=true" in out.reason
    out, _ = decided(tmp_path)  # a CPU, no gpu_memory_gib
    assert out.status == "invalid" and "set gpu_memory_gib" in out.reason
    assert not list(tmp_path.rglob("spec.json"))


def test_find_seq_joins_the_run_id_only_when_set():
    config = compose_config(FAST)
    unset = {k: v for k, v in config.items() if k != "find_seq"}  # a result from before the key
    assert results.run_id(identity(config)) == results.run_id(identity(unset))
    assert results.run_id(identity({**config, "find_seq": True})) != results.run_id(identity(config))


@pytest.mark.parametrize("positions, fits, above", [
    # two probes (4,096, then the model's 4,608) and the point: about 15 s on two idle cores
    pytest.param(4608, 4096, 4608, marks=pytest.mark.slow),
    pytest.param(16384, 6144, 6656, marks=pytest.mark.slow),  # four probes: 4,096, 8,192, 6,144, 6,656
])
def test_a_cpu_search_under_an_emulated_card_finds_the_longest_length_that_fits(tmp_path, positions, fits, above):
    tiny = [*TINY, f"model.block_size={positions}"]
    at = {n: analytic(find_seq.at_seq_len(compose_spec(tiny), n)).peak_mib for n in (fits, above)}
    usable = (at[fits] + at[above]) / 2 / (1 - MARGIN)  # `fits` is predicted to fit, `above` not
    proc = run_cli([*tiny, "find_seq=true", f"gpu_memory_gib={(usable + CUDA_CONTEXT_MIB) / 1024}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path)  # the probes' directories hold no result.json of their own
    m = row["metrics"]
    found, probes = m["max_seq_len"], {p["seq_len"]: p for p in m["find_seq"]}
    assert row["status"] == "ok" and found and row["config"]["seq_len"] == 16  # the row keeps what was asked
    assert probes[found]["status"] == "ok" and probes[found]["peak_mib"] <= usable * (1 - MARGIN)
    step_up = min(n for n in ladder(found, positions) if n > found)
    assert step_up in probes and not probes[step_up]["fits"]  # the next length up was probed and did not fit
    assert all(n <= positions for n in probes) and row["reason"] is None  # memory ended it, not the positions
    assert m["predicted_max_seq_len"] == fits and f"longest seq_len {found} (predicted {fits})" in proc.stdout
    assert m["peak_allocated_mib"] == pytest.approx(probes[found]["peak_mib"], rel=0.02)  # measured at that length
    assert row["prediction"]["peak_mib"] == pytest.approx(at[fits] if found == fits else m["peak_allocated_mib"],
                                                          rel=0.05)


@pytest.mark.slow
def test_a_search_the_model_bounds_ends_at_its_positions(tmp_path):
    proc = run_cli([*TINY, "find_seq=true", "model.block_size=2048", "gpu_memory_gib=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path)
    assert row["status"] == "ok" and row["metrics"]["max_seq_len"] == 2048
    assert max(p["seq_len"] for p in row["metrics"]["find_seq"]) == 2048  # nothing past the positions
    assert "the model's 2,048 positions" in row["reason"]


def _write(root, name, card, longest, peak, **choices):
    config = {"batch_size": 1, "seq_len": 16, "gpu_memory_gib": card, "accumulation": {"steps": 1}}
    metrics = {"max_seq_len": longest, "predicted_max_seq_len": longest}
    base = {"model": "gpt2", "data": "synthetic", "optimizer": "adamw", "precision": "fp32", "accumulation": "none",
            "checkpoint": "none", "offload": "none", "parallel": "single", "loss": "standard"}
    r = results.make(name, "predicted", None, {**base, **choices}, config, [], metrics=metrics,
                     prediction={"peak_mib": peak, "breakdown_mib": None, "method": "analytic", "step_time_s": 1.0},
                     env={"world_size": 1, "emulated_gpu_mib": card * 1024})
    assert results.problem(r) is None
    results.write_json(root / name / "result.json", r)


def test_the_report_shows_the_longest_context(tmp_path, capsys):
    from analysis.report import main

    _write(tmp_path, "a", 24, 32768, 20000)
    _write(tmp_path, "b", 24, 65536, 21000, checkpoint="block")
    _write(tmp_path, "c", 8, 8192, 7000)
    assert main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    tables = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    heads = [t for t in tables if "Longest context" in t]
    assert len(heads) == 2  # the recommended table's (per card) and the full table's
    cells = {tuple(t) for t in tables}
    for head in heads:
        at = head.index("Longest context")
        column = {row[at] for row in cells if len(row) == len(head) and row != tuple(head)}
        assert {"32,768", "8,192"} <= column or {"65,536", "8,192"} <= column, column


def test_a_probe_list_of_the_wrong_type_is_no_result():
    r = results.make("0" * 12, "ok", None, {}, {"batch_size": 1}, [], metrics={"find_seq": {"seq_len": 8}})
    assert results.problem(r) == "metrics.find_seq is {'seq_len': 8}, not a list or null"
    r = results.make("0" * 12, "ok", None, {}, {"batch_size": 1}, [], metrics={"max_seq_len": True})
    assert "metrics.max_seq_len is True" in results.problem(r)
