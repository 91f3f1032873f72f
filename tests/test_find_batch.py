"""The find_batch search on its own: fake probe runs and predictions stand in for workers, so the
rules (the margin, reserved over allocated, what a point that fits nowhere becomes, a stop signal)
are checked without starting a process. tests/test_capacity.py runs the search for real."""
from __future__ import annotations

import signal

import pytest

from ablate import find_batch, outcome, results
from ablate.predict import Prediction
from ablate.spec import RunSpec
from launch.worker_exit import Outcome
from tests.helpers import compose_spec

CAPACITY = 1000.0  # MiB; fits under the margin: peak <= 950


def config(batch_size: int = 32) -> RunSpec:
    return compose_spec([f"batch_size={batch_size}", "find_batch=true", "steps=50"])


def micro_of(cfg: RunSpec) -> int:
    return cfg.batch_size // cfg.groups["accumulation"]["steps"]


class FakeRuns:
    """run(config, where) for find_batch.measured: a peak of `mib_per_sample` per sample of the
    micro-batch, `status` for every probe; remembers what ran where."""

    def __init__(self, mib_per_sample: float, status: str = "ok", reason: str | None = None,
                 peak_key: str = "peak_reserved_mib"):
        self.mib_per_sample, self.status, self.reason, self.peak_key = mib_per_sample, status, reason, peak_key
        self.calls: list[tuple[int, int, str]] = []  # (micro-batch, steps, directory name)

    def __call__(self, cfg: RunSpec, where) -> Outcome:
        micro = micro_of(cfg)
        assert cfg.find_batch is False  # a probe never searches again
        self.calls.append((micro, cfg.steps, where.name))
        where.mkdir(parents=True, exist_ok=True)  # what a launch leaves there
        (where / "spec.json").write_text(str(micro))
        metrics = {self.peak_key: micro * self.mib_per_sample} if self.status == "ok" else {}
        return Outcome(self.status, self.reason, metrics)


def test_the_search_probes_a_few_micro_batches_then_runs_the_largest_that_fits(tmp_path):
    """Each micro-batch below the whole batch is tried by a one-step probe in a folder of its own;
    the whole batch by the point's own run, set aside to where its probe would be when it does
    not fit."""
    runs = FakeRuns(mib_per_sample=100.0)  # 8 x 100 = 800 fits, 16 x 100 = 1600 does not
    out = find_batch.measured(config(32), CAPACITY, tmp_path, runs)
    assert out.status == "ok" and out.metrics["max_batch_size"] == 8
    *tried, final = runs.calls
    assert (32, 50, tmp_path.name) in tried  # the binary search reaches the whole batch
    probes = [call for call in tried if call[0] != 32]
    assert all(steps == 1 and where == f"micro_{micro}" for micro, steps, where in probes)
    assert len(tried) <= 3  # a binary search of the 6 divisors of 32, not a scan
    assert final == (8, 50, tmp_path.name)  # the point itself: its own steps, in its own directory
    assert {p["micro_batch"]: p["fits"] for p in out.metrics["find_batch"]} == {m: m <= 8 for m, _, _ in tried}
    assert (tmp_path / "find_batch" / "micro_32" / "spec.json").read_text() == "32"  # set aside
    assert (tmp_path / "spec.json").read_text() == "8"


def test_the_search_starts_at_the_guess_and_checks_the_next_larger(tmp_path):
    """The job's guess is the largest micro-batch predicted to fit: a right one settles the search
    in two probes, where the plain search of 512's ten divisors takes four."""
    runs = FakeRuns(mib_per_sample=100.0)  # 8 fits, 16 does not
    out = find_batch.measured(config(512), CAPACITY, tmp_path, runs, guess=8)
    assert [micro for micro, _, _ in runs.calls] == [8, 16, 8]  # two probes, then the point
    assert out.metrics["max_batch_size"] == 8 and out.metrics["predicted_max_batch_size"] == 8
    wrong = FakeRuns(mib_per_sample=100.0)
    out = find_batch.measured(config(512), CAPACITY, tmp_path, wrong, guess=64)  # predicted 8x too big
    assert out.metrics["max_batch_size"] == 8 and out.metrics["predicted_max_batch_size"] == 64
    assert [micro for micro, _, _ in wrong.calls][:2] == [64, 32]


def test_without_a_capacity_the_whole_batch_is_tried_first_by_the_point_itself(tmp_path):
    """On a CPU without gpu_memory_gib no peak can be too big: the point's own run of the whole
    batch settles a point that runs, once; only a failing one sends the search lower."""
    runs = FakeRuns(mib_per_sample=100.0)
    out = find_batch.measured(config(32), None, tmp_path, runs)
    assert runs.calls == [(32, 50, tmp_path.name)] and out.metrics["max_batch_size"] == 32
    assert out.metrics["predicted_max_batch_size"] is None
    assert out.metrics["find_batch"] == [{"micro_batch": 32, "status": "ok", "reason": None, "peak_mib": 3200.0,
                                          "fits": True}]
    assert not (tmp_path / "find_batch").exists()

    def killed_above_8(cfg, where):  # e.g. the host's OOM killer
        return Outcome("error", "worker killed by SIGKILL") if micro_of(cfg) > 8 else Outcome("ok", None, {})

    out = find_batch.measured(config(32), None, tmp_path, killed_above_8)
    assert out.status == "ok" and out.metrics["max_batch_size"] == 8
    assert [p["micro_batch"] for p in out.metrics["find_batch"]][:2] == [32, 16]


def test_a_peak_inside_the_margin_does_not_fit(tmp_path):
    # micro-batch 1 peaks at 960 MiB: under the capacity, but not 5% under it
    out = find_batch.measured(config(4), CAPACITY, tmp_path, FakeRuns(mib_per_sample=960.0))
    assert out.status == "oom" and out.metrics["max_batch_size"] is None
    assert out.reason == "no micro-batch of batch_size=4 fits: micro-batch 1: over the capacity margin"


def test_allocated_counts_where_a_device_reports_no_reserved_peak(tmp_path):
    runs = FakeRuns(mib_per_sample=300.0, peak_key="peak_allocated_mib")  # 2 x 300 fits, 4 x 300 does not
    assert find_batch.measured(config(8), CAPACITY, tmp_path, runs).metrics["max_batch_size"] == 2


@pytest.mark.parametrize("status", ["oom", "error", "invalid", "timeout"])
def test_a_point_that_fits_nowhere_keeps_its_smallest_probes_status_and_reason(tmp_path, status):
    runs = FakeRuns(mib_per_sample=1.0, status=status, reason="what the worker said")
    out = find_batch.measured(config(8), CAPACITY, tmp_path, runs)
    assert out.status == status
    assert out.reason == "no micro-batch of batch_size=8 fits: micro-batch 1: what the worker said"
    assert [micro for micro, _, _ in runs.calls][-1] == 1  # and the point is not run after the search


def test_the_smallest_micro_batchs_failure_is_the_points(tmp_path):
    """The search starts in the middle: micro-batch 4 runs out of memory before micro-batch 1
    crashes, and the crash is what stops the point."""
    def run(cfg, where):
        return Outcome("error", "RuntimeError: crash") if micro_of(cfg) == 1 else Outcome("oom", "CUDA out of memory")

    out = find_batch.measured(config(8), CAPACITY, tmp_path, run)
    assert [p["micro_batch"] for p in out.metrics["find_batch"]][0] > 1
    assert out.status == "error" and out.reason.endswith("micro-batch 1: RuntimeError: crash")


def test_a_stop_signal_ends_the_search_at_that_probe(tmp_path):
    def stopped(cfg, where):
        return Outcome("timeout", "SIGUSR2", {}, stopped_by=signal.SIGUSR2)

    out = find_batch.measured(config(32), CAPACITY, tmp_path, stopped)
    assert out.status == "timeout" and out.stopped_by == signal.SIGUSR2
    assert len(out.metrics["find_batch"]) == 1  # no probe after it


def prediction(peak_mib: float) -> Prediction:
    return Prediction(peak_mib=peak_mib, breakdown_mib={}, category_max_mib={}, method="analytic")


def test_planned_judges_each_micro_batch_by_its_prediction():
    predict = lambda cfg: prediction(100.0 * micro_of(cfg))  # noqa: E731
    out, best = find_batch.planned(config(32), CAPACITY, predict)
    assert out.status == "predicted" and out.metrics == {"max_batch_size": 8} and best.peak_mib == 800.0


def test_planned_without_a_capacity_or_a_fit_says_why():
    predict = lambda cfg: prediction(5000.0)  # noqa: E731
    out, best = find_batch.planned(config(8), None, predict)
    assert out.status == "predicted" and "set gpu_memory_gib" in out.reason and best.peak_mib == 5000.0
    out, best = find_batch.planned(config(8), CAPACITY, predict)
    # an oom that never ran, as a plan's point that does not fit (was: `predicted`, and exit 0)
    assert out.status == "oom" and results.predicted_oom({"status": out.status, "reason": out.reason})
    assert out.reason == ("predicted: no micro-batch of batch_size=8 is predicted to fit 1,000 MiB usable; "
                          "not run (predict_only)")
    assert best.peak_mib == 5000.0  # the smallest micro-batch's prediction


def test_the_search_skips_micro_batches_the_point_cannot_run_at(tmp_path):
    """optimizer.in_backward steps inside backward and cannot accumulate: the whole batch is its
    only micro-batch, so the search tries that, by running the point, and nothing the point would
    call invalid."""
    spec = compose_spec(["batch_size=8", "find_batch=true", "steps=50", "optimizer.in_backward=true"])
    assert find_batch.candidates(spec, lambda probe: outcome.validate(probe) is None) == [8]
    assert find_batch.candidates(config(8), lambda probe: outcome.validate(probe) is None) == [1, 2, 4, 8]
    runs = FakeRuns(mib_per_sample=100.0)
    micros = find_batch.candidates(spec, lambda probe: micro_of(probe) == 8)
    out = find_batch.measured(spec, CAPACITY, tmp_path, runs, micros)
    assert out.status == "ok" and out.metrics["max_batch_size"] == 8
    assert runs.calls == [(8, 50, tmp_path.name)]  # the point's own run, and nothing else
    planned, best = find_batch.planned(spec, CAPACITY, lambda probe: prediction(100.0 * micro_of(probe)),
                                       micros)
    assert planned.metrics == {"max_batch_size": 8} and best.peak_mib == 800.0


@pytest.mark.slow
def test_an_in_backward_point_is_searched_not_invalid(tmp_path):
    """The same through the job, for real: the fit_llama_1b preset's in-backward rungs were
    `invalid`, because the search probed micro-batch 4 of 16, then 2, then 1."""
    from tests.helpers import results_under, run_cli

    proc = run_cli(["find_batch=true", "optimizer.in_backward=true", "batch_size=8"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path)
    assert row["status"] == "ok", row["reason"]
    assert row["metrics"]["max_batch_size"] == 8
    assert [p["micro_batch"] for p in row["metrics"]["find_batch"]] == [8]
