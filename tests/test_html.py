"""analysis.html: one self-contained report page, checked as text and rendered in headless Chromium."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from analysis.html import Section, is_number, page, status_class, write  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def _sections() -> list[Section]:
    memory = pd.DataFrame({
        "optimizer": ["adamw", "sgd", "adamw-8bit"],
        "Peak allocated (MiB)": ["1,234.5", "OOM", "987.0"],
        "Tokens/s": ["12,345", "", "11,002"],
        "Status": ["ok", "oom: CUDA out of memory", "ok"],
    })
    speed = pd.DataFrame({
        "precision": ["fp32", "bf16 <script>alert(1)</script>"],
        "Iteration time (ms)": ["12.5", "7.25"],
        "Change": ["+0.0%", "-42.0%"],
        "Status": ["ok", "invalid: needs CUDA"],
    })
    return [Section("Memory by optimizer", memory, "MiB = 2^20 bytes. <b>not bold</b>"),
            Section("Speed & precision", speed)]


def _png(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4, 3), dpi=80)
    ax.bar(["adamw", "sgd", "adamw-8bit"], [1234.5, 0, 987.0], color=["#4c72b0", "#dd8452", "#55a868"])
    ax.set_ylabel("Peak allocated (MiB)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def test_number_and_status_cells():
    assert all(map(is_number, ["1,234.5", "-3%", "+12", "12.5 ± 0.3", "0"]))
    assert not any(map(is_number, ["", "nan", "inf", "adamw", "OOM", "1.2.3"]))
    assert status_class("OOM") == status_class("oom: CUDA out of memory") == "warn"
    assert status_class("OOM (predicted ~20,236)") == "warn" and status_class("~2,660 (predicted)") == ""
    assert status_class("invalid: needs CUDA") == "warn" and status_class("error: boom") == "err"
    assert status_class("ok") == status_class("1,234.5") == ""


def test_page_is_self_contained_and_escaped(tmp_path):
    image = _png(tmp_path / "peak_memory.png")
    text = page("Ablation <report>", _sections(), [image])
    assert text.startswith("<!DOCTYPE html>") and "<style>" in text
    assert "<h1>Ablation &lt;report&gt;</h1>" in text
    assert "<h2>Memory by optimizer</h2>" in text and "<h2>Speed &amp; precision</h2>" in text
    assert '<td class="num">1,234.5</td>' in text and '<td class="num">-42.0%</td>' in text
    assert '<td class="warn num">OOM</td>' in text and '<td class="warn">oom: CUDA out of memory</td>' in text
    assert '<td class="warn">invalid: needs CUDA</td>' in text and "<td>adamw</td>" in text
    assert '<th class="num">Peak allocated (MiB)</th>' in text and "<th>optimizer</th>" in text
    assert '<p class="note">MiB = 2^20 bytes. &lt;b&gt;not bold&lt;/b&gt;</p>' in text
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert text.count('src="data:image/png;base64,') == 1 and "<figcaption>peak_memory</figcaption>" in text
    assert "http://" not in text and "https://" not in text
    assert re.findall(r'(?:src|href)="(?!data:)', text) == [] and "@import" not in text and "url(" not in text
    out = write(tmp_path / "sub" / "report.html", text)
    assert out.read_text(encoding="utf-8") == text


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (root only)."""
    if not os.path.exists(CHROMIUM):
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            pytest.skip(f"{CHROMIUM} missing and cannot be installed (needs root and apt-get)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        start = time.monotonic()
        run = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                             env=env, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:  # a stale package list: refresh once and retry
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            run = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                                 env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        print(f"installed chromium in {time.monotonic() - start:.0f} s")
    return CHROMIUM


def _browse(binary: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile{len(list(tmp.glob('profile*')))}"
    return subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp, env={**os.environ, "HOME": str(tmp)})


def test_page_renders_in_headless_chromium(chromium, tmp_path):
    html_file = write(tmp_path / "report.html",
                      page("Ablation report", _sections(), [_png(tmp_path / "peak_memory.png")]))
    shot = tmp_path / "page.png"
    run = _browse(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1200,900", html_file.as_uri())
    assert shot.is_file(), f"no screenshot (rc={run.returncode}): {run.stderr[-2000:]}"
    assert shot.stat().st_size > 10_000
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (900, 1200) and pixels[..., :3].std() > 0.01
    dom = _browse(chromium, tmp_path, "--dump-dom", html_file.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    for text in ("Memory by optimizer", "1,234.5", "12,345", "oom: CUDA out of memory", "-42.0%",
                 "invalid: needs CUDA", "&lt;script&gt;alert(1)&lt;/script&gt;", "peak_memory"):
        assert text in dom.stdout, text
    assert dom.stdout.count("<table>") == 2 and "data:image/png;base64," in dom.stdout


def test_report_command_html_opens_in_chromium(chromium, tmp_path, capsys):
    """The whole path: result files -> `python -m analysis.report --format html` -> a browser."""
    from ablate import results
    from analysis.report import main

    choices = {"model": "gpt-nano", "precision": "fp32", "accumulation": "none", "checkpoint": "none",
               "offload": "none", "parallel": "single", "data": "synthetic"}
    for opt, peak, status in (("adamw", 120.0, "ok"), ("sgd", 80.0, "ok"), ("adafactor", None, "oom")):
        metrics = {"peak_allocated_mib": peak, "train_latency_s": 2.0, "iter_time_ms": 20.0, "loss_final": 3.0,
                   "losses": [4.0, 3.5, 3.0]} if peak else {}
        r = results.make(opt, status, None if peak else "CUDA out of memory", {**choices, "optimizer": opt},
                         {"batch_size": 8}, [], metrics=metrics)
        results.write_json(tmp_path / "runs" / opt / "result.json", r)
    assert main([str(tmp_path / "runs"), "--format", "html", "--out", str(tmp_path / "report")]) == 0
    page_path = tmp_path / "report" / "report.html"
    assert capsys.readouterr().out == f"{page_path}\n"  # the page's path, not its megabytes
    assert page_path.read_text().startswith("<!DOCTYPE html>")
    dom = _browse(chromium, tmp_path, "--dump-dom", page_path.as_uri())
    assert dom.returncode == 0
    for text in ("Baseline (batch size = 8)", "+ SGD", "OOM", "oom: CUDA out of memory", "data:image/png;base64,"):
        assert text in dom.stdout, text
