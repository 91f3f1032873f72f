"""Benchmark: gpt2 at seq 1024 in bf16, torch.compile off and on: tokens/s and MFU.

    python benchmarks/gpt2_throughput.py [hydra overrides ...]   ->  benchmarks/results/<device>/gpt2_throughput.md
"""
from bench import run

if __name__ == "__main__":
    run("gpt2_throughput", report_args=["--table", "full"])
