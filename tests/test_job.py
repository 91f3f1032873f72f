"""ablate/job.py: the commit a run names (git_sha), from ABLATE_GIT_SHA or git."""
from __future__ import annotations


def test_ablate_git_sha_names_the_commit_whatever_git_says(monkeypatch):
    """A copy of the tree on a GPU host has no .git, or a stale one; whoever sent it names the commit
    in ABLATE_GIT_SHA."""
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
