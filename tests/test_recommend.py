"""analysis/recommend.py and its two readers: the report's Recommended and Setting-by-card tables and
the sweep's closing lines. Rankings on hand-made rows; then a plan over two cards of a
hand-written TinyLlama config.json through the CLI, as a user would ask "which combination trains
it on a 24 and a 16 GiB card?"."""
from __future__ import annotations

import json

from ablate import results
from analysis import compare, recommend
from analysis.load import load
from analysis.report import main
from helpers import run_cli

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
    assert answer["8 GiB card"]["Recommended"] == "nothing fits; the leanest tried needs ~9,500 MiB (Block recompute)"


def test_without_step_times_the_fewest_techniques_then_the_largest_micro_batch_win(tmp_path):
    _write(tmp_path, "a", "predicted", 24, 20000, checkpoint="block", micro=2)
    _write(tmp_path, "b", "predicted", 24, 21000, checkpoint="block", precision="bf16_pure", micro=16)
    _write(tmp_path, "c", "predicted", 24, 22000, precision="bf16_pure", micro=8)
    assert _answer(tmp_path)["24 GiB card"]["Recommended"] == "Pure bf16"  # 1 technique; then micro-batch 8 > 2
    df = load([tmp_path])
    assert "Step time (s)" not in recommend.recommendation(df, compare.varied(df))


TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_a_plan_over_two_cards_opens_with_an_answer_per_card_in_the_report_and_the_sweeps_last_lines(tmp_path):
    model = tmp_path / "tinyllama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINYLLAMA))
    proc = run_cli(["-m", "experiment=fit_llama_1b", "model=hf", f"model.config_path={model}", "predict_only=true",
                    "device=cuda", "gpu_memory_gib=24,16"], tmp_path / "out", fast=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("results under"):].splitlines()
    assert summary[1] == "recommended, per card:"
    assert [line.split(":")[0].strip() for line in summary if line.startswith("  ") and "GiB card" in line] == \
        ["24 GiB card", "16 GiB card"]
    assert not any(line.startswith("  oom:") for line in summary)  # the misfits are in the answer, not listed

    df = load([tmp_path / "out"])
    report = tmp_path / "report"
    assert main([str(tmp_path / "out"), "--out", str(report)]) == 0
    text = (report / "report.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Recommended", "## Setting by card"]  # the answer opens the report
    answer = _answer(tmp_path / "out")
    for card, cap in (("24 GiB card", 24), ("16 GiB card", 16)):
        row = answer[card]
        fits = df[(df["gpu_memory_gib"] == cap) & (df["status"] == "predicted")]
        named = {recommend.named(r, compare.varied(df)) for _, r in fits.iterrows()}
        assert row["Recommended"] in named  # a combination predicted to fit this card
        micro, steps = map(int, row["Micro-batch × steps"].split(" × "))
        assert micro * steps == 16
        peak = float(row["Peak (MiB)"].lstrip("~").split(" of ")[0].replace(",", ""))
        assert peak <= cap * 1024
        assert row["Recommended"] in text and row["Micro-batch × steps"] in text
    by_card = text[text.index("## Setting by card"):text.index("## All runs")]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in by_card.splitlines()
             if line.startswith("|") and not line.startswith("|:") and not line.startswith("|-")]
    assert table[0] == ["Setting", "24 GiB card", "16 GiB card"]  # the card is a column ...
    assert "GiB card (emulated)" not in text  # ... never a technique in a row's label
    assert len(table) == 1 + 6  # the experiment's 6 combinations, once each
