"""ablate: ablation sweeps of memory-saving techniques for GPT-2-class training."""
import logging

__version__ = "0.1.0"

# Import-time warnings meant for torchao's developers, not for ablate's users, printed in every
# process that imports torchao (each worker of a sweep): torch 2.13 deprecating torchao's Enum
# registrations ("register_constant() on Enum subclasses is deprecated"), and torchao's prebuilt
# kernels for another Python or GPU (mxfp8, cutlass) that it falls back from and ablate never uses.
# Errors still print. Setting a level imports nothing (the CLI's start stays torch-free).
for _name in ("torch.utils._pytree", "torchao"):
    logging.getLogger(_name).setLevel(logging.ERROR)
