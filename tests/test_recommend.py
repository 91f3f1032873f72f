"""analysis/recommend.py: which combination each card gets, on hand-made rows. The whole path (a
hand-written config.json planned over two cards through the CLI, the sweep's last lines and the
rendered report) is README's recipe, run by tests/test_readme.py."""
from __future__ import annotations

from ablate import results
from analysis import compare, recommend
from analysis.load import load

BASE = {"model": "gpt2", "data": "synthetic", "optimizer": "adamw", "precision": "fp32", "accumulation": "none",
        "checkpoint": "none", "offload": "none", "parallel": "single", "loss": "standard"}


def _write(root, name, status, card, peak, step=None, measured=False, micro=None, **choices):
    config = {"batch_size": 16, "gpu_memory_gib": card, "accumulation": {"steps": 1}}
    metrics = {"max_batch_size": micro} if micro else {}
    if measured:
        metrics.update(peak_allocated_mib=peak, iter_time_ms=step * 1000, losses=[3.0, 2.9], loss_final=2.9)
    prediction = {"peak_mib": peak, "breakdown_mib": None, "method": "analytic", "step_time_s": None if measured else step}
    reason = None if status in ("ok", "predicted") else "predicted: no micro-batch fits; not run (predict_only)"
    r = results.make(name, status, reason, {**BASE, **choices}, config, [], metrics=metrics, prediction=prediction,
                     env={"world_size": 1, "emulated_gpu_mib": card * 1024})
    results.write_json(root / name / "result.json", r)


def _answer(root) -> dict:
    df = load([root])
    table = recommend.recommendation(df, compare.varied(df))
    return {row["Card"]: row for _, row in table.iterrows()}


def test_the_fastest_that_fits_wins_and_a_near_tie_goes_to_fewer_techniques(tmp_path):
    _write(tmp_path, "a", "oom", 16, 20000, step=1.0)  # fastest, but does not fit
    _write(tmp_path, "b", "predicted", 16, 15000, step=1.50, checkpoint="block")
    _write(tmp_path, "c", "predicted", 16, 12000, step=1.49, checkpoint="block", precision="bf16_pure")  # tie
    _write(tmp_path, "d", "predicted", 16, 9000, step=2.5, checkpoint="block", optimizer="adamw8bit")
    card = _answer(tmp_path)["16 GiB card"]
    assert card["Recommended"] == "Block recompute"  # within 2% of the fastest, one technique fewer
    assert card["Peak (MiB)"] == "~15,000 of 16,384 (predicted)" and card["Step time (s)"] == "~1.50 (predicted)"
    assert card["Runners-up"].startswith("Pure bf16 + Block recompute (16 × 1, ~12,000 MiB, ~1.49 s)")


def test_a_measured_time_outranks_a_prediction_and_a_card_where_nothing_fits_says_how_far(tmp_path):
    _write(tmp_path, "a", "ok", 24, 20000, step=3.0, measured=True)  # predicted fast, measured slow
    _write(tmp_path, "b", "predicted", 24, 18000, step=2.0, checkpoint="block", micro=4)
    _write(tmp_path, "c", "oom", 8, 20000)
    _write(tmp_path, "d", "oom", 8, 9500, checkpoint="block")
    answer = _answer(tmp_path)
    assert list(answer) == ["24 GiB card", "8 GiB card"]  # the largest first
    assert answer["24 GiB card"]["Recommended"] == "Block recompute"
    assert answer["24 GiB card"]["Micro-batch × steps"] == "4 × 4"  # find_batch's micro-batch, 16 in all
    assert answer["8 GiB card"]["Recommended"] == (  # by find_batch's rule: 95% of what the card leaves usable
        "nothing fits; the leanest tried, Block recompute, needs ~9,500 MiB: over the 7,296 MiB a point may use there")


def test_without_step_times_the_fewest_techniques_then_the_largest_micro_batch_win(tmp_path):
    _write(tmp_path, "a", "predicted", 24, 20000, checkpoint="block", micro=2)
    _write(tmp_path, "b", "predicted", 24, 21000, checkpoint="block", precision="bf16_pure", micro=16)
    _write(tmp_path, "c", "predicted", 24, 22000, precision="bf16_pure", micro=8)
    assert _answer(tmp_path)["24 GiB card"]["Recommended"] == "Pure bf16"  # 1 technique; then micro-batch 8 > 2
    df = load([tmp_path])
    assert "Step time (s)" not in recommend.recommendation(df, compare.varied(df))
