"""Benchmark: gpt2-xl under FSDP1, batch sizes until OOM, then + block recompute, then + prefetch pre: the batch tables.

    python benchmarks/gpt2_xl_fsdp_batch_scan.py [hydra overrides ...]   ->  benchmarks/results/<device>/gpt2_xl_fsdp_batch_scan.md
"""
from bench import run

if __name__ == "__main__":
    run("gpt2_xl_fsdp_batch_scan", report_args=["--table", "batch", "--table", "full"])
