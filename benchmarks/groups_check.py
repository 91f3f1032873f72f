"""Benchmark: the analytic prediction against the measured peak for the adapters, attention kernels,
tiled MLP, overlapped offload, low-memory optimizers and kernel losses, one at a time on a 4-layer
Llama 3.2 1B.

    python benchmarks/groups_check.py [hydra overrides ...]   ->  benchmarks/results/<device>/groups_check.md
"""
from bench import run

if __name__ == "__main__":
    run("groups_check", report_args=["--table", "full"])
