"""Benchmark: which combinations train Llama 3.2 1B (seq 2048, batch 16) on a 24, 16 or 8 GiB card.

    python benchmarks/fit_llama_1b.py [hydra overrides ...]   ->  benchmarks/results/<device>/fit_llama_1b.md
"""
from bench import run

if __name__ == "__main__":
    run("fit_llama_1b", report_args=[])
