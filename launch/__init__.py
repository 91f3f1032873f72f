"""Turning one grid point into processes: a single worker, torchrun, or a SLURM task."""
