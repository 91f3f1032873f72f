"""ablate: ablation sweeps of memory-saving techniques for GPT-2-class training."""

__version__ = "0.1.0"
