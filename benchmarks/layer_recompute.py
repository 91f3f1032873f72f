"""Benchmark: a small transformer with one layer type recomputed at a time: setting and full tables.

    python benchmarks/layer_recompute.py [hydra overrides ...]   ->  benchmarks/results/<device>/layer_recompute.md
"""
from bench import run

if __name__ == "__main__":
    run("layer_recompute", report_args=[])
