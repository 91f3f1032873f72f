"""The repository carries its own design: docs/architecture.md names every part of the result
contract that ablate/results.py writes (every key of every section, every status, every config
group), so a key added to the code without a line in the document fails here; the documentation
site (mkdocs.yml over docs/) builds with --strict, so a broken link or anchor, or a page left out
of its nav, fails here too; and no tracked file points outside the repository at a sibling `shared`
folder, which a clone does not have."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from ablate import results
from ablate.events import PHASES
from ablate.schema import GROUPS
from helpers import ROOT

ARCHITECTURE = ROOT / "docs" / "architecture.md"
MKDOCS = ROOT / "mkdocs.yml"
# Spelt in two parts so that this file, once tracked, does not hold what it looks for.
OUTSIDE = ".." + "/shared"


def named_in_backticks(text: str) -> set[str]:
    """Every `name` the text puts in backticks, and the last part of a dotted one
    (`metrics.mfu` names mfu too)."""
    named = set(re.findall(r"`([^`\n]+)`", text))
    return named | {n.rsplit(".", 1)[1] for n in named if "." in n}


def contract_keys() -> dict[str, list[str]]:
    """What results.make writes, section by section, read off a result it makes (so a key added
    to the writer is a key this test asks the document for), with what the job adds beside it."""
    made = results.make("0" * 12, "ok", None, {g: None for g in GROUPS}, {}, [])
    return {
        "top level": [*made, "reused_from"],  # reused_from: ablate/job.py, on a point found done elsewhere
        "choices": list(made["choices"]),
        "metrics": list(made["metrics"]),
        "prediction": list(made["prediction"]),
        "env": list(made["env"]),
        "timing": list(made["timing"]),
        "timing.phases_s": [name for name, _, _ in PHASES],
        "artifacts": list(made["artifacts"]),
        "status": list(results.STATUSES),
    }


def test_architecture_names_every_key_status_and_group_of_the_result_contract():
    assert ARCHITECTURE.is_file(), "docs/architecture.md is missing"
    named = named_in_backticks(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = {section: [k for k in keys if k not in named] for section, keys in contract_keys().items()}
    missing = {section: keys for section, keys in missing.items() if keys}
    assert not missing, f"docs/architecture.md does not name (in backticks): {missing}"


def test_architecture_names_every_config_group_of_the_schema():
    named = named_in_backticks(ARCHITECTURE.read_text(encoding="utf-8")) if ARCHITECTURE.is_file() else set()
    missing = [g for g in GROUPS if g not in named]
    assert not missing, f"docs/architecture.md does not name the groups {missing}"


def test_the_site_checks_links_anchors_and_orphan_pages_and_lists_every_page():
    """Under strict, mkdocs fails only on what it warns of: these settings make it warn of a page
    missing from nav, a link to no page or anchor, and an absolute link."""
    config = yaml.safe_load(MKDOCS.read_text(encoding="utf-8"))
    assert config["strict"] is True and config["docs_dir"] == "docs"
    checks = ("omitted_files", "not_found", "absolute_links", "unrecognized_links", "anchors")
    assert {k: config["validation"].get(k) for k in checks} == dict.fromkeys(checks, "warn")
    listed = [page for entry in config["nav"] for page in entry.values()]
    assert sorted(listed) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def test_the_documentation_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--config-file",
                           str(MKDOCS), "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_at_a_shared_folder_outside_the_repository():
    """Every text file git tracks (binary ones, which hold a NUL byte, aside), and where a tracked
    path is a symbolic link, the path it points at."""
    offenders = []
    for name in tracked_files():
        path = ROOT / name
        if path.is_symlink():
            if OUTSIDE in os.readlink(path):
                offenders.append(f"{name} -> {os.readlink(path)}")
            continue
        if not path.is_file():  # deleted in the work tree, or a submodule's folder
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        offenders += [f"{name}:{i}" for i, line in enumerate(data.decode(errors="replace").splitlines(), 1)
                      if OUTSIDE in line]
    assert not offenders, f"these point outside the repository at {OUTSIDE}: {offenders}"
