"""Every option of the five technique groups through the real CLI on CPU: each point is ok or
invalid with a reason, never an error."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from ablate.groups import OFF, TECHNIQUE_GROUPS
from ablate.schema import GROUPS
from helpers import CONF, FAST, ROOT, results_under
from tests import cli_zygote

# Every technique group but parallel, whose options start several ranks each (tests/test_parallel.py).
# On a CPU these can only be invalid rows, each for a stated reason.
EXPECTED_INVALID = {("offload", "optimizer"): "needs a CUDA device",
                    ("optimizer", "adamw_fp8"): "compute capability >= 8.9", ("precision", "fp8"): "compute capability >= 8.9",
                    ("loss", "liger"): "on a CUDA GPU; device=cpu has none",
                    ("loss", "cce"): "loss.impl=torch_compile is its CPU path",
                    ("kernels", "liger"): "kernels=liger takes transformers' Llama family",
                    **{("attention", k): "needs a CUDA GPU, and device=cpu has none"
                       for k in ("flash", "efficient", "cudnn", "flex")}}
# Longer sequences for recompute, so that activations, not optimizer states, make the peak.
EXTRA = {"checkpoint": ["seq_len=32", "batch_size=16"]}
# Swept under -m slow: the optimizer group's options from other packages beyond bitsandbytes and
# torchao (each imports its package, lomo-optim transformers too), which tripled the optimizer
# sweep, the default suite's longest; each option's own tests run it through the CLI as well.
SLOW_OPTIONS = {"optimizer": ("adalomo", "adam_mini", "apollo", "apollo_mini", "galore", "galore8bit", "lomo",
                              # torchao's and torch's newer steps, each trained in its own file's default tests
                              # (test_lowbit_optimizers, test_muon)
                              "adamw4bit", "adamw8bit_ao", "adamw_bf16", "muon"),
                # ... and the long-context and GPU-kernel options, each in its own file's default tests
                # (test_attention, test_tiling, test_offload_overlap, test_kernel_options)
                "attention": ("cudnn", "eager", "efficient", "flash", "flex", "math"), "tiling": ("mlp",),
                "kernels": ("liger",), "loss": ("cce", "liger"), "offload": ("activations_overlap",)}
# Slow options whose rows their own files' tests sweep through the CLI (under -m slow as well):
# left out of the slow sweep below, which would run each a second time.
ELSEWHERE = {"optimizer": ("apollo", "apollo_mini", "galore", "galore8bit",  # test_projected_optimizers
                           "adamw4bit", "adamw8bit_ao")}  # test_lowbit_optimizers
# A group left with its do-nothing option alone is in every other group's sweep already.
SWEPT = tuple(g for g in TECHNIQUE_GROUPS if g != "parallel"
              and {p.stem for p in (CONF / g).glob("*.yaml")} - set(SLOW_OPTIONS.get(g, ())) != {OFF[g]})
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    out = tmp_path_factory.mktemp("techniques")

    def sweep(group: str) -> subprocess.CompletedProcess:
        options = ",".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")
                                  if p.stem not in SLOW_OPTIONS.get(group, ())))
        return cli_zygote.run(["-m", f"{group}={options}", *FAST, "batch_size=8", *EXTRA.get(group, []),
                               f"out_dir={out}", f"hydra.sweep.dir={out}/{group}"], ONE_THREAD, ROOT, 1800)

    # Five multiruns, one per group, two at a time on two cores; a pool rather than fixed pairs, so
    # a short group does not leave a core idle while its partner finishes. One intra-op thread per
    # worker: two workers with a thread per core each fight over the cores (measured on two cores:
    # seven optimizer points take 25 s alone, 62 s beside another such sweep, 25 s beside it
    # with one thread each; alone, one thread is as fast as two at these sizes).
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(SWEPT, pool.map(sweep, SWEPT)))
    for group, proc in done.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow  # the sweeps take 80 s on two cores; each option's own tests run it in the default suite
@pytest.mark.parametrize("group", SWEPT)
def test_every_option_is_ok_or_invalid_with_a_reason(sweeps, group):
    rows = {r["choices"][group]: r for r in results_under(sweeps / group)}
    assert set(rows) | set(SLOW_OPTIONS.get(group, ())) == {p.stem for p in (CONF / group).glob("*.yaml")}
    ok_or_invalid(group, rows)


@pytest.mark.slow
@pytest.mark.parametrize("group", SLOW_OPTIONS)
def test_every_slow_option_is_ok_or_invalid_with_a_reason(group, tmp_path):
    options = [o for o in SLOW_OPTIONS[group] if o not in ELSEWHERE.get(group, ())]
    proc = cli_zygote.run(["-m", f"{group}={','.join(options)}", *FAST, "batch_size=8", *EXTRA.get(group, []),
                           f"out_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/{group}"], dict(os.environ), ROOT, 1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["choices"][group]: r for r in results_under(tmp_path / group)}
    assert set(rows) == set(options)
    ok_or_invalid(group, rows)


def test_the_options_left_out_of_the_slow_sweep_are_swept_through_the_cli_by_their_own_tests():
    from tests.test_projected_optimizers import OPTIONS

    lowbit = (ROOT / "tests" / "test_lowbit_optimizers.py").read_text()
    assert '"optimizer=adamw4bit,adamw8bit_ao"' in lowbit
    assert set(ELSEWHERE["optimizer"]) == {*OPTIONS, "adamw4bit", "adamw8bit_ao"}


def ok_or_invalid(group: str, rows: dict) -> None:
    for option, row in rows.items():
        expected = EXPECTED_INVALID.get((group, option))
        if expected:
            assert row["status"] == "invalid" and expected in row["reason"], (option, row["reason"])
        else:
            assert row["status"] == "ok", (option, row["status"], row["reason"])
            assert row["metrics"]["loss_final"] > 0 and row["metrics"]["breakdown_mib"]["params"] > 0
        assert set(row["choices"]) == set(GROUPS)


@pytest.mark.slow  # the same sweeps
def test_the_sweep_shows_the_techniques_effects(sweeps):
    def metrics(group: str, option: str) -> dict:
        (row,) = [r for r in results_under(sweeps / group) if r["choices"][group] == option]
        return row["metrics"]

    acts = lambda group, option: metrics(group, option)["breakdown_mib"]["activations"]  # noqa: E731
    assert metrics("accumulation", "x4")["peak_allocated_mib"] < metrics("accumulation", "none")["peak_allocated_mib"]
    assert acts("accumulation", "x4") < acts("accumulation", "none")
    assert acts("checkpoint", "block") < acts("checkpoint", "none")
    assert metrics("optimizer", "sgd")["breakdown_mib"]["optimizer"] == 0
    assert metrics("precision", "bf16_pure")["breakdown_mib"]["params"] * 2 == \
        metrics("precision", "fp32")["breakdown_mib"]["params"]
