"""Benchmark: full fine-tune, LoRA or QLoRA of Llama 3.1 8B on a 24, 16 or 8 GiB card.

    python benchmarks/fit_llama_8b.py [hydra overrides ...]   ->  benchmarks/results/<device>/fit_llama_8b.md

45 points of an 8B model are more than one short device call: measure it in parts, the rows that
matter first, e.g. the QLoRA rows on an 8 GiB card:

    python benchmarks/fit_llama_8b.py gpu_memory_gib=8 'hydra.sweeper.only=[4,5,6,7]' --page fit_llama_8b_8gib
"""
from bench import run

if __name__ == "__main__":
    run("fit_llama_8b", report_args=[])
