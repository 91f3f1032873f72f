"""Capacity planning through the CLI: predict_only, prune, emulated GPU size, largest batch that fits."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ablate import results
from ablate.capacity import CUDA_CONTEXT_MIB, MemoryLimit, largest_fitting, micro_batches
from ablate.find_batch import MARGIN
from ablate.spec import RunSpec
from ablate.predict.analytic import analytic
from tests.helpers import FAST, compose_spec, results_under, run_cli, run_report


def gib_for(usable_mib: float) -> float:
    """gpu_memory_gib of a card whose allocator can use `usable_mib`."""
    return (usable_mib + CUDA_CONTEXT_MIB) / 1024


def predicted_peak(*overrides: str) -> float:
    return analytic(compose_spec([*FAST, *overrides])).peak_mib


def test_largest_fitting_is_a_binary_search():
    tried = []

    def fits(m: int) -> bool:
        tried.append(m)
        return m <= 24

    assert largest_fitting(micro_batches(96), fits) == 24
    assert len(tried) <= 4  # 12 divisors of 96: ceil(log2(13)) probes
    assert largest_fitting([1, 2, 4], lambda m: False) is None
    assert micro_batches(12) == [1, 2, 3, 4, 6, 12]


@given(batch=st.integers(1, 720), limit=st.integers(0, 800), guess=st.integers(0, 800))
def test_a_guess_changes_how_many_probes_the_search_takes_never_its_answer(batch, limit, guess):
    """find_batch's guess is the largest micro-batch predicted to fit: right, the search takes two
    probes (one where the guess is an end of the list); wrong by any amount, the same answer
    as without it, with at most two probes more than the plain search's worst case."""
    candidates = micro_batches(batch)
    plain, guided = [], []
    expected = largest_fitting(candidates, lambda m: plain.append(m) or m <= limit)
    assert expected == max([m for m in candidates if m <= limit], default=None)
    assert largest_fitting(candidates, lambda m: guided.append(m) or m <= limit, guess) == expected
    worst = math.ceil(math.log2(len(candidates) + 1))  # the plain binary search's most probes
    assert len(plain) <= worst and len(guided) <= worst + 2
    assert len(set(guided)) == len(guided)  # no micro-batch probed twice
    if guess == expected:
        assert len(guided) <= 2 and guided[0] == guess


def test_the_cap_names_the_gpu_by_index(monkeypatch):
    """The worker's device is a plain torch.device("cuda"); torch's cap refuses that ("Expected a
    torch.device with a specified index"), so the limit passes the current
    GPU's index. torch's own index check stands in for the GPU here."""
    import torch
    from torch.cuda._utils import _get_device_index

    class Props:
        total_memory = 80 * 2**30

    capped = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _get_device_index(d) is not None and Props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, d: capped.append((fraction, _get_device_index(d))))
    for device in (torch.device("cuda"), torch.device("cuda", 0)):
        MemoryLimit(16, device).apply()
    usable = 16 * 1024 - CUDA_CONTEXT_MIB
    assert capped == [(pytest.approx(usable / (80 * 1024)), 0)] * 2


def test_predict_only_plans_a_gpu_grid_on_a_machine_without_one(tmp_path):
    """device=cuda and 8 ranks on a CPU machine: every point predicted, no worker started."""
    proc = run_cli(["-m", "device=cuda", "parallel=fsdp,ddp", "parallel.nproc=8", "predict_only=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = results_under(tmp_path)
    assert [r["status"] for r in rows] == ["predicted", "predicted"]
    peaks = {r["choices"]["parallel"]: r["prediction"]["peak_mib"] for r in rows}
    assert 0 < peaks["fsdp"] < peaks["ddp"]
    assert all(r["prediction"]["method"] == "analytic" and r["prediction"]["breakdown_mib"]["params"] > 0 for r in rows)
    assert not list(tmp_path.rglob("events.jsonl"))  # nothing ran
    # Without parallel.nproc there is no GPU to count: a row that says what to give, not a plan
    # for a guessed 2 GPUs (nor, without predict_only, 2 ranks started only to fail).
    for extra in (["predict_only=true"], []):
        proc = run_cli(["-m", "device=cuda", "parallel=ddp", *extra], tmp_path / "auto" / str(len(extra)),
                       env={"CUDA_VISIBLE_DEVICES": ""})
        assert proc.returncode == 0, proc.stderr
        [row] = results_under(tmp_path / "auto" / str(len(extra)))
        assert row["status"] == "invalid" and "give parallel.nproc=N" in row["reason"], row["reason"]
        assert row["config"]["parallel"]["nproc"] == "auto"
    assert not list(tmp_path.rglob("events.jsonl"))


@pytest.mark.slow  # two sweeps: 9 s
def test_prune_records_predicted_oom_and_a_later_run_measures_it(tmp_path):
    small, big = predicted_peak("batch_size=4"), predicted_peak("batch_size=32")
    gib = gib_for((small + big) / 2)
    proc = run_cli(["-m", "batch_size=4,32", "prune=true", f"gpu_memory_gib={gib}", "prune_margin=0"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]["batch_size"]: r for r in results_under(tmp_path)}
    assert rows[4]["status"] == "ok" and rows[4]["env"]["emulated_gpu_mib"] == pytest.approx(gib * 1024)
    assert rows[32]["status"] == "oom" and rows[32]["reason"].startswith("predicted:")
    assert rows[32]["metrics"]["peak_allocated_mib"] is None  # never ran
    # Without prune the same point is measured (a prediction is not a result to skip), and the
    # emulated card really is too small for it: on a CPU the traced peak is checked afterwards.
    proc = run_cli(["batch_size=32", f"gpu_memory_gib={gib}"], tmp_path)
    assert proc.returncode == 1, proc.stderr  # a single run that ends oom says so to the shell
    rerun = [r for r in results_under(tmp_path / "runs")]
    assert [r["status"] for r in rerun] == ["oom"] and "emulated" in rerun[0]["reason"]
    assert rerun[0]["run_id"] == rows[32]["run_id"]


@pytest.mark.slow
def test_find_batch_keeps_the_effective_batch_with_accumulation(tmp_path):
    p8, p16 = predicted_peak("batch_size=8"), predicted_peak("batch_size=16")
    usable = (p8 + p16) / 2 / (1 - MARGIN)  # micro-batch 8 fits with its margin, 16 does not
    # batch 32 in one micro-batch is predicted far over the card: prune must not stop the search
    assert predicted_peak("batch_size=32") > usable * 1.1
    proc = run_cli(["batch_size=32", "find_batch=true", "prune=true", f"gpu_memory_gib={gib_for(usable)}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = results_under(tmp_path)
    assert row["status"] == "ok", row["reason"]
    assert row["metrics"]["max_batch_size"] == 8
    # The search starts at the micro-batch predicted to fit, and the next larger one settles it.
    assert row["metrics"]["predicted_max_batch_size"] == 8
    assert "max micro-batch 8 (predicted 8)" in proc.stdout  # the console line says both
    assert [(p["micro_batch"], p["fits"]) for p in row["metrics"]["find_batch"]] == [(8, True), (16, False)]
    assert row["metrics"]["tokens_per_s"] > 0 and row["config"]["batch_size"] == 32
    assert RunSpec.of(row["config"]).with_micro_batch(8).groups["accumulation"]["steps"] == 4
    # the prediction is of what was measured, micro-batch 8 (batch 32 whole would read +100%)
    assert row["prediction"]["peak_mib"] == pytest.approx(row["metrics"]["peak_allocated_mib"], rel=0.02)
    report = run_report([str(tmp_path), "--table", "full"], timeout=120)
    lines = report.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "Max micro-batch" in line)  # the "All runs" table
    headings = [c.strip() for c in lines[at].split("|")]
    row_cells = [c.strip() for c in lines[at + 2].split("|")]
    assert row_cells[headings.index("Max micro-batch")] == row_cells[headings.index("Predicted max micro-batch")] == "8"


def test_find_batch_with_predict_only_plans_a_card_without_running(tmp_path):
    cuda = [*FAST, "device=cuda", "batch_size=32"]
    at = {m: analytic(compose_spec(cuda).with_micro_batch(m)).peak_mib for m in (8, 16)}
    usable = (at[8] + at[16]) / 2 / (1 - MARGIN)  # micro-batch 8 is predicted to fit, 16 not
    card = f"gpu_memory_gib={gib_for(usable)}"
    proc = run_cli(["-m", "device=cuda", "batch_size=32", "find_batch=true", "predict_only=true",
                    f"{card},null", f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]["gpu_memory_gib"] is not None: r for r in results_under(tmp_path / "s")}
    assert rows[True]["status"] == "predicted" and rows[True]["reason"] is None
    assert rows[True]["metrics"]["max_batch_size"] == 8
    assert rows[True]["prediction"]["peak_mib"] == pytest.approx(at[8])  # of the micro-batch found
    # no GPU here and no card named: nothing to search against, and the row says so
    assert "set gpu_memory_gib" in rows[False]["reason"] and rows[False]["metrics"]["max_batch_size"] is None
    assert not [p for p in tmp_path.rglob("*") if p.name in ("spec.json", "events.jsonl")]  # no worker launched


@pytest.mark.slow
def test_report_shows_predicted_measured_and_error(tmp_path):
    proc = run_cli(["-m", "checkpoint=none,block"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = run_report([str(tmp_path), "--table", "full"], timeout=120)
    assert report.returncode == 0, report.stderr
    assert "Predicted peak (MiB)" in report.stdout
    for row in results_under(tmp_path):
        measured, predicted = row["metrics"]["peak_allocated_mib"], row["prediction"]["peak_mib"]
        assert predicted == pytest.approx(measured, rel=0.10)


def test_bad_predict_method_names_the_choices(tmp_path):
    proc = run_cli(["predict=guess"], tmp_path)
    assert proc.returncode != 0
    assert "predict" in proc.stderr and "analytic" in proc.stderr and "trace" in proc.stderr


@pytest.mark.slow
def test_batch_scan_experiment_is_one_command(tmp_path):
    """The published-table scan (1, 2, 4, 7, 8, 9, ...), planned without running: memory grows with batch."""
    proc = run_cli(["-m", "experiment=batch_scan", "model=gpt-nano", "seq_len=32", "predict_only=true"], tmp_path,
                   fast=False)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(results_under(tmp_path), key=lambda r: r["config"]["batch_size"])
    assert [r["config"]["batch_size"] for r in rows] == [1, 2, 4, 7, 8, 9, 16, 32, 64]
    peaks = [r["prediction"]["peak_mib"] for r in rows]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    report = run_report([str(tmp_path), "--table", "batch"], timeout=120)
    assert "(predicted)" in report.stdout


def test_a_point_about_to_run_on_this_cpu_with_device_auto_is_predicted_for_the_cpu(tmp_path):
    """device=auto on a machine without a GPU runs on the CPU, where activation offload moves
    nothing: predicting it for a GPU (where it saves the activations) would be 30% low here."""
    out = run_cli(["offload=activations", "device=auto", "batch_size=8", "seq_len=32", "steps=2"], tmp_path,
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    (result,) = results_under(tmp_path)
    assert result["status"] == "ok", result["reason"]
    assert result["prediction"]["peak_mib"] == pytest.approx(result["metrics"]["peak_allocated_mib"], rel=0.05)


@pytest.mark.slow
def test_batch_scan_stops_at_the_first_oom_and_records_the_rest_as_not_run(tmp_path):
    """On an emulated card between the batch-4 and batch-7 peaks: 1, 2, 4 run, 7 runs out of
    memory, and 8 ... 64 are oom rows that never ran (nor will a rerun skip them as done)."""
    small = [*FAST[:5], "seq_len=32", "steps=1", "device=cpu"]  # the batch sizes are the scan's own
    peak = {b: analytic(compose_spec([*small, f"batch_size={b}"])).peak_mib for b in (4, 7)}
    gib = gib_for((peak[4] + peak[7]) / 2)
    proc = run_cli(["-m", "experiment=batch_scan", *small, f"gpu_memory_gib={gib}"], tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(results_under(tmp_path), key=lambda r: r["config"]["batch_size"])
    assert [(r["config"]["batch_size"], r["status"]) for r in rows] == [
        (1, "ok"), (2, "ok"), (4, "ok"), (7, "oom"), *[(b, "oom") for b in (8, 9, 16, 32, 64)]]
    assert "emulated" in rows[3]["reason"]
    assert all(r["reason"].startswith("not run: batch_size=7 ran out of memory") for r in rows[4:])
    assert len(list(tmp_path.rglob("events.jsonl"))) == 4  # only 1, 2, 4 and 7 started a worker
    assert not any(results.is_terminal(r) for r in rows[4:])


def test_a_plan_with_a_capacity_stops_its_batch_scan_where_the_run_would(tmp_path):
    """predict_only with gpu_memory_gib between the batch-4 and batch-7 predictions: 1, 2, 4 are
    predicted, 7 is an oom that never ran (find_batch's 5% rule, so a plan agrees with its own
    find_batch), the rest not run after it; a later real sweep measures them all."""
    small = [*FAST[:5], "seq_len=32", "device=cuda"]
    peak = {b: analytic(compose_spec([*small, f"batch_size={b}"])).peak_mib for b in (4, 7)}
    usable = (peak[4] + peak[7]) / 2 / (1 - MARGIN)
    proc = run_cli(["-m", "experiment=batch_scan", *small, "predict_only=true", f"gpu_memory_gib={gib_for(usable)}"],
                   tmp_path, fast=False)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(results_under(tmp_path), key=lambda r: r["config"]["batch_size"])
    assert [(r["config"]["batch_size"], r["status"]) for r in rows] == [
        (1, "predicted"), (2, "predicted"), (4, "predicted"), *[(b, "oom") for b in (7, 8, 9, 16, 32, 64)]]
    assert rows[3]["reason"].startswith(f"predicted: {peak[7]:,.0f} MiB > ") and "predict_only" in rows[3]["reason"]
    assert rows[3]["prediction"]["peak_mib"] == pytest.approx(peak[7])
    assert all(r["reason"].startswith("not run: batch_size=7 was predicted to run out of memory") for r in rows[4:])
    assert not any(results.is_terminal(r) for r in rows)
    assert not list(tmp_path.rglob("events.jsonl"))
    # the rows the job judged name the card, as a worker's would; the ladder's unrun rows name none
    assert [r["env"]["emulated_gpu_mib"] for r in rows[:4]] == [gib_for(usable) * 1024] * 4
    report = run_report([str(tmp_path), "--table", "batch"], timeout=120)
    assert f"OOM (predicted ~{peak[7]:,.0f})" in report.stdout and "TFLOP/s" not in report.stdout
    assert (tmp_path / "report" / "batch_scan.png").exists()


def test_a_cpu_point_predicted_past_the_hosts_free_memory_is_an_oom_that_never_ran(tmp_path, monkeypatch):
    """A GPU preset started on a CPU without scale=cpu (gpt2-large: 22 GiB predicted on a host of
    23 GiB) is not left to the kernel's OOM killer: its row is an oom by prediction, rerun later.
    Each rank of a multi-process CPU point counts."""
    import io

    from ablate import outcome
    from ablate.console import Progress

    spec = compose_spec(["model=gpt-nano", "device=cpu", "batch_size=4", "seq_len=16", "steps=2"])
    need = outcome.predicted(spec).peak_mib
    monkeypatch.setattr(outcome, "host_free_mib", lambda: need)  # less the 5% margin: too little
    out, prediction = outcome.outcome_of(spec, tmp_path, [], Progress("host", stream=io.StringIO()))
    assert out.status == "oom" and results.predicted_oom({"status": out.status, "reason": out.reason})
    assert f"of host memory > {need:,.0f} MiB free on this host" in out.reason and prediction.peak_mib == need
    assert not (tmp_path / "events.jsonl").exists()  # no worker ran
    ddp = compose_spec(["model=gpt-nano", "device=cpu", "batch_size=4", "seq_len=16", "parallel=ddp",
                        "parallel.nproc=2"])
    assert outcome._over_the_host(ddp, outcome.predicted(ddp), None).startswith(
        f"predicted: {2 * outcome.predicted(ddp).peak_mib:,.0f} MiB")
    monkeypatch.setattr(outcome, "host_free_mib", lambda: 2 * need)
    assert outcome._over_the_host(spec, prediction, None) is None
