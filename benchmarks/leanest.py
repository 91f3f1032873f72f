"""Benchmark: the leanest combinations that still train against the baseline for gpt2-large and gpt2-xl.

    python benchmarks/leanest.py [hydra overrides ...]   ->  benchmarks/results/<device>/leanest.md
"""
from bench import run

if __name__ == "__main__":
    run("leanest", report_args=["--table", "setting", "--table", "full"], defaults=("model=gpt2-large,gpt2-xl",))
