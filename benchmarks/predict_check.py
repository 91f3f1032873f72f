"""Benchmark: the analytic memory prediction against the measured peak for gpt2 / gpt2-medium points.

    python benchmarks/predict_check.py [hydra overrides ...]   ->  benchmarks/results/<device>/predict_check.md
"""
from bench import run

if __name__ == "__main__":
    run("predict_check", report_args=["--table", "full"])
