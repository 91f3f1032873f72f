"""Benchmark: one technique at a time against the baseline, and all at once: setting, full and marginal-effects tables.

    python benchmarks/single_gpu_techniques.py [hydra overrides ...]   ->  benchmarks/results/<device>/single_gpu_techniques.md
"""
from bench import run

if __name__ == "__main__":
    run("single_gpu_techniques", report_args=[])
