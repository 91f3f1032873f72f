"""Pure pieces: outcome classification, the result file, the index, the peak table, FLOPs, timing."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from ablate import results
from ablate.events import EventReader, EventWriter
from ablate.hardware import flops_per_token, peak_tflops
from ablate.measure import percentiles, traced_step
from ablate.worker import classify as classify_exception
from ablate.techniques import Invalid
from launch.local import classify


def test_outcome_classification(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("Traceback...\nValueError: boom\n")
    ok = [{"event": "result", "metrics": {"iter_time_ms": 1.0}, "env": {}}]
    assert classify(0, False, 10, ok, log).status == "ok"
    assert classify(0, True, 10, ok, log).status == "timeout"  # the limit wins over anything reported
    oom = [{"event": "failure", "status": "oom", "reason": "CUDA out of memory"}]
    assert (classify(1, False, 10, oom, log).status, classify(1, False, 10, oom, log).reason) == \
        ("oom", "CUDA out of memory")
    killed = classify(-signal.SIGKILL, False, 10, [], log)
    assert killed.status == "error" and "SIGKILL" in killed.reason
    crashed = classify(3, False, 10, [], log)
    assert crashed.status == "error" and "code 3" in crashed.reason and "ValueError: boom" in crashed.reason


def test_rank_failures_name_the_root_cause(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("")
    gloo = {"event": "failure", "rank": 0, "status": "error", "reason": "RuntimeError: Connection closed by peer"}
    launcher = {"event": "launcher", "failures": [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": -9},
                                                   {"rank": 2, "exitcode": -15}]}
    killed = classify(1, False, 10, [gloo, launcher], log, world_size=3)
    assert (killed.status, killed.reason) == ("error", "rank 1 killed by SIGKILL (the host's out-of-memory "
                                                       "killer sends SIGKILL)")
    oom = {"event": "failure", "rank": 1, "status": "oom", "reason": "CUDA out of memory"}
    assert classify(1, False, 10, [gloo, oom, launcher], log, world_size=3).reason == "rank 1: CUDA out of memory"
    crashed = classify(1, False, 10, [gloo, {"event": "launcher", "failures": [{"rank": 0, "exitcode": 1}]}], log,
                       world_size=2)
    assert crashed.reason == "rank 0: RuntimeError: Connection closed by peer"
    # A rank that exits with a code of its own, reporting nothing: its exit and the log's last line.
    exited = {"event": "launcher", "failures": [{"rank": 1, "exitcode": 3}]}
    assert classify(1, False, 10, [exited], log, world_size=2).reason == "rank 1 ended with exit code 3 without a result"
    log.write_text("SystemExit: bad rank\n\n")
    assert classify(1, False, 10, [exited], log, world_size=2).reason == \
        "rank 1 ended with exit code 3 without a result: SystemExit: bad rank"
    assert classify(3, False, 10, [], tmp_path / "no.log").reason == "worker exited with code 3 without a result"


def test_a_lost_node_is_named_by_its_ranks_hosts(tmp_path):
    """Two nodes of two ranks each; the second node vanishes (its torchrun with it): only the first
    node's ranks and launcher speak, and their peers' address is all their errors name."""
    log = tmp_path / "worker.log"
    log.write_text("")
    started = [{"event": "started", "rank": r, "pid": 100 + r, "host": f"n{1 + r // 2}"} for r in range(4)]
    gloo = {"event": "failure", "rank": 0, "status": "error", "reason": "RuntimeError: Connection closed by peer [10.0.0.2]"}
    n1 = {"event": "launcher", "host": "n1", "failures": [{"rank": 0, "exitcode": 1}, {"rank": 1, "exitcode": 1}]}
    lost = classify(1, False, 10, [*started, gloo, n1], log, world_size=4)
    assert (lost.status, lost.reason) == ("error", "node n2 lost: ranks 2, 3 stopped without a word; "
                                                   "rank 0: RuntimeError: Connection closed by peer [10.0.0.2]")
    # The second node's torchrun survived and saw its rank killed: that rank, as on one node.
    n2 = {"event": "launcher", "host": "n2", "failures": [{"rank": 3, "exitcode": -9}]}
    assert classify(1, False, 10, [*started, gloo, n1, n2], log, world_size=4).reason.startswith("rank 3 killed by SIGKILL")
    # One node: its launcher spoke, so no rank of it is lost, even one it did not list.
    one = [e for e in started if e["host"] == "n1"]
    assert classify(1, False, 10, [*one, gloo, {**n1, "failures": [{"rank": 0, "exitcode": 1}]}], log,
                    world_size=2).reason == "rank 0: RuntimeError: Connection closed by peer [10.0.0.2]"


def test_exception_classification():
    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory. Tried"))[0] == "oom"
    assert classify_exception(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))[0] == "oom"
    assert classify_exception(Invalid("batch_size=3 ..."))[0] == "invalid"
    assert classify_exception(KeyError("x")) == ("error", "KeyError: 'x'")


def test_make_fills_every_key_with_null():
    r = results.make("abc", "timeout", "slow", {}, {}, [])
    assert all(v is None for v in r["metrics"].values()) and all(v is None for v in r["env"].values())
    with pytest.raises(AssertionError):
        results.make("abc", "crashed", None, {}, {}, [])


def test_readme_explains_every_field_of_the_result_contract():
    """Users read result.json through the README's field table: a metric, env key or status added
    to the contract without a line there fails here."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## What each number means", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9_.]+)`", section))
    named |= {n.split(".", 1)[1] for n in named if n.count(".") == 1}  # `env.emulated_gpu_mib`
    named |= {n + suffix for n in named for suffix in ("_p10", "_p90")}  # "`iter_time_ms` (+ `_p10`, `_p90`)"
    missing = [k for k in (*results.METRIC_KEYS, *results.STATUSES, "emulated_gpu_mib") if k not in named]
    assert not missing, f"README's 'What each number means' does not explain {missing}"


def test_write_json_is_atomic_and_rejects_nan(tmp_path):
    path = tmp_path / "result.json"
    results.write_json(path, {"a": 1})
    with pytest.raises(ValueError):
        results.write_json(path, {"a": float("nan")})
    assert json.loads(path.read_text()) == {"a": 1}  # the old file survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary left behind


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_result_is_as_readable_as_any_other_file_the_umask_allows(tmp_path, umask):
    """mkstemp makes 0600 files: a teammate's report on a shared directory could not read them."""
    old = os.umask(umask)
    try:
        results.write_json(tmp_path / "result.json", {"a": 1})
        (tmp_path / "other.txt").write_text("x")
    finally:
        os.umask(old)
    mode = (tmp_path / "result.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "other.txt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_run_id_is_stable_and_order_independent():
    assert results.run_id({"a": 1, "b": [1, 2]}) == results.run_id({"b": [1, 2], "a": 1})
    assert results.run_id({"a": 1}) != results.run_id({"a": 2})


def test_index_returns_only_terminal_existing_results(tmp_path):
    index = results.Index(tmp_path)
    for rid, status in (("ok1", "ok"), ("err1", "error"), ("oom1", "oom")):
        path = tmp_path / rid / "result.json"
        results.write_json(path, results.make(rid, status, None, {}, {"batch_size": 4, "seq_len": 16}, []))
        index.record(rid, path)
    assert index.terminal("ok1")[1]["status"] == "ok" and index.terminal("oom1")
    assert index.terminal("err1") is None  # errors may be transient: run again
    assert index.terminal("missing") is None
    (tmp_path / "ok1" / "result.json").unlink()
    assert index.terminal("ok1") is None


def test_peak_table_is_precision_aware():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA A10G", "bf16") == 125.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops("Mystery GPU", "bf16") is None
    assert peak_tflops("Mystery GPU", "bf16", override=100) == 100.0
    assert peak_tflops(None, "fp32") is None


def test_flops_per_token_matches_palm_for_gpt2():
    # GPT-2 124M: N without wpe = 124,439,808 - 1024 * 768; L=12, H=768, T=1024.
    n = 124_439_808 - 1024 * 768
    assert flops_per_token(n, 12, 768, 1024) == 6 * n + 12 * 12 * 768 * 1024


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


def test_event_reader_waits_for_complete_lines(tmp_path):
    writer, reader = EventWriter(tmp_path), EventReader(tmp_path)
    writer.emit("phase", phase="init", x=float("inf"))
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "prog')
    (event,) = reader.read_new()
    assert event.pop("t") == pytest.approx(time.time(), abs=60)  # when it was written: timing.phases_s
    assert event == {"event": "phase", "rank": 0, "phase": "init", "x": None}
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('ress"}\n')
    assert reader.read_new() == [{"event": "progress"}]


def test_ablate_git_sha_names_the_commit_whatever_git_says(monkeypatch):
    """A copy of the tree on a GPU host has no .git, or a stale one; the session that sent it names
    the commit."""
    import subprocess

    from ablate import job

    monkeypatch.setenv("ABLATE_GIT_SHA", "abc1234")
    assert job.git_sha.__wrapped__() == "abc1234"  # here, inside this repository's git
    monkeypatch.delenv("ABLATE_GIT_SHA")
    assert job.git_sha.__wrapped__() != "abc1234"

    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(job.subprocess, "run", no_git)
    assert job.git_sha.__wrapped__() is None
