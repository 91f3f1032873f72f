"""Benchmark: gpt2-large, one technique added per rung (conf/experiment/gpt2_large_ladder.yaml): the ladder table.

    python benchmarks/gpt2_large_ladder.py [hydra overrides ...]   ->  benchmarks/results/<device>/gpt2_large_ladder.md
"""
from bench import run

if __name__ == "__main__":
    run("gpt2_large_ladder", report_args=["--ladder", "--table", "setting", "--table", "full"])
