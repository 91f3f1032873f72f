"""Benchmark: the longest sequence Llama 3.2 1B (full) and Llama 3.1 8B (QLoRA) train on a 24 or 80 GiB card.

    python benchmarks/long_context.py [hydra overrides ...]   ->  benchmarks/results/<device>/long_context.md
"""
from bench import run

if __name__ == "__main__":
    run("long_context", report_args=[])
