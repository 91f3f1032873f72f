"""Benchmark: full-parameter training of Llama 3.1 8B and Mistral 7B on a 24 or 16 GiB card.

    python benchmarks/full_7b.py [hydra overrides ...]   ->  benchmarks/results/<device>/full_7b.md
"""
from bench import run

if __name__ == "__main__":
    run("full_7b", report_args=[])
